"""Layer: engine. peft's LoRA adapters built on the meta device get peft's own initialization.

A LoRA adapter is two ``nn.Linear`` (A and B) inside a peft ``LoraLayer``; peft starts A
from a Kaiming (or Gaussian) draw and B at zero, so the adapted model starts equal to the
base. Built on the meta device (the strategy's default at stages 2/3), the two Linears sit
inside a Hugging Face model, whose ``_init_weights`` ``materialize`` would give them: B
would start random and the model would not start from the base. So ``materialize`` asks
here first: for the A and B of each adapter, peft's ``reset_lora_parameters`` with the
adapter's ``init_lora_weights`` (read from the ``peft_config`` of the ``PeftModel`` that
holds it), once per adapter, over whole tensors (``whole``: engine/materialize.py's
``_whole_tensors``). Initializations that read the base weights (PiSSA, OLoRA, LoftQ, EVA,
...) cannot run on a model that has no weights yet: they are refused with the fix.
"""

from __future__ import annotations

import sys
from collections.abc import Callable
from contextlib import AbstractContextManager, ExitStack
from typing import Any

from torch import nn

from zeropp_strategy.errors import UsageError

__all__ = ["lora_inits"]

_ON_META = (True, False, "gaussian")  # peft's initializations that need no base weights


def lora_inits(root: nn.Module,
               whole: Callable[[nn.Module], AbstractContextManager]) -> dict[int, Callable[[nn.Module], None]]:
    """id(an adapter's A or B Linear) -> ``init(module)`` running peft's initialization of
    that adapter (the first call; later calls do nothing), in the form of ``materialize``'s
    per-module initializers. Empty without peft or without LoRA layers."""
    if "peft" not in sys.modules:  # no LoRA layer exists without peft imported (0.3 s of import saved)
        return {}
    from peft.tuners.lora import LoraLayer
    configs: dict[str, Any] = {}
    for m in root.modules():
        found = getattr(m, "peft_config", None)
        if isinstance(found, dict):
            configs.update(found)
    out: dict[int, Callable[[nn.Module], None]] = {}
    for layer in root.modules():
        if not isinstance(layer, LoraLayer):
            continue
        for adapter in list(layer.lora_A.keys()):
            init = getattr(configs.get(adapter), "init_lora_weights", True)
            if init not in _ON_META:
                raise UsageError(
                    f"LoRA adapter {adapter!r} has init_lora_weights={init!r}, which reads the base weights, but the "
                    "model was built on the meta device (ZeroConfig.meta_init, stages 2/3), where they do not exist "
                    "yet", "use init_lora_weights=True or 'gaussian', or build the model for real with "
                    "ZeroPPStrategy(meta_init=False) (init_module(empty_init=False))")
            a, b = layer.lora_A[adapter], layer.lora_B[adapter]
            reset = _Once(layer, adapter, init, (a, b), whole)
            out[id(a)] = out[id(b)] = reset
    return out


class _Once:
    """peft's initialization of one adapter's A and B, run by the first of the two modules
    ``materialize`` reaches, over both whole tensors. ``done`` then tells ``materialize`` to
    leave the second alone: wrapping it in whole tensors again would write back a fresh
    uninitialized tensor over the values peft drew."""

    def __init__(self, layer: Any, adapter: str, init: Any, linears: tuple[nn.Module, ...],
                 whole: Callable[[nn.Module], AbstractContextManager]) -> None:
        self.layer, self.adapter, self.init, self.linears, self.whole = layer, adapter, init, linears, whole
        self.done = False

    def __call__(self, module: nn.Module) -> None:
        if self.done:
            return
        self.done = True
        with ExitStack() as stack:
            for linear in self.linears:
                stack.enter_context(self.whole(linear))
            self.layer.reset_lora_parameters(self.adapter, self.init)

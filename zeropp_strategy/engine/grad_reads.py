"""Layer: engine. A warning, once per process, when user code reads a stage-1 gradient that
is not what DDP would hold.

[Note: stage-1 gradient reads]
After a gradient-sync backward at stage 1, each process's ``p.grad`` is averaged over the
processes only in the rows it owns ([Note: stage-1 partitioned reduce]); its other rows
hold its own unreduced share. Plain DDP (Accelerate without zeropp) leaves the whole
averaged gradient on every process. Code that reads ``p.grad`` to log a norm, clip by hand
(``torch.nn.utils.clip_grad_norm_``) or compare processes therefore gets other numbers,
with nothing to say so. Tensors have no hook on attribute reads, so ``watch_reads`` gives
the prepared model's parameters a subclass of ``nn.Parameter`` whose ``grad`` property
looks at the module that reads it:
- silent for the machinery that reads only owned rows or clears them: this package, the
  optimizers (``torch.optim``), the loss scaler (``torch.amp``), ``Module.zero_grad``,
  autograd and DDP internals, and Accelerate's and Lightning's own code;
- anything else (the user's script or hook, ``torch.nn.utils.clip_grad_norm_``, Lightning's
  ``grad_norm`` utility, a logger), once a gradient-sync backward has reduced the gradients
  and until they are cleared, gets one ``GradientReadWarning`` per process naming its file
  and line (the caller's, for a torch function or ``grad_norm``) and the front-end's fix
  (Accelerate: ``accelerator.full_gradients(model)``; Fabric:
  ``fabric.strategy.full_gradients(model)``; Lightning: ``trainer.strategy.full_gradients()``).
Inside ``no_sync``/``accumulate`` before the sync step the gradients are this process's own,
as under DDP, and nothing is said. ``zero_grad(set_to_none=False)`` zeroes in place without
clearing the mark: a read in the next accumulation step may warn although it matches DDP.
The subclass changes nothing else: the same objects, ``isinstance(p, nn.Parameter)``,
state dicts of plain tensors; pickled, a parameter is a plain ``nn.Parameter`` again. Costs one
Python call per ``.grad`` read, and a frame lookup only while the mark is set.
"""

from __future__ import annotations

import sys
import warnings
from dataclasses import dataclass
from types import FrameType

import torch
from torch import nn

__all__ = ["GradientReadWarning", "ReadWatch", "WatchedParameter", "watch_reads"]

_GRAD = torch._C.TensorBase.grad  # the getset descriptor every tensor's ``.grad`` goes through
# Readers whose reads are right at stage 1 (owned rows only, or clearing): module-name prefixes.
_SILENT = ("zeropp_strategy.", "torch.optim.", "torch.amp.", "torch.cuda.amp.", "torch.nn.modules.",
           "torch.nn.parallel.", "torch.autograd.", "torch.distributed.", "torch._", "accelerate.", "lightning.",
           "pytorch_lightning.", "lightning_fabric.")
# Functions users call to read gradients for them: their reads are the caller's (Lightning's
# grad_norm, which its docs show in on_before_optimizer_step, would log per-rank norms).
_USER_TOOLS = ("lightning.pytorch.utilities.grads", "pytorch_lightning.utilities.grads")


def _module(frame: FrameType) -> str:
    return frame.f_globals.get("__name__", "")


def _silent(frame: FrameType) -> bool:
    name = _module(frame)
    return name not in _USER_TOOLS and (name + ".").startswith(_SILENT)


class GradientReadWarning(UserWarning):
    """User code read a gradient whose value differs from plain DDP's ([Note: stage-1
    gradient reads])."""


_warned = False  # once per process, whichever model


@dataclass
class ReadWatch:
    """Shared by the parameters of one prepared model: ``armed`` from a gradient-sync
    backward (the stage-1 reduce sets it) until the gradients are set to ``None``."""

    advice: str
    armed: bool = False

    def read(self, frame: FrameType) -> None:
        global _warned
        if _warned or _silent(frame):
            return
        # the line to name: the first caller outside torch and the user tools (clip_grad_norm_
        # and grad_norm read for their caller)
        user = frame
        while user.f_back is not None and (_module(user).startswith("torch.") or _module(user) in _USER_TOOLS):
            user = user.f_back
        if _silent(user):
            return  # torch called by a framework or by us (Accelerate's clip_grad_value_: elementwise, right)
        _warned = True
        warnings.warn_explicit(
            "zeropp stage 1: this p.grad, read after a gradient-sync backward, holds the gradient averaged "
            "over the processes only in the rows this process owns (the other rows are its own unreduced "
            f"share), not the whole averaged gradient DDP holds. Fix: {self.advice}. Shown once per process.",
            GradientReadWarning, user.f_code.co_filename, user.f_lineno, module=_module(user))


class WatchedParameter(nn.Parameter):
    """An ``nn.Parameter`` whose ``grad`` reads are watched ([Note: stage-1 gradient reads])."""

    @property
    def grad(self) -> torch.Tensor | None:  # type: ignore[override]
        value = _GRAD.__get__(self)
        watch = self.__dict__.get("_zeropp_read_watch")
        if watch is not None and watch.armed and value is not None:
            watch.read(sys._getframe(1))
        return value

    @grad.setter
    def grad(self, value: torch.Tensor | None) -> None:
        _GRAD.__set__(self, value)
        watch = self.__dict__.get("_zeropp_read_watch")
        if watch is not None and value is None:
            watch.armed = False

    @grad.deleter
    def grad(self) -> None:
        _GRAD.__delete__(self)

    def __reduce_ex__(self, protocol: int) -> tuple:  # type: ignore[override]
        """Pickled as the plain ``nn.Parameter`` it is, without the watch (``torch.load`` with
        ``weights_only=True`` reads it back, without this package)."""
        from collections import OrderedDict

        state = {k: v for k, v in self.__dict__.items() if k != "_zeropp_read_watch"}
        if not state:
            return torch._utils._rebuild_parameter, (self.data, self.requires_grad, OrderedDict())
        return torch._utils._rebuild_parameter_with_state, (self.data, self.requires_grad, OrderedDict(), state)


def watch_reads(module: nn.Module, advice: str) -> ReadWatch:
    """Watch the ``.grad`` reads of ``module``'s parameters (plain ``nn.Parameter`` only: a
    subclass of the user's own is left alone); returns the watch, which the stage-1 reduce
    arms. Idempotent per parameter."""
    watch = ReadWatch(advice)
    for p in module.parameters():
        if type(p) is nn.Parameter:
            p.__class__ = WatchedParameter
        if type(p) is WatchedParameter:
            p.__dict__["_zeropp_read_watch"] = watch
    return watch

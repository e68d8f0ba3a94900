"""Layer: engine. A Hugging Face model's init of a module that redraws its submodules'
tensors, run after them as Hugging Face runs it (``materialize``'s second pass).

[Note: inits that reach into submodules]
Hugging Face initializes a model by applying its ``_init_weights`` to every module, children
before their parent. For some models the parent's call redraws a child's tensor: GPT-2's
attention and MLP blocks draw their ``c_proj`` weights again with std ``initializer_range /
sqrt(2 n_layer)`` (GPT-2's scaled init of the residual projections). ``materialize``
initializes the modules that hold tensors; alone, that left a GPT-2 built on the meta device
(the default at stages 2/3) with std 0.02 there instead of 0.0071 for 4 layers: a model that
trained slower and ended 200 steps 30% higher than the same model built for real
(benchmarks/zeropp_convergence.py, docs/zeropp_measurements.md).

``ParentInits.after(m)`` runs, once ``m`` is initialized, the init of every module whose
subtree ends with ``m`` (so deeper modules first: HF's order). Each such call runs twice:
1. on meta stand-ins of every tensor of the subtree, under a dispatch mode that records the
   storages written (``aten`` ops whose schema marks an argument as written): which tensors
   this init draws; nothing is allocated and the generator is left as it was;
2. if it writes tensors of its descendants that this materialization drew (never one filled
   from a pretrained folder), again with those tensors real (whole on a CPU mesh, [Note:
   initialization on a CPU mesh] in engine/materialize.py) and meta stand-ins for the rest
   (the parent's own tensors too: ``materialize`` initialized them when it reached the
   parent, before its children); a write to a stand-in is dropped.
So the redraw of a child's tensor comes after the child's own init, as in Hugging Face; a
module that owns tensors still gets its own init before its children's. An init that
reads a child's values (``.item()``, a copy from a sibling) cannot run on stand-ins and
fails here; build such a model with ``meta_init=False``.
Every model probed (GPT-2, Llama, Qwen2, Mistral, OPT, GPT-NeoX, Phi, Gemma 2 in
transformers 5.24) writes from a parent only in GPT-2's blocks, one tensor each.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import ExitStack, contextmanager
from typing import Any

import torch
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode

__all__ = ["ParentInits"]

Slot = tuple[nn.Module, str, str]  # (module, "_parameters" or "_buffers", name)


class ParentInits:
    """The second pass of [Note: inits that reach into submodules] for one ``materialize``."""

    def __init__(self, root: nn.Module, hf_init: dict[int, Callable[[nn.Module], None]]) -> None:
        self.done_at: dict[int, list[tuple[nn.Module, Callable[[nn.Module], None]]]] = {}
        order = {id(m): i for i, m in enumerate(root.modules())}  # registration order, as materialize goes
        for p in root.modules():  # an ancestor before its descendants
            init = hf_init.get(id(p))
            if init is None or next(p.children(), None) is None:
                continue
            last = max(p.modules(), key=lambda m: order[id(m)])  # a shared submodule may come later elsewhere
            self.done_at.setdefault(id(last), []).insert(0, (p, init))  # the deeper first
        self.drawn: set[int] = set()  # tensors (ids) this materialization drew
        self.stored: set[int] = set()  # tensors (ids) handed to an NVMe store: out of reach

    def after(self, m: nn.Module, whole: Callable[[nn.Module, set[str]], Any]) -> None:
        for p, init in self.done_at.get(id(m), ()):
            self._run(p, init, whole)

    def _run(self, p: nn.Module, init: Callable[[nn.Module], None],
             whole: Callable[[nn.Module, set[str]], Any]) -> None:
        slots = [s for m in p.modules() if m is not p for s in _slots(m)]
        if not any(id(_get(s)) in self.drawn for s in slots):  # all read from a folder (or real): no probe
            return
        written, seen = _written(p, init, slots), set()
        touched = []
        for s in written:  # a tensor tied into two slots is made whole once
            t = _get(s)
            if id(t) in self.drawn and id(t) not in seen:
                seen.add(id(t))
                touched.append(s)
        if not touched:
            return
        gone = [f"{type(s[0]).__name__}.{s[2]}" for s in touched if id(_get(s)) in self.stored]
        if gone:
            raise TypeError(
                f"{type(p).__name__}'s _init_weights redraws {', '.join(gone)}, whose FSDP group was already "
                "streamed to NVMe (offload_param='nvme'). Fix: wrap the module whose init reaches into its "
                "submodules in one FSDP group with them, or build the model with meta_init=False")
        keep = {(id(m), kind, name) for m, kind, name in touched}
        with ExitStack() as stack:
            by_module: dict[int, tuple[nn.Module, set[str]]] = {}
            for m, kind, name in touched:
                if kind == "_parameters":
                    by_module.setdefault(id(m), (m, set()))[1].add(name)
            for m, names in by_module.values():
                stack.enter_context(whole(m, names))
            stack.enter_context(_stand_ins([s for s in slots if (id(s[0]), s[1], s[2]) not in keep] + _slots(p)))
            init(p)


def _get(slot: Slot) -> torch.Tensor:
    m, kind, name = slot
    return getattr(m, kind)[name]


def _slots(m: nn.Module) -> list[Slot]:
    """``m``'s own parameters and buffers (not its children's)."""
    return [(m, kind, name) for kind in ("_parameters", "_buffers") for name, t in getattr(m, kind).items()
            if t is not None]


@contextmanager
def _stand_ins(slots: list[Slot]) -> Iterator[dict[int, Slot]]:
    """Each slot's tensor replaced by an empty one on the meta device (a parameter by a
    parameter); yields storage key -> slot."""
    kept, keys = [], {}
    try:
        for slot in slots:
            m, kind, name = slot
            t = getattr(m, kind)[name]
            meta = torch.empty(t.shape, dtype=t.dtype, device="meta")
            if isinstance(t, nn.Parameter):
                meta = nn.Parameter(meta, requires_grad=t.requires_grad)
            kept.append((slot, t))
            getattr(m, kind)[name] = meta
            keys[_key(meta)] = slot
        yield keys
    finally:
        for (m, kind, name), t in kept:
            getattr(m, kind)[name] = t


def _key(t: torch.Tensor) -> int:
    return t.untyped_storage()._cdata  # the same for every view of a tensor (``.data`` too)


class _Writes(TorchDispatchMode):
    """The storages of the tensors an op writes, by its schema."""

    def __init__(self) -> None:
        super().__init__()
        self.keys: set[int] = set()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        for i, a in enumerate(func._schema.arguments):
            if a.alias_info is None or not a.alias_info.is_write:
                continue
            v = kwargs.get(a.name) if a.kwarg_only or i >= len(args) else args[i]
            if isinstance(v, torch.Tensor):
                self.keys.add(_key(v))
        return func(*args, **kwargs)


def _written(p: nn.Module, init: Callable[[nn.Module], None], slots: list[Slot]) -> list[Slot]:
    """The slots of ``p``'s descendants that ``init(p)`` writes, found on meta stand-ins."""
    state = torch.get_rng_state()  # a draw on the CPU copied into a stand-in must not count
    try:
        with _stand_ins(slots + _slots(p)) as keys, _Writes() as writes:
            init(p)
    finally:
        torch.set_rng_state(state)
    return [s for k, s in keys.items() if k in writes.keys and s[0] is not p]

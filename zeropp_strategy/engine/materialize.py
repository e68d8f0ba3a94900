"""Layer: engine. Meta-device tensors allocated and initialized after sharding, each rank
its own shard only (``materialize``).

The last step of ``engine.fsdp.shard_module``'s recipe at stages 2/3 (all at once, or with
``offload_param="nvme"`` one FSDP group at a time once the swap files exist, from
``engine.core``), and the first of stage 1's preparation, where nothing is sharded. The values
are a real build's: a Hugging Face model's own ``_init_weights``, or each module's
``reset_parameters()`` from the random state its meta build ended with
([Note: the build's random state] in engine/meta_init.py), or a pretrained folder's tensors
(engine/pretrained.py).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator
from contextlib import contextmanager
from typing import Any

import torch
from torch import nn
from torch.distributed.fsdp import FSDPModule
from torch.distributed.tensor import DTensor, distribute_tensor

from zeropp_strategy.engine.fsdp_groups import fsdp_modules
from zeropp_strategy.engine.meta_init import has_meta, replayed_rng
from zeropp_strategy.engine.parent_init import ParentInits
from zeropp_strategy.engine.peft_init import lora_inits
from zeropp_strategy.engine.pretrained import Loads
from zeropp_strategy.fsdp_private import group_params, param_groups, reset_sharded_param
from zeropp_strategy.primitives import prefault


@torch.no_grad()
def materialize(root: nn.Module, device: torch.device, *, store: Any = None) -> None:
    """Allocate and initialize meta-device tensors, shard by shard.

    A Hugging Face model's submodules get the model's ``_init_weights`` (the innermost
    model's; where a module's init redraws its children's tensors, that redraw comes after
    their own init: [Note: inits that reach into submodules] in engine/parent_init.py); every other
    module with tensors of its own gets ``reset_parameters()``, in registration order and
    from the random state its meta build ended with (engine/meta_init.py), so the values
    are a real build's. Either way each rank keeps only its shard. Anything left
    uninitialized is an error, not garbage weights. With a ``store``
    (``offload_param="nvme"``), one FSDP group at a time ([Note: streaming initialization]).
    """
    if not has_meta(root):
        return
    hf_init: dict[int, Callable[[nn.Module], None]] = {}
    for m in root.modules():
        init = getattr(m, "_init_weights", None)
        if callable(init) and hasattr(m, "config"):
            inner = any(c.__name__ == "PreTrainedModel" for c in type(m).__mro__)
            for sub in m.modules():  # a model inside a model: the inner one's init (HF's smart_apply)
                if inner or id(sub) not in hf_init:
                    hf_init[id(sub)] = init
    missing: set[str] = set()
    loads = Loads(root)  # models from_pretrained built on meta: [Note: streaming load] in engine/pretrained.py
    parents = ParentInits(root, hf_init)
    hf_init.update(lora_inits(root, _whole_tensors))  # peft's LoRA adapters: peft's own init (engine/peft_init.py)
    with replayed_rng(root):  # [Note: the build's random state] in engine/meta_init.py
        if store is None:
            _materialize_meta_modules(root, device, hf_init, missing, loads, parents)
        else:
            _materialize_streaming(root, device, store, hf_init, missing, loads, parents)
    loads.close()
    if missing:
        raise TypeError(
            "configure_model created tensors on the meta device, but these modules have no "
            f"reset_parameters() to initialize them after sharding: {sorted(missing)}. Fix: "
            "implement reset_parameters() on them, or build the model without the meta device."
        )


def _own_tensors(m: nn.Module) -> list[torch.Tensor]:
    """``m``'s own parameters and buffers (not its children's)."""
    return [*m.parameters(recurse=False), *m.buffers(recurse=False)]


def _owns_meta(m: nn.Module) -> bool:
    return any(t.is_meta for t in _own_tensors(m))


def _reset_sharded_params(modules: Iterable[nn.Module]) -> None:
    """FSDP2 re-reads the sharded parameters of ``modules``' groups after an allocation
    (what its own ``_apply`` does after ``to_empty``)."""
    for module in modules:
        for g in param_groups(module):
            for fp in group_params(g):
                reset_sharded_param(fp)


def _materialize_meta_modules(root: nn.Module, device: torch.device, hf_init: dict[int, Callable[[nn.Module], None]],
                              missing: set[str], loads: Loads, parents: ParentInits) -> None:
    """Allocate and initialize the modules that own meta tensors, and only those: a model
    whose backbone was loaded for real (in ``__init__``, say) and whose head was built on the
    meta device keeps the backbone's values. FSDP2 re-reads every sharded parameter after the
    allocation (``reset_sharded_param``, what its own ``_apply`` does), before the values are
    drawn into the shards. Host shards have their pages mapped before they are written
    ([Note: prefaulting host shards] in primitives.py)."""
    todo = [m for m in root.modules() if _owns_meta(m)]
    to_empty_keeping_ties(todo, device)
    _reset_sharded_params(fsdp_modules(root))
    if device.type == "cpu":
        prefault(t for m in todo for t in _own_tensors(m))
    todo_ids = {id(m) for m in todo}
    for m in root.modules():  # in the streaming path's order: the same draws, bit for bit
        if id(m) in todo_ids:
            _initialize([m], hf_init, missing, loads, parents)
        parents.after(m, _whole_tensors)


def to_empty_keeping_ties(modules: Iterable[nn.Module], device: torch.device,
                           replaced: dict[int, nn.Parameter] | None = None) -> None:
    """``to_empty(recurse=False)`` of each module, allocating a parameter shared by several
    (tied weights: ``lm_head`` and the embedding) once: ``to_empty`` of each would give each
    module its own copy and untie them."""
    replaced = {} if replaced is None else replaced  # id(meta parameter) -> its allocation
    for m in modules:
        shared = {n: replaced[id(p)] for n, p in m._parameters.items() if p is not None and id(p) in replaced}
        for n in shared:
            del m._parameters[n]
        metas = {n: p for n, p in m._parameters.items() if p is not None and p.is_meta}
        m.to_empty(device=device, recurse=False)
        for n, p in metas.items():
            replaced[id(p)] = m._parameters[n]
        m._parameters.update(shared)


def _initialize(modules: Iterable[nn.Module], hf_init: dict[int, Callable[[nn.Module], None]],
                missing: set[str], loads: Loads, parents: ParentInits) -> None:
    for m in modules:
        if not _own_tensors(m):
            continue
        if not loads.init_needed(m):  # every tensor from a pretrained folder: nothing to draw
            loads.fill(m)
            continue
        if getattr(hf_init.get(id(m)), "done", False):  # a LoRA B that peft initialized with its A
            continue
        # Inside a Hugging Face model its own init wins: nn.Embedding.reset_parameters
        # draws N(0, 1) where the model wants N(0, initializer_range).
        with _whole_tensors(m):
            if id(m) in hf_init:
                hf_init[id(m)](m)
            elif callable(getattr(m, "reset_parameters", None)):
                m.reset_parameters()
            else:
                missing.add(type(m).__name__)
        loads.fill(m)
        parents.drawn.update(id(t) for t in _own_tensors(m) if id(t) not in loads.done)


@contextmanager
def _whole_tensors(m: nn.Module, names: set[str] | None = None) -> Iterator[None]:
    """On a CPU mesh, ``m``'s sharded parameters (those in ``names``, or all) are whole
    tensors while its init runs.

    [Note: initialization on a CPU mesh]
    DTensor's random ops draw each shard at its offset of the whole tensor only on
    accelerator meshes (its RNG tracker); on a CPU mesh every rank draws its shard from its
    own generator, so with the same seed every rank drew the same values, and a sharded
    weight's row blocks came out identical (a Linear(4, 8) on 2 ranks: rows 4-7 equal rows
    0-3), with a warning from DTensor. Here each rank draws the whole tensor, as one
    process would, and keeps its shard: the same weights as the model initialized without
    sharding, from the same seed. It costs one module's whole parameters at a time."""
    swapped = []
    for name, p in list(m.named_parameters(recurse=False)):
        if isinstance(p, DTensor) and p.device_mesh.device_type == "cpu" and (names is None or name in names):
            whole = nn.Parameter(torch.empty(p.shape, dtype=p.dtype), requires_grad=p.requires_grad)
            m._parameters[name] = whole
            swapped.append((name, p, whole))
    try:
        yield
    finally:
        with torch.no_grad():
            for name, p, whole in swapped:
                m._parameters[name] = p
                shard = distribute_tensor(whole.detach(), p.device_mesh, p.placements, src_data_rank=None)
                p.to_local().copy_(shard.to_local())


def _own_modules(group_root: nn.Module) -> list[nn.Module]:
    """``group_root`` and the submodules whose tensors belong to its FSDP group: all those
    reached without entering another ``fully_shard`` module."""
    out, todo = [], [group_root]
    while todo:
        m = todo.pop()
        out.append(m)
        todo.extend(c for c in m.children() if not isinstance(c, FSDPModule))
    return out


def _materialize_streaming(root: nn.Module, device: torch.device, store: Any,
                           hf_init: dict[int, Callable[[nn.Module], None]], missing: set[str], loads: Loads,
                           parents: ParentInits) -> None:
    """[Note: streaming initialization]
    ``root.to_empty`` would allocate this rank's whole shard of the model at once (4 P/N
    bytes in fp32) before anything could move to NVMe: the 3.4B-parameter model of issue 22
    was killed there. Instead the modules are initialized in the same order as on the
    whole-model path (``root.modules()``), and each ``fully_shard`` group is allocated when
    its first module comes (``to_empty(recurse=False)`` of the group's own submodules: its
    shards and buffers; then ``reset_sharded_param``, what FSDP2's own ``_apply`` does) and
    handed to the store when its last module is done: ``ParamStore.fill`` copies the shards
    into the swap file, writes them out and drops their pages. In memory at a time: the
    root group (its modules come first and last: embeddings, head) and one block. Same
    order, same shapes, so the same random draws as without NVMe offload, bit for bit."""
    owner: dict[int, nn.Module] = {}
    left: dict[int, int] = {}
    for group_root in fsdp_modules(root):
        own = _own_modules(group_root)
        left[id(group_root)] = len(own)
        owner.update((id(m), group_root) for m in own)
    ready: set[int] = set()
    replaced: dict[int, nn.Parameter] = {}
    for m in root.modules():
        group_root = owner.get(id(m))
        if group_root is None:  # outside every fully_shard module: nothing of it is offloaded
            to_empty_keeping_ties([m], device, replaced)
            _initialize([m], hf_init, missing, loads, parents)
            parents.after(m, _whole_tensors)
            continue
        if id(group_root) not in ready:
            ready.add(id(group_root))
            real = [type(sub).__name__ for sub in _own_modules(group_root) if _own_tensors(sub) and not _owns_meta(sub)]
            if real:  # to_empty of the group would lose their values
                raise TypeError(
                    f"offload_param='nvme' streams each FSDP group to disk as it is initialized, but the group of "
                    f"{type(group_root).__name__} mixes real tensors ({', '.join(sorted(set(real)))}) with meta ones. "
                    "Fix: build the whole model on the meta device (ZeroConfig.meta_init=True, the default, with "
                    "nothing loaded for real), or all of it for real (meta_init=False)")
            to_empty_keeping_ties(_own_modules(group_root), device, replaced)
            _reset_sharded_params([group_root])
        _initialize([m], hf_init, missing, loads, parents)
        parents.after(m, _whole_tensors)
        left[id(group_root)] -= 1
        if not left[id(group_root)]:
            parents.stored.update(id(t) for sub in _own_modules(group_root) for t in _own_tensors(sub))
            for g in param_groups(group_root):
                store.fill(g)

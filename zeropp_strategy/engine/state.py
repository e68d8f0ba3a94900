"""Layer: engine. Full (unsharded) model and optimizer state, in exactly the layout DDP produces.

A full state dict here is what ``strategy="ddp"`` would save: module ``state_dict()``
keys with plain tensors, and ``optimizer.state_dict()`` keyed by parameter index in
``param_groups`` order. Sharded tensors (DTensor) are gathered with ``full_tensor()``
(every rank must call these functions: they are collectives) and moved to CPU one
tensor at a time, so the gathered copy never sits on the accelerator whole.

Loading goes the other way without communication: every rank reads the full tensors
and keeps the rows its DTensor placement says it owns.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch
from torch import nn
from torch.distributed.tensor import DTensor, distribute_tensor
from torch.optim import Optimizer

from zeropp_strategy.engine.stage1 import ShardedOptimizer
from zeropp_strategy.primitives import follows_param


def to_full_cpu(value: Any, *, keep: bool = True, ledger: Any = None) -> Any:
    """DTensor -> gathered CPU tensor; tensors -> CPU; containers recursively.

    Gathers one tensor at a time; with ``keep=False`` (ranks other than the writer) the
    gathered copy is dropped at once, so only the writer ever holds the whole model, on
    CPU. Bytes sent per rank per DTensor: its padded local shard to every peer (booked
    as OTHER when a ledger is given).
    """
    if isinstance(value, DTensor):
        if ledger is not None:
            from zeropp_strategy.comm.collectives import group_ranks
            from zeropp_strategy.comm.ledger import CommKind

            mesh = value.device_mesh
            rows = -(-value.shape[0] // mesh.size()) if value.dim() else 1
            shard = rows * (value[0].numel() if value.dim() else 1) * value.element_size()
            ledger.record_all_gather(CommKind.OTHER, shard, group_ranks(mesh.get_group()))
        full = value.full_tensor()
        if not keep:
            return None
        # With one rank or a Replicate placement full_tensor() is the local tensor itself.
        aliased = full.untyped_storage().data_ptr() == value.to_local().untyped_storage().data_ptr()
        return full.to("cpu", copy=aliased)
    if isinstance(value, torch.Tensor):
        # copy=True: a CPU tensor's .cpu() is itself, and the caller must not get an
        # alias of a live parameter or optimizer counter that the next step changes.
        return value.detach().to("cpu", copy=True) if keep else None
    if isinstance(value, Mapping):
        return {k: to_full_cpu(v, keep=keep, ledger=ledger) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return type(value)(to_full_cpu(v, keep=keep, ledger=ledger) for v in value)
    return value


def _like(full: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
    """``full`` laid out like ``like``: this rank's local shard if ``like`` is a DTensor."""
    if isinstance(like, DTensor):
        full = full.to(device=like.device, dtype=like.dtype)
        # src_data_rank=None: every rank already has the full tensor, split locally.
        return distribute_tensor(full, like.device_mesh, like.placements, src_data_rank=None)
    return full.to(device=like.device, dtype=like.dtype)


def full_model_state(module: nn.Module, *, keep: bool = True, ledger: Any = None) -> dict[str, Any]:
    """Collective. The writer (``keep=True``) gets the full CPU state; others get {}."""
    state = to_full_cpu(module.state_dict(), keep=keep, ledger=ledger)
    return state if keep else {}


@torch.no_grad()
def full_gradients(module: nn.Module, *, stage: int, ledger: Any) -> dict[str, torch.Tensor]:
    """Collective. Each parameter's gradient as DDP leaves it after backward: the whole
    tensor, averaged over the ranks, on every rank, keyed by ``named_parameters()`` name
    (parameters without a gradient are left out). What ``.grad`` holds differs by stage:
    at stage 1 each rank's averaged rows are the ones it owns ([Note: stage-1 partitioned
    reduce]; the other rows hold its own unreduced share), so the owned rows are summed
    across the ranks; at stages 2/3 ``.grad`` is the averaged DTensor shard, gathered; a
    0-dim gradient is averaged whole at every stage. Bytes per rank: one all-reduce per
    stage-1 gradient, one all-gather per sharded one (booked as OTHER)."""
    import torch.distributed as dist

    from zeropp_strategy.comm.collectives import all_reduce
    from zeropp_strategy.comm.ledger import CommKind
    from zeropp_strategy.engine.stage1 import row_range

    distributed = dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1
    out: dict[str, torch.Tensor] = {}
    for name, p in module.named_parameters():
        g = p.grad
        if g is None:
            continue
        if isinstance(g, DTensor):
            out[name] = to_full_cpu(g, ledger=ledger).to(g.device)
        elif stage == 1 and g.dim() > 0 and distributed:
            rank, world = dist.get_rank(), dist.get_world_size()
            lo, hi = row_range(g.shape[0], rank, world)
            full = torch.zeros_like(g)
            full[lo:hi] = g[lo:hi]
            all_reduce(full, ledger=ledger, kind=CommKind.OTHER)
            out[name] = full
        else:
            out[name] = g.detach().clone()
    return out


@torch.no_grad()
def load_full_model_state(module: nn.Module, state: Mapping[str, Any], *, strict: bool = True) -> None:
    current = module.state_dict()
    missing = [k for k in current if k not in state]
    unexpected = [k for k in state if k not in current]
    if strict and (missing or unexpected):
        raise KeyError(
            f"checkpoint does not match the model: missing keys {missing[:8]}, unexpected keys "
            f"{unexpected[:8]}. Fix: load a checkpoint of this model, or set "
            "LightningModule.strict_loading = False."
        )
    loaded = {}
    for key, target in current.items():
        if key not in state:
            continue
        src = _like(state[key], target)
        if isinstance(target, DTensor):
            target.to_local().copy_(src.to_local())
        else:
            target.copy_(src)
        loaded[key] = target
    # state_dict() entries alias the parameters and buffers, except where a module returns
    # copies (int8 frozen weights show dequantized copies): copy those back through the
    # module, which requantizes them.
    module.load_state_dict(loaded, strict=False)


def _optimizer_params(optimizer: Optimizer) -> list[torch.Tensor]:
    return [p for g in optimizer.param_groups for p in g["params"]]


def full_optimizer_state(optimizer: Optimizer, *, keep: bool = True, ledger: Any = None) -> dict[str, Any]:
    """``optimizer.state_dict()`` with every sharded state tensor gathered (collective)."""
    inner = getattr(optimizer, "_optimizer", optimizer)
    sd = inner.state_dict()
    # Iterate in a fixed order so every rank issues the same gathers.
    state = {
        idx: {k: to_full_cpu(v, keep=keep, ledger=ledger) for k, v in sd["state"][idx].items()}
        for idx in sorted(sd["state"])
    }
    return {"state": state, "param_groups": sd["param_groups"]} if keep else {}


@torch.no_grad()
def load_full_optimizer_state(optimizer: Optimizer, state_dict: Mapping[str, Any]) -> None:
    inner = getattr(optimizer, "_optimizer", optimizer)
    params = _optimizer_params(inner)
    state: dict[int, dict[str, Any]] = {}
    for idx, entry in state_dict["state"].items():
        idx = int(idx)
        if idx >= len(params):
            raise KeyError(
                f"optimizer checkpoint has state for parameter #{idx} but the optimizer has "
                f"{len(params)} parameters. Fix: build the same param groups in configure_optimizers."
            )
        p = params[idx]
        state[idx] = {k: (_like(v, p) if follows_param(k, v, p) else v) for k, v in entry.items()}
    target = inner.optimizer if isinstance(inner, ShardedOptimizer) else inner
    target.load_state_dict({"state": state, "param_groups": state_dict["param_groups"]})

"""Full (unsharded) model and optimizer state, in exactly the layout DDP produces.

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


def to_full_cpu(value: Any) -> Any:
    """DTensor -> gathered CPU tensor; tensors -> CPU; containers recursively."""
    if isinstance(value, DTensor):
        return value.full_tensor().cpu()
    if isinstance(value, torch.Tensor):
        return value.detach().cpu()
    if isinstance(value, Mapping):
        return {k: to_full_cpu(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return type(value)(to_full_cpu(v) for v in value)
    return value


def _like(full: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
    """``full`` laid out like ``like``: this rank's local shard if ``like`` is a DTensor."""
    if isinstance(like, DTensor):
        full = full.to(device=like.device, dtype=like.dtype)
        # src_data_rank=None: every rank already has the full tensor, split locally.
        return distribute_tensor(full, like.device_mesh, like.placements, src_data_rank=None)
    return full.to(device=like.device, dtype=like.dtype)


def full_model_state(module: nn.Module) -> dict[str, Any]:
    return to_full_cpu(module.state_dict())


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
    for key, target in current.items():
        if key not in state:
            continue
        src = _like(state[key], target)
        if isinstance(target, DTensor):
            target.to_local().copy_(src.to_local())
        else:
            target.copy_(src)


def _optimizer_params(optimizer: Optimizer) -> list[torch.Tensor]:
    return [p for g in optimizer.param_groups for p in g["params"]]


def full_optimizer_state(optimizer: Optimizer) -> dict[str, Any]:
    """``optimizer.state_dict()`` with every sharded state tensor gathered (collective)."""
    inner = getattr(optimizer, "_optimizer", optimizer)
    sd = inner.state_dict()
    # Iterate in a fixed order so every rank issues the same gathers.
    state = {idx: {k: to_full_cpu(v) for k, v in sd["state"][idx].items()} for idx in sorted(sd["state"])}
    return {"state": state, "param_groups": sd["param_groups"]}


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
        state[idx] = {
            k: (_like(v, p) if isinstance(v, torch.Tensor) and v.dim() > 0 and v.shape == p.shape else v)
            for k, v in entry.items()
        }
    target = inner.optimizer if isinstance(inner, ShardedOptimizer) else inner
    target.load_state_dict({"state": state, "param_groups": state_dict["param_groups"]})

"""Layer: engine (runtime). Checks that keep the ranks in step: a rank-local step that may
fail (``agree``), the same config on every rank (``check_same_config``), non-finite losses
and gradients (``check_nonfinite``), and rank 0's values for a model nothing trains
(``broadcast_module``). Each is a small collective, booked as ``CommKind.CONTROL`` when a
ledger is given (``comm.control``).
"""

from __future__ import annotations

import logging
import math
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel

from zeropp_strategy.comm.control import all_gather_object, all_reduce_flag, distributed
from zeropp_strategy.comm.ledger import CommKind, CommLedger
from zeropp_strategy.engine.dtensor import local as _local

log = logging.getLogger(__name__)

__all__ = [
    "NONFINITE_POLICIES",
    "agree",
    "broadcast_module",
    "check_nonfinite",
    "check_nonfinite_policy",
    "check_same_config",
    "named_parameters",
    "unwrap",
]


def agree(what: str, fn: Callable[[], Any], *, device: torch.device | None = None,
          ledger: CommLedger | None = None) -> Any:
    """Run a rank-local step that may fail (a full disk) so that all ranks fail together.

    Every rank runs ``fn``, then one all-reduce says whether any failed: the failing
    rank raises its own error, the others an error naming it, instead of waiting in
    the next collective until the timeout. ``device``: where the flag goes under NCCL
    (default: the current CUDA device).
    """
    error: BaseException | None = None
    result = None
    try:
        result = fn()
    except Exception as e:  # noqa: BLE001 - re-raised below, after the others know
        error = e
    rank = dist.get_rank() if distributed() else 0
    flag = torch.tensor([rank if error is not None else -1], dtype=torch.int64)
    if distributed() and dist.get_backend() == "nccl":
        flag = flag.to(device if device is not None and device.type != "cpu"
                       else torch.device("cuda", torch.cuda.current_device()))
    all_reduce_flag(flag, op=dist.ReduceOp.MAX, ledger=ledger)
    if error is not None:
        raise error
    failed = int(flag.item())
    if failed >= 0:
        raise RuntimeError(f"zeropp: {what} failed on rank {failed} (its error is in its log); stopping this rank too.")
    return result


NONFINITE_POLICIES = ("ignore", "raise", "skip")


def check_nonfinite_policy(value: Any, where: str) -> str:
    """``on_nonfinite`` of a front-end, validated (a ``ValueError`` naming ``where``)."""
    if value not in NONFINITE_POLICIES:
        raise ValueError(f"{where}(on_nonfinite={value!r}) is invalid. Fix: use 'ignore', 'raise' (stop with the "
                         "step and the first non-finite parameter) or 'skip' (drop that step).")
    return value


def named_parameters(modules: list[nn.Module]) -> list[tuple[str, torch.Tensor]]:
    """The parameters of ``modules`` (wrappers removed) by name, prefixed with the module's
    index when there are several: what ``check_nonfinite`` reports."""
    return [(f"{i}.{n}" if len(modules) > 1 else n, p)
            for i, m in enumerate(modules) for n, p in unwrap(m).named_parameters()]


@torch.no_grad()
def check_nonfinite(named_params: list[tuple[str, torch.Tensor]], loss: Any, *, policy: str, step: int,
                    where: str, device: torch.device | None = None, ledger: CommLedger | None = None) -> bool:
    """After backward, before the optimizer step: one all-reduce says whether any rank has a
    non-finite loss or gradient (in its own shard). Then every rank raises the same
    ``FloatingPointError`` (``policy="raise"``: the step, the ranks with a bad loss, the first
    non-finite gradient and its rank), or drops every gradient so that the optimizer skips
    the step (``"skip"``; returns True). ``where``: the front-end, for the fix."""
    first = None
    for name, p in named_params:
        if p.grad is not None and not torch.isfinite(_local(p.grad)).all():
            first = name
            break
    loss_value = float(loss.detach()) if isinstance(loss, torch.Tensor) and loss.numel() == 1 else (
        float(loss) if isinstance(loss, (int, float)) else None)
    bad_loss = loss_value is not None and not math.isfinite(loss_value)
    flag = torch.tensor([1.0 if (first is not None or bad_loss) else 0.0],
                        device=device if device is not None else torch.device("cpu"))
    all_reduce_flag(flag, op=dist.ReduceOp.MAX, ledger=ledger)
    if flag.item() == 0:
        return False
    reports = all_gather_object((first, loss_value), ledger=ledger)
    at = next(((r, name) for r, (name, _) in enumerate(reports) if name is not None), None)
    losses = ", ".join(f"rank {r}: {v:.4g}" for r, (_, v) in enumerate(reports) if v is not None)
    bad_ranks = [str(r) for r, (_, v) in enumerate(reports) if v is not None and not math.isfinite(v)]
    parts = [f"non-finite loss on rank(s) {', '.join(bad_ranks)}"] if bad_ranks else []
    if at:  # after the gradient reduction, so one rank's NaN shows on every rank
        parts.append(f"first non-finite gradient in {at[1]!r} on rank {at[0]}")
    what = "; ".join(parts)
    if policy == "raise":
        raise FloatingPointError(
            f"zeropp: non-finite values at optimizer step {step}: {what} (losses: {losses}). Fix: lower the "
            f"learning rate, check this step's data, prefer bf16 to fp16, or pass {where}(on_nonfinite='skip') "
            "to drop such steps."
        )
    for _, p in named_params:
        p.grad = None  # optimizers skip parameters without a gradient: no update, no state change
    log.warning("zeropp: skipped optimizer step %d on every rank: %s (losses: %s)", step, what, losses)
    return True


def check_same_config(fields: dict[str, Any], world_size: int, *, ledger: CommLedger | None = None) -> None:
    """Collective (one object all-gather): every rank raises the same ``ValueError`` when
    the ranks were given different configs (stage, bits, hpZ size...), naming each field
    that differs, the ranks and their values, instead of entering mismatched collectives
    and hanging. ``fields``: what must agree (``ZeroConfig.comparable()``)."""
    if not isinstance(fields, dict):
        raise TypeError(f"check_same_config takes the fields to compare (config.comparable()), not a "
                        f"{type(fields).__name__}")
    if world_size <= 1 or not dist.is_initialized():
        return
    everyone = all_gather_object(fields, ledger=ledger)
    if all(d == everyone[0] for d in everyone):
        return
    lines = []
    for key in sorted(set().union(*everyone)):
        values = [d.get(key) for d in everyone]
        if any(v != values[0] for v in values):
            by_value: dict[str, list[int]] = {}
            for rank, v in enumerate(values):
                by_value.setdefault(repr(v), []).append(rank)
            shown = "; ".join(f"ranks {_ranks(r)} have {v}" for v, r in by_value.items())
            lines.append(f"{key}: {shown}")
    raise ValueError(
        "zeropp: the ranks were given different ZeroConfigs, and mismatched collectives would hang: "
        + " | ".join(lines) + ". Fix: give every rank the same configuration (the same recipe, command-line "
        "arguments and ZEROPP_* environment variables)."
    )


def _ranks(ranks: list[int]) -> str:
    return ",".join(str(r) for r in ranks[:8]) + (f",... ({len(ranks)} ranks)" if len(ranks) > 8 else "")


def unwrap(module: nn.Module) -> nn.Module:
    """The user's module behind Fabric's wrapper and DDP (stage 1)."""
    module = getattr(module, "_forward_module", module)  # lightning.fabric's _FabricModule
    return module.module if isinstance(module, DistributedDataParallel) else module


@torch.no_grad()
def broadcast_module(module: nn.Module, *, ledger: CommLedger | None = None) -> None:
    """Every rank takes rank 0's parameters and buffers (what DDP's construction does), for
    stage-1 models that are not wrapped in DDP because nothing in them trains. Booked as
    ``OTHER``, as DDP's own broadcast at construction is."""
    if not distributed():
        return
    for t in [*module.parameters(), *module.buffers()]:
        if ledger is not None:
            ledger.record_broadcast(CommKind.OTHER, t.numel() * t.element_size(), 0, list(range(dist.get_world_size())))
        dist.broadcast(t.data, src=0)

"""Layer: engine. The framework-free half of precision: the dtype policy each precision
flag means under ZeRO, the sharded grad scaler, and gradient clipping over shards. No
training framework is imported here; the Lightning plugin ``zeropp_strategy.lightning.
precision.ZeroPPPrecision`` is this policy plus Lightning's hooks, and the Fabric and Accelerate
front-ends use these pieces directly.

| flag         | params held (sharded at 2/3) | compute    | grad reduce | master |
|--------------|------------------------------|------------|-------------|--------|
| 32-true      | fp32                         | fp32       | fp32        | -      |
| bf16-mixed   | fp32                         | bf16 (*)   | fp32        | params |
| 16-mixed     | fp32                         | fp16 (*)   | fp32        | params |
| bf16-true    | bf16                         | bf16       | bf16        | -      |
| 16-true      | fp16                         | fp16       | fp16        | -      |

(*) stage 2/3 all-gather the parameters in 16 bits (FSDP2 ``MixedPrecisionPolicy``
``param_dtype``; half the gather bytes) and also run under autocast so that softmax,
norms and losses stay in fp32. Stage 1 keeps fp32 replicas and uses autocast alone.

[Note: global inf check]
With sharded gradients every rank sees only its shard, so one rank can find an inf
that the others do not. ``ShardedGradScaler`` all-reduces ``found_inf`` (MAX) across
the data-parallel group before ``step`` decides, so every rank skips the same steps and
lowers the loss scale identically. The clip norm is global for the same reason:
``clip_grad_norm`` sums squares over local shards and all-reduces them.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Generator, Iterable
from contextlib import AbstractContextManager, contextmanager, nullcontext
from typing import Any, Literal

import torch
import torch.distributed as dist
from torch import Tensor
from torch.distributed.tensor import DTensor
from torch.optim import Optimizer

from zeropp_strategy.comm.control import all_reduce_flag
from zeropp_strategy.engine.dtensor import local as _local
from zeropp_strategy.engine.stage1 import ShardedOptimizer, row_range

__all__ = [
    "SUPPORTED",
    "PrecisionFlag",
    "PrecisionPolicy",
    "ShardedGradScaler",
    "clip_grad_norm",
    "clip_grad_norm_params",
    "clip_grad_norm_rows",
    "clip_grad_value",
    "local_grads",
]

PrecisionFlag = Literal["32-true", "bf16-mixed", "16-mixed", "bf16-true", "16-true"]
SUPPORTED: tuple[str, ...] = ("32-true", "bf16-mixed", "16-mixed", "bf16-true", "16-true")

_HALF = {"bf16": torch.bfloat16, "16": torch.float16}


def local_grads(optimizer: Optimizer) -> list[Tensor]:
    """Gradients this rank owns for ``optimizer``, as plain tensors.

    Stage 1: the rows this rank owns, the only reduced ones ([Note: stage-1 partitioned
    reduce]). Stage 2/3: the local shards of FSDP2's DTensor gradients.
    """
    inner = getattr(optimizer, "_optimizer", optimizer)
    if isinstance(inner, ShardedOptimizer):
        return [_local(g) for g in inner.sharded_grads()]
    return [_local(p.grad) for g in inner.param_groups for p in g["params"] if p.grad is not None]


def _reduce(t: Tensor, op: dist.ReduceOp, group: Any, ledger: Any = None) -> Tensor:
    """All-reduce a scalar (a norm, an inf flag), booked as CONTROL (``comm.control``)."""
    if dist.is_available() and dist.is_initialized():
        all_reduce_flag(t, op=op, ledger=ledger, group=group)
    return t


def _is_sharded(optimizer: Optimizer) -> bool:
    inner = getattr(optimizer, "_optimizer", optimizer)
    return not isinstance(inner, ShardedOptimizer) and any(
        isinstance(p, DTensor) for g in inner.param_groups for p in g["params"]
    )


@torch.no_grad()
def clip_grad_norm(
    optimizer: Optimizer, max_norm: float, *, group: Any = None, norm_type: float = 2.0, ledger: Any = None
) -> Tensor:
    """Clip by the global norm over every rank's shard; returns the total norm.

    Stage 1: over the rows each rank owns (``clip_grad_norm_rows``). Stage 2/3: the
    sharded parameters (``clip_grad_norm_params``). Unsharded (plain) parameters:
    ``clip_grad_norm_``.
    """
    inner = getattr(optimizer, "_optimizer", optimizer)
    if isinstance(inner, ShardedOptimizer):
        return clip_grad_norm_rows(inner.full_params, max_norm, group=group, norm_type=norm_type, ledger=ledger)
    params = [p for g in inner.param_groups for p in g["params"]]
    if not _is_sharded(optimizer):
        return torch.nn.utils.clip_grad_norm_(params, max_norm, norm_type=norm_type)
    return clip_grad_norm_params(params, max_norm, group=group, norm_type=norm_type, ledger=ledger)


@torch.no_grad()
def clip_grad_norm_rows(
    params: Iterable[Tensor], max_norm: float, *, group: Any = None, norm_type: float = 2.0, ledger: Any = None
) -> Tensor:
    """Stage 1: clip full parameters' grads by their global norm, reading only the rows
    this rank owns, the only reduced ones ([Note: stage-1 partitioned reduce]); 0-dim
    gradients (reduced whole) count once. One fp32 scalar all-reduce."""
    rank = dist.get_rank(group) if dist.is_available() and dist.is_initialized() else 0
    world = dist.get_world_size(group) if dist.is_available() and dist.is_initialized() else 1
    rows, whole = [], []
    for p in params:
        if p.grad is None:
            continue
        if p.grad.dim() == 0:
            whole.append(p.grad)
        else:
            lo, hi = row_range(p.grad.shape[0], rank, world)
            rows.append(p.grad[lo:hi])
    return _clip_local(rows, whole, max_norm, group=group, norm_type=norm_type, ledger=ledger)


@torch.no_grad()
def clip_grad_norm_params(
    params: Iterable[Tensor], max_norm: float, *, group: Any = None, norm_type: float = 2.0, ledger: Any = None
) -> Tensor:
    """Clip ``params``' grads by their global norm, whether sharded (DTensor) or not.

    |g|^p summed over the local shards of DTensor gradients and all-reduced, plus (once,
    not N times) the replicated gradients FSDP2 leaves whole. Bytes sent per rank: one
    fp32 scalar all-reduce when any gradient is sharded, none otherwise (then this is
    ``torch.nn.utils.clip_grad_norm_``).
    """
    params = list(params)
    grads = [p.grad for p in params if p.grad is not None]
    if not any(isinstance(g, DTensor) for g in grads):
        return torch.nn.utils.clip_grad_norm_(params, max_norm, norm_type=norm_type)
    sharded = [g.to_local() for g in grads if isinstance(g, DTensor)]
    replicated = [g for g in grads if not isinstance(g, DTensor)]
    return _clip_local(sharded, replicated, max_norm, group=group, norm_type=norm_type, ledger=ledger)


def _clip_local(sharded: list[Tensor], replicated: list[Tensor], max_norm: float, *, group: Any, norm_type: float,
                ledger: Any) -> Tensor:
    """|g|^p of this rank's parts of ``sharded`` all-reduced, plus ``replicated`` once;
    every part then scaled in place by the same factor. Returns the total norm."""
    parts = [*sharded, *replicated]
    device = parts[0].device if parts else torch.device("cpu")
    if norm_type == float("inf"):
        def amax(ts: list[Tensor]) -> Tensor:
            return torch.stack([t.abs().max().float() for t in ts if t.numel()] or [torch.zeros((), device=device)]).max()

        total = torch.maximum(_reduce(amax(sharded).clone(), dist.ReduceOp.MAX, group, ledger), amax(replicated))
    else:
        def powsum(ts: list[Tensor]) -> Tensor:
            acc = torch.zeros((), dtype=torch.float32, device=device)
            for t in ts:
                acc += torch.linalg.vector_norm(t.float(), norm_type) ** norm_type
            return acc

        total = (_reduce(powsum(sharded), dist.ReduceOp.SUM, group, ledger) + powsum(replicated)) ** (1.0 / norm_type)
    coef = torch.clamp(max_norm / (total + 1e-6), max=1.0)
    for g in parts:
        g.mul_(coef.to(g.dtype))
    return total


@torch.no_grad()
def clip_grad_value(optimizer: Optimizer, clip_value: float) -> None:
    """Elementwise clip: local, no communication, identical to DDP."""
    for g in local_grads(optimizer):
        g.clamp_(-clip_value, clip_value)


class ShardedGradScaler(torch.amp.GradScaler):
    """``torch.amp.GradScaler`` whose inf/NaN check is global (see [Note: global inf check])."""

    def __init__(self, device: str = "cuda", *, group: Any = None, ledger: Any = None, **kwargs: Any) -> None:
        super().__init__(device=device, **kwargs)
        self.group = group
        self.ledger = ledger

    def _unscale_grads_(  # type: ignore[override]
        self, optimizer: Optimizer, inv_scale: Tensor, found_inf: Tensor, allow_fp16: bool
    ) -> dict[torch.device, Tensor]:
        buckets: dict[tuple[torch.device, torch.dtype], list[Tensor]] = defaultdict(list)
        for g in local_grads(optimizer):
            buckets[(g.device, g.dtype)].append(g)
        per_device: dict[torch.device, Tensor] = {}
        with torch.no_grad():
            for (device, _), grads in buckets.items():
                f = per_device.setdefault(device, found_inf.to(device))
                torch._amp_foreach_non_finite_check_and_unscale_(grads, f, inv_scale.to(device))
            # A rank whose shards are all empty still has to take part in the all-reduce.
            merged = sum((f.to(found_inf.device) for f in per_device.values()), torch.zeros_like(found_inf))
            merged = _reduce(merged.clamp_(max=1.0), dist.ReduceOp.MAX, self.group, self.ledger)
        return {found_inf.device: merged}


class PrecisionPolicy:
    """What a precision flag (the table above) means for the engine: the dtypes, the FSDP2
    mixed-precision policy, the module conversion, and the grad scaler of ``16-mixed``.
    ``ZeroEngine`` takes one; the Lightning plugin ``ZeroPPPrecision`` is one."""

    def __init__(self, precision: PrecisionFlag = "32-true", *, device: str = "cpu", scaler: Any = None) -> None:
        if precision not in SUPPORTED:
            raise ValueError(
                f"Trainer(precision={precision!r}) is not supported by the zeropp strategy. "
                f"Fix: use one of {', '.join(SUPPORTED)}."
            )
        self.precision = precision  # type: ignore[assignment]
        self.device = device
        self._own_scaler = precision == "16-mixed" and scaler is None
        # A "cuda" plugin built before the devices are known, on a machine without CUDA, gets its
        # scaler in bind(): built now, torch's GradScaler would warn that it disables itself.
        if self._own_scaler and (device != "cuda" or torch.cuda.is_available()):
            scaler = ShardedGradScaler(device=device)
        self.scaler = scaler
        self.ledger: Any = None

    def bind(self, device_type: str, ledger: Any = None, group: Any = None) -> None:
        """Called by the engine once the device is known.

        Lightning hands the plugin to the strategy before it sets the devices, so the
        autocast device and the scaler are fixed here, not in ``__init__``.
        """
        if self._own_scaler and (self.scaler is None or device_type != self.device):
            self.scaler = ShardedGradScaler(device=device_type)
        self.device = device_type
        self.ledger = ledger
        if isinstance(self.scaler, ShardedGradScaler):
            self.scaler.group, self.scaler.ledger = group, ledger

    @property
    def half_dtype(self) -> torch.dtype | None:
        return _HALF.get(self.precision.split("-")[0]) if self.precision != "32-true" else None

    @property
    def is_mixed(self) -> bool:
        return self.precision.endswith("-mixed")

    def mp_policy(self, gather_16bit: bool = True, reduce_dtype: torch.dtype | None = None) -> Any:
        """FSDP2 mixed-precision policy for stage 2/3: 16-bit gathers (unless ``gather_16bit`` is
        False: fp32 gathers, autocast alone lowers the compute); gradients reduced in
        ``reduce_dtype`` (``ZeroConfig.reduce_dtype``; None: fp32 under mixed precision, the
        parameters' dtype otherwise)."""
        from torch.distributed.fsdp import MixedPrecisionPolicy

        if self.is_mixed and gather_16bit:
            return MixedPrecisionPolicy(param_dtype=self.half_dtype, reduce_dtype=reduce_dtype or torch.float32)
        return MixedPrecisionPolicy(reduce_dtype=reduce_dtype)

    def convert_module(self, module: torch.nn.Module) -> torch.nn.Module:
        if self.precision.endswith("-true") and self.half_dtype is not None:
            return module.to(dtype=self.half_dtype)
        return module

    @contextmanager
    def _default_dtype(self) -> Generator[None, None, None]:
        """``-true`` flags: tensors created inside are in the half dtype."""
        if self.precision.endswith("-true") and self.half_dtype is not None:
            previous = torch.get_default_dtype()
            torch.set_default_dtype(self.half_dtype)
            try:
                yield
            finally:
                torch.set_default_dtype(previous)
        else:
            yield

    def _autocast(self) -> AbstractContextManager[Any]:
        """``-mixed`` flags: compute in the half dtype under autocast."""
        if self.is_mixed:
            return torch.autocast(self.device, dtype=self.half_dtype, cache_enabled=False)
        return nullcontext()

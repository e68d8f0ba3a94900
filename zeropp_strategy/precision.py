"""Precision for sharded training: what each Lightning precision flag means under ZeRO.

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
from collections.abc import Callable, Generator, Iterable
from contextlib import contextmanager, nullcontext
from typing import Any, Literal

import torch
import torch.distributed as dist
from lightning.pytorch.plugins.precision import Precision
from lightning.pytorch.utilities import GradClipAlgorithmType
from torch import Tensor
from torch.distributed.tensor import DTensor
from torch.optim import LBFGS, Optimizer

from zeropp_strategy.engine.stage1 import ShardedOptimizer, row_range
from zeropp_strategy.engine.dtensor import local as _local

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
    """All-reduce a scalar, booked as OTHER when a ledger is given (4 bytes to each peer... see ledger)."""
    if dist.is_available() and dist.is_initialized():
        if ledger is not None:
            from zeropp_strategy.comm.collectives import all_reduce
            from zeropp_strategy.comm.ledger import CommKind

            all_reduce(t, ledger=ledger, kind=CommKind.OTHER, group=group, op=op)
        else:
            dist.all_reduce(t, op=op, group=group)
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


class ZeroPPPrecision(Precision):
    """Lightning precision plugin for ``ZeroPPStrategy`` (any of the flags above)."""

    def __init__(self, precision: PrecisionFlag = "32-true", *, device: str = "cpu", scaler: Any = None) -> None:
        if precision not in SUPPORTED:
            raise ValueError(
                f"Trainer(precision={precision!r}) is not supported by the zeropp strategy. "
                f"Fix: use one of {', '.join(SUPPORTED)}."
            )
        self.precision = precision  # type: ignore[assignment]
        self.device = device
        self._own_scaler = precision == "16-mixed" and scaler is None
        if self._own_scaler:
            scaler = ShardedGradScaler(device=device)
        self.scaler = scaler
        self.ledger: Any = None

    def bind(self, device_type: str, ledger: Any = None, group: Any = None) -> None:
        """Called by the strategy once the device is known.

        Lightning hands the plugin to the strategy before it sets the devices, so the
        autocast device and the scaler are fixed here, not in ``__init__``.
        """
        if self._own_scaler and device_type != self.device:
            self.scaler = ShardedGradScaler(device=device_type)
        self.device = device_type
        self.ledger = ledger
        if isinstance(self.scaler, ShardedGradScaler):
            self.scaler.group, self.scaler.ledger = group, ledger

    # -- dtypes ---------------------------------------------------------------------------

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
        if self.precision.endswith("-true") and self.half_dtype is not None:
            previous = torch.get_default_dtype()
            torch.set_default_dtype(self.half_dtype)
            try:
                yield
            finally:
                torch.set_default_dtype(previous)
        else:
            yield

    @contextmanager
    def tensor_init_context(self) -> Generator[None, None, None]:
        with self._default_dtype():
            yield

    @contextmanager
    def module_init_context(self) -> Generator[None, None, None]:
        with self._default_dtype():
            yield

    @contextmanager
    def forward_context(self) -> Generator[None, None, None]:
        if self.is_mixed:
            ctx = torch.autocast(self.device, dtype=self.half_dtype, cache_enabled=False)
        else:
            ctx = nullcontext()
        with ctx, self._default_dtype():
            yield

    # -- scaling and clipping ------------------------------------------------------------

    def pre_backward(self, tensor: Tensor, module: Any) -> Tensor:  # type: ignore[override]
        if self.scaler is not None:
            tensor = self.scaler.scale(tensor)
        return super().pre_backward(tensor, module)

    def optimizer_step(  # type: ignore[override]
        self, optimizer: Any, model: Any, closure: Callable[[], Any], **kwargs: Any
    ) -> Any:
        if self.scaler is None:
            return super().optimizer_step(optimizer, model=model, closure=closure, **kwargs)
        if isinstance(optimizer, LBFGS):
            raise TypeError("precision='16-mixed' cannot be used with LBFGS. Fix: use precision='bf16-mixed'.")
        closure_result = closure()
        skip = closure_result is None and getattr(model, "automatic_optimization", True)
        if not skip:
            self.scaler.unscale_(optimizer)
        self._after_closure(model, optimizer)
        if skip:
            return closure_result
        out = self.scaler.step(optimizer, **kwargs)
        self.scaler.update()
        return out

    def clip_gradients(
        self,
        optimizer: Optimizer,
        clip_val: int | float = 0.0,
        gradient_clip_algorithm: GradClipAlgorithmType = GradClipAlgorithmType.NORM,
    ) -> None:
        if clip_val <= 0:
            return
        if gradient_clip_algorithm == GradClipAlgorithmType.VALUE:
            clip_grad_value(optimizer, clip_val)
        else:
            clip_grad_norm(optimizer, clip_val, ledger=self.ledger)

    def main_params(self, optimizer: Optimizer) -> Iterable[Tensor]:  # type: ignore[override]
        inner = getattr(optimizer, "_optimizer", optimizer)
        if isinstance(inner, ShardedOptimizer):
            return inner.full_params
        return super().main_params(optimizer)

    def state_dict(self) -> dict[str, Any]:
        return self.scaler.state_dict() if self.scaler is not None else {}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        if self.scaler is not None and state_dict:
            self.scaler.load_state_dict(state_dict)


def from_lightning_plugin(plugin: Precision, device: str) -> ZeroPPPrecision:
    """Translate the plugin Lightning's connector chose for a ``precision=`` flag."""
    if isinstance(plugin, ZeroPPPrecision):
        return plugin
    flag = str(getattr(plugin, "precision", "32-true"))
    if flag in ("32", "32-true"):
        flag = "32-true"
    # Lightning's MixedPrecision knows the accelerator ("cuda"/"cpu"); ours is rebound in
    # setup_environment anyway (see ZeroPPPrecision.bind).
    return ZeroPPPrecision(flag, device=getattr(plugin, "device", device))  # type: ignore[arg-type]

"""Layer: engine. Per-rank bytes in parameters, gradients and optimizer state, and the ZeRO formulas.

Counting is of real storage: each tensor's local storage (a DTensor's local shard),
deduplicated by storage, so a view is never counted twice (stage 1's optimizer shards
are views of the parameters and count once, as parameters).

[Note: the formulas we implement]
P parameters, N ranks, a = bytes per parameter element as held, g = bytes per gradient
element, k = optimizer-state bytes per element (Adam/AdamW: 2 fp32 moments = 8).
Our mixed precision keeps the master in the (fp32) parameters themselves, so there is no
separate master term; K of the ZeRO paper (12 = 4 master + 8 Adam) is a + k here.

    ddp      (a + g + k) P
    stage 1  a P + g P + k P / N          params and grads replicated
    stage 2  a P / N + g P / N + k P / N  at rest (FSDP2 reshards after backward);
             during forward/backward the gathered params add a16 P (16-bit compute
             dtype, or a) for the whole step, as in the paper's 2P + (2+K)P/N
    stage 3  (a + g + k) P / N            at rest; gathered params of one group at a
             time (plus prefetch) during forward/backward

For the paper's fp16 setting (a = g = 2, K = 12): ddp 16P, stage 1 4P + 12P/N,
stage 2 2P + 14P/N, stage 3 16P/N; docs/stages.md works both through.
"""

from __future__ import annotations

import resource
from collections.abc import Iterable
from dataclasses import asdict, dataclass
from typing import TYPE_CHECKING, Any

import torch
from torch import nn
from torch.optim import Optimizer

from zeropp_strategy.engine.frozen import Int8Weight
from zeropp_strategy.engine.dtensor import local as _local

if TYPE_CHECKING:  # a runtime import would be circular (offload imports engine)
    from zeropp_strategy.offload import OffloadOptimizer




class _StorageCounter:
    def __init__(self) -> None:
        self._seen: set[tuple[str, int]] = set()

    def add(self, t: torch.Tensor | None) -> int:
        if t is None:
            return 0
        t = _local(t)
        if t.device.type == "meta":
            return 0
        if isinstance(t, Int8Weight):  # int8 frozen storage: codes + scales
            return self.add(t.codes) + self.add(t.scales)
        storage = t.untyped_storage()
        key = (str(t.device), storage.data_ptr())
        if key in self._seen or storage.nbytes() == 0:
            return 0
        self._seen.add(key)
        return storage.nbytes()


@dataclass(frozen=True)
class MemoryStats:
    """What this rank holds, in bytes, and what the formula for its stage predicts."""

    rank: int
    stage: int
    world_size: int
    num_params: int  # P: elements of all parameters (global, unsharded)
    param_bytes: int
    grad_bytes: int
    optimizer_bytes: int
    predicted_param_bytes: int
    predicted_grad_bytes: int
    predicted_optimizer_bytes: int
    peak_rss_bytes: int
    cuda_allocated_bytes: int = 0
    offloaded_cpu_bytes: int = 0  # optimizer state (or swap buffers) in host RAM, with offload
    offloaded_nvme_bytes: int = 0  # optimizer state in swap files, with NVMe offload

    @property
    def total_bytes(self) -> int:
        return self.param_bytes + self.grad_bytes + self.optimizer_bytes

    @property
    def predicted_total_bytes(self) -> int:
        return self.predicted_param_bytes + self.predicted_grad_bytes + self.predicted_optimizer_bytes

    def as_dict(self) -> dict[str, int]:
        d = asdict(self)
        d["total_bytes"] = self.total_bytes
        d["predicted_total_bytes"] = self.predicted_total_bytes
        return d

    def format(self) -> str:
        mb = 2**20
        rows = [
            ("params", self.param_bytes, self.predicted_param_bytes),
            ("grads", self.grad_bytes, self.predicted_grad_bytes),
            ("optimizer", self.optimizer_bytes, self.predicted_optimizer_bytes),
            ("total", self.total_bytes, self.predicted_total_bytes),
        ]
        lines = [f"memory rank {self.rank} (stage {self.stage}, N={self.world_size}, P={self.num_params:,})"]
        lines.append(f"  {'':10s} {'held MiB':>10s} {'formula MiB':>11s}")
        lines += [f"  {name:10s} {held / mb:10.3f} {pred / mb:11.3f}" for name, held, pred in rows]
        if self.grad_bytes == 0 and self.predicted_grad_bytes:
            # Lightning frees gradients before each validation (zero_grad(set_to_none=True))
            lines.append("  (no gradients held now: zero_grad(set_to_none=True) freed them)")
        if self.offloaded_cpu_bytes or self.offloaded_nvme_bytes:
            lines.append(
                f"  offloaded optimizer state: {self.offloaded_cpu_bytes / mb:.3f} MiB host RAM, "
                f"{self.offloaded_nvme_bytes / mb:.3f} MiB NVMe"
            )
        lines.append(f"  peak RSS {self.peak_rss_bytes / mb:.1f} MiB")
        if self.cuda_allocated_bytes:
            lines.append(f"  CUDA allocated {self.cuda_allocated_bytes / mb:.1f} MiB")
        return "\n".join(lines)


def offloaded(optimizer: Optimizer) -> OffloadOptimizer | None:
    """The OffloadOptimizer inside Lightning's and stage 1's wrappers, if any."""
    from zeropp_strategy.engine.stage1 import ShardedOptimizer
    from zeropp_strategy.offload import OffloadOptimizer

    inner = getattr(optimizer, "_optimizer", optimizer)
    inner = inner.optimizer if isinstance(inner, ShardedOptimizer) else inner
    return inner if isinstance(inner, OffloadOptimizer) else None


def _optimizer_state_tensors(optimizers: Iterable[Optimizer]) -> Iterable[torch.Tensor]:
    """State tensors held in the training process's own optimizer (offloaded state excluded)."""
    for opt in optimizers:
        if offloaded(opt) is not None:
            continue
        inner = getattr(opt, "_optimizer", opt)
        for state in inner.state.values():
            for v in state.values():
                if isinstance(v, torch.Tensor):
                    yield v


def _state_bytes_per_elem(optimizers: list[Optimizer], num_trainable: int) -> float:
    """k: optimizer-state bytes per trainable element, read from the states' global sizes."""
    total = 0
    for t in _optimizer_state_tensors(optimizers):
        if t.dim() == 0:
            continue  # Adam's `step` counter: not per element
        total += t.numel() * t.element_size()  # DTensor.numel() is the global size
    return total / max(1, num_trainable)


def _offloaded_bytes(optimizers: Iterable[Optimizer]) -> tuple[int, int]:
    cpu = nvme = 0
    for opt in optimizers:
        off = offloaded(opt)
        if off is not None:
            b = off.offloaded_bytes()
            cpu, nvme = cpu + b["cpu"], nvme + b["nvme"]
    return cpu, nvme


def peak_rss_bytes() -> int:
    # ru_maxrss is KiB on Linux.
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def memory_stats(module: nn.Module, optimizers: list[Optimizer], *, stage: int, rank: int, world_size: int) -> MemoryStats:
    counter = _StorageCounter()
    params = list(module.parameters())
    param_bytes = sum(counter.add(p) for p in params)
    grad_bytes = sum(counter.add(p.grad) for p in params)
    optimizer_bytes = sum(counter.add(t) for t in _optimizer_state_tensors(optimizers))

    num_params = sum(p.numel() for p in params)  # global sizes (DTensor.numel is global)
    trainable = [p for p in params if p.requires_grad]
    num_trainable = sum(p.numel() for p in trainable)
    a = params[0].element_size() if params else 4
    g = a  # gradients take the parameter dtype (fp32 reduce under mixed precision)
    k = _state_bytes_per_elem(optimizers, num_trainable)
    n = world_size
    p_all, p_tr = num_params, num_trainable
    if stage == 1:
        pred = (a * p_all, g * p_tr, k * p_tr / n)
    elif stage in (2, 3):
        # Frozen weights stored as int8 (quantize_frozen_weights) hold codes + scales
        # instead of a bytes per element: R rows x (C + 4 ceil(C / B)) bytes, over N ranks.
        int8 = [(p, _local(p)) for p in params if isinstance(_local(p), Int8Weight)]
        int8_elems = sum(p.numel() for p, _ in int8)
        int8_bytes = sum(
            p.shape[0] * (q.codes.shape[1] + 4 * q.scales.shape[1]) for p, q in int8
        )
        pred = ((a * (p_all - int8_elems) + int8_bytes) / n, g * p_tr / n, k * p_tr / n)
    else:  # 0: plain data parallel, for comparison
        pred = (a * p_all, g * p_tr, k * p_tr)
    cuda = torch.cuda.memory_allocated() if torch.cuda.is_available() else 0
    off_cpu, off_nvme = _offloaded_bytes(optimizers)
    return MemoryStats(
        rank=rank,
        stage=stage,
        world_size=n,
        num_params=num_params,
        param_bytes=param_bytes,
        grad_bytes=grad_bytes,
        optimizer_bytes=optimizer_bytes,
        predicted_param_bytes=int(pred[0]),
        predicted_grad_bytes=int(pred[1]),
        predicted_optimizer_bytes=int(pred[2]),
        peak_rss_bytes=peak_rss_bytes(),
        cuda_allocated_bytes=cuda,
        offloaded_cpu_bytes=off_cpu,
        offloaded_nvme_bytes=off_nvme,
    )


def close_offload(optimizer: Any) -> None:
    """Close the OffloadOptimizer inside Lightning's/Accelerate's/stage 1's wrappers, if any."""
    inner = offloaded(getattr(optimizer, "optimizer", optimizer)) or offloaded(optimizer)
    if inner is not None:
        inner.close()

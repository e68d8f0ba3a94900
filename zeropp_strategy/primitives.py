"""Layer: primitives, the bottom one beside kernels: torch-only building blocks that the
engine and offload both use, so that neither has to import the other's package (offload
sits below the engine: the engine drives the host optimizer and the parameter store).

- the one place that tells a DTensor (a sharded parameter, gradient or state) from a
  plain tensor, and gives the part of it this rank holds (``is_dtensor``, ``local``;
  also importable from ``zeropp_strategy.engine.dtensor``);
- ``WrappingOptimizer``, the base of the optimizers that wrap the user's (stage 1's
  ``ShardedOptimizer``, ``OffloadOptimizer``, ``LocalStepOptimizer``; also importable
  from ``zeropp_strategy.engine.stage1``);
- ``follows_param``: whether an optimizer state entry is laid out like its parameter
  (also importable from ``zeropp_strategy.engine.state``);
- ``trim_heap``: give the host heap's free pages back to the OS (glibc's ``malloc_trim``);
- ``prefault``: map fresh host tensors' pages in one call per tensor instead of one fault per page.
"""

from __future__ import annotations

import ctypes
import mmap
import sys
from collections.abc import Callable, Iterable
from typing import Any

import torch
from torch import Tensor
from torch.distributed.tensor import DTensor
from torch.optim import Optimizer

__all__ = ["Alloc", "Workspace", "WrappingOptimizer", "follows_param", "fresh", "is_dtensor", "local", "prefault", "trim_heap"]


def is_dtensor(t: object) -> bool:
    return isinstance(t, DTensor)


def local(t: Tensor) -> Tensor:
    """This rank's part: the local shard of a DTensor, the tensor itself otherwise."""
    return t.to_local() if isinstance(t, DTensor) else t


_LIBC: Any = None


def _libc() -> Any:
    """glibc through ctypes, or False where there is none."""
    global _LIBC
    if _LIBC is None:
        try:
            _LIBC = ctypes.CDLL("libc.so.6", use_errno=True)
            _LIBC.malloc_trim.argtypes = [ctypes.c_size_t]
            _LIBC.madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
        except (OSError, AttributeError):
            _LIBC = False
    return _LIBC


def trim_heap() -> None:
    """Give the host heap's free pages back to the OS: glibc's ``malloc_trim(0)``, which
    returns the whole free pages of every arena, also those between chunks in use; a no-op
    where the C library is not glibc. Tensors below glibc's mmap threshold (up to 32 MiB,
    raised as large blocks are freed) come from the heap, and a heap fragmented by a step's
    temporaries keeps their pages resident after they are freed ([Note: the memory plan]
    in engine/memory_plan.py has the measurement)."""
    libc = _libc()
    if libc:
        libc.malloc_trim(0)


_MADV_POPULATE_WRITE = 23  # Linux 5.14 and later
_populate_works: bool | None = None if sys.platform == "linux" else False  # None: not asked yet


def _populate(libc: Any, ptr: int, nbytes: int) -> int:
    """``madvise(MADV_POPULATE_WRITE)`` of the whole pages inside ``[ptr, ptr + nbytes)``:
    the bytes mapped, 0 where it failed or there is no whole page."""
    page = mmap.PAGESIZE
    start, end = -(-ptr // page) * page, (ptr + nbytes) // page * page
    if end <= start or libc.madvise(start, end - start, _MADV_POPULATE_WRITE) != 0:
        return 0
    return end - start


def _populate_supported(libc: Any) -> bool:
    """Whether this kernel knows ``MADV_POPULATE_WRITE``: asked once, on fresh anonymous
    memory (EINVAL there means the advice is unknown; on another mapping it can also mean
    that mapping cannot be populated, such as a device's pinned host memory)."""
    global _populate_works
    if _populate_works is None:
        probe = torch.empty(3 * mmap.PAGESIZE, dtype=torch.uint8)
        _populate_works = _populate(libc, probe.data_ptr(), probe.numel()) > 0
    return _populate_works


def prefault(tensors: Iterable[Tensor], min_bytes: int = 1 << 20) -> int:
    """Map the pages of freshly allocated host tensors (their local parts) in one
    ``madvise(MADV_POPULATE_WRITE)`` per storage; returns the bytes mapped. Values are
    untouched. A no-op off Linux, before 5.14, and for storages under ``min_bytes``.

    [Note: prefaulting host shards]
    A fresh allocation's pages are mapped on first write, one fault per 4 KiB page. Filling
    a 2.7B model's fp32 shards on 2 ranks takes 1.33 million such faults per rank, and on a
    virtual machine their cost varies severalfold between runs (docs/pretrained.md). Mapped
    by the kernel in one call per storage, the same pages cost less system time when the
    faults are slow: that load (``benchmarks/pretrained.py``, 2 ranks on 2 cores, an idle
    machine) took 3.9-4.3 s with it and 4.2-4.8 s without in three alternating rounds, with
    2.4-3.2 s of system time per rank with it (four runs) and 3.2-3.8 s without (three).
    The fill alone (``benchmarks/prefault.py``) showed no gain in its recorded runs (idle, and
    beside a 4-rank training run), so the gain is in the load's own mix of work; it is
    modest, and kept because the system time fell in every set of rounds
    (benchmarks/results/pretrained_prefault_2026-11-29.json).
    The memory is the same: the shards are written in full right after."""
    libc = _libc()
    if not (libc and _populate_supported(libc)):
        return 0
    seen, done = set(), 0
    for t in tensors:
        t = local(t)
        if t.device.type != "cpu":
            continue
        try:
            if t.is_pinned():  # mapped already (and a device's pinned memory cannot be populated)
                continue
            storage = t.untyped_storage()
            ptr, nbytes = storage.data_ptr(), storage.nbytes()
        except RuntimeError:  # a wrapper subclass (int4 frozen weights): no storage of its own
            continue
        if nbytes < min_bytes or ptr in seen:
            continue
        seen.add(ptr)
        done += _populate(libc, ptr, nbytes)  # a failure leaves the pages to fault in as written
    return done


Alloc = Callable[[str, int, torch.dtype, torch.device], torch.Tensor]
"""``alloc(role, numel, dtype, device)``: an uninitialized 1-D temporary for ``role``."""


def fresh(role: str, numel: int, dtype: torch.dtype, device: torch.device) -> torch.Tensor:  # noqa: ARG001
    """The default ``Alloc``: a new tensor every call."""
    return torch.empty(numel, dtype=dtype, device=device)


class Workspace:
    """Reused buffers for a collective's temporaries: one per role (and dtype and device),
    grown to the largest size asked for, a view of its first ``numel`` elements returned.
    The caller guarantees that two uses of one role never overlap in time.

    [Note: communication temporaries in a workspace]
    Stage 1's gradient reduce and post-step gather allocate and free their send and receive
    buffers and sums every step, some on the comm thread, in sizes that differ per bucket.
    glibc raises its mmap threshold to the largest block freed (up to 32 MiB) and then
    serves such blocks from its per-thread arenas, which fragment and keep the freed
    pages: stage 1's resident memory grew for six steps to 300-400 MiB above DDP's
    (docs/stages.md). Allocating them once and reusing them keeps the heap still; giving
    each its own mapping instead (freed pages returned at once) held 808-848 MiB against
    DDP's 674-681 at 3.3M parameters but made the step 29% slower, every page faulted in
    again each step."""

    def __init__(self) -> None:
        self._buffers: dict[tuple[str, torch.dtype, torch.device], torch.Tensor] = {}

    def __call__(self, role: str, numel: int, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        key = (role, dtype, torch.device(device))
        buf = self._buffers.get(key)
        if buf is None or buf.numel() < numel:
            self._buffers.pop(key, None)  # the smaller one is freed before the larger one exists
            buf = self._buffers[key] = torch.empty(numel, dtype=dtype, device=device)
        return buf[:numel]


def follows_param(key: str, value: Any, param: torch.Tensor) -> bool:
    """Whether an optimizer state entry is laid out like its parameter (sharded with it).

    torch optimizers keep ``step`` as a plain scalar even for DTensor parameters, while
    per-element state (``exp_avg``...) takes the parameter's layout; for a 0-dim
    parameter both are 0-dim, so the shape alone cannot tell them apart.
    """
    return isinstance(value, torch.Tensor) and key != "step" and tuple(value.shape) == tuple(param.shape)


class WrappingOptimizer(Optimizer):
    """Base of optimizers that wrap the user's: its ``param_groups`` and ``defaults`` are
    the wrapped optimizer's own objects, so LR schedulers (bound to the user's optimizer)
    and code holding the wrapper see the same hyper-parameters. Subclasses set
    ``self.optimizer`` and skip ``Optimizer.__init__``."""

    optimizer: Optimizer

    @property
    def param_groups(self) -> list[dict[str, Any]]:  # type: ignore[override]
        return self.optimizer.param_groups

    @param_groups.setter
    def param_groups(self, value: list[dict[str, Any]]) -> None:
        self.optimizer.param_groups = value

    @property
    def defaults(self) -> dict[str, Any]:  # type: ignore[override]
        return self.optimizer.defaults

    @staticmethod
    def _evaluate(closure: Callable[[], Any] | None) -> Any:
        """Run ``step``'s closure (forward and backward) with grad enabled; its loss."""
        if closure is None:
            return None
        with torch.enable_grad():
            return closure()

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
- ``trim_heap``: give the host heap's free pages back to the OS (glibc's ``malloc_trim``).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch import Tensor
from torch.distributed.tensor import DTensor
from torch.optim import Optimizer

__all__ = ["Alloc", "Workspace", "WrappingOptimizer", "follows_param", "fresh", "is_dtensor", "local", "trim_heap"]


def is_dtensor(t: object) -> bool:
    return isinstance(t, DTensor)


def local(t: Tensor) -> Tensor:
    """This rank's part: the local shard of a DTensor, the tensor itself otherwise."""
    return t.to_local() if isinstance(t, DTensor) else t


_LIBC: Any = None


def trim_heap() -> None:
    """Give the host heap's free pages back to the OS: glibc's ``malloc_trim(0)``, which
    returns the whole free pages of every arena, also those between chunks in use; a no-op
    where the C library is not glibc. Tensors below glibc's mmap threshold (up to 32 MiB,
    raised as large blocks are freed) come from the heap, and a heap fragmented by a step's
    temporaries keeps their pages resident after they are freed ([Note: the memory plan]
    in engine/memory_plan.py has the measurement)."""
    global _LIBC
    if _LIBC is None:
        try:
            import ctypes

            _LIBC = ctypes.CDLL("libc.so.6")
            _LIBC.malloc_trim.argtypes = [ctypes.c_size_t]
        except (OSError, AttributeError):
            _LIBC = False
    if _LIBC:
        _LIBC.malloc_trim(0)


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

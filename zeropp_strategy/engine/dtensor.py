"""The one place that tells a DTensor (a sharded parameter, gradient or state) from a
plain tensor, and gives the part of it this rank holds."""

from __future__ import annotations

from torch import Tensor
from torch.distributed.tensor import DTensor

__all__ = ["is_dtensor", "local"]


def is_dtensor(t: object) -> bool:
    return isinstance(t, DTensor)


def local(t: Tensor) -> Tensor:
    """This rank's part: the local shard of a DTensor, the tensor itself otherwise."""
    return t.to_local() if isinstance(t, DTensor) else t

"""Layer: comm. Control collectives: votes, flags, object exchanges, broadcasts and
barriers, each booked in the ledger as ``CommKind.CONTROL``.

The training collectives (gathers, reduce-scatters) are the bytes that matter, but "every
byte each rank sends" must include the small ones too: the config check at start, the
"did any rank fail?" vote of ``agree``, the non-finite flag of every step, the uneven-batch
votes of evaluation, the checkpoint path broadcast. They all go through this module.

Bytes per rank, as the ledger counts them ([Note: ledger byte model] in ledger.py):

- ``all_reduce_flag(t)``: an all-reduce of ``t``'s bytes.
- ``all_gather_tensor(t)``: an all-gather of ``t``'s bytes (the front-ends' ``all_gather``,
  e.g. Lightning's ``self.all_gather`` of evaluation scores).
- ``all_gather_object(obj)``: torch first all-gathers each rank's pickled size (8 bytes),
  then every rank's pickle padded to the largest: 8 + max pickled bytes to every peer. The
  largest size is known only after the exchange, so it is booked after it returns.
- ``broadcast_object(obj, src)``: the source sends the size (8 bytes) and the pickle to
  every peer; the others send nothing.
- ``barrier()``: no payload; booked as one call of 0 bytes, so ``calls`` counts it.

``ledger=None`` books into the process's default ledger: the one the running
``ZeroSession`` installed (``set_default_ledger``), so that callers deep in the checkpoint
or evaluation code need not carry a ledger. Without a session nothing is booked.
"""

from __future__ import annotations

import pickle
from typing import Any, TypeVar

import torch
import torch.distributed as dist

from zeropp_strategy.comm.hierarchical import native_all_gather
from zeropp_strategy.comm.ledger import CommKind, CommLedger

__all__ = ["all_gather_object", "all_gather_tensor", "all_reduce_flag", "barrier", "book_control_all_gather",
           "book_control_all_reduce", "broadcast_object", "distributed", "set_default_ledger"]

T = TypeVar("T")
_SIZE_BYTES = 8  # torch sends each pickle's size as one int64 first
_default_ledger: CommLedger | None = None


def set_default_ledger(ledger: CommLedger | None) -> None:
    """Book control collectives called without a ledger into ``ledger`` (None: stop)."""
    global _default_ledger
    _default_ledger = ledger


def _book(ledger: CommLedger | None) -> CommLedger | None:
    return ledger if ledger is not None else _default_ledger


def distributed() -> bool:
    """Whether a default process group exists (every helper here is a no-op without one)."""
    return dist.is_available() and dist.is_initialized()


def _ranks(group: Any) -> list[int]:
    return dist.get_process_group_ranks(group) if group is not None else list(range(dist.get_world_size()))


def _pickled_bytes(obj: Any) -> int:
    return len(pickle.dumps(obj))


def all_reduce_flag(tensor: torch.Tensor, *, op: Any = dist.ReduceOp.MAX, ledger: CommLedger | None = None,
                    group: Any = None) -> torch.Tensor:
    """In-place all-reduce of a small flag or vote tensor (MAX by default); returns it."""
    if not distributed():
        return tensor
    if (ledger := _book(ledger)) is not None:
        ledger.record_all_reduce(CommKind.CONTROL, tensor.numel() * tensor.element_size(), _ranks(group))
    dist.all_reduce(tensor, op=op, group=group)
    return tensor


def book_control_all_reduce(tensor: torch.Tensor, *, ledger: CommLedger | None = None, group: Any = None) -> None:
    """Book an all-reduce of ``tensor`` that the caller sends itself (a front-end's
    framework reduce: Lightning's ``self.log(..., sync_dist=True)``, Fabric's
    ``all_reduce``) as CONTROL."""
    if distributed() and (ledger := _book(ledger)) is not None:
        ledger.record_all_reduce(CommKind.CONTROL, tensor.numel() * tensor.element_size(), _ranks(group))


def book_control_all_gather(tensor: torch.Tensor, *, ledger: CommLedger | None = None, group: Any = None) -> None:
    """Book an all-gather of ``tensor`` (a vote sent with ``dist.all_gather`` by the caller,
    who needs the per-rank tensors) as CONTROL."""
    if distributed() and (ledger := _book(ledger)) is not None:
        ledger.record_all_gather(CommKind.CONTROL, tensor.numel() * tensor.element_size(), _ranks(group))


def all_gather_tensor(tensor: torch.Tensor, *, ledger: CommLedger | None = None, group: Any = None) -> torch.Tensor:
    """Every rank's ``tensor`` stacked in rank order, shape ``(world, *tensor.shape)``; the
    tensor itself without a process group (as Lightning's ``all_gather`` returns it). Not
    differentiable: what a front-end's ``all_gather(..., sync_grads=False)`` needs, without
    torch's deprecated ``torch.distributed.nn`` path that Lightning's own takes."""
    if not distributed():
        return tensor
    flat = tensor.contiguous().reshape(-1)
    world = dist.get_world_size(group)
    out = torch.empty(world * flat.numel(), dtype=tensor.dtype, device=tensor.device)  # gloo wants it flat
    native_all_gather(out, flat, group, async_op=False)  # the torch 2.13 name where it exists: no warning
    book_control_all_gather(tensor, ledger=ledger, group=group)
    return out.view(world, *tensor.shape)


def all_gather_object(obj: Any, *, ledger: CommLedger | None = None, group: Any = None) -> list[Any]:
    """Every rank's ``obj``, in rank order (``[obj]`` without a process group)."""
    if not distributed():
        return [obj]
    size = dist.get_world_size(group)
    everyone: list[Any] = [None] * size
    dist.all_gather_object(everyone, obj, group=group)
    if (ledger := _book(ledger)) is not None:
        largest = max(_pickled_bytes(o) for o in everyone)
        ledger.record_all_gather(CommKind.CONTROL, _SIZE_BYTES + largest, _ranks(group))
    return everyone


def broadcast_object(obj: T, src: int = 0, *, ledger: CommLedger | None = None, group: Any = None) -> T:
    """``obj`` of global rank ``src`` on every rank."""
    if not distributed():
        return obj
    box = [obj]
    dist.broadcast_object_list(box, src, group=group)
    if (ledger := _book(ledger)) is not None:
        ledger.record_broadcast(CommKind.CONTROL, _SIZE_BYTES + _pickled_bytes(box[0]), src, _ranks(group))
    return box[0]


def barrier(*, ledger: CommLedger | None = None, group: Any = None, device: torch.device | None = None) -> None:
    """Wait for every rank of ``group``. ``device``: the CUDA device under NCCL."""
    if not distributed():
        return
    if (ledger := _book(ledger)) is not None:
        ledger.record(CommKind.CONTROL, {})
    if dist.get_backend(group) == "nccl" and device is not None and device.type == "cuda":
        dist.barrier(group=group, device_ids=[device.index])
    else:
        dist.barrier(group=group)

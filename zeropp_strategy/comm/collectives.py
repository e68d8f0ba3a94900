"""Layer: comm. The plain (unquantized) collectives, each booking its bytes into a CommLedger.

Three ways in, one per caller:
- FSDP2 comm objects, ``LedgerAllGather`` / ``LedgerReduceScatter``, installed with
  ``FSDPModule.set_custom_all_gather`` / ``set_custom_reduce_scatter`` (stages 2/3);
- thin wrappers, ``all_reduce`` / ``all_gather_into`` / ``broadcast`` (everything else).

Bytes are booked when the collective is issued (before an async one completes): the
payload is fixed by then, and booking at wait() would miss collectives nobody waits on.
Byte counts follow [Note: ledger byte model] in ``ledger.py``.
"""

from __future__ import annotations

import weakref
from collections.abc import Callable, Sequence

import torch
import torch.distributed as dist

from zeropp_strategy.comm.comm_thread import BackwardDeferral, ThreadGroups
from zeropp_strategy.comm.hierarchical import NodeGroups, all_gather, native_all_gather, reduce_scatter
from zeropp_strategy.comm.ledger import CommKind, CommLedger, Phase
from zeropp_strategy.fsdp_private import AllGather, ReduceScatter  # FSDP2's comm-object bases
from zeropp_strategy.primitives import Alloc, fresh

__all__ = [
    "LedgerAllGather",
    "LedgerReduceScatter",
    "all_gather_into",
    "all_reduce",
    "broadcast",
    "deferrable",
    "group_ranks",
    "tensor_bytes",
]

_ReduceOp = dist.ReduceOp | dist.ReduceOp.RedOpType


def tensor_bytes(tensor: torch.Tensor) -> int:
    return tensor.numel() * tensor.element_size()


# -- group ranks ------------------------------------------------------------------------
# Looked up on every collective, so cached. Weak keys: a destroyed group must not be
# kept alive by us, and a new group reusing its address must not hit a stale entry.
_RANKS_CACHE: weakref.WeakKeyDictionary[dist.ProcessGroup, tuple[int, ...]] = (
    weakref.WeakKeyDictionary()
)


def group_ranks(group: dist.ProcessGroup | None) -> list[int]:
    """The global ranks of ``group`` in group-rank order (``None`` = the world group)."""
    if group is None:
        group = dist.group.WORLD
    ranks = _RANKS_CACHE.get(group)
    if ranks is None:
        ranks = tuple(dist.get_process_group_ranks(group))
        _RANKS_CACHE[group] = ranks
    return list(ranks)


# -- FSDP2 comm objects -----------------------------------------------------------------


class EmptyAlloc:
    """``Comm.allocate`` for every comm object here: a plain ``torch.empty`` buffer."""

    def allocate(
        self,
        size: Sequence[int | torch.SymInt],
        *,
        dtype: torch.dtype,
        device: torch.device,
    ) -> torch.Tensor:
        return torch.empty(*size, dtype=dtype, device=device)


def param_gather_kind(ledger: CommLedger) -> CommKind:
    """A parameter all-gather is booked as forward or backward by the ledger's phase."""
    return CommKind.PARAM_ALLGATHER_BWD if ledger.current_phase is Phase.BACKWARD else CommKind.PARAM_ALLGATHER_FWD


class LedgerAllGather(EmptyAlloc, AllGather):
    """FSDP2's parameter all-gather, booked as forward or backward by the ledger's phase.

    Bytes per rank: ``input_tensor`` bytes (this rank's flat shard, FSDP's padding
    included, since it is really sent) to every other rank of ``group``, in two hops when
    the group spans nodes ([Note: two-hop collectives] in hierarchical.py).
    """

    def __init__(self, ledger: CommLedger, nodes: NodeGroups | None = None) -> None:
        self.ledger = ledger
        self.nodes = nodes

    def __call__(
        self,
        output_tensor: torch.Tensor,
        input_tensor: torch.Tensor,
        group: dist.ProcessGroup,
        async_op: bool = False,
    ) -> dist.Work | None:
        return all_gather(output_tensor, input_tensor, group=group, ranks=group_ranks(group), ledger=self.ledger,
                          kind=param_gather_kind(self.ledger), nodes=self.nodes, async_op=async_op)


def deferrable(params: Sequence[torch.Tensor], output: torch.Tensor, op: _ReduceOp) -> bool:
    """True when FSDP2 will only *view* ``output`` after the reduce-scatter call, so the
    reduce may finish later ([Note: deferred reduce-scatter] in comm_thread.py): AVG (no
    post-divide), host tensors, and for every parameter of the group no cast (same dtype),
    no existing gradient to accumulate into and no post-accumulate-grad hook."""
    return (
        op == dist.ReduceOp.AVG
        and output.device.type == "cpu"
        and bool(params)
        and all(p.dtype == output.dtype and p.grad is None and not getattr(p, "_post_accumulate_grad_hooks", None)
                for p in params)
    )


class LedgerReduceScatter(EmptyAlloc, ReduceScatter):
    """FSDP2's gradient reduce-scatter, booked as ``GRAD_REDUCE``; ``op`` passes through.

    Bytes per rank: ``output_tensor`` elements in ``wire_dtype`` (default: the gradient's
    dtype; padding included) to every other rank of ``group``; on gloo by all-to-all plus
    a local sum, in two hops when the group spans nodes ([Note: two-hop collectives]).
    With a ``deferral`` and ``params`` (the group's sharded parameters, set by
    ``install_comms``) it completes at the end of backward when it may ([Note: deferred
    reduce-scatter]).
    """

    def __init__(self, ledger: CommLedger, nodes: NodeGroups | None = None, *, wire_dtype: torch.dtype | None = None,
                 deferral: BackwardDeferral | None = None) -> None:
        self.ledger = ledger
        self.nodes = nodes
        self.wire_dtype = wire_dtype
        self.deferral = deferral
        self.params: list[torch.Tensor] = []

    def defer(self, ranks: list[int], output: torch.Tensor, op: _ReduceOp,
              job: Callable[[ThreadGroups], object]) -> bool:
        """Hand ``job`` (this reduce on the comm thread's groups) to the deferral when this
        call may finish at the end of backward: a deferral is set, the group is the world
        (the thread's groups mirror it) and ``deferrable``. Returns whether it did."""
        if self.deferral is None or ranks != list(range(dist.get_world_size())) or not deferrable(
                self.params, output, op):
            return False
        self.deferral.submit(job)
        return True

    def __call__(
        self,
        output_tensor: torch.Tensor,
        input_tensor: torch.Tensor,
        group: dist.ProcessGroup,
        op: _ReduceOp,
        async_op: bool = False,
    ) -> dist.Work | None:
        ranks = group_ranks(group)
        if self.wire_dtype is not None and input_tensor.is_floating_point():
            input_tensor = input_tensor.to(self.wire_dtype)
        if self.defer(ranks, output_tensor, op, lambda g: reduce_scatter(
                output_tensor, input_tensor, group=g.world, ranks=ranks, op=op, ledger=self.ledger,
                kind=CommKind.GRAD_REDUCE, nodes=g.nodes)):
            return None
        return reduce_scatter(output_tensor, input_tensor, group=group, ranks=ranks, op=op,
                              ledger=self.ledger, kind=CommKind.GRAD_REDUCE, nodes=self.nodes, async_op=async_op)


# -- thin wrappers ----------------------------------------------------------------------


def all_reduce(
    tensor: torch.Tensor,
    *,
    ledger: CommLedger,
    kind: CommKind,
    group: dist.ProcessGroup | None = None,
    op: _ReduceOp = dist.ReduceOp.SUM,
    async_op: bool = False,
) -> dist.Work | None:
    """In-place all-reduce of ``tensor``.

    Bytes per rank: ``ceil(2 * tensor_bytes / n)`` to every other rank of the group.
    """
    ledger.record_all_reduce(kind, tensor_bytes(tensor), group_ranks(group))
    return dist.all_reduce(tensor, op=op, group=group, async_op=async_op)


def all_gather_into(
    output: torch.Tensor,
    input: torch.Tensor,  # noqa: A002
    *,
    ledger: CommLedger,
    kind: CommKind,
    group: dist.ProcessGroup | None = None,
    nodes: NodeGroups | None = None,
    async_op: bool = False,
    alloc: Alloc = fresh,
) -> dist.Work | None:
    """Gather every rank's ``input`` into the flat ``output`` (``n * input.numel()``).

    Bytes per rank: ``input`` bytes to every other rank of the group (two hops when the
    group spans nodes and ``nodes`` is given, their temporaries from ``alloc``).
    """
    if group is None or nodes is None:
        ledger.record_all_gather(kind, tensor_bytes(input), group_ranks(group))
        return native_all_gather(output, input, group, async_op)
    return all_gather(output, input, group=group, ranks=group_ranks(group), ledger=ledger, kind=kind,
                      nodes=nodes, async_op=async_op, alloc=alloc)


def broadcast(
    tensor: torch.Tensor,
    src: int,
    *,
    ledger: CommLedger,
    kind: CommKind,
    group: dist.ProcessGroup | None = None,
    async_op: bool = False,
) -> dist.Work | None:
    """Broadcast ``tensor`` from global rank ``src`` in place.

    Bytes per rank: ``tensor`` bytes to every other rank of the group on ``src``;
    nothing on the other ranks.
    """
    ledger.record_broadcast(kind, tensor_bytes(tensor), src, group_ranks(group))
    return dist.broadcast(tensor, src=src, group=group, async_op=async_op)

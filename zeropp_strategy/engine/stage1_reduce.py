"""Layer: engine. Stage 1's gradient reduce: DDP's buckets reduce-scattered by rows.

See [Note: stage-1 partitioned reduce] in engine/stage1.py for what each rank ends up
with and why the volume equals DDP's.

    ddp.register_comm_hook(PartitionedReduce(...), partitioned_reduce_hook)

Per bucket (a flat buffer of whole gradients, in DDP's order):
1. scale by 1/N, as DDP does (the same multiply, so the summands are DDP's bit for bit);
2. lay the bucket out rank-major: for each rank r, the rows r owns of every gradient in
   the bucket, each padded to the rows every rank contributes (``chunk_rows``), so that
   every rank's chunk has the same C elements. (N, C), in the wire dtype;
3. reduce-scatter it (comm/hierarchical.py: all-to-all plus a local sum on gloo, two hops
   across nodes), on the comm thread ([Note: comm thread]); write this rank's C reduced
   elements back into its rows of the bucket; all-reduce the 0-dim gradients whole.
   The local sum adds each element's N values in the order gloo's ring all-reduce of
   this bucket would (``ring_order``, [Note: ring order] in comm/hierarchical.py), so
   the rows are DDP's bit for bit on any number of ranks of one node.
Bytes per rank: C x wire bytes to each peer (booked ``GRAD_REDUCE``), plus 8 bytes of
all-reduce per 0-dim gradient in the bucket.
"""

# No ``from __future__ import annotations``: DDP's register_comm_hook inspects the hook's
# ``bucket`` annotation and requires the real ``dist.GradBucket`` object.
import math
from dataclasses import dataclass, field

import torch
import torch.distributed as dist

from zeropp_strategy.comm.collectives import all_reduce, group_ranks
from zeropp_strategy.comm.comm_thread import CommThread, ThreadGroups
from zeropp_strategy.comm.hierarchical import reduce_scatter, ring_blocks
from zeropp_strategy.comm.ledger import CommKind, CommLedger
from zeropp_strategy.engine.grad_reads import ReadWatch
from zeropp_strategy.engine.stage1 import row_range

__all__ = ["PartitionedReduce", "partitioned_reduce_hook"]


@dataclass(frozen=True)
class _Layout:
    """Where each rank's rows sit in one bucket's flat buffer."""

    segments: tuple[tuple[tuple[int, int], ...], ...]  # [rank] -> ((start, stop) per gradient)
    chunk_elems: tuple[int, ...]  # per gradient: chunk_rows * row elements (padded share)
    scalars: tuple[int, ...]  # buffer offsets of the 0-dim gradients
    ring_order: torch.Tensor  # per element of this rank's chunk: its gloo ring block in the bucket

    @property
    def chunk(self) -> int:
        return sum(self.chunk_elems)


def _layout(params: list[torch.Tensor], numel: int, world: int, rank: int, element_bytes: int) -> _Layout:
    offset = 0
    segments: list[list[tuple[int, int]]] = [[] for _ in range(world)]
    chunk_elems: list[int] = []
    scalars: list[int] = []
    for p in params:
        if p.dim() == 0:
            scalars.append(offset)
        else:
            row = p[0].numel()
            chunk_elems.append(math.ceil(p.shape[0] / world) * row)
            for r in range(world):
                lo, hi = row_range(p.shape[0], r, world)
                segments[r].append((offset + lo * row, offset + hi * row))
        offset += p.numel()
    if offset != numel:
        raise RuntimeError(
            f"zeropp stage 1: a DDP gradient bucket holds {numel} elements but its parameters {offset}; this "
            "torch lays buckets out in a way the partitioned reduce does not know. Please report it with the "
            "torch version.")
    # This rank's chunk, element by element: its offset in the bucket; a padding element
    # takes its gradient's last offset (it is summed, never written back).
    offsets = [torch.zeros(0, dtype=torch.int64)]
    for (a, b), c in zip(segments[rank], chunk_elems, strict=True):
        offsets += [torch.arange(a, b), torch.full((c - (b - a),), max(a, b - 1))]
    return _Layout(tuple(tuple(s) for s in segments), tuple(chunk_elems), tuple(scalars),
                   ring_blocks(torch.cat(offsets), numel, world, element_bytes))


@dataclass
class PartitionedReduce:
    """State of ``partitioned_reduce_hook``: where to book, the groups, the wire dtype."""

    ledger: CommLedger
    groups: ThreadGroups
    rank: int
    world: int
    wire_dtype: torch.dtype | None = None
    """dtype the gradients travel in (``ZeroConfig.reduce_dtype``); None = their own."""
    thread: CommThread = field(default_factory=CommThread)
    watch: ReadWatch | None = None
    """Set when the model's ``.grad`` reads are watched ([Note: stage-1 gradient reads])."""
    _layouts: dict[tuple[int, ...], _Layout] = field(default_factory=dict)

    def layout(self, bucket) -> _Layout:  # noqa: ANN001 - a dist.GradBucket
        params = bucket.parameters()
        key = tuple(id(p) for p in params)
        found = self._layouts.get(key)
        if found is None:
            buffer = bucket.buffer()
            found = self._layouts[key] = _layout(params, buffer.numel(), self.world, self.rank, buffer.element_size())
        return found

    @torch.no_grad()
    def reduce(self, buffer: torch.Tensor, layout: _Layout) -> torch.Tensor:
        """Runs on the comm thread: the bucket's rows reduced in place (see module docstring)."""
        world, me = self.world, self.rank
        wire = self.wire_dtype or buffer.dtype
        if layout.chunk:
            pad = buffer.new_zeros(max(layout.chunk_elems))
            pieces = []
            for r in range(world):
                for (a, b), c in zip(layout.segments[r], layout.chunk_elems):
                    pieces.append(buffer[a:b])
                    if b - a < c:
                        pieces.append(pad[: c - (b - a)])
            send = torch.cat(pieces).to(wire)  # (world x chunk), rank-major
            mine = torch.empty(layout.chunk, dtype=wire, device=buffer.device)
            reduce_scatter(mine, send, group=self.groups.world, ranks=group_ranks(self.groups.world),
                           op=dist.ReduceOp.SUM, ledger=self.ledger, kind=CommKind.GRAD_REDUCE,
                           nodes=self.groups.nodes, ring_order=layout.ring_order)
            at = 0
            for (a, b), c in zip(layout.segments[me], layout.chunk_elems):
                buffer[a:b].copy_(mine[at : at + b - a])
                at += c
        if layout.scalars:
            index = torch.tensor(layout.scalars, device=buffer.device)
            scalars = buffer.index_select(0, index)
            all_reduce(scalars, ledger=self.ledger, kind=CommKind.GRAD_REDUCE, group=self.groups.world)
            buffer.index_copy_(0, index, scalars)
        return buffer


def partitioned_reduce_hook(state: PartitionedReduce, bucket) -> torch.futures.Future[torch.Tensor]:  # noqa: ANN001
    """DDP comm hook: this rank's rows of the bucket averaged over the group (module docstring).

    The scaling runs here, on backward's thread, before the bucket is handed to the comm
    thread; the returned future completes when the rows are written back.
    """
    buffer = bucket.buffer()
    if state.watch is not None:  # from now until zero_grad, p.grad is not what DDP would hold
        state.watch.armed = True
    buffer.mul_(1.0 / state.world)  # DDP's own pre-scaling, the same multiply
    layout = state.layout(bucket)
    return state.thread.submit(lambda: state.reduce(buffer, layout))

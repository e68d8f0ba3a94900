"""Layer: engine. Stage 1's gradient reduce: DDP's buckets reduce-scattered by rows.

See [Note: stage-1 partitioned reduce] in engine/stage1.py for what each rank ends up
with and why the volume equals DDP's.

    ddp.register_comm_hook(PartitionedReduce(...), partitioned_reduce_hook)

Per bucket (a flat buffer of whole gradients, in DDP's order):
1. scale by 1/N, as DDP does (the same multiply, so the summands are DDP's bit for bit);
2. lay the bucket out rank-major: for each rank r, the rows r owns of every gradient in
   the bucket, each padded to the rows every rank contributes (``chunk_rows``), so that
   every rank's chunk has the same C elements. (N, C), in the wire dtype, built and sent
   a window of columns at a time on the host (``REDUCE_WINDOW_BYTES``);
3. reduce-scatter each window (comm/hierarchical.py: all-to-all plus a local sum on gloo,
   two hops across nodes), on the comm thread ([Note: comm thread]); write this rank's
   reduced elements back into its rows of the bucket; all-reduce the 0-dim gradients whole.
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
from zeropp_strategy.primitives import Workspace

__all__ = ["REDUCE_WINDOW_BYTES", "PartitionedReduce", "partitioned_reduce_hook"]


@dataclass(frozen=True)
class _Layout:
    """Where each rank's rows sit in one bucket's flat buffer."""

    segments: tuple[tuple[tuple[int, int], ...], ...]  # [rank] -> ((start, stop) per gradient)
    chunk_elems: tuple[int, ...]  # per gradient: chunk_rows * row elements (padded share)
    scalars: tuple[int, ...]  # buffer offsets of the 0-dim gradients
    ring_order: torch.Tensor  # per element of this rank's chunk: its gloo ring block in the bucket
    runs: tuple[tuple[tuple[int, int, int, int], ...], ...]
    """[rank] -> per gradient (offset in the rank's chunk, start, stop in the bucket, padded
    length): chunk elements ``offset .. offset + stop - start`` are the bucket's
    ``start:stop``, the rest up to ``offset + padded`` padding."""

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
    runs = []
    for segs in segments:
        at, mine = 0, []
        for (a, b), c in zip(segs, chunk_elems, strict=True):
            mine.append((at, a, b, c))
            at += c
        runs.append(tuple(mine))
    return _Layout(tuple(tuple(s) for s in segments), tuple(chunk_elems), tuple(scalars),
                   ring_blocks(torch.cat(offsets), numel, world, element_bytes), tuple(runs))


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
    _work: Workspace = field(default_factory=Workspace)
    """The reduce's temporaries, reused bucket after bucket (the comm thread runs one bucket
    at a time): [Note: communication temporaries in a workspace] in primitives.py."""

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
        """Runs on the comm thread: the bucket's rows reduced in place (see module docstring),
        in windows of columns of the (world, chunk) layout, each its own reduce-scatter of
        at most ``REDUCE_WINDOW_BYTES`` on the host (one window on an accelerator), so that
        the temporaries do not grow with the bucket ([Note: communication temporaries in a
        workspace] in primitives.py)."""
        world, me = self.world, self.rank
        wire = self.wire_dtype or buffer.dtype
        if layout.chunk:
            # host buffers only: the CUDA caching allocator reuses its blocks, and NCCL reduces in place
            width = max(1, REDUCE_WINDOW_BYTES // (world * wire.itemsize)) if buffer.device.type == "cpu" \
                else layout.chunk
            for w0 in range(0, layout.chunk, width):
                w1 = min(w0 + width, layout.chunk)
                n = w1 - w0
                send = self._work("rows", world * n, wire, buffer.device)  # (world, n), rank-major
                for r in range(world):
                    _gather_window(send[r * n : (r + 1) * n], buffer, layout.runs[r], w0, w1)
                mine = self._work("reduced", n, wire, buffer.device)
                reduce_scatter(mine, send, group=self.groups.world, ranks=group_ranks(self.groups.world),
                               op=dist.ReduceOp.SUM, ledger=self.ledger, kind=CommKind.GRAD_REDUCE,
                               nodes=self.groups.nodes, ring_order=layout.ring_order[w0:w1], alloc=self._work)
                _scatter_window(buffer, mine, layout.runs[me], w0, w1)
        if layout.scalars:
            index = torch.tensor(layout.scalars, device=buffer.device)
            scalars = buffer.index_select(0, index)
            all_reduce(scalars, ledger=self.ledger, kind=CommKind.GRAD_REDUCE, group=self.groups.world)
            buffer.index_copy_(0, index, scalars)
        return buffer


REDUCE_WINDOW_BYTES = 2 << 20
"""Bytes of the (world, window) send buffer of one reduce-scatter of stage 1's reduce of a
host bucket: one of DDP's 25 MiB goes out as several, and the temporaries stay a few of
these. Buckets in accelerator memory go out whole."""


def _in_window(runs, w0: int, w1: int):  # noqa: ANN001, ANN202 - a _Layout.runs entry; yields slices
    """Per gradient that overlaps elements ``w0:w1`` of a rank's chunk: (where its rows sit
    in the window, where they sit in the bucket, where its padding sits in the window),
    each slice possibly empty."""
    for at, a, b, c in runs:
        if at + c <= w0:
            continue
        if at >= w1:
            break
        lo = max(at, w0)
        hi = max(min(at + b - a, w1), lo)  # the rows in the window (empty if it holds only padding)
        pad_lo = max(at + b - a, w0)
        pad_hi = max(min(at + c, w1), pad_lo)
        yield slice(lo - w0, hi - w0), slice(a + lo - at, a + hi - at), slice(pad_lo - w0, pad_hi - w0)


def _gather_window(dst: torch.Tensor, buffer: torch.Tensor, runs, w0: int, w1: int) -> None:  # noqa: ANN001
    """``dst`` = elements ``w0:w1`` of one rank's chunk (its rows of each gradient, padded
    with zeros), read from the bucket ``buffer``; converts to ``dst``'s dtype as it copies."""
    for rows, in_bucket, pad in _in_window(runs, w0, w1):
        dst[rows].copy_(buffer[in_bucket])
        dst[pad].zero_()


def _scatter_window(buffer: torch.Tensor, src: torch.Tensor, runs, w0: int, w1: int) -> None:  # noqa: ANN001
    """Elements ``w0:w1`` of this rank's chunk (``src``) back into its rows of the bucket;
    padding is dropped."""
    for rows, in_bucket, _ in _in_window(runs, w0, w1):
        buffer[in_bucket].copy_(src[rows])


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

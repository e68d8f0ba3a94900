"""Layer: comm. Plain (unquantized) reduce-scatter and all-gather at their ideal bytes.

Two facts decide how a reduce-scatter or all-gather should move its bytes:

- gloo has no reduce-scatter of its own: torch builds ``reduce_scatter`` from an
  all-reduce, so every gradient crosses the link twice (measured on the veth, see
  docs/stages.md). An all-to-all plus a local sum moves each element once.
- when the group spans nodes, the slow link should carry each element once per node
  pair, not once per rank pair: first combine within the node, then cross.

[Note: two-hop collectives]
Group = the world, M nodes x L ranks per node, contiguous ([Note: contiguous ranks] in
topology.py); ``s`` = elements of one rank's chunk, ``e`` = bytes per element.

reduce-scatter (input W x s, rank j keeps the sum of everybody's chunk j):
  flat  : all-to-all over the group, then sum the W received chunks.
          per rank: (W-1) s e sent, (W-L) s e of it to other nodes.
  2-hop : 1. within the node, send local peer l' the M chunks of ranks (m, l'), all m;
             sum the L contributions -> the node's partial sums of (m, l) for all m;
          2. across nodes, among the ranks with this local index, send node m its
             partial of chunk (m, l); sum the M partials.
          per rank: (L-1) M s e within the node, (M-1) s e across.
all-gather (input s, everyone gets all W chunks in rank order):
  flat  : the backend's own (gloo: a ring; the ring's M node-crossing links each carry
          (W-1) s e, i.e. M (W-1) s e across in all).
  2-hop : 1. across nodes, among the ranks with this local index: M chunks;
          2. within the node: L x M chunks, reordered into rank order (one copy).
          per rank: (M-1) s e across, (L-1) M s e within; W (M-1) s e across in all.
For the 2 x 2 simulated cluster: reduce-scatter crosses with s e per rank (flat
all-to-all 2 s e, gloo's all-reduce-based one 3 s e); all-gather 4 s e in all against
the ring's 6 s e. Measured on the veth by benchmarks/volume.py (docs/benchmarks_volume.md).

The local sums: AVG multiplies every summand by 1/W before the first sum, the multiply
DDP applies to its bucket, so the summands are DDP's bit for bit. The sum itself is either
gloo's ring order (``ring_order``, [Note: ring order]) or, where no order is given, exact
in fp64 and rounded once into the output: the same bits whatever the order of the ranks.
A 16-bit wire (``reduce_dtype="bf16"``) rounds each element to bf16 once per hop, never
while accumulating. Backends with a native reduce-scatter (NCCL) keep it: NCCL's ring and
tree algorithms already reach these volumes.

[Note: ring order]
The same W fp32 values added in two orders may differ in the last bit, and when the ranks'
gradients nearly cancel that bit is not small downstream: Adam's first step moves a
weight by ``lr x g / (|g| + eps)``, so an error dg moves it by ``lr x eps x dg / (|g| +
eps)^2``, where dg is an ulp of the summands, not of g. Measured (tests/test_parity.py,
4 ranks, 2 micro-batches, lr 1e-2): one gradient of four ~1e-3 summands sums to 8.7e-8
(~9 eps); rank order and gloo's order differ by 1.2e-10, the weight by 1.24e-6.
To give DDP's bits, the local sum adds the W values of each element in the order gloo's
ring all-reduce (DDP's host collective) does. gloo's ``ring()`` (allreduce.cc) cuts a
buffer of n elements of e bytes into ``S = roundup(max(ceil(n e / 1 MiB), 2 W), W)``
segments of ``ceil(n / S)`` elements; block k (segments k S/W .. (k+1) S/W - 1) starts
at rank k-1, which sends it to rank k-2, which adds its own values, and so on down to
rank k: ``((x[k-1] + x[k-2]) + x[k-3]) + ... + x[k]`` (ranks mod W). ``ring_blocks``
maps an element's offset in the all-reduced buffer to its k; the caller that knows that
buffer passes them as ``reduce_scatter(..., ring_order=...)`` (stage 1: DDP's own
bucket), and tests/test_ring_order.py checks the bits against ``dist.all_reduce`` on 2,
3 and 4 ranks. FSDP2's buffers (stages 2/3) are not DDP's, so no order is DDP's there:
the exact fp64 sum leaves only DDP's own rounding between the two (0.6e-6 in that
measurement). The two-hop path sums within the node first and uses the fp64 sums too.
Two summands commute: on 2 ranks every order gives gloo's bits.

Every function returns ``None`` (``async_op=False``) or a ``dist.Work`` whose ``wait()``
finishes the collective: the first hop is in flight when the call returns, the local sums
and the second hop run in ``wait()`` ([Note: pending work] below).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from datetime import timedelta

import torch
import torch.distributed as dist

from zeropp_strategy.comm.ledger import CommKind, CommLedger
from zeropp_strategy.primitives import Alloc, fresh
from zeropp_strategy.topology import Topology

__all__ = ["NodeGroups", "PendingWork", "all_gather", "finish_work", "has_native_reduce_scatter", "reduce_scatter", "ring_blocks"]

_ReduceOp = dist.ReduceOp | dist.ReduceOp.RedOpType

# -- compat: torch 2.13 renames the *_tensor collectives to *_single (our minimum, 2.9, has
# only the old names). Picked once at import so that no call warns.
_ALL_GATHER_SINGLE = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
_REDUCE_SCATTER_SINGLE = getattr(dist, "reduce_scatter_single", None)


def native_all_gather(output: torch.Tensor, input: torch.Tensor, group: dist.ProcessGroup | None,  # noqa: A002
                      async_op: bool) -> dist.Work | None:
    """The backend's own all-gather: every rank's ``input`` concatenated into ``output``."""
    return _ALL_GATHER_SINGLE(output, input, group=group, async_op=async_op)


def native_reduce_scatter(output: torch.Tensor, input: torch.Tensor, group: dist.ProcessGroup | None,  # noqa: A002
                          op: _ReduceOp, async_op: bool) -> dist.Work | None:
    """The backend's own reduce-scatter (on gloo: an all-reduce in disguise, 2x the bytes)."""
    if _REDUCE_SCATTER_SINGLE is not None:
        return _REDUCE_SCATTER_SINGLE(output=output, input=input, group=group, op=op, async_op=async_op)
    return dist.reduce_scatter_tensor(output, input, op=op, group=group, async_op=async_op)


def has_native_reduce_scatter(tensor: torch.Tensor) -> bool:
    """Accelerator tensors go through NCCL-like backends with a real reduce-scatter; host
    tensors through gloo, which has none (see the module docstring)."""
    return tensor.device.type != "cpu"


@dataclass(frozen=True)
class NodeGroups:
    """The world's node structure, for two-hop collectives: built once by the engine."""

    topology: Topology
    intra_group: dist.ProcessGroup
    """The ranks of this rank's node."""
    inter_group: dist.ProcessGroup
    """The ranks with this rank's local index, one per node."""

    def two_hop(self, ranks: list[int]) -> bool:
        """True when ``ranks`` is the world in order and it spans nodes with several ranks
        each: only then does a two-hop collective send fewer bytes across."""
        t = self.topology
        return t.num_nodes > 1 and t.ranks_per_node > 1 and ranks == list(range(t.world_size))


# -- pending work -----------------------------------------------------------------------


class PendingWork(dist.Work):
    """A collective in flight plus what must run once it completes.

    [Note: pending work]
    ``wait()`` waits for the first collective, then runs ``then`` (local sums, the second
    hop, a dequantize), once; later calls return at once. An error in the collective or in
    ``then`` is raised from ``wait()`` on this rank; the peers' own collectives fail with it
    (gloo reports the broken connection), so every rank sees an error, none hangs.
    FSDP2 recognises the object as async work (it is a ``dist.Work``) and calls ``wait()``
    right before it needs the gathered parameters.
    """

    def __init__(self, work: dist.Work | None, then: Callable[[], None]) -> None:
        super().__init__()
        self._work: dist.Work | None = work
        self._then: Callable[[], None] | None = then
        self._error: BaseException | None = None

    def wait(self, timeout: timedelta | None = None) -> bool:  # noqa: ARG002 - the collective's own timeout applies
        if self._error is not None:
            raise self._error
        if self._then is None:
            return True
        then, work = self._then, self._work
        self._then = self._work = None
        try:
            if work is not None:
                work.wait()
            then()
        except BaseException as e:
            self._error = e
            raise
        return True

    def is_completed(self) -> bool:
        return self._then is None

    def is_success(self) -> bool:
        return self._then is None and self._error is None


def finish_work(work: dist.Work | None, then: Callable[[], None], async_op: bool) -> dist.Work | None:
    """``work`` (the first collective, in flight) then ``then``: as pending work with
    ``async_op``, else run to the end now ([Note: pending work])."""
    pending = PendingWork(work, then)
    if async_op:
        return pending
    pending.wait()
    return None


def _sum_dtype(dtype: torch.dtype) -> torch.dtype:
    return torch.float32 if dtype in (torch.bfloat16, torch.float16) else dtype


# -- reduce-scatter -----------------------------------------------------------------------

_GLOO_MAX_SEGMENT_BYTES = 1 << 20  # gloo's AllreduceOptions::kMaxSegmentSize; torch keeps the default


def ring_blocks(offsets: torch.Tensor, numel: int, world: int, element_bytes: int) -> torch.Tensor:
    """Per element at ``offsets`` of a buffer of ``numel`` elements of ``element_bytes``
    that gloo's ring all-reduces over ``world`` ranks: the block it falls in, which sets
    the order its W values are added in ([Note: ring order])."""
    if numel <= 0 or world < 1:
        raise ValueError(f"ring_blocks: numel={numel}, world={world}; both must be positive. Fix: pass the "
                         "all-reduced buffer's element count and the group size.")
    max_segment_elems = max(1, _GLOO_MAX_SEGMENT_BYTES // element_bytes)
    segments = -(-max(-(-numel // max_segment_elems), 2 * world) // world) * world
    block_elems = -(-numel // segments) * (segments // world)
    return torch.div(offsets, block_elems, rounding_mode="floor").to(torch.int64)


def reduce_scatter(
    output: torch.Tensor,
    input: torch.Tensor,  # noqa: A002 - torch's own parameter name
    *,
    group: dist.ProcessGroup,
    ranks: list[int],
    op: _ReduceOp,
    ledger: CommLedger,
    kind: CommKind,
    nodes: NodeGroups | None,
    async_op: bool = False,
    ring_order: torch.Tensor | None = None,
    alloc: Alloc = fresh,
) -> dist.Work | None:
    """Reduce ``input`` (W chunks of ``output.numel()``) over ``group``; this rank keeps its
    chunk in ``output``. ``ranks``: the group's global ranks (``group_ranks(group)``).
    ``input`` travels in its own dtype (the wire dtype); ``output`` may be wider (fp32 sums
    of bf16 gradients land in fp32 without a last rounding). ``ring_order``: per element
    of ``output``, its ``ring_blocks`` in the buffer DDP all-reduces; the flat path then
    adds in gloo's ring order, DDP's bits ([Note: ring order]). Without it (and in the
    two-hop path) the sum is exact in fp64, rounded once into ``output``. ``alloc``: where
    the temporaries come from (a ``Workspace``: [Note: communication temporaries in a
    workspace] in primitives.py).

    Bytes per rank: see [Note: two-hop collectives]; the ledger books what each hop sends.
    """
    s = output.numel()
    world = len(ranks)
    if has_native_reduce_scatter(input) or op not in (dist.ReduceOp.SUM, dist.ReduceOp.AVG) or world == 1:
        ledger.record_reduce_scatter(kind, s * input.element_size(), ranks)
        if output.dtype == input.dtype:
            return native_reduce_scatter(output, input, group, op, async_op)
        # a wire dtype other than the gradient's (ZeroConfig.reduce_dtype): reduce in it, then cast
        wire = torch.empty(s, dtype=input.dtype, device=input.device)
        work = native_reduce_scatter(wire, input, group, op, async_op=True)
        return finish_work(work, lambda: output.copy_(wire.view_as(output)), async_op)
    if input.numel() != world * s:
        raise ValueError(f"reduce_scatter: input has {input.numel()} elements, expected {world} x {s}")
    if ring_order is not None and tuple(ring_order.shape) != (s,):
        raise ValueError(f"reduce_scatter: ring_order has shape {tuple(ring_order.shape)}, expected ({s},). Fix: "
                         "one ring_blocks value per element of output.")
    avg = op == dist.ReduceOp.AVG
    if nodes is not None and nodes.two_hop(ranks):
        return _reduce_scatter_two_hop(output, input, nodes, ledger, kind, avg, async_op, alloc)
    e = input.element_size()
    recv = alloc("recv", world * s, input.dtype, input.device)
    ledger.record_reduce_scatter(kind, s * e, ranks)
    work = dist.all_to_all_single(recv, input.reshape(-1).contiguous(), group=group, async_op=True)

    def then() -> None:
        parts = recv.view(world, s)
        if ring_order is None:
            _sum_into(output, parts, world if avg else None, alloc)
        else:
            _ring_sum_into(output, parts, ring_order, world if avg else None, alloc)

    return finish_work(work, then, async_op)


def _prescaled(parts: torch.Tensor, divide_by: int | None) -> torch.Tensor:
    """AVG: every summand times 1/W before any sum, DDP's own multiply (so the summands are
    DDP's bit for bit; W = 3 or 6 round differently otherwise), in the sum dtype (a 16-bit
    wire is widened first). ``parts`` is this module's own receive buffer: fp32 is scaled
    in place."""
    if divide_by is None:
        return parts
    return parts.to(_sum_dtype(parts.dtype)).mul_(1.0 / divide_by)


def _rounded_sum(parts: torch.Tensor, alloc: Alloc = fresh) -> torch.Tensor:
    """Sum over dim 0 where no order is asked for: floating summands add in fp64 (exact for
    a few fp32 ranks), so the caller's cast rounds the true sum once, the same bits for
    any order of the W parts ([Note: ring order])."""
    acc = torch.float64 if parts.is_floating_point() else parts.dtype
    total = alloc("sum", parts.shape[1], acc, parts.device)
    total.copy_(parts[0])
    wide = alloc("summand", parts.shape[1], acc, parts.device)
    for row in parts[1:]:
        total.add_(wide.copy_(row))  # same-dtype adds: a mixed-dtype add_ measured twice as slow
    return total


SUM_CHUNK_ELEMS = 1 << 20
"""Columns summed at a time by ``_sum_into``: its fp64 accumulators then take 16 MiB, not
16 bytes per output element (1.6 GB for the root group of a 4B Llama on 2 ranks)."""


def _sum_into(output: torch.Tensor, parts: torch.Tensor, divide_by: int | None, alloc: Alloc = fresh) -> None:
    """output = the sum over dim 0 of ``parts`` (each scaled by 1/divide_by first), in
    column chunks (elementwise, so the same bits as one pass)."""
    if not output.is_contiguous():
        output.copy_(_rounded_sum(_prescaled(parts, divide_by), alloc).view_as(output))
        return
    flat = output.view(-1)
    for start in range(0, parts.shape[1], SUM_CHUNK_ELEMS):
        cols = parts[:, start : start + SUM_CHUNK_ELEMS]
        flat[start : start + cols.shape[1]].copy_(_rounded_sum(_prescaled(cols, divide_by), alloc))


def _ring_sum_into(output: torch.Tensor, parts: torch.Tensor, blocks: torch.Tensor, divide_by: int | None,
                   alloc: Alloc = fresh) -> None:
    """``_sum_into`` with each column's W values added in gloo's ring order for its block
    ([Note: ring order]), in the wire dtype as gloo does (fp32 for a 16-bit wire). One pass
    per run of equal blocks: a chunk in buffer order (or reversed) has at most W runs."""
    world, n = parts.shape
    parts = _prescaled(parts, divide_by)
    total = alloc("sum", n, _sum_dtype(parts.dtype), parts.device)
    values, counts = torch.unique_consecutive(blocks, return_counts=True)
    at = 0
    for k, c in zip(values.tolist(), counts.tolist(), strict=True):
        acc = total[at : at + c]
        acc.copy_(parts[(k - 1) % world, at : at + c])
        for j in range(2, world + 1):
            acc.add_(parts[(k - j) % world, at : at + c])
        at += c
    output.copy_(total.view_as(output))


def _reduce_scatter_two_hop(
    output: torch.Tensor, input: torch.Tensor, nodes: NodeGroups, ledger: CommLedger,  # noqa: A002
    kind: CommKind, avg: bool, async_op: bool, alloc: Alloc = fresh,
) -> dist.Work | None:
    t = nodes.topology
    M, L, s, e = t.num_nodes, t.ranks_per_node, output.numel(), input.element_size()
    # (M, L, s) -> (L, M, s): row l' holds the chunks of ranks (m, l') for every node m.
    send = alloc("send", M * L * s, input.dtype, input.device)  # the transposed order
    send.view(L, M, s).copy_(input.reshape(M, L, s).transpose(0, 1))
    recv = alloc("recv", M * L * s, input.dtype, input.device)
    peers = t.node_ranks(t.node)
    ledger.record(kind, dict.fromkeys(peers, M * s * e))
    work = dist.all_to_all_single(recv, send, group=nodes.intra_group, async_op=True)

    def then() -> None:
        # recv[l'] = node peer l''s chunks of ranks (m, l) for every m: (L, M, s) -> partial (M, s)
        # AVG scales the W summands here, before the first sum, as DDP scales its bucket
        partial = alloc("partial", M * s, input.dtype, input.device)
        _sum_into(partial, _prescaled(recv.view(L, M * s), t.world_size if avg else None), None, alloc)
        across = alloc("across", M * s, input.dtype, input.device)
        ledger.record(kind, {m * L + t.local_rank: s * e for m in range(M)})
        dist.all_to_all_single(across, partial, group=nodes.inter_group)
        _sum_into(output, across.view(M, s), None, alloc)

    return finish_work(work, then, async_op)


# -- all-gather ----------------------------------------------------------------------------


def all_gather(
    output: torch.Tensor,
    input: torch.Tensor,  # noqa: A002
    *,
    group: dist.ProcessGroup,
    ranks: list[int],
    ledger: CommLedger,
    kind: CommKind,
    nodes: NodeGroups | None,
    async_op: bool = False,
    baseline_bytes: int | None = None,
    then: Callable[[], None] | None = None,
    alloc: Alloc = fresh,
) -> dist.Work | None:
    """Every rank's ``input`` concatenated into ``output`` in group-rank order.

    Bytes per rank: see [Note: two-hop collectives]. ``baseline_bytes``: what an
    unquantized shard would have sent (qwZ books its int8 payload against it). ``then``:
    runs once the gather is complete (qwZ's dequantization), before ``wait()`` returns.
    ``alloc``: where the two-hop temporaries come from (as ``reduce_scatter``'s).
    """
    s = input.numel()
    base = s * input.element_size() if baseline_bytes is None else baseline_bytes
    if nodes is None or not nodes.two_hop(ranks) or has_native_reduce_scatter(input):
        ledger.record_all_gather(kind, s * input.element_size(), ranks, baseline_shard_bytes=base)
        work = native_all_gather(output, input, group, async_op=True)
        return finish_work(work, then or (lambda: None), async_op)
    t = nodes.topology
    M, L, e = t.num_nodes, t.ranks_per_node, input.element_size()
    node_chunks = alloc("node_chunks", M * s, input.dtype, input.device)
    ledger.record(kind, {m * L + t.local_rank: s * e for m in range(M)},
                  baseline_bytes_to_rank={m * L + t.local_rank: base for m in range(M)})
    work = native_all_gather(node_chunks, input.reshape(-1).contiguous(), nodes.inter_group, async_op=True)

    def finish() -> None:
        everyone = alloc("everyone", L * M * s, input.dtype, input.device)
        ledger.record(kind, dict.fromkeys(t.node_ranks(t.node), M * s * e),
                      baseline_bytes_to_rank=dict.fromkeys(t.node_ranks(t.node), M * base))
        native_all_gather(everyone, node_chunks, nodes.intra_group, async_op=False)
        # (L, M, s) -> rank order (M, L, s)
        output.view(M, L, s).copy_(everyone.view(L, M, s).transpose(0, 1))
        if then is not None:
            then()

    return finish_work(work, finish, async_op)

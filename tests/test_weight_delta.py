"""qwZ weight deltas ([Note: qwZ weight deltas] in comm/zeropp.py) on 4 gloo ranks as 2
simulated nodes x 2: the gather against the exact 16-bit one, the sender's error feedback
(the copy never drifts more than one step's rounding, and a weight that stops changing
arrives exactly), the bytes booked per hop, and the same weights on every rank."""

from __future__ import annotations

import pytest
import torch

from tests._dist import run_ranks

pytestmark = pytest.mark.timeout(360)

WORLD, NODES, B, N = 4, 2, 64, 1001  # N: not a block multiple
LR = 1e-2  # the change per step of each weight, as AdamW's normalized step gives


RUNS = ((4, 32), (2, 32), (2, 16))  # (bits, cross_node_scale_bits): 2 with bf16 scales is the zeropp_delta preset's


def _worker(rank, world):
    return {run: _gathers(rank, world, *run) for run in RUNS}


def _gathers(rank, world, bits, scale_bits):
    import torch.distributed as dist

    from zeropp_strategy.comm.hierarchical import NodeGroups, native_all_gather
    from zeropp_strategy.comm.ledger import CommKind, CommLedger
    from zeropp_strategy.comm.zeropp import QuantizedAllGather, WeightDeltas
    from zeropp_strategy.kernels import quantized_nbytes
    from zeropp_strategy.kernels.reference import half_step
    from zeropp_strategy.topology import Topology

    topo = Topology.detect(world, rank, simulated_nodes=NODES)
    meshes = topo.build_meshes("cpu")
    ledger = CommLedger(topo)
    group = meshes.world.get_group()
    nodes = NodeGroups(topo, intra_group=meshes.intra_group, inter_group=meshes.inter_group)
    deltas = WeightDeltas(layout=(NODES, world // NODES))
    gather = QuantizedAllGather(ledger, topo, block_elems=B, min_elems=0, bits=bits, nodes=nodes, deltas=deltas,
                                scale_bits=scale_bits)
    direct = QuantizedAllGather(ledger, topo, block_elems=B, min_elems=0, bits=4, nodes=nodes)  # int4 of the weights
    g = torch.Generator().manual_seed(rank)
    master = torch.randn(N, generator=g)  # fp32, as the optimizer's
    steps = []
    for step in range(14):
        if 0 < step <= 8:  # 8 optimizer steps, then the weights stay put
            master += LR * torch.randn(N, generator=g).sign()
        shard = master.to(torch.bfloat16)
        exact = torch.empty(world * N, dtype=torch.bfloat16)
        native_all_gather(exact, shard, group, async_op=False)
        before = None if deltas.kept is None else deltas.kept.clone()
        got = torch.empty_like(exact)
        ledger.reset()
        gather(got, shard, group)
        t = ledger.totals(CommKind.PARAM_ALLGATHER_FWD)
        everyone = torch.empty(world * world * N, dtype=torch.bfloat16)
        native_all_gather(everyone, got, group, async_op=False)
        everyone = everyone.view(world, world * N)
        err = (got.float() - exact.float()).abs().view(world, N)
        # the bound: half a step of the codes of the largest change any shard sent, plus
        # half a bf16 ulp of the largest weight (the kept copy is rounded to bf16 once)
        change = None
        if before is not None:  # of every shard: the rows from the node peer came through its codes
            mine = (exact.view(world, N).float()[[m * 2 + rank % 2 for m in range(NODES)]] - before.float()).abs().max()
            dist.all_reduce(mine, op=dist.ReduceOp.MAX, group=group)
            change = mine.item()
        steps.append({
            "max_err": err.max().item(),
            # (bf16 scales: the scale, so the half step, up to 2^-7 larger)
            "bound": None if change is None else change * half_step(bits) * (1 + 2.0**-7 if scale_bits == 16 else 1)
            + 2.0**-9 * exact.float().abs().max().item(),
            "same_on_every_rank": all(torch.equal(everyone[0], row) for row in everyone),
            "bytes": (t.intra_bytes, t.inter_bytes),
        })
        if step == 8:
            got_direct = torch.empty_like(exact)
            direct(got_direct, shard, group)
            direct_err = (got_direct.float() - exact.float()).abs().max().item()
    return {"steps": steps, "direct_err": direct_err, "q": quantized_nbytes(N, B, bits, scale_bytes=scale_bits // 8),
            "count": deltas.count}


@pytest.fixture(scope="module")
def ranks():
    return run_ranks(_worker, WORLD, timeout_s=300, init_process_group=True)


def _runs(ranks):
    return [(run[0], out[run]) for out in ranks for run in RUNS]


def test_first_gather_sends_the_16bit_shards_and_is_exact(ranks):
    for _, out in _runs(ranks):
        first = out["steps"][0]
        assert first["max_err"] == 0
        # across: one 16-bit shard to the one peer node; inside: both nodes' rows to the node peer
        assert first["bytes"] == (2 * N * 2, N * 2), first["bytes"]


def test_changes_cross_as_codes_and_the_copy_stays_within_one_steps_rounding(ranks):
    for bits, out in _runs(ranks):
        for i, s in enumerate(out["steps"][1:9], start=1):
            assert s["bytes"] == (2 * N * 2, out["q"]), (bits, i, s["bytes"])
            assert s["max_err"] <= s["bound"], (bits, i, s)
        # the point of sending changes: an int4 code of the weights themselves is far coarser,
        # even against 2-bit codes of the changes
        assert max(s["max_err"] for s in out["steps"][1:9]) < 0.1 * out["direct_err"], (bits, out["direct_err"])
        assert out["count"] == 14


def test_a_weight_that_stops_changing_arrives(ranks):
    """The error feedback: what one gather's codes dropped is sent with the next change, so
    after the last step the copy converges to the weights: at 4 bits bit for bit within
    five gathers (exact after two here), at 2 bits (two levels a side) halving its error
    with each gather (0.0078 to 0.0005 in five here)."""
    for bits, out in _runs(ranks):
        errs = [s["max_err"] for s in out["steps"][8:]]
        if bits == 4:
            assert errs[-1] == 0, errs
        else:
            assert errs[-1] < errs[0] and errs[-1] <= 2.0**-10, errs


def test_every_rank_computes_with_the_same_weights(ranks):
    assert all(s["same_on_every_rank"] for _, out in _runs(ranks) for s in out["steps"])

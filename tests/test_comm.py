"""CommLedger byte model (pure) and the ledger-booking collectives (spawned gloo ranks).

    pytest tests/test_comm.py -q

Fake topology for the unit tests: 4 ranks in 2 nodes of 2, seen from rank 0, so rank 1
is an intra-node peer and ranks 2, 3 are inter-node peers.
"""

# No ``from __future__ import annotations``: DDP checks that a comm hook's ``bucket``
# annotation is the real ``dist.GradBucket`` (see _counting_hook).
import json
import threading
from dataclasses import dataclass, field

import pytest
import torch
import torch.distributed as dist
import torch.nn as nn

from tests._dist import run_ranks
from zeropp_strategy.comm.collectives import (
    LedgerAllGather,
    LedgerReduceScatter,
    all_gather_into,
    all_reduce,
    broadcast,
    group_ranks,
)
from zeropp_strategy.comm.hierarchical import NodeGroups, PendingWork, all_gather, reduce_scatter
from zeropp_strategy.comm.comm_thread import ThreadGroups
from zeropp_strategy.comm.ledger import CommKind, CommLedger, CommTotals, Phase
from zeropp_strategy.engine.stage1 import row_range
from zeropp_strategy.engine.stage1_reduce import PartitionedReduce, partitioned_reduce_hook
from zeropp_strategy.topology import Topology

K = CommKind.OTHER


def _ledger(rank: int = 0) -> CommLedger:
    return CommLedger(Topology(world_size=4, rank=rank, ranks_per_node=2))


def _split(t: CommTotals) -> tuple[int, int, int]:
    return (t.intra_bytes, t.inter_bytes, t.calls)


# -- byte model -----------------------------------------------------------------------


def test_all_gather_counts_every_peer_once():
    ledger = _ledger()
    ledger.record_all_gather(K, 40, [0, 1, 2, 3])
    assert _split(ledger.totals(K)) == (40, 80, 1)
    ledger.record_all_gather(K, 40, [1, 2, 3])  # this rank not listed: same bytes
    ledger.record_all_gather(K, 40, [0, 2])  # an inter-node-only group
    assert _split(ledger.totals(K)) == (80, 200, 3)
    assert ledger.totals(K).total_bytes == 280


def test_reduce_scatter():
    ledger = _ledger(rank=3)  # node 1: rank 2 intra, ranks 0 and 1 inter
    ledger.record_reduce_scatter(CommKind.GRAD_REDUCE, 10, range(4))
    assert _split(ledger.totals(CommKind.GRAD_REDUCE)) == (10, 20, 1)


def test_all_reduce_is_rs_plus_ag_with_ceil():
    ledger = _ledger()
    ledger.record_all_reduce(K, 100, [0, 1, 2, 3])  # 2 * 100 / 4 = 50 per peer
    assert _split(ledger.totals(K)) == (50, 100, 1)
    ledger.reset()
    ledger.record_all_reduce(K, 10, [0, 1, 2])  # ceil(20 / 3) = 7 per peer
    assert _split(ledger.totals(K)) == (7, 7, 1)
    ledger.reset()
    ledger.record_all_reduce(K, 10, [0])  # alone: nothing leaves the rank
    assert _split(ledger.totals(K)) == (0, 0, 1)


def test_all_to_all_indexes_by_group_rank():
    ledger = _ledger()
    ledger.record_all_to_all(K, [1, 2, 3, 4], [0, 1, 2, 3])  # self (1 byte) skipped
    assert _split(ledger.totals(K)) == (2, 7, 1)
    ledger.reset()
    ledger.record_all_to_all(K, [1, 2, 3, 4], [2, 3, 0, 1])
    assert _split(ledger.totals(K)) == (4, 3, 1)
    with pytest.raises(ValueError, match="one entry per group rank"):
        ledger.record_all_to_all(K, [1, 2, 3], [0, 1, 2, 3])


def test_broadcast_only_source_sends():
    src = _ledger(rank=0)
    src.record_broadcast(K, 16, 0, range(4))
    assert _split(src.totals(K)) == (16, 32, 1)
    other = _ledger(rank=1)
    other.record_broadcast(K, 16, 0, range(4))
    assert _split(other.totals(K)) == (0, 0, 1)


def test_baseline_defaults_to_payload_and_can_differ():
    ledger = _ledger()
    ledger.record_all_gather(K, 40, range(4))
    t = ledger.totals(K)
    assert (t.baseline_intra_bytes, t.baseline_inter_bytes) == (40, 80)
    # A quantized gather: 20 bytes sent where bf16 would have sent 40.
    ledger.record_all_gather(CommKind.PARAM_ALLGATHER_FWD, 20, range(4), baseline_shard_bytes=40)
    q = ledger.totals(CommKind.PARAM_ALLGATHER_FWD)
    assert (q.intra_bytes, q.inter_bytes, q.baseline_intra_bytes, q.baseline_inter_bytes) == (20, 40, 40, 80)
    ledger.record_all_reduce(K, 7, range(4), baseline_tensor_bytes=14)  # ceil(14/4)=4, ceil(28/4)=7
    ledger.record_reduce_scatter(K, 3, [0, 2], baseline_chunk_bytes=6)
    ledger.record_all_to_all(K, [9, 1, 2, 3], range(4), baseline_bytes_per_dest=[9, 2, 4, 6])
    t = ledger.totals(K)
    assert (t.intra_bytes, t.inter_bytes) == (40 + 4 + 0 + 1, 80 + 8 + 3 + 5)
    assert (t.baseline_intra_bytes, t.baseline_inter_bytes) == (40 + 7 + 0 + 2, 80 + 14 + 6 + 10)
    ledger.reset()
    ledger.record(K, {1: 5, 3: 6}, baseline_bytes_to_rank={1: 10, 2: 1})  # any shape
    t = ledger.totals(K)
    assert (t.intra_bytes, t.inter_bytes, t.baseline_intra_bytes, t.baseline_inter_bytes) == (5, 6, 10, 1)


def test_record_rejects_bad_input():
    ledger = _ledger()
    with pytest.raises(ValueError, match="negative"):
        ledger.record(K, {1: -1})
    with pytest.raises(ValueError, match="outside the world"):
        ledger.record_all_gather(K, 4, [0, 4])
    with pytest.raises(ValueError):
        ledger.record("no_such_kind", {1: 1})
    assert ledger.totals().calls == 0


def test_totals_summary_reset_table():
    ledger = _ledger(rank=2)
    ledger.record_all_gather(CommKind.PARAM_ALLGATHER_FWD, 1_000_000, range(4))
    ledger.record_reduce_scatter(CommKind.GRAD_REDUCE, 500_000, range(4))
    total = ledger.totals()
    assert _split(total) == (1_500_000, 3_000_000, 2)
    summary = json.loads(json.dumps(ledger.summary()))
    assert (summary["rank"], summary["node"]) == (2, 1)
    assert summary["total"]["inter_bytes"] == 3_000_000
    assert summary["total"]["total_bytes"] == 4_500_000
    assert set(summary["by_kind"]) == {k.value for k in CommKind}
    assert summary["by_kind"]["grad_reduce"]["intra_bytes"] == 500_000
    assert summary["by_kind"]["other"]["calls"] == 0
    table = ledger.format_table()
    assert "param_allgather_fwd" in table and "intra MB" in table and "inter MB" in table
    total_row = table.splitlines()[-1].split("|")
    assert total_row[0].strip() == "total" and float(total_row[3]) == 3.0
    ledger.reset()
    assert ledger.totals() == CommTotals()


def test_phase_nesting_restores_previous():
    ledger = _ledger()
    assert ledger.current_phase is Phase.FORWARD
    with ledger.phase(Phase.BACKWARD):
        assert ledger.current_phase is Phase.BACKWARD
        with ledger.phase(Phase.OPTIMIZER):
            assert ledger.current_phase is Phase.OPTIMIZER
        assert ledger.current_phase is Phase.BACKWARD
        with pytest.raises(RuntimeError), ledger.phase(Phase.FORWARD):
            raise RuntimeError("boom")
        assert ledger.current_phase is Phase.BACKWARD
    assert ledger.current_phase is Phase.FORWARD


def test_concurrent_records_are_exact():
    ledger = _ledger()

    def hammer() -> None:
        for _ in range(2000):
            ledger.record_all_gather(K, 3, range(4))

    threads = [threading.Thread(target=hammer) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert _split(ledger.totals(K)) == (3 * 8000, 6 * 8000, 8000)


# -- spawned: one 4-rank run (2 simulated nodes of 2) for every multi-process check ----
# A spawn costs seconds on 2 cores, so the parts below share one run (a module-scoped
# fixture) and each test asserts on its part. Every rank has 1 intra-node peer and 2
# inter-node peers; ledger tuples are (intra bytes, inter bytes, calls).


def _collectives_part(rank: int, topo: Topology, meshes) -> dict:
    ledger = CommLedger(topo)
    out: dict = {"intra_ranks": group_ranks(meshes.intra_group), "world_ranks": group_ranks(None)}

    def booked(name: str) -> None:
        out[name] = _split(ledger.totals())
        ledger.reset()

    x = torch.arange(6, dtype=torch.float32) + rank
    all_reduce(x, ledger=ledger, kind=K)
    assert torch.equal(x, 4 * torch.arange(6, dtype=torch.float32) + 6)
    booked("all_reduce_world")

    y = torch.full((5,), float(rank))
    all_reduce(y, ledger=ledger, kind=K, group=meshes.intra_group)
    assert torch.equal(y, torch.full((5,), float(sum(topo.node_ranks(topo.node)))))
    booked("all_reduce_intra")

    z = torch.full((5,), float(rank))
    work = all_reduce(z, ledger=ledger, kind=K, group=meshes.inter_group, op=dist.ReduceOp.MAX, async_op=True)
    work.wait()
    assert torch.equal(z, torch.full((5,), float(topo.local_rank + 2)))
    booked("all_reduce_inter")

    shard = torch.tensor([rank, 10 * rank, 100 * rank], dtype=torch.int32)
    gathered = torch.empty(12, dtype=torch.int32)
    all_gather_into(gathered, shard, ledger=ledger, kind=CommKind.PARAM_UPDATE)
    assert gathered.tolist() == [v * r for r in range(4) for v in (1, 10, 100)]
    booked("all_gather_into")

    b = torch.full((4,), float(rank), dtype=torch.float64)
    broadcast(b, 2, ledger=ledger, kind=K)
    assert torch.equal(b, torch.full((4,), 2.0, dtype=torch.float64))
    booked("broadcast")

    cpu = torch.device("cpu")
    ag = LedgerAllGather(ledger)
    inp = torch.arange(5, dtype=torch.bfloat16) + rank
    world_out = ag.allocate((20,), dtype=torch.bfloat16, device=cpu)
    ag(world_out, inp, dist.group.WORLD)
    assert torch.equal(world_out, torch.cat([torch.arange(5, dtype=torch.bfloat16) + r for r in range(4)]))
    node_out = ag.allocate((10,), dtype=torch.bfloat16, device=cpu)
    with ledger.phase(Phase.BACKWARD):  # FSDP calls with keywords; so do we here
        ag(output_tensor=node_out, input_tensor=inp, group=meshes.intra_group, async_op=True).wait()
    node_expected = [torch.arange(5, dtype=torch.bfloat16) + r for r in topo.node_ranks(topo.node)]
    assert torch.equal(node_out, torch.cat(node_expected))
    out["ag_fwd"] = _split(ledger.totals(CommKind.PARAM_ALLGATHER_FWD))
    out["ag_bwd"] = _split(ledger.totals(CommKind.PARAM_ALLGATHER_BWD))
    ledger.reset()

    rs = LedgerReduceScatter(ledger)
    full = torch.arange(8, dtype=torch.float32) * (rank + 1)  # summed over ranks: arange * 10
    chunk = rs.allocate((2,), dtype=torch.float32, device=cpu)
    rs(output_tensor=chunk, input_tensor=full, group=dist.group.WORLD, op=dist.ReduceOp.SUM)
    assert torch.equal(chunk, torch.arange(2 * rank, 2 * rank + 2, dtype=torch.float32) * 10)
    rs(chunk, full, dist.group.WORLD, dist.ReduceOp.AVG, async_op=True).wait()  # op passes through
    assert torch.equal(chunk, torch.arange(2 * rank, 2 * rank + 2, dtype=torch.float32) * 2.5)
    booked("reduce_scatter")
    return out


@dataclass
class _CountingReduce(PartitionedReduce):
    bucket_params: list = field(default_factory=list)


def _counting_hook(state: _CountingReduce, bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
    # Notes each bucket's parameter shapes, so the test can compute the expected bytes itself.
    state.bucket_params.append([tuple(p.shape) for p in bucket.parameters()])
    return partitioned_reduce_hook(state, bucket)


def _ddp_part(rank: int, topo: Topology) -> dict:
    """Stage 1's partitioned reduce vs plain DDP over the world: this rank's rows and bytes."""
    from torch.nn.parallel import DistributedDataParallel as DDP

    def make() -> nn.Module:
        torch.manual_seed(0)
        return nn.Sequential(nn.Linear(7, 13), nn.Tanh(), nn.Linear(13, 5), nn.Tanh(), nn.Linear(5, 3))

    # ~100-byte buckets, so that a backward reduces several buckets (from step 2 on:
    # DDP's first step uses one big bucket, then rebuilds them at bucket_cap_mb).
    plain = DDP(make(), bucket_cap_mb=1e-4)
    hooked = DDP(make(), bucket_cap_mb=1e-4)
    ledger = CommLedger(topo)
    state = _CountingReduce(ledger, ThreadGroups.create(topo), rank=rank, world=topo.world_size)
    hooked.register_comm_hook(state, _counting_hook)

    gen = torch.Generator().manual_seed(100 + rank)
    max_err, scale = 0.0, 0.0
    for step in range(2):
        x = torch.randn(6, 7, generator=gen)
        for model in (plain, hooked):
            model.zero_grad(set_to_none=True)
            model(x).pow(2).mean().backward()
        for p, q in zip(plain.parameters(), hooked.parameters(), strict=True):
            lo, hi = row_range(p.shape[0], rank, topo.world_size)
            max_err = max(max_err, (p.grad[lo:hi] - q.grad[lo:hi]).abs().max().item() if hi > lo else 0.0)
            scale = max(scale, p.grad.abs().max().item())
        with torch.no_grad():  # the same step on both (DDP's grads), so step 2 runs on other weights
            for p, q in zip(plain.parameters(), hooked.parameters(), strict=True):
                p -= 0.1 * p.grad
                q.copy_(p)
    state.thread.close()
    grad = ledger.totals(CommKind.GRAD_REDUCE)
    return {
        "max_err": max_err,
        "scale": scale,
        "grad": _split(grad),
        "other_calls": ledger.totals().calls - grad.calls,
        "bucket_params": state.bucket_params,
    }


def _two_hop_part(rank: int, topo: Topology, meshes) -> dict:
    """Two-hop reduce-scatter and all-gather equal the flat ones; their bytes; pending work."""
    nodes = NodeGroups(topo, intra_group=meshes.intra_group, inter_group=meshes.inter_group)
    world = dist.group.WORLD
    ranks = group_ranks(world)
    out: dict = {}
    gen = torch.Generator().manual_seed(rank)
    for dtype in (torch.float32, torch.bfloat16):
        x = torch.randn(4 * 37, generator=gen).to(dtype)  # 37: odd chunk
        exact = x.double().clone()
        dist.all_reduce(exact)
        ledger = CommLedger(topo)
        got = torch.empty(37, dtype=dtype)
        work = reduce_scatter(got, x, group=world, ranks=ranks, op=dist.ReduceOp.AVG, ledger=ledger,
                              kind=CommKind.GRAD_REDUCE, nodes=nodes, async_op=True)
        assert isinstance(work, PendingWork) and not work.is_completed()
        work.wait()
        work.wait()  # a second wait returns at once
        ref = exact[37 * rank: 37 * rank + 37] / 4
        out[f"rs_err_{dtype}"] = (got.double() - ref).abs().max().item()
        out[f"rs_bytes_{dtype}"] = _split(ledger.totals())
        flat = torch.empty(37, dtype=dtype)
        reduce_scatter(flat, x, group=world, ranks=ranks, op=dist.ReduceOp.AVG, ledger=ledger,
                       kind=CommKind.GRAD_REDUCE, nodes=None)
        out[f"rs_flat_err_{dtype}"] = (flat.double() - ref).abs().max().item()
        shard = torch.arange(5, dtype=dtype) + 10 * rank
        ledger.reset()
        gathered = torch.empty(20, dtype=dtype)
        seen = []
        work = all_gather(gathered, shard, group=world, ranks=ranks, ledger=ledger, kind=CommKind.PARAM_UPDATE,
                          nodes=nodes, async_op=True, then=lambda: seen.append(gathered.clone()))
        work.wait()
        out[f"ag_ok_{dtype}"] = torch.equal(gathered, torch.cat([torch.arange(5, dtype=dtype) + 10 * r
                                                                  for r in range(4)]))
        out[f"ag_then_ran_{dtype}"] = len(seen) == 1 and torch.equal(seen[0], gathered)
        out[f"ag_bytes_{dtype}"] = _split(ledger.totals())
    # An error inside a pending collective's continuation surfaces from wait(), every time.
    def boom() -> None:
        raise RuntimeError("continuation failed")

    work = all_gather(torch.empty(4), torch.ones(1), group=world, ranks=ranks, ledger=CommLedger(topo),
                      kind=CommKind.OTHER, nodes=nodes, async_op=True, then=boom)
    errors = []
    for _ in range(2):
        try:
            work.wait()
        except RuntimeError as e:
            errors.append(str(e))
    out["errors"] = errors
    return out


class _Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc1 = nn.Linear(6, 10)  # dims not divisible by 4: FSDP pads dim 0
        self.fc2 = nn.Linear(10, 6)
        self.head = nn.Linear(6, 3)  # no fully_shard of its own: the root manages it

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(torch.relu(self.fc2(torch.relu(self.fc1(x)))))


def _padded_shard_bytes(params, world_size: int) -> int:
    # FSDP2 pads dim 0 up to a multiple of world_size and gives each rank one slice.
    total = 0
    for p in params:
        rows = -(-p.shape[0] // world_size)
        total += rows * (p.numel() // p.shape[0]) * p.element_size()
    return total


def _fsdp_part(rank: int, topo: Topology, meshes) -> dict:
    from torch.distributed.fsdp import FSDPModule, fully_shard

    world_size = topo.world_size
    ledger = CommLedger(topo)
    torch.manual_seed(0)
    ref = _Net()
    net = _Net()
    net.load_state_dict(ref.state_dict())
    shard_bytes = {
        name: _padded_shard_bytes(getattr(net, name).parameters(), world_size)
        for name in ("fc1", "fc2", "head")
    }
    fully_shard(net.fc1, mesh=meshes.world)
    fully_shard(net.fc2, mesh=meshes.world)
    fully_shard(net, mesh=meshes.world)
    gather, reduce = LedgerAllGather(ledger), LedgerReduceScatter(ledger)
    for module in net.modules():
        if isinstance(module, FSDPModule):
            module.set_custom_all_gather(gather)
            module.set_custom_reduce_scatter(reduce)

    batch = torch.randn(4 * world_size, 6, generator=torch.Generator().manual_seed(7))
    with ledger.phase(Phase.FORWARD):
        loss = net(batch[4 * rank : 4 * rank + 4]).pow(2).mean()
    with ledger.phase(Phase.BACKWARD):
        loss.backward()
    # Reference: one process, the whole batch. The mean of 4 equal-sized per-rank means
    # is the batch mean, which is what FSDP's averaged gradients are the gradient of.
    ref(batch).pow(2).mean().backward()
    max_err = 0.0
    for p, q in zip(net.parameters(), ref.parameters(), strict=True):
        max_err = max(max_err, (p.grad.full_tensor() - q.grad).abs().max().item())
    return {
        "shard_bytes": shard_bytes,
        "fwd": _split(ledger.totals(CommKind.PARAM_ALLGATHER_FWD)),
        "bwd": _split(ledger.totals(CommKind.PARAM_ALLGATHER_BWD)),
        "grad": _split(ledger.totals(CommKind.GRAD_REDUCE)),
        "max_err": max_err,
        "ref_scale": max(q.grad.abs().max().item() for q in ref.parameters()),
    }


def _four_rank_worker(rank: int, world_size: int) -> dict:
    topo = Topology.detect(world_size, rank, simulated_nodes=2)
    meshes = topo.build_meshes("cpu")
    return {
        "collectives": _collectives_part(rank, topo, meshes),
        "two_hop": _two_hop_part(rank, topo, meshes),
        "ddp_two_nodes": _ddp_part(rank, topo),
        "ddp_one_node": _ddp_part(rank, Topology.detect(world_size, rank)),
        "fsdp": _fsdp_part(rank, topo, meshes),
    }


@pytest.fixture(scope="module")
def four_ranks() -> list[dict]:
    return run_ranks(_four_rank_worker, 4, timeout_s=240, init_process_group=True)


def test_collectives_results_and_bytes(four_ranks):
    for rank, all_parts in enumerate(four_ranks):
        out = all_parts["collectives"]
        assert out["world_ranks"] == [0, 1, 2, 3]
        assert out["intra_ranks"] == [rank - rank % 2, rank - rank % 2 + 1]
        assert out["all_reduce_world"] == (12, 24, 1)  # 24 bytes, n=4: 2*24/4 per peer
        assert out["all_reduce_intra"] == (20, 0, 1)  # 20 bytes, n=2: 20 to the intra peer
        assert out["all_reduce_inter"] == (0, 20, 1)
        assert out["all_gather_into"] == (12, 24, 1)  # 12-byte shard to every peer
        assert out["broadcast"] == ((32, 64, 1) if rank == 2 else (0, 0, 1))
        assert out["ag_fwd"] == (10, 20, 1)  # 5 bf16 to 3 peers
        assert out["ag_bwd"] == (10, 0, 1)  # 5 bf16 to the 1 intra peer
        assert out["reduce_scatter"] == (16, 32, 2)  # 8-byte chunk to every peer, twice


def _chunk_bytes(shapes: list[tuple[int, ...]], world: int) -> int:
    """Elements a rank contributes per bucket (rows padded to ceil(d0 / world)) x 4 bytes."""
    total = 0
    for shape in shapes:
        row = 1
        for d in shape[1:]:
            row *= d
        total += -(-shape[0] // world) * row
    return 4 * total


@pytest.mark.parametrize(
    ("part", "expected"),
    [
        # 2 nodes x 2: C to the intra peer for each of the 2 nodes' rows, then C across.
        ("ddp_two_nodes", lambda C: (2 * C, C)),
        # 1 node x 4: a flat all-to-all, C to each of 3 peers.
        ("ddp_one_node", lambda C: (3 * C, 0)),
    ],
)
def test_stage1_partitioned_reduce_equals_ddp(four_ranks, part, expected):
    """Each rank's own rows equal DDP's all-reduced gradient; the bytes are a reduce-scatter's."""
    for all_parts in four_ranks:
        out = all_parts[part]
        assert out["max_err"] <= 1e-6 * out["scale"], out
        chunks = [_chunk_bytes(shapes, 4) for shapes in out["bucket_params"]]
        intra = sum(expected(c)[0] for c in chunks)
        inter = sum(expected(c)[1] for c in chunks)
        hops = 2 if part == "ddp_two_nodes" else 1
        assert out["grad"] == (intra, inter, hops * len(chunks))
        assert len(chunks) >= 3  # 1 bucket in step 1, then several
        assert out["other_calls"] == 0


def test_two_hop_collectives_equal_flat_ones(four_ranks):
    for all_parts in four_ranks:
        out = all_parts["two_hop"]
        for dtype, bound in (("torch.float32", 1e-6), ("torch.bfloat16", 2e-2)):
            assert out[f"rs_err_{dtype}"] <= bound
            assert out[f"rs_flat_err_{dtype}"] <= bound
            e = 4 if dtype == "torch.float32" else 2
            # [Note: two-hop collectives]: 2 x 37 elements to the node peer, 37 across.
            assert out[f"rs_bytes_{dtype}"] == (2 * 37 * e, 37 * e, 2)
            assert out[f"ag_ok_{dtype}"] and out[f"ag_then_ran_{dtype}"]
            # 5 elements across, then 2 x 5 to the node peer.
            assert out[f"ag_bytes_{dtype}"] == (10 * e, 5 * e, 2)
        assert out["errors"] == ["continuation failed"] * 2


def test_fsdp2_with_ledger_comms_matches_single_process(four_ranks):
    for all_parts in four_ranks:
        out = all_parts["fsdp"]
        assert out["max_err"] <= 1e-6 * out["ref_scale"]
        s = out["shard_bytes"]
        every = s["fc1"] + s["fc2"] + s["head"]
        non_root = s["fc1"] + s["fc2"]
        assert out["fwd"] == (every, 2 * every, 3)
        # The root stays unsharded after forward, so only fc1 and fc2 gather again.
        assert out["bwd"] == (non_root, 2 * non_root, 2)
        assert out["grad"] == (every, 2 * every, 3)


# -- deferred reduce-scatter (no process group needed) ------------------------------------------


def _backward_calls(in_backward) -> None:  # noqa: ANN001
    """Run a tiny backward whose only node calls ``in_backward()``, as FSDP2's hooks call
    our reduce-scatter from inside backward."""

    class Node(torch.autograd.Function):
        @staticmethod
        def forward(ctx, x):  # noqa: ANN001, ANN205
            return x.clone()

        @staticmethod
        def backward(ctx, g):  # noqa: ANN001, ANN205
            in_backward()
            return g

    Node.apply(torch.ones(2, requires_grad=True)).sum().backward()


def test_deferral_waits_at_end_of_backward_and_raises_job_errors():
    from zeropp_strategy.comm.comm_thread import BackwardDeferral, CommThread

    thread = CommThread()
    deferral = BackwardDeferral(thread, groups=None)  # the jobs below ignore the groups
    out = torch.zeros(3)
    started = threading.Event()

    def slow_job(_groups) -> None:
        started.wait(5)
        out.fill_(7.0)

    def submit_slow() -> None:
        deferral.submit(slow_job)  # returns before the job ran
        assert out.sum() == 0
        started.set()

    _backward_calls(submit_slow)
    assert out.tolist() == [7.0, 7.0, 7.0]  # finished before backward() returned

    def failing_job(_groups) -> None:
        raise RuntimeError("reduce failed on the comm thread")

    with pytest.raises(RuntimeError, match="reduce failed on the comm thread"):
        _backward_calls(lambda: deferral.submit(failing_job))
    deferral.submit(lambda _groups: out.fill_(1.0))  # outside backward: runs and is waited at once
    assert out.tolist() == [1.0, 1.0, 1.0]
    thread.close()


def test_deferrable_only_when_fsdp_merely_views_the_output():
    from zeropp_strategy.comm.collectives import deferrable

    p = nn.Parameter(torch.zeros(4))
    out = torch.empty(2)
    assert deferrable([p], out, dist.ReduceOp.AVG)
    assert not deferrable([p], out, dist.ReduceOp.SUM)  # FSDP post-divides after a SUM
    assert not deferrable([p], out.to(torch.bfloat16), dist.ReduceOp.AVG)  # FSDP casts the output
    assert not deferrable([], out, dist.ReduceOp.AVG)
    p.grad = torch.zeros(4)  # FSDP would accumulate into it at once
    assert not deferrable([p], out, dist.ReduceOp.AVG)
    p.grad = None
    p.register_post_accumulate_grad_hook(lambda t: None)
    assert not deferrable([p], out, dist.ReduceOp.AVG)

"""Topology detection (pure, over fake env dicts) and mesh building (spawned gloo ranks).

    pytest tests/test_topology.py -q
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from tests._dist import run_ranks
from zeropp_strategy.topology import Topology

# -- detect: precedence ---------------------------------------------------------------


def test_single_node_when_nothing_is_known():
    topo = Topology.detect(4, 3, env={})
    assert (topo.ranks_per_node, topo.num_nodes, topo.node, topo.local_rank) == (4, 1, 0, 3)
    assert not topo.simulated
    assert topo.source == "single node"


def test_torchrun_local_world_size():
    topo = Topology.detect(8, 5, env={"LOCAL_WORLD_SIZE": "4"})
    assert (topo.ranks_per_node, topo.num_nodes, topo.node, topo.local_rank) == (4, 2, 1, 1)
    assert topo.source == "LOCAL_WORLD_SIZE"


@pytest.mark.parametrize(
    "env",
    [
        {"SLURM_NTASKS_PER_NODE": "2", "SLURM_NTASKS": "8"},
        {"SLURM_NTASKS_PER_NODE": "2"},
        {"SLURM_TASKS_PER_NODE": "2(x4)"},
        {"SLURM_TASKS_PER_NODE": "2,2,2,2"},
        {"SLURM_TASKS_PER_NODE": "2(x2),2,2"},
    ],
)
def test_slurm_forms(env):
    topo = Topology.detect(8, 7, env=env)
    assert (topo.ranks_per_node, topo.num_nodes, topo.node, topo.local_rank) == (2, 4, 3, 1)
    assert topo.source.startswith("SLURM_")


def test_slurm_ignored_when_it_describes_another_task_count():
    # An salloc shell with 1 task per node, but 4 ranks started by hand on one machine.
    assert Topology.detect(4, 0, env={"SLURM_TASKS_PER_NODE": "1(x2)"}).num_nodes == 1
    assert Topology.detect(4, 0, env={"SLURM_NTASKS_PER_NODE": "1", "SLURM_NTASKS": "2"}).num_nodes == 1


def test_precedence_order():
    env = {"LOCAL_WORLD_SIZE": "2", "SLURM_TASKS_PER_NODE": "1(x8)"}
    assert Topology.detect(8, 0, env=env).ranks_per_node == 2  # torchrun beats SLURM
    assert Topology.detect(8, 0, ranks_per_node=4, env=env).ranks_per_node == 4  # explicit beats env
    sim = Topology.detect(8, 0, ranks_per_node=4, simulated_nodes=4, env=env)
    assert (sim.ranks_per_node, sim.simulated, sim.source) == (2, True, "simulated_nodes")


def test_detect_reads_os_environ_by_default(monkeypatch):
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "3")
    assert Topology.detect(6, 4).num_nodes == 2


# -- detect: errors name the parameter / variable, the value and the fix --------------


@pytest.mark.parametrize(
    ("kwargs", "env", "fragments"),
    [
        ({"simulated_nodes": 3}, {}, ["simulated_nodes=3", "world_size=4", "divisor"]),
        ({"simulated_nodes": -1}, {}, ["simulated_nodes", "-1"]),
        ({"ranks_per_node": 3}, {}, ["ranks_per_node=3", "world_size=4", "divisor"]),
        ({"ranks_per_node": 0}, {}, ["ranks_per_node", "0"]),
        ({}, {"LOCAL_WORLD_SIZE": "3"}, ["LOCAL_WORLD_SIZE=3", "world_size=4"]),
        ({}, {"LOCAL_WORLD_SIZE": "four"}, ["LOCAL_WORLD_SIZE='four'", "integer"]),
        ({}, {"LOCAL_WORLD_SIZE": "0"}, ["LOCAL_WORLD_SIZE='0'", "positive"]),
        ({}, {"SLURM_NTASKS_PER_NODE": "3"}, ["SLURM_NTASKS_PER_NODE=3", "world_size=4"]),
        ({}, {"SLURM_TASKS_PER_NODE": "3,1"}, ["SLURM_TASKS_PER_NODE='3,1'", "same number"]),
        ({}, {"SLURM_TASKS_PER_NODE": "2(x)"}, ["SLURM_TASKS_PER_NODE='2(x)'", "4(x2)"]),
    ],
)
def test_detect_errors(kwargs, env, fragments):
    with pytest.raises(ValueError) as err:
        Topology.detect(4, 0, env=env, **kwargs)
    for fragment in fragments:
        assert fragment in str(err.value)


def test_bad_world_or_rank():
    with pytest.raises(ValueError, match="world_size"):
        Topology.detect(0, 0, env={})
    with pytest.raises(ValueError, match=r"rank must be in \[0, 4\)"):
        Topology.detect(4, 4, env={})
    with pytest.raises(ValueError, match="ranks_per_node=3"):
        Topology(4, 0, 3)


# -- rank arithmetic ------------------------------------------------------------------


def test_rank_arithmetic():
    topo = Topology(world_size=6, rank=4, ranks_per_node=3)
    assert [topo.node_of(r) for r in range(6)] == [0, 0, 0, 1, 1, 1]
    assert [topo.local_rank_of(r) for r in range(6)] == [0, 1, 2, 0, 1, 2]
    assert topo.node_ranks(0) == [0, 1, 2] and topo.node_ranks(1) == [3, 4, 5]
    assert topo.same_node(3, 5) and not topo.same_node(2, 3)
    assert (topo.node, topo.local_rank, topo.num_nodes) == (1, 1, 2)
    with pytest.raises(ValueError, match="outside the world"):
        topo.node_of(6)
    with pytest.raises(ValueError, match="node 2"):
        topo.node_ranks(2)
    line = topo.describe()
    assert "\n" not in line and "2 nodes x 3 ranks/node" in line and "rank 4" in line
    assert "simulated" in Topology.detect(4, 0, simulated_nodes=2).describe()


# -- meshes (spawned) -----------------------------------------------------------------
# One 4-rank spawn checks three shapes: 2 simulated nodes x 2, one node x 4 (found from
# the LOCAL_WORLD_SIZE=4 the harness sets, as torchrun would), and 4 nodes x 1. A spawn
# costs seconds on 2 cores, so the size-1 mesh dims ride along instead of their own run.


def _membership(rank: int, topo: Topology) -> dict:
    meshes = topo.build_meshes("cpu")
    out = {
        "world_dims": meshes.world.mesh_dim_names,
        "world_size": meshes.world.size(),
        "node_dims": meshes.node.mesh_dim_names,
        "node_shape": tuple(meshes.node.mesh.shape),
        "intra_ranks": dist.get_process_group_ranks(meshes.intra_group),
        "inter_ranks": dist.get_process_group_ranks(meshes.inter_group),
    }
    # Membership checked by communication, not just by the groups' bookkeeping: the
    # sum of rank ids over each group must be the sum of the ranks that belong in it.
    groups = {
        "intra": meshes.intra_group,
        "inter": meshes.inter_group,
        "world": meshes.world.get_group("shard"),
    }
    for name, group in groups.items():
        ids = torch.tensor([rank], dtype=torch.int64)
        dist.all_reduce(ids, group=group)
        out[f"{name}_sum"] = int(ids.item())
    return out


def _mesh_worker(rank: int, world_size: int) -> dict:
    return {
        "two_nodes": _membership(rank, Topology.detect(world_size, rank, simulated_nodes=2)),
        "one_node": _membership(rank, Topology.detect(world_size, rank)),
        "four_nodes": _membership(rank, Topology.detect(world_size, rank, ranks_per_node=1)),
    }


def test_meshes_four_ranks():
    results = run_ranks(_mesh_worker, 4, timeout_s=120, init_process_group=True)
    for rank, out in enumerate(results):
        for shape in out.values():
            assert shape["world_dims"] == ("shard",) and shape["world_size"] == 4
            assert shape["node_dims"] == ("inter", "intra")
            assert shape["world_sum"] == 6
        node, local = divmod(rank, 2)
        expected = {
            # shape, intra-node ranks, inter-node ranks (same local rank on every node)
            "two_nodes": ((2, 2), [2 * node, 2 * node + 1], [local, local + 2]),
            "one_node": ((1, 4), [0, 1, 2, 3], [rank]),
            "four_nodes": ((4, 1), [rank], [0, 1, 2, 3]),
        }
        for name, (shape, intra, inter) in expected.items():
            got = out[name]
            assert got["node_shape"] == shape, name
            assert got["intra_ranks"] == intra and got["intra_sum"] == sum(intra), name
            assert got["inter_ranks"] == inter and got["inter_sum"] == sum(inter), name


def test_build_meshes_checks_the_process_group():
    with pytest.raises(RuntimeError, match="init_process_group"):
        Topology(2, 0, 2).build_meshes("cpu")

"""Layer: base. Which rank lives on which node, and the device meshes built from that.

    topo = Topology.detect(world_size, rank)                # torchrun / SLURM / one node
    topo = Topology.detect(4, rank, simulated_nodes=2)      # tests: 4 ranks as 2 "nodes"
    meshes = topo.build_meshes("cuda")                      # collective: every rank calls it

ZeRO++'s hpZ and qgZ only pay off because intra-node links are much faster than
inter-node ones, so everything above this file needs one fact: the node of a rank.

[Note: contiguous ranks]
Every launcher we support (torchrun, SLURM via Lightning, Lightning's own launcher)
assigns ``global_rank = node_rank * ranks_per_node + local_rank``. So a node is a
contiguous block of ``ranks_per_node`` ranks and the topology is fully described by
``(world_size, ranks_per_node)``; we never exchange hostnames (that would be a
collective, and it would make simulated nodes impossible). Heterogeneous nodes
(different rank counts per node) are rejected: FSDP2's even sharding and hpZ's
secondary shards both assume every node holds the same number of ranks.

[Note: simulated nodes]
With ``simulated_nodes=k`` the ranks of one machine are split into ``k`` pretend
nodes. The collectives are then really hierarchical (separate intra/inter groups) and
the CommLedger's intra/inter split is exercised, only the bandwidth is not.
"""

from __future__ import annotations

import os
import re
from collections.abc import Mapping
from dataclasses import dataclass, field

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

__all__ = ["Meshes", "Topology"]

# "4(x2)" -> 4 tasks on each of 2 nodes; "4,4" or "2(x3),2" are comma-joined groups.
_SLURM_GROUP = re.compile(r"^\s*(\d+)\s*(?:\(x(\d+)\))?\s*$")


@dataclass(frozen=True)
class Meshes:
    """The device meshes and process groups of one rank (see ``Topology.build_meshes``)."""

    world: DeviceMesh
    """1-D over all ranks, dim name ``"shard"``: FSDP2 shards parameters over it."""
    node: DeviceMesh
    """2-D, shape ``(num_nodes, ranks_per_node)``, dim names ``("inter", "intra")``."""
    intra_group: dist.ProcessGroup
    """This rank and the other ranks of its node (size ``ranks_per_node``)."""
    inter_group: dist.ProcessGroup
    """This rank and the ranks with the same local rank on every node (size ``num_nodes``)."""


@dataclass(frozen=True)
class Topology:
    """``world_size`` ranks in ``world_size // ranks_per_node`` nodes of contiguous ranks."""

    world_size: int
    rank: int
    ranks_per_node: int
    simulated: bool = False
    source: str = field(default="explicit", compare=False)
    """Where ``ranks_per_node`` came from (for the log line only)."""

    def __post_init__(self) -> None:
        # Direct construction gets the same checks as detect(); detect() raises first
        # with a message naming the env var, so these only fire for hand-built values.
        if self.world_size < 1:
            raise ValueError(f"world_size must be >= 1, got {self.world_size}")
        if not 0 <= self.rank < self.world_size:
            raise ValueError(f"rank must be in [0, {self.world_size}), got {self.rank}")
        _check_ranks_per_node(self.world_size, self.ranks_per_node, "ranks_per_node")

    # -- rank arithmetic ([Note: contiguous ranks]) ----------------------------------

    @property
    def num_nodes(self) -> int:
        return self.world_size // self.ranks_per_node

    @property
    def node(self) -> int:
        return self.rank // self.ranks_per_node

    @property
    def local_rank(self) -> int:
        return self.rank % self.ranks_per_node

    def _check_rank(self, rank: int) -> None:
        # A rank outside the world here means a group was mis-built; failing loudly
        # beats silently booking its bytes to a node that does not exist.
        if not 0 <= rank < self.world_size:
            raise ValueError(f"rank {rank} is outside the world [0, {self.world_size})")

    def node_of(self, rank: int) -> int:
        self._check_rank(rank)
        return rank // self.ranks_per_node

    def local_rank_of(self, rank: int) -> int:
        self._check_rank(rank)
        return rank % self.ranks_per_node

    def same_node(self, a: int, b: int) -> bool:
        return self.node_of(a) == self.node_of(b)

    def node_ranks(self, node: int) -> list[int]:
        if not 0 <= node < self.num_nodes:
            raise ValueError(f"node {node} is outside [0, {self.num_nodes})")
        start = node * self.ranks_per_node
        return list(range(start, start + self.ranks_per_node))

    def describe(self) -> str:
        kind = ("simulated node" if self.simulated else "node") + ("s" if self.num_nodes != 1 else "")
        return (
            f"topology: world_size={self.world_size} = {self.num_nodes} {kind} x "
            f"{self.ranks_per_node} ranks/node (from {self.source}); "
            f"rank {self.rank} is node {self.node}, local rank {self.local_rank}"
        )

    # -- construction -----------------------------------------------------------------

    @classmethod
    def detect(
        cls,
        world_size: int,
        rank: int,
        *,
        ranks_per_node: int | None = None,
        simulated_nodes: int = 0,
        env: Mapping[str, str] | None = None,
    ) -> Topology:
        """Work out ``ranks_per_node`` without any communication.

        Precedence: ``simulated_nodes > 0`` > explicit ``ranks_per_node`` (Lightning's
        devices per node) > ``LOCAL_WORLD_SIZE`` (torchrun) > ``SLURM_NTASKS_PER_NODE``
        / ``SLURM_TASKS_PER_NODE`` > one node holding every rank.

        SLURM variables are only trusted when the task count they describe equals
        ``world_size``: inside an ``salloc`` shell they describe the allocation, not a
        process group started by hand, and taking them then would invent nodes.

        Raises ValueError (naming the parameter or variable, its value and the fix) on
        every rank alike, since the inputs are the same on every rank; that keeps one
        rank from failing while the others wait in the first collective.
        """
        env = os.environ if env is None else env
        if world_size < 1:
            raise ValueError(f"world_size must be >= 1, got {world_size}")
        if not 0 <= rank < world_size:
            raise ValueError(f"rank must be in [0, {world_size}), got {rank}")

        if simulated_nodes < 0:
            raise ValueError(
                f"simulated_nodes must be >= 0 (0 = off), got {simulated_nodes}"
            )
        if simulated_nodes > 0:
            if world_size % simulated_nodes != 0:
                raise ValueError(
                    f"simulated_nodes={simulated_nodes} does not divide world_size="
                    f"{world_size}; pick a divisor of {world_size} so every simulated "
                    f"node holds the same number of ranks"
                )
            per_node = world_size // simulated_nodes
            return cls(world_size, rank, per_node, simulated=True, source="simulated_nodes")

        if ranks_per_node is not None:
            _check_ranks_per_node(world_size, ranks_per_node, "ranks_per_node")
            return cls(world_size, rank, ranks_per_node, source="ranks_per_node")

        if "LOCAL_WORLD_SIZE" in env:
            per_node = _parse_positive_int(env["LOCAL_WORLD_SIZE"], "LOCAL_WORLD_SIZE")
            _check_ranks_per_node(world_size, per_node, "LOCAL_WORLD_SIZE")
            return cls(world_size, rank, per_node, source="LOCAL_WORLD_SIZE")

        slurm = _slurm_ranks_per_node(env, world_size)
        if slurm is not None:
            per_node, var = slurm
            return cls(world_size, rank, per_node, source=var)

        return cls(world_size, rank, world_size, source="single node")

    # -- meshes -----------------------------------------------------------------------

    def build_meshes(self, device_type: str) -> Meshes:
        """Build the world mesh and the (inter, intra) node mesh. Collective: all ranks.

        Bytes sent: none by us; DeviceMesh creates its subgroups through the store.
        """
        if not dist.is_initialized():
            raise RuntimeError(
                "build_meshes needs torch.distributed initialised; call "
                "dist.init_process_group (or let the strategy do it) first"
            )
        if dist.get_world_size() != self.world_size or dist.get_rank() != self.rank:
            raise ValueError(
                f"topology says world_size={self.world_size}, rank={self.rank} but the "
                f"process group has world_size={dist.get_world_size()}, rank="
                f"{dist.get_rank()}; detect the topology from the live process group"
            )
        world = init_device_mesh(device_type, (self.world_size,), mesh_dim_names=("shard",))
        # Row i = the ranks of node i ([Note: contiguous ranks]); dims of size 1 (one
        # node, or one rank per node) are fine: their groups hold just this rank.
        layout = torch.arange(self.world_size).view(self.num_nodes, self.ranks_per_node)
        node = DeviceMesh(device_type, layout, mesh_dim_names=("inter", "intra"))
        return Meshes(
            world=world,
            node=node,
            intra_group=node.get_group("intra"),
            inter_group=node.get_group("inter"),
        )


def _parse_positive_int(value: str, name: str) -> int:
    try:
        parsed = int(value.strip())
    except ValueError:
        raise ValueError(
            f"{name}={value!r} is not an integer; unset it or set it to the number of "
            f"ranks on each node"
        ) from None
    if parsed < 1:
        raise ValueError(
            f"{name}={value!r} must be a positive integer (the number of ranks on each node)"
        )
    return parsed


def _check_ranks_per_node(world_size: int, per_node: int, name: str) -> None:
    if per_node < 1:
        raise ValueError(f"{name} must be >= 1, got {per_node}")
    if world_size % per_node != 0:
        raise ValueError(
            f"{name}={per_node} does not divide world_size={world_size}: every node "
            f"must hold the same number of ranks; launch {per_node} ranks on each node "
            f"or set {name} to a divisor of {world_size}"
        )


def _slurm_ranks_per_node(env: Mapping[str, str], world_size: int) -> tuple[int, str] | None:
    """(ranks_per_node, variable) from SLURM's variables, or None if they don't apply."""
    if "SLURM_NTASKS_PER_NODE" in env:
        var = "SLURM_NTASKS_PER_NODE"
        per_node = _parse_positive_int(env[var], var)
        ntasks_raw = env.get("SLURM_NTASKS")
        total = _parse_positive_int(ntasks_raw, "SLURM_NTASKS") if ntasks_raw else None
    elif "SLURM_TASKS_PER_NODE" in env:
        var = "SLURM_TASKS_PER_NODE"
        counts = _parse_slurm_tasks_per_node(env[var])
        total = sum(counts)
        if len(set(counts)) > 1:
            if total != world_size:
                return None  # describes another job shape; not ours to reject
            raise ValueError(
                f"{var}={env[var]!r} gives nodes different rank counts; ZeRO++ needs the "
                f"same number of ranks on every node (use --ntasks-per-node)"
            )
        per_node = counts[0]
    else:
        return None
    if total is not None and total != world_size:
        return None
    _check_ranks_per_node(world_size, per_node, var)
    return per_node, var


def _parse_slurm_tasks_per_node(value: str) -> list[int]:
    """"4(x2),3" -> [4, 4, 3] (one entry per node)."""
    counts: list[int] = []
    for part in value.split(","):
        match = _SLURM_GROUP.match(part)
        if match is None:
            raise ValueError(
                f"SLURM_TASKS_PER_NODE={value!r} is not of the form '4(x2)' or '4,4'; "
                f"unset it or pass ranks_per_node explicitly"
            )
        tasks, repeat = int(match.group(1)), int(match.group(2) or 1)
        if tasks < 1 or repeat < 1:
            raise ValueError(
                f"SLURM_TASKS_PER_NODE={value!r} has a zero count; pass ranks_per_node "
                f"explicitly"
            )
        counts.extend([tasks] * repeat)
    return counts

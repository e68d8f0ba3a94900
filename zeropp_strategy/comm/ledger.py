"""Layer: comm. CommLedger: every byte this rank sends, split intra-node / inter-node, by kind.

    ledger = CommLedger(topology)
    with ledger.phase(Phase.BACKWARD):
        loss.backward()                      # comm objects record into the ledger
    print(ledger.format_table()); json.dumps(ledger.summary())

ZeRO++'s claim is a reduction of inter-node bytes (qwZ halves the forward gather, hpZ
removes the backward gather across nodes, qgZ quarters the gradient reduce). The ledger
is how we check that claim on any machine: each collective wrapper books what it sends,
and beside it the ``baseline``, what the plain 16-bit collective would have sent.

[Note: ledger byte model]
We count the payload this rank must deliver to each OTHER rank of the group, and book it
as intra- or inter-node by the destination's node. ``group_ranks`` are global ranks; this
rank may or may not be listed (it is never a destination). Per peer:

- all_gather(shard_bytes):      shard_bytes            (every peer needs our shard)
- reduce_scatter(chunk_bytes):  chunk_bytes            (every peer owns one chunk we add to)
- all_reduce(tensor_bytes):     ceil(2 * tensor_bytes / n), n = group size incl. this rank
                                (reduce-scatter then all-gather of tensor_bytes / n chunks;
                                ceil keeps the count an integer and never under-counts)
- all_to_all(bytes_per_dest):   bytes_per_dest[j] to group rank j
- broadcast(nbytes, src):       nbytes to every peer if this rank is src, else nothing

A two-hop collective ([Note: two-hop collectives] in hierarchical.py) books each hop as
its own call with the bytes that hop sends (``record``), so its inter-node bytes are what
really crosses: one chunk per node pair, not one per rank pair.

This is the algorithm-independent lower bound of what must leave the rank (a ring
forwards other ranks' data too, a tree may route intra-node first), so it measures what a
change to the *payload* saves, which is the thing ZeRO++ changes. Self-sends are never
counted. All counts are Python ints: exact, no float rounding, no overflow.
"""

from __future__ import annotations

import threading
from collections.abc import Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import asdict, dataclass
from enum import Enum

from zeropp_strategy.topology import Topology

__all__ = ["CommKind", "CommLedger", "CommTotals", "Phase"]

_MB = 1_000_000  # format_table reports decimal megabytes


class CommKind(str, Enum):
    """What a collective was for (the ledger's rows)."""

    PARAM_ALLGATHER_FWD = "param_allgather_fwd"
    PARAM_ALLGATHER_BWD = "param_allgather_bwd"
    PARAM_UPDATE = "param_update_allgather"
    """Stage 1: the updated parameter shards gathered after ``optimizer.step``."""
    GRAD_REDUCE = "grad_reduce"
    CONTROL = "control"
    """Votes, flags, object exchanges, broadcasts of settings and barriers
    (``comm.control``): small, but every byte is counted."""
    OTHER = "other"


class Phase(Enum):
    """Training phase; FSDP's param gathers are booked as forward or backward by it."""

    FORWARD = "forward"
    BACKWARD = "backward"
    OPTIMIZER = "optimizer"


@dataclass(frozen=True)
class CommTotals:
    """Bytes this rank sent (and would have sent unquantized), split by destination node."""

    intra_bytes: int = 0
    inter_bytes: int = 0
    calls: int = 0
    baseline_intra_bytes: int = 0
    baseline_inter_bytes: int = 0

    @property
    def total_bytes(self) -> int:
        return self.intra_bytes + self.inter_bytes

    @property
    def baseline_total_bytes(self) -> int:
        return self.baseline_intra_bytes + self.baseline_inter_bytes

    def __add__(self, other: CommTotals) -> CommTotals:
        return CommTotals(
            self.intra_bytes + other.intra_bytes,
            self.inter_bytes + other.inter_bytes,
            self.calls + other.calls,
            self.baseline_intra_bytes + other.baseline_intra_bytes,
            self.baseline_inter_bytes + other.baseline_inter_bytes,
        )

    def to_dict(self) -> dict[str, int]:
        out = asdict(self)
        out["total_bytes"] = self.total_bytes
        out["baseline_total_bytes"] = self.baseline_total_bytes
        return out


class CommLedger:
    """Per-rank byte counts of every collective, by ``CommKind`` ([Note: ledger byte model]).

    Thread-safe: FSDP issues collectives from hooks that may run on autograd's device
    threads, so every update and read takes one lock. The phase is deliberately shared
    (not thread-local) for the same reason: a backward hook on another thread must see
    the ``BACKWARD`` phase the training loop set.
    """

    def __init__(self, topology: Topology) -> None:
        self.topology = topology
        self._lock = threading.Lock()
        self._phase = Phase.FORWARD
        self._totals: dict[CommKind, CommTotals] = {}
        self._trace: list[tuple[str, int, int]] | None = None  # see trace()

    # -- phase ------------------------------------------------------------------------

    @property
    def current_phase(self) -> Phase:
        return self._phase

    @contextmanager
    def phase(self, phase: Phase) -> Iterator[None]:
        """Set the phase for the block; nestable, restores the previous phase on exit."""
        if not isinstance(phase, Phase):
            raise TypeError(f"phase must be a Phase, got {phase!r}")
        with self._lock:
            previous, self._phase = self._phase, phase
        try:
            yield
        finally:
            with self._lock:
                self._phase = previous

    # -- recording --------------------------------------------------------------------

    def record(
        self,
        kind: CommKind,
        bytes_to_rank: Mapping[int, int],
        *,
        baseline_bytes_to_rank: Mapping[int, int] | None = None,
    ) -> None:
        """Book one collective call: ``bytes_to_rank[r]`` bytes sent to global rank ``r``.

        Entries for this rank are ignored (self-sends cost nothing). The baseline
        defaults to the same numbers (an unquantized collective).
        """
        kind = CommKind(kind)
        intra, inter = self._split(bytes_to_rank)
        if baseline_bytes_to_rank is None:
            base_intra, base_inter = intra, inter
        else:
            base_intra, base_inter = self._split(baseline_bytes_to_rank)
        booked = CommTotals(intra, inter, 1, base_intra, base_inter)
        with self._lock:
            self._totals[kind] = self._totals.get(kind, CommTotals()) + booked
            if self._trace is not None:
                self._trace.append((kind.value, intra, inter))

    @contextmanager
    def trace(self) -> Iterator[list[tuple[str, int, int]]]:
        """Within the block, also list every booked call in the order booked:
        ``(kind, intra bytes, inter bytes)``. For tests and debugging (which collectives
        one step runs); not nestable."""
        with self._lock:
            if self._trace is not None:
                raise RuntimeError("CommLedger.trace() is already active; it does not nest.")
            calls: list[tuple[str, int, int]] = []
            self._trace = calls
        try:
            yield calls
        finally:
            with self._lock:
                self._trace = None

    def _split(self, bytes_to_rank: Mapping[int, int]) -> tuple[int, int]:
        topo = self.topology
        intra = inter = 0
        for dest, nbytes in bytes_to_rank.items():
            dest, nbytes = int(dest), int(nbytes)
            if nbytes < 0:
                raise ValueError(f"byte count to rank {dest} is negative: {nbytes}")
            if dest == topo.rank:
                continue
            if topo.same_node(topo.rank, dest):
                intra += nbytes
            else:
                inter += nbytes
        return intra, inter

    def _peers(self, group_ranks: Sequence[int]) -> list[int]:
        return [r for r in dict.fromkeys(int(r) for r in group_ranks) if r != self.topology.rank]

    def record_all_gather(
        self,
        kind: CommKind,
        shard_bytes: int,
        group_ranks: Sequence[int],
        *,
        baseline_shard_bytes: int | None = None,
    ) -> None:
        """All-gather: this rank sends its ``shard_bytes`` to every peer."""
        peers = self._peers(group_ranks)
        base = shard_bytes if baseline_shard_bytes is None else baseline_shard_bytes
        self.record(
            kind,
            dict.fromkeys(peers, shard_bytes),
            baseline_bytes_to_rank=dict.fromkeys(peers, base),
        )

    def record_reduce_scatter(
        self,
        kind: CommKind,
        chunk_bytes: int,
        group_ranks: Sequence[int],
        *,
        baseline_chunk_bytes: int | None = None,
    ) -> None:
        """Reduce-scatter: this rank sends each peer the ``chunk_bytes`` chunk it owns."""
        peers = self._peers(group_ranks)
        base = chunk_bytes if baseline_chunk_bytes is None else baseline_chunk_bytes
        self.record(
            kind,
            dict.fromkeys(peers, chunk_bytes),
            baseline_bytes_to_rank=dict.fromkeys(peers, base),
        )

    def record_all_reduce(
        self,
        kind: CommKind,
        tensor_bytes: int,
        group_ranks: Sequence[int],
        *,
        baseline_tensor_bytes: int | None = None,
    ) -> None:
        """All-reduce: ``ceil(2 * tensor_bytes / n)`` to every peer (RS + AG model)."""
        peers = self._peers(group_ranks)
        n = len(peers) + 1
        base = tensor_bytes if baseline_tensor_bytes is None else baseline_tensor_bytes
        self.record(
            kind,
            dict.fromkeys(peers, _ceil_div(2 * int(tensor_bytes), n)),
            baseline_bytes_to_rank=dict.fromkeys(peers, _ceil_div(2 * int(base), n)),
        )

    def record_all_to_all(
        self,
        kind: CommKind,
        bytes_per_dest: Sequence[int],
        group_ranks: Sequence[int],
        *,
        baseline_bytes_per_dest: Sequence[int] | None = None,
    ) -> None:
        """All-to-all: ``bytes_per_dest[j]`` to group rank ``j`` (``group_ranks[j]``).

        Here ``group_ranks`` must be the full, ordered group (this rank included),
        since ``bytes_per_dest`` is indexed by group rank.
        """
        ranks = [int(r) for r in group_ranks]
        base = bytes_per_dest if baseline_bytes_per_dest is None else baseline_bytes_per_dest
        if len(bytes_per_dest) != len(ranks) or len(base) != len(ranks):
            raise ValueError(
                f"all_to_all: bytes_per_dest has {len(bytes_per_dest)} entries and the "
                f"baseline {len(base)}, but the group has {len(ranks)} ranks; give one "
                f"entry per group rank"
            )
        self.record(
            kind,
            dict(zip(ranks, bytes_per_dest, strict=True)),
            baseline_bytes_to_rank=dict(zip(ranks, base, strict=True)),
        )

    def record_broadcast(
        self, kind: CommKind, nbytes: int, src: int, group_ranks: Sequence[int]
    ) -> None:
        """Broadcast: the source (a global rank) sends ``nbytes`` to every peer; others send nothing."""
        peers = self._peers(group_ranks) if int(src) == self.topology.rank else []
        self.record(kind, dict.fromkeys(peers, nbytes))

    # -- reading ----------------------------------------------------------------------

    def totals(self, kind: CommKind | None = None) -> CommTotals:
        """Totals of one kind, or of all kinds together when ``kind`` is None."""
        with self._lock:
            if kind is not None:
                return self._totals.get(CommKind(kind), CommTotals())
            return sum(self._totals.values(), CommTotals())

    def summary(self) -> dict:
        """JSON-able: rank, node, overall totals and totals for every kind (zeros included)."""
        topo = self.topology
        with self._lock:
            snapshot = dict(self._totals)
        return {
            "rank": topo.rank,
            "node": topo.node,
            "world_size": topo.world_size,
            "ranks_per_node": topo.ranks_per_node,
            "total": sum(snapshot.values(), CommTotals()).to_dict(),
            "by_kind": {k.value: snapshot.get(k, CommTotals()).to_dict() for k in CommKind},
        }

    def reset(self) -> None:
        """Forget every count (the phase is left as it is)."""
        with self._lock:
            self._totals.clear()

    def format_table(self) -> str:
        """Human-readable table: kind | calls | intra MB | inter MB, plus a totals row."""
        with self._lock:
            snapshot = dict(self._totals)
        rows = [(k.value, snapshot.get(k, CommTotals())) for k in CommKind]
        rows.append(("total", sum(snapshot.values(), CommTotals())))
        width = max(len(name) for name, _ in rows)
        lines = [
            f"comm ledger, rank {self.topology.rank} (node {self.topology.node}); MB = 1e6 bytes",
            f"{'kind':<{width}} | {'calls':>7} | {'intra MB':>11} | {'inter MB':>11}",
            f"{'-' * width}-+-{'-' * 7}-+-{'-' * 11}-+-{'-' * 11}",
        ]
        for name, t in rows:
            if name == "total":
                lines.append(lines[2])
            lines.append(
                f"{name:<{width}} | {t.calls:>7} | {t.intra_bytes / _MB:>11.3f} | "
                f"{t.inter_bytes / _MB:>11.3f}"
            )
        return "\n".join(lines)


def _ceil_div(a: int, b: int) -> int:
    return -(-a // b)

"""Layer: engine. ZeRO stage 1: replicated parameters, partitioned optimizer state.

[Note: stage-1 sharding by views]
Every rank holds the full parameters (like DDP). The optimizer state is what we
partition: for each parameter ``p`` of shape (d0, ...), rank r owns rows
``[r*c, min(d0, (r+1)*c))`` with ``c = ceil(d0 / N)`` (``torch.chunk`` semantics, so
trailing ranks may own nothing).

The user's optimizer is kept (same object: LR schedulers and ``self.optimizers()`` keep
working) but its ``param_groups`` are re-pointed from ``p`` to a DTensor ``Shard(0)``
whose local tensor is a *view* of this rank's rows of ``p``; its ``.grad`` is a view of the
same rows of ``p.grad``. So:
- Adam-like elementwise updates run exactly as DDP would run them, element for element,
  and write straight into ``p`` (no extra copy of the parameters, no master copy);
- optimizer state (``exp_avg`` ...) is created on the DTensor and therefore holds only
  this rank's rows: K*P/N bytes instead of K*P;
- a shape-dependent optimizer (row/column statistics, norms) still computes global
  quantities, because DTensor turns those reductions into collectives instead of
  silently computing them on a slice.
After ``step()`` every rank all-gathers the rows it updated, in buckets, so the replicated
parameters agree again; with ``overlap_param_gather`` the gathers finish while the next
forward runs ([Note: stage-1 asynchronous gather]).

0-dim parameters cannot be row-sharded; they are stepped redundantly on every rank
(``Replicate``), which costs a few bytes and needs no communication but their gradient's.

[Note: stage-1 partitioned reduce]
Gradients are not all-reduced: ``PartitionedReduce``, DDP's comm hook, reduce-scatters
each bucket so that every rank receives the averaged gradient of the rows it owns, and
the post-step all-gather sends the updated rows back. Per rank, with G gradient bytes:
(N-1)/N G for the reduce-scatter plus (N-1)/N G for the gather, DDP's 2 (N-1)/N G for
its all-reduce. So after backward, ``p.grad`` holds the averaged gradient only in this
rank's rows (``row_range``); the other rows keep this rank's own, unreduced
contribution. Everything we do with gradients reads this rank's rows (clipping sums
their squares and all-reduces one scalar; the inf check of fp16 scaling all-reduces a
flag); a user who needs the whole averaged gradients at stage 1 reads them through
``engine.state.full_gradients`` (each front-end's ``full_gradients``). 0-dim parameters'
gradients are all-reduced whole.

[Note: stage-1 asynchronous gather]
By default ``step()`` gathers the updated rows one bucket after another, each bucket in
host memory at most ``GATHER_WINDOW_BYTES`` gathered (a larger parameter is cut into pieces
of rows), all through one pair of reused buffers ([Note: communication temporaries in a workspace] in
primitives.py), and returns when all are in: whoever reads a parameter after ``step()``
reads the updated value, as with DDP. With ``overlap_param_gather=True`` it issues the
all-gathers of every bucket, each with buffers of its own, and returns without waiting;
the gathers finish while the next forward runs. Each bucket is one asynchronous ``all_gather_into`` (two hops across nodes: the
cross-node hop is in flight when ``step()`` returns, the within-node hop and the copy of
the received rows into the parameters run when the bucket is waited for). Buckets follow
the optimizer's parameter order, which is the order a model's forward uses them when its
modules are defined in the order they run (transformers are), and, overlapped, hold at most
``allgather_bucket_bytes`` and at most 1/``OVERLAP_BUCKETS`` of the gathered bytes
(never less than ``OVERLAP_MIN_BUCKET_BYTES``), so that the first blocks can compute
while the later buckets are still crossing the link. ``PendingParams`` ([Note: waiting
for parameters in flight] in pending_params.py) makes every module wait for the
buckets holding its own parameters before its forward, its ``state_dict`` and its
``load_state_dict``. The optimizer waits for everything in ``wait()``, at the next
``step()`` (after the closure's forward and backward, before the update),
``state_dict()``, ``load_state_dict()`` and when its ``state`` is read (Lightning moves
it at teardown). ``zero_grad()`` does not wait: it touches gradients only, and a loop that
calls it before its forward would otherwise lose the overlap. Until a bucket is waited
for, its receive buffer is held: at most the gathered parameters' bytes again, between
the step and the forward.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Replicate, Shard
from torch.optim import Optimizer

from zeropp_strategy.comm.collectives import all_gather_into
from zeropp_strategy.comm.hierarchical import NodeGroups, PendingWork
from zeropp_strategy.comm.ledger import CommKind, CommLedger, Phase
from zeropp_strategy.engine.local_step import local_shards
from zeropp_strategy.engine.pending_params import PendingParams
from zeropp_strategy.primitives import WrappingOptimizer
from zeropp_strategy.primitives import Alloc, Workspace, fresh


OVERLAP_BUCKETS = 8
"""The post-step gather is cut into about this many buckets (more when
``allgather_bucket_bytes`` is smaller), so that the next forward can start on the first
ones; docs/benchmarks_volume.md has the measurement (1, 8 and 16 buckets)."""
OVERLAP_MIN_BUCKET_BYTES = 2**20
"""...but no bucket below 1 MiB: each bucket is a collective (two across nodes) with its
own fixed cost."""
GATHER_WINDOW_BYTES = 4 * 2**20
"""Without the overlap and in host memory, the gathered bytes of one bucket at most (a larger
parameter is cut into pieces of rows; a single larger row is a bucket of its own): the
buckets go one after another through one workspace ([Note: communication temporaries in a
workspace] in primitives.py), so this bounds it."""


def row_range(dim0: int, rank: int, world_size: int) -> tuple[int, int]:
    """Rows of a dim-0 sharded tensor that ``rank`` owns (``torch.chunk`` semantics)."""
    chunk = math.ceil(dim0 / world_size) if dim0 else 0
    start = min(dim0, rank * chunk)
    return start, min(dim0, start + chunk)


@dataclass
class _Slot:
    """One optimized parameter: the full tensor and this rank's DTensor view of it."""

    param: nn.Parameter  # full, replicated, owned by the module
    shard: nn.Parameter  # DTensor whose local tensor aliases rows of ``param``
    rows: tuple[int, int]
    chunk_rows: int  # rows every rank contributes to the gather (padding included)


class ShardedOptimizer(WrappingOptimizer):
    """Wraps a user optimizer so that its state holds only this rank's rows.

    ``step()`` points each shard's grad at the matching rows of the reduced full
    gradient, runs the wrapped optimizer, then issues the all-gathers of the updated rows
    and returns ([Note: stage-1 asynchronous gather]); ``wait()`` finishes them.
    ``zero_grad()`` clears the full gradients on the module's parameters, which is what
    the next backward accumulates into.
    """

    def __init__(
        self,
        optimizer: Optimizer,
        mesh: DeviceMesh,
        ledger: CommLedger,
        *,
        allgather_bucket_bytes: int,
        nodes: NodeGroups | None = None,
        overlap_param_gather: bool = False,
    ) -> None:
        # Deliberately no Optimizer.__init__: we share the wrapped optimizer's
        # param_groups and state, so schedulers that mutate them act on both.
        self.optimizer = optimizer
        self.mesh = mesh
        self.ledger = ledger
        self.allgather_bucket_bytes = allgather_bucket_bytes
        self.nodes = nodes  # two-hop gathers across nodes ([Note: two-hop collectives])
        self.overlap_param_gather = overlap_param_gather
        self._rank = mesh.get_local_rank()
        self._world = mesh.size()
        self._slots: list[_Slot] = []
        seen: set[int] = set()
        for group in optimizer.param_groups:
            new_params = []
            for p in group["params"]:
                if id(p) in seen:
                    raise ValueError(
                        "configure_optimizers: a parameter appears twice in the optimizer's "
                        "param_groups. Fix: pass each parameter to exactly one group."
                    )
                seen.add(id(p))
                slot = self._make_slot(p)
                self._slots.append(slot)
                new_params.append(slot.shard)
            group["params"] = new_params
        # The wrapped optimizer may already hold state keyed by the full params (e.g. a
        # reused optimizer); it would now be orphaned and waste K*P bytes.
        if len(optimizer.state):
            raise ValueError(
                "configure_optimizers returned an optimizer that already has state "
                f"({len(optimizer.state)} entries). Fix: create a fresh optimizer in "
                "configure_optimizers; state is restored from checkpoints after setup."
            )
        self._full_to_shard = {id(s.param): s.shard for s in self._slots}
        # The gathers in flight after a step, and (when they may stay in flight past step())
        # the hooks that make readers wait for them.
        overlapped = [s.param for s in self._slots if s.chunk_rows and self._world > 1] if overlap_param_gather else []
        self._in_flight = PendingParams(overlapped)
        # Gathered one bucket at a time unless they overlap the next forward: then one pair of
        # buffers serves every bucket ([Note: communication temporaries in a workspace]).
        self._work = Workspace()

    # -- construction ------------------------------------------------------------------

    def _make_slot(self, p: torch.Tensor) -> _Slot:
        if isinstance(p, DTensor):
            raise TypeError(
                "zeropp_stage_1 got a DTensor parameter. Fix: do not call fully_shard or "
                "tensor-parallel APIs in configure_model when using zeropp_stage_1; use "
                "zeropp_stage_2/3 for sharded parameters."
            )
        data = p.detach()
        if data.dim() == 0:
            local, placements, rows, chunk = data, [Replicate()], (0, 0), 0
        else:
            rows = row_range(data.shape[0], self._rank, self._world)
            chunk = math.ceil(data.shape[0] / self._world)
            local, placements = data[rows[0] : rows[1]], [Shard(0)]
        shard = nn.Parameter(
            DTensor.from_local(local, self.mesh, placements, run_check=False, shape=data.shape, stride=data.stride()),
            requires_grad=p.requires_grad,
        )
        return _Slot(param=p, shard=shard, rows=rows, chunk_rows=chunk)

    # -- Optimizer surface ---------------------------------------------------------------

    @property
    def state(self) -> dict[Any, Any]:  # type: ignore[override]
        self.wait()  # whoever reads the state reads a finished step (Lightning's teardown moves it)
        return self.optimizer.state

    @property
    def full_params(self) -> list[nn.Parameter]:
        return [s.param for s in self._slots]

    def shard_of(self, param: torch.Tensor) -> nn.Parameter | None:
        """This rank's shard of a full parameter; None if the optimizer does not hold it."""
        return self._full_to_shard.get(id(param))

    def __repr__(self) -> str:
        return f"ShardedOptimizer(rank={self._rank}/{self._world}, {self.optimizer!r})"

    def zero_grad(self, set_to_none: bool = True) -> None:
        for s in self._slots:
            s.shard.grad = None
            if s.param.grad is None:
                continue
            if set_to_none:
                s.param.grad = None
            else:
                s.param.grad.zero_()  # may be a DDP bucket view: zero in place, never detach

    def _bind_grads(self) -> None:
        for s in self._slots:
            g = s.param.grad
            if g is None:
                s.shard.grad = None
                continue
            local = g if g.dim() == 0 else g[s.rows[0] : s.rows[1]]
            s.shard.grad = DTensor.from_local(
                local, self.mesh, s.shard.placements, run_check=False, shape=g.shape, stride=g.stride()
            )

    def sharded_grads(self) -> list[torch.Tensor]:
        """This rank's gradient rows (bound views), for inf checks and unscaling."""
        self._bind_grads()
        return [s.shard.grad for s in self._slots if s.shard.grad is not None]

    @torch.no_grad()
    def step(self, closure: Callable[[], Any] | None = None) -> Any:
        loss = self._evaluate(closure)  # its forward waited for the buckets it used
        self.wait()  # the update below writes the rows the last gathers send
        self._bind_grads()
        with self.ledger.phase(Phase.OPTIMIZER):
            with local_shards(self.optimizer):  # [Note: the step on local shards]
                self.optimizer.step()
            self._start_gathers()
        return loss

    def wait(self) -> None:
        """Finish the parameter gathers issued by the last ``step()`` (idempotent): then
        every rank holds the same, updated parameters. Forward, ``state_dict`` and
        ``load_state_dict`` of the modules and this optimizer's own methods wait by
        themselves; code that reads parameter tensors directly between a step and the next
        forward calls this first ([Note: stage-1 asynchronous gather]). Raises the error of
        a failed gather, again at every call."""
        self._in_flight.wait()

    @property
    def gathering(self) -> bool:
        """Whether gathers of the last step have not finished yet."""
        return self._in_flight.pending

    # -- the post-step all-gather ----------------------------------------------------------

    def _buckets(self) -> list[list[tuple[_Slot, int, int]]]:
        """The trainable row-sharded parameters in optimizer order, cut into buckets of one
        dtype and device, sized as [Note: stage-1 asynchronous gather] says. A bucket is a
        list of ``(slot, r0, r1)``: rows ``r0:r1`` of each rank's ``chunk_rows``. Gathered
        one at a time (no overlap) from host memory, a parameter larger than
        ``GATHER_WINDOW_BYTES`` is cut into pieces of rows (a single row larger than that
        is a bucket of its own); otherwise whole parameters."""
        slots = [s for s in self._slots if s.chunk_rows and s.param.requires_grad]
        limit = self.allgather_bucket_bytes
        # one bucket at a time through one workspace: host memory only (the C heap's problem)
        split = not self.overlap_param_gather and bool(slots) and slots[0].param.device.type == "cpu"
        if self.overlap_param_gather:  # small enough that the first blocks' rows arrive first
            total = sum(s.chunk_rows * s.param[0].numel() * s.param.element_size() * self._world for s in slots)
            limit = min(limit, max(OVERLAP_MIN_BUCKET_BYTES, math.ceil(total / OVERLAP_BUCKETS)))
        elif split:
            limit = min(limit, GATHER_WINDOW_BYTES)
        buckets: list[list[tuple[_Slot, int, int]]] = []
        size = 0
        for s in slots:
            row_bytes = s.param[0].numel() * s.param.element_size() * self._world  # one row of every rank
            step = max(1, limit // row_bytes) if split else s.chunk_rows
            for r0 in range(0, s.chunk_rows, step):
                r1 = min(r0 + step, s.chunk_rows)
                nbytes = (r1 - r0) * row_bytes
                last = buckets[-1][-1][0].param if buckets else None
                if last is None or (s.param.dtype, s.param.device) != (last.dtype, last.device) \
                        or size + nbytes > limit:
                    buckets.append([])
                    size = 0
                buckets[-1].append((s, r0, r1))
                size += nbytes
        return buckets

    def _start_gathers(self) -> None:
        """Issue the all-gather of every bucket; ``PendingParams`` finishes them."""
        if self._world == 1:
            return
        buckets = self._buckets()
        if not self.overlap_param_gather:  # every reader sees the updated weights once step() returns
            for b in buckets:  # one at a time through one workspace; a failed one stays pending (raised again)
                self._in_flight.start([[s.param for s, _, _ in b]], [self._gather_bucket(b, self._work)])
                self._in_flight.wait()
            return
        works = [self._gather_bucket(b, fresh) for b in buckets]  # in flight together: buffers of their own
        self._in_flight.start([[s.param for s, _, _ in b] for b in buckets], works)

    def _gather_bucket(self, pieces: list[tuple[_Slot, int, int]], alloc: Alloc) -> PendingWork:
        """Asynchronous all-gather of one bucket; its ``wait()`` writes the received rows.

        Bytes sent per rank: the bucket's padded shard (sum over pieces of their rows *
        row_elems * element_size) to each of the N-1 peers (two hops across nodes).
        """
        p0 = pieces[0][0].param
        sizes = [(r1 - r0) * s.param[0].numel() for s, r0, r1 in pieces]  # padded elems per rank
        per_rank = sum(sizes)
        send = alloc("gather_send", per_rank, p0.dtype, p0.device)
        offset = 0
        for (s, r0, r1), n in zip(pieces, sizes):
            lo, hi = s.rows
            own = s.param.detach()[min(lo + r0, hi) : min(lo + r1, hi)].reshape(-1)
            send[offset : offset + own.numel()].copy_(own)
            send[offset + own.numel() : offset + n].zero_()
            offset += n
        recv = alloc("gather_recv", per_rank * self._world, p0.dtype, p0.device)
        work = all_gather_into(recv, send, ledger=self.ledger, kind=CommKind.PARAM_UPDATE,
                               group=self.mesh.get_group(), nodes=self.nodes, async_op=True, alloc=alloc)
        return PendingWork(work, lambda: self._unpack(pieces, sizes, recv.view(self._world, per_rank)))

    @torch.no_grad()
    def _unpack(self, pieces: list[tuple[_Slot, int, int]], sizes: list[int], recv: torch.Tensor) -> None:
        """Copy the other ranks' rows of a gathered bucket (world, per_rank) into the params."""
        offset = 0
        for (s, r0, r1), n in zip(pieces, sizes):
            full = s.param.detach()
            d0 = full.shape[0]
            row = full[0].numel()
            for r in range(self._world):
                lo, hi = row_range(d0, r, self._world)
                lo, hi = min(lo + r0, hi), min(lo + r1, hi)
                if hi > lo and r != self._rank:
                    full[lo:hi].copy_(recv[r, offset : offset + (hi - lo) * row].view_as(full[lo:hi]))
            offset += n

    # -- checkpoint surface (the strategy gathers/scatters full state around these) ------

    def state_dict(self) -> dict[str, Any]:
        self.wait()
        return self.optimizer.state_dict()

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self.wait()
        self.optimizer.load_state_dict(state_dict)
        self._full_to_shard = {id(s.param): s.shard for s in self._slots}

    def add_param_group(self, param_group: dict[str, Any]) -> None:
        raise NotImplementedError(
            "add_param_group after setup is not supported by zeropp_stage_1: the new "
            "parameters would not be partitioned. Fix: create every param group in "
            "configure_optimizers."
        )


def unwrap_optimizer(optimizer: Optimizer) -> Optimizer:
    """The user's optimizer behind Lightning's and our wrappers."""
    inner = getattr(optimizer, "_optimizer", optimizer)  # LightningOptimizer
    return inner.optimizer if isinstance(inner, ShardedOptimizer) else inner


def iter_sharded(optimizers: Iterable[Optimizer]) -> Iterable[ShardedOptimizer]:
    for opt in optimizers:
        inner = getattr(opt, "_optimizer", opt)
        if isinstance(inner, ShardedOptimizer):
            yield inner


def wait_for_parameters(optimizers: Iterable[Optimizer]) -> None:
    """Finish the post-step gathers of every stage-1 optimizer among ``optimizers``, looking
    through wrappers (Lightning's and Fabric's ``_optimizer``, Accelerate's ``optimizer``):
    for code that reads parameter tensors directly after a step. A no-op for other
    optimizers."""
    for opt in optimizers:
        for _ in range(4):  # a few wrappers deep at most
            if isinstance(opt, ShardedOptimizer):
                opt.wait()
                break
            opt = getattr(opt, "_optimizer", None) or getattr(opt, "optimizer", None)
            if opt is None:
                break

"""Layer: comm. A worker thread that runs chains of collectives in submission order.

[Note: comm thread]
Some of our collectives are several steps (a two-hop reduce-scatter: all-to-all, local
sum, all-to-all, local sum). DDP's comm hooks must return a future at once, and
backward goes on computing the next buckets' gradients meanwhile; running such a chain
inline would stall backward until the last hop. So a chain is submitted here and runs on
one thread, in submission order; the hook returns the job's future.

Two rules keep this deadlock-free:
- the thread uses process groups of its own (``ThreadGroups``, created collectively at
  start): gloo requires that every rank issues the collectives of one group in the same
  order, which two threads sharing a group could not promise;
- jobs are submitted in the same order on every rank (DDP launches buckets in a fixed
  order), and one thread runs them in that order.

An exception in a job fails its future; DDP raises it from backward on this rank, and the
peers' matching collectives fail with the broken connection.
"""

from __future__ import annotations

import queue
import threading
import weakref
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from zeropp_strategy.comm.hierarchical import NodeGroups
from zeropp_strategy.topology import Topology

__all__ = ["BackwardDeferral", "CommThread", "ThreadGroups", "close_all"]

_LIVE: weakref.WeakSet[CommThread] = weakref.WeakSet()  # for close_all at exit


@dataclass(frozen=True)
class ThreadGroups:
    """Process groups for the comm thread's own use: the world and the node structure."""

    world: dist.ProcessGroup
    nodes: NodeGroups

    @classmethod
    def create(cls, topology: Topology) -> ThreadGroups:
        """Collective (every rank, same order): one new world group, then the node groups.

        Bytes sent: none by us; gloo connects the new groups' ranks through the store.
        """
        world = dist.new_group(ranks=list(range(topology.world_size)))
        M, L = topology.num_nodes, topology.ranks_per_node
        intra, _ = dist.new_subgroups_by_enumeration([[m * L + i for i in range(L)] for m in range(M)])
        inter, _ = dist.new_subgroups_by_enumeration([[m * L + i for m in range(M)] for i in range(L)])
        return cls(world=world, nodes=NodeGroups(topology, intra_group=intra, inter_group=inter))


class CommThread:
    """Runs submitted jobs one at a time, in order, on a daemon thread (started lazily)."""

    def __init__(self, name: str = "zeropp-comm") -> None:
        self._name = name
        self._jobs: queue.SimpleQueue[tuple[Callable[[], Any], torch.futures.Future] | None] = queue.SimpleQueue()
        self._thread: threading.Thread | None = None
        self._lock = threading.Lock()
        _LIVE.add(self)

    def submit(self, job: Callable[[], Any]) -> torch.futures.Future:
        """Queue ``job``; its future gets the job's return value, or its exception."""
        future: torch.futures.Future = torch.futures.Future()
        with self._lock:
            if self._thread is None:
                self._thread = threading.Thread(target=self._run, name=self._name, daemon=True)
                self._thread.start()
        self._jobs.put((job, future))
        return future

    def _run(self) -> None:
        while (item := self._jobs.get()) is not None:
            job, future = item
            item = None  # noqa: F841 - nothing of a finished job may stay alive until the next one
            try:
                result = job()
            except BaseException as e:  # noqa: BLE001 - handed to whoever waits on the future
                future.set_exception(e)
            else:
                future.set_result(result)
            # The job's closure holds its buffers (the root group's whole reduce-scatter input
            # at the end of backward: 4 P_root bytes); idle, this thread must hold none of them.
            job = future = result = None  # noqa: F841

    def close(self, timeout: float | None = None) -> bool:
        """Let queued jobs finish, then stop the thread (a later ``submit`` starts a new
        one). Returns False if it was still running a job after ``timeout`` seconds (a
        collective waiting for a peer that is gone)."""
        with self._lock:
            thread, self._thread = self._thread, None
        if thread is not None:
            self._jobs.put(None)
            thread.join(timeout)
            return not thread.is_alive()
        return True


def close_all(timeout: float | None = None) -> bool:
    """``close`` every comm thread of this process; False if one is stuck in a job."""
    return all([thread.close(timeout) for thread in list(_LIVE)])


class BackwardDeferral:
    """Gradient reduce-scatters that complete at the end of backward, not inline.

    [Note: deferred reduce-scatter]
    On the host FSDP2 calls the reduce-scatter synchronously and then only *views* its
    output as the new sharded gradients (``foreach_reduce``), unless it must read the
    output at once: a post-divide (fp16 reduce), a dtype cast (reduce dtype != parameter
    dtype), accumulation into an existing ``.grad`` (backward twice without ``no_sync``),
    or a post-accumulate-grad hook. When none of these applies (the comm object checks
    each, see ``deferrable``), the reduce runs as a job on the comm thread ([Note: comm
    thread]) and the call returns at once: backward goes on with the next block while the
    gradients cross the link. The first deferred job of a backward queues an autograd
    callback that waits for every pending job when the backward pass ends, before
    ``loss.backward()`` returns; an error in a job is raised there. So nothing after
    backward (clipping, the optimizer, a callback) can see an unfinished gradient.
    """

    def __init__(self, thread: CommThread, groups: ThreadGroups) -> None:
        self.thread = thread
        self.groups = groups
        self._pending: list[torch.futures.Future] = []
        self._lock = threading.Lock()
        self._queued = False

    def submit(self, job: Callable[[ThreadGroups], Any]) -> None:
        """Run ``job(groups)`` on the comm thread; wait for it at the end of this backward."""
        future = self.thread.submit(lambda: job(self.groups))
        with self._lock:
            self._pending.append(future)
            queue = not self._queued
            self._queued = True
        if queue:
            try:
                torch.autograd.Variable._execution_engine.queue_callback(self.wait_all)
            except RuntimeError:  # not inside a backward pass: nobody would wait, so wait now
                self.wait_all()

    def wait_all(self) -> None:
        """Wait for every pending job (in order); raise the first error."""
        with self._lock:
            pending, self._pending, self._queued = self._pending, [], False
        for future in pending:
            future.wait()

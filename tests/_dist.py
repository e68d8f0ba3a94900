"""Spawn N gloo ranks on 127.0.0.1 for one test, with a hard timeout.

    results = run_ranks(worker, world_size=4, args=(tmp_path,), timeout_s=120)

``worker(rank, world_size, *args)`` runs in a fresh process (start method "spawn"; see
below for "forkserver") with the environment a launcher would give it (MASTER_ADDR/PORT, RANK, WORLD_SIZE,
LOCAL_RANK, LOCAL_WORLD_SIZE, NODE_RANK), so Lightning's ``LightningEnvironment`` sees
externally created processes and ``Trainer(devices=world_size)`` joins them. With
``init_process_group=True`` the harness also creates the default gloo group before
calling the worker (for engine tests that use no Trainer).

Whatever the worker returns (picklable) comes back as ``results[rank]``. An exception
on any rank fails the test with that rank's traceback; a rank that has not finished
after ``timeout_s`` is killed with the others and the test fails instead of hanging.
Ranks share one machine, so each is pinned to one intra-op thread: with 4 ranks on
2 cores, more threads only thrash.

Start method. A "spawn" rank imports torch, Lightning and this package afresh: 11-12 s
for 2 ranks on the 2-core CI machine before the worker's first line, on every call
(`python benchmarks/spawn_cost.py`). ``ZEROPP_TEST_START=forkserver`` forks the ranks
from a server that has imported them once (``_PRELOAD``; the suite in 934 s instead of
1886 s), but it is not the default: in one of four full runs a forked rank aborted with
glibc's "malloc(): unaligned tcache chunk detected" (tests/test_checkpoint_faults.py,
Accelerate and Fabric in one worker; that worker then passed 72 forked runs on its own, 60
of them two at a time on 2 cores), and the cause is not found. With the forkserver: a child gets the parent's sys.path and
working directory from multiprocessing, and the parent's environment as it is at the
call (the forkserver's own is the one it started with), applied before the worker runs.
What the preloaded modules read from the environment at import (transformers' and
huggingface_hub's ``HF_*``, torch's dynamo/inductor settings, ``TMPDIR``) is the
forkserver's, fixed at the first call; no test passes such a variable today (the one
passed, ``ACCELERATE_USE_CPU``, is read at run time). Forked ranks also share the hash
seed and the memory layout, which real ranks do not: code that orders collectives by
iterating a set of strings or by ``id()`` would pass there and diverge under torchrun:
one more reason spawn stays the default. A forked child leaves through ``os._exit``,
which skips the interpreter's exit, so ``_entry`` does what that exit does, in its
order: join the non-daemon threads, run the atexit handlers, then destroy a process
group still left (spawned ranks do the same, before their own exit).
"""

from __future__ import annotations

import multiprocessing as mp
import os
import pickle
import queue
import socket
import traceback
from collections.abc import Callable
from datetime import timedelta
from typing import Any


# MASTER_PORTs come from below the kernel's ephemeral range (32768-60999 on Linux), split
# between pytest-xdist workers: a port that is free when picked can otherwise be taken
# before the TCPStore binds it, by a gloo connection's ephemeral port or by the other
# worker's pick (EADDRINUSE, seen with two workers).
_PORTS = range(20000, 32000)


def free_port() -> int:
    import random

    worker = os.environ.get("PYTEST_XDIST_WORKER", "gw0")
    index = int(worker[2:]) if worker[2:].isdigit() else 0
    count = max(1, int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1")))
    span = len(_PORTS) // count
    start = _PORTS.start + (index % count) * span
    for _ in range(100):
        port = random.randrange(start, start + span)
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
            try:
                s.bind(("127.0.0.1", port))
            except OSError:
                continue
            return port
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:  # the whole range busy: any free port
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


_PRELOAD = ["torch", "torch.distributed", "lightning.pytorch", "zeropp_strategy", "tests._models"]


def _context() -> mp.context.BaseContext:
    method = os.environ.get("ZEROPP_TEST_START", "spawn")
    ctx = mp.get_context(method)
    if method == "forkserver":
        ctx.set_forkserver_preload(_PRELOAD)  # takes effect when the server starts: the first call
    return ctx


def _entry(
    fn: Callable[..., Any],
    rank: int,
    world_size: int,
    port: int,
    args: tuple,
    env: dict[str, str],
    init_process_group: bool,
    out: mp.Queue,
) -> None:
    os.environ.clear()  # the caller's environment at the call, not the forkserver's
    os.environ.update(env)
    os.environ.update(
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(port),
        RANK=str(rank),
        WORLD_SIZE=str(world_size),
        LOCAL_RANK=str(rank),
        LOCAL_WORLD_SIZE=str(world_size),
        NODE_RANK="0",
        GLOO_SOCKET_IFNAME=env.get("GLOO_SOCKET_IFNAME", "lo"),
    )
    import torch

    torch.set_num_threads(1)
    try:
        if init_process_group:
            import torch.distributed as dist

            dist.init_process_group(
                "gloo",
                init_method=f"tcp://127.0.0.1:{port}",
                rank=rank,
                world_size=world_size,
                timeout=timedelta(seconds=60),
            )
        result = fn(rank, world_size, *args)
        # Plain pickle bytes: torch's multiprocessing would pass tensors as shared-memory
        # handles that vanish when this process exits.
        out.put((rank, True, pickle.dumps(result)))
    except BaseException:  # noqa: BLE001 - the traceback is the test's failure message
        out.put((rank, False, traceback.format_exc()))
    finally:
        import atexit
        import threading

        import torch.distributed as dist

        # What the interpreter does at a process's exit, which a forked rank (os._exit)
        # skips: join the non-daemon threads, then the atexit handlers (the swap files'
        # cleanup, the orderly exit that stops comm threads before destroying the groups).
        threading._shutdown()
        atexit._run_exitfuncs()
        if dist.is_available() and dist.is_initialized():
            dist.destroy_process_group()


def run_ranks(
    fn: Callable[..., Any],
    world_size: int,
    args: tuple = (),
    *,
    timeout_s: float = 180,
    env: dict[str, str] | None = None,
    init_process_group: bool = False,
) -> list[Any]:
    ctx = _context()
    out: mp.Queue = ctx.Queue()
    port = free_port()
    procs = [
        ctx.Process(
            target=_entry,
            args=(fn, rank, world_size, port, args, {**os.environ, **(env or {})}, init_process_group, out),
            daemon=False,
        )
        for rank in range(world_size)
    ]
    for p in procs:
        p.start()
    results: dict[int, Any] = {}
    failures: list[str] = []
    try:
        import time

        deadline = time.monotonic() + timeout_s
        while len(results) + len(failures) < world_size:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                missing = sorted(set(range(world_size)) - set(results))
                raise TimeoutError(
                    f"ranks {missing} did not finish within {timeout_s:.0f}s "
                    f"(finished: {sorted(results)}); killed all ranks"
                    + ("\n" + "\n".join(failures) if failures else "")
                )
            try:
                rank, ok, payload = out.get(timeout=min(remaining, 1.0))
            except queue.Empty:
                # A rank that died without reporting (segfault, os._exit) would otherwise
                # make us wait for the full timeout.
                dead = [r for r, p in enumerate(procs) if p.exitcode not in (None, 0) and r not in results]
                if dead and not failures:
                    failures.append(f"rank(s) {dead} exited with codes {[procs[r].exitcode for r in dead]}")
                    break
                continue
            if ok:
                results[rank] = pickle.loads(payload)
            else:
                failures.append(f"--- rank {rank} ---\n{payload}")
                # One failed rank usually leaves the others blocked in a collective.
                break
    finally:
        for p in procs:
            p.join(timeout=5 if not failures else 0.5)
        for p in procs:
            if p.is_alive():
                p.kill()
                p.join(timeout=5)
        out.close()
    if failures:
        raise AssertionError("distributed worker failed:\n" + "\n".join(failures))
    return [results[r] for r in range(world_size)]

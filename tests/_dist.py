"""N gloo ranks on 127.0.0.1 for one test, with a hard timeout.

    results = run_ranks(worker, world_size=4, args=(tmp_path,), timeout_s=120)

``worker(rank, world_size, *args)`` runs in a process of its own per rank with the
environment a launcher would give it (MASTER_ADDR/PORT, RANK, WORLD_SIZE, LOCAL_RANK,
LOCAL_WORLD_SIZE, NODE_RANK), so Lightning's ``LightningEnvironment`` sees externally
created processes and ``Trainer(devices=world_size)`` joins them. With
``init_process_group=True`` the harness also creates the default gloo group before
calling the worker (for engine tests that use no Trainer).

Whatever the worker returns (picklable) comes back as ``results[rank]``. An exception
on any rank fails the test with that rank's traceback; a rank that has not finished
after ``timeout_s`` is killed with the others and the test fails instead of hanging.
Ranks share one machine, so each is pinned to one intra-op thread: with 4 ranks on
2 cores, more threads only thrash.

[Note: the rank pool]
A freshly spawned rank imports torch, Lightning and this package before the worker's
first line: 6.5-11 s for 2 ranks on the 2-core CI machine, on every call (``python
benchmarks/spawn_cost.py``: 11.1 s at earlier stops, 6.5 s on 2026-11-27, where a pooled
call took 0.18 s after the pool's first, 11.6 s), about half of the suite's time. So by default the ranks run
in a pool of 4 processes spawned once (``_Pool``; spawned, not forked: each has its own
hash seed and memory layout, as ranks under torchrun do), which import what the workers
import before the first call's timeout starts and are reused by every call; rank r of a
call runs in process r. After a call that passed, a process is left as a fresh one would
be (``_exit_like``): the exit hooks that this package and the tests registered during the
call run (the orderly exit that stops comm threads and destroys the groups;
``_record_exit_hooks``), every process group destroyed, the worker's non-daemon threads
joined (one still running 30 s later fails that call), this package's per-process state
set back (``_FRESH_STATE``: the once-per-process hooks, the peer watchdog's generation,
which must agree across the ranks of a call), Accelerate's singletons reset, Python's
warnings shown again (torch's C++ warn-once ones are not), the working directory,
torch's default dtype and grad mode restored; each call starts with the caller's
environment and torch's default seed, as a fresh process does. What a module reads at
import is read once per pool, as under the forkserver below; no test passes such a
variable (the one passed, ``ACCELERATE_USE_CPU``, is read at run time). Two rules follow
for workers: undo what you patch (a module attribute, ``shutil.disk_usage``) before
returning, and pass arguments plain pickle can carry (no multiprocessing locks or
queues). A call that fails, times out or is left by any exception (pytest-timeout's)
kills the whole pool (its ranks may be stuck in a collective, or hold the failure's
state), and the next call starts a new one; a pool process that ends on its own is
reported and replaced; one whose pytest is killed ends within 2 s, also in the middle of a
call (a daemon thread watches pytest: before, a call ran on to its end, or to a collective's
timeout where a peer had died).

``fresh=True`` runs a call in processes of its own, for a worker that tests what happens
once per process or at its exit. The pool's check of the threads found a leak on its
first run: a fit with parameters on NVMe kept its trainer, optimizer, swap threads and
files until the process exited (a tensor hook held its store strongly from torch's C++
side, where the garbage collector cannot see the cycle; offload/params.py ``_weak_hook``).
The offload tests now run in the pool and would fail again on such a leak.

With the pool the suite's pytest took 725 s in CI (2026-11-27, at 22060a9).
``ZEROPP_TEST_START=spawn`` starts fresh processes for every call (the suite before the
pool: 1748-1906 s). ``ZEROPP_TEST_START=forkserver`` forks them from a server that has
imported ``_PRELOAD`` once (934 s), but in one of four full runs a forked rank aborted
with glibc's "malloc(): unaligned tcache chunk detected" (tests/test_checkpoint_faults.py,
Accelerate and Fabric in one worker; that worker then passed 72 forked runs on its own,
60 of them two at a time on 2 cores), and the cause is not found. Forked ranks also share
the hash seed and the memory layout, which real ranks do not. A forked child leaves
through ``os._exit``, which skips the interpreter's exit, so ``_entry`` does what that
exit does, in its order: join the non-daemon threads, run the atexit handlers, then
destroy a process group still left (spawned ranks do the same, before their own exit).
"""

from __future__ import annotations

import importlib
import logging
import multiprocessing as mp
import os
import pickle
import queue
import socket
import threading
import time
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


def _context(method: str) -> mp.context.BaseContext:
    ctx = mp.get_context(method)
    if method == "forkserver":
        ctx.set_forkserver_preload(_PRELOAD)  # takes effect when the server starts: the first call
    return ctx


def _setup_rank(rank: int, world_size: int, port: int, env: dict[str, str]) -> None:
    os.environ.clear()  # the caller's environment at the call, not the server's or the last call's
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


def _run_one(fn: Callable[..., Any], rank: int, world_size: int, port: int, args: tuple,
             init_process_group: bool) -> tuple[bool, Any]:
    """The worker's call: (True, its pickled result) or (False, the traceback)."""
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
        # Plain pickle bytes: torch's multiprocessing would pass tensors as shared-memory
        # handles that vanish when this process exits.
        return True, pickle.dumps(fn(rank, world_size, *args))
    except BaseException:  # noqa: BLE001 - the traceback is the test's failure message
        return False, traceback.format_exc()


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
    """A rank in a process of its own (``fresh=True``, or the "spawn"/"forkserver" start)."""
    _setup_rank(rank, world_size, port, env)
    try:
        out.put((0, rank, *_run_one(fn, rank, world_size, port, args, init_process_group)))
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


def _exit_with(parent: Any) -> None:
    """A pool process's watch on pytest: when it is gone, end this process at once."""
    while parent.is_alive():
        time.sleep(2)
    os._exit(1)


def _serve(slot: int, tasks: mp.Queue, out: mp.Queue) -> None:
    """One process of the pool: runs one rank of each call it is given, then leaves the
    process as a fresh one would find it ([Note: the rank pool])."""
    import random
    import warnings

    import torch

    for name in _PRELOAD:
        importlib.import_module(name)
    _record_exit_hooks()
    cwd, filters = os.getcwd(), list(warnings.filters)
    default_dtype, torch_seed = torch.get_default_dtype(), torch.initial_seed()
    parent = mp.parent_process()
    if parent is not None:  # pytest killed mid-call: this rank stops now, not after its call (or a peer's timeout)
        threading.Thread(target=_exit_with, args=(parent,), name="zeropp-pool-parent", daemon=True).start()
    out.put(("ready", slot, True, b""))
    while True:
        task = tasks.get()  # pytest killed: _exit_with ends the process
        if task is None:
            return
        call, payload, rank, world_size, port, env, init_process_group = task
        random.seed()  # a fresh process's: from the OS; torch's: the fixed default every fresh process has
        torch.manual_seed(torch_seed)
        _setup_rank(rank, world_size, port, env)
        try:
            fn, args = pickle.loads(payload)
        except BaseException:  # noqa: BLE001 - e.g. the test module fails to import here
            ok, result = False, traceback.format_exc()
        else:
            ok, result = _run_one(fn, rank, world_size, port, args, init_process_group)
        if not ok:  # reported at once: the cleanup may block (a peer gone), and the pool is killed anyway
            out.put((call, rank, ok, result))
            continue
        try:
            _exit_like(cwd, filters, default_dtype)
        except BaseException:  # noqa: BLE001 - a leak the next call would inherit fails this one
            ok, result = False, "the worker returned, but its process could not be left as a fresh one:\n" + (
                traceback.format_exc())
        out.put((call, rank, ok, result))


# Module state of this package that a process starts with: (module, name, value). Set back
# after every pooled call, as the once-per-process flags and the registries are per process.
_FRESH_STATE = (
    ("zeropp_strategy.engine.process_group", "_EXIT_HOOK_INSTALLED", False),
    ("zeropp_strategy.engine.watchdog", "_hook_installed", False),
    # the peer watchdog keys its heartbeats by how many engines this process started, which
    # must agree across the ranks of a call ([Note: peer watchdog])
    ("zeropp_strategy.engine.watchdog", "_generation", 0),
    ("zeropp_strategy.engine.watchdog", "_current", None),
    ("zeropp_strategy.engine.grad_reads", "_warned", False),
    ("zeropp_strategy.comm.control", "_default_ledger", None),
)


def _exit_like(cwd: str, filters: list, default_dtype: Any) -> None:
    """What a process's exit would end, so that the next call starts as in a fresh process:
    the call's exit hooks run, every process group destroyed, threads joined, this
    package's per-process state back to a fresh process's, Accelerate's singletons reset,
    warnings shown again, the working directory and torch's global modes back."""
    import gc
    import sys
    import threading
    import warnings

    import torch
    import torch.distributed as dist

    # The exit hooks first (a fresh process joins its threads first, but its exit also tells
    # idle executor threads to end, which a process that lives on cannot), then what the
    # worker dropped in a cycle (an exception's frames), so that finalizers release their
    # threads, then the threads. A raising hook does not stop the others, as at exit.
    errors = []
    while _CALL_EXIT_HOOKS:  # the last registered first, as at exit
        func, args, kwargs = _CALL_EXIT_HOOKS.pop()
        try:
            func(*args, **kwargs)
        except Exception:  # noqa: BLE001 - reported below, after the rest of the cleanup
            errors.append(traceback.format_exc())
    if dist.is_available() and dist.is_initialized():
        dist.destroy_process_group()
    gc.collect()
    left = [t for t in threading.enumerate() if t is not threading.main_thread() and not t.daemon]
    deadline = time.monotonic() + 30
    for t in left:
        t.join(timeout=max(0.0, deadline - time.monotonic()))
    still = [t.name for t in left if t.is_alive()]
    if still:
        errors.append(f"non-daemon threads still running 30 s after the worker returned: {still}")
    for module, name, value in _FRESH_STATE:
        if module in sys.modules:
            if not hasattr(sys.modules[module], name):  # renamed: this list must follow
                errors.append(f"tests/_dist.py _FRESH_STATE: {module} has no {name}")
            setattr(sys.modules[module], name, value)
    if "accelerate.state" in sys.modules:  # Accelerate's process-wide singletons: a fresh process has none
        state = sys.modules["accelerate.state"]
        state.AcceleratorState._reset_state(reset_partial_state=True)
        state.GradientState._reset_state()
    sys.excepthook = sys.__excepthook__  # the watchdog's hook wraps it again when re-armed
    warnings.filters[:] = filters
    warnings._filters_mutated()  # every "once"/"default" registry forgets what it has shown
    os.chdir(cwd)
    torch.set_default_dtype(default_dtype)
    torch.set_grad_enabled(True)
    if errors:
        raise RuntimeError("\n".join(errors))


_CALL_EXIT_HOOKS: list[tuple[Callable[..., Any], tuple, dict]] = []


def _record_exit_hooks() -> None:
    """In a pool process, the exit hooks this package and the tests register during a call
    run at the call's end, where a fresh process would have run them at its exit; any other
    library's (registered at import, or once per process) still runs at the pool's exit:
    running those after every call would, for instance, finalize objects still in use."""
    import atexit

    register = atexit.register

    def record(func: Callable[..., Any], *args: Any, **kwargs: Any) -> Callable[..., Any]:
        if (getattr(func, "__module__", None) or "").split(".")[0] in ("zeropp_strategy", "tests"):
            _CALL_EXIT_HOOKS.append((func, args, kwargs))
            return func
        return register(func, *args, **kwargs)

    atexit.register = record


class _Pool:
    """Processes spawned once and reused by every ``run_ranks`` call ([Note: the rank pool])."""

    def __init__(self, size: int) -> None:
        ctx = mp.get_context("spawn")
        self.size, self.call = size, 0
        self.out: mp.Queue = ctx.Queue()
        self.tasks: list[mp.Queue] = [ctx.Queue() for _ in range(size)]
        self.procs = [ctx.Process(target=_serve, args=(slot, self.tasks[slot], self.out), daemon=False,
                                  name=f"rank-pool-{slot}") for slot in range(size)]
        for p in self.procs:
            p.start()
        # Every slot imported what the workers import before any call's timeout starts.
        deadline, ready = time.monotonic() + 300, 0
        while ready < size:
            try:
                tag, *_ = self.out.get(timeout=max(0.1, deadline - time.monotonic()))
            except queue.Empty:
                self.close(kill=True)
                raise TimeoutError(f"the rank pool's {size} processes did not start within 300 s") from None
            ready += tag == "ready"

    def close(self, *, kill: bool = False) -> None:
        for p, q in zip(self.procs, self.tasks):
            if not kill and p.is_alive():
                q.put(None)
        _reap(self.procs, 0.5 if kill else 10)
        for q in (*self.tasks, self.out):
            q.close()
            q.cancel_join_thread()


_POOL: _Pool | None = None


def _reap(procs: list[Any], wait_s: float) -> None:
    """Join ``procs``, each given ``wait_s`` to end on its own before it is killed."""
    for p in procs:
        p.join(timeout=wait_s)
    for p in procs:
        if p.is_alive():
            p.kill()
            p.join(timeout=5)


def _pool(world_size: int) -> _Pool:
    global _POOL
    if _POOL is not None and (_POOL.size < world_size or not all(p.is_alive() for p in _POOL.procs)):
        dead = [(p.name, p.exitcode) for p in _POOL.procs if not p.is_alive()]
        if dead:  # after a call that passed: what ended it (a leftover thread's os._exit) is not seen here
            import sys

            print(f"tests/_dist.py: rank pool processes ended between calls {dead}; starting a new pool",
                  file=sys.stderr)
        _close_pool(kill=True)
    if _POOL is None:
        import atexit

        _POOL = _Pool(max(world_size, 4))
        atexit.unregister(_close_pool)
        atexit.register(_close_pool)
    return _POOL


def _close_pool(*, kill: bool = False) -> None:
    global _POOL
    if _POOL is not None:
        _POOL.close(kill=kill)
        _POOL = None


class LogLines(logging.Handler):
    """The messages of the log records it sees (at INFO and above), for a worker to return."""

    def __init__(self) -> None:
        super().__init__(logging.INFO)
        self.lines: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.lines.append(record.getMessage())


def _more_failures(out: Any, call: int, failures: list[str], results: dict[int, Any], world_size: int, *,
                   grace_s: float) -> None:
    """After a rank's failure: the other ranks' reports that arrive within ``grace_s``."""
    deadline = time.monotonic() + grace_s
    while len(results) + len(failures) < world_size and time.monotonic() < deadline:
        try:
            got, rank, ok, payload = out.get(timeout=max(0.05, deadline - time.monotonic()))
        except queue.Empty:
            return
        if got != call:
            continue
        if ok:
            failures.append(f"--- rank {rank} --- returned normally (fewer collectives than the failed rank?)")
        else:
            failures.append(f"--- rank {rank} ---\n{payload}")


def run_ranks(
    fn: Callable[..., Any],
    world_size: int,
    args: tuple = (),
    *,
    timeout_s: float = 180,
    env: dict[str, str] | None = None,
    init_process_group: bool = False,
    fresh: bool = False,
) -> list[Any]:
    """``fn(rank, world_size, *args)`` on ``world_size`` ranks; their results by rank.
    ``fresh=True``: in processes started for this call only (a worker that tests what a
    process does once, or at its exit)."""
    method = os.environ.get("ZEROPP_TEST_START", "pool")
    if method not in ("pool", "spawn", "forkserver"):
        raise ValueError(f"ZEROPP_TEST_START={method!r}: must be 'pool', 'spawn' or 'forkserver'")
    env = {**os.environ, **(env or {})}
    port = free_port()
    if method == "pool" and not fresh:
        pool = _pool(world_size)
        pool.call += 1
        payload = pickle.dumps((fn, args))  # here, so that an unpicklable worker fails at once
        for rank in range(world_size):
            pool.tasks[rank].put((pool.call, payload, rank, world_size, port, env, init_process_group))
        procs, out, call = pool.procs[:world_size], pool.out, pool.call
    else:
        ctx = _context("spawn" if method == "pool" else method)
        out = ctx.Queue()
        procs = [ctx.Process(target=_entry, args=(fn, rank, world_size, port, args, env, init_process_group, out),
                             daemon=False)
                 for rank in range(world_size)]
        for p in procs:
            p.start()
        pool, call = None, 0
    results: dict[int, Any] = {}
    failures: list[str] = []
    try:
        deadline = time.monotonic() + timeout_s
        while len(results) + len(failures) < world_size:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                missing = sorted(set(range(world_size)) - set(results))
                failures.append(
                    f"ranks {missing} did not finish within {timeout_s:.0f}s "
                    f"(finished: {sorted(results)}); killed all ranks"
                )
                raise TimeoutError("\n".join(failures))
            try:
                got, rank, ok, payload = out.get(timeout=min(remaining, 1.0))
            except queue.Empty:
                # A rank that died without reporting (segfault, os._exit) would otherwise
                # make us wait for the full timeout.
                dead = [r for r, p in enumerate(procs) if (not p.is_alive() if pool else p.exitcode not in (None, 0))
                        and r not in results]
                if dead and not failures:
                    failures.append(f"rank(s) {dead} exited with codes {[procs[r].exitcode for r in dead]}")
                    break
                continue
            if got != call:
                continue  # not expected: a result of an earlier call (a failed call's pool is not reused)
            if ok:
                results[rank] = pickle.loads(payload)
            else:
                failures.append(f"--- rank {rank} ---\n{payload}")
                # One failed rank usually leaves the others blocked in a collective. The first
                # report is often a peer's "connection closed": give the others a moment to
                # report theirs, which holds the cause.
                _more_failures(out, call, failures, results, world_size, grace_s=3.0)
                break
    finally:
        if pool is not None:
            # A failure, a timeout, or any exception out of here (pytest-timeout's, Ctrl-C):
            # ranks may be stuck in a collective or carry the failure's state.
            if failures or len(results) < world_size:
                _close_pool(kill=True)
        else:
            _reap(procs, 5 if not failures else 0.5)
            out.close()
    if failures:
        raise AssertionError("distributed worker failed:\n" + "\n".join(failures))
    return [results[r] for r in range(world_size)]

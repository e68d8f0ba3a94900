"""The end of a run: nothing of ours left inside a collective, every process group
destroyed before the interpreter finalizes ([Note: orderly exit] in engine/process_group.py).

    pytest tests/test_exit.py -q

A gloo group alive at interpreter finalization can abort a rank after training finished
("terminate called without an active exception"), and torchrun then fails the job. What
is checked here, on 2 gloo ranks whose default group the launcher created (as torchrun
and Accelerate do): after ``Trainer.fit`` at stages 1 and 3 no comm thread is alive (the
strategy's teardown stopped it, and a second fit starts it again), the exit hook is
installed although the group was not ours, and the hook leaves no group and no comm
thread, and once the Trainers are gone no gloo thread runs either (torch's DTensor cache
kept a destroyed group alive before). A second test reproduces the abort itself: a
comm-thread job still inside torch when the interpreter finalizes ends the process with
SIGABRT and that line; with the exit hook the process ends cleanly.
``benchmarks/exit_check.py`` runs whole jobs on the simulated cluster, 30 in a row.
"""

from __future__ import annotations

import signal
import sys

import pytest

from tests._dist import run_ranks

pytestmark = pytest.mark.timeout(300)


def _comm_threads() -> list[str]:
    import threading

    return [t.name for t in threading.enumerate() if t.name.startswith("zeropp-comm")]


def _gloo_threads() -> list[str]:
    """This process's threads that a live gloo group runs (its worker and transport loops)."""
    import os

    names = []
    for t in os.listdir("/proc/self/task"):
        try:
            names.append(open(f"/proc/self/task/{t}/comm").read().strip())
        except FileNotFoundError:  # ended since the listing
            pass
    return sorted(n for n in names if n.startswith(("pt_gloo", "gloo_tcp")))


def _fits(world: int, out: dict) -> None:
    """The fits, in a scope of their own: when it returns the Trainers are gone, as at the end
    of a script whose training ran in a function."""
    import lightning.pytorch as L
    import torch

    from tests._models import ParityModule, trainer_kwargs

    for stage in ("zeropp_stage_1", "zeropp_stage_3", "zeropp_stage_3"):  # the second stage-3 fit restarts the thread
        torch.manual_seed(0)
        trainer = L.Trainer(strategy=stage, **trainer_kwargs(world, max_steps=2))
        trainer.fit(ParityModule())
        out["threads_after_fit"].setdefault(stage, []).append(_comm_threads())


def _worker(rank: int, world: int) -> dict:
    import gc

    import torch.distributed as dist

    import zeropp_strategy  # noqa: F401 - registers the strategy names
    from zeropp_strategy.engine import process_group

    out: dict = {"threads_after_fit": {}}
    _fits(world, out)
    gc.collect()
    out["hook_installed"] = process_group._EXIT_HOOK_INSTALLED
    process_group._orderly_exit()  # what atexit runs
    out["initialized_after_exit_hook"] = dist.is_initialized()
    out["threads_after_exit_hook"] = _comm_threads()
    out["gloo_threads_after_exit_hook"] = _gloo_threads()
    return out


def test_teardown_stops_the_comm_thread_and_exit_destroys_every_group() -> None:
    for rank, out in enumerate(run_ranks(_worker, 2, timeout_s=240, init_process_group=True)):
        assert out["threads_after_fit"] == {"zeropp_stage_1": [[]], "zeropp_stage_3": [[], []]}, (rank, out)
        assert out["hook_installed"], rank  # the launcher's group, not ours: the hook still goes in
        assert not out["initialized_after_exit_hook"] and not out["threads_after_exit_hook"], (rank, out)
        # Destroyed groups whose C++ objects stayed alive (DTensor's sharding cache held their
        # mesh) kept their gloo threads running into the interpreter's finalization: without
        # release_destroyed_groups this fails with one group's three threads left
        assert not out["gloo_threads_after_exit_hook"], (rank, out)


_THREAD_AT_EXIT = """
import sys, time, torch
from zeropp_strategy.comm.comm_thread import CommThread
from zeropp_strategy.engine.process_group import destroy_at_exit

class SlowToFree:  # keeps the interpreter's finalization going for a while
    def __del__(self):
        time.sleep(3.5)

keep = SlowToFree()
if sys.argv[1] == "hook":
    destroy_at_exit()
a = torch.randn(1000, 1000)

def job():  # a comm-thread job still inside torch (the GIL released) when the script ends
    end = time.monotonic() + 2.0
    while time.monotonic() < end:
        a @ a

CommThread().submit(job)
time.sleep(0.2)
print("script done", flush=True)
"""


@pytest.mark.skipif(sys.version_info >= (3, 14), reason="from 3.14 such threads hang at finalization instead")
def test_a_thread_inside_torch_at_finalization_aborts_and_the_exit_hook_prevents_it() -> None:
    """The mechanism behind "terminate called without an active exception" at the end of a
    correct run: a thread that needs the GIL after the interpreter has begun to finalize is
    ended by ``pthread_exit``, whose unwinding through a C++ destructor that takes the GIL
    (torch's GIL release around an op) calls ``std::terminate``. The exit hook waits for
    the comm thread's jobs before the interpreter finalizes ([Note: orderly exit])."""
    import subprocess

    runs = {how: subprocess.run([sys.executable, "-c", _THREAD_AT_EXIT, how], capture_output=True, text=True,
                                timeout=120) for how in ("bare", "hook")}
    bare, hook = runs["bare"], runs["hook"]
    assert "script done" in bare.stdout and bare.returncode == -signal.SIGABRT, (bare.returncode, bare.stderr[-2000:])
    assert "terminate called" in bare.stderr, bare.stderr[-2000:]
    assert hook.returncode == 0 and "terminate called" not in hook.stderr, (hook.returncode, hook.stderr[-2000:])

"""The end of a run: nothing of ours left inside a collective, every process group
destroyed before the interpreter finalizes ([Note: orderly exit] in engine/process_group.py).

    pytest tests/test_exit.py -q

A gloo group alive at interpreter finalization can abort a rank after training finished
("terminate called without an active exception"), and torchrun then fails the job. What
is checked here, on 2 gloo ranks whose default group the launcher created (as torchrun
and Accelerate do): after ``Trainer.fit`` at stages 1 and 3 no comm thread is alive (the
strategy's teardown stopped it, and a second fit starts it again), the exit hook is
installed although the group was not ours, and the hook leaves no group and no comm
thread. ``benchmarks/exit_check.py`` runs whole jobs on the simulated cluster, 30 in a row.
"""

from __future__ import annotations

import pytest

from tests._dist import run_ranks

pytestmark = pytest.mark.timeout(300)


def _comm_threads() -> list[str]:
    import threading

    return [t.name for t in threading.enumerate() if t.name.startswith("zeropp-comm")]


def _worker(rank: int, world: int) -> dict:
    import lightning.pytorch as L
    import torch
    import torch.distributed as dist

    import zeropp_strategy  # noqa: F401 - registers the strategy names
    from tests._models import ParityModule, trainer_kwargs
    from zeropp_strategy.engine import process_group

    out: dict = {"threads_after_fit": {}}
    for stage in ("zeropp_stage_1", "zeropp_stage_3", "zeropp_stage_3"):  # the second stage-3 fit restarts the thread
        torch.manual_seed(0)
        trainer = L.Trainer(strategy=stage, **trainer_kwargs(world, max_steps=2))
        trainer.fit(ParityModule())
        out["threads_after_fit"].setdefault(stage, []).append(_comm_threads())
    out["hook_installed"] = process_group._EXIT_HOOK_INSTALLED
    process_group._orderly_exit()  # what atexit runs
    out["initialized_after_exit_hook"] = dist.is_initialized()
    out["threads_after_exit_hook"] = _comm_threads()
    return out


def test_teardown_stops_the_comm_thread_and_exit_destroys_every_group() -> None:
    for rank, out in enumerate(run_ranks(_worker, 2, timeout_s=240, init_process_group=True)):
        assert out["threads_after_fit"] == {"zeropp_stage_1": [[]], "zeropp_stage_3": [[], []]}, (rank, out)
        assert out["hook_installed"], rank  # the launcher's group, not ours: the hook still goes in
        assert not out["initialized_after_exit_hook"] and not out["threads_after_exit_hook"], (rank, out)

"""One rank of a fault-injection job, run as ``python -m tests._fault_worker`` by
``tests/test_reliability.py`` under a launcher's environment (RANK, WORLD_SIZE, MASTER_*;
torchrun's or the test's own).

``--fault kill|stop|error`` hits ``--victim`` at optimizer step ``--at-step`` (on the first
torchrun attempt only, so a restarted job runs clean); ``--linger`` keeps that many seconds
of rank-local work after fit on the last rank (a normal end that must not look like a
death). ``--ckpt-dir`` turns on a ModelCheckpoint at every epoch end and
``ZeroPPStrategy(resume="auto")``; the final parameters go to ``--out`` (rank 0).
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import torch
from lightning.pytorch import Trainer, seed_everything
from lightning.pytorch.callbacks import ModelCheckpoint

from tests._models import ParityModule, trainer_kwargs
from zeropp_strategy import ZeroPPStrategy

ROOT = Path(__file__).resolve().parents[1]


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--fault", choices=["none", "kill", "stop", "error"], default="none")
    ap.add_argument("--victim", type=int, default=1)
    ap.add_argument("--at-step", type=int, default=3)
    ap.add_argument("--stage", type=int, default=3)
    ap.add_argument("--peer-timeout", type=float, default=60.0)
    ap.add_argument("--max-epochs", type=int, default=1)
    ap.add_argument("--linger", type=float, default=0.0)
    ap.add_argument("--ckpt-dir", default=None)
    ap.add_argument("--out", default=None)
    a = ap.parse_args()
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    torch.set_num_threads(1)
    first_attempt = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") == "0"
    if not first_attempt and rank == 1:
        time.sleep(3)  # late to the new rendezvous: without a per-attempt store prefix rank 0 would
        # read rank 1's keys of the failed attempt and fail to connect (see engine.process_group.attempt_store)

    class Faulty(ParityModule):
        steps_here = 0  # training steps run by this process (a resumed attempt runs fewer)

        def training_step(self, batch, batch_idx):
            Faulty.steps_here += 1
            if a.fault != "none" and first_attempt and rank == a.victim and self.trainer.global_step == a.at_step:
                print(f"injecting {a.fault} on rank {rank} at step {a.at_step} (t={time.time():.3f})", flush=True)
                if a.fault == "error":
                    raise ValueError("injected fault on this rank")
                os.kill(os.getpid(), signal.SIGKILL if a.fault == "kill" else signal.SIGSTOP)
            return super().training_step(batch, batch_idx)

    seed_everything(0)
    callbacks = []
    if a.ckpt_dir:
        callbacks.append(ModelCheckpoint(dirpath=a.ckpt_dir, save_top_k=-1, every_n_epochs=1))
    strategy = ZeroPPStrategy(stage=a.stage, peer_timeout=a.peer_timeout, resume="auto" if a.ckpt_dir else None)
    kw = trainer_kwargs(world, max_steps=-1 if a.ckpt_dir else 40, max_epochs=a.max_epochs)
    kw.update(enable_checkpointing=bool(a.ckpt_dir), callbacks=callbacks)
    trainer = Trainer(strategy=strategy, **kw)
    module = Faulty()
    trainer.fit(module)
    state = {k: v.full_tensor() if hasattr(v, "full_tensor") else v for k, v in module.state_dict().items()}
    if a.out and rank == 0:
        json.dump({"global_step": trainer.global_step, "params": {k: v.tolist() for k, v in state.items()}},
                  open(a.out, "w"))
    if a.linger and rank == world - 1:
        time.sleep(a.linger)  # rank-local work after fit: the others have exited by now
    print(f"rank {rank} finished after {Faulty.steps_here} steps in this process", flush=True)


# -- the launcher side: the tests and benchmarks/fault_detection.py start jobs with these ------


def start_ranks(world: int, args: list[str], log_dir: Path, port: int) -> tuple[list, list]:
    """Start ``world`` ranks of this module as torchrun would (one process each, output to
    ``log_dir/rank<r>.log``). Pair with ``stop_ranks``."""
    procs, logs = [], []
    for rank in range(world):
        env = {**os.environ, "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port), "RANK": str(rank),
               "WORLD_SIZE": str(world), "LOCAL_RANK": str(rank), "LOCAL_WORLD_SIZE": str(world), "NODE_RANK": "0",
               "GLOO_SOCKET_IFNAME": "lo", "PYTHONUNBUFFERED": "1"}
        log = open(Path(log_dir) / f"rank{rank}.log", "w+")
        logs.append(log)
        procs.append(subprocess.Popen([sys.executable, "-m", "tests._fault_worker", *args], cwd=ROOT, env=env,
                                      stdout=log, stderr=subprocess.STDOUT))
    return procs, logs


def stop_ranks(procs: list, logs: list) -> list[str]:
    """Kill what still runs, reap everything, return each rank's output."""
    for p in procs:
        if p.poll() is None:
            p.kill()
        p.wait()
    outputs = []
    for log in logs:
        log.seek(0)
        outputs.append(log.read())
        log.close()
    return outputs


if __name__ == "__main__":
    main()

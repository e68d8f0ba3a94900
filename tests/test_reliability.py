"""Faults injected on spawned gloo ranks: each must end in a clear error on every rank,
within a bounded time, never a hang."""

from __future__ import annotations

from tests._dist import run_ranks


def _mismatched_configs(rank: int, world: int) -> str:
    from lightning.pytorch import Trainer

    from tests._models import ParityModule, trainer_kwargs
    from zeropp_strategy import ZeroPPStrategy

    # rank 1 was launched with another stage and without qwZ: a mistake in a launch script
    fields = {"stage": 3, "quantized_weights": True} if rank == 0 else {"stage": 2}
    trainer = Trainer(strategy=ZeroPPStrategy(**fields), **trainer_kwargs(world, max_steps=2))
    try:
        trainer.fit(ParityModule())
    except ValueError as e:
        return str(e)
    return "no error"


def test_ranks_with_different_configs_all_raise_the_same_clear_error():
    messages = run_ranks(_mismatched_configs, 2, timeout_s=120)
    assert messages[0] == messages[1], messages
    text = messages[0]
    assert "different ZeroConfigs" in text and "Fix: give every rank the same configuration" in text
    assert "stage: ranks 0 have 3; ranks 1 have 2" in text
    assert "quantized_weights: ranks 0 have True; ranks 1 have False" in text


def _same_but_nvme_path(rank: int, world: int, tmp: str) -> bool:
    import os

    import torch.distributed as dist

    from zeropp_strategy.config import OffloadConfig, ZeroConfig
    from zeropp_strategy.engine.guards import check_same_config

    path = os.path.join(tmp, f"node{rank}")
    os.makedirs(path, exist_ok=True)
    check_same_config(ZeroConfig(stage=3, offload_optimizer=OffloadConfig(device="nvme", nvme_path=path)).comparable(),
                      world)
    dist.barrier()
    return True


def test_nvme_paths_may_differ_per_rank(tmp_path):
    assert run_ranks(_same_but_nvme_path, 2, (str(tmp_path),), timeout_s=60, init_process_group=True) == [True, True]


def _nonfinite(rank: int, world: int, stage: int, policy: str) -> dict:
    import torch
    from lightning.pytorch import Trainer, seed_everything

    from tests._models import ParityModule, trainer_kwargs
    from zeropp_strategy import ZeroPPStrategy

    class Poisoned(ParityModule):
        """Rank 1's loss is NaN at optimizer step 2 (a bad batch on one rank)."""

        def training_step(self, batch, batch_idx):
            loss = super().training_step(batch, batch_idx)
            if self.trainer.global_step == 2 and self.global_rank == 1:
                loss = loss * float("nan")
            return loss

    seed_everything(0)
    strategy = ZeroPPStrategy(stage=stage, on_nonfinite=policy)
    trainer = Trainer(strategy=strategy, **trainer_kwargs(world, max_steps=5))
    module = Poisoned()
    try:
        trainer.fit(module)
    except FloatingPointError as e:
        return {"error": str(e)}
    finite = all(torch.isfinite(p.to_local() if hasattr(p, "to_local") else p).all().item()
                 for p in module.parameters())
    opt = trainer.strategy.optimizers[0]
    inner = getattr(opt, "optimizer", opt)
    steps = sorted({float(s["step"]) for s in inner.state.values() if "step" in s})
    return {"finite": finite, "skipped": strategy.skipped_steps, "global_step": trainer.global_step, "steps": steps}


def test_nonfinite_raise_stops_every_rank_with_the_step_and_the_parameter():
    results = run_ranks(_nonfinite, 2, (3, "raise"), timeout_s=120)
    assert results[0] == results[1], results
    text = results[0]["error"]
    assert "non-finite values at optimizer step 2: non-finite loss on rank(s) 1; first non-finite gradient in" in text
    assert "rank 1: nan" in text
    assert "Fix:" in text


def test_nonfinite_skip_drops_the_step_on_every_rank_at_stages_1_and_3():
    for stage in (1, 3):
        results = run_ranks(_nonfinite, 2, (stage, "skip"), timeout_s=120)
        for r in results:
            assert r["finite"] and r["skipped"] == 1, (stage, r)
            # 5 optimizer steps taken by the loop, 4 of them updated the weights (Adam's counter).
            assert r["global_step"] == 5 and r["steps"] == [4.0], (stage, r)


def _export_into_a_file(rank: int, world: int, tmp: str) -> str:
    import os

    from zeropp_strategy.rlhf.export import export_causal_lm
    from zeropp_strategy.rlhf.models import build_causal_lm, tiny_llama_config

    blocker = os.path.join(tmp, "not-a-dir")
    if rank == 0:
        open(blocker, "w").close()  # the export's parent is a file: rank 0's write fails
    model = build_causal_lm(tiny_llama_config(hidden_size=32, intermediate_size=64, num_hidden_layers=1))
    try:
        export_causal_lm(model, os.path.join(blocker, "actor"))
    except Exception as e:  # noqa: BLE001 - the test compares what each rank saw
        return f"{type(e).__name__}: {e}"
    return "no error"


def test_an_export_failing_on_rank_0_stops_every_rank(tmp_path):
    results = run_ranks(_export_into_a_file, 2, (str(tmp_path),), timeout_s=120, init_process_group=True)
    assert results[0].startswith(("FileExistsError", "NotADirectoryError", "OSError")), results
    assert results[1].startswith("RuntimeError: zeropp: exporting ") and "failed on rank 0" in results[1], results


# -- a rank that dies: the others stop and name it ([Note: peer watchdog]) ------------------------

import os  # noqa: E402
import subprocess  # noqa: E402
import sys  # noqa: E402
import time  # noqa: E402
from pathlib import Path  # noqa: E402

from tests._dist import free_port  # noqa: E402
from tests._fault_worker import start_ranks, stop_ranks  # noqa: E402

_ROOT = Path(__file__).resolve().parents[1]


def _job(tmp_path: Path, world: int, *args: str, limit_s: float = 90.0):
    """Start ``world`` ranks of tests/_fault_worker.py as a launcher would; wait at most
    ``limit_s`` for the others once any has exited; kill everything left, always.
    Returns [(exit status or None if it had to be killed, output)] per rank and the seconds
    from the first exit to the last."""
    procs, logs = start_ranks(world, list(args), tmp_path, free_port())
    try:
        start = time.monotonic()
        first_exit = None
        while time.monotonic() - start < 240:
            done = [p.poll() is not None for p in procs]
            if any(done) and first_exit is None:
                first_exit = time.monotonic()
            if all(done) or (first_exit is not None and time.monotonic() - first_exit > limit_s):
                break
            time.sleep(0.2)
        spread = time.monotonic() - (first_exit or start)
        statuses = [p.poll() for p in procs]
    finally:
        outputs = stop_ranks(procs, logs)
    return list(zip(statuses, outputs)), spread


def test_a_killed_rank_stops_the_others_with_its_name(tmp_path):
    """SIGKILL of rank 1 of 3 mid-step (stage 3): ranks 0 and 2 exit non-zero within
    seconds, each naming rank 1 (gloo alone would say 'Connection reset by peer')."""
    results, spread = _job(tmp_path, 3, "--fault", "kill", "--victim", "1", "--peer-timeout", "20", limit_s=60)
    assert results[1][0] == -9, results[1][1][-3000:]
    for rank in (0, 2):
        status, out = results[rank]
        assert status not in (0, None), f"rank {rank} did not stop: {out[-3000:]}"
        assert "because rank 1 " in out and "is gone" in out, out[-3000:]
    assert spread < 60


def test_a_frozen_rank_is_named_after_peer_timeout(tmp_path):
    """SIGSTOP of rank 1 (alive but silent: gloo would wait for the process-group timeout,
    30 minutes): rank 0 stops after peer_timeout=4 s plus the grace, naming rank 1."""
    # rank 0 exits first; the frozen rank 1 is then killed by the harness after 2 s
    results, spread = _job(tmp_path, 2, "--fault", "stop", "--victim", "1", "--peer-timeout", "4", limit_s=2)
    status, out = results[0]
    assert status == 1, out[-3000:]
    assert "rank 1 " in out and "no heartbeat" in out, out[-3000:]
    assert results[1][0] is None  # frozen until the harness killed it


def test_the_store_host_dying_is_named(tmp_path):
    """SIGKILL of rank 0, which hosts the rendezvous store outside torchrun."""
    results, _ = _job(tmp_path, 2, "--fault", "kill", "--victim", "0", "--peer-timeout", "20", limit_s=60)
    status, out = results[1]
    assert status not in (0, None), out[-3000:]
    assert "rank 0" in out and "collective failed because" in out, out[-3000:]


def test_a_rank_that_raised_is_named_by_the_others(tmp_path):
    results, _ = _job(tmp_path, 2, "--fault", "error", "--victim", "1", "--peer-timeout", "20", limit_s=60)
    assert results[1][0] not in (0, None) and "injected fault on this rank" in results[1][1]
    status, out = results[0]
    assert status not in (0, None), out[-3000:]
    assert "because rank 1 stopped with an error (ValueError: injected fault on this rank)" in out, out[-3000:]


def test_no_false_alarm_when_ranks_end_at_different_times(tmp_path):
    """A normal run where the last rank keeps working 4 s after the others (and the store's
    host) have exited, with peer_timeout=1 s: every rank exits 0."""
    results, _ = _job(tmp_path, 2, "--peer-timeout", "1", "--linger", "4", limit_s=60)
    for rank, (status, out) in enumerate(results):
        assert status == 0 and f"rank {rank} finished after" in out, out[-3000:]


# -- crash and restart: resume="auto" under torchrun --max-restarts ----------------------------


def test_killed_job_restarts_and_ends_equal_to_an_uninterrupted_run(tmp_path):
    """3 epochs, a checkpoint at each epoch end, stage 3, fp32. torchrun --max-restarts 1:
    rank 1 is SIGKILLed mid-epoch 2 of the first attempt; the restarted job resumes from the
    epoch-1 checkpoint (resume="auto") and its final parameters equal, exactly, those of
    the same job run without the fault. An interrupted save (a newer '.tmp-' sibling) and a
    half-copied directory without its meta file sit in the directory and are never chosen."""
    import json

    reference, _ = _job(tmp_path, 2, "--max-epochs", "3", "--ckpt-dir", str(tmp_path / "ref"),
                        "--out", str(tmp_path / "ref.json"), limit_s=60)
    assert all(status == 0 for status, _ in reference), reference[0][1][-3000:]

    ckpt = tmp_path / "ckpt"
    (ckpt / "epoch=9-step=999.ckpt.tmp-0badc0de").mkdir(parents=True)
    (ckpt / "epoch=8-step=998.ckpt").mkdir()
    (ckpt / "epoch=8-step=998.ckpt" / "__0_0.distcp").write_bytes(b"half a copy")
    future = time.time() + 3600
    for p in ckpt.iterdir():
        os.utime(p, (future, future))
    port = free_port()
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", "--max-restarts", "1",
           "--master-addr", "127.0.0.1", "--master-port", str(port), "-m", "tests._fault_worker",
           "--fault", "kill", "--victim", "1", "--at-step", "30", "--max-epochs", "3",
           "--ckpt-dir", str(ckpt), "--out", str(tmp_path / "resumed.json")]
    proc = subprocess.run(cmd, cwd=_ROOT, env={**os.environ, "GLOO_SOCKET_IFNAME": "lo"}, capture_output=True,
                          text=True, timeout=240)
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out[-4000:]
    assert "injecting kill on rank 1 at step 30" in out
    assert "resuming from " + str(ckpt / "epoch=0-step=20.ckpt") in out, out[-4000:]
    # the restarted attempt trained epochs 2 and 3 only: it really started from the checkpoint
    assert "rank 0 finished after 40 steps in this process" in out, out[-4000:]

    ref, resumed = (json.loads((tmp_path / f"{n}.json").read_text()) for n in ("ref", "resumed"))
    assert ref["global_step"] == resumed["global_step"] == 60
    assert ref["params"].keys() == resumed["params"].keys()
    for name, value in ref["params"].items():
        assert resumed["params"][name] == value, name


def test_resume_picks_the_newest_complete_checkpoint(tmp_path):
    import pytest
    from lightning.pytorch import Trainer
    from lightning.pytorch.callbacks import ModelCheckpoint

    from zeropp_strategy import ZeroPPStrategy

    with pytest.raises(TypeError, match="ZeroPPStrategy\\(resume=3\\)"):
        ZeroPPStrategy(resume=3)
    trainer = Trainer(strategy=ZeroPPStrategy(resume="auto"), accelerator="cpu", devices=1, logger=False)
    with pytest.raises(ValueError, match="resume='auto'.*ModelCheckpoint\\(dirpath="):
        trainer.strategy.resume_path(trainer)

    ckpt = tmp_path / "ckpt"
    trainer = Trainer(strategy=ZeroPPStrategy(resume="auto"), accelerator="cpu", devices=1, logger=False,
                      callbacks=[ModelCheckpoint(dirpath=ckpt)])
    assert trainer.strategy.resume_path(trainer) is None  # no directory yet: start from scratch
    ckpt.mkdir()
    (ckpt / "old.ckpt").write_bytes(b"x")
    (ckpt / "sharded.ckpt").mkdir()
    (ckpt / "sharded.ckpt" / "zeropp_meta.pt").write_bytes(b"x")
    (ckpt / "newer.ckpt.tmp-12345678").mkdir()  # an interrupted save
    (ckpt / "copied.ckpt").mkdir()  # a directory without its meta file
    for age, name in enumerate(["copied.ckpt", "newer.ckpt.tmp-12345678", "sharded.ckpt", "old.ckpt"]):
        os.utime(ckpt / name, (time.time() - age * 60, time.time() - age * 60))
    assert trainer.strategy.resume_path(trainer) == str(ckpt / "sharded.ckpt")
    other = ZeroPPStrategy(resume=tmp_path / "elsewhere")
    assert other.resume_path(trainer) is None


def _resume_disagreement(rank: int, world: int, root: str) -> str:
    from lightning.pytorch import Trainer

    from tests._models import ParityModule, trainer_kwargs
    from zeropp_strategy import ZeroPPStrategy

    # Rank 0 sees a checkpoint that rank 1 does not (a node-local directory).
    mine = Path(root) / f"rank{rank}"
    mine.mkdir()
    if rank == 0:
        (mine / "last.ckpt").write_bytes(b"x")
    trainer = Trainer(strategy=ZeroPPStrategy(resume=mine), **trainer_kwargs(world, max_steps=1))
    try:
        trainer.fit(ParityModule())
    except ValueError as e:
        return str(e)
    return "no error"


def test_ranks_that_would_resume_from_different_checkpoints_all_raise(tmp_path):
    errors = run_ranks(_resume_disagreement, 2, (str(tmp_path),), timeout_s=90)
    assert errors[0] == errors[1] and "chose different checkpoints on different ranks" in errors[0], errors
    assert "rank 1: None" in errors[0]


# -- uneven evaluation inputs ([Note: uneven evaluation]) -----------------------------------------


def _uneven_validation(rank: int, world: int, stage: int, counts: list[int]) -> dict:
    import torch
    from lightning.pytorch import Trainer
    from torch.utils.data import DataLoader, Subset

    from tests._models import ParityModule, dataset, trainer_kwargs
    from zeropp_strategy import ZeroPPStrategy

    class Uneven(ParityModule):
        """Rank r validates on counts[r] batches of 4 (no DistributedSampler to even them)."""

        seen = 0

        def val_dataloader(self):
            start = sum(counts[:rank]) * 4
            return DataLoader(Subset(dataset(n=64, seed=1), range(start, start + counts[rank] * 4)), batch_size=4)

        def validation_step(self, batch, batch_idx):
            Uneven.seen += 1
            x, y = batch
            loss = torch.nn.functional.cross_entropy(self(x), y)
            self.log("val_loss", loss, sync_dist=True)
            self.log("val_batches", 1.0, reduce_fx="sum", sync_dist=True)

    trainer = Trainer(strategy=ZeroPPStrategy(stage=stage, peer_timeout=30),
                      **trainer_kwargs(world, limit_val_batches=None, use_distributed_sampler=False))
    metrics = trainer.validate(Uneven(), verbose=False)[0]
    return {"metrics": metrics, "steps": Uneven.seen}


def test_uneven_validation_batches_do_not_hang_at_stage_3_and_count_once():
    """Rank 0 has 3 validation batches, rank 1 has 1: at stage 3 rank 1 runs 2 padding
    steps (its forwards are collectives rank 0 is in), whose logs are discarded, so the
    metrics equal stage 2's, where forwards are local and nothing is padded."""
    ref = run_ranks(_uneven_validation, 2, (2, [3, 1]), timeout_s=90)
    got = run_ranks(_uneven_validation, 2, (3, [3, 1]), timeout_s=90)
    assert [r["steps"] for r in ref] == [3, 1] and [r["steps"] for r in got] == [3, 3]
    for r in (0, 1):
        assert got[r]["metrics"]["val_batches"] == ref[r]["metrics"]["val_batches"] == 4.0
        assert abs(got[r]["metrics"]["val_loss"] - ref[r]["metrics"]["val_loss"]) < 1e-6, (got, ref)


def test_a_rank_without_validation_batches_borrows_one_at_stage_3():
    got = run_ranks(_uneven_validation, 2, (3, [2, 0]), timeout_s=90)
    assert [r["steps"] for r in got] == [2, 2]
    assert got[0]["metrics"] == got[1]["metrics"]


# -- on_nonfinite in Fabric and Accelerate ----------------------------------------------------------


def _nonfinite_loop(rank: int, world: int, front: str, policy: str) -> dict:
    import torch
    from torch.utils.data import DataLoader

    from tests._models import Net, dataset

    torch.manual_seed(0)
    model = Net()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    if front == "fabric":
        from lightning.fabric import Fabric

        from zeropp_strategy.fabric import ZeroPPFabricStrategy

        runner = Fabric(strategy=ZeroPPFabricStrategy(stage=3, on_nonfinite=policy), accelerator="cpu",
                        devices=world)
        runner.launch()
        model, optimizer = runner.setup(model, optimizer)
        counter = runner.strategy
    else:
        from zeropp_strategy.accelerate import ZeroPPAccelerator

        runner = counter = ZeroPPAccelerator(zero_config={"stage": 3}, on_nonfinite=policy)
        model, optimizer = runner.prepare(model, optimizer)
    loader = DataLoader(dataset(n=32, seed=rank), batch_size=4)
    try:
        for step, (x, y) in zip(range(4), loader):
            loss = torch.nn.functional.cross_entropy(model(x), y)
            if step == 1 and rank == 1:
                loss = loss * float("nan")  # a bad batch on one rank
            runner.backward(loss)
            optimizer.step()
            optimizer.zero_grad()
    except FloatingPointError as e:
        return {"error": str(e)}
    inner = optimizer
    while hasattr(inner, "optimizer"):
        inner = inner.optimizer
    steps = sorted({float(s["step"]) for s in inner.state.values() if "step" in s})
    finite = all(torch.isfinite(p.to_local() if hasattr(p, "to_local") else p).all().item()
                 for p in model.parameters())
    return {"skipped": counter.skipped_steps, "steps": steps, "finite": finite}


import pytest  # noqa: E402


@pytest.mark.parametrize("front", ["fabric", "accelerate"])
def test_nonfinite_policies_in_fabric_and_accelerate(front):
    raised = run_ranks(_nonfinite_loop, 2, (front, "raise"), timeout_s=120)
    assert raised[0] == raised[1], raised
    assert "non-finite values at optimizer step 1: non-finite loss on rank(s) 1" in raised[0]["error"], raised
    skipped = run_ranks(_nonfinite_loop, 2, (front, "skip"), timeout_s=120)
    for r in skipped:
        assert r == {"skipped": 1, "steps": [3.0], "finite": True}, skipped


# -- the watchdog's logic, in one process (a HashStore stands in for the rendezvous store) ------


def _watchdog(timeout=0.5, world=2):
    import torch.distributed as dist

    from zeropp_strategy.engine.watchdog import PeerWatchdog

    exits = []
    store = dist.HashStore()
    w = PeerWatchdog(store, rank=0, world_size=world, timeout=timeout, generation=999, exit=exits.append)
    return w, store, exits


def test_watchdog_declares_a_silent_peer_dead_and_exits():
    w, store, exits = _watchdog()
    store.set("zeropp/peers/999/who/1", "elsewhere|1|4242")  # another host: only heartbeats count
    deadline = time.time() + 10
    while not exits and time.time() < deadline:
        time.sleep(0.05)
    assert exits == [1]
    assert w.finding.startswith("rank 1 (pid 4242 on elsewhere) stopped responding: no heartbeat for")
    assert store.get("zeropp/peers/999/dead").decode() == w.finding
    assert store.get("zeropp/peers/999/end/0").decode().startswith("comm: rank 1")


def test_watchdog_leaves_a_peer_that_ended_alone():
    w, store, exits = _watchdog(timeout=0.3)
    store.set("zeropp/peers/999/end/1", "done")
    time.sleep(1.5)
    assert exits == [] and w.finding is None and w.running
    w.stop()
    assert not w.running and store.get("zeropp/peers/999/end/0") == b"done"


def test_watchdog_explains_a_comm_failure_by_the_rank_that_raised_first():
    w, store, exits = _watchdog(timeout=5)
    store.set("zeropp/peers/999/end/1", "error: ValueError: bad batch")
    line = w.explain(RuntimeError("[gloo/transport/tcp/pair.cc:537] Read error: Connection reset by peer"))
    assert "because rank 1 stopped with an error (ValueError: bad batch)" in line
    assert w.explain(ValueError("own error")) is None  # not a collective failure: nothing to explain
    w.stop()
    assert exits == []


def test_process_gone_sees_exited_and_zombie_processes():
    from zeropp_strategy.engine.watchdog import _identity, _process_gone, is_comm_failure

    assert not _process_gone(_identity())
    child = subprocess.Popen([sys.executable, "-c", "pass"])
    while True:  # exited, not reaped yet: a zombie
        time.sleep(0.05)
        with open(f"/proc/{child.pid}/stat") as f:
            if f.read().rsplit(")", 1)[1].split()[0] == "Z":
                break
    host, ns, _ = _identity().split("|")
    assert _process_gone(f"{host}|{ns}|{child.pid}")
    child.wait()
    assert _process_gone(f"{host}|{ns}|{child.pid}")
    assert not _process_gone(f"another-host|{ns}|{child.pid}")
    assert is_comm_failure(RuntimeError("Gloo connectFullMesh failed ... Connection refused"))
    assert not is_comm_failure(RuntimeError("zeropp: exporting x failed on rank 0"))

"""CommVolumeMonitor, MemoryMonitor and ThroughputMonitor report exactly what the ledger and
the tensors say, on 2 ranks (one node) and 4 ranks (two simulated nodes, ZeRO++ on)."""

from __future__ import annotations

import pytest

from tests._dist import run_ranks

pytestmark = pytest.mark.timeout(360)  # its longest run_ranks timeout + 60 s (pyproject's 300 s would cut it)


def _worker(rank: int, world: int, stage: int) -> dict:
    import torch
    from lightning.pytorch import Callback, Trainer, seed_everything
    from lightning.pytorch.loggers import CSVLogger

    from tests._models import ParityModule, trainer_kwargs
    from zeropp_strategy import ZeroPPStrategy
    from zeropp_strategy.callbacks import CommVolumeMonitor, MemoryMonitor, ThroughputMonitor

    class Check(Callback):
        """Independent readings, after the monitors (callbacks run in list order)."""

        def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
            self.before = trainer.strategy.comm_ledger.totals()

        def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
            after = trainer.strategy.comm_ledger.totals()
            self.step_bytes = after.total_bytes - self.before.total_bytes
            self.step_inter = after.inter_bytes - self.before.inter_bytes
            local = [p.to_local() if hasattr(p, "to_local") else p for p in pl_module.parameters()]
            # Storages, counted once each: FSDP2 pads each shard, and the padding is held too.
            self.param_bytes = sum({t.untyped_storage().data_ptr(): t.untyped_storage().nbytes() for t in local}.values())
            self.tokens = batch[0].shape[0] * batch[0].shape[1] if batch[0].dim() > 1 else batch[0].shape[0]

    fields = {"stage": stage}
    if world == 4:
        fields.update(simulated_nodes=2, quantized_weights=True, quantized_gradients=True, quantize_min_elems=0)
    seed_everything(0)
    comm, memory, throughput, check = CommVolumeMonitor(), MemoryMonitor(raise_stage_fraction=0.0), ThroughputMonitor(), Check()
    import tempfile

    logdir = tempfile.mkdtemp()
    trainer = Trainer(strategy=ZeroPPStrategy(**fields), callbacks=[comm, memory, throughput, check],
                      **trainer_kwargs(world, max_steps=3, logger=CSVLogger(logdir), log_every_n_steps=1))
    import warnings

    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        trainer.fit(ParityModule())
    hints = [str(w.message) for w in seen if "would free" in str(w.message)]
    logged = {k: float(v) for k, v in trainer.callback_metrics.items()}
    (planned,) = trainer.strategy.session.estimates().values()
    return {"planned": {"intra": planned.intra_bytes, "inter": planned.inter_bytes}, "explain": trainer.strategy.explain(),
            "comm": comm.last, "memory": memory.last, "throughput": throughput.last, "step_bytes": check.step_bytes,
            "step_inter": check.step_inter, "param_bytes": check.param_bytes, "tokens": check.tokens,
            "logged": logged, "hints": hints, "logdir": logdir, "torch_ok": torch.isfinite(torch.tensor(list(logged.values()))).all().item()}


@pytest.mark.parametrize("world,stage", [(2, 1), (2, 3), (4, 3)])
def test_monitors_report_the_ledger_and_the_tensors(world, stage):
    results = run_ranks(_worker, world, (stage,), timeout_s=300)
    for rank, r in enumerate(results):
        # MemoryMonitor's hint (raise_stage_fraction=0): once, on rank 0, below stage 3 only
        # (it used to suggest a "zeropp_stage_4" at stage 3).
        assert len(r["hints"]) == (1 if stage < 3 and rank == 0 else 0), r["hints"]
        assert r["comm"]["comm/total_bytes"] == r["step_bytes"] > 0
        assert r["comm"]["comm/inter_bytes"] == r["step_inter"]
        kinds = sum(v for k, v in r["comm"].items() if k.endswith("_bytes") and k.count("/") == 1
                    and k not in ("comm/total_bytes", "comm/intra_bytes", "comm/inter_bytes"))
        assert kinds == r["comm"]["comm/total_bytes"]
        assert r["memory"]["memory/param_bytes"] == r["param_bytes"]
        assert r["memory"]["memory/total_bytes"] == (r["memory"]["memory/param_bytes"] + r["memory"]["memory/grad_bytes"]
                                                     + r["memory"]["memory/optimizer_bytes"])
        assert r["throughput"]["throughput/tokens_per_sec"] * r["throughput"]["throughput/step_seconds"] == \
            pytest.approx(r["tokens"])
        assert r["logged"]["comm/total_bytes"] == r["comm"]["comm/total_bytes"]
        assert r["torch_ok"]
        # The run's own plan, priced when the model was set up ([Note: the estimate]), against
        # the ledger's last step, each hop. 10%: the model is 17,880 parameters in small
        # tensors, FSDP2 pads every tensor's rows to a multiple of the world size and qwZ/qgZ
        # pad every shard to whole blocks (7-8% here at 4 ranks; under 1% on GPT-2 small,
        # tests/test_estimate.py). The first version of the plan was 2x off inside the node.
        assert r["planned"]["intra"] == pytest.approx(r["step_bytes"] - r["step_inter"], rel=0.10), (r["planned"], r["step_bytes"])
        assert r["planned"]["inter"] == pytest.approx(r["step_inter"], rel=0.10, abs=8), (r["planned"], r["step_inter"])
        assert r["explain"].startswith("zeropp plan: stage ") and "per step per rank" in r["explain"]
    try:
        if world == 4:  # two simulated nodes with qwZ + qgZ: cross-node bytes shrink
            assert results[0]["comm"]["comm/inter_bytes"] > 0
            assert results[0]["comm"]["comm/inter_vs_unquantized"] < 0.5
            _check_report(results[0]["logdir"])
        else:
            assert results[0]["comm"]["comm/vs_unquantized"] == 1.0
    finally:
        import shutil

        for r in results:
            shutil.rmtree(r["logdir"], ignore_errors=True)


def _check_report(logdir):
    """``zeropp report`` on the 4-rank run's CSV: four labelled, non-empty PNGs."""
    from pathlib import Path

    from zeropp_strategy.cli import main
    from zeropp_strategy.report import make_report

    assert main(["report", logdir]) == 0
    result = make_report(logdir)
    plots = result["plots"]
    assert set(plots) == {"loss", "comm", "memory", "throughput"} and not result["missing"]
    assert {"param_allgather_fwd", "param_allgather_bwd", "grad_reduce"} <= set(plots["comm"]["series"])
    assert plots["memory"]["series"] == ["held", "ZeRO formula"] and plots["memory"]["ylabel"] == "MiB"
    assert plots["loss"]["series"] == ["train_loss"]
    for info in plots.values():
        png = Path(result["out"]) / info["file"]
        assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and png.stat().st_size > 10_000, png
    text = (Path(result["out"]) / "report.md").read_text()
    assert "## Communication" in text and "![memory](memory.png)" in text


def test_monitors_warn_and_stay_silent_under_another_strategy(tmp_path):
    from lightning.pytorch import Trainer

    from tests._models import ParityModule, trainer_kwargs
    from zeropp_strategy.callbacks import CommVolumeMonitor, ThroughputMonitor

    throughput = ThroughputMonitor()
    trainer = Trainer(callbacks=[CommVolumeMonitor(), throughput], **trainer_kwargs(1, max_steps=2))
    with pytest.warns(UserWarning, match="CommVolumeMonitor reports what strategy='zeropp' does"):
        trainer.fit(ParityModule())
    assert "comm/total_bytes" not in trainer.callback_metrics
    assert throughput.last["throughput/samples_per_sec"] > 0


def test_report_skips_what_was_not_logged_and_says_why(tmp_path):
    from lightning.pytorch import Trainer
    from lightning.pytorch.loggers import CSVLogger

    from tests._models import ParityModule, trainer_kwargs
    from zeropp_strategy.callbacks import ThroughputMonitor
    from zeropp_strategy.report import make_report

    trainer = Trainer(callbacks=[ThroughputMonitor()],
                      **trainer_kwargs(1, max_steps=4, logger=CSVLogger(tmp_path), log_every_n_steps=1))
    trainer.fit(ParityModule())
    result = make_report(tmp_path, tmp_path / "out")
    assert set(result["plots"]) == {"loss", "throughput"}
    assert any("CommVolumeMonitor" in m for m in result["missing"])
    assert any("MemoryMonitor" in m for m in result["missing"])
    with pytest.raises(FileNotFoundError, match="no metrics.csv.*Fix"):
        make_report(tmp_path / "out")

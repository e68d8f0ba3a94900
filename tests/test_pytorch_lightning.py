"""The strategy under the standalone ``pytorch_lightning`` package ([Note: two Lightning
packages] in zeropp_strategy/lightning/_pytorch_lightning.py): its own classes, importable and
picklable by name, and training, evaluating (uneven loaders at stage 3) and resuming as
the ``lightning.pytorch`` strategy does, which is the reference."""

from __future__ import annotations

import pickle
import subprocess
import sys

import pytest

from tests._dist import run_ranks

pl = pytest.importorskip("pytorch_lightning")


def test_the_standalone_package_gets_its_own_module_level_classes():
    import zeropp_strategy
    from zeropp_strategy._registry import pytorch_lightning_strategy
    from zeropp_strategy.lightning import _pytorch_lightning

    trainer = pl.Trainer(strategy="zeropp_stage_3", accelerator="cpu", devices=2, logger=False,
                         precision="bf16-mixed")
    strategy = trainer.strategy
    assert type(strategy) is pytorch_lightning_strategy() is _pytorch_lightning.ZeroPPStrategy
    assert not isinstance(strategy, zeropp_strategy.ZeroPPStrategy)  # lightning.pytorch's
    assert isinstance(strategy.precision_plugin, pl.plugins.precision.Precision)
    assert type(strategy.precision_plugin) is _pytorch_lightning.ZeroPPPrecision
    assert strategy.precision_plugin.precision == "bf16-mixed"
    assert type(strategy._launcher) is _pytorch_lightning.ResumingLauncher
    assert isinstance(strategy._launcher, pl.strategies.launchers.launcher._Launcher)
    for cls in (_pytorch_lightning.ZeroPPStrategy, _pytorch_lightning.ZeroPPPrecision,
                _pytorch_lightning.ResumingLauncher):
        assert cls.__module__ == "zeropp_strategy.lightning._pytorch_lightning"
        assert pickle.loads(pickle.dumps(cls)) is cls
    copy = pickle.loads(pickle.dumps(strategy))
    assert type(copy) is _pytorch_lightning.ZeroPPStrategy and copy.stage == 3
    # nothing executed under made-up module names (what the rewritten-source mirror did)
    assert not [name for name in sys.modules if name.startswith("zeropp_strategy._pl_")]


@pytest.mark.parametrize("first", ["pytorch_lightning", "zeropp_strategy"])
def test_both_packages_get_the_names_when_pytorch_lightning_comes_first(first, tmp_path):
    """``import pytorch_lightning`` before ``import zeropp_strategy``: registering with it
    imports ``lightning.pytorch`` (the mixins' module imports it), and that package gets
    the names too."""
    code = (
        f"import {first}\n"
        "import pytorch_lightning, zeropp_strategy\n"
        "from lightning.fabric.strategies import STRATEGY_REGISTRY\n"
        "from lightning.pytorch.strategies import StrategyRegistry\n"
        "from pytorch_lightning.strategies import StrategyRegistry as PLRegistry\n"
        "print('RESULT', [name in registry for name in ('zeropp', 'zeropp_stage_3')\n"
        "                 for registry in (StrategyRegistry, STRATEGY_REGISTRY, PLRegistry)])\n"
    )
    proc = subprocess.run([sys.executable, "-c", code], cwd=tmp_path, capture_output=True, text=True, timeout=180)
    assert proc.returncode == 0, proc.stderr[-4000:]
    assert f"RESULT {[True] * 6}" in proc.stdout, proc.stdout + proc.stderr[-2000:]


def test_resume_auto_reads_the_standalone_model_checkpoint(tmp_path):
    from zeropp_strategy._registry import pytorch_lightning_strategy

    strategy = pytorch_lightning_strategy()
    trainer = pl.Trainer(strategy=strategy(resume="auto"), accelerator="cpu", devices=1, logger=False)
    with pytest.raises(ValueError, match="resume='auto'.*ModelCheckpoint\\(dirpath="):
        trainer.strategy.resume_path(trainer)
    ckpt = tmp_path / "ckpt"
    trainer = pl.Trainer(strategy=strategy(resume="auto"), accelerator="cpu", devices=1, logger=False,
                         callbacks=[pl.callbacks.ModelCheckpoint(dirpath=ckpt)])
    assert trainer.strategy.resume_path(trainer) is None  # no checkpoint yet: start from scratch
    ckpt.mkdir()
    (ckpt / "last.ckpt").write_bytes(b"x")
    assert trainer.strategy.resume_path(trainer) == str(ckpt / "last.ckpt")


def _train_under_both_packages(rank: int, world: int) -> dict:
    import lightning.pytorch as L
    import pytorch_lightning as pl
    import torch
    from torch.utils.data import DataLoader, Subset

    from tests._models import Net, dataset, trainer_kwargs
    from zeropp_strategy.engine.state import full_model_state

    val_batches = [3, 1]  # per rank: uneven, so that rank 1 runs padding steps at stage 3

    class Tiny:
        """One LightningModule body, put on either package's LightningModule below."""

        seen = 0

        def configure_model(self):
            if getattr(self, "net", None) is None:
                torch.manual_seed(1234)
                self.net = Net()

        def training_step(self, batch, batch_idx):
            x, y = batch
            loss = torch.nn.functional.cross_entropy(self.net(x), y)
            self.log("train_loss", loss, sync_dist=True)
            return loss

        def validation_step(self, batch, batch_idx):
            type(self).seen += 1
            x, y = batch
            self.log("val_loss", torch.nn.functional.cross_entropy(self.net(x), y), sync_dist=True)

        def configure_optimizers(self):
            return torch.optim.AdamW(self.parameters(), lr=1e-2, weight_decay=0.1)

        def train_dataloader(self):  # each rank its own rows: the gradients differ by rank
            return DataLoader(Subset(dataset(n=32), range(rank * 16, rank * 16 + 16)), batch_size=4)

        def val_dataloader(self):
            start = sum(val_batches[:rank]) * 4
            rows = range(start, start + val_batches[rank] * 4)
            return DataLoader(Subset(dataset(n=16, seed=1), rows), batch_size=4)

    out = {}
    for package in (L, pl):
        module = type("Tiny", (Tiny, package.LightningModule), {"seen": 0})()
        trainer = package.Trainer(strategy="zeropp_stage_3", **trainer_kwargs(
            world, max_steps=3, limit_val_batches=None, use_distributed_sampler=False))
        trainer.fit(module)
        type(module).seen = 0
        metrics = trainer.validate(module, verbose=False)[0]
        out[package.__name__] = {
            "strategy": type(trainer.strategy).__module__,
            "state": full_model_state(module),
            "val_loss": metrics["val_loss"],
            "val_steps": type(module).seen,
        }
    return out


def test_pytorch_lightning_trains_and_evaluates_as_lightning_does():
    """Stage 3 (FSDP2; uneven validation, padded) under ``pytorch_lightning.Trainer`` gives
    bit for bit the parameters and the validation loss of ``lightning.pytorch.Trainer`` with
    the same strategy name. (Stage 1 is left out: of the package's own names it adds only
    the DDP forward redirection, and it would double this test's time.)"""
    results = run_ranks(_train_under_both_packages, 2, timeout_s=240)
    for rank, got in enumerate(results):
        ref, other = got["lightning.pytorch"], got["pytorch_lightning"]
        assert ref["strategy"] == "zeropp_strategy.lightning.strategy"
        assert other["strategy"] == "zeropp_strategy.lightning._pytorch_lightning"
        assert ref["state"].keys() == other["state"].keys() and ref["state"]
        for name, value in ref["state"].items():
            assert other["state"][name].equal(value), (rank, name)
        assert other["val_loss"] == ref["val_loss"], rank
        assert other["val_steps"] == ref["val_steps"] == 3, rank  # rank 1: 1 batch + 2 padding steps

"""The demo: byte data pipeline, the LightningModule in one process, the 2-process run."""

from __future__ import annotations

import math
import os
import re
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import lightning.pytorch as L
import pytest
import torch

from zeropp_strategy import demo

# -- data --------------------------------------------------------------------------------


def test_corpus_ships_with_the_package() -> None:
    text = demo.load_corpus()
    assert 20_000 <= len(text.encode("utf-8")) <= 40_000
    assert text.startswith("Tales of the Sallow Valley")


@pytest.mark.parametrize("text", ["", "plain ascii", "naïve café, 東京, emoji 🙂\n"])
def test_bytes_round_trip(text: str) -> None:
    ids = demo.encode(text)
    assert ids.dtype == torch.long and ids.shape == (len(text.encode("utf-8")),)
    assert all(0 <= i < 256 for i in ids.tolist())  # PAD_ID never comes out of encode
    assert demo.decode(ids) == text


def test_decode_drops_padding() -> None:
    ids = torch.cat([demo.encode("hi"), torch.full((3,), demo.PAD_ID)])
    assert demo.decode(ids) == "hi"


def test_windows_are_fixed_length_and_tile_the_ids() -> None:
    ids = torch.arange(200) % 256
    ds = demo.WindowDataset(ids, seq_len=64)
    assert len(ds) == 3  # 200 // 64; the ragged tail of 8 is dropped
    assert all(ds[i].shape == (64,) for i in range(len(ds)))
    assert torch.equal(torch.cat([ds[i] for i in range(len(ds))]), ids[:192])


def test_split_is_deterministic_contiguous_and_disjoint() -> None:
    ids = demo.encode(demo.load_corpus())
    train, val = demo.split_ids(ids)
    train2, val2 = demo.split_ids(demo.encode(demo.load_corpus()))
    assert torch.equal(train, train2) and torch.equal(val, val2)
    assert torch.equal(torch.cat([train, val]), ids)
    assert len(val) == int(len(ids) * demo.VAL_FRACTION)
    # enough windows for 2 ranks x batch 8 in training and 4 validation batches in all
    assert len(demo.WindowDataset(train)) >= 2 * 8 * 20
    assert len(demo.WindowDataset(val)) >= 4 * 8


# -- the LightningModule, one process ----------------------------------------------------


def test_configure_model_is_idempotent_and_starts_at_uniform_loss() -> None:
    torch.manual_seed(0)
    module = demo.TinyCausalLM()
    module.configure_model()
    first = module.model
    module.configure_model()
    assert module.model is first
    assert module.model.config.vocab_size == demo.VOCAB_SIZE
    assert not module.model.config.tie_word_embeddings

    # With small random init the logits are near zero: the loss is that of a uniform guess.
    batch = next(iter(module.train_dataloader()))  # (8, 64)
    assert batch.shape == (8, demo.SEQ_LEN)
    with torch.no_grad():
        loss = module._lm_loss(batch)
    assert abs(float(loss) - math.log(demo.VOCAB_SIZE)) < 0.1


def test_three_steps_in_one_process_give_a_finite_loss(tmp_path: Path) -> None:
    L.seed_everything(1234, verbose=False)
    trainer = L.Trainer(
        accelerator="cpu",
        devices=1,
        max_steps=3,
        limit_val_batches=1,
        logger=False,
        enable_checkpointing=False,
        enable_model_summary=False,
        enable_progress_bar=False,
        default_root_dir=tmp_path,
    )
    trainer.fit(demo.TinyCausalLM(batch_size=4))
    assert trainer.global_step == 3
    loss = float(trainer.callback_metrics["train_loss"])
    assert math.isfinite(loss) and loss < math.log(demo.VOCAB_SIZE) + 0.5


def _fake_trainer(strategy: object) -> SimpleNamespace:
    return SimpleNamespace(strategy=strategy, global_rank=1, callback_metrics={"train_loss": torch.tensor(2.5)})


def test_rank_report_includes_memory_and_ledger_when_the_strategy_has_them() -> None:
    strategy = SimpleNamespace(
        memory_stats=lambda: SimpleNamespace(format=lambda: "params 1.0\ngrads 2.0"),
        comm_ledger=SimpleNamespace(format_table=lambda: "kind | calls"),
    )
    report = demo._rank_report(_fake_trainer(strategy))
    assert report.splitlines() == [
        "[rank 1] final train_loss 2.5000",
        "[rank 1] params 1.0",
        "[rank 1] grads 2.0",
        "[rank 1] kind | calls",
    ]


def test_rank_report_skips_what_a_plain_strategy_lacks() -> None:
    assert demo._rank_report(_fake_trainer(SimpleNamespace())) == "[rank 1] final train_loss 2.5000"


# -- the main job: 2 processes under strategy="zeropp" -----------------------------------


def _strategy_missing() -> str | None:
    try:
        import zeropp_strategy.lightning.strategy  # noqa: F401
    except ImportError as exc:
        return f"zeropp_strategy.lightning.strategy is not importable yet ({exc})"
    return None


@pytest.mark.skipif(_strategy_missing() is not None, reason=str(_strategy_missing()))
def test_two_process_demo_under_zeropp(tmp_path: Path) -> None:
    env = {k: v for k, v in os.environ.items() if k != "ZEROPP_DEMO_OUTPUT_DIR"}
    command = [sys.executable, "-m", "zeropp_strategy.demo", "--max-steps", "6", "--strategy", "zeropp"]
    proc = subprocess.run(
        command + ["--output-dir", str(tmp_path)],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    out = proc.stdout
    assert proc.returncode == 0, f"demo failed:\n{out[-4000:]}\n{proc.stderr[-4000:]}"
    final = dict(re.findall(r"^\[rank (\d)\] final train_loss (\S+)$", out, re.M))
    assert sorted(final) == ["0", "1"], out
    # Data parallel: each rank trains on its own shard of the batches (Lightning's
    # DistributedSampler), so the last local losses differ. Equal values mean both
    # ranks saw the same data.
    assert final["0"] != final["1"], f"both ranks report train_loss {final['0']}: is the data sharded?"
    assert "ledger" in out.lower(), out
    assert "loss went from" in out, out
    assert (tmp_path / "lightning_logs" / "version_0" / "metrics.csv").exists()

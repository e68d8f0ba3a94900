"""Layer: commands. The main job: train a tiny Llama on the bundled corpus with ``strategy="zeropp"``.

    zeropp demo                                   # or: python -m zeropp_strategy.demo
    zeropp demo --strategy ddp                    # the same run under plain DDP, to compare
    zeropp demo --max-steps 200 --precision bf16-mixed

Two CPU processes (gloo) train a ~132k-parameter ``LlamaForCausalLM`` for 60 steps on
byte-level windows of ``zeropp_strategy/data/tiny_corpus.txt``. Every rank then prints
its final loss, the bytes it holds in params / grads / optimizer state, and the
communication ledger (bytes sent per collective); rank 0 also says how the loss moved.

Lightning starts the second process by re-running this command (``sys.argv``), so
everything below runs once per rank; only the output folder is decided once, by the
first process, and handed to the others in an environment variable.
"""

from __future__ import annotations

import csv
import os
import sys
import tempfile
import warnings
from importlib import resources
from pathlib import Path

import lightning.pytorch as L
import torch
from lightning.fabric.utilities.exceptions import MisconfigurationException
from lightning.pytorch.loggers import CSVLogger
from torch.utils.data import DataLoader, Dataset

import zeropp_strategy  # noqa: F401  (registers "zeropp", "zeropp_stage_{1,2,3}" with Lightning)
from zeropp_strategy.errors import UsageError, run
from zeropp_strategy.parsers import demo_parser as build_parser

# -----------------------------------------------------------------------------
# data: bytes in, bytes out. No tokenizer files, nothing to download.

PAD_ID = 256  # one id past the 256 byte values; windows are full-length, so unused in training
VOCAB_SIZE = 257
SEQ_LEN = 64
VAL_FRACTION = 0.1


def load_corpus() -> str:
    return resources.files("zeropp_strategy.data").joinpath("tiny_corpus.txt").read_text("utf-8")


def encode(text: str) -> torch.Tensor:
    return torch.tensor(list(text.encode("utf-8")), dtype=torch.long)  # (n_bytes,)


def decode(ids: torch.Tensor | list[int]) -> str:
    ids = ids.tolist() if isinstance(ids, torch.Tensor) else ids
    return bytes(i for i in ids if i != PAD_ID).decode("utf-8", errors="replace")


def split_ids(ids: torch.Tensor, val_fraction: float = VAL_FRACTION) -> tuple[torch.Tensor, torch.Tensor]:
    # A contiguous tail, not random windows: overlapping train/val text would flatter val_loss.
    n_val = int(len(ids) * val_fraction)
    return ids[: len(ids) - n_val], ids[len(ids) - n_val :]


class WindowDataset(Dataset):
    """Non-overlapping windows of ``seq_len`` ids; the ragged tail is dropped."""

    def __init__(self, ids: torch.Tensor, seq_len: int = SEQ_LEN) -> None:
        self.ids = ids  # (n,)
        self.seq_len = seq_len

    def __len__(self) -> int:
        return len(self.ids) // self.seq_len

    def __getitem__(self, i: int) -> torch.Tensor:
        start = i * self.seq_len
        return self.ids[start : start + self.seq_len]  # (seq_len,)


# -----------------------------------------------------------------------------
# model


class TinyCausalLM(L.LightningModule):
    def __init__(self, batch_size: int = 8, lr: float = 3e-3) -> None:
        super().__init__()
        self.save_hyperparameters()
        self.model = None  # built in configure_model, so a strategy can build it on "meta"

    def configure_model(self) -> None:
        if self.model is not None:  # Lightning may call this more than once
            return
        from transformers import LlamaConfig, LlamaForCausalLM

        config = LlamaConfig(
            vocab_size=VOCAB_SIZE,
            hidden_size=64,
            intermediate_size=172,
            num_hidden_layers=2,
            num_attention_heads=4,
            max_position_embeddings=SEQ_LEN,
            pad_token_id=PAD_ID,
            bos_token_id=None,
            eos_token_id=None,
            tie_word_embeddings=False,  # tied weights would span two sharded blocks
        )
        self.model = LlamaForCausalLM(config)

    def _lm_loss(self, batch: torch.Tensor) -> torch.Tensor:
        # batch: (B, SEQ_LEN) byte ids; the model shifts labels by one internally
        return self.model(input_ids=batch, labels=batch).loss  # scalar, mean over B*(SEQ_LEN-1)

    def training_step(self, batch: torch.Tensor, batch_idx: int) -> torch.Tensor:
        loss = self._lm_loss(batch)
        self.log("train_loss", loss, prog_bar=True)
        return loss

    def validation_step(self, batch: torch.Tensor, batch_idx: int) -> None:
        self.log("val_loss", self._lm_loss(batch), sync_dist=True, prog_bar=True)

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.AdamW(self.model.parameters(), lr=self.hparams.lr)

    def train_dataloader(self) -> DataLoader:
        train_ids, _ = split_ids(encode(load_corpus()))
        return DataLoader(WindowDataset(train_ids), batch_size=self.hparams.batch_size, shuffle=True, drop_last=True)

    def val_dataloader(self) -> DataLoader:
        _, val_ids = split_ids(encode(load_corpus()))
        return DataLoader(WindowDataset(val_ids), batch_size=self.hparams.batch_size)


# -----------------------------------------------------------------------------
# run

_OUTPUT_DIR_ENV = "ZEROPP_DEMO_OUTPUT_DIR"


def _output_dir(requested: str | None) -> str:
    # The re-launched ranks must log beside rank 0, not into temp dirs of their own.
    if requested is None:
        requested = os.environ.get(_OUTPUT_DIR_ENV) or tempfile.mkdtemp(prefix="zeropp-demo-")
    os.environ[_OUTPUT_DIR_ENV] = requested
    return requested


def _logged_train_losses(log_dir: str) -> list[float]:
    path = Path(log_dir) / "metrics.csv"
    if not path.exists():
        return []
    with path.open(newline="") as f:
        return [float(row["train_loss"]) for row in csv.DictReader(f) if row.get("train_loss")]


def _rank_report(trainer: L.Trainer) -> str:
    strategy = trainer.strategy
    final = trainer.callback_metrics.get("train_loss")
    lines = [f"final train_loss {float(final):.4f}" if final is not None else "final train_loss n/a"]
    memory_stats = getattr(strategy, "memory_stats", None)
    if callable(memory_stats):
        lines.append(memory_stats().format())  # bytes held in params / grads / optimizer state
    ledger = getattr(strategy, "comm_ledger", None)
    if ledger is not None:
        lines.append(ledger.format_table())  # bytes sent per collective, intra / inter node
    return "\n".join(f"[rank {trainer.global_rank}] {line}" for text in lines for line in text.splitlines())


def _monitors(strategy: str) -> list:
    """Per-step bytes, memory and throughput in metrics.csv (for `zeropp report`); the first
    two need the zeropp strategy."""
    from zeropp_strategy.callbacks import CommVolumeMonitor, MemoryMonitor, ThroughputMonitor

    monitors: list = [ThroughputMonitor()]
    if strategy.startswith("zeropp"):
        monitors += [CommVolumeMonitor(), MemoryMonitor(raise_stage_fraction=1.0)]
    return monitors


def main(argv: list[str] | None = None, prog: str | None = None) -> int:
    parser = build_parser(prog)
    args = parser.parse_args(argv)
    output_dir = _output_dir(args.output_dir)
    warnings.filterwarnings("ignore", ".*does not have many workers.*")
    L.seed_everything(args.seed, workers=True, verbose=False)

    try:  # Lightning checks --strategy, --precision and --devices here
        trainer = L.Trainer(
            accelerator="cpu",
            devices=args.devices,
            strategy=args.strategy,
            precision=args.precision,
            max_steps=args.max_steps,
            # validate three times, counted in steps across epochs (an epoch is ~25 steps)
            val_check_interval=max(1, args.max_steps // 3),
            check_val_every_n_epoch=None,
            limit_val_batches=4,
            logger=CSVLogger(output_dir),
            callbacks=_monitors(args.strategy),
            enable_checkpointing=False,
            enable_model_summary=False,
            # every 5 steps, but at least twice in a short run so "from -> to" means something
            log_every_n_steps=max(1, min(5, args.max_steps // 4)),
        )
    except (ValueError, MisconfigurationException) as err:
        raise UsageError(f"{parser.prog}: {err}", f"see `{parser.prog} --help`") from None
    trainer.fit(TinyCausalLM(batch_size=args.batch_size))

    # One print per rank, in rank order: a block built whole cannot interleave.
    for rank in range(trainer.world_size):
        if rank == trainer.global_rank:
            print(_rank_report(trainer), flush=True)
        trainer.strategy.barrier("demo-report")

    if trainer.global_rank == 0:
        losses = _logged_train_losses(trainer.logger.log_dir)
        lines = [f"[rank 0] strategy {args.strategy}, {trainer.world_size} ranks, logs in {trainer.logger.log_dir}"]
        if losses:
            lines += [
                f"[rank 0] first logged train_loss {losses[0]:.4f}, last {losses[-1]:.4f}",
                f"[rank 0] loss went from {losses[0]:.4f} to {losses[-1]:.4f}"
                + (" (it learned)" if losses[-1] < losses[0] else " (it did NOT go down)"),
            ]
        else:
            lines.append("[rank 0] no train_loss was logged")
        lines.append(f"[rank 0] plots of this run: zeropp report {trainer.logger.log_dir}")
        print("\n".join(lines), flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(run(main, sys.argv[1:]))  # a UsageError as one line and status 2, as under `zeropp demo`

"""Per-rank bytes in params / grads / optimizer state for DDP and ZeRO stages 1-3.

    torchrun --nproc-per-node 2 benchmarks/memory_per_stage.py
    torchrun --nproc-per-node 4 benchmarks/memory_per_stage.py --out benchmarks/results/memory_n4.json

Trains a GPT-2-shaped transformers model (4 layers, width 256, vocab 512, seq 128:
about 3.3M parameters) for 3 steps of AdamW in fp32 under each strategy, then reads
``strategy.memory_stats()`` on every rank (storage bytes actually held, at rest between
steps) beside the stage's formula (engine/memory.py). Rank 0 prints a markdown table of
the worst rank (the one holding the most) and writes JSON with every rank.
"""

from __future__ import annotations

import argparse
import json
import os
from pathlib import Path

import torch
from lightning.pytorch import LightningModule, Trainer, seed_everything
from torch.utils.data import DataLoader, TensorDataset

import zeropp_strategy
from zeropp_strategy.engine.memory import memory_stats


class GPT(LightningModule):
    def __init__(self, layers: int, width: int) -> None:
        super().__init__()
        self.layers, self.width = layers, width
        self.model = None

    def configure_model(self) -> None:
        if self.model is not None:
            return
        from transformers import GPT2Config, GPT2LMHeadModel

        torch.manual_seed(0)
        cfg = GPT2Config(n_layer=self.layers, n_embd=self.width, n_head=4, vocab_size=512, n_positions=128,
                         bos_token_id=0, eos_token_id=0)  # token ids inside the small vocabulary
        self.model = GPT2LMHeadModel(cfg)
        self.model.loss_type = "ForCausalLM"  # the loss it defaults to, named: no warning (bench_train.gpt2)

    def training_step(self, batch, batch_idx):
        (ids,) = batch  # (B, T)
        return self.model(input_ids=ids, labels=ids).loss

    def configure_optimizers(self):
        return torch.optim.AdamW(self.parameters(), lr=1e-4)

    def train_dataloader(self):
        g = torch.Generator().manual_seed(0)
        return DataLoader(TensorDataset(torch.randint(0, 512, (64, 128), generator=g)), batch_size=2)


def run(strategy: str, devices: int, layers: int, width: int) -> dict:
    seed_everything(0)
    module = GPT(layers, width)
    trainer = Trainer(
        strategy=strategy, accelerator="cpu", devices=devices, max_steps=3, logger=False,
        enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
    )
    trainer.fit(module)
    if strategy == "ddp":
        stats = memory_stats(module, trainer.optimizers, stage=0, rank=trainer.global_rank, world_size=devices)
    else:
        stats = trainer.strategy.memory_stats()
    all_ranks = trainer.strategy.all_gather(torch.tensor([stats.param_bytes, stats.grad_bytes, stats.optimizer_bytes]))
    return {"rank0": stats.as_dict(), "per_rank": all_ranks.tolist()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--width", type=int, default=256)
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args()
    devices = int(os.environ.get("WORLD_SIZE", "1"))
    results = {}
    for strategy in ("ddp", "zeropp_stage_1", "zeropp_stage_2", "zeropp_stage_3"):
        results[strategy] = run(strategy, devices, args.layers, args.width)
    if int(os.environ.get("RANK", "0")) != 0:
        return
    mb = 2**20
    print(f"\nN={devices}, P={results['ddp']['rank0']['num_params']:,} params, fp32 + AdamW; MiB on the fullest rank")
    print("| strategy | params | grads | optimizer | total | formula total |")
    print("|---|---:|---:|---:|---:|---:|")
    for name, r in results.items():
        worst = max(r["per_rank"], key=sum)
        pred = r["rank0"]["predicted_total_bytes"]
        cells = [f"{b / mb:.2f}" for b in (*worst, sum(worst))]
        print(f"| {name} | {' | '.join(cells)} | {pred / mb:.2f} |")
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps({"world_size": devices, "results": results}, indent=1))
    assert zeropp_strategy  # registered the names


if __name__ == "__main__":
    main()

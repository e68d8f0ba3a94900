"""ZeRO++ vs plain ZeRO-3: loss curves and cross-node bytes per step, same seed and data.

    torchrun --nproc-per-node 4 benchmarks/zeropp_convergence.py --steps 200 \
        --out benchmarks/results/zeropp_convergence.json --plot docs/img/zeropp_loss.png

4 ranks split into 2 simulated nodes x 2 (ZeroConfig.simulated_nodes), so qwZ, hpZ and
qgZ take their cross-node paths and the CommLedger splits intra/inter-node bytes. A
GPT-2-shaped transformers model (4 layers, width 256, vocab 512, seq 128), trained from
scratch on the text shipped with the package (byte-level, folded into the vocab) with
AdamW in fp32. Each variant: stage 3 plain, qwZ, hpZ, qgZ alone, all three ("zeropp").
"""

from __future__ import annotations

import argparse
import json
import os
from pathlib import Path

import torch
from lightning.pytorch import Callback, LightningModule, Trainer, seed_everything
from torch.utils.data import DataLoader, TensorDataset

from zeropp_strategy import ZeroPPStrategy
from zeropp_strategy.comm.ledger import CommKind

VARIANTS = {
    "stage3": {},
    "qwZ": {"quantized_weights": True},
    "hpZ": {"hpz_partition_size": 0},
    "qgZ": {"quantized_gradients": True},
    "zeropp": {"quantized_weights": True, "hpz_partition_size": 0, "quantized_gradients": True},
}


def corpus_batches(seq: int, vocab: int) -> TensorDataset:
    text = (Path(__file__).resolve().parents[1] / "zeropp_strategy" / "data" / "tiny_corpus.txt").read_bytes()
    ids = torch.tensor(list(text), dtype=torch.long) % vocab
    n = (ids.numel() - 1) // seq
    return TensorDataset(ids[: n * seq].view(n, seq))


class GPT(LightningModule):
    def __init__(self) -> None:
        super().__init__()
        self.model = None

    def configure_model(self) -> None:
        if self.model is None:
            from transformers import GPT2Config, GPT2LMHeadModel

            torch.manual_seed(0)
            self.model = GPT2LMHeadModel(GPT2Config(n_layer=4, n_embd=256, n_head=4, vocab_size=512, n_positions=128))

    def training_step(self, batch, batch_idx):
        (ids,) = batch  # (B, 128)
        loss = self.model(input_ids=ids, labels=ids).loss
        self.log("train_loss", loss, sync_dist=True)
        return loss

    def configure_optimizers(self):
        return torch.optim.AdamW(self.parameters(), lr=1e-3)

    def train_dataloader(self):
        return DataLoader(corpus_batches(128, 512), batch_size=4, shuffle=True, generator=torch.Generator().manual_seed(0))


class Record(Callback):
    def __init__(self) -> None:
        self.losses: list[float] = []
        self.inter: list[int] = []
        self.by_kind: dict[str, int] = {}

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        self.losses.append(trainer.callback_metrics["train_loss"].item())
        ledger = trainer.strategy.comm_ledger
        self.inter.append(ledger.totals().inter_bytes)
        self.by_kind = {k.value: ledger.totals(k).inter_bytes for k in CommKind}  # last step, before reset
        ledger.reset()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--out", type=Path, default=None)
    parser.add_argument("--plot", type=Path, default=None)
    args = parser.parse_args()
    world = int(os.environ.get("WORLD_SIZE", "4"))
    results = {}
    for name, fields in VARIANTS.items():
        seed_everything(0)
        rec = Record()
        strategy = ZeroPPStrategy(stage=3, simulated_nodes=2, **fields)
        trainer = Trainer(
            strategy=strategy, accelerator="cpu", devices=world, max_steps=args.steps, callbacks=[rec],
            logger=False, enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
        )
        trainer.fit(GPT())
        results[name] = {"loss": rec.losses, "inter_bytes_per_step": rec.inter[1:], "last_step_by_kind": rec.by_kind}
    if int(os.environ.get("RANK", "0")):
        return
    base = results["stage3"]
    print(f"\n{args.steps} steps, {world} ranks as 2 simulated nodes; final loss = mean of the last 10 steps")
    print("| variant | final loss | vs stage 3 | cross-node MB/step | vs stage 3 |")
    print("|---|---:|---:|---:|---:|")
    for name, r in results.items():
        loss = sum(r["loss"][-10:]) / 10
        bloss = sum(base["loss"][-10:]) / 10
        mb = sum(r["inter_bytes_per_step"]) / len(r["inter_bytes_per_step"]) / 1e6
        bmb = sum(base["inter_bytes_per_step"]) / len(base["inter_bytes_per_step"]) / 1e6
        print(f"| {name} | {loss:.4f} | {loss / bloss - 1:+.2%} | {mb:.3f} | {mb / bmb:.3f}x |")
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(results))
    if args.plot:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt

        fig, ax = plt.subplots(figsize=(7, 4))
        for name, r in results.items():
            ax.plot(r["loss"], label=name, linewidth=1)
        ax.set_xlabel("step")
        ax.set_ylabel("training loss")
        ax.set_title(f"ZeRO-3 vs ZeRO++ (GPT-2 4x256, {world} ranks as 2 nodes, fp32)")
        ax.legend()
        args.plot.parent.mkdir(parents=True, exist_ok=True)
        fig.tight_layout()
        fig.savefig(args.plot, dpi=120)


if __name__ == "__main__":
    main()

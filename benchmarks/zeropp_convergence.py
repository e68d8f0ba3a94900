"""ZeRO++ vs plain ZeRO-3: loss curves and cross-node bytes per step, same seed and data.

    torchrun --nproc-per-node 4 benchmarks/zeropp_convergence.py --steps 200 --seeds 0 1 2 \
        --out benchmarks/results/zeropp_convergence.json --plot docs/img/zeropp_loss.png

4 ranks split into 2 simulated nodes x 2 (ZeroConfig.simulated_nodes), so qwZ, hpZ and
qgZ take their cross-node paths and the CommLedger splits intra/inter-node bytes. A
GPT-2-shaped transformers model (4 layers, width 256, vocab 512, seq 128), trained from
scratch on the text shipped with the package (byte-level, folded into the vocab) with
AdamW in fp32, the usual GPT recipe: linear warm-up over the first 10% of steps, cosine
decay to a tenth, gradient clipping at 1.0. Each variant: stage 3 plain, qwZ, hpZ, qgZ
alone, all three ("zeropp"); each over the given seeds (model init and data order).

Why warm-up and clipping: without them (lr 1e-3 from step 0) every variant spikes in its
first 20 steps and then sits on a unigram plateau for a random number of steps, so the
200-step loss measures when a run escaped the plateau, not the collectives. The first
version of this script did that and reported ZeRO++ at +6.3% with qgZ alone at -11%.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
from pathlib import Path

import torch
from lightning.pytorch import Callback, LightningModule, Trainer, seed_everything
from torch.utils.data import DataLoader

from zeropp_strategy import ZeroPPStrategy
from zeropp_strategy.presets import PRESETS
from zeropp_strategy.primitives import local

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run as a script: make `benchmarks` importable
from benchmarks.bench_train import corpus  # noqa: E402  (the shipped text, folded into the vocab)
from zeropp_strategy.comm.ledger import CommKind

def _preset(name: str, **fields) -> dict:
    """A preset's fields but the stage (every variant runs at stage 3), with ``fields`` over them."""
    return {**{k: v for k, v in PRESETS[name].items() if k != "stage"}, **fields}


VARIANTS = {
    "stage3": {},
    "qwZ": {"quantized_weights": True},
    "hpZ": {"hpz_partition_size": 0},
    "qgZ": {"quantized_gradients": True},
    "zeropp": _preset("zeropp"),
    # Gradients reduced in bf16 (ZeroConfig.reduce_dtype), DeepSpeed's default under bf16.
    "reduce_bf16": {"reduce_dtype": "bf16"},
    # Ablations of the quantization settings (not in the default run).
    "qgZ_int8": {"quantized_gradients": True, "gradient_quant_bits": 8},
    "qgZ_b64": {"quantized_gradients": True, "gradient_quant_block_elems": 64},
    "qgZ_b32": {"quantized_gradients": True, "gradient_quant_block_elems": 32},
    "qgZ_b256": {"quantized_gradients": True, "gradient_quant_block_elems": 256},
    "qgZ_int8_b256": {"quantized_gradients": True, "gradient_quant_bits": 8, "gradient_quant_block_elems": 256},
    "zeropp_g256": _preset("zeropp", gradient_quant_block_elems=256),
    "zeropp_g64": _preset("zeropp", gradient_quant_block_elems=64),
    "zeropp_g32": _preset("zeropp", gradient_quant_block_elems=32),
    "qwZ_b64": {"quantized_weights": True, "weight_quant_block_elems": 64},
    # Error feedback on qgZ's cross-node hop (ZeroConfig.gradient_error_feedback, LoCo), with
    # int8 inside the node (gradient_quant_bits_intra=8); "_ef0": beta 0 (classic feedback).
    "qgZ_b256_ef": {"quantized_gradients": True, "gradient_quant_block_elems": 256, "gradient_error_feedback": True},
    "qgZ_b256_ef0": {"quantized_gradients": True, "gradient_quant_block_elems": 256, "gradient_error_feedback": True,
                     "gradient_error_beta": 0.0},
    "qgZ_b256_i8": {"quantized_gradients": True, "gradient_quant_block_elems": 256, "gradient_quant_bits_intra": 8},
    "zeropp_ef": _preset("zeropp", gradient_quant_bits_intra=8, gradient_error_feedback=True),
    "zeropp_i8": _preset("zeropp", gradient_quant_bits_intra=8),
    "zeropp_ef_only": _preset("zeropp", gradient_error_feedback=True),
    "zeropp_ef0": _preset("zeropp", gradient_quant_bits_intra=8, gradient_error_feedback=True, gradient_error_beta=0.0),
    "zeropp_ef_g256": _preset("zeropp", gradient_quant_bits_intra=8, gradient_error_feedback=True,
                              gradient_quant_block_elems=256),
    # Beyond ZeRO++: int4 weight gathers in blocks of 64 (the zeropp_4bit preset); in blocks of 32
    # (finer scales: 0.625 bytes per element instead of 0.5625)
    "zeropp_4bit": _preset("zeropp_4bit"),
    "zeropp_4bit_b32": _preset("zeropp_4bit", weight_quant_block_elems=32),
    # Weight deltas (ZeroConfig.weight_delta_coding): codes of each shard's change since the
    # last gather, the sender's rounding fed back: the zeropp_delta preset (2-bit codes in
    # blocks of 256), and int4 codes in blocks of 64
    "zeropp_delta": _preset("zeropp_delta"),
    # ... as the preset was until 2026-11-28, with fp32 block scales across nodes
    "zeropp_delta_fp32_scales": _preset("zeropp_delta", cross_node_scale_bits=32),
    "zeropp_delta_int4": _preset("zeropp_4bit", weight_delta_coding=True),
    # ... the preset with int4 changes instead of 2-bit ones, all else equal (blocks of 256,
    # bf16 scales): the bit width alone
    "zeropp_delta_int4_b256": _preset("zeropp_delta", weight_quant_bits=4),
    # ... and int8 ones (each change rounded to within 1/254 of its block's largest)
    "zeropp_delta_int8_b256": _preset("zeropp_delta", weight_quant_bits=8),
    # ... int4 changes with qgZ's error feedback (LoCo, beta 0.8): does the feedback alone
    # remove qgZ's loss cost, as the 2-bit changes do on this benchmark?
    "zeropp_delta_int4_b256_ef": _preset("zeropp_delta", weight_quant_bits=4, gradient_error_feedback=True),
    # ... and the preset itself with qgZ's error feedback (no byte more)
    "zeropp_delta_ef": _preset("zeropp_delta", gradient_error_feedback=True),
    # ... and with qgZ's first hop, inside the node, in int8 (cross-node bytes unchanged); qgZ
    # alone the same way
    "zeropp_delta_i8": _preset("zeropp_delta", gradient_quant_bits_intra=8),
    "qgZ_i8": {"quantized_gradients": True, "gradient_quant_bits_intra": 8},
    # which of qgZ's two hops carries its loss cost: int8 across nodes only (int4 inside), int8
    # on both hops (qgZ_int8 above), and int8 inside with the cross-node hop's rounding fed back
    "qgZ_g8": {"quantized_gradients": True, "gradient_quant_bits": 8, "gradient_quant_bits_intra": 4},
    "qgZ_i8_ef": {"quantized_gradients": True, "gradient_quant_bits_intra": 8, "gradient_error_feedback": True},
    # int8 gradients on both of qgZ's hops (gradient_quant_bits=8) on the two presets
    "zeropp_grad_int8": _preset("zeropp", gradient_quant_bits=8),
    "zeropp_delta_grad_int8": _preset("zeropp_delta", gradient_quant_bits=8),
    # ... the preset's 2-bit changes in blocks of 64 (0.514x zeropp's bytes with bf16 scales)
    "zeropp_delta_b64": _preset("zeropp_delta", weight_quant_block_elems=64),
    # the weight path alone (no qgZ): how much of a delta level's loss is its weights'
    "qwZ_delta": {k: v for k, v in PRESETS["zeropp_delta"].items() if k not in ("stage", "quantized_gradients")},
    # 2-bit gradient codes across nodes (int8 inside), their rounding fed back: classic feedback
    # (beta 0) and LoCo's average (beta 0.8); with weight deltas, and qgZ alone
    "zeropp_delta_g2": _preset("zeropp_delta", gradient_quant_bits=2, gradient_quant_bits_intra=8,
                               gradient_error_feedback=True, gradient_error_beta=0.0),
    "zeropp_delta_g2_loco": _preset("zeropp_delta", gradient_quant_bits=2, gradient_quant_bits_intra=8,
                                    gradient_error_feedback=True),
    "qgZ_g2": {"quantized_gradients": True, "gradient_quant_bits": 2, "gradient_quant_bits_intra": 8,
               "gradient_error_feedback": True, "gradient_error_beta": 0.0},
    # LoCo as DeepSpeed runs it (zeropp_loco_param): both hops' rounding fed back, int4 on both
    # (the intra-node error kept as int8 blocks); qgZ alone, and on the two presets
    "qgZ_ef_both": {"quantized_gradients": True, "gradient_error_feedback": True, "gradient_error_feedback_intra": True},
    "zeropp_ef_both": _preset("zeropp", gradient_error_feedback=True, gradient_error_feedback_intra=True),
    "zeropp_delta_ef_both": _preset("zeropp_delta", gradient_error_feedback=True, gradient_error_feedback_intra=True),
}
DEFAULT_VARIANTS = ["stage3", "qwZ", "hpZ", "qgZ", "zeropp"]


class GPT(LightningModule):
    def __init__(self, seed: int, steps: int) -> None:
        super().__init__()
        self.seed, self.steps = seed, steps
        self.model = None

    def configure_model(self) -> None:
        if self.model is None:
            from transformers import GPT2Config, GPT2LMHeadModel

            torch.manual_seed(self.seed)
            self.model = GPT2LMHeadModel(GPT2Config(n_layer=4, n_embd=256, n_head=4, vocab_size=512, n_positions=128,
                                                      bos_token_id=0, eos_token_id=0))
            self.model.loss_type = "ForCausalLM"  # the loss it defaults to, named: no warning (bench_train.gpt2)

    def training_step(self, batch, batch_idx):
        (ids,) = batch  # (B, 128)
        loss = self.model(input_ids=ids, labels=ids).loss
        self.log("train_loss", loss, sync_dist=True)
        return loss

    def configure_optimizers(self):
        opt = torch.optim.AdamW(self.parameters(), lr=1e-3, weight_decay=0.01)
        warm = max(1, self.steps // 10)

        def factor(step: int) -> float:  # linear warm-up, then cosine from 1 to 0.1
            if step < warm:
                return (step + 1) / warm
            t = min(1.0, (step - warm) / max(1, self.steps - warm))
            return 0.1 + 0.45 * (1 + math.cos(math.pi * t))

        sched = torch.optim.lr_scheduler.LambdaLR(opt, factor)
        return {"optimizer": opt, "lr_scheduler": {"scheduler": sched, "interval": "step"}}

    def train_dataloader(self):
        gen = torch.Generator().manual_seed(self.seed)
        return DataLoader(corpus(128, 512), batch_size=4, shuffle=True, generator=gen)


class Record(Callback):
    def __init__(self) -> None:
        self.losses: list[float] = []
        self.inter: list[int] = []
        self.by_kind: dict[str, int] = {}

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        self.losses.append(trainer.callback_metrics["train_loss"].item())
        ledger = trainer.strategy.comm_ledger
        self.inter.append(ledger.totals().inter_bytes)
        if batch_idx == 1:  # a steady-state step (step 0 also books the setup broadcasts)
            self.by_kind = {k.value: ledger.totals(k).inter_bytes for k in CommKind}
        ledger.reset()


QUANTILES = (0.01, 0.05, 0.1, 0.25, 0.5, 0.75, 0.9, 0.99)
SNAPSHOT_FRACTIONS = (0.125, 0.25, 0.5, 1.0)  # of the run's steps: when Probe takes its quantiles


class Probe(Callback):
    """``--probe``: before each optimizer step (and before clipping), the global L2 norm of the
    reduced gradients and the mean of AdamW's ``exp_avg_sq`` over every element, summed over
    the ranks' shards (one plain ``dist`` all-reduce, which the ledger does not book: the
    bytes per step are unchanged). Before the steps at ``SNAPSHOT_FRACTIONS`` of the run
    (keyed by the updates done so far: 24, 49, 99, 199 of 200), also the ``QUANTILES`` over
    every element of the model of ``exp_avg_sq`` and of AdamW's update before the learning
    rate and without its bias correction, ``|exp_avg| / (sqrt(exp_avg_sq) + eps)``, and the
    fraction of elements whose ``exp_avg_sq`` is exactly zero (never a nonzero gradient): the mean is
    dominated by the largest elements and cannot show what happens to the small ones
    (the shards gathered with ``all_gather_object``, also outside the ledger)."""

    def __init__(self, steps: int) -> None:
        self.grad_norm: list[float] = []
        self.exp_avg_sq_mean: list[float] = []
        self.snapshot_steps = sorted({max(1, round(f * steps) - 1) for f in SNAPSHOT_FRACTIONS})  # 0: no state yet
        self.quantiles: dict[str, dict[str, list[float] | float]] = {}

    def on_before_optimizer_step(self, trainer, pl_module, optimizer):
        sq = sum((local(p.grad).float().pow(2).sum() for p in pl_module.parameters() if p.grad is not None),
                 torch.zeros(()))
        v = torch.zeros(2)
        for state in optimizer.state.values():
            if "exp_avg_sq" in state:
                x = local(state["exp_avg_sq"])
                v += torch.stack([x.float().sum(), torch.tensor(float(x.numel()))])
        both = torch.cat([sq.reshape(1), v])
        torch.distributed.all_reduce(both)
        self.grad_norm.append(both[0].sqrt().item())
        self.exp_avg_sq_mean.append((both[1] / both[2]).item() if both[2] else 0.0)
        if trainer.global_step in self.snapshot_steps:
            self._snapshot(trainer.global_step, optimizer)

    def _snapshot(self, step: int, optimizer) -> None:
        eps = optimizer.param_groups[0]["eps"]
        vs, us = [], []
        for state in optimizer.state.values():
            if "exp_avg_sq" in state:
                v, m = local(state["exp_avg_sq"]).float().reshape(-1), local(state["exp_avg"]).float().reshape(-1)
                vs.append(v)
                us.append(m.abs() / (v.sqrt() + eps))
        parts: list = [None] * torch.distributed.get_world_size()
        torch.distributed.all_gather_object(parts, (torch.cat(vs), torch.cat(us)))
        v, u = torch.cat([p[0] for p in parts]), torch.cat([p[1] for p in parts])
        q = torch.tensor(QUANTILES, dtype=torch.float64)
        # torch.quantile takes at most 2**24 elements: the benchmark's model has about 3.3M
        self.quantiles[str(step)] = {"exp_avg_sq": torch.quantile(v.double(), q).tolist(),  # after ``step`` updates
                                     "update": torch.quantile(u.double(), q).tolist(),
                                     "exp_avg_sq_zero_fraction": (v == 0).double().mean().item()}


TAIL = 20


def mean(xs) -> float:
    xs = list(xs)
    return sum(xs) / len(xs)


def final_loss(losses: list[float]) -> float:
    return mean(losses[-TAIL:])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--seeds", type=int, nargs="+", default=[0])
    parser.add_argument("--variants", nargs="+", default=DEFAULT_VARIANTS, choices=list(VARIANTS))
    parser.add_argument("--out", type=Path, default=None)
    parser.add_argument("--probe", action="store_true",
                        help="also record each step's gradient norm and AdamW's mean exp_avg_sq, and quantiles of its state (Probe)")
    parser.add_argument("--plot", type=Path, default=None)
    parser.add_argument("--plot-variants", nargs="+", default=None, help="variants to draw (default: all)")
    parser.add_argument("--from-json", type=Path, nargs="+", default=None,
                        help="no training: merge these --out files (later ones win) and report them")
    args = parser.parse_args()
    world = int(os.environ.get("WORLD_SIZE", "4"))
    rank0 = not int(os.environ.get("RANK", "0"))
    results: dict[str, dict] = {}
    if args.from_json:
        for path in args.from_json:  # variants only: a file may carry notes ("_note": text) beside them
            results.update({k: v for k, v in json.loads(path.read_text()).items() if isinstance(v, dict)})
        args.variants = []
        args.seeds = sorted({run["seed"] for r in results.values() for run in r["runs"]})
        args.steps = len(next(iter(results.values()))["runs"][0]["loss"])
    for name in args.variants:
        runs = []
        for seed in args.seeds:
            seed_everything(seed)
            rec, probe = Record(), Probe(args.steps)
            strategy = ZeroPPStrategy(stage=3, simulated_nodes=2, **VARIANTS[name])
            trainer = Trainer(
                strategy=strategy, accelerator="cpu", devices=world, max_steps=args.steps,
                callbacks=[rec, probe] if args.probe else [rec],
                gradient_clip_val=1.0, logger=False, enable_checkpointing=False, enable_progress_bar=False,
                enable_model_summary=False,
            )
            trainer.fit(GPT(seed, args.steps))
            runs.append({"seed": seed, "loss": rec.losses, "inter_bytes_per_step": rec.inter[1:],
                         "inter_bytes_by_kind_step1": rec.by_kind})
            if args.probe:
                runs[-1].update(grad_norm=probe.grad_norm, exp_avg_sq_mean=probe.exp_avg_sq_mean,
                                quantiles=probe.quantiles)
            if rank0:
                print(f"{name} seed {seed}: final loss {final_loss(rec.losses):.4f}", flush=True)
        results[name] = {"runs": runs, "config": {"stage": 3, "simulated_nodes": 2, **VARIANTS[name]}}  # what ran
        if args.out and rank0:  # after every variant: a run stopped later keeps what it finished
            args.out.parent.mkdir(parents=True, exist_ok=True)
            args.out.write_text(json.dumps(results))
    if not rank0:
        return
    print(f"\n{args.steps} steps, {world} ranks as 2 simulated nodes, seeds {args.seeds}; "
          f"final loss = mean of the last {TAIL} steps, then over seeds")
    print("| variant | final loss | vs stage 3 | worst seed vs stage 3 | cross-node MB/step | vs stage 3 |")
    print("|---|---:|---:|---:|---:|---:|")
    base = results.get("stage3")
    for name, r in results.items():
        finals = [final_loss(run["loss"]) for run in r["runs"]]
        mb = mean([mean(run["inter_bytes_per_step"]) for run in r["runs"]]) / 1e6
        if base is None:
            print(f"| {name} | {mean(finals):.4f} | - | - | {mb:.3f} | - |")
            continue
        bfinals = [final_loss(run["loss"]) for run in base["runs"]]
        worst = max(f / b - 1 for f, b in zip(finals, bfinals))
        bmb = mean([mean(run["inter_bytes_per_step"]) for run in base["runs"]]) / 1e6
        print(f"| {name} | {mean(finals):.4f} | {mean(finals) / mean(bfinals) - 1:+.2%} | {worst:+.2%} "
              f"| {mb:.3f} | {mb / bmb:.3f}x |")
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(results))
    if args.plot:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt

        fig, (ax, dax) = plt.subplots(2, 1, figsize=(7, 6), sharex=True, height_ratios=[2, 1])
        means = {name: [mean(col) for col in zip(*[run["loss"] for run in r["runs"]])] for name, r in results.items()}
        for name, r in results.items():  # mean over seeds
            if args.plot_variants and name not in args.plot_variants:
                continue
            (line,) = ax.plot(means[name], label=f"{name} ({len(r['runs'])} seeds)", linewidth=1)
            if "stage3" in means and name != "stage3":  # the difference, smoothed over 10 steps
                diff = [a - b for a, b in zip(means[name], means["stage3"])]
                smooth = [mean(diff[max(0, i - 9) : i + 1]) for i in range(len(diff))]
                dax.plot(smooth, label=name, linewidth=1, color=line.get_color())
        ax.set_ylabel("training loss")
        ax.set_title(f"ZeRO-3 vs ZeRO++: GPT-2 4x256, {world} ranks as 2 nodes, fp32", fontsize=10)
        ax.legend()
        dax.axhline(0, color="0.6", linewidth=0.8)
        dax.set_xlabel("step")
        dax.set_ylabel("minus stage 3\n(10-step mean)")
        args.plot.parent.mkdir(parents=True, exist_ok=True)
        fig.tight_layout()
        fig.savefig(args.plot, dpi=120)


if __name__ == "__main__":
    main()

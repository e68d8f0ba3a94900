"""How far from the true weights the copy every rank computes with is: int8/int4 codes of
the weights (qwZ, zeropp_4bit) against 2-bit or int4 codes of their changes with the
rounding fed back (weight_delta_coding, zeropp_delta), along one real training run.

    python benchmarks/weight_error.py --steps 200 --seed 0

One process trains the GPT-2-shaped model of benchmarks/zeropp_convergence.py with its
recipe (AdamW, warm-up, cosine decay, clipping; batch 16 = its 4 ranks x 4) in fp32, without
any quantization (its own run: not the benchmark's draws or data order, the same recipe and
corpus), and after every step codes a sample of the weights (the first 4,096 elements of
every tensor, the whole of a smaller one: 52 tensors, LayerNorms and biases included) the
way each wire does, with this package's ``kernels.quantize``/``dequantize``: int8 codes of
the weights in blocks of 256 and int4 in blocks of 64 with fp32 scales (qwZ, zeropp_4bit);
2-bit codes of the changes in blocks of 256 with bf16 scales (the zeropp_delta preset), int4
ones in blocks of 64 with fp32 scales. Printed: the RMS and the largest error of each copy, in units of that step's own
change of the weights (RMS and largest), averaged over the steps after the warm-up's
first 10, and over the last 50. Weight deltas are the weights' changes, so their error
shrinks with the learning rate; codes of the weights are not.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run as a script: make `benchmarks` importable
from benchmarks.bench_train import corpus  # noqa: E402
from zeropp_strategy.kernels import dequantize, quantize  # noqa: E402


def coded(x: torch.Tensor, bits: int, block: int, bf16_scales: bool = False) -> torch.Tensor:
    codes, scales = quantize(x, block, bits, bf16_scales=bf16_scales)
    return dequantize(codes, scales, block, x.numel(), bits)


def trajectory(steps: int, seed: int) -> torch.Tensor:
    """(steps + 1, n) samples of the flat weights, before training and after each step."""
    from benchmarks.zeropp_convergence import GPT  # the benchmark's own model, optimizer and schedule

    module = GPT(seed, steps)
    module.configure_model()  # seeds the generator itself, then builds the model for real
    model = module.model
    schedule = module.configure_optimizers()
    opt, sched = schedule["optimizer"], schedule["lr_scheduler"]["scheduler"]
    data = torch.utils.data.DataLoader(corpus(128, 512), batch_size=16, shuffle=True,
                                       generator=torch.Generator().manual_seed(seed))
    sample = lambda: torch.cat([p.detach().reshape(-1)[:4096] for p in model.parameters()])  # noqa: E731
    out, batches = [sample().clone()], iter(data)
    for step in range(steps):
        try:
            (ids,) = next(batches)
        except StopIteration:
            batches = iter(data)
            (ids,) = next(batches)
        model(input_ids=ids, labels=ids).loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        opt.zero_grad()
        sched.step()
        out.append(sample().clone())
        if step % 50 == 0:
            print(f"step {step}", flush=True)
    return torch.stack(out)


def errors(w: torch.Tensor, copy_of) -> tuple[list[float], list[float]]:
    """Per step: (RMS error / RMS change, largest error / largest change)."""
    rms, top = [], []
    for t in range(1, w.shape[0]):
        err, change = copy_of(t) - w[t], w[t] - w[t - 1]
        rms.append((err.pow(2).mean().sqrt() / change.pow(2).mean().sqrt()).item())
        top.append((err.abs().max() / change.abs().max()).item())
    return rms, top


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    w = trajectory(args.steps, args.seed)
    rows = {"int8 codes of the weights (zeropp's qwZ, blocks of 256)": lambda t: coded(w[t], 8, 256),
            "int4 codes of the weights (zeropp_4bit, blocks of 64)": lambda t: coded(w[t], 4, 64)}
    for bits, block, bf16, name in ((2, 256, True, "zeropp_delta, blocks of 256, bf16 scales"),
                                    (4, 64, False, "int4 deltas, blocks of 64")):
        kept = [w[0].clone()]  # the first gather sends the weights themselves
        for t in range(1, w.shape[0]):  # the next change is taken against the copy
            kept.append(kept[-1] + coded(w[t] - kept[-1], bits, block, bf16))
        rows[f"{bits}-bit codes of the changes, fed back ({name})"] = kept.__getitem__
    mean = lambda xs: sum(xs) / len(xs)  # noqa: E731
    print(f"\nerror of the copy computed with, in units of one step's change (steps 10-{args.steps}; last 50)")
    print("| copy | RMS | RMS, last 50 | largest | largest, last 50 |\n|---|---:|---:|---:|---:|")
    for name, copy_of in rows.items():
        rms, top = errors(w, copy_of)
        print(f"| {name} | {mean(rms[10:]):.2f} | {mean(rms[-50:]):.2f} | {mean(top[10:]):.2f} | {mean(top[-50:]):.2f} |")


if __name__ == "__main__":
    main()

"""The optimizer step on DTensor shards against the same step on their local tensors.

    python benchmarks/optimizer_step.py                 # writes benchmarks/results/optimizer_step.json
    python benchmarks/optimizer_step.py --ranks 4       # each rank holds a quarter, as in the 4-rank suite

One process per rank (gloo on 127.0.0.1, one intra-op thread each), every rank holding
its Shard(0) DTensor shards of GPT-2 4 x 256's 52 parameters (the model of
benchmarks/volume.py, 3.3M parameters), with random gradients. For each AdamW
implementation (for-loop, ``foreach=True``, ``fused=True``) it times ``step()`` three
ways: torch's optimizer on the DTensors (what FSDP2 users run), ``LocalStepOptimizer``
around the same optimizer (the engine's default at stages 2/3, [Note: the step on local
shards]), and the optimizer on plain tensors of the local shapes (the floor). Median of
``--steps`` timed steps after 3 warm-up steps, rank 0's figures. The local step must
leave the same bits as the DTensor step; the script checks it and says so.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

LAYERS, WIDTH, VOCAB, SEQ = 4, 256, 512, 128
IMPLS = {"for-loop": {}, "foreach": {"foreach": True}, "fused": {"fused": True}}


def gpt2_shapes() -> list[tuple[int, ...]]:
    """GPT-2's parameter shapes (transformers' Conv1D layout), embeddings first."""
    block = [(WIDTH,), (WIDTH,), (WIDTH, 3 * WIDTH), (3 * WIDTH,), (WIDTH, WIDTH), (WIDTH,), (WIDTH,), (WIDTH,),
             (WIDTH, 4 * WIDTH), (4 * WIDTH,), (4 * WIDTH, WIDTH), (WIDTH,)]
    return [(VOCAB, WIDTH), (SEQ, WIDTH), *block * LAYERS, (WIDTH,), (WIDTH,)]


def _params(mesh, kind: str) -> list[torch.Tensor]:
    from torch.distributed.tensor import Shard, distribute_tensor

    g = torch.Generator().manual_seed(0)
    out = []
    for shape in gpt2_shapes():
        value, grad = torch.randn(shape, generator=g), torch.randn(shape, generator=g)
        if kind == "plain":  # this rank's rows only, as plain tensors
            rows = -(-shape[0] // mesh.size())
            lo = min(shape[0], mesh.get_local_rank() * rows)
            p = torch.nn.Parameter(value[lo : lo + rows].clone())
            p.grad = grad[lo : lo + rows].clone()
        else:
            p = torch.nn.Parameter(distribute_tensor(value, mesh, [Shard(0)]))
            p.grad = distribute_tensor(grad, mesh, [Shard(0)])
        out.append(p)
    return out


def _time(opt: torch.optim.Optimizer, steps: int) -> list[float]:
    for _ in range(3):
        opt.step()
    times = []
    for _ in range(steps):
        dist.barrier()
        t0 = time.perf_counter()
        opt.step()
        times.append(time.perf_counter() - t0)
    return times


def worker(steps: int) -> dict:
    from torch.distributed.device_mesh import init_device_mesh

    from zeropp_strategy.engine.local_step import LocalStepOptimizer

    torch.set_num_threads(1)
    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    rows: dict = {}
    for impl, kw in IMPLS.items():
        dtensor_params, local_params, plain_params = _params(mesh, "dtensor"), _params(mesh, "dtensor"), _params(
            mesh, "plain")
        cells = {
            "dtensor": torch.optim.AdamW(dtensor_params, lr=1e-3, weight_decay=0.01, **kw),
            "local": LocalStepOptimizer(torch.optim.AdamW(local_params, lr=1e-3, weight_decay=0.01, **kw)),
            "plain": torch.optim.AdamW(plain_params, lr=1e-3, weight_decay=0.01, **kw),
        }
        row = {}
        for name, opt in cells.items():
            times = _time(opt, steps)
            row[name] = {"median_ms": 1e3 * statistics.median(times), "min_ms": 1e3 * min(times)}
        row["same_bits"] = all(torch.equal(a._local_tensor, b._local_tensor)
                               for a, b in zip(dtensor_params, local_params))
        rows[impl] = row
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--ranks", type=int, default=4)
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--out", type=Path, default=ROOT / "benchmarks" / "results" / "optimizer_step.json")
    ap.add_argument("--rank", type=int, default=None, help=argparse.SUPPRESS)  # internal: one rank
    args = ap.parse_args()
    if args.rank is not None:  # one rank of the run
        dist.init_process_group("gloo", rank=args.rank, world_size=args.ranks)
        rows = worker(args.steps)
        if args.rank == 0:
            args.out.write_text(json.dumps(rows))
        dist.destroy_process_group()
        return
    import subprocess

    from tests._dist import free_port

    env = {**os.environ, "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(free_port()), "OMP_NUM_THREADS": "1"}
    tmp = args.out.with_suffix(".rank0.json")
    procs = [subprocess.Popen([sys.executable, __file__, "--ranks", str(args.ranks), "--steps", str(args.steps),
                               "--out", str(tmp), "--rank", str(r)], env=env) for r in range(args.ranks)]
    if any(p.wait(timeout=600) for p in procs):
        raise SystemExit("a rank failed")
    rows = json.loads(tmp.read_text())
    tmp.unlink()
    result = {"command": " ".join(["python", "benchmarks/optimizer_step.py", *sys.argv[1:]]),
              "hardware": {"machine": platform.machine(), "cpu_count": os.cpu_count(), "torch": torch.__version__},
              "ranks": args.ranks, "params": sum(torch.Size(s).numel() for s in gpt2_shapes()), "rows": rows}
    args.out.write_text(json.dumps(result, indent=1))
    print(f"AdamW step, GPT-2 {LAYERS} x {WIDTH} ({result['params'] / 1e6:.2f}M parameters) sharded over "
          f"{args.ranks} ranks on {os.cpu_count()} cores, rank 0, median of {args.steps} steps (ms):\n")
    print("| implementation | on DTensors | LocalStepOptimizer | plain local tensors | same bits |")
    print("|---|---:|---:|---:|:---:|")
    for impl, row in rows.items():
        print(f"| {impl} | {row['dtensor']['median_ms']:.1f} | {row['local']['median_ms']:.1f} | "
              f"{row['plain']['median_ms']:.1f} | {'yes' if row['same_bits'] else 'NO'} |")
    print(f"\nwrote {args.out}")


if __name__ == "__main__":
    main()

"""The parts of the GPU check (benchmarks/gpu/check.py runs each in its own process).

    python benchmarks/gpu/parts.py PART RESULT.json --budget-s 90 --work DIR [--dry-run]

Each part writes its result as JSON: ``status`` ("ok", "failed" or "partial": a part that
stopped at its budget says what it did not do), a one-line ``summary`` and its figures.
``--dry-run`` is the same code on the CPU with tiny sizes. The model cells of ``one_gpu``
run as ``train`` in a process of their own, so each starts with an empty GPU.
"""

from __future__ import annotations

import argparse
import copy
import importlib.util
import json
import os
import re
import statistics
import subprocess
import sys
import time
import traceback
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))
sys.path.insert(0, str(Path(__file__).resolve().parent))  # already sys.path[0] when this runs as a script

import torch  # noqa: E402
from llama import llama_config, llama_params  # noqa: E402 - the shapes: benchmarks/llama.py
from parts_common import (  # noqa: E402 - the parts' shared helpers: benchmarks/gpu/parts_common.py
    Budget, _bench_kernels, _cuda, _env_result, _save_partial, _text, _write_json)

DATASHEET_BF16_TFLOPS = 989.4  # H100/H200 SXM, dense bf16 (the vendor's datasheet): the MFU denominator
ONE_GPU_SYSTEMS = ("plain", "zeropp_stage_3", "zeropp_offload")


# -- env ------------------------------------------------------------------------------------------


def part_env(args: argparse.Namespace, budget: Budget) -> dict:
    cuda = _cuda(args.dry_run)
    r: dict = {"python": sys.version.split()[0], "torch": torch.__version__, "torch_cuda": torch.version.cuda,
               "cpus": os.cpu_count()}
    for name in ("triton", "lightning", "transformers", "accelerate", "peft"):
        r[name] = __import__(name).__version__ if importlib.util.find_spec(name) else None
    if cuda:
        props = torch.cuda.get_device_properties(0)
        r.update(gpu=props.name, gpu_memory_GiB=round(props.total_memory / 2**30, 1),
                 multiprocessors=props.multi_processor_count, capability=f"{props.major}.{props.minor}",
                 nccl=".".join(map(str, torch.cuda.nccl.version())))
        try:
            r["driver"] = subprocess.run(["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"],
                                         capture_output=True, text=True, timeout=20).stdout.strip()
        except (OSError, subprocess.SubprocessError) as e:
            r["driver"] = f"nvidia-smi failed: {e}"
    device = torch.device("cuda" if cuda else "cpu")
    time_ms = _bench_kernels()._time_ms  # the kernels' timer: do_bench's median on CUDA
    nbytes = 2**30 if cuda else 2**24  # 1 GiB: many times the L2
    src = torch.randint(0, 255, (nbytes,), dtype=torch.uint8, device=device)
    dst = torch.empty_like(src)
    r["copy_GBps"] = round(2 * nbytes / time_ms(lambda: dst.copy_(src), device) / 1e6, 1)  # bytes read + written
    del src, dst
    n, dtype = (8192, torch.bfloat16) if cuda else (256, torch.float32)
    a, b = (torch.randn(n, n, device=device, dtype=dtype) for _ in range(2))
    r["matmul_TFLOPs"] = round(2 * n**3 / time_ms(lambda: a @ b, device) / 1e9, 3)
    r["matmul"] = f"{n}x{n}x{n} {str(dtype).removeprefix('torch.')}, random data"
    r["summary"] = (f"{r.get('gpu', 'CPU')}: copy {r['copy_GBps']} GB/s, matmul {r['matmul_TFLOPs']} TFLOP/s, "
                    f"torch {r['torch']}, triton {r['triton']}, nccl {r.get('nccl', '-')}")
    r["status"] = "ok"
    return r


# -- tests ----------------------------------------------------------------------------------------


def part_tests(args: argparse.Namespace, budget: Budget) -> dict:
    """The tests that skip without CUDA, and the adapter of FSDP2's private names on this torch."""
    select = ["tests/test_kernels.py", "-k", "cuda_matches or ptx or test_fsdp_private"]
    cmd = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-o", "addopts=-ra", *select]
    if args.dry_run:
        cmd.append("--collect-only")  # no GPU: check that the selection still names the CUDA tests
    else:
        cmd += ["tests/test_fsdp_private.py", f"--timeout={max(30, int(budget.left()) - 10)}"]
    try:
        proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=max(10, budget.left() - 5))
    except subprocess.TimeoutExpired as e:  # what pytest printed so far says how far it got
        print(_text(e.stdout)[-20000:], _text(e.stderr)[-5000:], sep="\n", flush=True)
        progress = [ln for ln in _text(e.stdout).splitlines() if re.fullmatch(r"[.sFExX]+\s*(\[\s*\d+%\])?", ln.strip())]
        dots = sum(ln.split("[")[0].count(".") for ln in progress)  # pytest -q's progress lines only
        return {"command": " ".join(cmd[1:]), "status": "timeout",
                "error": f"pytest ran past {e.timeout:.0f} s (about {dots} tests passed by then; a cold Triton "
                         "cache compiles every kernel first)"}
    print(proc.stdout[-20000:], proc.stderr[-5000:], sep="\n", flush=True)
    tail = proc.stdout.strip().splitlines()[-1] if proc.stdout.strip() else ""
    counts = {k: int(v) for v, k in re.findall(r"(\d+) (passed|failed|skipped|errors?)", tail)}
    r = {"command": " ".join(cmd[1:]), "last_line": tail, "counts": counts, "returncode": proc.returncode}
    if args.dry_run:
        found = re.search(r"(\d+)(?:/\d+)? tests? collected", tail)  # "211/428 tests collected (217 deselected)"
        collected = int(found.group(1)) if found else 0
        ok = proc.returncode == 0 and collected >= 100
        r["summary"] = f"{collected} CUDA tests collected (not run: no GPU)"
    else:
        ok = proc.returncode == 0 and counts.get("passed", 0) > 0 and not counts.get("failed")
        r["summary"] = tail
    r["status"] = "ok" if ok else "failed"
    return r


# -- kernels --------------------------------------------------------------------------------------


def part_kernels(args: argparse.Namespace, budget: Budget) -> dict:
    from zeropp_strategy import ZeroConfig

    bk = _bench_kernels()
    cuda = _cuda(args.dry_run)
    device = torch.device("cuda" if cuda else "cpu")
    cfg = ZeroConfig()
    # qwZ int8, qgZ int4 defaults; 2 bits: zeropp_delta's weight deltas, in qwZ's blocks
    blocks = {8: cfg.weight_quant_block_elems, 4: cfg.gradient_quant_block_elems, 2: cfg.weight_quant_block_elems}
    if cuda:
        # the sizes the 0.8-of-copy target is about first, in case the budget runs out
        sizes, ops, dtypes = [2**26, 2**28, 2**20, 2**24], bk.OPS, ("bfloat16", "float16")
    else:  # the torch reference only (bk.throughput's CPU rule), at a size that takes milliseconds
        sizes, ops, dtypes = [2**16], bk.OPS[:2], ("bfloat16",)
    copy_gbps = _env_result(args).get("copy_GBps")
    rows, skipped, skipped_2bit = [], 0, 0
    # int8 and int4 first, every dtype; the 2-bit cells (the first dtype only) last, so that a
    # short budget drops them rather than the cells earlier leases measured
    cells = [(dtype, numel, bits) for dtype in dtypes for numel in sizes for bits in (8, 4)]
    cells += [(dtypes[0], numel, 2) for numel in sizes]
    for dtype, numel, bits in cells:
        for op in ops:
            if budget.left() < 8:
                skipped += 1
                skipped_2bit += bits == 2
                continue
            nbytes, fns, check = bk._op_setup(op, numel, blocks[bits], bits, getattr(torch, dtype), device)
            row = {"op": op, "numel": numel, "bits": bits, "block_elems": blocks[bits], "dtype": dtype,
                   "bytes": nbytes}
            for backend, fn in fns.items():
                ms = bk._time_ms(fn, device)
                row[f"{backend}_ms"], row[f"{backend}_GBps"] = ms, float(f"{nbytes / ms / 1e6:.4g}")
            if check is not None:
                row["exact"] = bool(check())
            if copy_gbps:
                best = row.get("triton_GBps", row["torch_GBps"])
                row["of_copy"] = float(f"{best / copy_gbps:.3g}")
            rows.append(row)
            print(json.dumps(row), flush=True)
            del fns, check
            if cuda:
                torch.cuda.empty_cache()
    backend = "triton" if any("triton_GBps" in r for r in rows) else "torch"
    # the 0.8-of-copy target is the int8/int4 kernels' (qwZ, qgZ); the 2-bit rows are reported beside it
    big = [r for r in rows if r["numel"] >= 2**26 and "of_copy" in r and r["bits"] in (8, 4)]
    r = {"rows": rows, "backend": backend, "copy_GBps": copy_gbps, "cells_not_run": skipped}
    inexact = [f"{x['op']} int{x['bits']} {x['dtype']} {x['numel']}" for x in rows if x.get("exact") is False]
    r["inexact"] = inexact
    if big:
        worst = min(big, key=lambda x: x["of_copy"])
        r["worst_64M_plus"] = {k: worst[k] for k in ("op", "bits", "dtype", "numel", "of_copy")}
        r["below_0.8_of_copy"] = sum(x["of_copy"] < 0.8 for x in big)
    r["summary"] = (f"{len(rows)} cells ({backend}), {len(inexact)} not bit-identical"
                    + (f", worst at >=64M: {r['worst_64M_plus']['of_copy']:.2f}x copy "
                       f"({r['worst_64M_plus']['op']} int{r['worst_64M_plus']['bits']})" if big else "")
                    + (f", {skipped} cells not run (budget)" if skipped else ""))
    r["status"] = "failed" if inexact or not rows else ("partial" if skipped > skipped_2bit else "ok")
    return r


# -- one GPU: training cells ---------------------------------------------------------------------


def llama_counts(size: str, seq: int) -> tuple[int, float]:
    """(parameters, training FLOPs per token): 6 x the matmul parameters (all but the input
    embedding) plus attention's 12 x layers x hidden x seq (PaLM's appendix B)."""
    cfg = llama_config(size, seq)
    params = llama_params(size)
    return params, 6 * (params - cfg.vocab_size * cfg.hidden_size) + 12 * cfg.num_hidden_layers * cfg.hidden_size * seq


def train_cell(args: argparse.Namespace) -> dict:
    """One system, one size, under the Trainer as users run it: the model built in
    ``configure_model``, bf16-mixed, AdamW, ``--steps`` timed steps after ``--warmup``."""
    import lightning.pytorch as L
    from torch.utils.data import DataLoader, TensorDataset
    from transformers import LlamaForCausalLM

    import zeropp_strategy  # noqa: F401 - registers the strategy names
    from zeropp_strategy import ZeroPPStrategy

    cuda = _cuda(args.dry_run)
    cfg = llama_config(args.size, args.seq)
    vocab = cfg.vocab_size
    total = args.warmup + args.steps

    class Llama(L.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.model = None

        def configure_model(self) -> None:
            if self.model is None:  # as README tells users (zeropp at stages 2/3: on the meta device)
                self.model = LlamaForCausalLM(cfg)

        def training_step(self, batch, batch_idx):
            (ids,) = batch
            return self.model(input_ids=ids, labels=ids).loss

        def configure_optimizers(self):
            return torch.optim.AdamW(self.parameters(), lr=1e-4)

        def train_dataloader(self):
            g = torch.Generator().manual_seed(0)
            return DataLoader(TensorDataset(torch.randint(0, vocab, (total * args.batch, args.seq), generator=g)),
                              batch_size=args.batch)

    class Timer(L.Callback):
        def __init__(self) -> None:
            self.steps: list[float] = []
            self.losses: list[float] = []

        def on_train_batch_start(self, *a) -> None:  # noqa: ANN002
            if cuda:
                torch.cuda.synchronize()
            self.t0 = time.perf_counter()

        def on_train_batch_end(self, trainer, module, outputs, batch, batch_idx) -> None:  # noqa: ANN001
            if cuda:
                torch.cuda.synchronize()
            self.steps.append(time.perf_counter() - self.t0)
            self.losses.append(float(outputs["loss"]))

    strategy = {"plain": "auto", "zeropp_stage_3": "zeropp_stage_3", "zeropp_offload": "zeropp_offload"}.get(
        args.system)
    if args.system == "largest":  # ZeRO-Offload's case: states in host memory, the plan refuses what cannot fit
        strategy = ZeroPPStrategy(stage=3, offload_optimizer={"device": "cpu"}, offload_param={"device": "cpu"},
                                  host_memory_budget_bytes="auto", wrap_modules=["LlamaDecoderLayer"])
    timer = Timer()
    trainer = L.Trainer(accelerator="gpu" if cuda else "cpu", devices=1, precision="bf16-mixed", strategy=strategy,
                        max_steps=total, logger=False, enable_checkpointing=False, enable_progress_bar=False,
                        enable_model_summary=False, callbacks=[timer], default_root_dir=args.work)
    if cuda:
        torch.cuda.reset_peak_memory_stats()
    t0 = time.perf_counter()
    r: dict = {"system": args.system, "size": args.size, "batch": args.batch, "seq": args.seq}
    try:
        trainer.fit(Llama())
    except ValueError as e:
        if "cannot fit" not in str(e):
            raise
        r.update(status="refused", error=str(e).splitlines()[0])
        return r
    params, flops_per_token = llama_counts(args.size, args.seq)
    timed = timer.steps[args.warmup:]
    step_s = statistics.median(timed)
    tokens = args.batch * args.seq
    r.update(status="ok", params=params, fit_s=round(time.perf_counter() - t0, 1),
             step_s=[round(s, 4) for s in timer.steps], median_step_s=round(step_s, 4),
             tokens_per_s=round(tokens / step_s, 1), tflops=round(tokens * flops_per_token / step_s / 1e12, 2),
             losses=[round(x, 4) for x in timer.losses])
    if cuda:
        r["peak_gpu_GiB"] = round(torch.cuda.max_memory_allocated() / 2**30, 2)
    return r


def _cell(args: argparse.Namespace, budget: Budget, system: str, size: str, steps: int, warmup: int, batch: int,
          seq: int, share_s: float) -> dict:
    result = Path(args.work) / f"cell_{system}_{size}.json"
    result.unlink(missing_ok=True)
    cmd = [sys.executable, __file__, "train", str(result), "--work", args.work, "--system", system, "--size", size,
           "--steps", str(steps), "--warmup", str(warmup), "--batch", str(batch), "--seq", str(seq),
           "--budget-s", str(int(share_s))] + (["--dry-run"] if args.dry_run else [])
    print(f"$ {' '.join(cmd)}", flush=True)
    try:
        rc = subprocess.run(cmd, cwd=ROOT, timeout=share_s).returncode
    except subprocess.TimeoutExpired:
        return {"system": system, "size": size, "status": "timeout", "error": f"over its {share_s:.0f} s"}
    if not result.exists():
        return {"system": system, "size": size, "status": "failed", "error": f"exit {rc}, no result (check.log)"}
    return json.loads(result.read_text())


def part_one_gpu(args: argparse.Namespace, budget: Budget) -> dict:
    cuda = _cuda(args.dry_run)
    size, batch, seq, steps, warmup = ("1B", 4, 2048, 8, 3) if cuda else ("tiny", 2, 32, 2, 1)
    env = _env_result(args)
    systems = {}
    total_s = budget.left()
    for system, fraction in zip(ONE_GPU_SYSTEMS, (0.3, 0.35, 0.35)):
        s_steps = steps if system != "zeropp_offload" else max(2, steps // 2)
        systems[system] = _cell(args, budget, system, size, s_steps, warmup, batch, seq, total_s * fraction)
        s = systems[system]
        if s.get("tflops") is not None:
            s["mfu_datasheet"] = round(s["tflops"] / DATASHEET_BF16_TFLOPS, 4) if cuda else None
            if env.get("matmul_TFLOPs"):
                s["mfu_measured_matmul"] = round(s["tflops"] / env["matmul_TFLOPs"], 4)
        _save_partial(args, {"systems": systems})
    plain = systems["plain"].get("tokens_per_s")
    r: dict = {"model": f"Llama {size} ({llama_counts(size, seq)[0] / 1e9:.2f}B), batch {batch} x {seq}, bf16-mixed",
               "systems": systems}
    z3 = systems["zeropp_stage_3"].get("tokens_per_s")
    if plain and z3:
        r["zeropp_stage_3_vs_plain"] = round(z3 / plain, 3)
    bad = [n for n, s in systems.items() if s["status"] != "ok"]
    r["summary"] = (", ".join(f"{n} {s.get('tokens_per_s', s['status'])} tok/s" for n, s in systems.items())
                    + (f"; stage3/plain {r.get('zeropp_stage_3_vs_plain')}" if z3 and plain else ""))
    r["status"] = "failed" if bad else "ok"
    return r


# Sizes trained with their states on the host, on a lease: 2.7B (H100, 2026-11-26), 4.3B (H100
# and H200, 2026-11-27: 1.80 s per step on the H200, its first step 23 s). A 4.3B cell needs
# about 135 s with its start, more than the default run leaves, so this part runs only when
# named (--parts offload_largest) and starts above the largest size trained so far.
LARGEST_SIZES = ("6.7B",)


def part_offload_largest(args: argparse.Namespace, budget: Budget) -> dict:
    """Ascending, while the budget lasts: each size that trains is a floor on the largest, and
    the first refused (the memory plan: host memory) or failed one is the ceiling."""
    cuda = _cuda(args.dry_run)
    largest = []
    for big in (LARGEST_SIZES if cuda else ("tiny", "tiny2")):
        if budget.left() < (100 if cuda else 15):
            break
        # the margin: a cell killed at its limit with tens of GiB of pinned host memory takes
        # many seconds to die (the second lease lost the whole part to that)
        cell = _cell(args, budget, "largest", big, 2, 1, 1, 512 if cuda else 32, budget.left() - (40 if cuda else 5))
        largest.append(cell)
        _save_partial(args, {"largest_tried": largest})
        if cell["status"] != "ok":
            break
    r: dict = {"largest_tried": largest}
    trained = [c for c in largest if c["status"] == "ok"]
    if trained:
        r["largest_trained"] = {k: trained[-1].get(k) for k in ("size", "params", "tflops", "median_step_s")}
    r["summary"] = (f"largest with host offload: {trained[-1]['size']} at {trained[-1]['tflops']} TFLOP/s"
                    if trained else "no size trained: " + "; ".join(f"{c['size']} {c['status']}" for c in largest))
    r["status"] = "ok" if trained else ("refused" if largest and largest[-1]["status"] == "refused" else "failed")
    return r


# -- two ranks on one GPU -----------------------------------------------------------------------------


def _two_rank_worker(rank: int, world_size: int, backend: str, use_cuda: bool) -> dict:
    from datetime import timedelta

    import torch.distributed as dist
    from torch import nn

    from zeropp_strategy import ZeroConfig
    from zeropp_strategy.engine.precision import PrecisionPolicy
    from zeropp_strategy.session import ZeroSession

    import faulthandler

    faulthandler.enable()  # a crash in a backend (gloo with CUDA tensors died with SIGSEGV) prints its stack

    def at(what: str) -> None:  # where a rank got to, in the log, for a rank that dies
        print(f"two_ranks {backend} rank {rank}: {what}", flush=True)

    device = torch.device("cuda", 0) if use_cuda else torch.device("cpu")
    if use_cuda:
        torch.cuda.set_device(device)
    dist.init_process_group(backend, timeout=timedelta(seconds=30))
    at("process group up")
    probe = torch.ones(4, device=device) * (rank + 1)
    dist.all_reduce(probe)  # the backend's first collective on this device: where NCCL refuses a shared GPU
    assert probe.tolist() == [3.0] * 4, probe
    at("first all_reduce done")
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(16, 32), nn.Tanh(), nn.Linear(32, 32), nn.Tanh(), nn.Linear(32, 4)).to(device)
    reference = copy.deepcopy(model)
    data = torch.randn(3, 8, 16, device=device)  # 3 steps, a global batch of 8: 4 per rank
    session = ZeroSession.start(ZeroConfig(stage=3, wrap_min_params=1), rank=rank, world_size=world_size,
                                ranks_per_node=world_size, device=device, precision=PrecisionPolicy("32-true",
                                device=device.type), where="gpu-check", backend=backend)
    model = session.prepare(model)
    at("model sharded")
    opt = session.adopt(torch.optim.AdamW(model.parameters(), lr=1e-2))
    ref_opt = torch.optim.AdamW(reference.parameters(), lr=1e-2)
    for x in data:
        mine = x[rank * 4:(rank + 1) * 4]
        model(mine).square().mean().backward()
        session.after_backward([model])
        opt.step()
        opt.zero_grad()
        reference(x).square().mean().backward()
        ref_opt.step()
        ref_opt.zero_grad()
        at("step done")
    # the shards gathered on the host: DTensor.full_tensor() over gloo with CUDA tensors died
    # with SIGSEGV in torch's functional all-gather on an H100 (torch 2.11), after the steps
    diffs = []
    for p, q in zip(model.parameters(), reference.parameters()):
        local = (p.to_local() if hasattr(p, "to_local") else p).detach().cpu()
        shards: list = [None] * world_size
        dist.all_gather_object(shards, local)
        full = torch.cat(shards)[: q.shape[0]] if hasattr(p, "to_local") else local
        diffs.append(full.sub(q.detach().cpu()).abs().max().item())
    session.close()
    return {"rank": rank, "max_abs_diff": max(diffs), "device": str(device)}


def part_two_ranks(args: argparse.Namespace, budget: Budget) -> dict:
    from tests._dist import run_ranks

    cuda = _cuda(args.dry_run)
    attempts = []
    for backend in (("nccl", "gloo") if cuda else ("gloo",)):
        if budget.left() < 10:
            break
        # NCCL may hang rather than refuse a shared device: it gets at most 40% of the part
        limit = min(budget.left() * 0.4, 25) if backend == "nccl" else budget.left() - 5
        try:
            out = run_ranks(_two_rank_worker, 2, (backend, cuda), timeout_s=limit)
            diff = max(o["max_abs_diff"] for o in out)
            attempts.append({"backend": backend, "status": "ok" if diff <= 1e-5 else "failed",
                             "max_abs_diff": diff, "device": out[0]["device"]})
        except Exception as e:  # noqa: BLE001 - a refusal is a result: what was tried and why it failed
            attempts.append({"backend": backend, "status": "refused", "error": str(e)[-1500:]})
        if attempts[-1]["status"] == "ok":
            break
    ok = [a for a in attempts if a["status"] == "ok"]
    return {"attempts": attempts, "status": "ok" if ok else "failed",
            "summary": "; ".join(f"{a['backend']}: {a['status']}" + (f" (max |diff| {a['max_abs_diff']:.1e} vs one "
                                 "process)" if "max_abs_diff" in a else "") for a in attempts)}


# -- the main job ---------------------------------------------------------------------------------


def part_pipeline(args: argparse.Namespace, budget: Budget) -> dict:
    from zeropp_strategy.pipeline import load_recipe, run_pipeline

    cuda = _cuda(args.dry_run)
    recipe = load_recipe(None)
    recipe.setdefault("trainer", {}).update(accelerator="gpu" if cuda else "cpu", devices=1)
    if args.dry_run:  # a few steps of each stage: the path, not the figures
        for stage, steps in (("sft", 2), ("reward", 2)):
            recipe[stage]["trainer"].update(max_steps=steps, val_check_interval=steps, limit_val_batches=1)
        recipe["ppo"]["trainer"].update(max_epochs=1, limit_train_batches=1, limit_val_batches=1)
    out = Path(args.work) / "pipeline"
    t0 = time.perf_counter()
    summary = run_pipeline(recipe, out)
    keep = {k: v for k, v in summary.items() if not k.endswith("example") and k != "final_actor"}
    return {"summary_json": keep, "seconds_total": round(time.perf_counter() - t0, 1), "status": "ok",
            "summary": ", ".join(f"{k} {v}" for k, v in keep.items() if isinstance(v, float))}


PARTS = {"env": part_env, "tests": part_tests, "kernels": part_kernels, "one_gpu": part_one_gpu,
         "two_ranks": part_two_ranks, "pipeline": part_pipeline, "offload_largest": part_offload_largest}


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("part", choices=[*PARTS, "train"])
    p.add_argument("result", type=Path)
    p.add_argument("--budget-s", type=float, default=60)
    p.add_argument("--work", default="/tmp/zeropp-gpu-check")
    p.add_argument("--dry-run", action="store_true")
    for name, kind in (("system", str), ("size", str), ("steps", int), ("warmup", int), ("batch", int), ("seq", int)):
        p.add_argument(f"--{name}", type=kind)
    args = p.parse_args()
    Path(args.work).mkdir(parents=True, exist_ok=True)
    torch.manual_seed(0)
    try:
        r = train_cell(args) if args.part == "train" else PARTS[args.part](args, Budget(args.budget_s))
    except Exception as e:  # noqa: BLE001 - the failure is the result; the traceback goes to check.log
        traceback.print_exc()
        saved = json.loads(args.result.read_text()) if args.result.exists() else {}  # a part's figures so far
        r = {**saved, "status": "failed", "error": f"{type(e).__name__}: {str(e)[:2000]}"}
    _write_json(args.result, r)  # check.py puts it in --work: later parts read env's
    return 0 if r["status"] in ("ok", "refused") else 1


if __name__ == "__main__":
    sys.exit(main())

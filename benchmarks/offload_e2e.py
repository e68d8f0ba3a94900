"""``python benchmarks/offload.py --part e2e`` and ``--part param``: Lightning training runs on
CPU with each offload setting, one cell per process (what they measure: benchmarks/offload.py's
docstring, ``e2e`` and ``param``). A cell's process is benchmarks/offload.py itself, started with
``--e2e-cell`` (``_cell_argv``).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

from offload_common import MiB, _md  # a sibling: benchmarks/ is on sys.path

E2E_CELLS = ("none", "none_fused", "opt_cpu", "opt_nvme", "opt_cpu_param_cpu", "opt_nvme_param_nvme", "param_nvme",
             "param_nvme_grads_nvme")
OFFLOAD = Path(__file__).resolve().parent / "offload.py"  # the entry point: each cell's process runs it


# -- e2e ----------------------------------------------------------------------------------------


def _e2e_module(width: int, depth: int, vocab: int, seq: int, batch: int, n_batches: int, fused: bool):
    from lightning.pytorch import LightningModule
    from torch import nn
    from torch.utils.data import DataLoader, TensorDataset

    class Block(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.norm = nn.LayerNorm(width)
            self.fc1 = nn.Linear(width, 4 * width)
            self.fc2 = nn.Linear(4 * width, width)

        def forward(self, x):
            return x + self.fc2(nn.functional.gelu(self.fc1(self.norm(x))))

    class Net(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.embed = nn.Embedding(vocab, width)
            self.blocks = nn.ModuleList(Block() for _ in range(depth))
            self.head = nn.Linear(width, vocab)

        def forward(self, idx):
            x = self.embed(idx)
            for b in self.blocks:
                x = b(x)
            return self.head(x)

    class Module(LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.net = None

        def configure_model(self) -> None:
            if self.net is None:
                torch.manual_seed(0)
                self.net = Net()

        def training_step(self, batch, batch_idx):
            (ids,) = batch
            logits = self.net(ids[:, :-1])
            return nn.functional.cross_entropy(logits.reshape(-1, vocab), ids[:, 1:].reshape(-1))

        def configure_optimizers(self):
            return torch.optim.AdamW(self.parameters(), lr=1e-4, **({"fused": True} if fused else {}))

        def train_dataloader(self):
            g = torch.Generator().manual_seed(0)
            return DataLoader(TensorDataset(torch.randint(0, vocab, (batch * n_batches, seq + 1), generator=g)),
                              batch_size=batch)

    return Module()


def _e2e_strategy_kwargs(cell: str, d: Path, args: argparse.Namespace) -> dict:
    nvme = {"device": "nvme", "nvme_path": str(d), "buffer_count": args.buffer_count,
            "buffer_bytes": args.buffer_mib * MiB}
    return {
        "none": {}, "none_fused": {},
        "opt_cpu": {"offload_optimizer": "cpu"},
        "opt_nvme": {"offload_optimizer": nvme},
        "opt_cpu_param_cpu": {"offload_optimizer": "cpu", "offload_param": "cpu"},
        "opt_nvme_param_nvme": {"offload_optimizer": nvme, "offload_param": {"device": "nvme", "nvme_path": str(d)}},
        "param_nvme": {"offload_param": {"device": "nvme", "nvme_path": str(d)}},
        # No budget, no memory plan: the gradient shards go to NVMe too.
        "param_nvme_grads_nvme": {"offload_param": {"device": "nvme", "nvme_path": str(d)},
                                  "host_memory_budget_bytes": None},
    }[cell]


def run_e2e_cell(cell: str, args: argparse.Namespace, d: Path) -> dict:
    """One training run; returns rank 0's timings (other ranks return {})."""
    import logging
    import resource

    from lightning.pytorch import Callback, Trainer, seed_everything

    from zeropp_strategy import ZeroPPStrategy
    from zeropp_strategy.offload import OffloadOptimizer

    class Timer(Callback):
        def __init__(self) -> None:
            self.before_opt: list[float] = []
            self.batch_end: list[float] = []
            self.usage: list = []  # this rank's rusage at each batch end (all its threads)

        def on_before_optimizer_step(self, trainer, pl_module, optimizer) -> None:
            self.before_opt.append(time.perf_counter())

        def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
            self.batch_end.append(time.perf_counter())
            self.usage.append(resource.getrusage(resource.RUSAGE_SELF))

    for name in ("lightning.pytorch", "lightning.fabric", "lightning_fabric", "pytorch_lightning", "zeropp_strategy"):
        logging.getLogger(name).setLevel(logging.WARNING)
    stage = args.stage
    if "param" in cell and stage != 3:
        stage = 3  # parameter offload needs stage 3
    seed_everything(0, verbose=False)
    n_steps = args.e2e_warmup + args.e2e_steps + 1
    module = _e2e_module(args.e2e_width, args.e2e_depth, args.e2e_vocab, args.e2e_seq, args.e2e_batch,
                         n_steps * args.devices, fused=cell == "none_fused")
    timer = Timer()
    trainer = Trainer(
        strategy=ZeroPPStrategy(stage=stage, **_e2e_strategy_kwargs(cell, d, args)), accelerator="cpu",
        devices=args.devices, max_steps=n_steps, logger=False, enable_checkpointing=False,
        enable_progress_bar=False, enable_model_summary=False, num_sanity_val_steps=0, limit_val_batches=0,
        callbacks=[timer],
    )
    trainer.fit(module)
    stats = trainer.strategy.memory_stats()
    stores = trainer.strategy.engine.param_stores
    # offload_param="nvme": the store's I/O figures (a ParamStore before write-behind has none)
    param_io = stores[0].io_stats() if stores and hasattr(stores[0], "io_stats") else None
    numel = sum(p.numel() for p in module.parameters())  # a DTensor's numel is the full parameter's
    for opt in trainer.optimizers:  # free swap files and buffers now (the strategy keeps them after fit)
        inner = getattr(opt, "optimizer", None)
        for o in (opt, inner):
            if isinstance(o, OffloadOptimizer):
                o.close()
    if trainer.global_rank != 0:
        return {}
    ends, befores = timer.batch_end, timer.before_opt
    intervals = [b - a for a, b in zip(ends, ends[1:])][args.e2e_warmup :]
    opt_times = [e - b for b, e in zip(befores, ends)][args.e2e_warmup + 1 :]
    first, last = timer.usage[args.e2e_warmup], timer.usage[-1]
    per_step = {k: (getattr(last, f) - getattr(first, f)) / max(1, len(intervals)) for k, f in (
        ("cpu_user_s", "ru_utime"), ("cpu_sys_s", "ru_stime"), ("minor_faults", "ru_minflt"),
        ("major_faults", "ru_majflt"), ("blocks_in", "ru_inblock"), ("blocks_out", "ru_oublock"))}
    return {"cell": cell, "stage": stage, "devices": args.devices, "numel": numel, "steps_timed": len(intervals),
            "rusage_per_step_rank0": per_step,
            "step_s": statistics.median(intervals), "step_times_s": intervals,
            "optimizer_s": statistics.median(opt_times) if opt_times else None,
            "offloaded_cpu_bytes": stats.offloaded_cpu_bytes, "offloaded_nvme_bytes": stats.offloaded_nvme_bytes,
            "peak_rss_bytes": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024,
            "torch_threads": torch.get_num_threads(), "param_io": param_io, "steps_total": n_steps,
            "zeropp_strategy": str(Path(sys.modules["zeropp_strategy"].__file__).parent)}


def _cell_argv(args: argparse.Namespace, cell: str, d: Path, out: Path) -> list[str]:
    keep = ["--stage", "--devices", "--e2e-width", "--e2e-depth", "--e2e-vocab", "--e2e-seq", "--e2e-batch",
            "--e2e-warmup", "--e2e-steps", "--buffer-count", "--buffer-mib"]
    argv = [sys.executable, str(OFFLOAD), "--e2e-cell", cell, "--cell-out", str(out), "--dir", str(d)]
    for flag in keep:
        argv += [flag, str(getattr(args, flag[2:].replace("-", "_")))]
    return argv


def _run_cell(cell: str, args: argparse.Namespace, d: Path, in_process: bool) -> dict:
    """One e2e cell, in this process or in its own; an error is reported, not raised."""
    t0, load = time.perf_counter(), os.getloadavg()[0]
    if in_process:
        try:
            res = run_e2e_cell(cell, args, d)
        except Exception as e:  # noqa: BLE001 (report the cell, go on with the others)
            res = {"cell": cell, "error": f"{type(e).__name__}: {e}"}
    else:
        with tempfile.TemporaryDirectory(dir=d) as tmp:
            out = Path(tmp) / "cell.json"
            try:
                r = subprocess.run(_cell_argv(args, cell, d, out), capture_output=True, text=True,
                                   timeout=args.cell_timeout)
                if r.returncode == 0 and out.exists():
                    res = json.loads(out.read_text())
                else:
                    res = {"cell": cell, "error": f"exit {r.returncode}: {r.stderr[-2000:]}"}
            except subprocess.TimeoutExpired:
                res = {"cell": cell, "error": f"timed out after {args.cell_timeout} s"}
    res["wall_s"], res["loadavg_1min_before"] = time.perf_counter() - t0, load
    print(f"e2e {cell}: " + (f"{res['step_s'] * 1e3:.1f} ms/step" if "step_s" in res
                             else res["error"].splitlines()[-1] if res["error"] else "error"),
          file=sys.stderr, flush=True)
    return res


def part_e2e(args: argparse.Namespace, d: Path) -> dict:
    in_process = args.quick and args.devices == 1
    cells = {cell: _run_cell(cell, args, d, in_process) for cell in E2E_CELLS}
    base = cells.get("none", {}).get("step_s")
    for c in cells.values():
        if "step_s" in c and base:
            c["overhead_vs_none"] = c["step_s"] / base - 1
    return {"part": "e2e", "stage": args.stage, "devices": args.devices, "in_process": in_process,
            "model": {"width": args.e2e_width, "depth": args.e2e_depth, "vocab": args.e2e_vocab, "seq": args.e2e_seq,
                      "batch_per_rank": args.e2e_batch},
            "warmup": args.e2e_warmup, "steps": args.e2e_steps, "cells": cells}


E2E_LABELS = {
    "none": "no offload (AdamW default: for-loop)",
    "none_fused": "no offload, AdamW(fused=True)",
    "opt_cpu": "offload_optimizer=cpu",
    "opt_nvme": "offload_optimizer=nvme",
    "opt_cpu_param_cpu": "offload_optimizer=cpu + offload_param=cpu",
    "opt_nvme_param_nvme": "offload_optimizer=nvme + offload_param=nvme",
    "param_nvme": "offload_param=nvme (the user's AdamW steps the mapped shards; gradients in memory, "
                  "the plan's choice)",
    "param_nvme_grads_nvme": "offload_param=nvme, gradients on NVMe too (host_memory_budget_bytes=None)",
}


def print_e2e(res: dict) -> None:
    numel = next((c["numel"] for c in res["cells"].values() if "numel" in c), 0)
    m = res["model"]
    print(f"\n## e2e: Lightning on CPU, {res['devices']} rank(s), stage {res['stage']}, {numel:,} params "
          f"(width {m['width']}, depth {m['depth']}, vocab {m['vocab']}, seq {m['seq']}, batch {m['batch_per_rank']}"
          f"/rank), median of {res['steps']} steps after {res['warmup']}\n")
    rows = []
    for name, c in res["cells"].items():
        if "step_s" not in c:
            rows.append([E2E_LABELS[name], "error", "-", "-", "-", "-"])
            continue
        ov = c.get("overhead_vs_none")
        rows.append([E2E_LABELS[name], f"{c['step_s'] * 1e3:.1f}",
                     "-" if c["optimizer_s"] is None else f"{c['optimizer_s'] * 1e3:.1f}",
                     "-" if ov is None else f"{100 * ov:+.1f}%", f"{c['offloaded_cpu_bytes'] / MiB:.1f} / "
                     f"{c['offloaded_nvme_bytes'] / MiB:.1f}", f"{c['peak_rss_bytes'] / MiB:.0f}"])
    print(_md(["setting", "step ms", "optimizer step ms", "vs none", "offloaded MiB (RAM / NVMe)",
               "peak RSS MiB (rank 0)"], rows))
    if res["in_process"]:
        print("\n(--quick: cells ran in one process; peak RSS is that process's, cumulative.)")


# -- param: NVMe parameters against no offload ---------------------------------------------------

PARAM_CELLS = ("none", "param_nvme", "opt_nvme_param_nvme", "param_nvme_grads_nvme")
PARAM_TARGET = 1.3  # step time with offload_param="nvme" / without offload (issue 18, item 6)


def _cpu_s(cell: dict) -> float:
    u = cell["rusage_per_step_rank0"]
    return u["cpu_user_s"] + u["cpu_sys_s"]


def part_param(args: argparse.Namespace, d: Path) -> dict:
    """The e2e cells of ``PARAM_CELLS``, ``--rounds`` times, interleaved (none, nvme, ...,
    none, nvme, ...) so that a slow spell of a shared machine hits both sides of a ratio."""
    in_process = args.quick and args.devices == 1
    rounds = [{cell: _run_cell(cell, args, d, in_process) for cell in PARAM_CELLS} for _ in range(args.rounds)]
    summary = {}
    for cell in PARAM_CELLS[1:]:
        pairs = [(r[cell], r["none"]) for r in rounds if "step_s" in r[cell] and "step_s" in r["none"]]
        ratios = [a["step_s"] / b["step_s"] for a, b in pairs]
        cpu = [_cpu_s(a) / _cpu_s(b) for a, b in pairs]
        summary[cell] = {"step_ratios": ratios, "cpu_ratios_rank0": cpu,
                         "min": min(ratios, default=None), "median": statistics.median(ratios) if ratios else None,
                         "max": max(ratios, default=None), "target": PARAM_TARGET}
    return {"part": "param", "stage": 3, "devices": args.devices, "in_process": in_process, "precision": "32-true",
            "model": {"width": args.e2e_width, "depth": args.e2e_depth, "vocab": args.e2e_vocab, "seq": args.e2e_seq,
                      "batch_per_rank": args.e2e_batch},
            "warmup": args.e2e_warmup, "steps": args.e2e_steps, "rounds": rounds, "summary": summary}


def print_param(res: dict) -> None:
    m = res["model"]
    print(f"\n## param: offload_param=nvme vs none, Lightning on CPU, {res['devices']} rank(s), stage 3, fp32 "
          f"(width {m['width']}, depth {m['depth']}), {len(res['rounds'])} interleaved rounds, median of "
          f"{res['steps']} steps each\n")
    rows = []
    for i, r in enumerate(res["rounds"]):
        base = r["none"]
        for cell in PARAM_CELLS:
            c = r[cell]
            if "step_s" not in c:
                rows.append([str(i), E2E_LABELS[cell], "error", "-", "-", "-", "-", "-"])
                continue
            ok = "step_s" in base
            io = c.get("param_io") or {}
            gathers = max(1, io.get("gathers", 0))
            rows.append([str(i), E2E_LABELS[cell], f"{c['step_s'] * 1e3:.1f}", f"{c['optimizer_s'] * 1e3:.1f}",
                         f"{c['step_s'] / base['step_s']:.2f}x" if ok else "-",
                         f"{_cpu_s(c) / _cpu_s(base):.2f}x" if ok else "-",
                         f"{io['gather_major_faults'] / gathers:.2f}" if io else "-",
                         f"{io['write_wait_s'] * 1e3 / c['steps_total']:.1f}" if io else "-"])
    print(_md(["round", "setting", "step ms", "optimizer ms", "step / none", "CPU s / none (rank 0)",
               "copy-in major faults per gather", "write-behind wait ms/step"], rows))
    for cell, sm in res["summary"].items():
        if sm["median"] is None:
            print(f"\n{E2E_LABELS[cell]}: no complete round")
            continue
        verdict = "ok" if sm["max"] <= sm["target"] else ("median ok" if sm["median"] <= sm["target"] else "ABOVE")
        print(f"\n{E2E_LABELS[cell]}: step time {sm['min']:.2f}x to {sm['max']:.2f}x of no offload (median "
              f"{sm['median']:.2f}x; target <= {sm['target']}x: {verdict})")


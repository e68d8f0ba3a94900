"""ZeRO-Infinity on one machine: the largest Llama that trains with its model states on NVMe.

    sudo python benchmarks/infinity.py --nvme /var/tmp/zeropp-nvme              # default sizes
    python benchmarks/infinity.py --nvme DIR --sizes 0.1B --steps 2          # a quick look
    python benchmarks/infinity.py --plot-only                                # redraw the plot
    sudo python benchmarks/infinity.py --nvme DIR --checkpoint --sizes 2.1B  # sharded save + resume

Each size is one 2-rank CPU job (Lightning, ``ZeroPPStrategy(stage=3)`` with
``offload_param`` and ``offload_optimizer`` on NVMe under ``--nvme``, the memory plan's
``host_memory_budget_bytes=--budget``), a ``LlamaForCausalLM`` built (by the strategy, on the meta device) in
``configure_model`` (fp32 weights, ``precision="32-true"``: this CPU has no bf16 matrix
units, a bf16 matmul is about 60x slower than fp32 here, see ``matmul_ms`` in the JSON), AdamW,
micro-batch 1 x 64 tokens, the same batch every step (so the loss must fall), ``--steps``
steps. Sizes go up until the plan refuses one at start; every refused size is recorded with
the plan's message.

Per rank and step: wall time, the loss; per rank over the run: peak RSS sampled every 20 ms
(``VmRSS``, and its anonymous and file-mapped parts, ``RssAnon``/``RssFile``) and the
kernel's high-water mark ``VmHWM``, against the budget. Per step, the bytes the drive of
``--nvme`` read and wrote (``/proc/diskstats``, both ranks and everything else on that
drive) against the plan's prediction (``MemoryPlan.disk_traffic_per_step`` x 2 ranks), and
the drive's sequential bandwidth from ``fio`` (``benchmarks/offload.py``'s measurement).

Writes ``benchmarks/results/infinity.json`` and ``docs/img/infinity.png``; prints the table for
docs/offload.md.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

sys.path.insert(0, str(ROOT / "benchmarks"))
from llama import SIZES, llama_config, llama_params  # noqa: E402 - the shapes: benchmarks/llama.py
from rss import PeakRSS, status  # noqa: E402 - the RSS sampler: benchmarks/rss.py

VOCAB, SEQ = 32000, 64
RESULTS = ROOT / "benchmarks" / "results" / "infinity.json"
CHECKPOINT_RESULTS = ROOT / "benchmarks" / "results" / "infinity_checkpoint.json"
PLOT = ROOT / "docs" / "img" / "infinity.png"


# -- one job ------------------------------------------------------------------------------


def _disk_sectors(path: str) -> tuple[int, int]:
    """Sectors read and written so far by the drive holding ``path`` (/proc/diskstats)."""
    dev = os.stat(path).st_dev
    major, minor = os.major(dev), os.minor(dev)
    with open("/proc/diskstats", encoding="ascii") as f:
        rows = [line.split() for line in f]
    for r in rows:
        if int(r[0]) == major and int(r[1]) == minor:
            return int(r[5]), int(r[9])
    # a partition's numbers may be missing on virtual disks: the whole disk then
    for r in rows:
        if int(r[0]) == major:
            return int(r[5]), int(r[9])
    return 0, 0


def run_cell(args: argparse.Namespace) -> None:
    import torch
    from lightning.pytorch import Callback, LightningModule, Trainer
    from torch.utils.data import DataLoader, TensorDataset
    from transformers import LlamaForCausalLM

    from zeropp_strategy import ZeroPPStrategy

    torch.set_num_threads(1)  # two ranks on two cores
    peak = PeakRSS()
    peak.start()

    class Llama(LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.model = None

        def configure_model(self) -> None:
            if self.model is None:  # as README tells users: the strategy builds it on the meta device
                self.model = LlamaForCausalLM(llama_config(args.cell, SEQ))

        def training_step(self, batch, batch_idx):
            (ids,) = batch
            return self.model(input_ids=ids, labels=ids).loss

        def on_load_checkpoint(self, checkpoint):  # noqa: ANN001 - before the tensors are read
            record.mark("load")

        def configure_optimizers(self):
            return torch.optim.AdamW(self.parameters(), lr=args.lr)

        def train_dataloader(self):
            ids = torch.randint(0, VOCAB, (1, SEQ), generator=torch.Generator().manual_seed(0))
            return DataLoader(TensorDataset(ids.repeat(args.steps, 1)), batch_size=1)

    class Record(Callback):
        """Per step: time, loss, drive bytes; per phase (setup, load, train, save): time and drive bytes."""

        def __init__(self) -> None:
            self.steps: list[dict] = []
            self.phases: dict[str, dict] = {}
            self.t0 = 0.0
            self.disk0 = (0, 0)
            self._phase = ("setup", time.perf_counter(), _disk_sectors(args.nvme))
            self._start_anon = status().get("RssAnon", 0)

        def mark(self, phase: str) -> None:
            """End the current phase (its time and drive bytes) and start ``phase``."""
            name, t0, (r0, w0) = self._phase
            r, w = _disk_sectors(args.nvme)
            entry = self.phases.setdefault(name, {"s": 0.0, "disk_read_bytes": 0, "disk_write_bytes": 0,
                                                  "start_anon": self._start_anon})
            entry["s"] += time.perf_counter() - t0
            entry["disk_read_bytes"] += (r - r0) * 512
            entry["disk_write_bytes"] += (w - w0) * 512
            self._phase = (phase, time.perf_counter(), (r, w))
            self._start_anon = status().get("RssAnon", 0)
            peak.phase = phase

        def on_train_start(self, trainer, pl_module):  # noqa: ANN001
            self.mark("train")

        def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):  # noqa: ANN001
            self.t0, self.disk0 = time.perf_counter(), _disk_sectors(args.nvme)

        def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):  # noqa: ANN001
            r, w = _disk_sectors(args.nvme)
            self.steps.append({"step": trainer.global_step, "step_s": time.perf_counter() - self.t0,
                               "loss": float(outputs["loss"]), "disk_read_bytes": (r - self.disk0[0]) * 512,
                               "disk_write_bytes": (w - self.disk0[1]) * 512})
            if args.save_after and trainer.global_step == args.save_after:
                self.mark("save")
                trainer.save_checkpoint(args.ckpt)  # a sharded directory (stage 3's default)
                self.mark("train")

        def on_train_end(self, trainer, pl_module):  # noqa: ANN001
            self.mark("end")

    nvme = {"device": "nvme", "nvme_path": args.nvme}
    budget = args.budget if args.budget == "auto" else int(float(args.budget) * 2**30)
    strategy = ZeroPPStrategy(stage=3, offload_param=nvme, offload_optimizer=nvme, host_memory_budget_bytes=budget,
                              wrap_modules=["LlamaDecoderLayer"], peer_timeout=600)
    record = Record()
    trainer = Trainer(accelerator="cpu", devices=2, precision="32-true", strategy=strategy, max_steps=args.steps,
                      callbacks=[record], logger=False, enable_checkpointing=False, enable_progress_bar=False,
                      enable_model_summary=False)
    t_setup = time.perf_counter()
    out: dict = {"rank": trainer.global_rank}
    try:
        trainer.fit(Llama(), ckpt_path=args.resume)
    except ValueError as e:
        if "cannot fit" not in str(e):
            raise
        out["refused"] = str(e)
    peak.stop.set()
    out["fit_s"] = time.perf_counter() - t_setup
    out["steps"] = record.steps
    out["peak"] = peak.peak
    out["phase_peaks"] = peak.phases
    out["phases"] = record.phases
    out["VmHWM"] = status()["VmHWM"]
    engine = getattr(getattr(strategy, "_session", None), "engine", None)
    plan = getattr(engine, "memory_plan", None)
    if plan is not None:
        read, write = plan.disk_traffic_per_step()
        out["plan"] = {"text": plan.describe(), "host_bytes": plan.host_bytes, "budget_bytes": plan.budget_bytes,
                       "disk_bytes": plan.disk_bytes(), "read_per_step": read, "write_per_step": write}
    Path(f"{args.out}.rank{out['rank']}").write_text(json.dumps(out, indent=1))


# -- the driver ---------------------------------------------------------------------------


def run_size(name: str, args: argparse.Namespace, *extra: str) -> dict:
    out = Path(args.nvme) / f"cell-{name}.json"
    cmd = [sys.executable, str(Path(__file__).resolve()), "--cell", name, "--nvme", args.nvme, "--steps",
           str(args.steps), "--budget", str(args.budget), "--lr", str(args.lr), "--out", str(out), *extra]
    t0 = time.perf_counter()
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=args.cell_timeout_s, cwd=ROOT)
    ranks = []
    for k in (0, 1):
        f = Path(f"{out}.rank{k}")
        if f.exists():
            ranks.append(json.loads(f.read_text()))
            f.unlink()
    hidden, layers, mlp = SIZES[name]
    cell = {"size": name, "hidden": hidden, "layers": layers, "mlp": mlp, "params": llama_params(name),
            "wall_s": time.perf_counter() - t0, "returncode": r.returncode, "ranks": ranks}
    if r.returncode != 0 or len(ranks) != 2:
        cell["error"] = r.stderr[-4000:]
    return cell


def summarize(res: dict) -> str:
    gb = 1e9
    ram = res["meta"]["hardware"].get("ram_bytes") or 0
    lines = ["| model | parameters | fp32 model states (16 B/param) | x memory | result | step s (median) | "
             "loss first -> last | peak RSS rank 0 / 1 (GiB) | anon / file (GiB, max) | budget (GiB) | "
             "disk read+write per step: measured / plan (GB) |", "|---|---:|---:|---:|---|---:|---|---|---|---:|---|"]
    for c in res["cells"]:
        states = 16 * c["params"]
        head = f"| {c['size']} ({c['hidden']} x {c['layers']}, MLP {c['mlp']}) | {c['params'] / 1e9:.2f}B | " \
               f"{states / gb:.1f} GB | {states / ram:.2f}x |" if ram else ""
        ranks = c.get("ranks") or []
        refused = next((r["refused"] for r in ranks if "refused" in r), None)
        if refused:
            first = refused.splitlines()[1].strip() if len(refused.splitlines()) > 1 else refused
            lines.append(f"{head} refused at start: {first[:160]} | | | | | | |")
            continue
        if "error" in c or not ranks or not ranks[0]["steps"]:
            lines.append(f"{head} failed (return code {c['returncode']}) | | | | | | |")
            continue
        steps = ranks[0]["steps"]
        times = [s["step_s"] for s in steps]
        plan = ranks[0].get("plan") or {}
        disk = [s["disk_read_bytes"] + s["disk_write_bytes"] for s in steps[1:]] or [0]
        predicted = 2 * (plan.get("read_per_step", 0) + plan.get("write_per_step", 0))
        lines.append(
            f"{head} trained {len(steps)} steps | {statistics.median(times):.1f} | {steps[0]['loss']:.3f} -> "
            f"{steps[-1]['loss']:.3f} | {ranks[0]['peak']['VmRSS'] / 2**30:.2f} / {ranks[1]['peak']['VmRSS'] / 2**30:.2f}"
            f" | {max(r['peak']['RssAnon'] for r in ranks) / 2**30:.2f} / {max(r['peak']['RssFile'] for r in ranks) / 2**30:.2f}"
            f" | {plan.get('budget_bytes', 0) / 2**30:.2f} | {statistics.median(disk) / gb:.1f} / {predicted / gb:.1f} |")
    fio = res["meta"].get("fio") or {}
    bw = [f"{k}: {v['Bps'] / gb:.2f} GB/s" for k, v in fio.items() if "Bps" in v]
    lines += ["", f"Drive (fio, sequential, 8 MiB requests): {', '.join(bw) or 'not measured'}."]
    return "\n".join(lines)


# -- checkpoints at this size --------------------------------------------------------------


def run_checkpoint(name: str, args: argparse.Namespace) -> dict:
    """Train ``--steps`` steps saving a sharded checkpoint after ``--save-after``; then a second
    job resumes from it and trains to ``--steps``. Its losses must equal the first job's, bit for bit."""
    import shutil

    ckpt = Path(args.nvme) / f"ckpt-{name}"
    shutil.rmtree(ckpt, ignore_errors=True)
    first = run_size(name, args, "--save-after", str(args.save_after), "--ckpt", str(ckpt))
    ckpt_bytes = sum(f.stat().st_size for f in ckpt.rglob("*") if f.is_file()) if ckpt.is_dir() else 0
    second = run_size(name, args, "--resume", str(ckpt)) if ckpt_bytes else {"error": "no checkpoint was written"}
    shutil.rmtree(ckpt, ignore_errors=True)
    cell = {"size": name, "params": first["params"], "checkpoint_bytes": ckpt_bytes, "train": first, "resume": second}
    if first.get("ranks") and second.get("ranks"):
        after = [s["loss"] for s in first["ranks"][0]["steps"] if s["step"] > args.save_after]
        resumed = [s["loss"] for s in second["ranks"][0]["steps"]]
        cell["losses_after_save"], cell["losses_resumed"] = after, resumed
        cell["exact"] = bool(after) and after == resumed
    return cell


def summarize_checkpoint(res: dict) -> str:
    gb = 1e9
    lines = ["| model | checkpoint | phase | time s | drive read / written (GB) | peak anon / file-mapped per rank, max (GiB) "
             "| budget (GiB) |", "|---|---:|---|---:|---|---|---:|"]
    for c in res["cells"]:
        for job, phase in (("train", "train"), ("train", "save"), ("resume", "setup"), ("resume", "load"),
                           ("resume", "train")):
            ranks = (c.get(job) or {}).get("ranks") or []
            if not ranks or phase not in ranks[0].get("phases", {}):
                continue
            p = ranks[0]["phases"][phase]
            anon = max(r["phase_peaks"].get(phase, {}).get("RssAnon", 0) for r in ranks) / 2**30
            file = max(r["phase_peaks"].get(phase, {}).get("RssFile", 0) for r in ranks) / 2**30
            budget = (ranks[0].get("plan") or {}).get("budget_bytes", 0) / 2**30
            label = {"train": "training", "save": "sharded save", "setup": "set-up (streaming init)",
                     "load": "sharded resume (model + optimizer)"}[phase] + (" (resumed job)" if job == "resume" and
                                                                              phase == "train" else "")
            lines.append(f"| {c['size']} ({c['params'] / 1e9:.2f}B) | {c['checkpoint_bytes'] / gb:.1f} GB | {label} | "
                         f"{p['s']:.0f} | {p['disk_read_bytes'] / gb:.1f} / {p['disk_write_bytes'] / gb:.1f} | "
                         f"{anon:.2f} / {file:.2f} | {budget:.2f} |")
        if "exact" in c:
            lines += ["", f"{c['size']}: losses after step {res['meta']['save_after']}: uninterrupted "
                          f"{c['losses_after_save']}, resumed {c['losses_resumed']}: "
                          f"{'equal, bit for bit' if c['exact'] else 'DIFFERENT'}."]
        for job in ("train", "resume"):
            if (c.get(job) or {}).get("error"):
                lines += ["", f"{c['size']} {job} job failed: {c[job]['error'][-800:]}"]
    return "\n".join(lines)


def plot(res: dict) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    cells = [c for c in res["cells"] if c.get("ranks") and all(r.get("steps") for r in c["ranks"])]
    if not cells:
        return
    fig, ax = plt.subplots(figsize=(7, 4))
    xs = range(len(cells))
    for k, (key, label) in enumerate((("VmRSS", "peak RSS"), ("RssAnon", "peak anonymous"), ("RssFile", "peak file-mapped"))):
        ax.bar([x + (k - 1) * 0.25 for x in xs], [max(r["peak"][key] for r in c["ranks"]) / 2**30 for c in cells],
               width=0.25, label=label)
    budget = max(c["ranks"][0].get("plan", {}).get("budget_bytes", 0) for c in cells) / 2**30
    ax.axhline(budget, color="k", linestyle="--", label=f"budget per rank ({budget:.1f} GiB)")
    ax.set_xticks(list(xs), [f"{c['params'] / 1e9:.1f}B\n({16 * c['params'] / 1e9:.0f} GB states)" for c in cells])
    ax.set_ylabel("GiB per rank (max of 2 ranks)")
    ax.set_title("Host memory per rank, model states on NVMe (2 ranks, 2 cores)")
    ax.legend(fontsize=8)
    fig.tight_layout()
    PLOT.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(PLOT, dpi=110)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--nvme", default=None, help="directory on the drive for the swap files")
    ap.add_argument("--sizes", default="1.3B,4.3B,6.7B", help=f"comma-separated, of {', '.join(SIZES)}")
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--budget", default="auto", help="'auto' or GiB per rank")
    ap.add_argument("--lr", type=float, default=3e-4)
    ap.add_argument("--cell-timeout-s", type=int, default=3600)
    ap.add_argument("--out", default=str(RESULTS))
    ap.add_argument("--cell", default=None, help=argparse.SUPPRESS)  # one job (internal)
    ap.add_argument("--plot-only", action="store_true")
    ap.add_argument("--checkpoint", action="store_true",
                    help="save a sharded checkpoint after --save-after steps, resume it in a new job, compare losses")
    ap.add_argument("--save-after", type=int, default=0)
    ap.add_argument("--ckpt", default=None, help=argparse.SUPPRESS)  # one job (internal): where to save
    ap.add_argument("--resume", default=None, help=argparse.SUPPRESS)  # one job (internal): what to resume
    args = ap.parse_args()
    if args.cell:
        run_cell(args)
        return
    if args.checkpoint:
        args.save_after = args.save_after or 1
        if args.out == str(RESULTS):
            args.out = str(CHECKPOINT_RESULTS)
    if args.plot_only:
        res = json.loads(Path(args.out).read_text())
        if args.checkpoint:
            print(summarize_checkpoint(res))
            return
        plot(res)
        print(summarize(res))
        return
    if args.nvme is None:
        ap.error("--nvme DIR is required (a directory on the drive to measure)")
    Path(args.nvme).mkdir(parents=True, exist_ok=True)
    from benchmarks.volume import _matmul_ms
    from offload_common import hardware  # benchmarks/offload.py's parts: siblings, like llama and rss above
    from offload_swap import fio_bandwidth

    res = {"meta": {"command": " ".join(["python", "benchmarks/infinity.py", *sys.argv[1:]]),
                    "date": time.strftime("%Y-%m-%d"), "hardware": hardware(None), "matmul_ms": _matmul_ms(),
                    "fio": fio_bandwidth(Path(args.nvme), 2048, drop=os.geteuid() == 0)},
           "cells": []}
    if args.checkpoint:
        res["meta"]["save_after"] = args.save_after
        for name in args.sizes.split(","):
            print(f"{name}: train, save after step {args.save_after}, resume", flush=True)
            res["cells"].append(run_checkpoint(name, args))
            Path(args.out).write_text(json.dumps(res, indent=1))
            print(summarize_checkpoint(res), flush=True)
        return
    for name in args.sizes.split(","):
        print(f"{name}: running", flush=True)
        cell = run_size(name, args)
        res["cells"].append(cell)
        Path(args.out).write_text(json.dumps(res, indent=1))
        print(summarize(res), flush=True)
        if any("refused" in r for r in cell.get("ranks") or []) or "error" in cell:
            break  # the next size is larger still
    plot(res)


if __name__ == "__main__":
    main()

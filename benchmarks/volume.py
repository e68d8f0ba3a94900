"""Issue 18's side-by-side run: communication volume and step time as users train (bf16-mixed).

    sudo python benchmarks/volume.py                          # 3 runs per cell, about 35 min
    sudo python benchmarks/volume.py --repeat 1 --out /tmp/v.json --docs /tmp/v.md   # a quick look
    sudo python benchmarks/volume.py --package-root ../before  # the same cells on another checkout
    sudo python benchmarks/volume.py --part stage1 --precision 32-true  # stage 1 with and without overlap_param_gather
    sudo python benchmarks/volume.py --part sizes              # two model sizes at 1 Gbit/s
    python benchmarks/volume.py --render-only

``--part stage1`` (results/volume_stage1_async.json): ``ddp`` and ``zeropp_stage_1`` at
200 Mbit/s, and ``zeropp_stage_1`` from ``--before-root`` (a folder holding another
``zeropp_strategy`` package: the code before a change). ``--part sizes``
(results/volume_sizes_1gbit.json): ``ddp``, ``zeropp_stage_3``, ``zeropp`` and DeepSpeed
ZeRO-3 (when ``deepspeed`` imports) at 1 Gbit/s for GPT-2 ``small`` (4 x 256, 3.3M
parameters) and ``medium`` (8 x 512, 25.5M). Both parts run their cells in rounds (every
cell once, ``--repeat`` times) so that a busy spell of a shared machine falls on every
cell alike, and record the load average at the start of each run. A part's system written
``name~RATE`` runs at RATE instead of the part's rate, in the same rounds (``--part
delta_200mbit``: DDP with no link limit beside three systems at 200 Mbit/s), ``name*B`` with a
micro-batch of B sequences per rank instead of ``--batch`` (the JSON's ``meta["batch"]`` is
``--batch``), ``name#N`` with stage 1's post-step gather in about N buckets and
``name@before`` from the ``--before-root`` package; written together, in the order
``name#N*B@before~RATE`` (``volume_cells.parse_cell``). The other parts
(``4bit_*``, ``delta_*``, ``grad_int8``, ``loco``: issue 35's levels beside ``zeropp``) are listed with
their results files in benchmarks/volume_cells.py; docs/zeropp_measurements.md holds their tables.

Every cell is one ``benchmarks/bench_train.py`` job on the simulated 2-node x 2-rank cluster
(``benchmarks/simcluster.py``: two network namespaces, a veth shaped with ``tc tbf``),
GPT-2 4 x 256, micro-batch 4 x 128 per rank, AdamW, ``precision="bf16-mixed"``:

    200mbit     ddp, zeropp_stage_1/2/3, zeropp_stage_3_bf16, zeropp, deepspeed_zero3 (bf16)
    unlimited   zeropp_stage_3, zeropp

and the page (``--docs``) holds, as ratios from one run of the suite: cross-node bytes per step
on the veth of each stage against ``ddp`` and against the formula of docs/stages.md; step
times of ``zeropp_stage_3_bf16`` and ``zeropp`` against DeepSpeed ZeRO-3 at 200 Mbit/s;
``zeropp`` at 200 Mbit/s against its unlimited-bandwidth step; ``zeropp`` against
``zeropp_stage_3`` with unlimited bandwidth. Step times are medians over the steps after
the warm-up; with ``--repeat`` the median of the runs, and the range is printed beside it.
"""

from __future__ import annotations

import argparse
import datetime
import importlib.util
import json
import os
import platform
import statistics
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from benchmarks.run import run_cell  # noqa: E402
from benchmarks.volume_cells import (  # noqa: E402
    ARCHIVED_SUITES,
    CELLS,
    MB,
    PART_FILES,
    PARTS,
    parse_cell,
    SUITE_FILES,
    formula_bytes,
)
from benchmarks.volume_page import render  # noqa: E402

# What importers read here (tests/test_bench_report.py: formula_bytes and render from benchmarks/volume_*.py).
__all__ = ["formula_bytes", "gpt2_params", "main", "render", "run", "run_part"]


def run(args: argparse.Namespace) -> dict:
    """The suite's cells in rounds (every cell once per round, ``--repeat`` rounds)."""
    from benchmarks.simcluster import SimCluster

    runs: dict[str, list[dict]] = {f"{rate}/{system}": [] for rate, systems in CELLS.items() for system in systems}
    meta = {**_meta(args), "rates": list(CELLS)}  # times two matmuls: once per invocation
    if args.append and args.out.exists():  # more rounds on top of an earlier invocation's
        earlier = json.loads(args.out.read_text())
        for key, cell_runs in earlier.get("runs", {}).items():
            runs.setdefault(key, []).extend(cell_runs)
        meta = {**earlier["meta"], "appended": [*earlier["meta"].get("appended", []), meta]}
    results: dict = {}
    for round_ in range(args.repeat):
        for rate, systems in CELLS.items():
            if args.rates and rate not in args.rates:
                continue
            with SimCluster(rate=rate) as cluster:
                for system in systems:
                    key = f"{rate}/{system}"
                    load = os.getloadavg()[0]
                    cell = run_cell(cluster, system, args)
                    cell["load_avg_1min_at_start"] = load
                    runs[key].append(_run_record(cell))
                    print(f"round {round_ + 1}/{args.repeat} {key}: " + (
                          f"{cell['step_s']:.3f} s/step, {cell['veth_bytes_per_step'] / MB:.2f} MB/step (load "
                          f"{load:.1f})" if "step_s" in cell else f"FAILED {cell.get('error')}"), flush=True)
                    results = {"meta": meta, "cells": _summarize(runs, {}), "runs": runs}
                    args.out.parent.mkdir(parents=True, exist_ok=True)
                    args.out.write_text(json.dumps(results, indent=1))
    return results


def _meta(args: argparse.Namespace) -> dict:
    return {
        "command": _command(sys.argv[1:]),
        "date": datetime.date.today().isoformat(),
        "commit": _commit(),
        "hardware": f"{platform.machine()} VM, {os.cpu_count()} CPU cores, no GPU",
        "steps": args.steps, "warmup": args.warmup, "batch": args.batch, "precision": args.precision,
        "repeat": args.repeat, "bf16_matmul": args.bf16_matmul, "cpu_capability": _cpu_capability(),
        "matmul_ms": _matmul_ms(),
        # our systems' GPT-2, built on meta, has GPT-2's own init (engine/parent_init.py; runs
        # without this key predate it: their loss columns start from another init than DDP's)
        "meta_init_as_hf": True,
    }


def run_part(args: argparse.Namespace) -> dict:
    """One of PARTS, in rounds: every cell once per round, ``--repeat`` rounds."""
    from benchmarks.simcluster import SimCluster

    rate, sizes, systems = PARTS[args.part]
    has_ds = importlib.util.find_spec("deepspeed") is not None
    # "system~RATE" runs that system at RATE instead of the part's (its cells in a cluster of their own);
    # every name is parsed before the first cell runs
    cells = {f"{parse_cell(system).rate or rate}/{size}/{system.partition('~')[0]}": (size, system.partition("~")[0])
             for size in sizes for system in systems}
    runs: dict[str, list[dict]] = {key: [] for key in cells}
    out = args.out.parent / PART_FILES[args.part]
    if args.append and out.exists():  # more rounds on top of an earlier invocation's
        for key, earlier in json.loads(out.read_text()).get("runs", {}).items():
            runs.setdefault(key, []).extend(earlier)
    skipped = {key: "deepspeed is not installed (pip install -e '.[bench]')"
               for key, (_, system) in cells.items() if system.startswith("deepspeed") and not has_ds}
    meta = {**_meta(args), "rate": rate}
    out.parent.mkdir(parents=True, exist_ok=True)
    results: dict = {}
    rates = list(dict.fromkeys(key.split("/")[0] for key in cells if key not in skipped))
    if len(rates) == 1:  # one cluster for every round, as the single-rate parts always had
        with SimCluster(rate=rates[0]) as cluster:
            for round_ in range(args.repeat):
                results = _run_round(args, cluster, cells, rates[0], round_, runs, skipped, meta, out)
        return results
    for round_ in range(args.repeat):  # several rates: each round builds each rate's cluster in turn
        for cell_rate in rates:
            with SimCluster(rate=cell_rate) as cluster:
                results = _run_round(args, cluster, cells, cell_rate, round_, runs, skipped, meta, out)
    return results


def _run_round(args: argparse.Namespace, cluster: object, cells: dict, cell_rate: str, round_: int,
               runs: dict[str, list[dict]], skipped: dict[str, str], meta: dict, out: Path) -> dict:
    """One round of a part's cells at ``cell_rate``, on ``cluster``; the results file is
    rewritten after every run, so that a run cut short keeps what it measured."""
    results = {"meta": meta, "cells": _summarize(runs, skipped), "runs": runs}
    for key, (size, system) in cells.items():
        if key in skipped or not key.startswith(f"{cell_rate}/"):
            continue
        parsed = parse_cell(system)
        cell_args = argparse.Namespace(**{**vars(args), "size": size, "batch": parsed.batch or args.batch,
                                          "overlap_buckets": parsed.buckets})
        if parsed.before:
            cell_args.package_root = args.before_root
        load = os.getloadavg()[0]
        # how fast this machine runs a fixed piece of work right now (100 fp32 matmuls, about 0.2-0.4 s),
        # to set beside a cell's CPU seconds per step (docs/zeropp_measurements.md, "What the 2 cores allow")
        probe = _matmul_ms(calls=100, dtypes=("fp32",))
        cell = run_cell(cluster, parsed.name, cell_args)
        cell["load_avg_1min_at_start"], cell["matmul_ms_at_start"] = load, probe
        runs[key].append(_run_record(cell))
        print(f"round {round_ + 1}/{args.repeat} {key}: " + (f"{cell['step_s']:.3f} s/step (load {load:.1f})"
              if "step_s" in cell else f"FAILED {cell.get('error')}"), flush=True)
        results = {"meta": meta, "cells": _summarize(runs, skipped), "runs": runs}
        out.write_text(json.dumps(results, indent=1))
    return results


RUN_FIELDS = ("step_s", "step_s_all", "veth_bytes_per_step", "loss", "load_avg_1min_at_start",
              "matmul_ms_at_start", "cpu_s_per_step_per_rank", "cores", "error")


def _run_record(cell: dict) -> dict:
    """What a results JSON keeps of one run of a cell."""
    return {k: cell[k] for k in RUN_FIELDS if k in cell}


def cpu_bound_s(run: dict) -> float:
    """The shortest step the run's CPU work allows: every rank's CPU seconds per step, summed,
    over the cores they share (the simulated cluster's ranks all run on this machine)."""
    return sum(cpu for cpu, _, _ in run["cpu_s_per_step_per_rank"]) / run["cores"]


def _summarize(runs: dict[str, list[dict]], skipped: dict[str, str]) -> dict:
    """Per cell: the median of its runs' step times, their list, and what the runs had in common."""
    cells: dict = {}
    for key, cell_runs in runs.items():
        ok = [c for c in cell_runs if "step_s" in c]
        if key in skipped:
            cells[key] = {"skipped": skipped[key]}
        elif not ok:
            cells[key] = {"error": cell_runs[0].get("error") if cell_runs else "not run"}
        elif any(c.get("veth_bytes_per_step") is None for c in ok):
            # no veth counter (GLOO_SOCKET_IFNAME not a real interface): 0 bytes would pass every byte target
            cells[key] = {"error": "the run read no veth counters, so its cross-node bytes are unknown"}
        else:
            cells[key] = {
                "step_s": statistics.median(c["step_s"] for c in ok),
                "step_s_runs": [c["step_s"] for c in ok],
                "veth_bytes_per_step": statistics.median(c["veth_bytes_per_step"] for c in ok),
                "loss": ok[0]["loss"],
                "load_avg_1min_at_start": [c["load_avg_1min_at_start"] for c in ok],
                "failed_runs": len(cell_runs) - len(ok),
            }
            if all(c.get("cpu_s_per_step_per_rank") for c in ok):  # runs before delta_cpu's (2026-11-29) have none
                cells[key]["cpu_bound_s_runs"] = [cpu_bound_s(c) for c in ok]
    return cells


def _matmul_ms(calls: int = 10, dtypes: tuple[str, ...] = ("fp32", "bf16")) -> dict[str, float]:
    """One thread, (512 x 256) @ (256 x 1024), the size of a GPT-2 small MLP matmul: ms per call
    in each of ``dtypes`` (fp32, bf16), the mean of ``calls``. Without native bf16 (AVX-512 BF16,
    AMX) the bf16 one is emulated, and can take 100 times fp32's."""
    import time

    import torch

    torch.set_num_threads(1)
    out = {}
    for name, dtype in ((d, {"fp32": torch.float32, "bf16": torch.bfloat16}[d]) for d in dtypes):
        a, b = torch.randn(512, 256, dtype=dtype), torch.randn(256, 1024, dtype=dtype)
        a @ b
        start = time.perf_counter()
        for _ in range(calls):
            a @ b
        out[name] = (time.perf_counter() - start) / calls * 1e3
    return out


def _cpu_capability() -> str:
    import torch

    return torch.backends.cpu.get_cpu_capability()


def _command(argv: list[str]) -> str:
    """This run's command line, folders named by their role instead of this machine's paths."""
    shown = list(argv)
    for i, arg in enumerate(shown[:-1]):
        if arg in ("--before-root", "--package-root", "--out", "--docs"):
            shown[i + 1] = {"--before-root": "BEFORE", "--package-root": "AFTER"}.get(arg, "FILE")
    # --repeat / --append: the page names the rounds run in all (render_parts)
    kept = [a for i, a in enumerate(shown) if a != "--append" and a != "--repeat" and
            (i == 0 or shown[i - 1] != "--repeat")]
    return " ".join(["python", "benchmarks/volume.py", *kept])


def _commit() -> str:
    """HEAD, and whether the working tree differed from it when the part ran."""
    def git(*cmd: str) -> str:
        return subprocess.run(["git", *cmd], cwd=ROOT, capture_output=True, text=True).stdout.strip()

    head = git("rev-parse", "--short", "HEAD")
    return head + (" + uncommitted changes" if git("status", "--porcelain", "--untracked-files=no") else "")


def gpt2_params() -> int:
    from benchmarks.bench_train import gpt2

    return sum(p.numel() for p in gpt2("small").parameters())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--steps", type=int, default=16)
    parser.add_argument("--warmup", type=int, default=4)
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--package-root", type=Path, default=None, help="run this checkout's zeropp_strategy")
    parser.add_argument("--out", type=Path, default=None,
                        help="the suite's JSON; default results/volume_bf16_fp32mm.json (--bf16-matmul fp32) or "
                             "volume_bf16.json (native)")
    parser.add_argument("--docs", type=Path, default=ROOT / "docs" / "benchmarks_volume.md")
    parser.add_argument("--render-only", action="store_true")
    parser.add_argument("--part", choices=["suite", *PARTS], default="suite",
                        help="suite: issue 18's cells; stage1 / sizes: see the module docstring")
    parser.add_argument("--precision", choices=["bf16-mixed", "32-true"], default="bf16-mixed",
                        help="--part stage1 / sizes only (the suite is bf16-mixed): 32-true where the CPU has no "
                             "fast bf16 matmul (see docs/benchmarks_volume.md)")
    parser.add_argument("--bf16-matmul", choices=["native", "fp32"], default="fp32",
                        help="fp32 (default): bf16 matmuls computed in fp32 and rounded, a stand-in for bf16 "
                             "hardware on a CPU without it (benchmarks/bf16_matmul.py); native: torch's own kernel")
    parser.add_argument("--append", action="store_true",
                        help="add this invocation's rounds to the runs already in its JSON")
    parser.add_argument("--rates", nargs="+", choices=list(CELLS), default=None,
                        help="the suite: run only these rates' cells (with --append: more rounds of them)")
    parser.add_argument("--before-root", type=Path, default=None,
                        help="--part stage1 / loco_pieces: a folder holding the zeropp_strategy package to compare "
                             "against (its cells named @before)")
    args = parser.parse_args()
    args.size, args.nproc_per_node, args.cell_timeout_s = "small", 2, 900
    if args.part == "suite":
        args.precision = "bf16-mixed"
    results_dir = ROOT / "benchmarks" / "results"
    args.out = args.out or results_dir / SUITE_FILES[args.bf16_matmul]
    earlier_file = results_dir / SUITE_FILES["native"]
    if args.part != "suite" and not args.render_only:
        run_part(args)
    if args.part == "suite" and not args.render_only:
        newest = run(args)
    else:
        newest_file = results_dir / SUITE_FILES["fp32"]
        newest = json.loads(newest_file.read_text()) if newest_file.exists() else {}
    earlier = [json.loads((results_dir / name).read_text()) for name in ARCHIVED_SUITES
               if (results_dir / name).exists()]
    if earlier_file.exists() and args.out.resolve() != earlier_file.resolve():
        earlier.append(json.loads(earlier_file.read_text()))
    print(render(newest, args.docs, "python benchmarks/volume.py", gpt2_params(), earlier=earlier))

if __name__ == "__main__":
    main()

"""Filling fresh host memory with and without its pages mapped first
(``zeropp_strategy.primitives.prefault``, [Note: prefaulting host shards]).

    python benchmarks/prefault.py                     # 2 processes at once, 4.8 GB of fp32 each, 3 rounds

What a rank does when it fills its fp32 shards of a published model from bf16 files: each
of ``--procs`` processes (one thread each, all at once, as the ranks of a node) allocates
``--gb`` GB of fp32 and copies bf16 values into it in 8 slices, either straight into the
fresh memory (``faults``: one page fault per 4 KiB page on first write) or after
``prefault`` mapped its pages in one ``madvise(MADV_POPULATE_WRITE)``. The two ways
alternate for ``--rounds`` rounds; each line is one process: seconds from the allocation to
the last copy, and the process's system CPU time. Appends one run (with its date and the
load average at its start: the gain depends on what else the machine does) to
benchmarks/results/prefault.json.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
RESULTS = ROOT / "benchmarks" / "results" / "prefault.json"


def cell(mode: str, numel: int) -> dict:
    import torch

    from zeropp_strategy.primitives import prefault

    torch.set_num_threads(1)
    src = torch.randn(numel // 8).to(torch.bfloat16)
    before = os.times()
    t0 = time.perf_counter()
    dst = torch.empty(numel, dtype=torch.float32)
    mapped = prefault([dst]) if mode == "prefault" else 0
    t1 = time.perf_counter()
    for i in range(8):
        dst[i * (numel // 8):(i + 1) * (numel // 8)].copy_(src)
    t2 = time.perf_counter()
    after = os.times()
    if mode == "prefault" and not mapped:
        raise SystemExit("prefault mapped nothing: this kernel has no MADV_POPULATE_WRITE (Linux 5.14+)")
    return {"mode": mode, "map_s": t1 - t0, "total_s": t2 - t0, "sys_s": after.system - before.system}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--gb", type=float, default=4.8, help="GB of fp32 per process")
    p.add_argument("--procs", type=int, default=2)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--cell", help=argparse.SUPPRESS)
    args = p.parse_args()
    numel = int(args.gb * 1e9 / 4) // 8 * 8
    if args.cell:
        print(json.dumps(cell(args.cell, numel)))
        return
    rows, load = [], os.getloadavg()
    for r in range(args.rounds):
        for mode in ("faults", "prefault"):
            procs = [subprocess.Popen([sys.executable, __file__, "--cell", mode, "--gb", str(args.gb)],
                                      stdout=subprocess.PIPE, text=True) for _ in range(args.procs)]
            for proc in procs:
                out, _ = proc.communicate(timeout=600)
                if proc.returncode:
                    raise SystemExit(f"a {mode} process failed with exit code {proc.returncode}")
                row = {"round": r, **json.loads(out.strip().splitlines()[-1])}
                rows.append(row)
                print(f"round {r} {mode:8s} map {row['map_s']:.2f} s, total {row['total_s']:.2f} s, "
                      f"system {row['sys_s']:.2f} s", flush=True)
    for mode in ("faults", "prefault"):
        t = [row["total_s"] for row in rows if row["mode"] == mode]
        print(f"{mode:8s} {min(t):.2f}-{max(t):.2f} s per process ({args.procs} at once, {args.gb} GB fp32 each)")
    runs = json.loads(RESULTS.read_text())["runs"] if RESULTS.exists() else []
    runs.append({"date": time.strftime("%Y-%m-%d %H:%M"), "load_average_at_start": load, "gb_per_process": args.gb,
                 "procs": args.procs, "cpus": os.cpu_count(), "rows": rows})
    RESULTS.write_text(json.dumps({"runs": runs}, indent=1) + "\n")


if __name__ == "__main__":
    main()

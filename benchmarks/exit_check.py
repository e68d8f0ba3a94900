"""Consecutive whole jobs on the simulated 2x2 cluster: does any rank abort at exit?

    sudo python benchmarks/exit_check.py --runs 30                       # this checkout
    sudo python benchmarks/exit_check.py --runs 30 --package-root OLD     # another checkout's zeropp_strategy

Each run is one ``benchmarks/bench_train.py`` job (GPT-2 small, ``--steps`` steps,
bf16-mixed, ``--system`` default ``zeropp_stage_3``) started by ``benchmarks/simcluster.py``
on 2 namespaces x 2 ranks (one torchrun per node) with the cross-node link at ``--rate``.
A run counts as aborted when any node's torchrun exits non-zero or any rank printed
``terminate called`` (the C++ runtime's line when a process group's threads are torn down
during interpreter finalization: [Note: orderly exit] in engine/process_group.py). Prints
one line per run and writes every run's result to ``--out``; exits 1 if any run aborted.
Needs root (namespaces), like simcluster.py. The systems built on a preset (``zeropp``,
``zeropp_4bit``, ``zeropp_delta`` and those over them: bench_train.py's ``OURS``) are read
from the package under test (bench_train.py's ``ours_fields``): a checkout older
than ``zeropp_strategy/presets.py``, or without that preset, cannot run them.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from benchmarks.simcluster import SimCluster  # noqa: E402

ABORT = "terminate called"


def _commit(root: Path) -> str:
    """The checkout's commit (a path of this machine does not go into the results)."""
    import subprocess

    out = subprocess.run(["git", "-C", str(root), "rev-parse", "--short", "HEAD"], capture_output=True, text=True)
    return out.stdout.strip() or "unknown"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--runs", type=int, default=30)
    ap.add_argument("--system", default="zeropp_stage_3")
    ap.add_argument("--steps", type=int, default=8)
    ap.add_argument("--rate", default="200mbit")
    ap.add_argument("--package-root", type=Path, default=None,
                    help="import zeropp_strategy from this checkout instead (a 'before' run)")
    ap.add_argument("--out", type=Path, default=ROOT / "benchmarks" / "results" / "exit_check.json")
    ap.add_argument("--timeout-s", type=float, default=600)
    args = ap.parse_args(argv)
    if args.runs < 1:
        ap.error(f"--runs={args.runs} is invalid: run at least one job")
    package_root = (args.package_root or ROOT).resolve()
    runs = []
    start = time.monotonic()
    with SimCluster(rate=args.rate) as cluster, tempfile.TemporaryDirectory() as tmp:
        for i in range(1, args.runs + 1):
            cmd = [sys.executable, str(ROOT / "benchmarks" / "bench_train.py"), "--system", args.system,
                   "--steps", str(args.steps), "--warmup", "2", "--precision", "bf16-mixed",
                   "--out", str(Path(tmp) / f"run{i}.json")]
            res = cluster.run(cmd, nproc_per_node=2, timeout_s=args.timeout_s,
                              env={"PYTHONPATH": f"{package_root}:{ROOT}"}, echo=False)
            lines = [ln for out in res.outputs for ln in out.splitlines() if ABORT in ln]
            aborted = bool(lines) or not res.ok
            trained = (Path(tmp) / f"run{i}.json").exists()
            runs.append({"run": i, "returncodes": res.returncodes, "timed_out": res.timed_out, "aborted": aborted,
                         "abort_lines": lines[:4], "trained": trained, "wall_s": round(res.wall_s, 1)})
            print(f"run {i}/{args.runs}: {'ABORTED' if aborted else 'ok'} returncodes {res.returncodes}"
                  f"{' ' + lines[0] if lines else ''} ({res.wall_s:.0f} s)", flush=True)
    aborted = [r["run"] for r in runs if r["aborted"]]
    summary = {"system": args.system, "steps": args.steps, "rate": args.rate, "runs": len(runs),
               "aborted": len(aborted), "aborted_runs": aborted, "commit": _commit(package_root),
               "wall_s": round(time.monotonic() - start), "per_run": runs}
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(summary, indent=1) + "\n")
    print(f"{len(aborted)} of {len(runs)} runs aborted ({args.system}, {args.steps} steps, {args.rate}); "
          f"written {args.out}")
    return 1 if aborted else 0


if __name__ == "__main__":
    sys.exit(main())

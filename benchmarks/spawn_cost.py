"""What starting the test ranks costs: ``tests/_dist.run_ranks`` with its rank pool (the
suite's default), under "spawn" and under "forkserver", side by side in one run.

    python benchmarks/spawn_cost.py [--calls 5] [--json benchmarks/results/spawn_cost.json]

Each call starts 2 (then 4) ranks whose worker imports what the suite's workers import
(Lightning and this package) and returns. A "spawn" rank imports them afresh on every
call; a "forkserver" rank is forked from a server that imported them once, on the first
call (reported on its own); a "pool" rank is a process spawned at the first call and
reused by the others. Prints one line per method: the first call and the median and range
of the others, in seconds.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))


def _worker(rank: int, world_size: int) -> int:
    import lightning.pytorch  # noqa: F401 - what a suite worker imports
    import zeropp_strategy  # noqa: F401

    return rank


def _measure(method: str, calls: int) -> dict:
    os.environ["ZEROPP_TEST_START"] = method
    from tests._dist import run_ranks

    out = {}
    for world in (2, 4):
        times = []
        for _ in range(calls):
            t0 = time.perf_counter()
            assert run_ranks(_worker, world, timeout_s=120) == list(range(world))
            times.append(time.perf_counter() - t0)
        rest = times[1:] or times
        out[f"{world}_ranks"] = {"first_s": round(times[0], 3), "median_s": round(statistics.median(rest), 3),
                                 "min_s": round(min(rest), 3), "max_s": round(max(rest), 3)}
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--calls", type=int, default=5)
    ap.add_argument("--json", type=Path)
    args = ap.parse_args()
    import platform

    result = {"command": "python benchmarks/spawn_cost.py " + " ".join(sys.argv[1:]),
              "machine": f"{os.cpu_count()} cores, {platform.processor() or platform.machine()}",
              **{method: _measure(method, args.calls) for method in ("pool", "spawn", "forkserver")}}
    for method in ("pool", "spawn", "forkserver"):
        for world, r in result[method].items():
            print(f"{method:10s} {world}: first call {r['first_s']:.2f} s, then median {r['median_s']:.2f} s "
                  f"({r['min_s']:.2f}-{r['max_s']:.2f})")
    if args.json:
        args.json.write_text(json.dumps(result, indent=1) + "\n")


if __name__ == "__main__":
    main()

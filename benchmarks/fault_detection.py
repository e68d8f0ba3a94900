"""How long the surviving ranks take to stop after one rank dies or freezes, and whether
they name it: with the peer watchdog ([Note: peer watchdog]) and without it.

    python benchmarks/fault_detection.py                 # kill and stop, watchdog on and off
    python benchmarks/fault_detection.py --repeat 1 --cap 60 --out some/tmp/file.json

Each case starts ``--world`` gloo ranks on 127.0.0.1 running ``tests/_fault_worker.py``
(a small model, ``ZeroPPStrategy(stage=3)``, the launcher's environment as torchrun gives
it); at optimizer step 3 rank 1 gets SIGKILL ("kill": its process is gone) or SIGSTOP
("stop": alive but silent, as a hung process or a node that vanished without closing its
sockets). The figure is the time from that signal to the last surviving rank's exit, and
whether every survivor's output names rank 1. A survivor still running after ``--cap``
seconds counts as hung (gloo would wait for the process-group timeout, 30 minutes).

Writes ``--out`` (default ``benchmarks/results/fault_detection.json``) with the hardware
and the command line, and prints a markdown table.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import re
import socket
import statistics
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from tests._fault_worker import start_ranks, stop_ranks  # noqa: E402


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run_case(fault: str, peer_timeout: float, world: int, cap: float) -> dict:
    port = _free_port()
    with tempfile.TemporaryDirectory() as tmp:
        procs, logs = start_ranks(world, ["--fault", fault, "--victim", "1", "--peer-timeout", str(peer_timeout)],
                                  Path(tmp), port)
        survivors = [r for r in range(world) if r != 1]
        injected = None
        exits: dict[int, float] = {}
        try:
            deadline = time.time() + 300
            while time.time() < deadline:
                if injected is None:
                    logs[1].seek(0)
                    m = re.search(r"injecting \w+ on rank 1 at step \d+ \(t=([\d.]+)\)", logs[1].read())
                    injected = float(m.group(1)) if m else None
                for r in survivors:
                    if r not in exits and procs[r].poll() is not None:
                        exits[r] = time.time()
                if len(exits) == len(survivors) or (injected is not None and time.time() - injected > cap):
                    break
                time.sleep(0.05)
        finally:
            outputs = stop_ranks(procs, logs)
    if injected is None:
        raise RuntimeError("the fault was never injected:\n" + outputs[1][-3000:])
    hung = len(exits) < len(survivors)
    return {
        "fault": fault, "peer_timeout": peer_timeout, "world": world,
        "seconds_to_stop": None if hung else max(exits.values()) - injected,
        "hung_past_cap": hung,
        "named": all("rank 1 " in outputs[r] and "zeropp:" in outputs[r] for r in survivors),
        "exit_codes": [procs[r].returncode for r in survivors],
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--world", type=int, default=3)
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--cap", type=float, default=150.0, help="seconds after the fault counted as a hang")
    ap.add_argument("--out", default=str(ROOT / "benchmarks" / "results" / "fault_detection.json"))
    args = ap.parse_args()
    cases = [("kill", 60.0), ("kill", 0.0), ("stop", 10.0), ("stop", 60.0), ("stop", 0.0)]
    rows = []
    for fault, timeout in cases:
        runs = [run_case(fault, timeout, args.world, args.cap) for _ in range(args.repeat)]
        times = [r["seconds_to_stop"] for r in runs if r["seconds_to_stop"] is not None]
        rows.append({
            "fault": fault, "peer_timeout": timeout,
            "median_seconds_to_stop": statistics.median(times) if len(times) == len(runs) else None,
            "max_seconds_to_stop": max(times) if len(times) == len(runs) else None,
            "hung_runs": sum(r["hung_past_cap"] for r in runs), "named_runs": sum(r["named"] for r in runs),
            "runs": runs,
        })
        print(rows[-1]["fault"], timeout, rows[-1]["median_seconds_to_stop"], rows[-1]["hung_runs"], flush=True)
    result = {
        "command": "python " + " ".join([Path(sys.argv[0]).as_posix().split("/")[-2] + "/" + Path(sys.argv[0]).name,
                                         *sys.argv[1:]]),
        "hardware": f"{platform.machine()}, {os.cpu_count()} CPU cores, {platform.system()}, no GPU",
        "world": args.world, "repeat": args.repeat, "cap_seconds": args.cap, "rows": rows,
    }
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(result, indent=1))
    print("\n| fault | peer_timeout | survivors stop after (median / max) | runs hung past the cap | runs naming rank 1 |")
    print("|---|---|---|---|---|")
    for r in rows:
        took = (f"{r['median_seconds_to_stop']:.1f} s / {r['max_seconds_to_stop']:.1f} s"
                if r["median_seconds_to_stop"] is not None else f"> {args.cap:.0f} s")
        off = " (off)" if r["peer_timeout"] == 0 else " s"
        print(f"| {r['fault']} | {r['peer_timeout']:g}{off} | {took} | {r['hung_runs']}/{args.repeat} | "
              f"{r['named_runs']}/{args.repeat} |")


if __name__ == "__main__":
    main()

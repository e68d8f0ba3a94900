"""Shared pieces of benchmarks/offload.py's parts: the sizes parser, the timing loop, the page
cache drop, the hardware record and the markdown table. Imported by benchmarks/offload.py and
its parts (benchmarks/offload_adam.py, offload_swap.py, offload_e2e.py); benchmarks/infinity.py
takes ``hardware`` from here. What each part measures: benchmarks/offload.py's docstring.
"""

from __future__ import annotations

import os
import platform
import statistics
import subprocess
import time
from pathlib import Path

import torch

MiB = 2**20


# -- helpers ------------------------------------------------------------------------------------


def _count(s: str) -> int:
    s = s.strip().upper()
    mult = {"K": 2**10, "M": 2**20, "G": 2**30}.get(s[-1], 1)
    return int(s[:-1] if s[-1] in "KMG" else s) * mult


def _adam_cases(spec: str) -> list[tuple[str, list[int]]]:
    """'1M,16M,64x256K' -> [('1M', [2**20]), ('16M', [2**24]), ('64x256K', [2**18] * 64)]."""
    cases = []
    for item in spec.split(","):
        item = item.strip()
        if "x" in item.lower():
            n, size = item.lower().split("x", 1)
            cases.append((item, [_count(size)] * int(n)))
        else:
            cases.append((item, [_count(item)]))
    return cases


def _ints(s: str) -> list[int]:
    return [int(x) for x in s.split(",") if x.strip()]


def _median_step(step, warmup: int, steps: int, before=None, after=None) -> tuple[float, list[float]]:
    """Median seconds of ``step()`` over ``steps`` calls after ``warmup`` untimed ones.

    ``before``/``after`` run around each timed call, ``after`` inside the timing."""
    for _ in range(warmup):
        step()
    times = []
    for _ in range(steps):
        if before is not None:
            before()
        t0 = time.perf_counter()
        step()
        if after is not None:
            after()
        times.append(time.perf_counter() - t0)
    return statistics.median(times), times


def drop_caches(enabled: bool = True) -> bool:
    """``sync; echo 3 > /proc/sys/vm/drop_caches`` as root; False when not done."""
    if not enabled or not hasattr(os, "geteuid") or os.geteuid() != 0:
        return False
    os.sync()
    try:
        with open("/proc/sys/vm/drop_caches", "w") as f:
            f.write("3\n")
        return True
    except OSError:
        return False


def fs_info(path: Path) -> dict:
    """File system of ``path``: ``stat -f -c %T`` and the matching /proc/mounts entry."""
    info: dict = {}
    try:
        r = subprocess.run(["stat", "-f", "-c", "%T", str(path)], capture_output=True, text=True, timeout=10)
        if r.returncode == 0:
            info["stat_f_type"] = r.stdout.strip()
    except (OSError, subprocess.SubprocessError):
        pass
    try:
        real = os.path.realpath(path)
        best = None
        for line in Path("/proc/mounts").read_text().splitlines():
            parts = line.split()
            if len(parts) < 3:
                continue
            mnt = parts[1].replace("\\040", " ")
            if (real == mnt or real.startswith(mnt.rstrip("/") + "/")) and (best is None or len(mnt) >= len(best[1])):
                best = (parts[0], mnt, parts[2])
        if best:
            info.update(mount_source=best[0], mount_point=best[1], mounts_type=best[2])
    except OSError:
        pass
    return info


def hardware(fs_dir: Path | None) -> dict:
    hw = {
        "processor": platform.processor(),
        "machine": platform.machine(),
        "cpu_count": os.cpu_count(),
        "torch": torch.__version__,
        "torch_threads": torch.get_num_threads(),
        "python": platform.python_version(),
        "kernel": platform.release(),
    }
    if hasattr(os, "sched_getaffinity"):
        hw["cpus_usable"] = len(os.sched_getaffinity(0))
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                hw["cpu_model"] = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    try:
        import psutil

        hw["ram_bytes"] = psutil.virtual_memory().total
    except ImportError:
        hw["ram_bytes"] = None
    if fs_dir is not None:
        hw["dir_fs"] = fs_info(fs_dir)
    return hw


def _md(head: list[str], rows: list[list[str]]) -> str:
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    lines += ["| " + " | ".join(r) + " |" for r in rows]
    return "\n".join(lines)


def _gbs(nbytes: float, seconds: float) -> float:
    return nbytes / seconds / 1e9 if seconds > 0 else float("nan")

"""Optimizer offload: host Adam throughput, NVMe swap bandwidth, end-to-end step time.

    python benchmarks/offload.py --part all                     # all three parts, full size
    python benchmarks/offload.py --part adam --adam-sizes 1M,16M,64x256K
    python benchmarks/offload.py --part swap --dir path/on/nvme --state-mib 256
    python benchmarks/offload.py --part e2e --devices 2
    python benchmarks/offload.py --part param --devices 2 --rounds 3   # offload_param="nvme" vs none
    python benchmarks/offload.py --part all --quick --out-dir some/tmp/dir   # smoke test, tiny sizes

Each part writes ``<out-dir>/offload_<part>.json`` (default ``benchmarks/results/``) and
prints a markdown table. Every JSON records the hardware (CPU, core count, RAM, torch
version, the file system of ``--dir``) and the exact command line. ``--quick`` shrinks
every size so that the whole run takes well under a minute: its figures are a smoke
test, not measurements (the JSON says ``"quick": true``).

``adam``: CPU AdamW step throughput (Mparams/s, and GB/s counting the 28 bytes per element
a step moves: param, grad, two moments read; param, two moments written) on flat fp32
tensors (``--adam-sizes``: ``1M`` is one tensor of 2**20 elements, ``64x256K`` a list of
64 tensors of 2**18). Compared: ``torch.optim.AdamW`` for-loop (``foreach=False``),
``foreach=True``, ``fused=True``, and ours: ``OffloadOptimizer(AdamW(...),
OffloadConfig(device="cpu"))`` stepping the same parameters (it picks the fused CPU kernel
when the user chose no implementation). ``--warmup`` steps, then the median of ``--steps``
timed steps; ratios are throughput over the fused kernel's.

``swap``: NVMe swap bandwidth, in the directory ``--dir`` (default: a new temporary
directory under the current directory, removed afterwards). (a) The drive's sequential
bandwidth, the *reference*: with ``fio`` where it is installed (8 MiB requests, ``psync``,
1 and 4 jobs, ``--direct=1`` unless refused; per direction the faster job count), else
with ``dd`` (8 MiB blocks, ``oflag=direct conv=fdatasync`` to write, ``iflag=direct`` to
read; without the direct flags if dd refuses them). The JSON's ``reference`` says which
tool and job gave each figure. (b) Our swap path: an ``OffloadOptimizer`` with
``device="nvme"`` over ``--state-mib`` MiB of fp32 AdamW state (the step reads and writes
all of it, so I/O dominates; the same step with the state in RAM is timed beside it),
reported as (bytes read + bytes written per step) / step time and as a fraction of what
the reference bandwidths would need for the same bytes (``R/read + W/write``) over the step
time; and the raw ``SwapFile.write_from`` (+ fsync) / ``read_into`` of one ``--size-mib``
buffer, ``O_DIRECT`` and buffered, for each ``--io-threads`` and ``--io-block-mib``,
as a fraction of the reference write/read bandwidth (target >= 0.70). As root, the page cache is
dropped before every buffered read (``sync; echo 3 > /proc/sys/vm/drop_caches``) so
that buffered reads come from the drive; the JSON records whether that succeeded. Not
root: buffered reads may come from the page cache and overstate the drive. Every row
says which I/O mode was actually used: a file system that refuses ``O_DIRECT`` (tmpfs
before Linux 6.6, some network file systems) gets buffered I/O.

``e2e``: median step time of a small Lightning training run on CPU (a residual MLP
language model, ``--e2e-width`` x ``--e2e-depth``, several million parameters, AdamW),
``ZeroPPStrategy(stage=--stage)`` with: no offload (the user's AdamW as PyTorch runs it by
default on CPU, the for-loop), no offload with ``AdamW(fused=True)``, ``offload_optimizer=
"cpu"``, ``offload_optimizer="nvme"`` (in ``--dir``), and ``offload_optimizer="cpu"`` +
``offload_param="cpu"`` (stage 3). A callback records ``time.perf_counter()`` at
``on_before_optimizer_step`` and ``on_train_batch_end``: step time is the median interval
between batch ends after ``--e2e-warmup`` steps, optimizer time the median of
(batch end - before optimizer step). Overhead is relative to no offload. Each cell runs
in its own process (``--devices 2`` launches 2 CPU ranks through Lightning), except under
``--quick`` with one device, where the cells run one after another in this process.
Each cell also records rank 0's CPU seconds, page faults and block I/O per step
(``getrusage``, all its threads) and, with ``offload_param="nvme"``, the parameter
store's ``io_stats()``.

``param``: ``offload_param="nvme"`` against no offload (issue 18 item 6: target step time
<= 1.3x), stage 3, fp32 (the e2e model has no precision flag): the e2e cells ``none``,
``param_nvme`` (your AdamW steps the mapped shards; the memory plan keeps the gradients
in host memory, since the budget has room for them), ``opt_nvme_param_nvme``
(``zeropp_offload_nvme``'s placement) and ``param_nvme_grads_nvme`` (no budget, so no
plan: the gradients go through the drive too), ``--rounds`` times, interleaved, so that
a slow spell of a shared machine lands on both sides of a ratio. Reported per round: the step
time ratio to ``none`` of the same round, rank 0's CPU-time ratio (less sensitive to
other load on the machine than wall time), the major page faults per all-gather copy-in
(pages the read-ahead missed) and the time the step waited for the write-behind; then
the range and median of the ratios. To measure code from another commit with this
benchmark: ``git archive <commit> zeropp_strategy | tar -x -C /tmp/base`` and run it with
``PYTHONPATH=/tmp/base`` (the JSON records which ``zeropp_strategy`` each cell imported).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import re
import shlex
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import torch

MiB = 2**20
RESULTS = Path(__file__).resolve().parent / "results"
ADAM_IMPLS = ("forloop", "foreach", "fused", "ours")
ADAM_BYTES_PER_ELEM = 28  # fp32: read param, grad, exp_avg, exp_avg_sq; write param, exp_avg, exp_avg_sq
E2E_CELLS = ("none", "none_fused", "opt_cpu", "opt_nvme", "opt_cpu_param_cpu", "opt_nvme_param_nvme", "param_nvme",
             "param_nvme_grads_nvme")
TARGET = 0.70  # swap path bandwidth / the drive's (fio, else dd)


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


# -- adam ---------------------------------------------------------------------------------------


def _adam_optimizer(impl: str, params: list[torch.Tensor]):
    from zeropp_strategy.config import OffloadConfig
    from zeropp_strategy.offload import OffloadOptimizer

    if impl == "forloop":
        return torch.optim.AdamW(params, lr=1e-3, foreach=False)
    if impl == "foreach":
        return torch.optim.AdamW(params, lr=1e-3, foreach=True)
    if impl == "fused":
        return torch.optim.AdamW(params, lr=1e-3, fused=True)
    return OffloadOptimizer(torch.optim.AdamW(params, lr=1e-3), OffloadConfig(device="cpu"))


def part_adam(args: argparse.Namespace) -> dict:
    rows = []
    for label, sizes in _adam_cases(args.adam_sizes):
        g = torch.Generator().manual_seed(0)
        params = [torch.randn(n, generator=g).requires_grad_() for n in sizes]
        for p in params:
            p.grad = torch.randn(p.shape, generator=g) * 1e-3
        numel = sum(sizes)
        row: dict = {"case": label, "tensors": len(sizes), "numel": numel}
        for impl in ADAM_IMPLS:
            opt = _adam_optimizer(impl, params)
            med, times = _median_step(opt.step, args.warmup, args.steps)
            row[impl] = {"step_s": med, "min_s": min(times), "times_s": times, "Mparams_per_s": numel / med / 1e6,
                         "GBps": _gbs(ADAM_BYTES_PER_ELEM * numel, med)}
            if impl == "ours":
                d = opt.host_optimizer.defaults
                row["ours_host_impl"] = {"fused": d.get("fused"), "foreach": d.get("foreach")}
                opt.close()
            del opt
        fused = row["fused"]["Mparams_per_s"]
        for impl in ADAM_IMPLS:
            row[impl]["vs_fused"] = row[impl]["Mparams_per_s"] / fused
        rows.append(row)
        del params
    return {"part": "adam", "warmup": args.warmup, "steps": args.steps, "torch_threads": torch.get_num_threads(),
            "bytes_per_elem": ADAM_BYTES_PER_ELEM, "rows": rows}


def print_adam(res: dict) -> None:
    print(f"\n## adam: CPU AdamW step, fp32, {res['torch_threads']} threads, median of {res['steps']} steps\n")
    head = ["case", "numel"]
    for impl in ADAM_IMPLS:
        head += [f"{impl} Mparams/s", f"{impl} GB/s", f"{impl} / fused"]
    rows = []
    for r in res["rows"]:
        cells = [r["case"], f"{r['numel']:,}"]
        for impl in ADAM_IMPLS:
            c = r[impl]
            cells += [f"{c['Mparams_per_s']:.1f}", f"{c['GBps']:.2f}", f"{c['vs_fused']:.2f}x"]
        rows.append(cells)
    print(_md(head, rows))
    impl = res["rows"][0].get("ours_host_impl") if res["rows"] else None
    print(f"\nours: the host optimizer ran with {impl}; GB/s counts {res['bytes_per_elem']} bytes per element.")


# -- swap ---------------------------------------------------------------------------------------

_DD_RE = re.compile(r"(\d+) bytes.*copied, ([0-9.eE+-]+) s")


def _dd(cmd: list[str]) -> tuple[int, float] | None:
    r = subprocess.run(cmd, capture_output=True, text=True, env={**os.environ, "LC_ALL": "C"})
    if r.returncode != 0:
        return None
    m = _DD_RE.search(r.stderr)
    if not m:
        return None
    return int(m.group(1)), float(m.group(2))


def dd_bandwidth(d: Path, size_mib: int, drop: bool) -> dict:
    """Sequential write then read of one file with dd, 8 MiB blocks; direct I/O when allowed."""
    f = d / "dd.bin"
    count = max(1, size_mib // 8)
    out: dict = {"file_bytes": count * 8 * MiB}
    try:
        for what in ("write", "read"):
            for direct in (True, False):
                if what == "write":
                    f.unlink(missing_ok=True)
                    cmd = ["dd", "if=/dev/zero", f"of={f}", "bs=8M", f"count={count}", "conv=fdatasync"]
                    cmd += ["oflag=direct"] if direct else []
                    dropped = None
                else:
                    cmd = ["dd", f"if={f}", "of=/dev/null", "bs=8M"] + (["iflag=direct"] if direct else [])
                    dropped = None if direct else drop_caches(drop)  # iflag=direct bypasses the cache
                got = _dd(cmd)
                if got is not None:
                    nbytes, secs = got
                    out[what] = {"bytes": nbytes, "seconds": secs, "Bps": nbytes / secs, "direct": direct,
                                 "command": shlex.join(c.replace(str(f), "FILE") for c in cmd)}
                    if dropped is not None:
                        out[what]["page_cache_dropped"] = dropped
                    break
            else:
                out[what] = {"error": "dd failed with and without direct flags"}
    finally:
        f.unlink(missing_ok=True)
    return out


def fio_bandwidth(d: Path, size_mib: int, drop: bool) -> dict | None:
    """fio sequential write/read, 8 MiB requests, 1 and 4 jobs (psync); None if fio is not installed."""
    if shutil.which("fio") is None:
        return None
    f = d / "fio.bin"
    out: dict = {}
    try:
        for jobs in (1, 4):
            per = max(8, size_mib // jobs // 8 * 8)
            for rw in ("write", "read"):
                for direct in (1, 0):
                    dropped = drop_caches(drop) if rw == "read" and not direct else None
                    cmd = ["fio", f"--name=seq{rw}", f"--filename={f}", f"--rw={rw}", "--bs=8M", f"--size={per}M",
                           f"--numjobs={jobs}", f"--offset_increment={per}M", "--ioengine=psync",
                           f"--direct={direct}", "--group_reporting", "--output-format=json"]
                    if rw == "write":
                        cmd.append("--end_fsync=1")
                    r = subprocess.run(cmd, capture_output=True, text=True)
                    if r.returncode != 0:
                        continue
                    try:
                        job = json.loads(r.stdout[r.stdout.index("{"):])["jobs"][0][rw]
                    except (ValueError, KeyError, IndexError):
                        continue
                    out[f"{rw}_jobs{jobs}"] = {"Bps": float(job["bw_bytes"]), "bytes": int(job["io_bytes"]),
                                               "direct": bool(direct), "page_cache_dropped": dropped,
                                               "command": shlex.join(c.replace(str(f), "FILE") for c in cmd)}
                    break
                else:
                    out[f"{rw}_jobs{jobs}"] = {"error": "fio failed with and without --direct"}
    finally:
        f.unlink(missing_ok=True)
    return out


def _pattern_fill(buf: torch.Tensor, seed: int) -> None:
    """Distinct bytes per MiB row, so a block read back at the wrong offset is caught."""
    rows = buf.view(-1, MiB)
    tile = (torch.arange(MiB, dtype=torch.int32) * 7) % 256
    for i in range(0, rows.shape[0], 16):
        k = torch.arange(i, min(rows.shape[0], i + 16), dtype=torch.int32).unsqueeze(1)
        rows[i : i + len(k)].copy_((tile.unsqueeze(0) + k + seed) % 256)


def _pattern_ok(buf: torch.Tensor, seed: int) -> bool:
    rows = buf.view(-1, MiB)
    tile = (torch.arange(MiB, dtype=torch.int32) * 7) % 256
    for i in range(0, rows.shape[0], 16):
        k = torch.arange(i, min(rows.shape[0], i + 16), dtype=torch.int32).unsqueeze(1)
        if not torch.equal(rows[i : i + len(k)], ((tile.unsqueeze(0) + k + seed) % 256).to(torch.uint8)):
            return False
    return True


def raw_swapfile(d: Path, args: argparse.Namespace, drop: bool) -> list[dict]:
    """SwapFile.write_from (+ fsync) and read_into of one large aligned buffer, per setting."""
    from zeropp_strategy.offload.swap import SwapDir, SwapFile, aligned_buffer, wait

    nbytes = max(1, args.size_mib) * MiB
    buf = aligned_buffer(nbytes, pin=False)
    sd = SwapDir(d, 0)
    rows = []
    try:
        i = 0
        for direct in (True, False):
            for threads in _ints(args.io_threads):
                for block in _ints(args.io_block_mib):
                    i += 1
                    with ThreadPoolExecutor(threads, thread_name_prefix="bench-swap") as pool:
                        f = SwapFile(sd.path / f"raw{i}.swap", nbytes, pool, direct=direct, io_block_bytes=block * MiB)
                        try:
                            writes, reads, dropped, ok = [], [], [], True
                            for rep in range(args.repeat):
                                _pattern_fill(buf, rep)
                                t0 = time.perf_counter()
                                wait(f.write_from(buf, 0))
                                f.sync()
                                writes.append(time.perf_counter() - t0)
                                buf.zero_()
                                if not f.direct:  # O_DIRECT reads bypass the cache anyway
                                    dropped.append(drop_caches(drop))
                                t0 = time.perf_counter()
                                wait(f.read_into(buf, 0))
                                reads.append(time.perf_counter() - t0)
                                ok = ok and _pattern_ok(buf, rep)
                            w, r = statistics.median(writes), statistics.median(reads)
                            rows.append({"direct_asked": direct, "direct": f.direct, "io_threads": threads,
                                         "io_block_mib": block, "bytes": nbytes, "write_s": w, "read_s": r,
                                         "write_Bps": nbytes / w, "read_Bps": nbytes / r, "write_times_s": writes,
                                         "read_times_s": reads, "data_ok": ok,
                                         "page_cache_dropped": None if f.direct else bool(dropped) and all(dropped)})
                        finally:
                            f.close()
                            f.path.unlink(missing_ok=True)
    finally:
        sd.close()
    return rows


def _swap_params(state_mib: int, tensors: int) -> list[torch.Tensor]:
    """fp32 params whose AdamW state (8 bytes per element) totals ``state_mib`` MiB, with grads."""
    total = state_mib * MiB // 8
    g = torch.Generator().manual_seed(0)
    sizes = [total // tensors + (1 if i < total % tensors else 0) for i in range(tensors)]
    params = [torch.randn(n, generator=g).requires_grad_() for n in sizes if n]
    for p in params:
        p.grad = torch.randn(p.shape, generator=g) * 1e-3
    return params


def nvme_optimizer(d: Path, args: argparse.Namespace, drop: bool) -> dict:
    """OffloadOptimizer(device="nvme") step: bytes moved per step over step time; RAM step beside it."""
    from zeropp_strategy.config import OffloadConfig
    from zeropp_strategy.offload import OffloadOptimizer

    params = _swap_params(args.state_mib, args.swap_tensors)
    numel = sum(p.numel() for p in params)
    out: dict = {"numel": numel, "tensors": len(params), "state_bytes": 8 * numel,
                 "buffer_count": args.buffer_count, "buffer_bytes": args.buffer_mib * MiB,
                 "io_threads": args.opt_io_threads, "io_block_bytes": args.opt_io_block_mib * MiB, "rows": []}

    ram = OffloadOptimizer(torch.optim.AdamW(params, lr=1e-3), OffloadConfig(device="cpu"))
    ram_s, ram_times = _median_step(ram.step, args.warmup, args.steps)
    out["ram_step_s"], out["ram_times_s"] = ram_s, ram_times
    ram.close()
    del ram

    for direct in (True, False):
        cfg = OffloadConfig(device="nvme", nvme_path=str(d), pin_memory=False, buffer_count=args.buffer_count,
                            buffer_bytes=args.buffer_mib * MiB)
        opt = OffloadOptimizer(torch.optim.AdamW(params, lr=1e-3), cfg, io_threads=args.opt_io_threads,
                               io_block_bytes=args.opt_io_block_mib * MiB, direct_io=direct)
        files = [f for s in opt._streams.values() for f in s.files.values()]
        moved = {"read": 0, "write": 0}

        def counting(f, name, key):
            inner = getattr(f, name)

            def wrapper(buf, offset):
                moved[key] += buf.numel()
                return inner(buf, offset)

            setattr(f, name, wrapper)

        for f in files:
            counting(f, "read_into", "read")
            counting(f, "write_from", "write")
        try:
            opt.step()  # the first step creates the state: it writes, reads nothing
            for k in moved:
                moved[k] = 0
            direct_all = all(f.direct for f in files)
            dropped: list[bool] = []
            before = None if direct_all else (lambda: dropped.append(drop_caches(drop)))
            sync = None if direct_all else (lambda: [f.sync() for f in files])
            med, times = _median_step(opt.step, max(0, args.warmup - 1), args.steps, before=before, after=sync)
            # bytes per step, averaged over the warm-up and timed steps (each moves the whole state)
            per_step = {k: v / (args.steps + max(0, args.warmup - 1)) for k, v in moved.items()}
            row = {"direct_asked": direct, "direct": direct_all, "step_s": med, "times_s": times,
                   "read_bytes_per_step": per_step["read"], "write_bytes_per_step": per_step["write"],
                   "Bps": (per_step["read"] + per_step["write"]) / med, "fsync_in_timing": sync is not None,
                   "page_cache_dropped": None if direct_all else bool(dropped) and all(dropped),
                   "io_share": max(0.0, 1 - ram_s / med)}
            out["rows"].append(row)
        finally:
            opt.close()
        del opt
    return out


def part_swap(args: argparse.Namespace, d: Path) -> dict:
    drop = not args.no_drop_caches
    res: dict = {"part": "swap", "dir_fs": fs_info(d), "running_as_root": hasattr(os, "geteuid") and os.geteuid() == 0}
    res["page_cache_drop_works"] = drop_caches(drop)
    res["fio"] = fio_bandwidth(d, args.size_mib, drop)
    res["reference"] = reference_bandwidth(res["fio"], None)
    res["dd"] = None  # only where fio is missing or failed
    if any("Bps" not in v for v in res["reference"].values()):
        res["dd"] = dd_bandwidth(d, args.size_mib, drop)
        res["reference"] = reference_bandwidth(res["fio"], res["dd"])
    res["raw"] = raw_swapfile(d, args, drop)
    res["optimizer"] = nvme_optimizer(d, args, drop)
    dw, dr = res["reference"]["write"].get("Bps"), res["reference"]["read"].get("Bps")
    for r in res["raw"]:
        r["write_vs_disk"] = r["write_Bps"] / dw if dw else None
        r["read_vs_disk"] = r["read_Bps"] / dr if dr else None
    for r in res["optimizer"]["rows"]:
        if dw and dr:
            disk_s = r["read_bytes_per_step"] / dr + r["write_bytes_per_step"] / dw
            r["disk_equivalent_s"] = disk_s
            r["vs_disk"] = disk_s / r["step_s"]
        else:
            r["vs_disk"] = None
    res["target_vs_disk"] = TARGET
    return res


def reference_bandwidth(fio: dict | None, dd: dict | None) -> dict:
    """Per direction, the drive's sequential bandwidth and the tool that measured it: fio's
    faster job count (direct I/O preferred), else dd's figure."""
    ref: dict = {}
    for what in ("write", "read"):
        runs = [(k, v) for k, v in (fio or {}).items() if k.startswith(what) and "Bps" in v]
        if runs:
            key, run = max(runs, key=lambda kv: (kv[1]["direct"], kv[1]["Bps"]))
            ref[what] = {"tool": "fio", "job": key, "Bps": run["Bps"], "direct": run["direct"],
                         "command": run["command"]}
        elif dd is not None and "Bps" in dd.get(what, {}):
            run = dd[what]
            ref[what] = {"tool": "dd", "Bps": run["Bps"], "direct": run["direct"], "command": run["command"]}
        else:
            ref[what] = {"tool": None, "error": "neither fio nor dd measured it"}
    return ref


def _mode(direct: bool) -> str:
    return "O_DIRECT" if direct else "buffered"


def _frac(x: float | None) -> str:
    if x is None:
        return "-"
    return f"{x:.2f} {'ok' if x >= TARGET else 'BELOW'}"


def print_swap(res: dict) -> None:
    fs = res["dir_fs"]
    print(f"\n## swap: directory on {fs.get('mounts_type', fs.get('stat_f_type', '?'))} "
          f"({fs.get('mount_source', '?')}); page cache dropped before reads: {res['page_cache_drop_works']}\n")
    rows = []
    for what in ("write", "read"):
        r = (res["dd"] or {}).get(what)
        if r is None:
            continue
        if "Bps" in r:
            rows.append([f"dd {what}", _mode(r["direct"]), f"{r['bytes'] / MiB:.0f}", f"{r['Bps'] / 1e6:.0f}"])
        else:
            rows.append([f"dd {what}", "-", "-", r.get("error", "-")])
    for key, r in (res["fio"] or {}).items():
        if "Bps" in r:
            rows.append([f"fio {key}", _mode(r["direct"]), f"{r['bytes'] / MiB:.0f}", f"{r['Bps'] / 1e6:.0f}"])
        else:
            rows.append([f"fio {key}", "-", "-", r.get("error", "-")])
    print(_md(["tool", "I/O mode", "MiB", "MB/s"], rows))
    if res["fio"] is None:
        print("\nfio: not installed, skipped; dd gives the reference.")
    ref = res["reference"]
    tools = {what: (f"{r['tool']} {r.get('job', '')}".strip() if r["tool"] else "none") for what, r in ref.items()}
    print(f"\nReference (the drive's sequential bandwidth): write {ref['write'].get('Bps', 0) / 1e6:.0f} MB/s "
          f"({tools['write']}), read {ref['read'].get('Bps', 0) / 1e6:.0f} MB/s ({tools['read']})")

    print(f"\nRaw SwapFile path, one buffer of {res['raw'][0]['bytes'] / MiB:.0f} MiB (write includes fsync), "
          f"median of repeats; fraction of the reference (target >= {TARGET}):\n" if res["raw"] else "")
    rows = []
    for r in res["raw"]:
        mode = _mode(r["direct"]) + ("" if r["direct"] == r["direct_asked"] else " (O_DIRECT refused)")
        rows.append([mode, str(r["io_threads"]), str(r["io_block_mib"]), f"{r['write_Bps'] / 1e6:.0f}",
                     _frac(r["write_vs_disk"]), f"{r['read_Bps'] / 1e6:.0f}", _frac(r["read_vs_disk"]),
                     "yes" if r["data_ok"] else "NO"])
    print(_md(["I/O mode", "io_threads", "block MiB", "write MB/s", "write / ref", "read MB/s", "read / ref",
               "data ok"], rows))

    o = res["optimizer"]
    print(f"\nOffloadOptimizer(device='nvme') AdamW step, {o['numel']:,} fp32 params in {o['tensors']} tensors "
          f"({o['state_bytes'] / MiB:.0f} MiB of state), buffers {o['buffer_count']} x "
          f"{o['buffer_bytes'] / MiB:g} MiB, io_threads {o['io_threads']}, block {o['io_block_bytes'] / MiB:g} MiB; "
          f"the same step with the state in RAM: {o['ram_step_s'] * 1e3:.1f} ms\n")
    rows = []
    for r in o["rows"]:
        mode = _mode(r["direct"]) + (" + fsync" if r["fsync_in_timing"] else "")
        rows.append([mode, f"{r['step_s'] * 1e3:.1f}", f"{r['read_bytes_per_step'] / MiB:.0f}",
                     f"{r['write_bytes_per_step'] / MiB:.0f}", f"{r['Bps'] / 1e6:.0f}", f"{r['io_share']:.2f}",
                     _frac(r["vs_disk"])])
    print(_md(["I/O mode", "step ms", "read MiB", "written MiB", "(R+W)/step MB/s", "I/O share of step",
               "reference time / step time"], rows))


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
    argv = [sys.executable, str(Path(__file__).resolve()), "--e2e-cell", cell, "--cell-out", str(out), "--dir", str(d)]
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
    "param_nvme": "offload_param=nvme (the user's AdamW steps the mapped shards; gradients in memory, the plan's choice)",
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


# -- main ---------------------------------------------------------------------------------------

QUICK = dict(adam_sizes="64K,4x16K", warmup=1, steps=3, size_mib=16, io_threads="1,4", io_block_mib="1,4",
             repeat=1, state_mib=8, swap_tensors=4, buffer_mib=1, e2e_width=64, e2e_depth=2, e2e_vocab=64,
             e2e_seq=16, e2e_batch=4, e2e_warmup=2, e2e_steps=3, rounds=1)


def _parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--part", choices=("adam", "swap", "e2e", "param", "all"), default="all")
    ap.add_argument("--quick", action="store_true", help="tiny sizes: a smoke test (< 1 min), not a measurement")
    ap.add_argument("--out-dir", type=Path, default=RESULTS, help="where offload_<part>.json go")
    ap.add_argument("--dir", type=Path, default=None,
                    help="directory for swap files and dd/fio (default: a temporary one under the current directory)")
    ap.add_argument("--no-drop-caches", action="store_true", help="never drop the page cache, even as root")
    g = ap.add_argument_group("adam")
    g.add_argument("--adam-sizes", default="1M,16M,64x256K", help="'16M' one tensor; '64x256K' 64 tensors")
    g.add_argument("--warmup", type=int, default=3, help="untimed steps (adam, swap optimizer)")
    g.add_argument("--steps", type=int, default=10, help="timed steps (adam, swap optimizer)")
    g = ap.add_argument_group("swap")
    g.add_argument("--size-mib", type=int, default=1024, help="dd/fio file and raw SwapFile buffer size")
    g.add_argument("--io-threads", default="1,2,4,8", help="raw SwapFile sweep")
    g.add_argument("--io-block-mib", default="1,4,8,16", help="raw SwapFile sweep")
    g.add_argument("--repeat", type=int, default=3, help="raw SwapFile repetitions (median)")
    g.add_argument("--state-mib", type=int, default=256, help="AdamW state of the NVMe optimizer, MiB")
    g.add_argument("--swap-tensors", type=int, default=16, help="parameter tensors it is split into")
    g.add_argument("--buffer-count", type=int, default=4, help="NVMe swap buffers (swap optimizer and e2e nvme)")
    g.add_argument("--buffer-mib", type=int, default=64, help="MiB per NVMe swap buffer (swap optimizer and e2e nvme)")
    g.add_argument("--opt-io-threads", type=int, default=4)
    g.add_argument("--opt-io-block-mib", type=int, default=8)
    g = ap.add_argument_group("e2e")
    g.add_argument("--devices", type=int, default=1, help="CPU ranks per cell")
    g.add_argument("--stage", type=int, default=3, choices=(1, 2, 3))
    g.add_argument("--e2e-width", type=int, default=384)
    g.add_argument("--e2e-depth", type=int, default=4)
    g.add_argument("--e2e-vocab", type=int, default=1024)
    g.add_argument("--e2e-seq", type=int, default=32)
    g.add_argument("--e2e-batch", type=int, default=4, help="sequences per rank per step")
    g.add_argument("--e2e-warmup", type=int, default=3)
    g.add_argument("--e2e-steps", type=int, default=10)
    g.add_argument("--cell-timeout", type=int, default=600, help="seconds per e2e cell (subprocess)")
    g.add_argument("--rounds", type=int, default=3, help="param: interleaved rounds of none / nvme cells")
    ap.add_argument("--e2e-cell", choices=E2E_CELLS, help=argparse.SUPPRESS)
    ap.add_argument("--cell-out", type=Path, help=argparse.SUPPRESS)
    return ap


def main() -> None:
    ap = _parser()
    args = ap.parse_args()
    if args.quick:  # shrink what the user did not set
        given = {a.dest for a in ap._actions for arg in sys.argv[1:] for opt in a.option_strings
                 if arg == opt or arg.startswith(opt + "=")}
        for k, v in QUICK.items():
            if k not in given:
                setattr(args, k, v)

    if args.e2e_cell:  # one e2e cell, in its own process (Lightning may launch more ranks of it)
        res = run_e2e_cell(args.e2e_cell, args, args.dir)
        if res:
            args.cell_out.write_text(json.dumps(res))
        return

    command = "python " + shlex.join(sys.argv)
    parts = ["adam", "swap", "e2e", "param"] if args.part == "all" else [args.part]
    temp = None
    if args.dir is None and parts != ["adam"]:
        temp = Path(tempfile.mkdtemp(prefix="offload-bench-", dir="."))
    d = args.dir or temp or Path(".")
    args.out_dir.mkdir(parents=True, exist_ok=True)
    try:
        for part in parts:
            t0 = time.perf_counter()
            if part == "adam":
                res = part_adam(args)
                print_adam(res)
            elif part == "swap":
                res = part_swap(args, d)
                print_swap(res)
            elif part == "e2e":
                res = part_e2e(args, d)
                print_e2e(res)
            else:
                res = part_param(args, d)
                print_param(res)
            res.update(command=command, quick=args.quick, wall_s=time.perf_counter() - t0, hardware=hardware(d),
                       dir="temporary directory under the current directory" if temp else str(d))
            path = args.out_dir / f"offload_{part}.json"
            path.write_text(json.dumps(res, indent=1))
            print(f"\nwrote {path} ({res['wall_s']:.1f} s)", flush=True)
    finally:
        if temp is not None:
            shutil.rmtree(temp, ignore_errors=True)


if __name__ == "__main__":
    main()

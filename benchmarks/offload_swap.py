"""``python benchmarks/offload.py --part swap``: the drive's sequential bandwidth (fio, else dd),
the raw ``SwapFile`` path and ``OffloadOptimizer(device="nvme")``'s step against it (what it
measures: benchmarks/offload.py's docstring, ``swap``). benchmarks/infinity.py takes
``fio_bandwidth`` from here.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shlex
import shutil
import statistics
import subprocess
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import torch

from offload_common import MiB, _ints, _md, _median_step, drop_caches, fs_info  # a sibling: benchmarks/ is on sys.path

TARGET = 0.70  # swap path bandwidth / the drive's (fio, else dd)


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

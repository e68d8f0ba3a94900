"""Issue 18's side-by-side run: communication volume and step time as users train (bf16-mixed).

    sudo python benchmarks/volume.py                          # 3 runs per cell, about 35 min
    sudo python benchmarks/volume.py --repeat 1 --out /tmp/v.json --docs /tmp/v.md   # a quick look
    sudo python benchmarks/volume.py --package-root ../before  # the same cells on another checkout
    sudo python benchmarks/volume.py --part stage1 --precision 32-true    # stage 1 with and without overlap_param_gather
    sudo python benchmarks/volume.py --part sizes              # two model sizes at 1 Gbit/s
    python benchmarks/volume.py --render-only

``--part stage1`` (results/volume_stage1_async.json): ``ddp`` and ``zeropp_stage_1`` at
200 Mbit/s, and ``zeropp_stage_1`` from ``--before-root`` (a folder holding another
``zeropp_strategy`` package: the code before a change). ``--part sizes``
(results/volume_sizes_1gbit.json): ``ddp``, ``zeropp_stage_3``, ``zeropp`` and DeepSpeed
ZeRO-3 (when ``deepspeed`` imports) at 1 Gbit/s for GPT-2 ``small`` (4 x 256, 3.3M
parameters) and ``medium`` (8 x 512, 25.5M). Both parts run their cells in rounds (every
cell once, ``--repeat`` times) so that a busy spell of a shared machine falls on every
cell alike, and record the load average at the start of each run.

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
from collections.abc import Sequence
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from benchmarks.run import run_cell  # noqa: E402

CELLS = {
    "200mbit": ["ddp", "zeropp_stage_1", "zeropp_stage_2", "zeropp_stage_3", "zeropp_stage_3_bf16", "zeropp",
                "deepspeed_zero3"],
    "unlimited": ["zeropp_stage_3", "zeropp", "deepspeed_zero3"],
}
MB = 1e6
# --part stage1 / sizes: (rate, sizes, systems); "@before" would run the --before-root package,
# "#N" cuts stage 1's post-step gather into about N buckets (bench_train.py --overlap-buckets).
PARTS = {
    "stage1": ("200mbit", ["small"], ["ddp", "zeropp_stage_1", "zeropp_stage_1_overlap", "zeropp_stage_1_overlap#1",
                                      "zeropp_stage_1_overlap#16"]),
    "sizes": ("1gbit", ["small", "medium"], ["ddp", "zeropp_stage_3", "zeropp", "deepspeed_zero3"]),
    # Beyond ZeRO++ (issue 35): int4 weight gathers against zeropp, at 50 Mbit/s and without a limit
    "4bit_50mbit": ("50mbit", ["small"], ["zeropp", "zeropp_4bit"]),
    "4bit_unlimited": ("unlimited", ["small"], ["zeropp", "zeropp_4bit"]),
}
PART_FILES = {"stage1": "volume_stage1_async.json", "sizes": "volume_sizes_1gbit.json",
              "4bit_50mbit": "volume_4bit_50mbit.json", "4bit_unlimited": "volume_4bit_unlimited.json"}
SUITE_FILES = {"fp32": "volume_bf16_fp32mm.json", "native": "volume_bf16.json"}  # by --bf16-matmul
ARCHIVED_SUITES = ["volume_bf16_fp32mm_2026-11-25.json"]
"""Earlier runs of the suite kept on the page below the newest, newest first; each JSON's
``meta["title_note"]`` says what it predates."""


def formula_bytes(system: str, params: int, world: int = 4, nodes: int = 2) -> float | None:
    """Cross-node payload per step, both directions, all ranks ([Note: two-hop collectives]).

    P parameters, bf16 gathers (2 bytes), fp32 (4) or bf16 (2) reduce: a two-hop collective
    puts (M-1)/M of the full tensor's bytes across per node pair, i.e. (M-1) x bytes(P) in all;
    gloo's ring all-reduce (ddp) puts 2 (W-1)/W x bytes(P) on each of the M node-crossing links.
    """
    m = nodes - 1
    if system == "ddp":
        return nodes * 2 * (world - 1) / world * 4 * params
    if system == "zeropp_stage_1":  # fp32 reduce-scatter + fp32 gather of the updated rows
        return m * (4 + 4) * params
    if system == "zeropp_stage_2":  # one bf16 gather + fp32 reduce-scatter
        return m * (2 + 4) * params
    if system == "zeropp_stage_3":  # two bf16 gathers + fp32 reduce-scatter
        return m * (2 + 2 + 4) * params
    if system == "zeropp_stage_3_bf16":
        return m * (2 + 2 + 2) * params
    return None


# Peers whose gradient reduce-scatter gloo runs as an all-reduce (torch's gloo backend has
# no reduce_scatter_tensor of its own), with their reduce dtype's bytes: DeepSpeed ZeRO-3 in
# its bf16 mode, FSDP2 with MixedPrecisionPolicy(reduce_dtype=fp32). Ours uses all-to-all.
RS_AS_ALL_REDUCE = {"deepspeed_zero3": 2, "fsdp2": 4}


def nccl_ideal_bytes(system: str, veth: float, params: int, world: int = 4, nodes: int = 2) -> float | None:
    """An estimate of a peer's cross-node bytes per step with a native reduce-scatter (NCCL):
    the measured bytes less what the all-reduce adds over a reduce-scatter. On the ring of
    ``world`` ranks, ``nodes`` links cross nodes; a reduce-scatter of B bytes puts (W-1)/W x B
    on each link, an all-reduce twice that, so the extra is nodes x (W-1)/W x B. None for
    systems that do not pay it."""
    width = RS_AS_ALL_REDUCE.get(system)
    if width is None:
        return None
    return veth - nodes * (world - 1) / world * width * params


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
        "repeat": args.repeat, "bf16_matmul": args.bf16_matmul, "cpu_capability": _cpu_capability(), "matmul_ms": _matmul_ms(),
    }


def run_part(args: argparse.Namespace) -> dict:
    """One of PARTS, in rounds: every cell once per round, ``--repeat`` rounds."""
    from benchmarks.simcluster import SimCluster

    rate, sizes, systems = PARTS[args.part]
    has_ds = importlib.util.find_spec("deepspeed") is not None
    cells = {f"{rate}/{size}/{system}": (size, system) for size in sizes for system in systems}
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
    with SimCluster(rate=rate) as cluster:
        for round_ in range(args.repeat):
            for key, (size, system) in cells.items():
                if key in skipped:
                    continue
                name, _, variant = system.partition("@")
                name, _, buckets = name.partition("#")
                cell_args = argparse.Namespace(**{**vars(args), "size": size,
                                                  "overlap_buckets": int(buckets) if buckets else None})
                if variant == "before":
                    cell_args.package_root = args.before_root
                load = os.getloadavg()[0]
                cell = run_cell(cluster, name, cell_args)
                cell["load_avg_1min_at_start"] = load
                runs[key].append(_run_record(cell))
                print(f"round {round_ + 1}/{args.repeat} {key}: " + (f"{cell['step_s']:.3f} s/step (load {load:.1f})"
                      if "step_s" in cell else f"FAILED {cell.get('error')}"), flush=True)
                # after every run, so that a run cut short keeps what it measured
                results = {"meta": meta, "cells": _summarize(runs, skipped), "runs": runs}
                out.write_text(json.dumps(results, indent=1))
    return results


RUN_FIELDS = ("step_s", "step_s_all", "veth_bytes_per_step", "loss", "load_avg_1min_at_start", "error")


def _run_record(cell: dict) -> dict:
    """What a results JSON keeps of one run of a cell."""
    return {k: cell[k] for k in RUN_FIELDS if k in cell}


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
    return cells


def _matmul_ms() -> dict[str, float]:
    """One thread, (512 x 256) @ (256 x 1024), the size of a GPT-2 small MLP matmul: ms per call
    in fp32 and in bf16. Without native bf16 (AVX-512 BF16, AMX) the bf16 one is emulated."""
    import time

    import torch

    torch.set_num_threads(1)
    out = {}
    for name, dtype in (("fp32", torch.float32), ("bf16", torch.bfloat16)):
        a, b = torch.randn(512, 256, dtype=dtype), torch.randn(256, 1024, dtype=dtype)
        a @ b
        start = time.perf_counter()
        for _ in range(10):
            a @ b
        out[name] = (time.perf_counter() - start) / 10 * 1e3
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


TIMELINE = """## One step on a timeline

`sudo python benchmarks/overlap_timeline.py` (same cluster, model and batch, 200 Mbit/s,
bf16-mixed with the matmuls at fp32 speed as in the suite above; 2026-11-25, after the
optimizer started stepping local shards): one training step on rank 0, after the warm-up,
with our own timestamps. *compute* is each GPT-2 block's forward (F) and backward (B);
*all-gather in flight* runs from the moment FSDP2 asks our comm object for a block's
parameters until its pending work's `wait()` returns; *waiting* is the part of that in
which the training thread was blocked; *reduce-scatter* shows the calls (instant where
deferred) and the wait for the deferred ones at the end of backward.

![overlap timeline](img/overlap_timeline.png)

The same step of `zeropp` with no link limit (`sudo python benchmarks/overlap_timeline.py
--rate unlimited --systems zeropp --png docs/img/overlap_timeline_unlimited.png --json
benchmarks/results/overlap_timeline_unlimited.json`, same day and code):

![overlap timeline, unlimited bandwidth](img/overlap_timeline_unlimited.png)

How to read it:
- Forward: with asynchronous unshards and two blocks of forward prefetch
  ([Note: prefetch] in engine/fsdp.py) each block's gather is issued while earlier blocks
  compute, yet the training thread still waits on each, {fwd_wait} s per block in
  `zeropp`'s step above. The link does not explain that: a block's int8 gather puts about 0.4 MB on each
  direction of the link, 17 ms at 200 Mbit/s, and the same step with no link limit at all
  (second figure) waits as long, {fwd_wait_unlimited} s per block. The waits are the peers: each
  hop is a rendezvous (the first with the same local rank on the other node, the second,
  run in `wait()`, with the other rank of this node), and on 2 shared cores a peer often
  reaches the block late (last point below).
  An experiment that ran that hop on the comm thread as soon as the first hop had landed
  changed the median step by +0.7% at 200 Mbit/s (6 rounds; per round 0.82-1.10x) and by
  +1.1% with no limit (5 rounds), so it was not kept.
- Backward: FSDP2 prefetches the previous block's gather from each block's pre-backward
  hook, so gathers overlap compute (with hpZ, `zeropp`'s stay inside the node). The
  reduce-scatters return at once ([Note: deferred reduce-scatter]) and run on the comm
  thread while backward goes on; what is left of them is waited for at the end of
  backward. For plain stage 3 that wait is the link still carrying the fp32 gradients
  (about 13 MB per step across at 200 Mbit/s, 0.28 s of link time alone); for `zeropp` it
  is the last blocks' and the root group's qgZ chains, which start only when their
  gradients exist.
- On 2 cores, *waiting* also contains waiting for the slowest peer: four ranks
  time-share two cores, so a rank that reaches a collective first waits for the others'
  compute. `zeropp`'s backward gathers cross no link at all, yet the training thread waits
  {bwd_wait} s on them: that is the peer finishing its own block. The end-of-backward
  wait for the deferred reduce-scatters was {end_wait} s in the step above and
  {end_wait_unlimited} s in the unlimited one. A GPU cluster does not have that term.
"""


def _waits(trace: dict) -> dict[str, list[float]]:
    """A traced step's waits, in seconds: per block in forward and in backward (the
    'waiting' events before and after the first backward compute), and the
    end-of-backward reduce-scatter wait."""
    events = trace["events"]
    first_b = min((e[2] for e in events if e[0] == "compute" and e[1].startswith("B")), default=None)
    if first_b is None:
        raise ValueError(f"volume.py: the {trace['system']} trace has no backward compute. "
                         "Fix: re-run benchmarks/overlap_timeline.py")
    waits = [(e[2], e[3] - e[2]) for e in events if e[0] == "waiting"]
    end = [e[3] - e[2] for e in events if e[0] == "reduce-scatter" and e[1] == "end of backward"]
    return {"forward": [w for t, w in waits if t < first_b], "backward": [w for t, w in waits if t >= first_b],
            "end": end}


def _span(values: list[float], what: str) -> str:
    if not values:
        raise ValueError(f"volume.py: the timeline JSON has no {what}. Fix: re-run benchmarks/overlap_timeline.py")
    lo, hi = min(values), max(values)
    return f"{lo:.2g}" if f"{lo:.2g}" == f"{hi:.2g}" else f"{lo:.2g}-{hi:.2g}"


def timeline_text(results_dir: Path) -> str:
    """TIMELINE with its figures read from overlap_timeline*.json (the zeropp trace of each)."""
    def zeropp(name: str) -> dict:
        path = results_dir / name
        if not path.exists():
            raise FileNotFoundError(f"volume.py: {path} is missing. Fix: run benchmarks/overlap_timeline.py "
                                    "(the commands are in the page's timeline section)")
        traces = [t for t in json.loads(path.read_text())["traces"] if t["system"] == "zeropp"]
        if not traces:
            raise ValueError(f"volume.py: {path} has no zeropp trace. Fix: re-run with --systems including zeropp")
        return _waits(traces[0])

    limited, unlimited = zeropp("overlap_timeline.json"), zeropp("overlap_timeline_unlimited.json")
    return TIMELINE.format(fwd_wait=_span(limited["forward"], "forward waits"),
                           fwd_wait_unlimited=_span(unlimited["forward"], "forward waits"),
                           bwd_wait=_span(limited["backward"], "backward waits"),
                           end_wait=_span(limited["end"], "end-of-backward wait"),
                           end_wait_unlimited=_span(unlimited["end"], "end-of-backward wait"))


def _cell(results: dict, key: str) -> dict | None:
    c = results.get(key)
    return c if c and "step_s" in c else None


EARLIER = {"date": "2026-11-23", "commit": "332d460"}  # volume_bf16.json predates the JSON's "meta"


def render(results: dict, docs: Path, command: str, params: int, earlier: Sequence[dict] = ()) -> str:
    """The page: ``results`` (the newest suite), ``earlier`` (older suites' JSON, newest first),
    the parts, the timeline."""
    lines = ["# Communication volume and overlap, bf16-mixed (issue 18)", "",
             "<!-- generated by benchmarks/volume.py; edit the script, not this file -->", ""]
    for data in (results, *earlier):
        if data:
            lines += _suite_lines(data, command, params)
    lines += render_parts(docs_results_dir(docs))
    lines += ["", timeline_text(docs_results_dir(docs))]
    text = "\n".join(lines) + "\n"
    docs.parent.mkdir(parents=True, exist_ok=True)
    docs.write_text(text)
    return text


def _suite_lines(data: dict, command: str, params: int) -> list[str]:
    setting = (f"GPT-2 4 x 256 ({params / 1e6:.2f}M parameters), micro-batch 4 x 128 per rank, AdamW, "
               "`precision=\"bf16-mixed\"`; DeepSpeed ZeRO-3 in its bf16 mode (bf16 gradient reduce). Cross-node "
               "bytes: the veth's TX+RX kernel counters per step (payload plus TCP/IP headers). Step time: median of "
               "the steps after the warm-up, then the median over runs; the range of the runs is shown.")
    if "meta" in data:
        meta, results = data["meta"], data["cells"]
        rounds = _rounds(data)
        mm = meta["matmul_ms"]
        then = "".join(f" Then `{m['command']} --repeat {m['repeat']}` ({m['date']}, commit {m['commit']}), which "
                       "added rounds of those cells to the same JSON." for m in meta.get("appended", []))
        note = f", {meta['title_note']}" if meta.get("title_note") else ""
        lines = [f"## The suite on this project's CPU, bf16 matmuls at fp32 speed ({meta['date']}{note})", "",
                 f"Command: `{meta['command']} --repeat {meta.get('repeat', rounds)}` (as root), {meta['date']}, "
                 f"commit {meta['commit']}.{then} "
                 f"Hardware: {meta['hardware']}; all 4 ranks (2 network namespaces x 2 ranks, gloo) share the "
                 f"cores. {setting}" + _load_note(results, rounds), ""]
        if meta.get("bf16_matmul") == "fp32":
            lines += [f"`--bf16-matmul fp32`: this CPU (torch capability {meta['cpu_capability']}, no AVX-512 BF16 "
                      f"or AMX) has no bf16 matmul instructions; a (512 x 256) @ (256 x 1024) takes {mm['bf16']:.0f} "
                      f"ms in bf16 against {mm['fp32']:.1f} ms in fp32 (one thread, measured at the start of the run), "
                      "which makes a bf16-mixed step all compute. Every system therefore ran with "
                      "`benchmarks/bf16_matmul.py`'s `fp32_matmuls()`, which computes each bf16 matmul and "
                      "attention in fp32 from bf16-rounded operands and rounds the result to bf16, as bf16 hardware "
                      "does. Parameters, activations, gradients and every collective keep their bf16-mixed dtypes, "
                      "so the bytes on the wire are a bf16-mixed run's; only the matmuls run at fp32 speed (one "
                      "process, forward + backward: 0.21 s, against 0.22 s in fp32 and 3.6 s with torch's bf16 "
                      "kernels; `python benchmarks/bf16_matmul.py`).", ""]
    else:
        results = data
        lines = [f"## The suite on a CPU with native bf16 matmuls ({EARLIER['date']}, commit {EARLIER['commit']})",
                 "",
                 f"Command: `{command}` (as root; today `{command} --bf16-matmul native`). Hardware: x86_64 VM, 2 "
                 "CPU cores, no GPU; all 4 "
                 f"ranks (2 network namespaces x 2 ranks, gloo) share the 2 cores. {setting} About 1.1 s per "
                 "bf16-mixed ddp step: this run's CPU multiplied bf16 natively (the machine of the sections "
                 "above and below does not), and the code was older (commit above); compare ratios within a "
                 "section only.", ""]
    lines += ["| cell | step s (runs) | cross-node MB/step (veth) | vs ddp | formula MB | veth / formula | "
              "NCCL-ideal MB (est.) |",
              "|---|---|---:|---:|---:|---:|---:|"]
    ddp = _cell(results, "200mbit/ddp")
    for key, cell in results.items():
        if "step_s" not in cell:
            lines.append(f"| {key} | failed: {cell.get('error', '?')} | | | | | |")
            continue
        system = key.split("/", 1)[1]
        veth = cell["veth_bytes_per_step"]
        f = formula_bytes(system, params)
        ideal = nccl_ideal_bytes(system, veth, params)
        runs = ", ".join(f"{v:.3f}" for v in cell.get("step_s_runs", [cell["step_s"]]))
        vs = f"{veth / ddp['veth_bytes_per_step']:.2f}x" if ddp and key.startswith("200mbit") else "-"
        lines.append(f"| {key} | {cell['step_s']:.3f} ({runs}) | {veth / MB:.2f} | {vs} | "
                     + (f"{f / MB:.2f} | {veth / f:.2f} | " if f else "- | - | ")
                     + (f"{ideal / MB:.2f} |" if ideal is not None else "- |"))
    lines += ["", "*NCCL-ideal* estimates a peer's bytes with a native reduce-scatter: gloo has none, "
              "so DeepSpeed and FSDP2 reduce-scatter through an all-reduce and send the gradient bytes "
              "twice (assumed: DeepSpeed reduces bf16 gradients in one such all-reduce per step, "
              "FSDP2 fp32 ones); the column subtracts what that adds on the ring (2 node-crossing links x 3/4 x the "
              "reduce dtype's bytes x parameters). Our systems use all-to-all and need no correction. An "
              "estimate from a formula, not a measurement."]
    lines += ["", "Targets:", "", "| target | measured | met |", "|---|---:|:---:|"]

    def ratio(a: str, b: str, field: str = "step_s") -> float | None:
        x, y = _cell(results, a), _cell(results, b)
        return x[field] / y[field] if x and y else None

    checks = [(f"cross-node bytes: {s} <= 1.05 x ddp", ratio(f"200mbit/{s}", "200mbit/ddp", "veth_bytes_per_step"),
               1.05) for s in ("zeropp_stage_1", "zeropp_stage_2", "zeropp_stage_3")]
    checks += [
        ("200 Mbit/s: zeropp_stage_3_bf16 step <= 1.0 x DeepSpeed ZeRO-3",
         ratio("200mbit/zeropp_stage_3_bf16", "200mbit/deepspeed_zero3"), 1.0),
        ("200 Mbit/s: zeropp step <= 0.5 x DeepSpeed ZeRO-3", ratio("200mbit/zeropp", "200mbit/deepspeed_zero3"), 0.5),
        ("zeropp at 200 Mbit/s <= 1.15 x its unlimited step", ratio("200mbit/zeropp", "unlimited/zeropp"), 1.15),
        ("unlimited: zeropp <= 1.05 x zeropp_stage_3", ratio("unlimited/zeropp", "unlimited/zeropp_stage_3"), 1.05),
    ]
    for name, value, bound in checks:
        lines.append(f"| {name} | {value:.2f}x | {'yes' if value <= bound else 'no'} |" if value is not None
                     else f"| {name} | - | - |")
    for s in ("zeropp_stage_1", "zeropp_stage_2", "zeropp_stage_3"):
        c, f = _cell(results, f"200mbit/{s}"), formula_bytes(s, params)
        if c and f:
            within = abs(c["veth_bytes_per_step"] / f - 1) <= 0.10
            lines.append(f"| cross-node bytes: {s} within 10% of its formula | "
                         f"{c['veth_bytes_per_step'] / f:.2f}x | {'yes' if within else 'no'} |")
    if "runs" in data:
        lines += _paired_lines(data["runs"])
    lines += _limits_lines(results, params)
    return lines + [""]


def _limits_lines(results: dict, params: int) -> list[str]:
    """What bounds zeropp's ratio to DeepSpeed here: its own step with no link limit at all."""
    zpp, zpp_free = _cell(results, "200mbit/zeropp"), _cell(results, "unlimited/zeropp")
    ds, ds_free = _cell(results, "200mbit/deepspeed_zero3"), _cell(results, "unlimited/deepspeed_zero3")
    if not (zpp and zpp_free and ds):
        return []
    # The veth counts TX+RX; the two nodes send alike and tc shapes each direction to the
    # rate, so the link needs half the counted bytes' time, both directions at once.
    link_s = {k: c["veth_bytes_per_step"] / 2 * 8 / 200e6 for k, c in (("zeropp", zpp), ("ds", ds))}
    shown = zpp["step_s"] - zpp_free["step_s"]
    if shown <= 0.05 * zpp_free["step_s"]:
        hidden = "all hidden"
    elif shown >= 0.9 * link_s["zeropp"]:
        hidden = f"and the step grows by {shown:.2f} s, as much as the link time: at these medians the transfer is not hidden"
    else:
        hidden = f"and the step grows by {shown:.2f} s"
    text = (f"What bounds `zeropp` against DeepSpeed here: with no link limit at all a `zeropp` step takes "
            f"{zpp_free['step_s']:.3f} s, the compute of 4 ranks on 2 cores plus the CPU work of the collectives, "
            f"and at 200 Mbit/s {zpp['step_s']:.3f} s: its {zpp['veth_bytes_per_step'] / MB:.1f} MB per step "
            f"(TX+RX, half of it each way; tc shapes each direction) need {link_s['zeropp']:.2f} s of link, "
            f"{hidden}. Against DeepSpeed's {ds['step_s']:.3f} s at 200 Mbit/s, "
            f"that unlimited step alone is {zpp_free['step_s'] / ds['step_s']:.2f}x, so no change to the "
            "communication can bring the 200 Mbit/s ratio below it on the machine of this section.")
    if ds_free:
        text += (f" DeepSpeed's own step is {ds_free['step_s']:.3f} s unlimited and {ds['step_s']:.3f} s at 200 "
                 f"Mbit/s, where its {ds['veth_bytes_per_step'] / MB:.1f} MB per step need {link_s['ds']:.2f} s of "
                 "link.")
    ideal = nccl_ideal_bytes("deepspeed_zero3", ds["veth_bytes_per_step"], params)
    ideal_s = ideal / 2 * 8 / 200e6
    text += (" Where compute is much faster than this link (GPUs on 200 Mbit/s between nodes), a step tends to its "
             f"link time, and the ratio to the ratio of the bytes: {link_s['zeropp']:.2f} s against "
             f"{link_s['ds']:.2f} s, {link_s['zeropp'] / link_s['ds']:.2f}x as measured here, or against "
             f"{ideal_s:.2f} s with DeepSpeed's NCCL-ideal bytes ({ideal / MB:.1f} MB, the table's last column), "
             f"{link_s['zeropp'] / ideal_s:.2f}x: the fairer figure for a GPU cluster. Both are estimates from "
             "bytes, not measurements.")
    return ["", text]


PAIRS = [("200mbit/zeropp", "200mbit/deepspeed_zero3"), ("200mbit/zeropp", "unlimited/zeropp"),
         ("unlimited/zeropp", "unlimited/zeropp_stage_3"), ("unlimited/zeropp", "unlimited/deepspeed_zero3"),
         ("200mbit/deepspeed_zero3", "unlimited/deepspeed_zero3")]


def _paired_lines(runs: dict[str, list[dict]]) -> list[str]:
    """Each step-time ratio round by round: the two cells of a round ran minutes apart, under one load."""
    rows = []
    for a, b in PAIRS:
        ratios = [x["step_s"] / y["step_s"] for x, y in zip(runs.get(a, []), runs.get(b, []))
                  if "step_s" in x and "step_s" in y]
        if ratios:
            rows.append(f"| {a} / {b} | {statistics.median(ratios):.2f}x | "
                        f"{', '.join(f'{r:.2f}' for r in ratios)} |")
    if not rows:
        return []
    return ["", "The same step-time ratios taken round by round (each round runs every cell once, so the two "
            "cells of a ratio ran minutes apart under the same load), then their median:", "",
            "| ratio | median | per round |", "|---|---:|---|", *rows]


def docs_results_dir(docs: Path) -> Path:  # noqa: ARG001 - the parts' JSON always lives here
    return ROOT / "benchmarks" / "results"


def _load_note(cells: dict, rounds: int) -> str:
    loads = [x for c in cells.values() for x in c.get("load_avg_1min_at_start", [])]
    if not loads:
        return ""
    return (f" The 1-minute load average at the start of the runs was {min(loads):.1f}-{max(loads):.1f}: our "
            "own 4 ranks on 2 cores account for about 4 of it, and what is above that is the previous cell's "
            "processes still exiting or other jobs, so absolute times are noisy; each cell ran "
            f"{rounds} times, in rounds (every cell once per round), and the median and the range of the runs "
            "are shown.")


def _runs(cell: dict) -> str:
    runs = cell["step_s_runs"]
    return f"{cell['step_s']:.3f} ({min(runs):.3f}-{max(runs):.3f}, {len(runs)} runs)"


def _rounds(data: dict) -> int:
    return max((len(r) for r in data.get("runs", {}).values()), default=0)


def render_parts(results_dir: Path) -> list[str]:
    """The sections of --part stage1 and --part sizes, from their JSON when it exists."""
    lines: list[str] = []
    for part, title in (("stage1", "Stage 1 against DDP at 200 Mbit/s: the post-step gather overlapped"),
                        ("sizes", "Step time for two model sizes at 1 Gbit/s")):
        path = results_dir / PART_FILES[part]
        if not path.exists():
            continue
        data = json.loads(path.read_text())
        meta, cells = data["meta"], data["cells"]
        rate = meta["rate"]
        lines += ["", f"## {title}", "",
                  f"Command: `{meta['command']} --repeat {_rounds(data)}` (as root), {meta['date']}, commit "
                  f"{meta['commit']}. Hardware: "
                  f"{meta['hardware']}; 2 nodes x 2 ranks (gloo) on the simulated cluster, the veth at {rate}; "
                  f"`precision=\"{meta.get('precision', 'bf16-mixed')}\"`, AdamW, micro-batch {meta['batch']} x 128 "
                  f"per rank, {meta['steps']} steps of which "
                  f"the first {meta['warmup']} are warm-up." + _load_note(cells, _rounds(data)), ""]
        roles = []
        if "AFTER" in meta["command"]:
            roles.append("AFTER is a copy of the measured tree's `zeropp_strategy/`, taken when the part started "
                         "so that other work in the tree could not change it mid-run")
        if "BEFORE" in meta["command"]:
            roles.append("BEFORE is the same copy with `engine/stage1.py` from commit " + meta["commit"].split()[0]
                         + " (`git show HEAD:zeropp_strategy/engine/stage1.py`), whose `step()` waited for its "
                         "gathers")
        if roles:
            lines += ["; ".join(roles) + ".", ""]
        mm = meta.get("matmul_ms")
        if meta.get("precision") == "32-true" and mm:
            lines += [f"Why `32-true` and not `bf16-mixed`: this CPU (torch capability {meta['cpu_capability']}, no "
                      f"AVX-512 BF16 or AMX) emulates bf16 matmuls: a (512 x 256) @ (256 x 1024) takes "
                      f"{mm['bf16']:.0f} ms in bf16 against {mm['fp32']:.1f} ms in fp32 (one thread, measured at "
                      "the start of this part), so a bf16-mixed step of the small model takes about 10 s, all "
                      "compute, and no link speed shows. (The suite's first section runs bf16-mixed with its matmuls at "
                      "fp32 speed instead; its section on a CPU with native bf16 ran on another machine.) Compare "
                      "ratios within a section only.", ""]
        if part == "stage1":
            lines += [
                "`zeropp_stage_1`: the default, `step()` gathers the buckets one after another and waits for "
                "each (since 2026-11-27 at most `GATHER_WINDOW_BYTES` = 4 MiB gathered per bucket, through one "
                "reused pair of buffers: the model's 13 MB go in 4; docs/stages.md, resident memory of stage 1). "
                "`zeropp_stage_1_overlap`: "
                "`overlap_param_gather=True`, the gathers finish under the next forward. The `OVERLAP_BUCKETS = 1` "
                "and `16` rows are the experiment behind its value 8 (`bench_train.py --overlap-buckets N`; buckets "
                "are whole parameters of at least 1 MiB, hence 12 and 22 buckets rather than 8 and 16).", "",
                "| system | step s, median (range) | vs ddp | cross-node MB/step (veth) |",
                "|---|---|---:|---:|"]
            ddp = cells.get(f"{rate}/small/ddp", {})
            for system, label in (("ddp", "ddp"), ("zeropp_stage_1", "zeropp_stage_1 (synchronous gather, the default)"),
                                  ("zeropp_stage_1_overlap", "zeropp_stage_1_overlap (OVERLAP_BUCKETS = 8: 12 buckets)"),
                                  ("zeropp_stage_1_overlap#1", "zeropp_stage_1_overlap, OVERLAP_BUCKETS = 1: 1 bucket"),
                                  ("zeropp_stage_1_overlap#16", "zeropp_stage_1_overlap, OVERLAP_BUCKETS = 16: 22 buckets")):
                c = cells.get(f"{rate}/small/{system}", {})
                if "step_s" not in c:
                    lines.append(f"| {label} | {c.get('error') or c.get('skipped') or 'not run'} | | |")
                    continue
                vs = f"{c['step_s'] / ddp['step_s']:.2f}x" if "step_s" in ddp else "-"
                lines.append(f"| {label} | {_runs(c)} | {vs} | {c['veth_bytes_per_step'] / MB:.2f} |")
            continue
        for size, label in (("small", "GPT-2 small, 4 x 256, 3.3M parameters"),
                            ("medium", "GPT-2 medium, 8 x 512, 25.5M parameters")):
            lines += ["", f"### {label}", "",
                      "| system | step s, median (range) | vs ddp | vs zeropp_stage_3 | vs DeepSpeed ZeRO-3 | "
                      "cross-node MB/step (veth) | loss |", "|---|---|---:|---:|---:|---:|---:|"]
            ref = {name: cells.get(f"{rate}/{size}/{name}", {}) for name in ("ddp", "zeropp_stage_3", "deepspeed_zero3")}
            for system in PARTS["sizes"][2]:
                c = cells.get(f"{rate}/{size}/{system}", {})
                if "step_s" not in c:
                    lines.append(f"| {system} | {c.get('error') or c.get('skipped') or 'not run'} | | | | | |")
                    continue
                ratios = [f"{c['step_s'] / r['step_s']:.2f}x" if "step_s" in r else "-" for r in ref.values()]
                lines.append(f"| {system} | {_runs(c)} | {' | '.join(ratios)} | "
                             f"{c['veth_bytes_per_step'] / MB:.2f} | {c['loss']:.4f} |")
    return lines


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
                        help="--part stage1: a folder holding the zeropp_strategy package to compare against")
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

"""The page of benchmarks/volume.py (docs/benchmarks_volume.md by default, ``--docs``): the suite's
tables and targets from its results JSON, the sections of ``--part stage1`` and ``--part sizes``,
and the timeline section from benchmarks/overlap_timeline.py's JSON. Imported by
benchmarks/volume.py, which writes the page after every run and with ``--render-only``.
"""

from __future__ import annotations

import json
import statistics
from collections.abc import Sequence
from pathlib import Path

from benchmarks.volume_cells import MB, PART_FILES, PARTS, formula_bytes, nccl_ideal_bytes

ROOT = Path(__file__).resolve().parents[1]


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
        hidden = (f"and the step grows by {shown:.2f} s, as much as the link time: at these medians the transfer is "
                  "not hidden")
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
    return (f" The 1-minute load average at the start of the runs was {min(loads):.1f}-{max(loads):.1f}. It "
            "counts runnable threads, and each rank runs dozens beside its training thread (43 in a zeropp "
            "rank, gloo's among them): on a machine running nothing else, this benchmark's own cells took it "
            "from 1 to about 10 (2026-11-29), "
            "so it says little about other jobs. Absolute times are noisy; each cell ran "
            f"{rounds} times, in rounds (every cell once per round), and the median and the range of the runs "
            "are shown.")


def _runs(cell: dict) -> str:
    runs = cell["step_s_runs"]
    return f"{cell['step_s']:.3f} ({min(runs):.3f}-{max(runs):.3f}, {len(runs)} runs)"


def _rounds(data: dict) -> int:
    return max((len(r) for r in data.get("runs", {}).values()), default=0)


def _ratio_row(system: str, c: dict, refs: list[dict]) -> str:
    """A table row: the cell's step (median and range), its ratio to each reference cell
    that ran, its veth bytes and loss; or why it has none."""
    if "step_s" not in c:
        return f"| {system} | {c.get('error') or c.get('skipped') or 'not run'} |" + " |" * (len(refs) + 2)
    ratios = [f"{c['step_s'] / r['step_s']:.2f}x" if "step_s" in r else "-" for r in refs]
    return f"| {system} | {_runs(c)} | {' | '.join(ratios)} | {c['veth_bytes_per_step'] / MB:.2f} | {c['loss']:.4f} |"


def _delta_lines(results_dir: Path) -> list[str]:
    """The section of the --part delta_* runs (issue 35: the zeropp_delta preset at 50 and
    200 Mbit/s, beside zeropp, DeepSpeed ZeRO-3 and DDP), from their JSON when all exist."""
    parts = ("delta_50mbit", "delta_unlimited", "delta_200mbit")
    paths = [results_dir / PART_FILES[part] for part in parts]
    if not all(path.exists() for path in paths):
        return []
    slow, free, mid = (json.loads(path.read_text()) for path in paths)
    cell = lambda data, key: data["cells"].get(key, {})  # noqa: E731
    lines = ["", "## Beyond ZeRO++: `zeropp_delta` at 50 and 200 Mbit/s (issue 35)", "",
             "The `zeropp_delta` preset (weight deltas in 2-bit codes, bf16 block scales; docs/zeropp.md, \"Weight "
             "deltas\") beside `zeropp`, on the simulated cluster and model of the suite above, bf16-mixed, on "
             "the CPU each run names (compare ratios within a table). Commands (as root; "
             "the last needs deepspeed): " + ", ".join(f"`{d['meta']['command']} --repeat {_rounds(d)}`"
                                                      for d in (slow, free, mid)) + ". Runs: "
             + ", ".join(f"{d['meta']['date']} at {d['meta']['commit']} (torch CPU capability "
                         f"{d['meta'].get('cpu_capability', '?')})" for d in (slow, free, mid))
             + f". Hardware: {mid['meta']['hardware']}. Each cell ran once per round; the median and the range "
             "of the runs are shown.", "",
             "| system | 50 Mbit/s step s | unlimited step s | 50 Mbit/s / unlimited | cross-node MB/step at 50 "
             "Mbit/s (veth) | loss after 16 steps (unlimited) |", "|---|---|---|---:|---:|---:|"]

    def step(c: dict) -> str:
        return _runs(c) if "step_s" in c else c.get("error") or c.get("skipped") or "-"

    for system in PARTS["delta_unlimited"][2]:
        a, b = cell(slow, f"50mbit/small/{system}"), cell(free, f"unlimited/small/{system}")
        ratio = f"{a['step_s'] / b['step_s']:.2f}x" if "step_s" in a and "step_s" in b else "-"
        veth = (f"{a['veth_bytes_per_step'] / MB:.2f}" if "step_s" in a else
                f"{b['veth_bytes_per_step'] / MB:.2f} (unlimited)" if "step_s" in b else "-")
        loss = f"{b['loss']:.4f}" if "step_s" in b else "-"
        lines.append(f"| {system} | {step(a)} | {step(b)} | {ratio} | {veth} | {loss} |")
    refs = {name: cell(mid, key) for name, key in (("DeepSpeed ZeRO-3", "200mbit/small/deepspeed_zero3"),
                                                    ("zeropp", "200mbit/small/zeropp"),
                                                    ("DDP, no link limit", "unlimited/small/ddp"))}
    lines += ["", "| system at 200 Mbit/s | step s | " + " | ".join(f"vs {name}" for name in refs)
              + " | cross-node MB/step (veth) | loss |", "|---|---|---:|---:|---:|---:|---:|"]
    for system, key in (("ddp (no link limit)", "unlimited/small/ddp"),
                        ("deepspeed_zero3", "200mbit/small/deepspeed_zero3"),
                        ("zeropp", "200mbit/small/zeropp"), ("zeropp_delta", "200mbit/small/zeropp_delta")):
        lines.append(_ratio_row(system, cell(mid, key), list(refs.values())))
    lines += ["", "The losses after 16 steps compare our systems with each other (all build the model in "
              "`configure_model()` on the meta device: one init), not with DDP's and DeepSpeed's real builds: "
              "on meta a Hugging Face model gets its own init's distributions but not a real build's draws "
              "(docs/strategy.md, \"Meta-device initialisation\"), so ours start from other values. The "
              "200-step losses, over 6 seeds, are in docs/zeropp_measurements.md."]
    return lines + ["", "Targets and what limits them on 2 cores: docs/zeropp_measurements.md, \"Weight deltas\"."]


def render_parts(results_dir: Path) -> list[str]:
    """The sections of --part stage1, --part sizes and the --part delta_* runs, from their
    JSON when it exists."""
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
                      "compute, and no link speed shows. (The suite's first section runs bf16-mixed with its matmuls "
                      "at fp32 speed instead; its section on a CPU with native bf16 ran on another machine.) Compare "
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
            for system, label in (
                    ("ddp", "ddp"), ("zeropp_stage_1", "zeropp_stage_1 (synchronous gather, the default)"),
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
            ref = {name: cells.get(f"{rate}/{size}/{name}", {})
                   for name in ("ddp", "zeropp_stage_3", "deepspeed_zero3")}
            for system in PARTS["sizes"][2]:
                lines.append(_ratio_row(system, cells.get(f"{rate}/{size}/{system}", {}), list(ref.values())))
    return lines + _delta_lines(results_dir)

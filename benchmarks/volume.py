"""Issue 18's side-by-side run: communication volume and step time as users train (bf16-mixed).

    sudo python benchmarks/volume.py                          # 3 runs per cell, about 35 min
    sudo python benchmarks/volume.py --repeat 1 --out /tmp/v.json --docs /tmp/v.md   # a quick look
    sudo python benchmarks/volume.py --package-root ../before  # the same cells on another checkout
    python benchmarks/volume.py --render-only

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
import json
import platform
import statistics
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from benchmarks.run import run_cell  # noqa: E402

CELLS = {
    "200mbit": ["ddp", "zeropp_stage_1", "zeropp_stage_2", "zeropp_stage_3", "zeropp_stage_3_bf16", "zeropp",
                "deepspeed_zero3"],
    "unlimited": ["zeropp_stage_3", "zeropp"],
}
MB = 1e6


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


def run(args: argparse.Namespace) -> dict:
    from benchmarks.simcluster import SimCluster

    results = json.loads(args.out.read_text()) if args.out.exists() else {}
    for rate, systems in CELLS.items():
        with SimCluster(rate=rate) as cluster:
            for system in systems:
                runs = [run_cell(cluster, system, args) for _ in range(args.repeat)]
                ok = [c for c in runs if "step_s" in c]
                cell = dict(ok[0] if ok else runs[0])
                if ok:
                    cell["step_s_runs"] = [c["step_s"] for c in ok]
                    cell["step_s"] = statistics.median(cell["step_s_runs"])
                    cell["veth_bytes_per_step"] = statistics.median(c["veth_bytes_per_step"] or 0 for c in ok)
                results[f"{rate}/{system}"] = cell
                args.out.parent.mkdir(parents=True, exist_ok=True)
                args.out.write_text(json.dumps(results, indent=1))
                print(f"{rate}/{system}: " + (f"{cell['step_s']:.3f} s/step {cell['step_s_runs']}, "
                      f"{cell['veth_bytes_per_step'] / MB:.2f} MB/step" if ok else f"FAILED {cell.get('error')}"),
                      flush=True)
    return results


TIMELINE = """## One step on a timeline

`sudo python benchmarks/overlap_timeline.py` (same cluster, model and batch, 200 Mbit/s): one
training step on rank 0, after the warm-up, with our own timestamps. *compute* is each GPT-2
block's forward (F) and backward (B); *all-gather in flight* runs from the moment FSDP2 asks
our comm object for a block's parameters until its pending work's `wait()` returns;
*waiting* is the part of that in which the training thread was blocked; *reduce-scatter*
shows the calls (instant where deferred) and the wait for the deferred ones at the end of
backward.

![overlap timeline](img/overlap_timeline.png)

How to read it:
- Forward: with asynchronous unshards and two blocks of forward prefetch
  ([Note: prefetch] in engine/fsdp.py) each block's gather is issued while earlier blocks
  compute. At 200 Mbit/s a block's forward computes in less time than its gather takes on
  the link, so the training thread still waits part of each gather: the link is the
  bottleneck there, not the schedule.
- Backward: FSDP2 prefetches the previous block's gather from each block's pre-backward
  hook, so gathers overlap compute. The reduce-scatters return at once ([Note: deferred
  reduce-scatter]) and run on the comm thread while backward goes on; what is left of
  them is waited for at the end of backward. For plain stage 3 that wait is the link
  still carrying the fp32 gradients (about 13 MB per step across at 200 Mbit/s, 0.28 s of
  link time alone); for `zeropp` it is mostly qgZ's quantization on a CPU whose two cores
  already run four ranks.
- On 2 cores, *waiting* also contains waiting for the slowest peer: four ranks
  time-share two cores, so a rank that reaches a collective first waits for the others'
  compute. A GPU cluster does not have that term.
"""


def _cell(results: dict, key: str) -> dict | None:
    c = results.get(key)
    return c if c and "step_s" in c else None


def render(results: dict, docs: Path, command: str, params: int) -> str:
    lines = ["# Communication volume and overlap, bf16-mixed (issue 18)", "",
             "<!-- generated by benchmarks/volume.py; edit the script, not this file -->", "",
             f"Command: `{command}` (as root). Hardware: {platform.machine()} VM, 2 CPU cores, no GPU; all 4 "
             "ranks (2 network namespaces x 2 ranks, gloo) share the 2 cores. GPT-2 4 x 256 "
             f"({params / 1e6:.2f}M parameters), micro-batch 4 x 128 per rank, AdamW, `precision=\"bf16-mixed\"`; "
             "DeepSpeed ZeRO-3 in its bf16 mode (bf16 gradient reduce). Cross-node bytes: the veth's "
             "TX+RX kernel counters per step (payload plus TCP/IP headers). Step time: median of the steps "
             "after the warm-up, then the median over runs; the range of the runs is shown.", "",
             "| cell | step s (runs) | cross-node MB/step (veth) | vs ddp | formula MB | veth / formula |",
             "|---|---|---:|---:|---:|---:|"]
    ddp = _cell(results, "200mbit/ddp")
    for key, cell in results.items():
        if "step_s" not in cell:
            lines.append(f"| {key} | failed: {cell.get('error', '?')} | | | | |")
            continue
        system = key.split("/", 1)[1]
        veth = cell["veth_bytes_per_step"]
        f = formula_bytes(system, params)
        runs = ", ".join(f"{v:.3f}" for v in cell.get("step_s_runs", [cell["step_s"]]))
        vs = f"{veth / ddp['veth_bytes_per_step']:.2f}x" if ddp and key.startswith("200mbit") else "-"
        lines.append(f"| {key} | {cell['step_s']:.3f} ({runs}) | {veth / MB:.2f} | {vs} | "
                     f"{f / MB:.2f} | {veth / f:.2f} |" if f else
                     f"| {key} | {cell['step_s']:.3f} ({runs}) | {veth / MB:.2f} | {vs} | - | - |")
    lines += ["", "## Targets", "", "| target | measured | met |", "|---|---:|:---:|"]

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
    lines += ["", TIMELINE]
    text = "\n".join(lines) + "\n"
    docs.parent.mkdir(parents=True, exist_ok=True)
    docs.write_text(text)
    return text


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
    parser.add_argument("--out", type=Path, default=ROOT / "benchmarks" / "results" / "volume_bf16.json")
    parser.add_argument("--docs", type=Path, default=ROOT / "docs" / "benchmarks_volume.md")
    parser.add_argument("--render-only", action="store_true")
    args = parser.parse_args()
    args.size, args.precision, args.nproc_per_node, args.cell_timeout_s = "small", "bf16-mixed", 2, 600
    results = json.loads(args.out.read_text()) if args.render_only else run(args)
    print(render(results, args.docs, "python benchmarks/volume.py", gpt2_params()))


if __name__ == "__main__":
    main()

"""``zeropp plan`` against measured runs on the simulated 2x2 cluster: bytes, memory, step time.

    sudo python benchmarks/plan_accuracy.py --repeat 2     # about 25 minutes on 2 cores
    python benchmarks/plan_accuracy.py --render-only       # the tables again, from the JSON

Every cell is one ``benchmarks/bench_train.py`` job on ``benchmarks/simcluster.py``'s 2
namespaces x 2 ranks (GPT-2 4 x 256, micro-batch 4 x 128 per rank, ``bf16-mixed``, AdamW,
the model built in ``configure_model`` under the Trainer), at the link rates of ``CELLS``.
The plan prices the same model the way ``zeropp plan`` prices a user's: its config.json
written to a folder and read back (``estimate.model_shape``, activations traced), each
system's ``ZeroConfig`` resolved for 2 nodes x 2 ranks (``plan.resolve``) and costed
(``cost.cost``) on a cluster whose link is the cell's rate.

Compared, per system: cross-node bytes per step (the ledger's, summed over the ranks),
model states per rank (storage bytes of parameters, gradients and optimizer state after a
step, ``engine.memory.memory_stats``), activations per rank (what the first training
forward saved for backward, the memory plan's ``ActivationMeter``) and the step time.

The step time needs one calibration, this machine's compute rate: ``6 P`` FLOPs per token
over DDP's measured step at unlimited bandwidth (the cell ``unlimited/ddp``), the only
fitted number. Every other cell is a prediction. The link is the cell's rate times
1448/1514 (tbf counts whole frames: the TCP payload's share of a full one); the in-node
hops are taken as free (loopback).
"""

from __future__ import annotations

import argparse
import datetime
import json
import math
import os
import platform
import statistics
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from benchmarks.bench_train import gpt2, ours_fields  # noqa: E402
from benchmarks.run import run_cell  # noqa: E402

CELLS = {
    "unlimited": ["ddp", "zeropp_stage_3", "zeropp", "zeropp_delta"],
    "200mbit": ["ddp", "zeropp_stage_1", "zeropp_stage_2", "zeropp_stage_3", "zeropp"],
    "50mbit": ["zeropp_stage_3", "zeropp", "zeropp_delta"],
    # where the plan recommends zeropp_delta on this model (issue 35's slow links)
    "12mbit": ["zeropp", "zeropp_delta"],
}
# Memory: one short run per system with bf16 matmuls as they are (``--bf16-matmul native``):
# the fp32 stand-in the timed cells use keeps fp32 copies for backward that a bf16 run does
# not (56.6 MiB saved per rank under DDP against 40.1 MiB natively, measured).
MEMORY = ["ddp", "zeropp_stage_1", "zeropp_stage_2", "zeropp_stage_3", "zeropp", "zeropp_delta"]
CALIBRATION = "unlimited/ddp"
PAYLOAD = 1448 / 1514  # TCP payload of a full Ethernet frame
RESULTS = ROOT / "benchmarks" / "results" / "plan_accuracy.json"
MB, MiB = 1e6, 2**20


def run(args: argparse.Namespace) -> dict:
    """The memory cells once, then every timed cell once per round, ``--repeat`` rounds."""
    from benchmarks.simcluster import SimCluster

    earlier = json.loads(args.out.read_text()) if args.memory_only and args.out.exists() else {}
    runs: dict[str, list[dict]] = earlier.get("runs") or {f"{rate}/{s}": [] for rate, ss in CELLS.items() for s in ss}
    meta = earlier.get("meta") or {
        "command": "python benchmarks/plan_accuracy.py " + " ".join(sys.argv[1:]),
        "date": datetime.date.today().isoformat(),
        "hardware": f"{platform.machine()} VM, {os.cpu_count()} CPU cores, no GPU",
        "steps": args.steps, "warmup": args.warmup, "batch": args.batch, "bf16_matmul": args.bf16_matmul}
    memory: dict[str, dict] = {}
    with SimCluster(rate="unlimited") as cluster:
        # at the batch the timed cells ran with (render plans at meta's batch)
        short = argparse.Namespace(**{**vars(args), "bf16_matmul": "native", "steps": 2, "warmup": 0,
                                      "batch": meta["batch"]})
        for system in MEMORY:
            memory[system] = run_cell(cluster, system, short)
            print(f"memory/{system}: " + ("done" if "step_s" in memory[system] else memory[system].get("error")),
                  flush=True)
    for round_ in range(0 if args.memory_only else args.repeat):
        for rate, systems in CELLS.items():
            with SimCluster(rate=rate) as cluster:
                for system in systems:
                    cell = run_cell(cluster, system, args)
                    runs[f"{rate}/{system}"].append(cell)
                    print(f"round {round_ + 1}/{args.repeat} {rate}/{system}: " + (
                        f"{cell['step_s']:.3f} s/step" if "step_s" in cell else f"FAILED {cell.get('error')}"),
                        flush=True)
                    args.out.write_text(json.dumps({"meta": meta, "runs": runs, "memory": memory}, indent=1))
    args.out.write_text(json.dumps({"meta": meta, "runs": runs, "memory": memory}, indent=1))
    return {"meta": meta, "runs": runs, "memory": memory}


def _rate_bytes(rate: str) -> float:
    from benchmarks.simcluster import parse_rate_bit_s

    bits = parse_rate_bit_s(rate)
    return math.inf if bits is None else bits / 8 * PAYLOAD


def _model(batch: int):
    """GPT-2 small as ``zeropp plan`` reads a user's model (a config.json folder, activations
    traced), and the workload of a cell."""
    from zeropp_strategy.estimate import model_shape, with_traced_activations
    from zeropp_strategy.cost import Workload

    with tempfile.TemporaryDirectory() as folder:
        gpt2("small").config.save_pretrained(folder)
        work = Workload(micro_batch=batch, seq_len=128)
        return with_traced_activations(model_shape(folder), folder, work), work


def planned(shape, work, tflops: float) -> dict:  # noqa: ANN001
    """``zeropp plan``'s figures for every system and rate, compute at ``tflops`` (the
    calibrated rate, MFU 1), the step with the link hidden (``overlap`` 1) and not (0)."""
    from zeropp_strategy.config import ZeroConfig
    from zeropp_strategy.cost import ByteModel, Cluster, cost
    from zeropp_strategy.plan import resolve
    from zeropp_strategy.topology import Topology

    out = {}
    for rate, systems in CELLS.items():
        for system in systems:
            plan = (None if system == "ddp" else
                    resolve(ZeroConfig(**ours_fields(system)), Topology(world_size=4, rank=0, ranks_per_node=2)))
            b = ByteModel() if plan is None else ByteModel.of("bf16-mixed", plan)
            e0, e1 = (cost(system, plan, shape, Cluster(nodes=2, gpus_per_node=2, gpu_memory=0, host_memory=0,
                                                        link=_rate_bytes(rate), intra_link=math.inf, tflops=tflops,
                                                        mfu=1.0, overlap=overlap), work, b=b)
                      for overlap in (0.0, 1.0))
            out[f"{rate}/{system}"] = {
                "inter_bytes": e0.inter_bytes * 4, "activations": e0.gpu["activations"],
                "model_states": sum(e0.gpu.get(k, 0) for k in ("parameters", "gradients", "optimizer")),
                "step_overlap0": e0.step_s, "step_overlap1": e1.step_s}
    return out


def _median_cells(runs: dict[str, list[dict]]) -> dict[str, dict]:
    out = {}
    for key, cell_runs in runs.items():
        ok = [c for c in cell_runs if "step_s" in c]
        out[key] = ({"step_s": statistics.median(c["step_s"] for c in ok), "runs": [c["step_s"] for c in ok],
                     "ledger": ok[0].get("ledger_inter_bytes_per_step"),
                     "veth": statistics.median(c["veth_bytes_per_step"] for c in ok)}
                    if ok else {"error": cell_runs[0].get("error") if cell_runs else "not run"})
    return out


def render(data: dict) -> str:
    meta = data["meta"]
    measured = _median_cells(data["runs"])
    if "step_s" not in measured.get(CALIBRATION, {}):
        return f"no calibration: {CALIBRATION} did not run ({measured.get(CALIBRATION)})"
    shape, work = _model(meta["batch"])
    # the one fitted number: the rate at which the plan's compute (6 P per token) takes DDP's step
    rate = 6 * shape.params * work.micro_batch * work.seq_len / measured[CALIBRATION]["step_s"]
    plan = planned(shape, work, rate / 1e12)
    lines = [f"Command: `{meta['command']}` ({meta['date']}, {meta['hardware']}; {len(data['runs'][CALIBRATION])} "
             f"run(s) per cell, {meta['steps']} steps of which {meta['warmup']} warm-up, `--bf16-matmul "
             f"{meta['bf16_matmul']}`). Calibrated compute rate: {rate / 1e9:.1f} GFLOP/s per rank (`6 P` per "
             f"token, from `{CALIBRATION}`).", "",
             "| cell | step s measured (runs) | planned, `--overlap 0` | planned / measured | planned, `--overlap 1` "
             "(GPUs) | planned / measured |", "|---|---:|---:|---:|---:|---:|"]
    for key, m in measured.items():
        if "error" in m:
            lines.append(f"| {key} | failed: {m['error']} | | | | |")
            continue
        serial, hidden = plan[key]["step_overlap0"], plan[key]["step_overlap1"]
        note = " (calibration)" if key == CALIBRATION else ""
        lines.append(f"| {key}{note} | {m['step_s']:.3f} ({', '.join(f'{x:.3f}' for x in m['runs'])}) | {serial:.3f} "
                     f"| {serial / m['step_s']:.2f} | {hidden:.3f} | {hidden / m['step_s']:.2f} |")
    lines += ["", "| system | cross-node MB per step: ledger / planned | model states MiB per rank: measured / planned "
              "| activations MiB per rank: measured / planned |", "|---|---|---|---|"]
    for system in MEMORY:
        # the bytes of its 200 Mbit/s cell, else of the first timed cell that ran it (the ledger's do
        # not depend on the rate; the veth's, for DDP, include the link's retransmissions)
        key = next((k for k in [f"200mbit/{system}", *measured] if k.split("/", 1)[1] == system
                    and "step_s" in measured.get(k, {})), None)
        m, mem = (measured[key] if key else {}), data.get("memory", {})
        p = plan[key] if key else next((v for k, v in plan.items() if k.split("/", 1)[1] == system), None)
        if p is None:
            lines.append(f"| {system} | no timed cell in CELLS | | |")
            continue
        if m.get("ledger"):
            inter = f"{m['ledger'] / MB:.2f} / {p['inter_bytes'] / MB:.2f} ({p['inter_bytes'] / m['ledger']:.3f})"
        elif "veth" in m:  # Lightning's DDP keeps no ledger: the veth's bytes, TCP/IP headers included
            inter = f"veth {m['veth'] / MB:.2f} / {p['inter_bytes'] / MB:.2f}"
        else:
            inter = "not measured"
        cell = mem.get(system, {})
        if "model_states_per_rank" in cell and None not in cell["activation_bytes_per_rank"]:
            states = max(sum(r.values()) for r in cell["model_states_per_rank"])
            acts = max(cell["activation_bytes_per_rank"])
            memory_text = (f"{states / MiB:.2f} / {p['model_states'] / MiB:.2f} ({p['model_states'] / states:.3f}) | "
                           f"{acts / MiB:.2f} / {p['activations'] / MiB:.2f} ({p['activations'] / acts:.3f})")
        else:
            memory_text = f"not measured: {cell.get('error', 'no memory run')} | "
        lines.append(f"| {system} | {inter} | {memory_text} |")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeat", type=int, default=2)
    parser.add_argument("--steps", type=int, default=14)
    parser.add_argument("--warmup", type=int, default=4)
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--bf16-matmul", choices=["native", "fp32"], default="fp32",
                        help="as benchmarks/volume.py: fp32 stands in for bf16 hardware on a CPU without it")
    parser.add_argument("--out", type=Path, default=RESULTS)
    parser.add_argument("--render-only", action="store_true")
    parser.add_argument("--memory-only", action="store_true",
                        help="run the memory cells only, keeping --out's timed cells")
    args = parser.parse_args()
    args.size, args.precision, args.nproc_per_node, args.cell_timeout_s = "small", "bf16-mixed", 2, 900
    data = json.loads(args.out.read_text()) if args.render_only else run(args)
    print(render(data))


if __name__ == "__main__":
    main()

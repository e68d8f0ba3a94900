"""One training step's timeline on rank 0: compute and communication on separate lanes.

    sudo python benchmarks/overlap_timeline.py                 # 200 Mbit/s, zeropp_stage_3 and zeropp
    sudo python benchmarks/overlap_timeline.py --rate unlimited --png /tmp/t.png

``--bf16-matmul fp32`` (the default, as in benchmarks/volume.py): bf16 matmuls run in fp32 and
are rounded to bf16 (benchmarks/bf16_matmul.py), for CPUs without bf16 matrix instructions,
where a bf16-mixed step is otherwise all compute; ``native`` runs torch's bf16 kernels.

Runs ``bench_train.py``'s GPT-2 (4 x 256, micro-batch 4 x 128, bf16-mixed) on the simulated
2-node x 2-rank cluster (benchmarks/simcluster.py) and records, on rank 0, for one step after
the warm-up, with our own timestamps (``time.perf_counter``):

- compute: each GPT2Block's forward (pre-hook to hook) and backward (backward pre-hook to
  backward hook);
- all-gather in flight: from the moment FSDP2 calls our comm object until the pending work's
  ``wait()`` returns (the gather and, for qwZ, its dequantization ran somewhere in between);
- waiting: the part of that in which the training thread was blocked in ``wait()``;
- reduce-scatter: the gradient reduce-scatter call (on the host it returns at once where it
  is deferred, [Note: deferred reduce-scatter]), and the wait for the deferred ones at the
  end of backward;
- comm thread: each deferred job on the comm thread ([Note: comm thread]) from start to end,
  and within it qgZ's cross-node hop (the all-to-all on the thread's inter-node group): the
  gaps between those hops are the link's idle time while gradients are due.

The other ranks record the same step; their comm-thread lanes go into the JSON under
``peers``, moved to rank 0's time base (``perf_counter`` is the host's monotonic clock, which
the namespaces share), and a table per job prints when each rank entered the cross-node hop
and how long it stayed: a rank that waits for a late peer shows a long hop.

Each rank also reads the kernel's per-thread scheduler counters (``/proc/thread-self/schedstat``:
CPU time, and run-queue delay, the time a thread was runnable but waited for a core) over
each comm-thread job and over the step for its training thread, and its process's CPU time
over the step (every thread). A second table prints them per rank: where 4 ranks share 2
cores, a job whose run-queue delay is most of its time was starved of CPU, not of link.

The comm objects are wrapped after set-up (``set_custom_all_gather`` again, delegating to
ours), so the product code carries no tracing. Writes the PNG (rank 0) and a JSON of the
intervals.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))


def worker(system: str, out: Path, trace_step: int, steps: int, bf16_matmul: str = "fp32") -> None:
    import torch
    import torch.distributed as dist
    from lightning.pytorch import Callback, LightningModule, Trainer, seed_everything
    from torch.distributed.fsdp import FSDPModule

    from benchmarks.bench_train import gpt2, loader, ours_fields, thread_stat
    from zeropp_strategy import ZeroPPStrategy
    from zeropp_strategy.comm.collectives import AllGather, EmptyAlloc, ReduceScatter

    torch.set_num_threads(1)
    events: list[tuple[str, str, float, float]] = []  # (lane, label, start, end)
    recording = {"on": False}
    t0 = {"t": 0.0}

    def add(lane: str, label: str, a: float, b: float) -> None:
        if recording["on"]:
            events.append((lane, label, a - t0["t"], b - t0["t"]))

    # (thread, label, start, end, cpu_s, runq_s): the scheduler's view of a span (bench_train.thread_stat;
    # a process's run-queue delay, summed over its 40-odd threads, is left at 0: it says nothing)
    threads: list[tuple[str, str, float, float, float, float]] = []

    def add_thread(thread: str, label: str, a: float, b: float, before: tuple[float, float],
                   after: tuple[float, float]) -> None:
        if recording["on"]:
            threads.append((thread, label, a - t0["t"], b - t0["t"], after[0] - before[0], after[1] - before[1]))

    class TimedWork(dist.Work):
        def __init__(self, inner: dist.Work, issued: float, label: str) -> None:
            super().__init__()
            self.inner, self.issued, self.label = inner, issued, label

        def wait(self, timeout=None) -> bool:  # noqa: ANN001
            a = time.perf_counter()
            self.inner.wait()
            b = time.perf_counter()
            add("all-gather in flight", self.label, self.issued, b)
            add("waiting", self.label, a, b)
            return True

    class TimedGather(EmptyAlloc, AllGather):
        def __init__(self, inner, label: str) -> None:  # noqa: ANN001
            self.inner, self.label = inner, label

        def __call__(self, output_tensor, input_tensor, group, async_op=False):  # noqa: ANN001, ANN201
            a = time.perf_counter()
            work = self.inner(output_tensor, input_tensor, group, async_op)
            if work is None:
                add("all-gather in flight", self.label, a, time.perf_counter())
                return None
            return TimedWork(work, a, self.label)

    class TimedReduce(EmptyAlloc, ReduceScatter):
        def __init__(self, inner, label: str) -> None:  # noqa: ANN001
            self.inner, self.label = inner, label

        def __call__(self, output_tensor, input_tensor, group, op, async_op=False):  # noqa: ANN001, ANN201
            a = time.perf_counter()
            work = self.inner(output_tensor, input_tensor, group, op, async_op)
            if work is not None:
                work.wait()
            add("reduce-scatter", self.label, a, time.perf_counter())
            return None

    class GPT(LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.model = None

        def configure_model(self) -> None:
            if self.model is None:
                self.model = gpt2("small")

        def training_step(self, batch, batch_idx):  # noqa: ANN001, ANN201
            (ids,) = batch
            return self.model(input_ids=ids, labels=ids).loss

        def configure_optimizers(self):  # noqa: ANN201
            return torch.optim.AdamW(self.parameters(), lr=5e-4)

        def train_dataloader(self):  # noqa: ANN201
            return loader(4)

    class Instrument(Callback):
        def on_fit_start(self, trainer, pl_module) -> None:  # noqa: ANN001
            for i, block in enumerate(pl_module.model.transformer.h):
                block.register_forward_pre_hook(lambda m, a, i=i: m.__dict__.__setitem__("_t", time.perf_counter()))
                block.register_forward_hook(lambda m, a, o, i=i: add("compute", f"F{i}", m._t, time.perf_counter()))
                block.register_full_backward_pre_hook(
                    lambda m, g, i=i: m.__dict__.__setitem__("_tb", time.perf_counter()))
                block.register_full_backward_hook(
                    lambda m, gi, go, i=i: add("compute", f"B{i}", m._tb, time.perf_counter()))
            deferral = trainer.strategy.engine.deferral()
            if deferral is not None:  # time the end-of-backward wait (an instance attribute wins)
                inner_wait = deferral.wait_all

                def timed_wait_all() -> None:
                    a = time.perf_counter()
                    inner_wait()
                    add("reduce-scatter", "end of backward", a, time.perf_counter())

                deferral.wait_all = timed_wait_all
                # the comm thread's lanes: each deferred job, and within it qgZ's cross-node hop (the
                # all-to-all on the thread's inter-node group), to see the link's idle time between hops
                inner_submit, inter = deferral.thread.submit, deferral.groups.nodes.inter_group

                def timed_submit(job):  # noqa: ANN001, ANN202
                    def timed():  # noqa: ANN202
                        a, before = time.perf_counter(), thread_stat()
                        try:
                            return job()
                        finally:
                            b = time.perf_counter()
                            add("comm thread: job", "job", a, b)
                            add_thread("comm", "job", a, b, before, thread_stat())

                    return inner_submit(timed)

                deferral.thread.submit = timed_submit
                inner_a2a = dist.all_to_all_single

                def timed_a2a(output, input, *rest, group=None, async_op=False, **kw):  # noqa: A002, ANN001, ANN202
                    a = time.perf_counter()
                    work = inner_a2a(output, input, *rest, group=group, async_op=async_op, **kw)
                    if group is inter and not async_op:
                        add("comm thread: across nodes", "hop 2", a, time.perf_counter())
                    return work

                dist.all_to_all_single = timed_a2a
            names = {id(b): f"h{i}" for i, b in enumerate(pl_module.model.transformer.h)}
            for m in trainer.strategy.model.modules():
                if isinstance(m, FSDPModule):
                    state = m._get_fsdp_state()
                    group = state._fsdp_param_group
                    if group is None:
                        continue
                    label = names.get(id(m), "root")
                    m.set_custom_all_gather(TimedGather(group._all_gather_comm, label))
                    m.set_custom_reduce_scatter(TimedReduce(group._reduce_scatter_comm, label))

        def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:  # noqa: ANN001
            recording["on"] = batch_idx == trace_step
            t0["t"] = time.perf_counter()
            if recording["on"]:
                t0["traced"] = t0["t"]
                t0["main"], t0["process"] = thread_stat(), (time.process_time(), 0.0)

        def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:  # noqa: ANN001
            if batch_idx == trace_step:
                b = time.perf_counter()
                add("step", "step", t0["t"], b)
                add_thread("main", "step", t0["t"], b, t0["main"], thread_stat())
                add_thread("process", "step", t0["t"], b, t0["process"], (time.process_time(), 0.0))
                recording["on"] = False

    nodes = int(os.environ.get("GROUP_WORLD_SIZE", "1"))
    per_node = int(os.environ.get("LOCAL_WORLD_SIZE", "1"))
    seed_everything(0)
    trainer = Trainer(accelerator="cpu", devices=per_node, num_nodes=nodes, max_steps=steps,
                      strategy=ZeroPPStrategy(wrap_modules=["GPT2Block"], **ours_fields(system)), precision="bf16-mixed",
                      callbacks=[Instrument()], logger=False, enable_checkpointing=False, enable_progress_bar=False,
                      enable_model_summary=False, use_distributed_sampler=False)
    from benchmarks.bf16_matmul import matmul_mode

    with matmul_mode(bf16_matmul):
        trainer.fit(GPT())
    # every rank writes its own step (and the monotonic clock at its start, shared by the host's processes, so
    # that main() can put the ranks on rank 0's time base); rank 0's file is the trace
    rank = dist.get_rank()
    path = out if rank == 0 else out.with_name(f"{out.stem}.rank{rank}.json")
    path.write_text(json.dumps({"system": system, "rank": rank, "t0": t0["traced"], "events": events,
                                "threads": threads}))


def render(traces: list[dict], png: Path, rate: str, bf16_matmul: str = "fp32") -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    lanes = ["compute", "all-gather in flight", "waiting", "reduce-scatter", "comm thread: job",
             "comm thread: across nodes"]
    colors = {"compute": "#4c72b0", "all-gather in flight": "#dd8452", "waiting": "#c44e52",
              "reduce-scatter": "#55a868", "comm thread: job": "#8172b3", "comm thread: across nodes": "#937860"}
    fig, axes = plt.subplots(len(traces), 1, figsize=(11, 2.3 * len(traces)), squeeze=False)
    for ax, trace in zip(axes[:, 0], traces):
        step = next((e for e in trace["events"] if e[0] == "step"), None)
        for y, lane in enumerate(lanes):
            spans = [(a, b - a) for ln, _, a, b in trace["events"] if ln == lane]
            # Overlapping spans of one lane (two gathers in flight) get thin offsets so both show.
            for k, (a, w) in enumerate(spans):
                off = 0.15 * (k % 2) if lane == "all-gather in flight" else 0
                ax.broken_barh([(a, w)], (y - 0.35 + off, 0.55), color=colors[lane], edgecolor="black",
                               linewidth=0.3)
        ax.set_yticks(range(len(lanes)), lanes)
        ax.invert_yaxis()
        total = step[3] - step[2] if step else 0
        how = ", bf16 matmuls at fp32 speed" if bf16_matmul == "fp32" else ""
        ax.set_title(f"{trace['system']} at {rate}{how}: one step on rank 0 ({total:.2f} s)", fontsize=10)
        ax.set_xlabel("seconds from the step's start")
    fig.tight_layout()
    png.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(png, dpi=110)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rate", default="200mbit")
    parser.add_argument("--systems", nargs="+", default=["zeropp_stage_3", "zeropp"])
    parser.add_argument("--png", type=Path, default=ROOT / "docs" / "img" / "overlap_timeline.png")
    parser.add_argument("--json", type=Path, default=ROOT / "benchmarks" / "results" / "overlap_timeline.json")
    parser.add_argument("--bf16-matmul", choices=["native", "fp32"], default="fp32")
    parser.add_argument("--worker", nargs=3, default=None, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        worker(args.worker[0], Path(args.worker[1]), trace_step=6, steps=8, bf16_matmul=args.worker[2])
        return
    from benchmarks.simcluster import SimCluster

    traces = []
    with SimCluster(rate=args.rate) as cluster, tempfile.TemporaryDirectory() as tmp:
        for system in args.systems:
            out = Path(tmp) / f"{system}.json"
            res = cluster.run([sys.executable, str(Path(__file__).resolve()), "--worker", system, str(out),
                               args.bf16_matmul],
                              nproc_per_node=2, timeout_s=600, env={"PYTHONPATH": str(ROOT)})
            if not out.exists():
                raise SystemExit(f"{system} failed: {res.returncodes}\n" + "\n".join(o[-3000:] for o in res.outputs))
            traces.append(with_peers(out))
    args.json.parent.mkdir(parents=True, exist_ok=True)
    args.json.write_text(json.dumps({"rate": args.rate, "bf16_matmul": args.bf16_matmul, "traces": traces}))
    render(traces, args.png, args.rate, args.bf16_matmul)
    for trace in traces:
        print(hop_table(trace))
        print(cpu_table(trace))
    print(f"wrote {args.png} and {args.json}")


PEER_LANES = ("comm thread: job", "comm thread: across nodes")


def with_peers(out: Path) -> dict:
    """Rank 0's trace, with the other ranks' comm-thread lanes under ``peers`` (rank -> events),
    moved to rank 0's time base."""
    trace = json.loads(out.read_text())
    trace["peers"], trace["peer_threads"] = {}, {}
    for path in sorted(out.parent.glob(f"{out.stem}.rank*.json")):
        peer = json.loads(path.read_text())
        shift = peer["t0"] - trace["t0"]
        trace["peers"][str(peer["rank"])] = [[lane, label, a + shift, b + shift]
                                             for lane, label, a, b in peer["events"] if lane in PEER_LANES]
        trace["peer_threads"][str(peer["rank"])] = [[thread, label, a + shift, b + shift, *stat]
                                                    for thread, label, a, b, *stat in peer.get("threads", [])]
    return trace


def hop_table(trace: dict) -> str:
    """Per gradient job, when each rank entered qgZ's cross-node hop and how long it took there
    (seconds from rank 0's step start): a late peer shows as its partner's long hop."""
    ranks = {"0": [e for e in trace["events"] if e[0] == PEER_LANES[1]], **{
        r: [e for e in ev if e[0] == PEER_LANES[1]] for r, ev in trace.get("peers", {}).items()}}
    ranks = {r: sorted(ev, key=lambda e: e[2]) for r, ev in sorted(ranks.items())}
    lines = [f"{trace['system']}: qgZ's cross-node hop per job, rank: entered at (took) s"]
    for job in range(max((len(ev) for ev in ranks.values()), default=0)):
        cells = [f"{r}: {ev[job][2]:.3f} ({ev[job][3] - ev[job][2]:.3f})" for r, ev in ranks.items() if job < len(ev)]
        lines.append(f"  job {job + 1}  " + "  ".join(cells))
    return "\n".join(lines)


def cpu_table(trace: dict) -> str:
    """Per rank, the scheduler's view of the traced step: the process's CPU seconds (every
    thread), the training thread's CPU and run-queue delay, and per comm-thread job its time,
    CPU and run-queue delay. A job that waited for a core shows a run-queue delay near its time."""
    ranks = {"0": trace.get("threads", []), **trace.get("peer_threads", {})}
    lines = [f"{trace['system']}: per rank, seconds: time / CPU / waiting for a core"]
    for r, rows in sorted(ranks.items()):
        by = {t: [row for row in rows if row[0] == t] for t in ("process", "main", "comm")}
        if not by["process"]:
            continue
        (_, _, a, b, cpu, _), (_, _, _, _, mcpu, mq) = by["process"][0], by["main"][0]
        jobs = "  ".join(f"{jb - ja:.3f}/{jc:.3f}/{jq:.3f}"
                         for _, _, ja, jb, jc, jq in sorted(by["comm"], key=lambda x: x[2]))
        lines.append(f"  rank {r}: step {b - a:.3f}, process CPU {cpu:.3f}; training thread {mcpu:.3f}/{mq:.3f}; "
                     f"comm jobs {jobs}")
    return "\n".join(lines)


if __name__ == "__main__":
    main()

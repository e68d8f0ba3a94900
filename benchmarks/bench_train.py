"""One benchmark cell: train a GPT-2 for a few steps under one system and measure it.

    torchrun --nproc-per-node 4 benchmarks/bench_train.py --system zeropp --simulated-nodes 2 \
        --steps 16 --warmup 4 --out cell.json

Normally started by benchmarks/run.py inside benchmarks/simcluster.py (2 namespaces x P
ranks, a shaped veth between them), which sets GLOO_SOCKET_IFNAME to the namespace's veth.

Every system trains the same transformers GPT-2 (4 layers, width 256, 4 heads, vocab 512,
seq 128, dropout off by default; ``--size medium`` is 8 x 512, ``--size large`` 12 x 768), from the same seed, on the same data
(the text shipped with the package, byte-level, folded into the vocab) in the same order
(rank r reads samples r, r + W, ...; shuffle off), micro-batch ``--batch`` per rank,
AdamW (lr 5e-4, weight decay 0.01), on CPU in ``--precision`` (default ``bf16-mixed``, as
users train; ``32-true`` for the fp32 table). Under bf16-mixed DeepSpeed runs its ``bf16``
mode, which reduces gradients in bf16 (its default ``communication_data_type``).
Systems:

    zeropp_stage_1/2/3, qwZ, hpZ, qgZ, zeropp, zeropp_4bit, zeropp_delta (+ _grad_int8),
    zeropp_loco, zeropp_ef                      ours (ZeroPPStrategy), Lightning Trainer
    zeropp_stage_3_bf16                         ours, stage 3 with reduce_dtype="bf16": the
                                                like-for-like peer of DeepSpeed's bf16 reduce
    ddp                                         Lightning's DDPStrategy
    fsdp2                                       Lightning's ModelParallelStrategy with
                                                fully_shard per GPT2Block + root (plain FSDP2;
                                                bf16 gathers, fp32 reduce under bf16-mixed)
    deepspeed_zero3, deepspeed_zero3_hpz        DeepSpeed's engine, a plain loop
                                                (DS_ACCELERATOR=cpu, gloo; no gradient
                                                clipping, like the others)
    deepspeed_zeropp                            + its qwZ and qgZ (fails on CPU: reported)

Measured per cell (rank 0 writes ``--out`` as JSON):
- step_s: wall time between consecutive step ends on rank 0, median over the steps after
  ``--warmup`` (collectives synchronize the ranks every step);
- veth bytes per step: the namespace's veth TX+RX kernel counters (all cross-node traffic,
  both directions, headers included) read at each step end, when GLOO_SOCKET_IFNAME names
  a real interface; median over the measured steps;
- ledger bytes per step (ours only): the CommLedger's inter-node bytes summed over ranks,
  by collective kind, mean over the measured steps;
- CPU per step, every rank, medians over the measured steps: the process's CPU time (all its
  threads, ``time.process_time``), the part of it in the kernel (``getrusage``'s system
  time: system calls such as socket copies, and whatever packet work is charged to it), and the
  training thread's run-queue delay (time runnable but waiting for a core, from
  ``/proc/thread-self/schedstat``). With R ranks on C cores a step takes at least (the
  ranks' CPU summed) / C, whatever the link (docs/zeropp_measurements.md, "What the 2 cores
  allow"); work not charged to the ranks (softirq packet processing, other processes, a
  VM's stolen time) is outside that sum;
- loss: mean of the last 3 steps' training loss (rank 0's micro-batch);
- peak RSS of every rank (ru_maxrss);
- Lightning systems: every rank's model states after step ``STATES_STEP`` (storage bytes of
  parameters, gradients and optimizer state, ``engine.memory.memory_stats``) and the
  activations its first training forward saved for backward (``ActivationMeter``, the
  memory plan's own meter). benchmarks/plan_accuracy.py sets these beside ``zeropp plan``'s
  figures.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist
from torch.utils.data import DataLoader, Dataset, TensorDataset

# `torchrun benchmarks/bench_train.py` puts benchmarks/ on the path, not the repository root
# that `from benchmarks... import` needs (docs/stages.md's command failed without this).
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

LR, WEIGHT_DECAY = 5e-4, 0.01
STATES_STEP = 1  # model states are read at the end of this step: a warm-up step, outside the timed ones
SIZES = {"small": (4, 256), "medium": (8, 512), "large": (12, 768)}  # (layers, width): 3.3M, 25.5M, 85M params
# system -> (the registered preset it starts from, or None for ZeroConfig's defaults; the fields
# over it). A preset is read from the package at call time (ours_fields): strategy="zeropp" gives
# the "zeropp" row.
OURS: dict[str, tuple[str | None, dict]] = {
    "zeropp_stage_1": (None, {"stage": 1}),
    "zeropp_stage_1_overlap": (None, {"stage": 1, "overlap_param_gather": True}),
    "zeropp_stage_2": (None, {"stage": 2}),
    "zeropp_stage_3": (None, {"stage": 3}),
    "zeropp_stage_3_bf16": (None, {"stage": 3, "reduce_dtype": "bf16"}),
    "qwZ": (None, {"stage": 3, "quantized_weights": True}),
    "hpZ": (None, {"stage": 3, "hpz_partition_size": 0}),
    "qgZ": (None, {"stage": 3, "quantized_gradients": True}),
    "zeropp": ("zeropp", {}),
    "zeropp_4bit": ("zeropp_4bit", {}),
    "zeropp_delta": ("zeropp_delta", {}),
    # the "Which level to use" rows of docs/zeropp.md with int8 gradients
    "zeropp_grad_int8": ("zeropp", {"gradient_quant_bits": 8}),
    "zeropp_delta_grad_int8": ("zeropp_delta", {"gradient_quant_bits": 8}),
    # ... with error feedback: on both hops (what ZeroConfig.from_deepspeed makes of zeropp_loco_param),
    # and int8 inside the node with the cross-node hop fed back
    "zeropp_loco": ("zeropp", {"gradient_error_feedback": True, "gradient_error_feedback_intra": True}),
    "zeropp_ef": ("zeropp", {"gradient_quant_bits_intra": 8, "gradient_error_feedback": True}),
}
DEEPSPEED = {
    "deepspeed_zero3": {},
    "deepspeed_zero3_hpz": {"zero_hpz_partition_size": "ranks_per_node"},
    # DeepSpeed's qwZ / qgZ: expected to fail on CPU; run.py reports its error.
    "deepspeed_zeropp": {"zero_hpz_partition_size": "ranks_per_node", "zero_quantized_weights": True,
                         "zero_quantized_gradients": True},
}
SYSTEMS = [*OURS, "ddp", "fsdp2", *DEEPSPEED]


def ours_fields(system: str) -> dict:
    """The ZeroConfig fields of one of our systems: its preset's own, read at call time from
    the package on the path (exit_check.py's ``--package-root`` puts another checkout's
    there), with the table's fields over them."""
    preset, fields = OURS[system]
    if preset is None:
        return dict(fields)
    from zeropp_strategy.presets import PRESETS

    return {**PRESETS[preset], **fields}


def corpus(seq: int, vocab: int) -> TensorDataset:
    text = (Path(__file__).resolve().parents[1] / "zeropp_strategy" / "data" / "tiny_corpus.txt").read_bytes()
    ids = torch.tensor(list(text), dtype=torch.long) % vocab
    n = (ids.numel() - 1) // seq
    return TensorDataset(ids[: n * seq].view(n, seq))


def gpt2(size: str):
    from transformers import GPT2Config, GPT2LMHeadModel

    layers, width = SIZES[size]
    torch.manual_seed(0)
    # Dropout off: each framework draws its own dropout masks, which would make the losses
    # differ for no reason of the collectives; without it every system computes the same math.
    cfg = GPT2Config(n_layer=layers, n_embd=width, n_head={"small": 4, "medium": 8}.get(size, 12), vocab_size=512,
                     n_positions=128, resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0,
                     bos_token_id=0, eos_token_id=0)  # token ids inside the small vocabulary
    model = GPT2LMHeadModel(cfg)
    # transformers picks the loss from the class name, finds no "ForCausalLM" in "GPT2LMHeadModel"
    # and warns on the first loss; the default it falls back to is this one, named here
    model.loss_type = "ForCausalLM"
    return model


def loader(batch: int) -> DataLoader:
    """The same samples in the same order for every system: rank r reads r, r + W, ...

    Built here, not left to Lightning: Lightning's own sampler did not give rank 0
    samples 0 and W first, so its runs and DeepSpeed's saw different batches."""
    from torch.utils.data.distributed import DistributedSampler

    data: Dataset = corpus(128, 512)
    sampler = DistributedSampler(data, num_replicas=dist.get_world_size(), rank=dist.get_rank(), shuffle=False)
    return DataLoader(data, batch_size=batch, sampler=sampler)


def thread_stat() -> tuple[float, float]:
    """The calling thread's CPU time and run-queue delay so far, in seconds (the first two
    fields of ``/proc/thread-self/schedstat``: time on a core, and time runnable but waiting
    for one); zeros where the kernel has none."""
    try:
        cpu, runq = Path("/proc/thread-self/schedstat").read_text().split()[:2]
    except OSError:
        return 0.0, 0.0
    return int(cpu) / 1e9, int(runq) / 1e9


class Meter:
    """Step-end timestamps, veth counters and (ours) ledger bytes, on every rank."""

    def __init__(self) -> None:
        ifname = os.environ.get("GLOO_SOCKET_IFNAME", "")
        stats = Path(f"/sys/class/net/{ifname}/statistics")
        self.stats = stats if ifname and ifname != "lo" and stats.exists() else None
        self.times: list[float] = []
        self.veth: list[int] = []
        self.ledger: list[dict[str, int]] = []
        self.losses: list[float] = []
        # at each step end: the process's CPU time (every thread), its system part, and the
        # training thread's run-queue delay
        self.cpu: list[tuple[float, float, float]] = []
        self.model_states: dict[str, int] = {}  # Lightning systems: bytes this rank holds
        self.activation_bytes: int | None = None

    def veth_bytes(self) -> int:
        if self.stats is None:
            return 0
        return sum(int((self.stats / f"{d}_bytes").read_text()) for d in ("tx", "rx"))

    def step_end(self, loss: float, ledger=None) -> None:  # noqa: ANN001
        self.times.append(time.perf_counter())
        self.veth.append(self.veth_bytes())
        self.losses.append(loss)
        self.cpu.append((time.process_time(), resource.getrusage(resource.RUSAGE_SELF).ru_stime, thread_stat()[1]))
        if ledger is not None:
            from zeropp_strategy.comm.ledger import CommKind

            self.ledger.append({k.value: ledger.totals(k).inter_bytes for k in CommKind})
            ledger.reset()

    def result(self, warmup: int) -> dict:
        step_s = [b - a for a, b in zip(self.times[warmup:], self.times[warmup + 1 :])]
        veth = [b - a for a, b in zip(self.veth[warmup:], self.veth[warmup + 1 :])]
        measured = self.ledger[warmup + 1 :]
        by_kind = {k: statistics.mean(d[k] for d in measured) for k in measured[0]} if measured else {}
        cpu = [[b - a for a, b in zip(x, y)] for x, y in zip(self.cpu[warmup:], self.cpu[warmup + 1 :])]
        return {
            "cpu_s_per_step": [statistics.median(c[i] for c in cpu) for i in range(3)],
            "step_s": statistics.median(step_s),
            "step_s_all": step_s,
            "veth_bytes_per_step": statistics.median(veth) if self.stats else None,
            "ledger_inter_bytes_per_step_by_kind": by_kind,
            "loss": statistics.mean(self.losses[-3:]),
            "losses": self.losses,
            "peak_rss_bytes": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024,
            "model_states": self.model_states,
            "activation_bytes": self.activation_bytes,
        }

    def read_model(self, trainer, pl_module, batch_idx: int) -> None:  # noqa: ANN001
        """Model states after step STATES_STEP."""
        if batch_idx != STATES_STEP:
            return
        from zeropp_strategy.engine.memory import memory_stats

        stats = memory_stats(pl_module, trainer.optimizers, stage=0, rank=trainer.global_rank,
                             world_size=trainer.world_size)
        self.model_states = {"parameters": stats.param_bytes, "gradients": stats.grad_bytes,
                             "optimizer": stats.optimizer_bytes}


# -- Lightning systems (ours, ddp, fsdp2) ---------------------------------------------------


def run_lightning(args: argparse.Namespace, meter: Meter) -> None:
    from lightning.pytorch import Callback, LightningModule, Trainer, seed_everything

    from zeropp_strategy import ZeroPPStrategy

    class GPT(LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.model = None

        def configure_model(self) -> None:
            if self.model is not None:
                return
            self.model = gpt2(args.size)
            if args.system == "fsdp2":  # Lightning's own FSDP2 recipe: blocks, then the root
                from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

                mesh = self.device_mesh["data_parallel"]
                # Under bf16-mixed, parameters gathered in bf16 and gradients reduced in fp32,
                # as our stage 3 does; without a policy FSDP2 gathers fp32 (twice the bytes).
                policy = (MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
                          if args.precision == "bf16-mixed" else MixedPrecisionPolicy())
                for block in self.model.transformer.h:
                    fully_shard(block, mesh=mesh, mp_policy=policy)
                fully_shard(self.model, mesh=mesh, mp_policy=policy)

        def training_step(self, batch, batch_idx):
            (ids,) = batch
            loss = self.model(input_ids=ids, labels=ids).loss
            self.log("train_loss", loss)
            return loss

        def configure_optimizers(self):
            return torch.optim.AdamW(self.parameters(), lr=LR, weight_decay=WEIGHT_DECAY)

        def train_dataloader(self):
            return loader(args.batch)

    class Record(Callback):
        def on_train_start(self, trainer, pl_module):
            from zeropp_strategy.engine.memory_plan import ActivationMeter

            ActivationMeter(pl_module.model, lambda nbytes: setattr(meter, "activation_bytes", nbytes))

        def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
            ledger = getattr(trainer.strategy, "comm_ledger", None)
            meter.read_model(trainer, pl_module, batch_idx)
            meter.step_end(outputs["loss"].item(), ledger)

    nodes = int(os.environ.get("GROUP_WORLD_SIZE", os.environ.get("NNODES", "1")))
    per_node = int(os.environ.get("LOCAL_WORLD_SIZE", "1"))
    if args.system in OURS:
        strategy = ZeroPPStrategy(wrap_modules=["GPT2Block"], simulated_nodes=args.simulated_nodes,
                                  **ours_fields(args.system))
    elif args.system == "fsdp2":
        from lightning.pytorch.strategies import ModelParallelStrategy

        strategy = ModelParallelStrategy(data_parallel_size=nodes * per_node, tensor_parallel_size=1)
    else:
        strategy = "ddp"
    seed_everything(0)
    trainer = Trainer(
        accelerator="cpu", devices=per_node, num_nodes=nodes, strategy=strategy, max_steps=args.steps,
        precision=args.precision,
        callbacks=[Record()], logger=False, enable_checkpointing=False, enable_progress_bar=False,
        enable_model_summary=False, use_distributed_sampler=False,
    )
    trainer.fit(GPT())


# -- DeepSpeed ------------------------------------------------------------------------------


def run_deepspeed(args: argparse.Namespace, meter: Meter) -> None:
    os.environ.setdefault("DS_ACCELERATOR", "cpu")
    import deepspeed

    deepspeed.init_distributed(dist_backend="gloo")
    model = gpt2(args.size)
    zero = {"stage": 3}
    for key, value in DEEPSPEED[args.system].items():
        zero[key] = int(os.environ.get("LOCAL_WORLD_SIZE", "1")) if value == "ranks_per_node" else value
    config = {
        "train_micro_batch_size_per_gpu": args.batch,
        "gradient_accumulation_steps": 1,
        "zero_optimization": zero,
        "zero_allow_untested_optimizer": True,
        "zero_force_ds_cpu_optimizer": False,
        # DeepSpeed clips the global gradient norm to 1.0 unless told otherwise; the other
        # systems do not clip. With clipping its losses left DDP's at the third step (Adam's
        # first update does not depend on the gradient's scale) and ended 7% lower (3.37
        # against 3.62 after 16 steps); without it they are DDP's.
        "gradient_clipping": 0.0,
    }
    if args.precision == "bf16-mixed":
        config["bf16"] = {"enabled": True}
    optimizer = torch.optim.AdamW(model.parameters(), lr=LR, weight_decay=WEIGHT_DECAY)
    engine, _, _, _ = deepspeed.initialize(model=model, optimizer=optimizer, config=config)
    for step, (ids,) in enumerate(loader(args.batch)):
        if step == args.steps:
            break
        loss = engine(input_ids=ids, labels=ids).loss
        engine.backward(loss)
        engine.step()
        meter.step_end(loss.item())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--system", choices=SYSTEMS, required=True)
    parser.add_argument("--size", choices=list(SIZES), default="small")
    parser.add_argument("--steps", type=int, default=14)
    parser.add_argument("--warmup", type=int, default=4, help="steps left out of the step-time median")
    parser.add_argument("--batch", type=int, default=2, help="micro-batch per rank (sequences of 128)")
    parser.add_argument("--precision", choices=["bf16-mixed", "32-true"], default="bf16-mixed")
    parser.add_argument("--bf16-matmul", choices=["native", "fp32"], default="native",
                        help="fp32: run bf16 matmuls in fp32 and round to bf16 (benchmarks/bf16_matmul.py), a "
                             "stand-in for bf16 hardware on a CPU without it; every system alike")
    parser.add_argument("--simulated-nodes", type=int, default=0, help="ours only: split one machine's ranks")
    parser.add_argument("--overlap-buckets", type=int, default=None,
                        help="stage 1 only, an experiment: cut the post-step gather into about this many buckets "
                             "instead of engine.stage1.OVERLAP_BUCKETS")
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args()
    torch.set_num_threads(1)  # 2 cores shared by all ranks: more threads only thrash

    if args.overlap_buckets is not None:  # the measurement behind OVERLAP_BUCKETS (benchmarks/volume.py)
        from zeropp_strategy.engine import stage1

        stage1.OVERLAP_BUCKETS = args.overlap_buckets
    meter = Meter()
    from benchmarks.bf16_matmul import matmul_mode

    with matmul_mode(args.bf16_matmul):
        if args.system.startswith("deepspeed"):
            run_deepspeed(args, meter)
        else:
            run_lightning(args, meter)
    result = meter.result(args.warmup)
    # Every rank's RSS and ledger bytes; the link carries the sum of what all ranks send.
    per_rank = [None] * dist.get_world_size()
    dist.all_gather_object(per_rank, (result["peak_rss_bytes"], result["ledger_inter_bytes_per_step_by_kind"],
                                      result.pop("model_states"), result.pop("activation_bytes"),
                                      result.pop("cpu_s_per_step")))
    rank = dist.get_rank()
    dist.barrier()
    dist.destroy_process_group()  # every system the same way: no gloo teardown at interpreter exit
    if rank != 0:
        return
    kinds = per_rank[0][1]
    result.update(
        system=args.system,
        size=args.size,
        precision=args.precision,
        bf16_matmul=args.bf16_matmul,
        world_size=len(per_rank),
        peak_rss_bytes_per_rank=[p[0] for p in per_rank],
        ledger_inter_bytes_per_step_by_kind={k: sum(p[1][k] for p in per_rank) for k in kinds},
        model_states_per_rank=[p[2] for p in per_rank],
        activation_bytes_per_rank=[p[3] for p in per_rank],
        # per rank: [process CPU, its system time, the training thread's run-queue delay] per step
        cpu_s_per_step_per_rank=[p[4] for p in per_rank],
        cores=len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count(),
    )
    result["ledger_inter_bytes_per_step"] = sum(result["ledger_inter_bytes_per_step_by_kind"].values()) if kinds else None
    del result["peak_rss_bytes"]
    print(f"{args.system}: step {result['step_s']:.3f} s, loss {result['loss']:.4f}, veth/step "
          f"{result['veth_bytes_per_step']}, ledger/step {result['ledger_inter_bytes_per_step']}", flush=True)
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()

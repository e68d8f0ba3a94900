"""Layer: commands. ``zeropp plan``: for a model on a cluster, every config's memory per
rank (by part), bytes per step inside and across nodes, an estimated step time, whether
it fits, and the one to use.

    zeropp plan meta-llama/Llama-3-8B-folder --nodes 2 --gpus-per-node 8 --gpu-memory 80GB \\
        --host-memory 512GB --link 100Gbit --intra-link 900GB/s --micro-batch 4 --seq-len 2048

[Note: the estimate]
Everything here is arithmetic on the model's shape, read from a meta-device build (no
weights are read or allocated, so a 70B model costs a second): the parameter count ``P``,
the trainable count ``T`` (``P``, or the LoRA adapters with ``--lora R``), the parameters
outside the repeated blocks (``P_root``: embeddings, head, final norm) and the largest
block. The formulas are the ones docs/stages.md and docs/zeropp.md derive and the ledger
measures, under ``bf16-mixed`` with AdamW: fp32 parameters (``a = 4`` bytes), fp32
gradients (``g = 4``), two fp32 moments (``k = 8``), 16-bit gathers (``c = 2``), fp32
reduces (``r = 4``); ``M`` nodes of ``L`` GPUs, ``N = M L`` ranks.

- **Memory per GPU**: parameters, gradients and optimizer state as each stage holds them;
  the gathered working set of stages 2/3 (stage 2: every group, from its forward to its
  backward; stage 3: the root group and the two largest blocks, the one computing and the
  one prefetched); hpZ's secondary shard ``c P / L``; one bucket or one group of unsharded
  gradients; activations from the micro-batch (``34 s b h`` bytes per layer as Korthikanti
  et al. count for 16-bit activations without the attention matrix, which SDPA does not
  store; ``2 s b h`` per layer with activation checkpointing; plus ``6 s b V`` for the
  logits and their fp32 loss); ``RUNTIME_GPU_BYTES`` for the CUDA context and allocator.
  Offloaded state moves to the host column (NVMe: to the disk column, with the in-flight
  buffers in host memory).
- **Bytes per step per rank**, as the ledger books them: the collectives of each stage on
  the two-hop routes (docs/stages.md, "Across nodes"): a gather of ``B`` bytes in all sends
  ``B (M-1)/N`` across nodes and ``B (L-1)/L`` inside per rank, a reduce-scatter of ``B``
  bytes per rank the same; DDP's ring all-reduce ``2 (N-1)/N B``, ``M/N`` of it across;
  qwZ at 1 + 4/256 bytes per element, qgZ at 0.5 + 4/64 (int4, blocks of 64), hpZ's
  backward gather inside the node only. NCCL's native rings on GPUs put up to ``M/(M-1)``
  times more of a plain collective on the link (2x on two nodes): the cross-node figures
  are then a lower bound, and ``tests/test_estimate.py`` checks them against the ledger of a
  measured run.
- **Step time**: compute ``(6 P + 2 P_ckpt) tokens / (TFLOPs x MFU)`` for full training
  (``4 P + 2 T`` with frozen weights: the input gradients still pass every layer), plus the
  communication not hidden behind it: the larger of compute and link time, plus one
  block's share of the link time (the first gather and the last reduce have nothing to
  overlap with). A node's cross-node bytes share its link (``--link`` per node), a GPU's
  intra-node bytes its ``--intra-link``. Offloaded optimizer state adds the host step and
  the PCIe copies (``HOST_BYTES_PER_S``, ``PCIE_BYTES_PER_S``), not overlapped.

It is an estimate: the measured MFU, the allocator's fragmentation and the framework's
buffers decide the rest. ``--json`` gives every term, so a measured run can be set beside
it (docs/plan.md compares it with the ledger of real runs).
"""

from __future__ import annotations

import argparse
import json
import re
from dataclasses import asdict, dataclass, field
from typing import Any

__all__ = ["Cluster", "ConfigEstimate", "ModelShape", "Workload", "estimate", "main", "model_shape", "parse_bandwidth",
           "parse_bytes"]

A, G, K, C, R = 4, 4, 8, 2, 4  # bytes: fp32 params, fp32 grads, AdamW moments, 16-bit gathers, fp32 reduces
QW = 1 + 4 / 256  # qwZ: int8 codes + one fp32 scale per 256 elements
QG = 0.5 + 4 / 64  # qgZ: int4 codes + one fp32 scale per 64 elements
FROZEN = {8: 1 + 4 / 256, 4: 0.5 + 4 / 256}  # frozen int8/int4 shards: codes + a scale per 256
RUNTIME_GPU_BYTES = 2 * 2**30  # CUDA context, cuBLAS workspaces, allocator slack
RUNTIME_HOST_BYTES = 2**30  # per rank: Python, torch, the framework
HOST_BYTES_PER_S = 10e9  # a host AdamW step, bytes of state per second per rank
PCIE_BYTES_PER_S = 25e9  # host <-> GPU copies per rank
NVME_BYTES_PER_S = 3e9  # per node
GPU_HEADROOM = 0.95  # of --gpu-memory the plan may fill

_RATE = re.compile(r"^\s*([0-9]*\.?[0-9]+)\s*([kmgtp]?)(i?)(b|bit|bps)?(/s)?\s*$", re.IGNORECASE)
_UNIT = {"": 0, "k": 1, "m": 2, "g": 3, "t": 4, "p": 5}


def parse_bytes(text: str, field_name: str) -> int:
    """``80GB``, ``80GiB``, ``512G``, ``1.5TB`` -> bytes (GB decimal, GiB binary): the units
    of ``zeropp consolidate --max-shard-size`` (``checkpoint.consolidate.parse_size``), plus a
    bare ``G``; a lower-case ``b`` (bits) is refused."""
    from zeropp_strategy.checkpoint.consolidate import parse_size

    unit = str(text).strip().lstrip("0123456789. ")
    if not (unit.lower().endswith("bit") or unit.endswith("b")):
        try:
            return parse_size(str(text) + "B" if unit[-1:].lower() in ("k", "m", "g", "t", "p") else str(text))
        except ValueError:
            pass
    raise ValueError(f"{field_name}={text!r} is not a size. Fix: e.g. {field_name} 80GB (or 80GiB, 512G).")


def parse_bandwidth(text: str, field_name: str) -> float:
    """Bits: ``100Gbit``, ``100Gbps``, ``100Gb``, or a bare ``100G`` (the network's unit);
    bytes (a capital ``B``): ``900GB/s``, ``900GBps``, ``900GB``. Returns bytes per second."""
    m = _RATE.match(str(text))
    if not m:
        raise ValueError(f"{field_name}={text!r} is not a bandwidth. Fix: e.g. {field_name} 100Gbit or 900GB/s.")
    unit = m.group(4) or ""
    value = float(m.group(1)) * (1024 if m.group(3) else 1000) ** _UNIT[m.group(2).lower()]
    if value <= 0:
        raise ValueError(f"{field_name}={text!r} is not a bandwidth above 0. Fix: e.g. {field_name} 100Gbit.")
    return value if unit.startswith("B") and unit.lower() != "bit" else value / 8


@dataclass(frozen=True)
class ModelShape:
    """What the estimate needs of a model, from a meta-device build."""

    name: str
    params: int
    trainable: int
    root_params: int  # outside the repeated blocks (embeddings, head, final norm)
    largest_block: int
    blocks: int
    hidden: int
    layers: int
    vocab: int

    @property
    def frozen(self) -> int:
        return self.params - self.trainable


@dataclass(frozen=True)
class Cluster:
    nodes: int
    gpus_per_node: int
    gpu_memory: int  # bytes
    host_memory: int  # bytes per node
    link: float  # bytes/s, cross-node, per node
    intra_link: float  # bytes/s, per GPU
    tflops: float = 989.0  # dense bf16 per GPU (H100 SXM)
    mfu: float = 0.4
    nvme: str | None = None

    @property
    def world(self) -> int:
        return self.nodes * self.gpus_per_node


@dataclass(frozen=True)
class Workload:
    micro_batch: int = 1
    seq_len: int = 2048
    activation_checkpointing: bool = False


@dataclass
class ConfigEstimate:
    """One config's row: bytes per rank by part, per step, and the verdict."""

    name: str
    zero_config: dict[str, Any]
    gpu: dict[str, float] = field(default_factory=dict)  # bytes per GPU by part
    host: dict[str, float] = field(default_factory=dict)  # bytes per rank by part
    disk: float = 0.0  # bytes per node
    intra_bytes: float = 0.0  # per rank per step
    inter_bytes: float = 0.0
    compute_s: float = 0.0
    comm_s: float = 0.0
    offload_s: float = 0.0
    step_s: float = 0.0
    fits: bool = True
    why_not: str = ""
    notes: list[str] = field(default_factory=list)  # the run's own fallbacks (plan.resolve)

    @property
    def gpu_total(self) -> float:
        return sum(self.gpu.values())

    @property
    def host_total(self) -> float:
        return sum(self.host.values())


def _meta_model(spec: str) -> tuple[Any, str]:
    import importlib
    from pathlib import Path

    import torch

    if ":" in spec and not Path(spec).exists():
        module_name, _, cls_name = spec.partition(":")
        try:
            cls = getattr(importlib.import_module(module_name), cls_name)
        except (ImportError, AttributeError) as e:
            raise ValueError(f"MODEL={spec!r} names no importable class ({e}). Fix: module.path:ClassName, "
                             "a class that builds with no arguments.") from None
        with torch.device("meta"):
            return cls(), cls_name
    from transformers import AutoConfig, AutoModelForCausalLM

    if spec in ("tiny", "embedded"):
        from zeropp_strategy.rlhf.models import _config, tiny_llama_config

        config, name = _config(tiny_llama_config()), "the embedded tiny Llama"
    else:
        path = Path(spec)
        folder = path.parent if path.name == "config.json" else path
        if not (folder / "config.json").is_file():
            raise ValueError(f"MODEL={spec!r} has no config.json. Fix: a Hugging Face folder, its config.json, "
                             "'tiny' (the embedded default) or module:Class.")
        config, name = AutoConfig.from_pretrained(str(folder)), folder.name
    with torch.device("meta"):
        return AutoModelForCausalLM.from_config(config), name


def model_shape(spec: str, *, lora: int = 0) -> ModelShape:
    """The shape of MODEL (a folder, a config.json, ``tiny`` or ``module:Class``), built on the
    meta device; ``lora``: rank of LoRA adapters on every linear layer inside the blocks
    (then only those train)."""
    from torch import nn

    from zeropp_strategy.engine.wrap import select_blocks

    model, name = _meta_model(spec)
    params = sum(p.numel() for p in model.parameters())
    if params == 0:
        raise ValueError(f"MODEL={spec!r} has no parameters. Fix: name the model to train.")
    blocks = select_blocks(model, wrap_modules=(), wrap_min_params=1_000_000)
    in_blocks = [sum(p.numel() for p in b.parameters()) for b in blocks]
    if lora:  # on every linear layer of the blocks: nn.Linear, and GPT-2's Conv1D (weight: in x out)
        trainable = sum(lora * sum(m.weight.shape) for b in blocks for m in b.modules()
                        if isinstance(m, nn.Linear) or (type(m).__name__ == "Conv1D" and m.weight.dim() == 2))
        if not trainable:
            raise ValueError(f"--lora={lora} found no linear layer in the blocks of MODEL={spec!r}. Fix: --lora 0 "
                             "(full training), or a model whose blocks hold nn.Linear layers.")
        params += trainable
    else:
        trainable = sum(p.numel() for p in model.parameters() if p.requires_grad)
    config = getattr(model, "config", None)
    hidden = int(getattr(config, "hidden_size", 0) or 0)
    vocab = int(getattr(config, "vocab_size", 0) or 0)
    layers = int(getattr(config, "num_hidden_layers", 0) or len(blocks))
    return ModelShape(name=name, params=params, trainable=trainable,
                      root_params=params - sum(in_blocks) - (trainable if lora else 0),
                      largest_block=max(in_blocks, default=0), blocks=len(blocks), hidden=hidden, layers=layers,
                      vocab=vocab)


# name -> ZeroConfig fields (None: plain DDP), in the order the table lists them
CONFIGS: dict[str, dict[str, Any] | None] = {
    "ddp": None,
    "zeropp_stage_1": {"stage": 1},
    "zeropp_stage_2": {"stage": 2},
    "zeropp_stage_3": {"stage": 3},
    "zeropp": {"stage": 3, "quantized_weights": True, "hpz_partition_size": 0, "quantized_gradients": True},
    "zeropp_stage_3 + offload_optimizer=cpu": {"stage": 3, "offload_optimizer": "cpu"},
    "zeropp_offload": {"stage": 3, "quantized_weights": True, "hpz_partition_size": 0, "quantized_gradients": True,
                       "offload_optimizer": "cpu", "offload_param": "cpu"},
    "zeropp_offload_nvme": {"stage": 3, "quantized_weights": True, "hpz_partition_size": 0,
                            "quantized_gradients": True, "offload_optimizer": "nvme", "offload_param": "nvme"},
}
FROZEN_CONFIGS: dict[str, dict[str, Any]] = {
    "zeropp + frozen int8": {**CONFIGS["zeropp"], "quantize_frozen_weights": True},  # type: ignore[dict-item]
    "zeropp + frozen int4": {**CONFIGS["zeropp"], "quantize_frozen_weights": True,  # type: ignore[dict-item]
                             "frozen_weight_bits": 4},
}


def _activations(m: ModelShape, w: Workload) -> float:
    sbh = w.seq_len * w.micro_batch * m.hidden
    per_layer = 2 * sbh if w.activation_checkpointing else 34 * sbh
    extra = 34 * sbh if w.activation_checkpointing else 0  # one block recomputed at a time
    return m.layers * per_layer + extra + 6 * w.seq_len * w.micro_batch * m.vocab


def _one(name: str, cfg: dict[str, Any] | None, m: ModelShape, c: Cluster, w: Workload) -> ConfigEstimate:
    from zeropp_strategy.config import ZeroConfig
    from zeropp_strategy.plan import resolve
    from zeropp_strategy.topology import Topology

    P, T, F, N, L, M = m.params, m.trainable, m.frozen, c.world, c.gpus_per_node, c.nodes
    e = ConfigEstimate(name, {} if cfg is None else dict(cfg))
    stage, qw, hpz_group, qg, frozen_bits, opt_off, par_off = 0, False, 1, False, 0, "none", "none"
    if cfg is not None:  # the decisions the run itself makes for this topology (fallbacks included)
        fields = {k: ({"device": v, "nvme_path": c.nvme} if v == "nvme" else v) for k, v in cfg.items()}
        plan = resolve(ZeroConfig(**fields), Topology(world_size=N, rank=0, ranks_per_node=L))
        stage, qw, hpz_group, qg = plan.stage, plan.quantized_weights, plan.hpz_group, plan.quantized_gradients
        opt_off, par_off, e.notes = plan.offload_optimizer, plan.offload_param, list(plan.notes)
        frozen_bits = cfg.get("frozen_weight_bits", 8) if cfg.get("quantize_frozen_weights") and F else 0
    # -- model states ------------------------------------------------------------------------
    shard_param = (F * FROZEN[frozen_bits] + A * T) / N if frozen_bits else A * P / N
    if stage == 0:
        e.gpu.update(parameters=A * P, gradients=G * T, optimizer=K * T, buckets=G * T)
    elif stage == 1:
        e.gpu.update(parameters=A * P, gradients=G * T, optimizer=K * T / N, buckets=min(25 * 2**20, G * T))
    else:
        e.gpu.update(parameters=shard_param, gradients=G * T / N, optimizer=K * T / N)
        if stage == 2:
            e.gpu["gathered"] = C * P
        else:
            e.gpu["gathered"] = C * (m.root_params + 2 * m.largest_block)
        e.gpu["unsharded_gradients"] = G * min(T, max(m.largest_block, m.root_params))
        if hpz_group > 1:  # the secondary shard, in the gather's dtype (frozen codes as stored)
            e.gpu["hpz_secondary"] = ((F * FROZEN[frozen_bits] + C * T) if frozen_bits else C * P) / hpz_group
    if opt_off != "none":
        state = {"optimizer": e.gpu.pop("optimizer"), "gradients": e.gpu.pop("gradients")}
        if opt_off == "cpu":
            e.host.update(state)
        else:
            e.disk += sum(state.values()) * L
            e.host["nvme_buffers"] = min(sum(state.values()), 2 * 2**30)  # staging, as the memory plan sizes it
    if par_off != "none":
        shard = e.gpu.pop("parameters")
        if par_off == "cpu":
            e.host["parameters"] = shard
        else:
            e.disk += shard * L
            e.host["parameter_buffers"] = C * 4 * m.largest_block
    e.gpu["activations"] = _activations(m, w)
    e.gpu["runtime"] = RUNTIME_GPU_BYTES
    e.host["runtime"] = RUNTIME_HOST_BYTES
    # -- bytes per step per rank, as the ledger books them ([Note: two-hop collectives]) --------
    # A gather of B bytes in all (B/N per rank): across nodes B (M-1)/N, inside B (L-1)/L (the
    # fan-out); a reduce-scatter of B bytes per rank: inside B (L-1)/L, across B (M-1)/N.
    across, inside = (M - 1) / N, (L - 1) / L
    # qwZ quantizes the cross-node hop; the fan-out inside the node stays 16-bit. Frozen
    # int8/int4 shards travel as stored on both hops.
    wire = QW if qw else C
    gather_in = (F * FROZEN[frozen_bits] + C * T) if frozen_bits else C * P
    gather_across = (F * FROZEN[frozen_bits] + wire * T) if frozen_bits else wire * P
    if stage == 0:  # DDP's ring all-reduce over N ranks: 2 (N-1)/N B per rank, M of the N hops cross
        ring = 2 * R * T * (N - 1) / N
        e.inter_bytes, e.intra_bytes = ring * M / N if M > 1 else 0.0, ring * (1 - M / N) if M > 1 else ring
    elif stage == 1:  # reduce-scatter of the gradients, all-gather of the updated rows
        e.intra_bytes, e.inter_bytes = (R + A) * T * inside, (R + A) * T * across
    else:
        e.intra_bytes, e.inter_bytes = gather_in * inside, gather_across * across  # forward gather
        if stage == 3:
            blocks = 1 - m.root_params / P  # the root is not gathered again in backward
            if hpz_group > 1:  # from the secondary shard, inside the hpZ group
                e.intra_bytes += gather_in * blocks * (hpz_group - 1) / hpz_group
            else:
                e.intra_bytes += gather_in * blocks * inside
                e.inter_bytes += gather_across * blocks * across
        if qg:
            e.intra_bytes += QG * T * inside
            e.inter_bytes += QG * T * across
        else:
            e.intra_bytes += R * T * inside
            e.inter_bytes += R * T * across
    # -- time ----------------------------------------------------------------------------------
    tokens = w.micro_batch * w.seq_len
    flops = (6 * P if F == 0 else 4 * P + 2 * T) * tokens + (2 * P * tokens if w.activation_checkpointing else 0)
    e.compute_s = flops / (c.tflops * 1e12 * c.mfu)
    link_s = e.inter_bytes * L / c.link + e.intra_bytes / c.intra_link
    e.comm_s = link_s
    moved = sum(e.host.get(k, 0.0) for k in ("optimizer", "gradients", "parameters"))
    if opt_off != "none" or par_off != "none":
        e.offload_s = e.host.get("optimizer", 0.0) / HOST_BYTES_PER_S + 2 * moved / PCIE_BYTES_PER_S
        if e.disk:
            e.offload_s += 2 * e.disk / NVME_BYTES_PER_S
    e.step_s = max(e.compute_s, link_s) + link_s / max(m.blocks, 1) + e.offload_s
    # -- fits? ---------------------------------------------------------------------------------
    problems = []
    if e.gpu_total > GPU_HEADROOM * c.gpu_memory:
        problems.append(f"GPU {e.gpu_total / 2**30:.1f} GiB > {GPU_HEADROOM:.0%} of {c.gpu_memory / 2**30:.0f} GiB")
    if e.host_total * L > c.host_memory:
        problems.append(f"host {e.host_total * L / 2**30:.1f} GiB per node > {c.host_memory / 2**30:.0f} GiB")
    if e.disk and not c.nvme:
        problems.append("needs an NVMe path (--nvme)")
    e.fits, e.why_not = not problems, "; ".join(problems)
    return e


def estimate(m: ModelShape, c: Cluster, w: Workload) -> tuple[list[ConfigEstimate], ConfigEstimate | None, str]:
    """Every config's estimate, the recommended one (or None) and why."""
    configs = dict(CONFIGS)
    if m.frozen:
        configs.update(FROZEN_CONFIGS)
    if not c.nvme:
        configs.pop("zeropp_offload_nvme")
    rows = [_one(name, cfg, m, c, w) for name, cfg in configs.items()]
    if c.world == 1:
        rows = [r for r in rows if r.name == "ddp" or "offload" in r.name]
    fitting = [r for r in rows if r.fits]
    if not fitting:
        return rows, None, ("nothing fits: " + "; ".join(f"{r.name}: {r.why_not}" for r in rows[-2:])
                            + ". Fix: more GPUs or nodes, a smaller micro-batch, activation checkpointing, "
                              "or LoRA on a frozen int4 base")
    fastest = min(r.step_s for r in fitting)
    # within 5% of the fastest, the simplest: the first in the table's order (fewer features,
    # no offload), as an estimate cannot rank configs that close
    near = [r for r in fitting if r.step_s <= 1.05 * fastest]
    best = near[0]
    why = (f"the fastest estimated step that fits ({best.step_s:.2f} s: compute {best.compute_s:.2f} s, "
           f"link {best.comm_s:.2f} s" + (f", offload {best.offload_s:.2f} s" if best.offload_s else "") + ")")
    if len(near) > 1:
        why += f"; the simplest of the {len(near)} configs within 5% of it"
    return rows, best, why


def _gib(x: float) -> str:
    return f"{x / 2**30:.1f}"


def _count(n: int) -> str:
    return f"{n / 1e9:.2f}B" if n >= 1e9 else f"{n / 1e6:.1f}M" if n >= 1e6 else f"{n / 1e3:.0f}K"


def table(m: ModelShape, c: Cluster, w: Workload, rows: list[ConfigEstimate], best: ConfigEstimate | None,
          why: str) -> str:
    lines = [f"zeropp plan: {m.name}: {_count(m.params)} parameters ({_count(m.trainable)} trainable), "
             f"{m.blocks} blocks; {c.nodes} node(s) x {c.gpus_per_node} GPU(s), {_gib(c.gpu_memory)} GiB each, "
             f"link {c.link * 8 / 1e9:g} Gbit/s per node; micro-batch {w.micro_batch} x {w.seq_len} tokens, "
             f"bf16-mixed, AdamW, {c.tflops:g} TFLOP/s at {c.mfu:.0%} MFU",
             "",
             "| config | GPU GiB | of it: params / grads / optim / gathered / activations | host GiB per rank "
             "| MB in node | MB across nodes | step s (compute, link, offload) | fits |",
             "|---|---:|---|---:|---:|---:|---|---|"]
    for r in rows:
        g = r.gpu
        gathered = g.get("gathered", 0) + g.get("hpz_secondary", 0) + g.get("buckets", 0) + \
            g.get("unsharded_gradients", 0)
        parts = " / ".join(_gib(v) for v in (g.get("parameters", 0), g.get("gradients", 0), g.get("optimizer", 0),
                                              gathered, g.get("activations", 0)))
        lines.append(f"| {r.name}{' (recommended)' if r is best else ''} | {_gib(r.gpu_total)} | {parts} | "
                     f"{_gib(r.host_total)} | {r.intra_bytes / 1e6:,.0f} | {r.inter_bytes / 1e6:,.0f} | "
                     f"{r.step_s:.2f} ({r.compute_s:.2f}, {r.comm_s:.2f}, {r.offload_s:.2f}) | "
                     f"{'yes' if r.fits else 'no: ' + r.why_not} |")
    notes = dict.fromkeys(n for r in rows for n in r.notes)  # the runs' own fallbacks, once each
    if notes:
        lines += [""] + [f"note: {n}" for n in notes]
    lines += ["", f"recommended: {best.name}: {why}" if best else f"recommended: none: {why}"]
    return "\n".join(lines)


def parser(prog: str | None = None) -> argparse.ArgumentParser:
    from zeropp_strategy.errors import ArgumentParser

    p = ArgumentParser(prog=prog, description="Memory, bytes and time per config for MODEL on a cluster, "
                       "and the config to use (estimates: see docs/plan.md).")
    p.add_argument("model", metavar="MODEL", help="a Hugging Face folder or its config.json, 'tiny' (the embedded "
                   "default), or module:Class (built with no arguments, on the meta device)")
    p.add_argument("--nodes", type=int, default=1)
    p.add_argument("--gpus-per-node", type=int, default=8)
    p.add_argument("--gpu-memory", default="80GiB", help="per GPU, e.g. 80GiB (an H100 80GB) or 141GB")
    p.add_argument("--host-memory", default="512GB", help="per node")
    p.add_argument("--link", default="100Gbit", help="cross-node bandwidth per node, e.g. 100Gbit or 400Gbit")
    p.add_argument("--intra-link", default="900GB/s", help="per GPU inside a node (NVLink), e.g. 900GB/s")
    p.add_argument("--nvme", default=None, metavar="PATH", help="an NVMe path: adds the NVMe offload config")
    p.add_argument("--micro-batch", type=int, default=1)
    p.add_argument("--seq-len", type=int, default=2048)
    p.add_argument("--activation-checkpointing", action="store_true")
    p.add_argument("--lora", type=int, default=0, metavar="R", help="LoRA rank on every linear layer of the blocks "
                   "(the base frozen); 0 = full training")
    p.add_argument("--tflops", type=float, default=989.0, help="dense bf16 TFLOP/s per GPU (H100 SXM: 989)")
    p.add_argument("--mfu", type=float, default=0.4, help="the fraction of it compute reaches")
    p.add_argument("--json", action="store_true", help="every term as JSON")
    return p


def main(argv: list[str] | None = None, prog: str | None = None) -> int:
    from zeropp_strategy.errors import UsageError

    args = parser(prog).parse_args(argv)
    for name in ("nodes", "gpus_per_node", "micro_batch", "seq_len"):
        if getattr(args, name) < 1:
            raise UsageError(f"--{name.replace('_', '-')}={getattr(args, name)} is invalid", "use 1 or more")
    if not 0 < args.mfu <= 1:
        raise UsageError(f"--mfu={args.mfu} is invalid", "use a fraction in (0, 1], e.g. 0.4")
    if not args.tflops > 0:
        raise UsageError(f"--tflops={args.tflops} is invalid", "use the GPU's dense bf16 TFLOP/s, e.g. 989")
    if args.lora < 0:
        raise UsageError(f"--lora={args.lora} is invalid", "use 0 (full training) or a LoRA rank, e.g. 16")
    try:
        cluster = Cluster(nodes=args.nodes, gpus_per_node=args.gpus_per_node,
                          gpu_memory=parse_bytes(args.gpu_memory, "--gpu-memory"),
                          host_memory=parse_bytes(args.host_memory, "--host-memory"),
                          link=parse_bandwidth(args.link, "--link"),
                          intra_link=parse_bandwidth(args.intra_link, "--intra-link"),
                          tflops=args.tflops, mfu=args.mfu, nvme=args.nvme)
        shape = model_shape(args.model, lora=args.lora)
    except ValueError as e:
        what, _, fix = str(e).partition(" Fix: ")
        raise UsageError(what.rstrip("."), fix.rstrip(".") or "see zeropp plan --help") from None
    work = Workload(micro_batch=args.micro_batch, seq_len=args.seq_len,
                    activation_checkpointing=args.activation_checkpointing)
    rows, best, why = estimate(shape, cluster, work)
    if args.json:
        print(json.dumps({"model": asdict(shape), "cluster": asdict(cluster), "workload": asdict(work),
                          "configs": [{**asdict(r), "gpu_total": r.gpu_total, "host_total": r.host_total}
                                      for r in rows],
                          "recommended": best.name if best else None, "why": why}, indent=1))
    else:
        print(table(shape, cluster, work, rows, best, why))
    return 0

"""Layer: commands. ``zeropp plan``: for a model on a cluster, every config's memory per
rank (by part), bytes per step inside and across nodes, an estimated step time, whether
it fits, and the one to use.

    zeropp plan meta-llama/Llama-3-8B-folder --nodes 2 --gpus-per-node 8 --gpu-memory 80GB \\
        --host-memory 512GB --link 100Gbit --intra-link 900GB/s --micro-batch 4 --seq-len 2048

The arithmetic is the plan's cost (``cost.cost``; [Note: the estimate] in cost.py): the same
function prices the run's own plan at its start (``ZeroSession.explain``). This module adds
the model from a name (built on the meta device), every config side by side, the
recommendation and the command.
"""

from __future__ import annotations

import argparse
import json
import re
from dataclasses import asdict, replace
from typing import Any

from zeropp_strategy.config import ZeroConfig
from zeropp_strategy.cost import (ActivationTrace, ByteModel, Cluster, ConfigEstimate, ModelShape, Workload, cost,
                                  leaf_counts)
from zeropp_strategy.plan import resolve
from zeropp_strategy.presets import PRESETS
from zeropp_strategy.topology import Topology

__all__ = ["ActivationTrace", "Cluster", "ConfigEstimate", "ModelShape", "Workload", "estimate", "main", "model_shape",
           "parse_bandwidth", "parse_bytes", "SHAPES", "trace_activations", "with_traced_activations"]

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
    from transformers import AutoModelForCausalLM

    config, name = _hf_config(spec)
    with torch.device("meta"):
        return AutoModelForCausalLM.from_config(config), name


# Model shapes by name, for sizing a cluster without a download: Llama configs (untied
# embeddings; the weights do not matter to a plan): Llama-3's 8B and 70B, and a 1B
# Llama-style shape (TinyLlama's widths, 16 layers of 16 heads).
SHAPES: dict[str, dict[str, int]] = {
    "llama-1B": {"hidden_size": 2048, "num_hidden_layers": 16, "intermediate_size": 5632, "num_attention_heads": 16,
                 "num_key_value_heads": 16, "vocab_size": 32000},  # a 1B Llama-style shape (TinyLlama's widths)
    "llama3-8B": {"hidden_size": 4096, "num_hidden_layers": 32, "intermediate_size": 14336, "num_attention_heads": 32,
                  "num_key_value_heads": 8, "vocab_size": 128256},
    "llama3-70B": {"hidden_size": 8192, "num_hidden_layers": 80, "intermediate_size": 28672,
                   "num_attention_heads": 64, "num_key_value_heads": 8, "vocab_size": 128256},
}


def _hf_config(spec: str) -> tuple[Any, str]:
    """The Hugging Face config of MODEL (a folder, its config.json, ``tiny`` or a name in
    ``SHAPES``) and its name."""
    from pathlib import Path

    from transformers import AutoConfig, LlamaConfig

    if spec in ("tiny", "embedded"):
        from zeropp_strategy.rlhf.models import _config, tiny_llama_config

        return _config(tiny_llama_config()), "the embedded tiny Llama"
    path = Path(spec)
    if spec in SHAPES and not path.is_dir():  # a folder of that name is the user's model
        return LlamaConfig(**SHAPES[spec], tie_word_embeddings=False), f"{spec} (shape)"

    folder = path.parent if path.name == "config.json" else path
    if not (folder / "config.json").is_file():
        raise ValueError(f"MODEL={spec!r} has no config.json. Fix: a Hugging Face folder, its config.json, "
                         f"'tiny' (the embedded default), a shape ({', '.join(SHAPES)}) or module:Class.")
    return AutoConfig.from_pretrained(str(folder)), folder.name


def _transformers_at_least(version: str) -> bool:
    import transformers

    def key(text: str) -> tuple[int, ...]:
        return tuple(int(part) for part in re.findall(r"\d+", text)[:2])

    return key(transformers.__version__) >= key(version)


def trace_activations(spec: str, workload: Workload, *, params_16bit: bool = False) -> ActivationTrace | None:
    """What one training forward of MODEL (a folder, a config.json, ``tiny`` or a name in
    ``SHAPES``: a Hugging Face causal LM) saves for backward at ``workload``'s micro-batch and length, under bf16
    autocast with fp32 parameters (DDP, stage 1) or 16-bit ones (``params_16bit``: stages
    2/3's gathers), counted on fake tensors (no memory, no compute) the way
    ``ActivationMeter`` counts a real run: each storage once, parameters and views of them
    left out. None for ``module:Class`` (its inputs are unknown)."""
    from pathlib import Path

    import torch
    from torch._subclasses.fake_tensor import FakeTensorMode
    from transformers import AutoModelForCausalLM

    from zeropp_strategy.engine.memory_plan import saved_storage_bytes
    from zeropp_strategy.engine.wrap import select_blocks

    if ":" in spec and not Path(spec).exists():
        return None
    config, _ = _hf_config(spec)
    with FakeTensorMode(allow_non_fake_inputs=True), torch.device("cpu"):
        # dtype always given: from_config would take the config's own (bf16 for most published
        # models); transformers before 4.56 names the argument torch_dtype
        name = "dtype" if _transformers_at_least("4.56") else "torch_dtype"
        model = AutoModelForCausalLM.from_config(config, **{name: torch.bfloat16 if params_16bit else torch.float32})
        model.train()
        if hasattr(model, "loss_type"):  # the causal-LM loss by name (GPT-2's class name does not say it: a warning)
            model.loss_type = "ForCausalLM"
        blocks = select_blocks(model, wrap_modules=(), wrap_min_params=ZeroConfig().wrap_min_params)
        seen: set[Any] = set()
        current: list[int] = []  # the block running, if any
        per_block = [0] * len(blocks)
        counts = {"root": 0, "inputs": 0}

        def pack(t: torch.Tensor) -> torch.Tensor:
            nbytes = saved_storage_bytes(t, seen)  # ActivationMeter's rule, on fake tensors
            if current:
                per_block[current[-1]] += nbytes
            else:
                counts["root"] += nbytes
            return t

        def enter(index: int) -> Any:
            def hook(module: Any, args: tuple, kwargs: dict) -> None:
                current.append(index)
                first = next((a for a in (*args, *kwargs.values()) if isinstance(a, torch.Tensor)), None)
                counts["inputs"] += first.untyped_storage().nbytes() if first is not None else 0
            return hook

        def leave(module: Any, args: tuple, output: Any) -> None:
            current.pop()

        for index, block in enumerate(blocks):
            block.register_forward_pre_hook(enter(index), with_kwargs=True)
            block.register_forward_hook(leave)
        ids = torch.zeros((workload.micro_batch, workload.seq_len), dtype=torch.long)
        with torch.autocast("cpu", dtype=torch.bfloat16), torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            model(input_ids=ids, labels=ids)
    return ActivationTrace(micro_batch=workload.micro_batch, seq_len=workload.seq_len, root=counts["root"],
                           blocks=sum(per_block), largest_block=max(per_block, default=0),
                           block_inputs=counts["inputs"])


def with_traced_activations(shape: ModelShape, spec: str, workload: Workload) -> ModelShape:
    """``shape`` with MODEL's activations traced for ``workload`` (both traces), or as it was
    when MODEL cannot be traced: an estimate never stops, the formula stands in and the
    table says so."""
    try:
        return replace(shape, activation_trace=trace_activations(spec, workload),
                       activation_trace_16bit=trace_activations(spec, workload, params_16bit=True))
    except Exception as err:  # noqa: BLE001 - a model fake tensors cannot run: the formula stands in
        first_line = str(err).partition("\n")[0][:200] or "(no message)"
        return replace(shape, untraced=f"{type(err).__name__}: {first_line}")


def model_shape(spec: str, *, lora: int = 0) -> ModelShape:
    """The shape of MODEL (a folder, a config.json, ``tiny``, a name in ``SHAPES`` or
    ``module:Class``), built on the meta device; ``lora``: rank of LoRA adapters on every linear layer inside the blocks
    (then only those train)."""
    from torch import nn

    from zeropp_strategy.engine.wrap import frozen_leaves, gathered_in_backward, select_blocks

    model, name = _meta_model(spec)
    params = sum(p.numel() for p in model.parameters())
    if params == 0:
        raise ValueError(f"MODEL={spec!r} has no parameters. Fix: name the model to train.")
    min_params = ZeroConfig().wrap_min_params  # the run's default
    blocks = select_blocks(model, wrap_modules=(), wrap_min_params=min_params)
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
    if lora:  # the base is frozen: at stage 3 an untied embedding and head become groups of their own
        model.requires_grad_(False)
    leaves = [(sum(p.numel() for p in leaf.parameters()), gathered_in_backward(leaf))
              for leaf in frozen_leaves(model, blocks, min_params=min_params)]
    config = getattr(model, "config", None)
    hidden = int(getattr(config, "hidden_size", 0) or 0)
    vocab = int(getattr(config, "vocab_size", 0) or 0)
    layers = int(getattr(config, "num_hidden_layers", 0) or len(blocks))
    return ModelShape(name=name, params=params, trainable=trainable,
                      root_params=params - sum(in_blocks) - (trainable if lora else 0),
                      largest_block=max(in_blocks, default=0), blocks=len(blocks), hidden=hidden, layers=layers,
                      vocab=vocab, **leaf_counts(leaves))


# name -> ZeroConfig fields (None: plain DDP), in the order the table lists them
CONFIGS: dict[str, dict[str, Any] | None] = {
    "ddp": None,
    "zeropp_stage_1": {"stage": 1},
    "zeropp_stage_2": {"stage": 2},
    "zeropp_stage_3": {"stage": 3},
    "zeropp": dict(PRESETS["zeropp"]),
    "zeropp_4bit": dict(PRESETS["zeropp_4bit"]),
    "zeropp_delta": dict(PRESETS["zeropp_delta"]),
    "zeropp_stage_3 + offload_optimizer=cpu": {"stage": 3, "offload_optimizer": "cpu"},
    # the offload presets with device strings: _one adds the cluster's NVMe path
    "zeropp_offload": {**PRESETS["zeropp"], "offload_optimizer": "cpu", "offload_param": "cpu"},
    "zeropp_offload_nvme": {**PRESETS["zeropp"], "offload_optimizer": "nvme", "offload_param": "nvme"},
}
NOT_RECOMMENDED = {"zeropp_4bit": "its loss ended 2.3% above stage 3's over 6 seeds of our 200-step benchmark "
                                   "(docs/zeropp_measurements.md, \"The benchmark's GPT-2 was mis-initialized\")"}
"""Rows shown but never recommended on their own, with the reason the recommendation names."""
FROZEN_CONFIGS: dict[str, dict[str, Any]] = {
    "zeropp + frozen int8": {**CONFIGS["zeropp"], "quantize_frozen_weights": True},  # type: ignore[dict-item]
    "zeropp + frozen int4": {**CONFIGS["zeropp"], "quantize_frozen_weights": True,  # type: ignore[dict-item]
                             "frozen_weight_bits": 4},
}


def _one(name: str, cfg: dict[str, Any] | None, m: ModelShape, c: Cluster, w: Workload) -> ConfigEstimate:
    """``cfg`` (None: DDP) priced with the decisions the run itself makes for this topology
    (``plan.resolve``: fallbacks included), under bf16-mixed with AdamW."""
    if cfg is None:
        return cost(name, None, m, c, w)
    fields = {k: ({"device": v, "nvme_path": c.nvme} if v == "nvme" else v) for k, v in cfg.items()}
    config = ZeroConfig(**fields)
    plan = resolve(config, Topology(world_size=c.world, rank=0, ranks_per_node=c.gpus_per_node))
    e = cost(name, plan, m, c, w, b=ByteModel.of("bf16-mixed", plan))
    e.zero_config = dict(cfg)
    return e


def estimate(m: ModelShape, c: Cluster, w: Workload, extra: dict[str, dict[str, Any]] | None = None,
             ) -> tuple[list[ConfigEstimate], ConfigEstimate | None, str]:
    """Every config's estimate (and ``extra``'s: name -> ZeroConfig fields), the recommended
    one (or None) and why."""
    configs = dict(CONFIGS)
    if m.frozen:
        configs.update(FROZEN_CONFIGS)
    if not c.nvme:
        configs.pop("zeropp_offload_nvme")
    rows = [_one(name, cfg, m, c, w) for name, cfg in configs.items()]
    if c.world == 1:
        rows = [r for r in rows if r.name == "ddp" or "offload" in r.name]
    largest = rows[-2:]  # the configs that need the least GPU memory: the offload rows
    rows += [_one(name, cfg, m, c, w) for name, cfg in (extra or {}).items()]
    fitting = [r for r in rows if r.fits and r.name not in NOT_RECOMMENDED]
    if not fitting:
        return rows, None, ("nothing fits: " + "; ".join(f"{r.name}: {r.why_not}" for r in largest)
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
    for r in rows:
        if r.name in NOT_RECOMMENDED and r.fits and r.step_s < 0.95 * best.step_s:
            why += f"; {r.name} would be {r.step_s:.2f} s, not recommended on its own: {NOT_RECOMMENDED[r.name]}"
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
             "activations: " + ("traced (one training forward on fake tensors, bf16 autocast)"
                                if m.activation_trace is not None else
                                f"34 s b h per layer (not traced: {m.untraced or 'module:Class inputs are unknown'})"),
             "",
             "| config | GPU GiB | of it: params / grads / optim / gathered / activations | host GiB per rank "
             "| MB in node | MB across nodes | step s (compute, link, offload) | fits |",
             "|---|---:|---|---:|---:|---:|---|---|"]
    for r in rows:
        g = r.gpu
        gathered = g.get("gathered", 0) + g.get("hpz_secondary", 0) + g.get("delta_copies", 0) + \
            g.get("feedback_errors", 0) + g.get("buckets", 0) + g.get("unsharded_gradients", 0)
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
    p.add_argument("model", metavar="MODEL", nargs="?",
                   help="a Hugging Face folder or its config.json, 'tiny' (the embedded default), a model "
                   f"shape by name ({', '.join(SHAPES)}), or module:Class (built with no arguments, on the meta "
                   "device)")
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
    p.add_argument("--overlap", type=float, default=1.0,
                   help="the share of the link time that hides behind compute: 1 for GPUs (NCCL's own streams), "
                   "0 for gloo on CPUs (communication takes the cores compute needs)")
    p.add_argument("--with", dest="extra", action="append", default=[], metavar="FIELD=VALUE,...",
                   help="one more row: ZeroConfig fields, e.g. --with stage=1,offload_optimizer=cpu (repeatable)")
    p.add_argument("--explain", nargs="?", const="", default=None, metavar="CONFIG",
                   help="after the table, what happens under a config, in sentences: the recommended one and every "
                        "--with row (no value), one row by name, or 'all'")
    p.add_argument("--json", action="store_true", help="every term as JSON")
    return p


def _extra_row(text: str, cluster: Cluster) -> tuple[str, dict[str, Any]]:
    """``--with stage=1,offload_optimizer=cpu``: the row's name and its ZeroConfig fields (one
    YAML flow mapping, so ``wrap_modules=[A,B]`` is a list), checked as the run would check
    them on this cluster: ZeroConfig, then ``validate_for_world``."""
    import yaml

    from zeropp_strategy.errors import UsageError

    fix = "e.g. --with stage=1,offload_optimizer=cpu (values as YAML: 1, true, cpu, [A,B])"
    names = re.findall(r"(?:^|,)\s*([A-Za-z_]\w*)\s*=", text)
    twice = sorted({n for n in names if names.count(n) > 1})
    if twice:  # YAML would keep the last value without a word
        raise UsageError(f"--with={text!r} gives {twice[0]} more than once", "give each field once in a row")
    try:
        fields = yaml.safe_load("{" + re.sub(r"(^|,)\s*([A-Za-z_]\w*)\s*=", r"\1\2: ", text) + "}")
    except yaml.YAMLError:
        fields = None
    if not isinstance(fields, dict) or not fields or any(v is None and f"{k}=" not in text for k, v in fields.items()):
        raise UsageError(f"--with={text!r} is not a list of FIELD=VALUE", fix)
    try:
        offload = {k for k in ("offload_optimizer", "offload_param") if fields.get(k) == "nvme"}
        if offload and not cluster.nvme:
            raise ValueError(f"{sorted(offload)[0]}='nvme' needs a drive. Fix: add --nvme PATH.")
        config = ZeroConfig(**{k: ({"device": v, "nvme_path": cluster.nvme} if k in offload else v)
                               for k, v in fields.items()})
        config.validate_for_world(cluster.world, cluster.gpus_per_node)
    except (TypeError, ValueError) as e:
        what, _, why = str(e).partition(" Fix: ")
        raise UsageError(f"--with={text!r}: {what.rstrip('.')}", why.rstrip(".") or "see ZeroConfig's fields "
                         "in docs/strategy.md") from None
    return text, fields


def explanations(rows: list[ConfigEstimate], best: ConfigEstimate | None, which: str, extra: list[str]) -> str:
    """``--explain``: the chosen rows' ``explanation``, one paragraph each."""
    from zeropp_strategy.errors import UsageError

    names = [r.name for r in rows]
    if which == "all":
        chosen = rows
    elif which:
        if which not in names:
            raise UsageError(f"--explain={which!r} is not a row of this table", f"use one of {names} or 'all'")
        chosen = [r for r in rows if r.name == which]
    else:
        chosen = [r for r in rows if (best is not None and r is best) or r.name in extra]
        if not chosen:
            return "nothing fits, so no config is recommended: --explain NAME explains one row, --explain all each."
    return "\n\n".join(f"{r.name}:\n" + "\n".join(f"  - {line}" for line in r.explanation) for r in chosen)


def main(argv: list[str] | None = None, prog: str | None = None) -> int:
    from zeropp_strategy.errors import UsageError

    p = parser(prog)
    args = p.parse_args(argv)
    if args.model is None:  # `--explain MODEL` with no row name: argparse gave MODEL to --explain
        if args.explain in (None, "", "all"):
            p.error("the following arguments are required: MODEL")
        args.model, args.explain = args.explain, ""
    for name in ("nodes", "gpus_per_node", "micro_batch", "seq_len"):
        if getattr(args, name) < 1:
            raise UsageError(f"--{name.replace('_', '-')}={getattr(args, name)} is invalid", "use 1 or more")
    if not 0 < args.mfu <= 1:
        raise UsageError(f"--mfu={args.mfu} is invalid", "use a fraction in (0, 1], e.g. 0.4")
    if not 0 <= args.overlap <= 1:
        raise UsageError(f"--overlap={args.overlap} is invalid",
                         "use a fraction in [0, 1]: 1 for GPUs, 0 for gloo on CPUs")
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
                          tflops=args.tflops, mfu=args.mfu, nvme=args.nvme, overlap=args.overlap)
        shape = model_shape(args.model, lora=args.lora)
    except ValueError as e:
        what, _, fix = str(e).partition(" Fix: ")
        raise UsageError(what.rstrip("."), fix.rstrip(".") or "see zeropp plan --help") from None
    work = Workload(micro_batch=args.micro_batch, seq_len=args.seq_len,
                    activation_checkpointing=args.activation_checkpointing)
    shape = with_traced_activations(shape, args.model, work)
    extra = dict(_extra_row(text, cluster) for text in args.extra)
    rows, best, why = estimate(shape, cluster, work, extra)
    if args.explain:  # a row's name is checked under --json too
        explanations(rows, best, args.explain, list(extra))
    if args.json:
        print(json.dumps({"model": asdict(shape), "cluster": asdict(cluster), "workload": asdict(work),
                          "configs": [{**asdict(r), "gpu_total": r.gpu_total, "host_total": r.host_total}
                                      for r in rows],
                          "recommended": best.name if best else None, "why": why}, indent=1))
    else:
        print(table(shape, cluster, work, rows, best, why))
        if args.explain is not None:
            print("\n" + explanations(rows, best, args.explain, list(extra)))
    return 0

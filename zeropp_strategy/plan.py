"""Layer: plan. What a ``ZeroConfig`` means for this job, decided once.

``ZeroConfig`` is the flat, validated surface users write (keyword arguments, YAML keys,
DeepSpeed JSON). Its fields group into five concerns, each readable as a small policy
(``policies(config)``):

    sharding   stage, blocks, activation checkpointing, buckets, gather/reduce dtypes
    zeropp     qwZ, hpZ, qgZ and quantized frozen weights
    offload    optimizer state and parameter shards: device, CPU or NVMe
    checkpoint the checkpoint format
    runtime    peer watchdog, simulated nodes

Several fields are sentinels whose meaning depends on the job: ``hpz_partition_size`` 0
(ranks per node) or 1 (off), ``gather_16bit`` None (the front-end's default),
``state_dict_type`` None (by stage), ``reduce_dtype`` None (the precision's own), and ZeRO++
switches that cannot help on one node. ``resolve(config, topology)`` decides every one of
them once, into a ``Plan``, with the reason for each fallback; the session logs it once at
start (``Plan.describe``), and the engine reads the plan instead of re-deriving them.

The plan also prices itself: ``cost`` gives a plan's memory per rank, bytes per step and
step time for a model on a cluster, for ``zeropp plan`` (every config) and for a run's own
plan at its start (``ZeroSession.explain``).

[Note: the estimate]
``cost`` is arithmetic on the model's shape (for ``zeropp plan`` read from a meta-device
build, so a 70B model costs seconds, its activations traced on fake tensors; for a run, from
its prepared modules): the parameter count ``P``,
the trainable count ``T`` (``P``, or the LoRA adapters with ``--lora R``), the parameters
outside the repeated blocks (``P_root``: embeddings, head, final norm) and the largest
block. The formulas are the ones docs/stages.md and docs/zeropp.md derive and the ledger
measures; the bytes per element are a ``ByteModel``: under ``bf16-mixed`` with AdamW (the
default) fp32 parameters (``a = 4`` bytes), fp32 gradients (``g = 4``), two fp32 moments
(``k = 8``), 16-bit gathers (``c = 2``), fp32 reduces (``r = 4``); ``ByteModel.of`` reads
them from a run's precision and plan (bits and blocks of qwZ and qgZ per hop). ``M`` nodes
of ``L`` GPUs, ``N = M L`` ranks.

- **Memory per GPU**: parameters, gradients and optimizer state as each stage holds them;
  the gathered working set of stages 2/3 (stage 2: every group, from its forward to its
  backward; stage 3: the root group and the two largest blocks, the one computing and the
  one prefetched); hpZ's secondary shard ``c P / L``; one bucket or one group of unsharded
  gradients; activations from the micro-batch: traced when the model can be (``zeropp
  plan`` runs one training forward of the model on fake tensors under bf16 autocast and
  counts what autograd saves for backward, as the memory plan's ``ActivationMeter``
  measures a real run: ``ActivationTrace``), else ``34 s b h`` bytes per layer as
  Korthikanti et al. count for 16-bit activations without the attention matrix, which
  SDPA does not store (``2 s b h`` per layer with activation checkpointing; plus ``6 s b
  V`` for the logits and their fp32 loss). The formula assumes a fused GeLU and 16-bit
  everything: GPT-2's elementwise ``gelu_new`` saved 1.7x it with 16-bit parameters, 2.2x
  with fp32 ones (plus the fp32 residual stream and autocast's weight copies;
  benchmarks/plan_accuracy.py). The trace follows CPU autocast's op lists (CUDA's keep a
  few more ops in fp32, e.g. ``pow``: GPT-2's ``gelu_new`` would save more on a GPU). ``RUNTIME_GPU_BYTES`` for the CUDA context and allocator.
  Offloaded state moves to the host column (NVMe: to the disk column, with the in-flight
  buffers in host memory).
- **Bytes per step per rank**, as the ledger books them: the collectives of each stage on
  the two-hop routes (docs/stages.md, "Across nodes"): a gather of ``B`` bytes in all sends
  ``B (M-1)/N`` across nodes and ``B (L-1)/L`` inside per rank, a reduce-scatter of ``B``
  bytes per rank the same; DDP's ring all-reduce ``2 (N-1)/N B``, ``M/N`` of it across;
  qwZ at 1 + 4/256 bytes per element, qgZ at 0.5 + 4/64 (int4, blocks of 64; the
  config's bits and blocks per hop), hpZ's backward gather inside the node only; every
  tensor counted as quantized (``quantize_min_elems`` is ignored). NCCL's native rings on GPUs put up to ``M/(M-1)``
  times more of a plain collective on the link (2x on two nodes): the cross-node figures
  are then a lower bound, and ``tests/test_estimate.py`` checks them against the ledger of a
  measured run.
- **Step time**: compute ``(6 P + 2 P_ckpt) tokens / (TFLOPs x MFU)`` for full training
  (``4 P + 2 T`` with frozen weights: the input gradients still pass every layer), plus the
  communication not hidden behind it: the larger of compute and link time, plus one
  block's share of the link time (the first gather and the last reduce have nothing to
  overlap with); with ``Cluster.overlap`` below 1 (``--overlap``: gloo on CPUs, where
  communication takes the cores compute needs) that share of the step moves toward
  compute + link. A node's cross-node bytes share its link (``--link`` per node), a GPU's
  intra-node bytes its ``--intra-link``. Offload adds, not overlapped, the host's AdamW
  step over the optimizer state (``HOST_BYTES_PER_S``) and the PCIe copies
  (``PCIE_BYTES_PER_S``): the gradient shards down once, the parameter shards up once after
  the step, or twice (each gather) when they live on the host; NVMe adds the state's read
  and write (``NVME_BYTES_PER_S``).

It is an estimate: the measured MFU, the allocator's fragmentation and the framework's
buffers decide the rest. ``zeropp plan --json`` and ``ZeroSession.explain`` give every term, so a
measured run can be set beside it (tests/test_callbacks.py sets a run's own plan beside
its ledger; docs/plan.md compares ``zeropp plan`` with measured runs).
"""

from __future__ import annotations

from dataclasses import dataclass, field, fields
from typing import Any

from zeropp_strategy.config import OffloadConfig, ZeroConfig
from zeropp_strategy.topology import Topology

__all__ = [
    "ActivationTrace",
    "ByteModel",
    "CheckpointPolicy",
    "Cluster",
    "ConfigEstimate",
    "ModelShape",
    "OffloadPolicy",
    "Plan",
    "RuntimePolicy",
    "ShardingPolicy",
    "Workload",
    "ZeroPPPolicy",
    "activations",
    "cost",
    "explain",
    "leaf_counts",
    "policies",
    "resolve",
]


@dataclass(frozen=True, kw_only=True, slots=True)
class ShardingPolicy:
    """What is partitioned and how gradients and parameters move (see ``ZeroConfig`` for
    each field's documentation)."""

    stage: int
    wrap_modules: tuple[str, ...]
    wrap_min_params: int
    activation_checkpointing: bool
    meta_init: bool
    reduce_bucket_bytes: int
    allgather_bucket_bytes: int
    overlap_param_gather: bool
    gather_16bit: bool | None
    reduce_dtype: str | None


@dataclass(frozen=True, kw_only=True, slots=True)
class ZeroPPPolicy:
    """ZeRO++: quantized weights (qwZ), the secondary partition (hpZ), quantized gradients
    (qgZ), and frozen weights stored quantized."""

    quantized_weights: bool
    weight_quant_block_elems: int
    weight_quant_bits: int
    weight_delta_coding: bool
    hpz_partition_size: int
    quantized_gradients: bool
    gradient_quant_bits: int
    gradient_quant_bits_intra: int | None
    gradient_error_feedback: bool
    gradient_error_beta: float
    gradient_error_reset_steps: int
    gradient_quant_block_elems: int
    quantized_gradients_on_single_node: bool
    quantize_min_elems: int
    quantize_frozen_weights: bool
    frozen_weight_bits: int


@dataclass(frozen=True, kw_only=True, slots=True)
class OffloadPolicy:
    """Where optimizer state and parameter shards live."""

    offload_optimizer: OffloadConfig
    offload_param: OffloadConfig
    host_memory_budget_bytes: int | str | None


@dataclass(frozen=True, kw_only=True, slots=True)
class CheckpointPolicy:
    """The checkpoint format."""

    state_dict_type: str | None


@dataclass(frozen=True, kw_only=True, slots=True)
class RuntimePolicy:
    """Failure detection and topology simulation."""

    peer_timeout: float
    simulated_nodes: int


_POLICIES = (ShardingPolicy, ZeroPPPolicy, OffloadPolicy, CheckpointPolicy, RuntimePolicy)


def policies(config: ZeroConfig) -> tuple[ShardingPolicy, ZeroPPPolicy, OffloadPolicy, CheckpointPolicy, RuntimePolicy]:
    """The five policies of ``config``: every field of it, each in exactly one policy."""
    return tuple(cls(**{f.name: getattr(config, f.name) for f in fields(cls)}) for cls in _POLICIES)  # type: ignore[return-value]


@dataclass(frozen=True, kw_only=True, slots=True)
class Plan:
    """Every sentinel of a ``ZeroConfig`` decided for one job (``resolve``).

    ``hpz_group``: ranks holding a secondary shard (1 = off); ``reshard_after_forward``: what
    FSDP2 is given (stage 2: False; stage 3: True, or ``hpz_group``); ``quantized_weights`` /
    ``quantized_gradients``: whether qwZ / qgZ quantize anything in this job;
    ``gradient_bits`` / ``gradient_bits_inside``: qgZ's codes across / inside nodes;
    ``error_feedback``: qgZ keeps its cross-node quantization error; ``weight_delta``: qwZ
    sends each shard's change since its last gather (kept rows per rank);
    ``frozen_weight_bits``:
    frozen weights stored at 8 or 4 bits (0: dense); ``weight_bits``: qwZ's codes (8 or 4; 2
    with weight deltas);
    ``weight_block_elems`` / ``gradient_block_elems`` / ``quantize_min_elems`` /
    ``error_beta`` / ``error_reset_steps``: the collectives' parameters, as configured;
    ``overlap_param_gather``: stage 1's
    post-step gather finishes during the next forward; ``notes``: one line per fallback, saying why;
    ``wrap_modules`` / ``wrap_min_params`` / ``activation_checkpointing``: how the model is
    cut into groups and whether they recompute; ``reduce_bucket_bytes`` /
    ``allgather_bucket_bytes``: stage 1's buckets; ``offload_param_settings`` /
    ``offload_optimizer_settings``: the offload blocks as configured (device, NVMe path,
    pinning, staging buffers; ``offload_param`` / ``offload_optimizer`` are their devices);
    ``host_memory_budget_bytes``: the memory plan's budget per rank (``"auto"``, bytes, or
    None for no plan).
    """

    stage: int
    world_size: int
    num_nodes: int
    ranks_per_node: int
    hpz_group: int
    reshard_after_forward: bool | int
    quantized_weights: bool
    quantized_gradients: bool
    gather_16bit: bool
    reduce_dtype: str | None
    state_dict_type: str
    offload_optimizer: str
    offload_param: str
    notes: tuple[str, ...]
    gradient_bits: int = 4
    gradient_bits_inside: int = 4
    error_feedback: bool = False
    weight_delta: bool = False
    frozen_weight_bits: int = 0
    overlap_param_gather: bool = False
    weight_bits: int = 8  # qwZ's codes, when quantized_weights
    weight_block_elems: int = 256  # qwZ's (and the frozen shards') elements per scale
    gradient_block_elems: int = 64  # qgZ's
    quantize_min_elems: int = 4096  # smaller tensors take the plain collectives
    error_beta: float = 0.8  # error feedback's moving average, when error_feedback
    error_reset_steps: int = 1024  # ... and its reset period (0: never)
    wrap_modules: tuple[str, ...] = ()
    wrap_min_params: int = 1_000_000
    activation_checkpointing: bool = False
    reduce_bucket_bytes: int = 25 * 2**20
    allgather_bucket_bytes: int = 50 * 2**20
    offload_param_settings: OffloadConfig = field(default_factory=OffloadConfig)
    offload_optimizer_settings: OffloadConfig = field(default_factory=OffloadConfig)
    host_memory_budget_bytes: int | str | None = "auto"

    def describe(self) -> str:
        """One line for the log: the plan's decisions."""
        parts = [f"stage {self.stage}"]
        if self.stage == 3:
            parts.append(f"hpZ group {self.hpz_group}" if self.hpz_group > 1 else "hpZ off")
        if self.quantized_weights and self.weight_delta:
            parts.append(f"qwZ {self.weight_bits}-bit weight deltas across nodes (the kept rows inside)")
        elif self.quantized_weights:
            parts.append(f"qwZ int{self.weight_bits} gathers across nodes (the codes on both hops)")
        if self.quantized_gradients:
            feedback = " with error feedback" if self.error_feedback else ""
            across = f", {self.gradient_bits}-bit across{feedback}" if self.num_nodes > 1 else ", one node"
            parts.append(f"qgZ gradient reduce (int{self.gradient_bits_inside} inside the node{across})")
        parts.append(f"{'16-bit' if self.gather_16bit else 'full-precision'} gathers under mixed precision")
        parts.append(f"reduce dtype {self.reduce_dtype or 'of the precision'}")
        parts.append(f"{self.state_dict_type} checkpoints")
        if self.offload_optimizer != "none" or self.offload_param != "none":
            parts.append(f"offload optimizer={self.offload_optimizer} param={self.offload_param}")
        return "zeropp plan: " + ", ".join(parts)


def explain(plan: Plan | None) -> list[str]:
    """What happens to each kind of state, in each step, under ``plan`` (None: DDP), in plain
    sentences: parameters, gradients, optimizer, the collectives on each hop, checkpoints,
    then the fallbacks. ``zeropp plan --explain`` prints it for every config, and a run's
    ``explain()`` for its own."""
    if plan is None:
        return ["Parameters, gradients and optimizer state: every rank holds all of them (DDP).",
                "Backward: the gradients are all-reduced in buckets while backward runs; every rank then steps the "
                "whole optimizer."]
    N, M, L = plan.world_size, plan.num_nodes, plan.ranks_per_node
    host_step = {"cpu": "in host memory, stepped on the host CPU",
                 "nvme": "in swap files on NVMe, streamed through host buffers and stepped on the host CPU"}
    two_hops = (" (on gloo in two hops, inside each node first, then across nodes; on GPUs NCCL's own collective)"
                if M > 1 else "")
    lines = []
    if plan.stage == 1:
        after = ("they are all-gathered in the background and the next forward waits for each bucket's rows "
                 "(overlap_param_gather)" if plan.overlap_param_gather else
                 "they are all-gathered before the step returns, so every rank again holds every parameter")
        lines += [
            "Parameters: every rank holds all of them, as DDP does.",
            f"Backward: gradients fill DDP's buckets; each bucket is reduce-scattered by rows as it fills{two_hops}, "
            f"so each rank ends with the averaged rows it owns (1/{N} of each gradient). With the post-step gather "
            "below, the bytes equal DDP's all-reduce.",
            f"Optimizer: each rank keeps the state of its own rows only (1/{N}), "
            f"{host_step.get(plan.offload_optimizer, 'on the device')}; after its step the updated rows go to every "
            f"rank: {after}.",
        ]
    else:
        frozen = (f" Frozen weights, if any, are stored and gathered as int{plan.frozen_weight_bits} codes (a weight "
                  "whose rows do not divide evenly stays dense)." if plan.frozen_weight_bits else "")
        held = {"none": "on the device", "cpu": "in host memory, copied to the device for each gather",
                "nvme": "in memory-mapped swap files on NVMe, read for each gather"}[plan.offload_param]
        if plan.stage == 2:
            gathers = ("Forward: each block's parameters are all-gathered before it runs and kept until its backward "
                       f"(one gather per step){two_hops}.")
        else:
            if plan.hpz_group > 1 and plan.frozen_weight_bits:
                again = ("gathered again in backward from every rank: hpZ keeps no secondary shard of a block "
                         "holding frozen codes (other blocks: from the secondary shard of their group of "
                         f"{plan.hpz_group} ranks)")
            elif plan.hpz_group > 1:
                where = ("inside the node: nothing crosses nodes" if plan.hpz_group <= L else
                         f"a group spanning {plan.hpz_group // L} nodes")
                again = (f"gathered again in backward from a secondary shard held by each group of {plan.hpz_group} "
                         f"ranks (hpZ, {where})")
            else:
                again = "gathered again in backward"
            gathers = (f"Forward: each block's parameters are all-gathered before it runs{two_hops} and freed after; "
                       f"{again}. The parameters outside the blocks (usually the embeddings and the head) stay "
                       "gathered from forward to backward, except a frozen, untied embedding and head, which "
                       "are gathered around their own forward (the head again in backward).")
        lines += [f"Parameters: sharded, 1/{N} of each FSDP group per rank, {held}.{frozen}", gathers]
        if plan.quantized_weights and plan.weight_delta:
            lines.append(f"qwZ with weight deltas: a gather that spans nodes sends, across nodes, {plan.weight_bits}-bit "
                         "codes of each shard's change since its last gather (one fp32 scale per block); each rank "
                         f"adds them to its kept copy (in the gather dtype) of the shards of its local index on every "
                         f"node (1/{L} of the gathered groups, kept between steps), whose rounding the sender feeds "
                         "back into its next change; inside the node that copy is gathered as it is. The first "
                         "gather sends the shards themselves. Every rank computes with the same weights.")
        elif plan.quantized_weights:
            lines.append(f"qwZ: a gather that spans nodes sends int{plan.weight_bits} codes with one fp32 scale per "
                         "block, on both hops; every rank computes with the same dequantized weights.")
        small = ("Tensors below quantize_min_elems, and non-float ones, take the plain reduce-scatter in the reduce "
                 "dtype.")
        if plan.quantized_gradients and M > 1:
            kept = (" Each rank keeps the cross-node hop's quantization error and adds it to its next reduction "
                    "(error feedback)." if plan.error_feedback else "")
            across = ("2-bit codes (-1/0/+1 times the block's largest value)" if plan.gradient_bits == 2
                      else f"int{plan.gradient_bits}")
            lines.append(f"Backward: gradients are reduce-scattered per block in two hops (qgZ): int"
                         f"{plan.gradient_bits_inside} codes inside the node and {across} across "
                         f"nodes, summed in fp32.{kept} {small}")
        elif plan.quantized_gradients:
            lines.append(f"Backward: gradients are reduce-scattered per block as int{plan.gradient_bits_inside} codes "
                         f"in one hop inside the node (qgZ on a single node), summed in fp32. {small}")
        else:
            lines.append(f"Backward: gradients are reduce-scattered per block as they are computed{two_hops}.")
        if plan.offload_optimizer != "none":
            optimizer = host_step[plan.offload_optimizer]
        elif plan.offload_param != "none":
            optimizer = "in host memory, beside the offloaded shards and their gradients, stepped on the host CPU"
        else:
            optimizer = "on the device"
        lines.append(f"Optimizer: each rank keeps and steps the state of its shard (1/{N}), {optimizer}.")
    lines.append("Checkpoints: " + ("one file, written by rank 0." if plan.state_dict_type == "full" else
                                    "a directory, every rank writing its own shards (resharded on load)."))
    lines += [f"Topology: {N} rank(s) as {M} node(s) x {L}."] + [f"Fallback: {n}" for n in plan.notes]
    return lines


def resolve(config: ZeroConfig, topology: Topology, *, gather_16bit_default: bool = True) -> Plan:
    """Decide every sentinel of ``config`` for ``topology`` (no collective, no side effect).

    ``gather_16bit_default``: what ``gather_16bit=None`` means for the front-end (True under
    Lightning and Fabric, False under ``ZeroPPAccelerator``: Accelerate's mixed precision is
    autocast over fp32 weights).
    """
    notes: list[str] = []
    stage, world = config.stage, topology.world_size
    one_node = topology.num_nodes == 1

    # hpZ: 0 = ranks per node; it helps only when the group is larger than one rank and
    # smaller than the world (a group of every rank is plain stage 3).
    asked = config.hpz_partition_size or topology.ranks_per_node
    hpz_group = asked if stage == 3 and 1 < asked < world else 1
    if stage == 3 and config.hpz_partition_size != 1 and hpz_group == 1:
        why = (f"its group would be {asked} rank (one rank per node): a secondary shard of one rank is the "
               "whole model" if asked <= 1 else
               f"its group of {asked} ranks holds all {world} ranks (a single node)")
        notes.append(f"zeropp: hpZ is off: {why}, so backward gathers use the plain stage-3 path.")
    reshard_after_forward: bool | int = False if stage == 2 else (hpz_group if hpz_group > 1 else True)

    quantized_weights = config.quantized_weights and not one_node
    if config.quantized_weights and one_node:
        notes.append("zeropp: qwZ quantizes only cross-node gathers; on one node they stay 16/32-bit.")
    quantized_gradients = config.quantized_gradients and (not one_node or config.quantized_gradients_on_single_node)
    if config.quantized_gradients and not quantized_gradients:
        notes.append("zeropp: qgZ falls back to the plain reduce-scatter on a single node "
                     "(set quantized_gradients_on_single_node=True to quantize anyway).")

    gather_16bit = gather_16bit_default if config.gather_16bit is None else config.gather_16bit
    return Plan(
        stage=stage,
        world_size=world,
        num_nodes=topology.num_nodes,
        ranks_per_node=topology.ranks_per_node,
        hpz_group=hpz_group,
        reshard_after_forward=reshard_after_forward,
        quantized_weights=quantized_weights,
        quantized_gradients=quantized_gradients,
        gather_16bit=gather_16bit,
        reduce_dtype=config.reduce_dtype,
        state_dict_type=config.resolved_state_dict_type(),
        offload_optimizer=config.offload_optimizer.device,
        offload_param=config.offload_param.device,
        notes=tuple(notes),
        gradient_bits=config.gradient_quant_bits,
        gradient_bits_inside=config.gradient_quant_bits_intra or config.gradient_quant_bits,
        error_feedback=quantized_gradients and not one_node and config.gradient_error_feedback,  # one node: no cross hop
        weight_delta=quantized_weights and config.weight_delta_coding,
        frozen_weight_bits=config.frozen_weight_bits if config.quantize_frozen_weights and stage > 1 else 0,
        overlap_param_gather=stage == 1 and config.overlap_param_gather,
        **{field_: getattr(config, name) for field_, name in _AS_CONFIGURED.items()},
    )


# Plan fields taken from the config as they are: Plan field -> ZeroConfig field.
_AS_CONFIGURED = {
    "weight_bits": "weight_quant_bits",
    "weight_block_elems": "weight_quant_block_elems",
    "gradient_block_elems": "gradient_quant_block_elems",
    "quantize_min_elems": "quantize_min_elems",
    "error_beta": "gradient_error_beta",
    "error_reset_steps": "gradient_error_reset_steps",
    "wrap_modules": "wrap_modules",  # a tuple already (ZeroConfig normalizes it)
    "wrap_min_params": "wrap_min_params",
    "activation_checkpointing": "activation_checkpointing",
    "reduce_bucket_bytes": "reduce_bucket_bytes",
    "allgather_bucket_bytes": "allgather_bucket_bytes",
    "offload_param_settings": "offload_param",
    "offload_optimizer_settings": "offload_optimizer",
    "host_memory_budget_bytes": "host_memory_budget_bytes",
}


# -- what a plan costs ([Note: the estimate] above) -------------------------------------------

@dataclass(frozen=True)
class ActivationTrace:
    """What one micro-batch's training forward saves for backward, in bytes, traced without
    memory (``estimate.trace_activations``: fake tensors, bf16 autocast, the parameters in
    fp32 or in 16 bits): outside the blocks (embeddings, final norm, logits and loss), in
    all blocks, in the largest one, and the blocks' inputs (what activation checkpointing
    keeps of them)."""

    micro_batch: int
    seq_len: int
    root: int
    blocks: int
    largest_block: int
    block_inputs: int


@dataclass(frozen=True)
class ModelShape:
    """What the estimate needs of a model: counts of elements (global, not per shard)."""

    name: str
    params: int
    trainable: int
    root_params: int  # outside the repeated blocks (embeddings, head, final norm)
    largest_block: int
    blocks: int
    hidden: int
    layers: int
    vocab: int
    # Stage 3's frozen leaves ([Note: frozen leaves] in engine/wrap.py), counted in
    # root_params too: each is gathered around its own forward instead of with the root
    # for the whole step, and the ones whose backward reads the weight (a head, not an
    # embedding) once more in backward.
    largest_leaf: int = 0
    leaf_params: int = 0  # all the leaves
    leaf_backward: int = 0  # the leaves gathered again in backward
    # Traced activations, used for a workload of their micro-batch and length: the forward
    # computing with fp32 parameters (DDP, stage 1: autocast's 16-bit copies of the weights
    # and an fp32 residual stream included) and with 16-bit gathered ones (stages 2/3).
    activation_trace: ActivationTrace | None = None
    activation_trace_16bit: ActivationTrace | None = None
    untraced: str = ""  # why a trace was tried and failed

    @property
    def frozen(self) -> int:
        return self.params - self.trainable


def leaf_counts(leaves: list[tuple[int, bool]]) -> dict[str, int]:
    """``ModelShape``'s leaf fields from (elements, gathered again in backward) per frozen leaf."""
    return {"largest_leaf": max((n for n, _ in leaves), default=0), "leaf_params": sum(n for n, _ in leaves),
            "leaf_backward": sum(n for n, again in leaves if again)}


@dataclass(frozen=True)
class Cluster:
    """The machines: ``link`` and ``intra_link`` in bytes/s (``inf`` when a run does not know
    them: its estimate then has no link time)."""

    nodes: int
    gpus_per_node: int
    gpu_memory: int  # bytes
    host_memory: int  # bytes per node
    link: float  # bytes/s, cross-node, per node
    intra_link: float  # bytes/s, per GPU
    tflops: float = 989.0  # dense bf16 per GPU (H100 SXM)
    mfu: float = 0.4
    nvme: str | None = None
    # The share of the link time that can hide behind compute: 1 where communication runs
    # beside it (NCCL on its own CUDA streams), 0 where it takes the same cores (gloo on a
    # CPU: benchmarks/plan_accuracy.py measured compute + link there).
    overlap: float = 1.0

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
    explanation: list[str] = field(default_factory=list)  # explain(plan): what happens, in sentences

    @property
    def gpu_total(self) -> float:
        return sum(self.gpu.values())

    @property
    def host_total(self) -> float:
        return sum(self.host.values())


RUNTIME_GPU_BYTES = 2 * 2**30  # CUDA context, cuBLAS workspaces, allocator slack
RUNTIME_HOST_BYTES = 2**30  # per rank: Python, torch, the framework
# Offload rates per rank, from one H200 with a 16-core host to itself (docs/gpu.md, 2026-11-27):
# the measured offload time, 3.8e-10 s per parameter at 0.95B and 4.0e-10 at 4.3B, is both
# terms below together (they scale alike with the model, so the two runs measure only their
# sum); the split between them is PCIe 5.0 x16's usual pinned-copy rate, not a measurement.
HOST_BYTES_PER_S = 50e9  # a host AdamW step, bytes of optimizer state per second per rank
PCIE_BYTES_PER_S = 50e9  # host <-> GPU copies per rank
NVME_BYTES_PER_S = 3e9  # per node
GPU_HEADROOM = 0.95  # of the GPU memory a plan may fill


@dataclass(frozen=True)
class ByteModel:
    """Bytes per element the estimate counts with; the defaults are bf16-mixed with AdamW and
    ZeroConfig's own quantization defaults (qwZ int8 in blocks of 256, qgZ int4 in blocks of 64)."""

    param: float = 4.0  # the parameters the optimizer steps
    grad: float = 4.0
    optim: float = 8.0  # AdamW's two moments
    gather: float = 2.0  # a gathered parameter
    reduce: float = 4.0  # a reduced gradient
    qw: float = 1 + 4 / 256  # a qwZ code with its share of a scale
    qg_across: float = 0.5 + 4 / 64  # a qgZ code across nodes
    qg_inside: float = 0.5 + 4 / 64  # ... and inside the node
    frozen: float = 0.0  # a frozen int8/int4 code with its share of a scale; 0: the plan's bits in blocks of 256

    @classmethod
    def of(cls, precision: str, plan: Plan) -> ByteModel:
        """The bytes of a run: its precision flag (Lightning's names), the plan's gather and
        reduce dtypes, bits and blocks per hop."""
        half = 2.0 if precision.startswith(("bf16", "16")) else 4.0
        true_half = precision.endswith("-true") and half == 2.0  # bf16-true: everything in 16 bits
        param = half if true_half else 4.0
        gather = param if not precision.endswith("-mixed") else (2.0 if plan.gather_16bit else 4.0)
        reduce = {"fp32": 4.0, "bf16": 2.0, "fp16": 2.0}.get(str(plan.reduce_dtype))  # ZeroConfig.reduce_dtype
        if reduce is None:  # the precision's own: fp32 under mixed precision, the parameters' otherwise
            reduce = 2.0 if true_half else 4.0
        block, weight_block = plan.gradient_block_elems, plan.weight_block_elems  # the frozen shards' too
        return cls(param=param, grad=param, optim=2 * param, gather=gather, reduce=reduce,
                   qw=plan.weight_bits / 8 + 4 / weight_block,
                   frozen=plan.frozen_weight_bits / 8 + 4 / weight_block if plan.frozen_weight_bits else 0.0,
                   qg_across=plan.gradient_bits / 8 + 4 / block,
                   qg_inside=plan.gradient_bits_inside / 8 + 4 / block)


def activations(model: ModelShape, workload: Workload, *, params_16bit: bool = False) -> float:
    """Activation bytes of one micro-batch ([Note: the estimate]): the model's trace for a
    forward with 16-bit (``params_16bit``) or fp32 parameters when it was traced for this
    micro-batch and length, else the formula."""
    m, w = model, workload
    t = m.activation_trace_16bit if params_16bit else m.activation_trace
    if t is not None and (t.micro_batch, t.seq_len) == (w.micro_batch, w.seq_len):
        # checkpointed: every block's input, and one block's activations while it is recomputed
        return t.root + (t.block_inputs + t.largest_block if w.activation_checkpointing else t.blocks)
    sbh = w.seq_len * w.micro_batch * m.hidden
    per_layer = 2 * sbh if w.activation_checkpointing else 34 * sbh
    extra = 34 * sbh if w.activation_checkpointing else 0  # one block recomputed at a time
    return m.layers * per_layer + extra + 6 * w.seq_len * w.micro_batch * m.vocab


def cost(name: str, plan: Plan | None, model: ModelShape, cluster: Cluster, workload: Workload | None, *,
         b: ByteModel = ByteModel()) -> ConfigEstimate:
    """What ``plan`` (None: DDP) costs for ``model`` on ``cluster``: memory per rank by part,
    bytes per step per rank inside and across nodes, the step time, and whether it fits
    (a memory of 0 in ``cluster`` is not checked). ``workload`` None: no activations and no
    compute time (a run that has not seen a batch). Frozen weights are stored at
    ``plan.frozen_weight_bits`` (0: dense)."""
    m, c, w = model, cluster, workload
    P, T, F, N, L, M = m.params, m.trainable, m.frozen, c.world, c.gpus_per_node, c.nodes
    A, G, K, C, R = b.param, b.grad, b.optim, b.gather, b.reduce
    e = ConfigEstimate(name, {}, explanation=explain(plan))
    stage, qw, hpz_group, qg, opt_off, par_off = 0, False, 1, False, "none", "none"
    delta = plan is not None and plan.weight_delta
    if plan is not None:
        stage, qw, hpz_group, qg = plan.stage, plan.quantized_weights, plan.hpz_group, plan.quantized_gradients
        opt_off, par_off, e.notes = plan.offload_optimizer, plan.offload_param, list(plan.notes)
    frozen_bits = plan.frozen_weight_bits if plan is not None and F else 0
    if frozen_bits:  # FSDP2 keeps no secondary shard of a block with int8/int4 weights: hpZ is off there
        hpz_group = 1
    # -- model states ------------------------------------------------------------------------
    frozen_code = (b.frozen or frozen_bits / 8 + 4 / 256) if frozen_bits else 0.0
    shard_param = (F * frozen_code + A * T) / N if frozen_bits else A * P / N
    if stage == 0:
        e.gpu.update(parameters=A * P, gradients=G * T, optimizer=K * T, buckets=G * T)
    elif stage == 1:
        e.gpu.update(parameters=A * P, gradients=G * T, optimizer=K * T / N, buckets=min(25 * 2**20, G * T))
    else:
        e.gpu.update(parameters=shard_param, gradients=G * T / N, optimizer=K * T / N)
        if stage == 2:
            e.gpu["gathered"] = C * P
        else:
            # the root for the whole step, one frozen leaf at a time, the block computing and the next
            e.gpu["gathered"] = C * (m.root_params - m.leaf_params + m.largest_leaf + 2 * m.largest_block)
        e.gpu["unsharded_gradients"] = G * min(T, max(m.largest_block, m.root_params))
        if hpz_group > 1:  # the secondary shard, in the gather's dtype (never with frozen codes: hpZ is off there)
            e.gpu["hpz_secondary"] = C * P / hpz_group
        if delta:  # qwZ's kept copy of the shards of this local index on every node (frozen codes keep none)
            e.gpu["delta_copies"] = C * (T if frozen_bits else P) / L
    if plan is not None and plan.error_feedback and stage >= 2:  # qgZ's kept errors: fp32, M chunks of T / N
        e.gpu["feedback_errors"] = 4 * T / L
    stepped_on_host = moved_down = 0.0  # optimizer state the host steps, gradient bytes copied down
    if opt_off != "none":
        state = {"optimizer": e.gpu.pop("optimizer"), "gradients": e.gpu.pop("gradients")}
        stepped_on_host, moved_down = state["optimizer"], state["gradients"]
        if opt_off == "cpu":
            e.host.update(state)
        else:
            e.disk += sum(state.values()) * L
            e.host["nvme_buffers"] = min(sum(state.values()), 2 * 2**30)  # staging, as the memory plan sizes it
    if par_off != "none" and opt_off == "none":  # FSDP2's CPUOffloadPolicy: the step runs beside the shards
        e.host.update(optimizer=e.gpu.pop("optimizer"), gradients=e.gpu.pop("gradients"))
        stepped_on_host, moved_down = e.host["optimizer"], e.host["gradients"]
    moved_up = e.gpu.get("parameters", 0.0)  # once, after the host step
    if par_off != "none":
        shard = e.gpu.pop("parameters")
        moved_up = 2 * shard  # for each gather: forward and backward
        if par_off == "cpu":
            e.host["parameters"] = shard
        else:
            e.disk += shard * L
            e.host["parameter_buffers"] = C * 4 * m.largest_block
    if w is not None:
        # the forward computes with the stored parameters (DDP, stage 1) or the gathered ones
        # (stages 2/3): the 16-bit trace when those are 16-bit (traces are of bf16 autocast)
        e.gpu["activations"] = activations(m, w, params_16bit=(C if stage >= 2 else A) < 4)
    e.gpu["runtime"] = RUNTIME_GPU_BYTES
    e.host["runtime"] = RUNTIME_HOST_BYTES
    # -- bytes per step per rank, as the ledger books them ([Note: two-hop collectives]) --------
    # A gather of B bytes in all (B/N per rank): across nodes B (M-1)/N, inside B (L-1)/L (the
    # fan-out); a reduce-scatter of B bytes per rank: inside B (L-1)/L, across B (M-1)/N.
    across, inside = (M - 1) / N, (L - 1) / L
    # Under qwZ (which the plan turns off on one node) a gather sends its quantized payload
    # on both hops: the fan-out inside the node carries the same codes. hpZ's backward gather
    # stays inside the node, unquantized. Frozen int8/int4 shards travel as stored.
    # In a group holding frozen codes, the dense parameters travel with them at the gather
    # width (docs/zeropp.md, "Bytes per gather"), not as qwZ codes.
    wire = b.qw if qw else C
    gather_plain = (F * frozen_code + C * T) if frozen_bits else C * P
    gather_wire = gather_plain if frozen_bits else wire * P
    # weight deltas: the codes cross nodes, the kept 16-bit copies fan out inside the node
    gather_inside = C * P if delta and not frozen_bits else gather_wire
    if stage == 0:  # DDP's ring all-reduce over N ranks: 2 (N-1)/N B per rank, M of the N hops cross
        ring = 2 * R * T * (N - 1) / N
        e.inter_bytes, e.intra_bytes = ring * M / N if M > 1 else 0.0, ring * (1 - M / N) if M > 1 else ring
    elif stage == 1:  # reduce-scatter of the gradients, all-gather of the updated rows
        e.intra_bytes, e.inter_bytes = (R + A) * T * inside, (R + A) * T * across
    else:
        e.intra_bytes, e.inter_bytes = gather_inside * inside, gather_wire * across  # forward gather
        if stage == 3:
            # the root is not gathered again in backward; the blocks and a frozen head are
            blocks = 1 - (m.root_params - m.leaf_backward) / P
            if 1 < hpz_group <= L:  # from the secondary shard, inside the node
                e.intra_bytes += gather_plain * blocks * (hpz_group - 1) / hpz_group
            elif hpz_group > L:  # a group of whole nodes: a two-hop gather over H ranks, quantized if qwZ
                # (with weight deltas, as int8 codes of the weights: deltas need the world's gather)
                hop = (1 + 4 / plan.weight_block_elems) * P if delta and not frozen_bits else gather_wire
                e.intra_bytes += hop * blocks * inside
                e.inter_bytes += hop * blocks * (hpz_group // L - 1) / hpz_group
            else:
                e.intra_bytes += gather_inside * blocks * inside
                e.inter_bytes += gather_wire * blocks * across
        if qg:
            e.intra_bytes += b.qg_inside * T * inside
            e.inter_bytes += b.qg_across * T * across
        else:
            e.intra_bytes += R * T * inside
            e.inter_bytes += R * T * across
    # -- time ----------------------------------------------------------------------------------
    if w is not None:
        tokens = w.micro_batch * w.seq_len
        flops = (6 * P if F == 0 else 4 * P + 2 * T) * tokens + (2 * P * tokens if w.activation_checkpointing else 0)
        e.compute_s = flops / (c.tflops * 1e12 * c.mfu)
    link_s = e.inter_bytes * L / c.link + e.intra_bytes / c.intra_link
    e.comm_s = link_s
    if opt_off != "none" or par_off != "none":
        # over PCIe: the gradient shards down once, the parameter shards up (moved_up); the
        # optimizer state stays where it is stepped (on NVMe it is also read and written)
        e.offload_s = stepped_on_host / HOST_BYTES_PER_S + (moved_down + moved_up) / PCIE_BYTES_PER_S
        if e.disk:
            e.offload_s += 2 * e.disk / NVME_BYTES_PER_S
    hidden = max(e.compute_s, link_s) + link_s / max(m.blocks, 1)
    e.step_s = c.overlap * hidden + (1 - c.overlap) * (e.compute_s + link_s) + e.offload_s
    # -- fits? ---------------------------------------------------------------------------------
    problems = []
    if c.gpu_memory and e.gpu_total > GPU_HEADROOM * c.gpu_memory:
        problems.append(f"GPU {e.gpu_total / 2**30:.1f} GiB > {GPU_HEADROOM:.0%} of {c.gpu_memory / 2**30:.0f} GiB")
    if c.host_memory and e.host_total * L > c.host_memory:
        problems.append(f"host {e.host_total * L / 2**30:.1f} GiB per node > {c.host_memory / 2**30:.0f} GiB")
    if e.disk and not c.nvme:
        problems.append("needs an NVMe path (--nvme)")
    e.fits, e.why_not = not problems, "; ".join(problems)
    return e

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

What a plan costs (memory per rank, bytes per step and step time for a model on a cluster)
is cost.py's ([Note: the estimate] there), for ``zeropp plan`` and for a run's own plan at
its start (``ZeroSession.explain``).
"""

from __future__ import annotations

from dataclasses import dataclass, field, fields

from zeropp_strategy.config import OffloadConfig, ZeroConfig
from zeropp_strategy.topology import Topology

__all__ = [
    "CheckpointPolicy",
    "OffloadPolicy",
    "Plan",
    "RuntimePolicy",
    "ShardingPolicy",
    "ZeroPPPolicy",
    "explain",
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
    gradient_error_feedback_intra: bool
    gradient_error_beta: float
    gradient_error_reset_steps: int
    gradient_quant_block_elems: int
    cross_node_scale_bits: int
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
    ``error_feedback`` / ``error_feedback_intra``: qgZ keeps its cross-node / intra-node
    quantization error; ``weight_delta``: qwZ
    sends each shard's change since its last gather (kept rows per rank);
    ``frozen_weight_bits``:
    frozen weights stored at 8 or 4 bits (0: dense); ``weight_bits``: qwZ's codes (8 or 4; 2
    with weight deltas);
    ``weight_block_elems`` / ``gradient_block_elems`` / ``cross_node_scale_bits`` / ``quantize_min_elems`` /
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
    error_feedback_intra: bool = False
    weight_delta: bool = False
    frozen_weight_bits: int = 0
    overlap_param_gather: bool = False
    weight_bits: int = 8  # qwZ's codes, when quantized_weights
    weight_block_elems: int = 256  # qwZ's (and the frozen shards') elements per scale
    gradient_block_elems: int = 64  # qgZ's
    cross_node_scale_bits: int = 32  # each block scale's bits in qgZ's cross-node hop and in weight deltas
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
            inside = " with error feedback" if self.error_feedback_intra else ""
            across = f", {self.gradient_bits}-bit across{feedback}" if self.num_nodes > 1 else ", one node"
            parts.append(f"qgZ gradient reduce (int{self.gradient_bits_inside} inside the node{inside}{across})")
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
        scale = "bf16" if plan.cross_node_scale_bits == 16 else "fp32"  # of qgZ's cross-node hop and weight deltas
        if plan.quantized_weights and plan.weight_delta:
            lines.append(f"qwZ with weight deltas: a gather that spans nodes sends, across nodes, {plan.weight_bits}-bit "
                         f"codes of each shard's change since its last gather (one {scale} scale per block); each rank "
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
            hops = [h for h, on in (("cross-node", plan.error_feedback), ("intra-node", plan.error_feedback_intra)) if on]
            kept = (f" Each rank keeps the quantization error of the {' and '.join(hops)} hop{'s' * (len(hops) > 1)} "
                    "and adds it to its next reduction (error feedback)." if hops else "")
            across = ("2-bit codes (-3/-1/+1/+3 times a third of the block's largest value)" if plan.gradient_bits == 2
                      else f"int{plan.gradient_bits}")
            lines.append(f"Backward: gradients are reduce-scattered per block in two hops (qgZ): int"
                         f"{plan.gradient_bits_inside} codes inside the node and {across} across "
                         f"nodes ({scale} block scales), summed in fp32.{kept} {small}")
        elif plan.quantized_gradients:
            lines.append(f"Backward: gradients are reduce-scattered per block as int{plan.gradient_bits_inside} codes "
                         f"in one hop inside the node (qgZ on a single node), summed in fp32."
                         f"{' Each rank keeps its quantization error (error feedback).' if plan.error_feedback_intra else ''}"
                         f" {small}")
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
        error_feedback_intra=quantized_gradients and config.gradient_error_feedback_intra,
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
    "cross_node_scale_bits": "cross_node_scale_bits",
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

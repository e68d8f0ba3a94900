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
"""

from __future__ import annotations

from dataclasses import dataclass, fields

from zeropp_strategy.config import OffloadConfig, ZeroConfig
from zeropp_strategy.topology import Topology

__all__ = [
    "CheckpointPolicy",
    "OffloadPolicy",
    "Plan",
    "RuntimePolicy",
    "ShardingPolicy",
    "ZeroPPPolicy",
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
    ``notes``: one line per fallback, saying why.
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

    def describe(self) -> str:
        """One line for the log: the plan's decisions."""
        parts = [f"stage {self.stage}"]
        if self.stage == 3:
            parts.append(f"hpZ group {self.hpz_group}" if self.hpz_group > 1 else "hpZ off")
        if self.quantized_weights:
            parts.append("qwZ int8 cross-node gathers")
        if self.quantized_gradients:
            parts.append("qgZ quantized gradient reduce")
        parts.append(f"{'16-bit' if self.gather_16bit else 'full-precision'} gathers under mixed precision")
        parts.append(f"reduce dtype {self.reduce_dtype or 'of the precision'}")
        parts.append(f"{self.state_dict_type} checkpoints")
        if self.offload_optimizer != "none" or self.offload_param != "none":
            parts.append(f"offload optimizer={self.offload_optimizer} param={self.offload_param}")
        return "zeropp plan: " + ", ".join(parts)


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
    )

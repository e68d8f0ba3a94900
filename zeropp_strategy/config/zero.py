"""Layer: plan (config). ``ZeroConfig``: the fields, their documentation and their checks
(``__post_init__``), serialisation, and reading YAML, JSON or DeepSpeed files (see the
package docstring). Its offload blocks, ``OffloadConfig``, are in ``offload.py``."""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

__all__ = ["ZeroConfig"]

from zeropp_strategy.config.checks import (
    REDUCE_DTYPE_NAMES,
    _at_least,
    _block_elems,
    _bool,
    _check_keys,
    _int,
    _invalid,
    _seconds,
)
from zeropp_strategy.config.deepspeed import _from_deepspeed, _looks_like_deepspeed
from zeropp_strategy.config.offload import OffloadConfig, _offload_from


def _wrap_names(value: object, where: str) -> tuple[str, ...]:
    """A list/tuple (or a single one) of class names or classes -> tuple of unique names, in order."""
    fix = "give class names such as ['LlamaDecoderLayer'] (or the classes), or () for auto"
    items = (value,) if isinstance(value, (str, type)) else value
    if not isinstance(items, (list, tuple)):
        _invalid(where, value, f"must be a list or tuple, not {type(value).__name__}", fix, TypeError)
    names: list[str] = []
    for item in items:
        name = item.__name__ if isinstance(item, type) else item
        if not isinstance(name, str):
            _invalid(where, value, f"holds {item!r}, which is neither a str nor a class", fix, TypeError)
        if not name.isidentifier():
            _invalid(where, value, f"{name!r} is not a class name (blocks match on type(m).__name__)", fix)
        if name not in names:
            names.append(name)
    return tuple(names)


@dataclass(frozen=True, kw_only=True)
class ZeroConfig:
    """Everything that decides how a model is sharded and communicated. Immutable and validated."""

    stage: int = 3
    """ZeRO stage: 1 shards optimizer state, 2 also gradients, 3 also parameters."""
    quantized_weights: bool = False
    """qwZ: all-gather stage-3 parameters as int8 blocks (one fp32 scale each). Stage 3 only."""
    weight_quant_block_elems: int = 256
    """Elements per qwZ quantization block: a power of two in 32..65536."""
    weight_quant_bits: int = 8
    """Bits per qwZ code: 8, or 4 (two codes per byte: with blocks of 64, 0.56 bytes per
    gathered element against int8's 1.02, a rounding step 127/7 = 18x coarser), or, with
    ``weight_delta_coding`` only, 2 (four codes per byte, the levels -3/-1/+1/+3 times a third of
    the block's largest value).
    Only the gathers that cross nodes are quantized; the ``zeropp_4bit`` preset sets 4 with
    blocks of 64 (docs/zeropp.md, "4-bit weight gathers"). No effect without
    ``quantized_weights``."""
    weight_delta_coding: bool = False
    """qwZ sends, in each gather that crosses nodes, the change of every shard since the
    last gather instead of the shard itself, as ``weight_quant_bits`` codes, with the
    sender's error fed back: each rank keeps the values it has sent and received (a copy,
    in the gather dtype, of 1/ranks-per-node of the gathered groups, like hpZ's secondary
    shard) and sends ``Q(w - kept)`` next time, so the receivers' copy stays within one
    step's rounding of the weights (SDP4Bit's difference coding). The first gather, and
    the first after a resume without the kept copies, sends the shards themselves. Needs
    ``quantized_weights``; the ``zeropp_delta`` preset sets it with 2-bit codes in blocks
    of 256 (docs/zeropp.md, "Weight deltas")."""
    hpz_partition_size: int = 1
    """hpZ: ranks in a group holding a secondary parameter shard (usually ranks per node); 1 = off,
    0 = auto (ranks per node). Backward then all-gathers within the group, not across nodes.
    Anything but 1 needs stage 3."""
    quantized_gradients: bool = False
    """qgZ: hierarchical quantized gradient reduce-scatter (intra-node, then inter-node). Stage 2 or 3."""
    gradient_quant_bits: int = 4
    """Bits per quantized gradient element in qgZ: 4 or 8, or, with ``gradient_error_feedback``
    only, 2 (four codes per byte, the levels -3/-1/+1/+3 times a third of the block's largest
    value; the intra-node hop then needs ``gradient_quant_bits_intra``). The cross-node hop always uses it; the
    intra-node hop too unless ``gradient_quant_bits_intra`` says otherwise."""
    gradient_quant_bits_intra: int | None = None
    """Bits of qgZ's first hop, inside the node (4 or 8); None = ``gradient_quant_bits``. 8 here
    with 4 across halves the first quantization's error for intra-node bytes only (SDP4Bit's
    split: more bits on the fast link, fewer on the slow one)."""
    gradient_error_feedback: bool = False
    """qgZ error feedback (LoCo): each rank keeps what the cross-node quantization of its node
    partials dropped and adds it to the next step's partials before quantizing, so the
    rounding errors cancel over steps instead of accumulating in the weights. Costs one fp32
    buffer of 1/ranks-per-node of the gradients per rank; no extra bytes on the wire. Needs
    ``quantized_gradients`` (docs/zeropp.md, "Error feedback")."""
    gradient_error_feedback_intra: bool = False
    """Error feedback on qgZ's first hop, inside the node, too (LoCo as DeepSpeed's
    ``zeropp_loco_param`` runs it: both hops). Each rank keeps the error of its whole gradient
    as int8 blocks: (1 + 4/B) bytes per gradient element (1.06 at B = 64) kept between
    steps. No extra bytes on the wire. Needs ``quantized_gradients`` (docs/zeropp.md,
    "Error feedback")."""
    gradient_error_beta: float = 0.8
    """Error feedback: the kept error is ``beta * old + (1 - beta) * new`` (LoCo's moving
    average; 0 = the classic feedback of the last step's error alone). In [0, 1)."""
    gradient_error_reset_steps: int = 1024
    """Error feedback: the kept error is zeroed every this many reductions of a group
    (LoCo's reset_T); 0 = never."""
    gradient_quant_block_elems: int = 64
    """Elements per qgZ quantization block: a power of two in 32..65536. 64 by measurement: at
    256, int4 gradients left a 200-step GPT-2 run 5.5% above plain stage 3 in loss; at 64 within
    1% (docs/zeropp.md, "Block size")."""
    cross_node_scale_bits: int = 32
    """Bits of each block's scale in the payloads that cross nodes: qgZ's cross-node hop and
    ``weight_delta_coding``'s gathers. 32 (fp32) or 16 (bf16: each scale rounded up to a bf16
    value before its block's codes are computed, so the codes agree exactly with the scale
    sent; the rounding step grows by at most 2^-7). 16 saves 2 bytes per block: 5.6% of
    int4 gradients in blocks of 64, 3% of 2-bit deltas in blocks of 256. The
    ``zeropp_delta`` preset sets 16 (docs/zeropp.md, "bf16 block scales"). No effect
    without ``quantized_gradients`` or ``weight_delta_coding``."""
    quantized_gradients_on_single_node: bool = False
    """Use qgZ even when all ranks share one node (by default it falls back to the plain
    reduce-scatter there: quantizing costs time and saves no slow-link bytes)."""
    quantize_min_elems: int = 4096
    """Tensors with fewer elements than this use the plain collective (>= 0)."""
    quantize_frozen_weights: bool = False
    """Store the shards of frozen (requires_grad=False) parameters as int8, or int4 with
    ``frozen_weight_bits=4``. Stage 3 only."""
    frozen_weight_bits: int = 8
    """Bits per stored code of ``quantize_frozen_weights``: 8, or 4 (two codes per byte: about
    half the bytes of int8, a rounding step 127/7 = 18x coarser). One fp32 scale per block of
    ``weight_quant_block_elems`` within a row either way. No effect without
    ``quantize_frozen_weights``."""
    offload_optimizer: OffloadConfig = field(default_factory=OffloadConfig)
    """Optimizer state and fp32 master weights: device memory, CPU or NVMe. Any stage.
    Also accepts a dict of OffloadConfig fields, or a device string such as "cpu"."""
    offload_param: OffloadConfig = field(default_factory=OffloadConfig)
    """Parameter shards: device memory, CPU or NVMe; not "none" needs stage 3. Dict or str accepted."""
    host_memory_budget_bytes: int | str | None = "auto"
    """Host memory one rank may use for model states, staging buffers and (on a CPU device) the
    gathered blocks, when anything is offloaded. At start every rank computes the plan of what
    that memory must hold and what goes to disk, logs it once, and refuses a run that cannot fit
    (memory or disk) before any parameter is allocated (docs/offload.md, "The memory plan").
    "auto" = 90% of the machine's available memory (or of its cgroup's) over the ranks on the
    machine; an int = that many bytes; None = no plan. No effect without offload."""
    wrap_modules: tuple[str, ...] = ()
    """Class names of the blocks sharded as one group each (e.g. "LlamaDecoderLayer"). Accepts a
    list/tuple of names or classes; () = auto (HF ``_no_split_modules``, else by size)."""
    wrap_min_params: int = 1_000_000
    """Size-based fallback: a submodule with at least this many parameters gets its own group.
    At stage 3 also the least size at which a Hugging Face model's frozen, untied input or
    output embedding is a group of its own ([Note: frozen leaves] in engine/wrap.py)."""
    activation_checkpointing: bool = False
    """Recompute each wrapped block's activations in backward instead of storing them."""
    meta_init: bool = True
    """Stages 2/3: a model built in ``configure_model()`` (Lightning) or under ``init_module()``
    (Lightning, Fabric) is created on the meta device and materialized shard by shard after
    sharding, so no rank ever holds it whole, from the random state its build ended with (plain
    PyTorch modules get a real build's values, bit for bit; engine/meta_init.py). False, or
    ``init_module(empty_init=False)``, builds it for real on every rank. At stage 1 the build
    is real whatever this says; under ``init_module(empty_init=True)`` there,
    ``zeropp_strategy.from_pretrained`` reads a folder on rank 0 only and the others get its
    values with DDP's broadcast (engine/meta_init.py)."""
    reduce_bucket_bytes: int = 25 * 2**20
    """Stage 1: bytes of gradients all-reduced per bucket (>= 1024)."""
    allgather_bucket_bytes: int = 50 * 2**20
    """Stage 1: bytes of updated parameters all-gathered per bucket after the step (>= 1024)."""
    overlap_param_gather: bool = False
    """Stage 1: ``optimizer.step()`` issues the post-step all-gathers and returns; each module's
    forward waits for the buckets holding its parameters, so the gathers run under the next
    forward. Until then, other ranks' updated rows still hold their old values: code that reads
    parameter tensors directly between the step and the next forward (a weight-norm callback,
    Lightning's ``WeightAveraging``) must call ``wait_for_parameters`` first (docs/stages.md,
    "Overlapping the post-step gather"). Off by default: every reader then sees updated weights
    as soon as ``step()`` returns, as with DDP. Megatron-LM's ``overlap_param_gather``."""
    state_dict_type: str | None = None
    """Checkpoints: "sharded" (a file per rank), "full" (one consolidated state dict on rank 0) or
    None = "sharded" for stages 2/3, "full" for stage 1 (see ``resolved_state_dict_type``)."""
    gather_16bit: bool | None = None
    """With 16-bit mixed precision (bf16/fp16 "-mixed"), stages 2/3 all-gather parameters in the
    16-bit dtype: half the gather bytes, and every op computes with 16-bit weights (as Lightning's
    and Accelerate's FSDP do). False gathers fp32 weights: only autocast-eligible ops (matmuls,
    convolutions) run in 16 bits, so the numbers equal DDP with autocast. None = True under
    Lightning and Fabric, False under ``ZeroPPAccelerator`` (Accelerate's own mixed precision
    is autocast over fp32 weights). No effect in fp32 or "-true" precision."""
    reduce_dtype: str | None = None
    """dtype of the gradient reduce on the wire: "fp32", "bf16" or "fp16"; None = the precision's
    own (fp32 under "-mixed" and "32-true", the parameters' dtype under "-true"). "bf16" halves the
    reduce's bytes against fp32 (DeepSpeed's ``communication_data_type``, which it maps from); on
    gloo our sums still run in fp32, each element rounded to the wire dtype once per hop
    (docs/stages.md, "Reduce dtype", has the measured loss curves). All stages."""
    simulated_nodes: int = 0
    """0 = real topology; N > 0 splits one machine's ranks into N simulated nodes, so hierarchical
    (inter-node) collectives run for real in tests and benchmarks."""
    peer_timeout: float = 60.0
    """Seconds without a heartbeat after which a rank is declared dead: the others then stop with
    a message naming it instead of waiting for the process group's timeout (30 minutes). A rank
    whose process is gone is named at once on its own host. 0 turns the watchdog off
    (``engine/watchdog.py``, docs/failure_modes.md)."""

    def __post_init__(self) -> None:
        w = "ZeroConfig"
        put = lambda name, value: object.__setattr__(self, name, value)  # noqa: E731 (frozen: normalise once)
        stage_fix = "use stage=3 for full sharding, or strategy='ddp' for none"
        if _int(f"{w}.stage", self.stage, stage_fix) not in (1, 2, 3):
            _invalid(f"{w}.stage", self.stage, "must be 1, 2 or 3", stage_fix)
        put("stage", stage := int(self.stage))
        for name in _BOOL_FIELDS:
            _bool(f"{w}.{name}", getattr(self, name), f"use {name}=True or {name}=False")
        if self.gather_16bit is not None:
            _bool(f"{w}.gather_16bit", self.gather_16bit,
                  "use gather_16bit=True (16-bit gathers), False (fp32 gathers) or None (the front-end's default)")
        if self.reduce_dtype is not None and self.reduce_dtype not in REDUCE_DTYPE_NAMES:
            _invalid(f"{w}.reduce_dtype", self.reduce_dtype, f"must be one of {', '.join(REDUCE_DTYPE_NAMES)} or None",
                     "use reduce_dtype='fp32' (exact sums), 'bf16' (half the bytes, as DeepSpeed) or None (the "
                     "precision's own)")
        for name, (low, fix) in _INT_MINIMUMS.items():
            put(name, _at_least(f"{w}.{name}", getattr(self, name), low, fix))
        for name in ("weight_quant_block_elems", "gradient_quant_block_elems"):
            put(name, _block_elems(f"{w}.{name}", getattr(self, name)))
        scale_bits = self.cross_node_scale_bits
        if _int(f"{w}.cross_node_scale_bits", scale_bits, _SCALE_BITS_FIX) not in (16, 32):
            _invalid(f"{w}.cross_node_scale_bits", scale_bits, "must be 32 or 16", _SCALE_BITS_FIX)
        put("cross_node_scale_bits", int(scale_bits))
        for name, fix in _BITS_FIELDS.items():
            if name == "gradient_quant_bits_intra" and self.gradient_quant_bits_intra is None:
                continue
            two_bit = ((name == "weight_quant_bits" and self.weight_delta_coding)
                       or (name == "gradient_quant_bits" and self.gradient_error_feedback))
            allowed = (2, 4, 8) if two_bit else (4, 8)
            if _int(f"{w}.{name}", getattr(self, name), fix) not in allowed:
                _invalid(f"{w}.{name}", getattr(self, name), f"must be {' or '.join(map(str, allowed))}", fix)
            put(name, int(getattr(self, name)))
        beta, beta_fix = self.gradient_error_beta, "use 0.8 (LoCo's default) or any value in [0, 1)"
        if isinstance(beta, bool) or not isinstance(beta, (int, float)):
            _invalid(f"{w}.gradient_error_beta", beta, f"must be a number, not {type(beta).__name__}", beta_fix,
                     TypeError)
        if not 0.0 <= float(beta) < 1.0:
            _invalid(f"{w}.gradient_error_beta", beta, "must be in [0, 1)", beta_fix)
        put("gradient_error_beta", float(beta))
        put("peer_timeout", _seconds(f"{w}.peer_timeout", self.peer_timeout,
                                     "use seconds >= 0, e.g. peer_timeout=60 (0 turns the watchdog off)"))
        sdt, sdt_fix = self.state_dict_type, "use 'sharded' (a file per rank), 'full' (one file) or None (stage default)"
        if sdt is not None and not isinstance(sdt, str):
            _invalid(f"{w}.state_dict_type", sdt, f"must be a str or None, not {type(sdt).__name__}", sdt_fix, TypeError)
        if sdt not in (None, "sharded", "full"):
            _invalid(f"{w}.state_dict_type", sdt, "must be 'sharded', 'full' or None", sdt_fix)
        budget = self.host_memory_budget_bytes
        if budget is not None and budget != "auto":
            put("host_memory_budget_bytes", _at_least(
                f"{w}.host_memory_budget_bytes", budget, 2**20,
                "use 'auto' (the machine's available memory over its ranks), a byte count such as 12 * 2**30, or "
                "None (no memory plan)"))
        put("offload_optimizer", _offload_from(self.offload_optimizer, f"{w}.offload_optimizer"))
        put("offload_param", _offload_from(self.offload_param, f"{w}.offload_param"))
        put("wrap_modules", _wrap_names(self.wrap_modules, f"{w}.wrap_modules"))

        # Cross-field rules: each ZeRO++ feature rewrites a collective that only some stages have.
        if self.quantized_weights and stage < 3:
            _invalid(f"{w}.quantized_weights", True, "qwZ quantizes the parameter all-gather of stage 3, "
                     f"and stage {stage} does not gather parameters", "set stage=3, or quantized_weights=False")
        if self.hpz_partition_size != 1 and stage < 3:
            _invalid(f"{w}.hpz_partition_size", self.hpz_partition_size, "hpZ keeps a secondary shard of "
                     f"stage-3 parameters; stage {stage} does not shard them", "set stage=3, or hpz_partition_size=1")
        if self.quantized_gradients and stage < 2:
            _invalid(f"{w}.quantized_gradients", True, "qgZ replaces the gradient reduce-scatter of stages 2 "
                     "and 3; stage 1 all-reduces gradients", "set stage=2 or 3, or quantized_gradients=False")
        if self.weight_delta_coding and not self.quantized_weights:
            _invalid(f"{w}.weight_delta_coding", True, "it changes qwZ's quantized all-gather, which is off",
                     "set quantized_weights=True as well, or weight_delta_coding=False")
        for name, value in (("gradient_error_feedback", self.gradient_error_feedback),
                            ("gradient_error_feedback_intra", self.gradient_error_feedback_intra),
                            ("gradient_quant_bits_intra", self.gradient_quant_bits_intra)):
            if value not in (False, None) and not self.quantized_gradients:
                _invalid(f"{w}.{name}", value, "it changes qgZ's quantized reduce-scatter, which is off",
                         f"set quantized_gradients=True as well, or leave {name} at its default")
        if self.quantized_gradients and self.gradient_quant_bits == 2 and self.gradient_quant_bits_intra is None:
            _invalid(f"{w}.gradient_quant_bits_intra", None, "2-bit gradient codes are for the cross-node hop only, "
                     "where the slow link makes their coarser rounding worth it",
                     "set gradient_quant_bits_intra=8 (or 4)")
        if self.overlap_param_gather and stage != 1:
            _invalid(f"{w}.overlap_param_gather", True, f"it overlaps stage 1's post-step gather; stage {stage} "
                     "gathers parameters per block in forward, already prefetched under compute",
                     "set stage=1, or overlap_param_gather=False")
        if self.quantize_frozen_weights and stage < 3:
            _invalid(f"{w}.quantize_frozen_weights", True, f"only stage 3 stores parameter shards; stage {stage} "
                     "keeps full parameters", "set stage=3, or quantize_frozen_weights=False")
        if self.offload_param.device != "none" and stage < 3:
            _invalid(f"{w}.offload_param.device", self.offload_param.device, "parameter offload needs "
                     f"partitioned parameters (stage 3), not stage {stage}",
                     "set stage=3, or offload_param='none' (offload_optimizer works with every stage)")

    def resolved_state_dict_type(self) -> str:
        """``state_dict_type`` with None resolved: "full" for stage 1, "sharded" for 2/3."""
        if self.state_dict_type is not None:
            return self.state_dict_type
        return "full" if self.stage == 1 else "sharded"

    def validate_for_world(self, world_size: int, ranks_per_node: int) -> None:
        """Checks that need the job size. Call on every rank before any collective."""
        w = "ZeroConfig.validate_for_world"
        world_size = _at_least(f"{w}(world_size)", world_size, 1, "pass the number of ranks in the job")
        ranks_per_node = _at_least(f"{w}(ranks_per_node)", ranks_per_node, 1, "pass the number of ranks per node")
        if ranks_per_node > world_size:
            _invalid(f"{w}(ranks_per_node)", ranks_per_node, f"exceeds world_size={world_size}",
                     "pass the number of ranks per node")
        hpz, nodes = self.hpz_partition_size, self.simulated_nodes
        if hpz and (hpz > world_size or world_size % hpz):
            _invalid("ZeroConfig.hpz_partition_size", hpz, f"must divide world_size={world_size} (and be <= it) "
                     "to split the ranks into equal hpZ groups",
                     f"use a divisor of {world_size}, usually ranks per node ({ranks_per_node}), or 1 for no hpZ")
        if nodes and (nodes > world_size or world_size % nodes):
            _invalid("ZeroConfig.simulated_nodes", nodes, f"must divide world_size={world_size}, so every "
                     "simulated node has as many ranks", f"use a divisor of {world_size}, or 0 for the real topology")

    # -- serialisation ---------------------------------------------------------------------------

    def to_dict(self) -> dict[str, Any]:
        """Plain JSON-able dict (offload blocks as dicts, wrap_modules as a list)."""
        return {**dataclasses.asdict(self), "wrap_modules": list(self.wrap_modules)}

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> ZeroConfig:
        """Strict inverse of ``to_dict``: an unknown key raises ValueError with a suggestion."""
        if not isinstance(d, Mapping):
            _invalid("ZeroConfig.from_dict(d)", d, f"must be a dict, not {type(d).__name__}",
                     "pass a mapping of field names to values", TypeError)
        _check_keys(d, _FIELDS, "ZeroConfig")
        return cls(**d)

    def replace(self, **changes: Any) -> ZeroConfig:
        """A copy with ``changes`` applied, validated again."""
        _check_keys(changes, _FIELDS, "ZeroConfig")
        return dataclasses.replace(self, **changes)

    def comparable(self) -> dict[str, Any]:
        """The fields every rank must agree on (``check_same_config``): ``to_dict()`` without the
        NVMe paths, which may differ per node (a different mount point on each machine)."""
        d = self.to_dict()
        for key in ("offload_optimizer", "offload_param"):
            d[key] = {k: v for k, v in d[key].items() if k != "nvme_path"}
        return d

    @property
    def offload_blocks(self) -> dict[str, OffloadConfig]:
        """The two offload blocks by field name (``offload_optimizer``, ``offload_param``)."""
        return {"offload_optimizer": self.offload_optimizer, "offload_param": self.offload_param}

    @property
    def offloads(self) -> bool:
        """Whether any state leaves the device (optimizer state or parameters, to the host or a
        drive): on CUDA the process group then needs gloo beside NCCL for the host tensors."""
        return self.offload_optimizer.device != "none" or self.offload_param.device != "none"

    def digest(self) -> str:
        """sha256 of the canonical JSON of ``to_dict()``: equal exactly on ranks whose configs agree."""
        canon = json.dumps(self.to_dict(), sort_keys=True, separators=(",", ":"))
        return hashlib.sha256(canon.encode()).hexdigest()

    @classmethod
    def from_yaml(cls, path: str | os.PathLike[str]) -> ZeroConfig:
        """Load fields from a YAML file, at top level or under a ``zero:`` key."""
        try:
            data = yaml.safe_load(_read(path, "ZeroConfig.from_yaml"))
        except yaml.YAMLError as e:
            raise ValueError(f"ZeroConfig.from_yaml: {path} is not valid YAML: {e}") from None
        return _from_loaded(cls, data, path, "ZeroConfig.from_yaml")

    @classmethod
    def from_file(cls, path: str | os.PathLike[str]) -> ZeroConfig:
        """``.yaml``/``.yml`` -> from_yaml; ``.json`` -> from_deepspeed when it looks like a DeepSpeed
        config (``zero_optimization`` or DeepSpeed top-level keys), else our fields as in from_yaml."""
        suffix = Path(path).suffix.lower()
        if suffix in (".yaml", ".yml"):
            return cls.from_yaml(path)
        if suffix != ".json":
            raise ValueError(f"ZeroConfig.from_file: {path} has suffix {suffix!r}. Fix: use a .json, .yaml or .yml file.")
        data = _load_json(path, "ZeroConfig.from_file")
        if isinstance(data, Mapping) and _looks_like_deepspeed(data, _FIELDS):
            return _from_deepspeed(cls, data, str(path), warn=True, stacklevel=3)
        return _from_loaded(cls, data, path, "ZeroConfig.from_file")

    @classmethod
    def coerce(cls, config: ZeroConfig | Mapping[str, Any] | str | os.PathLike[str] | None, *,
               where: str = "config", overrides: Mapping[str, Any] | None = None) -> ZeroConfig:
        """What every front-end accepts as a config: a ``ZeroConfig``, a dict of its fields, a
        YAML/DeepSpeed JSON path, or None (the defaults); then ``overrides`` (field -> value).
        ``where`` names the argument in the error for any other type."""
        if config is None:
            base = cls()
        elif isinstance(config, ZeroConfig):
            base = config
        elif isinstance(config, Mapping):
            base = cls.from_dict(dict(config))
        elif isinstance(config, (str, os.PathLike)):
            base = cls.from_file(config)
        else:
            _invalid(where, config, f"is a {type(config).__name__}, not a ZeroConfig, a dict or a path",
                     "pass a ZeroConfig, a dict of its fields, or the path of a YAML/DeepSpeed JSON file", TypeError)
        return base.replace(**overrides) if overrides else base

    @classmethod
    def from_deepspeed(cls, path_or_dict: str | os.PathLike[str] | Mapping[str, Any], *, warn: bool = True) -> ZeroConfig:
        """Convert a DeepSpeed config (path of a JSON file, or the loaded dict) into a ZeroConfig.

        Mapped from ``zero_optimization``: stage (0 is rejected: it is plain DDP),
        zero_quantized_weights, zero_hpz_partition_size, zero_quantized_gradients,
        zero_quantized_nontrainable_weights, offload_optimizer / offload_param (device, nvme_path,
        pin_memory, buffer_count, buffer_size), reduce_bucket_size, allgather_bucket_size,
        [stage3_]gather_16bit_weights_on_model_save (true -> state_dict_type="full") and
        zeropp_loco_param (gradient_error_feedback and gradient_error_feedback_intra, err_beta,
        reset_T); top-level
        communication_data_type -> reduce_dtype.

        DeepSpeed sizes (reduce_bucket_size, allgather_bucket_size, buffer_size) count ELEMENTS;
        ours count bytes. Each is multiplied by the element width: 2 bytes when the top-level
        ``bf16`` or ``fp16`` block has ``"enabled": true``, else 4 (fp32, also for "auto").
        The value "auto" (HF / Accelerate style) keeps our default; numbers may be floats or
        strings such as 5e8 or "5e8".

        Every other key, inside ``zero_optimization`` and at top level, is listed in one
        ``ZeroConfigWarning``, with where the setting lives in Lightning when there is such a place.
        """
        if isinstance(path_or_dict, Mapping):
            return _from_deepspeed(cls, path_or_dict, "<dict>", warn=warn, stacklevel=3)
        if not isinstance(path_or_dict, (str, os.PathLike)):
            _invalid("ZeroConfig.from_deepspeed(path_or_dict)", path_or_dict, "must be a path or a dict, not "
                     f"{type(path_or_dict).__name__}", "pass the path of a DeepSpeed JSON file or its dict", TypeError)
        data = _load_json(path_or_dict, "ZeroConfig.from_deepspeed")
        if not isinstance(data, Mapping):
            raise ValueError(f"ZeroConfig.from_deepspeed: {path_or_dict} holds a {type(data).__name__}, not a "
                             "JSON object. Fix: pass a DeepSpeed config file.")
        return _from_deepspeed(cls, data, str(path_or_dict), warn=warn, stacklevel=3)


_FIELDS = tuple(f.name for f in dataclasses.fields(ZeroConfig))
_BOOL_FIELDS = ("overlap_param_gather", "quantized_weights", "quantized_gradients", "quantized_gradients_on_single_node",
                "gradient_error_feedback", "gradient_error_feedback_intra", "weight_delta_coding",
                "quantize_frozen_weights", "activation_checkpointing", "meta_init")
_BITS_FIELDS = {  # field (4 or 8) -> fix
    "weight_quant_bits": "use 8 (int8, ZeRO++'s qwZ) or 4 (int4: about half the bytes of a cross-node gather); 2 "
                         "only with weight_delta_coding=True (codes of the changes, not of the weights)",
    "gradient_quant_bits": "use 4 (ZeRO++'s qgZ) or 8 (more precise); 2 only with gradient_error_feedback=True "
                           "(what the codes drop is then sent with the next step's gradients)",
    "gradient_quant_bits_intra": "use 8 (inside the node, where bytes are cheap), 4, or None (= gradient_quant_bits, "
                                 "when that is 4 or 8)",
    "frozen_weight_bits": "use 8 (int8, the default) or 4 (int4: half the bytes, a coarser step)",
}
_SCALE_BITS_FIX = ("use 32 (fp32 scales, ZeRO++'s) or 16 (bf16 scales: 2 bytes less per block across nodes, the "
                   "rounding step at most 2^-7 coarser)")
_INT_MINIMUMS = {  # field -> (smallest valid value, fix)
    "hpz_partition_size": (0, "use 1 to turn hpZ off, 0 for ranks per node, or the number of ranks per node"),
    "quantize_min_elems": (0, "use 0 to quantize every tensor, or e.g. 4096"),
    "wrap_min_params": (1, "use e.g. wrap_min_params=1_000_000"),
    "reduce_bucket_bytes": (1024, "use e.g. reduce_bucket_bytes=25 * 2**20"),
    "allgather_bucket_bytes": (1024, "use e.g. allgather_bucket_bytes=50 * 2**20"),
    "simulated_nodes": (0, "use 0 for the real topology, or N > 0 to simulate N nodes"),
    "gradient_error_reset_steps": (0, "use e.g. 1024 (LoCo's reset_T), or 0 never to reset"),
}


# -- files ------------------------------------------------------------------------------------


def _read(path: object, who: str) -> str:
    try:
        return Path(path).expanduser().read_text()  # type: ignore[arg-type]
    except FileNotFoundError:
        raise FileNotFoundError(f"{who}: no such file: {path}") from None
    except IsADirectoryError:
        raise ValueError(f"{who}: {path} is a directory. Fix: pass the config file itself.") from None


def _load_json(path: object, who: str) -> Any:
    try:
        return json.loads(_read(path, who))
    except json.JSONDecodeError as e:
        raise ValueError(f"{who}: {path} is not valid JSON: {e}. Fix: correct the file there "
                         "(`python -m json.tool FILE` points at the error).") from None


def _from_loaded(cls: type[ZeroConfig], data: object, path: object, who: str) -> ZeroConfig:
    """A loaded YAML / JSON document -> ZeroConfig, with the fields at top level or under ``zero``."""
    fix = "Fix: write ZeroConfig fields as key: value pairs (e.g. 'stage: 3'), at top level or under 'zero:'."
    if data is None:
        raise ValueError(f"{who}: {path} is empty. {fix}")
    if isinstance(data, Mapping) and "zero" in data:
        data = data["zero"] if data["zero"] is not None else {}
    if not isinstance(data, Mapping):
        raise ValueError(f"{who}: {path} holds a {type(data).__name__}, not a mapping of ZeroConfig fields. {fix}")
    try:
        return cls.from_dict(data)
    except (ValueError, TypeError) as e:
        raise type(e)(f"{e} (in {path})") from None

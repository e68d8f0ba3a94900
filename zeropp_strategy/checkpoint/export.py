"""Layer: checkpoint (no training framework). Exporting a live (sharded) model: a merged
``from_pretrained`` folder streamed one tensor at a time, or its LoRA adapters alone as a
peft adapter folder. Both functions are **collective**: every rank calls them with the
same model.

    import zeropp_strategy
    zeropp_strategy.export_pretrained(model, "out/merged", dtype=torch.bfloat16)  # transformers loads it
    zeropp_strategy.export_adapters(model, "out/adapter")   # peft's PeftModel.from_pretrained loads it

[Note: streamed export]
Gathering the whole state dict on rank 0 and merging LoRA into a CPU copy of the model
(what the RLHF modules did) costs rank 0 the model twice: 32 GB for an 8B model in bf16,
before a byte is written. ``export_pretrained`` never holds more than one safetensors
shard (``max_shard_bytes``) plus the one tensor in flight:

- every rank lists the model's weights in state-dict order, once per tensor (a tied
  weight is listed under its first name only), from the module tree, not from
  ``state_dict()``: an int8/int4 frozen base would otherwise be dequantized whole at once;
- ``checkpoint.hf.write_hf`` on rank 0 reads the weights through a ``WeightReader`` in
  the order it writes them; each read advances every rank through the list to that
  weight: the same collective gathers (``full_tensor``) on every rank, in the same order,
  each dropped at once on the other ranks. A weight the writer skips is skipped on every
  rank without a gather when it is a tied alias, gathered and dropped otherwise; when the
  writer is done, or fails, it goes through the rest, so no rank is left in a collective;
- a LoRA layer's base weight is merged on rank 0 as peft's ``merge`` does it
  (``W += transpose(B @ A, fan_in_fan_out) * scaling``, fp32 on CPU for 16-bit weights),
  its A and B gathered right after W; the folder has the plain model's names and
  nothing of LoRA; a quantized frozen base is dequantized one tensor at a time.
  LoRA variants peft merges its own way (DoRA, ``lora_bias``, several active adapters,
  layers other than ``Linear``) are refused before anything is gathered: export the
  adapters instead;
- ``agree`` then makes a failure on rank 0 (a full disk) an error on every rank, and
  ``write_hf`` publishes atomically (nothing half-written under the final name).

``export_adapters`` gathers only the adapters' tensors (and peft's ``modules_to_save``),
names them as peft's ``get_peft_model_state_dict`` does, and writes
``adapter_model.safetensors`` and ``adapter_config.json`` (``inference_mode`` on, as peft
saves it) through the same staged, read-back, atomically published folder.

Tests: python -m pytest tests/test_export.py -q
"""

from __future__ import annotations

import copy
import json
import os
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import nn

from zeropp_strategy.checkpoint.atomic import published_directory
from zeropp_strategy.checkpoint.hf import DEFAULT_MAX_SHARD_BYTES, HFModel, WeightReader, write_hf
from zeropp_strategy.checkpoint.integrity import CheckpointError, is_writer
from zeropp_strategy.engine.frozen import dense_value
from zeropp_strategy.engine.guards import agree
from zeropp_strategy.engine.state import to_full_cpu
from zeropp_strategy.errors import UsageError

__all__ = ["ADAPTER_CONFIG", "ADAPTER_WEIGHTS", "export_adapters", "export_pretrained"]

ADAPTER_WEIGHTS = "adapter_model.safetensors"
ADAPTER_CONFIG = "adapter_config.json"


@torch.no_grad()
def _gather(t: torch.Tensor, writer: bool, ledger: Any) -> torch.Tensor | None:
    """Collective: ``t`` whole on the CPU of the writer (a quantized weight dequantized
    first, this rank's shard only); None elsewhere."""
    return to_full_cpu(dense_value(t.detach()), keep=writer, ledger=ledger)


def _peft_config(model: nn.Module) -> dict[str, Any] | None:
    config = getattr(model, "peft_config", None)
    return config if isinstance(config, dict) and config else None


def _base(model: nn.Module) -> nn.Module:
    """The transformers model inside a ``PeftModel`` (its LoRA layers included), or ``model``."""
    return model.get_base_model() if _peft_config(model) is not None else model


def _local_tensors(module: nn.Module) -> Iterator[tuple[str, torch.Tensor]]:
    """(state-dict key, live tensor) of every parameter and persistent buffer, in
    ``state_dict()`` order, without running its hooks (no dequantized copies)."""
    for prefix, m in module.named_modules(remove_duplicate=False):
        dot = f"{prefix}." if prefix else ""
        for name, p in m._parameters.items():
            if p is not None:
                yield dot + name, p
        for name, b in m._buffers.items():
            if b is not None and name not in m._non_persistent_buffers_set:
                yield dot + name, b


@dataclass
class _Merge:
    """What peft's ``merge`` would add to one LoRA layer's base weight."""

    a: torch.Tensor
    b: torch.Tensor
    scaling: float
    fan_in_fan_out: bool


@dataclass
class _Item:
    name: str          # the plain model's key
    tensor: torch.Tensor
    merge: _Merge | None = None


def _lora_layers(base: nn.Module, where: str) -> dict[str, _Merge]:
    """Key of each LoRA layer's base weight (``...q_proj.base_layer.weight``) -> its merge;
    raises ``UsageError`` for what a streamed merge does not do exactly as peft would."""
    try:
        from peft.tuners.lora import Linear as LoraLinear
        from peft.tuners.lora import LoraLayer
    except ImportError:
        return {}
    merges: dict[str, _Merge] = {}
    for name, layer in base.named_modules():
        if not isinstance(layer, LoraLayer):
            continue
        active = [a for a in layer.active_adapters if a in layer.lora_A]
        refuse = None
        if not isinstance(layer, LoraLinear):
            refuse = f"its {type(layer).__name__} layer {name!r} is not a Linear"
        elif len(active) > 1:
            refuse = f"layer {name!r} has {len(active)} active adapters {active}"
        elif active and (active[0] in getattr(layer, "lora_variant", {}) or layer.lora_bias.get(active[0], False)):
            refuse = f"layer {name!r} uses a LoRA variant (DoRA or lora_bias) that peft merges its own way"
        elif getattr(layer, "merged", False):
            refuse = f"layer {name!r} has its adapters merged into the base already"
        if refuse:
            raise UsageError(f"{where}: cannot merge the LoRA adapters while streaming: {refuse}",
                             "export the adapters alone (zeropp_strategy.export_adapters) and merge them with "
                             "peft where the model fits")
        if active:
            a = active[0]
            merges[f"{name}.base_layer.weight"] = _Merge(layer.lora_A[a].weight, layer.lora_B[a].weight,
                                                         float(layer.scaling[a]), bool(layer.fan_in_fan_out))
    return merges


def _plain_name(key: str) -> str:
    return key.replace(".base_layer.", ".")


def _walk(base: nn.Module, merges: dict[str, _Merge], where: str
          ) -> tuple[list[_Item], dict[str, tuple[torch.Size, torch.dtype]], dict[str, int]]:
    """The plain (merged) model's weights in state-dict order, once per tensor; ``specs``:
    name -> (shape, dtype) of every key its state dict has, tied aliases included
    (``write_hf`` checks them against the architecture, then drops the aliases);
    ``index``: every such name -> the position of the tensor it names."""
    items: list[_Item] = []
    specs: dict[str, tuple[torch.Size, torch.dtype]] = {}
    index: dict[str, int] = {}
    position: dict[int, int] = {}
    for key, t in _local_tensors(base):
        # peft's own tensors: the adapters (merged below), and the trained copy and the
        # untrained original of a modules_to_save layer
        if ".lora_" in key or ".modules_to_save." in key or ".original_module." in key:
            continue
        name = _plain_name(key)
        if id(t) not in position:
            position[id(t)] = len(items)
            items.append(_Item(name, t, merges.get(key)))
        specs.setdefault(name, (t.shape, t.dtype))
        index.setdefault(name, position[id(t)])
    if not items:
        raise UsageError(f"{where}: the model has no weights to export", "export the model the run trained")
    return items, specs, index


class _StreamedGather:
    """Every rank walks the same list of weights in the same order (see [Note: streamed export])."""

    def __init__(self, items: list[_Item], index: dict[str, int], writer: bool, ledger: Any = None) -> None:
        self.items = items
        self.index = index
        self.writer = writer
        self.ledger = ledger
        self.next = 0

    def _gather(self, t: torch.Tensor) -> torch.Tensor | None:
        return _gather(t, self.writer, self.ledger)

    def _take(self, item: _Item) -> torch.Tensor | None:
        full = self._gather(item.tensor)
        if item.merge is None:
            return full
        a, b = self._gather(item.merge.a), self._gather(item.merge.b)
        if full is None or a is None or b is None:
            return None
        delta_dtype = b.dtype
        if delta_dtype in (torch.float16, torch.bfloat16):  # as peft does on the CPU
            a, b = a.float(), b.float()
        delta = b @ a
        if item.merge.fan_in_fan_out:
            delta = delta.T
        delta = (delta * item.merge.scaling).to(delta_dtype)
        full += delta
        return full.contiguous()

    def read(self, name: str) -> torch.Tensor:
        """Rank 0 (inside ``write_hf``): the full weight ``name``; every rank gathers with it."""
        target = self.index[name]
        if target < self.next:
            raise RuntimeError(f"export: {name!r} was asked for after the weights that follow it; the streamed "
                               "export reads in state-dict order only")
        while self.next < target:  # weights the writer does not write: gathered and dropped, as on every rank
            self._take(self.items[self.next])
            self.next += 1
        out = self._take(self.items[self.next])
        self.next += 1
        assert out is not None
        return out

    def drain(self) -> None:
        """The gathers the writer did not ask for (all of them on the other ranks)."""
        while self.next < len(self.items):
            self._take(self.items[self.next])
            self.next += 1


def export_pretrained(model: nn.Module, directory: str | os.PathLike[str], *, dtype: torch.dtype | None = None,
                      tokenizer: Any = None, max_shard_bytes: int = DEFAULT_MAX_SHARD_BYTES,
                      extra_tensors: dict[str, dict[str, torch.Tensor]] | None = None,
                      extra_json: dict[str, Any] | None = None, ledger: Any = None) -> Path:
    """Collective. ``model`` (a transformers model or a peft ``PeftModel`` around one; sharded
    at any stage or not) as a ``from_pretrained`` folder, LoRA adapters merged, streamed
    (see [Note: streamed export]). Returns ``directory``; an existing folder is replaced
    only once the new one is complete.

    Args:
        dtype: cast floating-point weights (e.g. ``torch.bfloat16`` for fp32 master
            weights); None keeps the parameters' dtype.
        tokenizer: a tokenizer (``save_pretrained``) or a folder to copy in.
        max_shard_bytes: the largest safetensors file; rank 0 holds one at a time.
        extra_tensors, extra_json: more files (rank 0's values are written).
    """
    where = f"export_pretrained({str(directory)!r})"
    base = _base(model)
    if not hasattr(base, "config"):
        raise UsageError(f"{where}: {type(base).__name__} has no transformers config",
                         "pass a transformers model (or a peft PeftModel around one)")
    merges = _lora_layers(base, where)
    items, specs, index = _walk(base, merges, where)
    writer = is_writer()
    stream = _StreamedGather(items, index, writer, ledger)

    def write() -> Path | None:
        try:
            if not writer:
                return None
            reader = WeightReader(specs, stream.read)
            hf = HFModel(weights=reader, config=base.config, model_cls=type(base),
                         generation_config=getattr(base, "generation_config", None), tokenizer=tokenizer,
                         extra_tensors=extra_tensors or {}, extra_json=extra_json or {},
                         source="the live model")
            return write_hf(directory, hf, dtype=dtype, max_shard_bytes=max_shard_bytes, overwrite=True)
        finally:
            stream.drain()  # the writer failed or skipped some: the other ranks still wait for these gathers

    agree(f"exporting {directory}", write)
    return Path(directory)


def export_adapters(model: nn.Module, directory: str | os.PathLike[str], *, adapter: str = "default",
                    ledger: Any = None) -> Path:
    """Collective. The LoRA adapters of a peft ``PeftModel`` (sharded or not) as the folder
    ``PeftModel.save_pretrained`` writes (``adapter_model.safetensors``,
    ``adapter_config.json``), loadable with ``PeftModel.from_pretrained(base, directory)``.
    An existing folder is replaced only once the new one is complete."""
    where = f"export_adapters({str(directory)!r})"
    configs = _peft_config(model)
    if configs is None:
        raise UsageError(f"{where}: {type(model).__name__} carries no peft adapters",
                         "wrap the model with peft.get_peft_model before training, or use export_pretrained")
    if adapter not in configs:
        raise UsageError(f"{where}: adapter={adapter!r} is not one of the model's adapters {sorted(configs)}",
                         f"pass adapter= one of {sorted(configs)}")
    marks = (f".lora_A.{adapter}.", f".lora_B.{adapter}.", f".lora_embedding_A.{adapter}",
             f".lora_embedding_B.{adapter}", f".lora_magnitude_vector.{adapter}", f".modules_to_save.{adapter}.")
    writer = is_writer()
    ours = [(key, t) for key, t in _local_tensors(model) if any(m in key for m in marks)]
    if not ours:
        raise UsageError(f"{where}: adapter {adapter!r} has no tensors in the model", "export the model the run trained")
    gathered: dict[str, torch.Tensor] = {}
    for key, t in ours:  # every rank, in the same order: one gather each
        full = _gather(t, writer, ledger)
        if writer:
            gathered[key] = full

    def write() -> None:
        if writer:
            _write_adapters(Path(directory), model, gathered, adapter)

    agree(f"exporting {directory}", write)
    return Path(directory)


def _write_adapters(path: Path, model: nn.Module, gathered: dict[str, torch.Tensor], adapter: str) -> None:
    from peft.utils import get_peft_model_state_dict
    from safetensors import safe_open
    from safetensors.torch import save_file

    state = get_peft_model_state_dict(model, state_dict=gathered, adapter_name=adapter)
    state = {k: v.contiguous() for k, v in state.items()}
    config = copy.deepcopy(model.peft_config[adapter])
    config.inference_mode = True
    with published_directory(path) as tmp:
        save_file(state, str(tmp / ADAPTER_WEIGHTS), metadata={"format": "pt"})
        config.save_pretrained(str(tmp))
        with safe_open(str(tmp / ADAPTER_WEIGHTS), "pt") as f:
            lost = sorted(set(state) - set(f.keys()))
        written = json.loads((tmp / ADAPTER_CONFIG).read_text()) if (tmp / ADAPTER_CONFIG).is_file() else None
        if lost or not state or not written:
            raise CheckpointError(f"{path}: reading back the adapter folder, {len(lost)} of {len(state)} tensors "
                                  f"are not there{'' if written else ', nor ' + ADAPTER_CONFIG}; nothing was kept. "
                                  "Fix: check the disk (space, a file system that drops writes) and export again.")

"""Layer: checkpoint. Sharded checkpoints: every rank writes its own shards in parallel (DCP), keyed by name.

[Note: sharded checkpoint format v1]
A directory with
- ``torch.distributed.checkpoint`` files holding only tensors, from
  ``{"model": {fqn: tensor}, "optim": {"<i>": {fqn: {state_key: tensor}}}}``; fqn is the
  LightningModule's state-dict key with wrapper segments (``_orig_mod.``,
  ``_checkpoint_wrapped_module.``) removed;
- ``zeropp_meta.pt``: the rest of Lightning's checkpoint (loops, schedulers, callbacks,
  hparams...), per optimizer its param groups with parameter *names* instead of indices
  plus non-tensor state, and a ``"zeropp"`` block (format, stage, world size, config, the
  Hugging Face models inside the module for export).
Keying optimizer state by parameter name, and storing DTensors by their global shape,
is what makes the checkpoint loadable at any stage and rank count: DCP reads whatever
region each rank's target tensor covers, whether the target is an FSDP2 shard (stage
2/3), a stage-1 row shard, or a whole tensor.
"""

from __future__ import annotations

import shutil
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.api import CheckpointException
from torch import nn
from torch.distributed.tensor import DTensor
from torch.optim import Optimizer

from zeropp_strategy.checkpoint import integrity
from zeropp_strategy.engine.stage1 import ShardedOptimizer

FORMAT = "zeropp-sharded"
VERSION = 1
TENSOR = "__tensor__"
# A callback's state_dict() may hold DTensor shards under CALLBACK_TENSORS (ShardedEMA): in
# the sharded format they are saved with the model under "callbacks.<id>.<name>", and the
# callback's entry in the meta file keeps only the id, under CALLBACK_TENSORS_ID.
QGZ_ERROR = "qgz_error"  # DCP key and zeropp-block key of qgZ's kept errors (checkpoint/comm_state.py)
CALLBACK_TENSORS = "__zeropp_shards__"
CALLBACK_TENSORS_ID = "__zeropp_shards_id__"
_WRAPPER_SEGMENTS = ("_orig_mod.", "_checkpoint_wrapped_module.")


def canonical(name: str) -> str:
    for seg in _WRAPPER_SEGMENTS:
        name = name.replace(seg, "")
    return name


def model_tensors(module: nn.Module) -> dict[str, torch.Tensor]:
    """This rank's view of the module state (DTensor shards stay shards)."""
    return {canonical(k): v for k, v in module.state_dict().items()}


def _param_names(module: nn.Module, optimizer: Optimizer) -> dict[int, str]:
    """id(optimizer param) -> canonical name; stage 1 maps shards through their full param."""
    names = {id(p): canonical(n) for n, p in module.named_parameters(remove_duplicate=False)}
    inner = getattr(optimizer, "_optimizer", optimizer)
    if isinstance(inner, ShardedOptimizer):
        for full in inner.full_params:
            shard = inner.shard_of(full)
            if shard is not None and id(full) in names:
                names[id(shard)] = names[id(full)]
    return names


def _inner(optimizer: Optimizer) -> Optimizer:
    inner = getattr(optimizer, "_optimizer", optimizer)
    return inner.optimizer if isinstance(inner, ShardedOptimizer) else inner


def optimizer_tensors_and_meta(module: nn.Module, optimizer: Optimizer) -> tuple[dict[str, Any], dict[str, Any]]:
    """(tensors by name for DCP, everything else for the meta file)."""
    names = _param_names(module, optimizer)
    inner = _inner(optimizer)
    tensors: dict[str, dict[str, torch.Tensor]] = {}
    state_meta: dict[str, dict[str, Any]] = {}
    groups = []
    for group in inner.param_groups:
        fqns = []
        for p in group["params"]:
            if id(p) not in names:
                raise KeyError(
                    "an optimizer parameter is not a parameter of the LightningModule, so it cannot be "
                    "checkpointed by name. Fix: build optimizers from self.parameters() in configure_optimizers."
                )
            fqn = names[id(p)]
            fqns.append(fqn)
            state = inner.state.get(p, {})
            if state:
                tensors[fqn] = {k: v for k, v in state.items() if isinstance(v, torch.Tensor)}
                state_meta[fqn] = {k: (TENSOR if isinstance(v, torch.Tensor) else v) for k, v in state.items()}
        groups.append({**{k: v for k, v in group.items() if k != "params"}, "params": fqns})
    return tensors, {"param_groups": groups, "state_meta": state_meta}


def _model_class(module: nn.Module) -> type:
    """The module's own class: FSDP2's ``fully_shard`` swaps in a subclass named ``FSDP<Name>``."""
    from torch.distributed.fsdp import FSDPModule

    return next(c for c in type(module).__mro__ if not issubclass(c, FSDPModule))


def hf_models(module: nn.Module) -> list[dict[str, Any]]:
    """Outermost transformers models inside ``module``, for ``zeropp consolidate --hf``."""
    try:
        from transformers import PreTrainedModel
    except ImportError:  # pragma: no cover - transformers is a dependency
        return []
    found: list[dict[str, Any]] = []
    taken: list[str] = []
    for name, sub in module.named_modules():
        if isinstance(sub, PreTrainedModel) and not any(t == "" or name.startswith(t + ".") for t in taken):
            taken.append(name)
            entry = {
                "prefix": canonical(f"{name}.") if name else "",
                "architecture": _model_class(sub).__name__,
                "config": sub.config.to_dict(),
            }
            generation = getattr(sub, "generation_config", None)
            if generation is not None:
                entry["generation_config"] = generation.to_dict()
            found.append(entry)
    return found


# -- save -------------------------------------------------------------------------------


def _own_storage(t: torch.Tensor) -> torch.Tensor:
    """``t`` as a zero-copy view whose storage spans exactly its bytes.

    DCP's writer clones every tensor whose storage is larger than the tensor (an FSDP2
    shard is a view of its padded flat buffer; an NVMe-offloaded shard or optimizer state
    is a view of a whole swap file), and torch 2.13's writer keeps every tensor it wrote
    until the rank's file is finished: a save then held a copy of the rank's whole shard,
    12 bytes per parameter with Adam. A view with its own storage is not cloned, and what
    the writer keeps costs nothing. The view holds the original storage alive."""
    if isinstance(t, DTensor):
        local = _own_storage(t.to_local())
        return DTensor.from_local(local, t.device_mesh, t.placements, run_check=False, shape=t.shape, stride=t.stride())
    if t.untyped_storage().nbytes() == t.nbytes or not t.is_contiguous() or t.device.type != "cpu":
        return t
    start = t.storage_offset() * t.element_size()
    storage = t.untyped_storage()[start : start + t.nbytes]
    return torch.empty(0, dtype=t.dtype).set_(storage, 0, t.shape, t.stride())


def _own_storages(tree: Any) -> Any:
    if isinstance(tree, Mapping):
        return {k: _own_storages(v) for k, v in tree.items()}
    return _own_storage(tree) if isinstance(tree, torch.Tensor) else tree


def save_tensors(tensors: Mapping[str, Any], directory: Path) -> None:
    """Collective: every rank writes its shards into ``directory`` and checksums them
    ([Note: checkpoint checksums]). On failure (a full disk) every rank raises, and the
    staged ``directory`` is removed: nothing was published."""
    try:
        dcp.save(_own_storages(tensors), checkpoint_id=str(directory))
        integrity.record(directory)
    except (Exception, CheckpointException) as err:  # the latter is a BaseException
        if integrity.is_writer():  # every rank is past its writes: DCP gathers their results first
            shutil.rmtree(directory, ignore_errors=True)
        raise integrity.write_failed(directory, err) from err


# -- load -------------------------------------------------------------------------------


def _metadata(directory: Path) -> dict[str, Any]:
    try:
        return dcp.FileSystemReader(str(directory)).read_metadata().state_dict_metadata
    except (Exception, CheckpointException) as err:  # the latter is a BaseException
        raise integrity.damaged_file(directory / ".metadata", err) from err


def _load(state: dict[str, Any], directory: Path) -> None:
    """Collective ``dcp.load``; a shard that cannot be read (an unverified checkpoint) fails on every rank."""
    try:
        dcp.load(state, checkpoint_id=str(directory))
    except (Exception, CheckpointException) as err:  # the latter is a BaseException
        failures = getattr(err, "failures", None) or {}
        first = next(iter(failures.values()), (err,))
        cause = first[0] if isinstance(first, tuple) else first
        raise integrity.CheckpointError(
            f"could not read the tensors of checkpoint {directory}: {type(cause).__name__}: {cause}. A shard "
            "file is missing, truncated or corrupted. Fix: resume from another checkpoint, or restore this one."
        ) from err


def load_model(module: nn.Module, directory: Path, *, strict: bool, key: str = "model") -> None:
    """Read the module's tensors (saved under ``key``) from ``directory`` into its current layout, in place."""
    saved = {k[len(key) + 1 :] for k in _metadata(directory) if k.startswith(f"{key}.")}
    current = module.state_dict()
    by_name = {canonical(k): v for k, v in current.items()}
    missing = sorted(set(by_name) - saved)
    unexpected = sorted(saved - set(by_name))
    if strict and (missing or unexpected):
        raise KeyError(
            f"checkpoint {directory} does not match the model: missing {missing[:8]}, unexpected "
            f"{unexpected[:8]}. Fix: load a checkpoint of this model, or set LightningModule.strict_loading = False."
        )
    targets = {k: v for k, v in by_name.items() if k in saved}
    _load({key: targets}, directory)
    # dcp.load fills tensors in place; state_dict() tensors alias the parameters and
    # buffers, except where a module returns copies: copy those back.
    module.load_state_dict({k: v for k, v in current.items() if canonical(k) in targets}, strict=False)


def load_optimizer(module: nn.Module, optimizer: Optimizer, directory: Path, index: int, meta: Mapping[str, Any]) -> None:
    """Rebuild optimizer ``index``'s state from names, in this rank's layout."""
    md = _metadata(directory)
    names = _param_names(module, optimizer)
    inner = _inner(optimizer)
    params = [p for g in inner.param_groups for p in g["params"]]
    by_name = {names[id(p)]: p for p in params if id(p) in names}
    saved_groups = meta["param_groups"]
    if len(saved_groups) != len(inner.param_groups):
        raise ValueError(
            f"checkpoint optimizer {index} has {len(saved_groups)} param groups, this run's has "
            f"{len(inner.param_groups)}. Fix: build the same param groups in configure_optimizers."
        )
    targets: dict[str, dict[str, torch.Tensor]] = {}
    # An optimizer whose state lives in swap files (offload to NVMe) offers views of them, so
    # DCP reads the state straight into the files, never the whole shard into memory.
    in_place = getattr(inner, "checkpoint_target", None)
    for fqn, entries in meta["state_meta"].items():
        if fqn not in by_name:
            raise KeyError(f"checkpoint optimizer {index} has state for {fqn!r}, which this run's optimizer lacks")
        p = by_name[fqn]
        for key, kind in entries.items():
            if kind != TENSOR:
                continue
            info = md[f"optim.{index}.{fqn}.{key}"]
            dtype = info.properties.dtype
            if key != "step" and tuple(info.size) == tuple(p.shape):  # see follows_param
                t = in_place(p, key) if in_place is not None else None
                if t is None or t.dtype != dtype:
                    t = torch.zeros_like(p, dtype=dtype)  # DTensor -> same placements
            else:
                t = torch.zeros(tuple(info.size), dtype=dtype, device="cpu" if p.device.type == "meta" else p.device)
            targets.setdefault(fqn, {})[key] = t
    if targets:
        _load({"optim": {str(index): targets}}, directory)
    position = {names[id(p)]: i for i, p in enumerate(params)}
    state = {}
    for fqn, entries in meta["state_meta"].items():
        state[position[fqn]] = {k: (targets[fqn][k] if v == TENSOR else v) for k, v in entries.items()}
    # Optimizer.load_state_dict pairs saved and current params by position, so list the
    # indices in the current order, after checking each group holds the same names.
    groups = []
    for saved, current in zip(saved_groups, inner.param_groups):
        current_names = [names[id(p)] for p in current["params"]]
        if sorted(saved["params"]) != sorted(current_names):
            raise ValueError(
                f"checkpoint optimizer {index}: a param group holds {len(saved['params'])} parameters "
                f"({saved['params'][:3]}...), this run's holds {len(current_names)} ({current_names[:3]}...). "
                "Fix: build the same param groups in configure_optimizers."
            )
        groups.append({**{k: v for k, v in saved.items() if k != "params"}, "params": [position[n] for n in current_names]})
    inner.load_state_dict({"state": state, "param_groups": groups})


def is_dtensor_state(value: Any) -> bool:
    return isinstance(value, DTensor)

"""Layer: checkpoint (no process group, no training framework; transformers and safetensors
are imported when used). The one Hugging Face exporter: full weights -> a checked
``from_pretrained`` folder.

    from zeropp_strategy.checkpoint.hf import HFModel, write_hf
    write_hf("export/lm", HFModel(weights=model.state_dict(), config=model.config, model_cls=type(model)))

Both ways a run ends up as a Hugging Face folder go through ``write_hf``; each caller only
says where the weights come from:

- ``zeropp consolidate --hf`` (checkpoint/consolidate.py): a ``WeightReader`` over a
  checkpoint, one tensor read at a time, and the config the strategy recorded
  (``config_from_record``); one subfolder per model when the module held several;
- the RLHF modules' ``export_dir`` (rlhf/export.py): after a collective gather, rank 0's
  dense CPU state dict of the live model, LoRA adapters merged.

``write_hf`` in order: check the arguments and every model's weight names against its
architecture (nothing is written if they do not match) -> stage ``<folder>.tmp-<nonce>``
-> per model: tokenizer, safetensors shards (one in memory at a time), index, config.json,
generation_config.json, extra files -> read back what was written (every expected
weight in the safetensors headers, at least one) -> publish: rename over any existing
folder (checkpoint/atomic.py, [Note: atomic saves]). A failure anywhere removes the
staged folder; an existing folder of the same name is then left as it was.

Tests: python -m pytest tests/test_hf_export.py tests/test_consolidate.py -q
"""

from __future__ import annotations

import copy
import json
import logging
import os
import shutil
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from zeropp_strategy.checkpoint.atomic import published_directory
from zeropp_strategy.checkpoint.integrity import CheckpointError
from zeropp_strategy.engine.pretrained import tied_aliases

__all__ = ["DEFAULT_MAX_SHARD_BYTES", "HFModel", "WeightReader", "cast_floating", "config_from_record", "write_hf"]

log = logging.getLogger(__name__)

DEFAULT_MAX_SHARD_BYTES = 2 * 2**30
INDEX_FILE = "model.safetensors.index.json"
_MODEL_FILES = ("config.json", "generation_config.json", "model.safetensors", INDEX_FILE)  # + model-*-of-*


def cast_floating(t: torch.Tensor, dtype: torch.dtype | None) -> torch.Tensor:
    """``t`` in ``dtype`` if it is floating point and a dtype is asked for; else ``t``."""
    return t.to(dtype) if dtype is not None and t.is_floating_point() and t.dtype != dtype else t


@dataclass(frozen=True, slots=True)
class WeightReader:
    """Weights read one tensor at a time, for a model too big to hold twice (a checkpoint)."""

    specs: Mapping[str, tuple[torch.Size, torch.dtype]]
    """name -> (shape, dtype) of every weight, in the order to write them"""
    read: Callable[[str], torch.Tensor]
    """name -> a CPU tensor of that shape and dtype, contiguous, sharing no storage with
    another weight (safetensors refuses shared storage)"""

    @classmethod
    def of(cls, state: Mapping[str, Any], folder: Path) -> WeightReader:
        """A dense state dict; its tensors are made contiguous CPU tensors when read."""
        bad = [k for k, v in state.items() if not isinstance(v, torch.Tensor)]
        if bad:
            raise ValueError(f"cannot write {folder}: weights {bad[:4]} are not tensors. Fix: pass the model's "
                             "state_dict() (tensors only).")
        return cls({k: (v.shape, v.dtype) for k, v in state.items()},
                   lambda name: state[name].detach().to("cpu").contiguous())


@dataclass(kw_only=True, slots=True)
class HFModel:
    """One Hugging Face model to write: its weights and what describes them."""

    weights: Mapping[str, torch.Tensor] | WeightReader = field(repr=False)
    """the model's own ``state_dict()`` (names without an attribute prefix, LoRA merged),
    dense CPU tensors; or a ``WeightReader``"""
    config: Any
    """its ``transformers.PretrainedConfig``; a copy is written, with ``architectures`` and
    the weights' dtype set"""
    model_cls: type | None = None
    """its transformers class. Given, the weight names must be exactly the class's (no
    LoRA names, nothing missing), tied weights are written once and, under transformers
    5, fused weights (MoE experts) in their saved layout. ``None``: written unchecked."""
    generation_config: Any = None
    """a ``GenerationConfig`` or its dict; ``None``: the class's default for a model that
    generates, none otherwise"""
    tokenizer: Any = None
    """an object with ``save_pretrained``, or a folder whose files are copied in"""
    extra_tensors: Mapping[str, Mapping[str, torch.Tensor]] = field(default_factory=dict)
    """more ``*.safetensors`` files, file name -> tensors (e.g. a reward model's value head)"""
    extra_json: Mapping[str, Any] = field(default_factory=dict)
    """more ``*.json`` files, file name -> what to ``json.dumps``"""
    source: str = "the state dict"
    """where the weights come from, for errors (e.g. ``"CKPT under the prefix 'model.'"``)"""


@dataclass(slots=True)
class _Plan:
    """What one model's folder will hold: decided, and checked, before anything is written."""

    model: HFModel
    folder: Path  # the final name, for messages
    reader: WeightReader
    config: Any
    skeleton: Any
    arch: str
    shards: list[list[str]]
    out_dtypes: dict[str, torch.dtype]
    total_bytes: int
    convert: Callable[[dict[str, torch.Tensor]], dict[str, torch.Tensor]] | None


# -- the architecture: expected names, tied weights, fused weights -------------------------------


def config_from_record(architecture: str | None, config: Mapping[str, Any]) -> tuple[Any, type | None]:
    """The ``PretrainedConfig`` and transformers class from a class name and ``config.to_dict()``
    (what the strategy records when it saves); the class is None for one transformers
    does not export (a user subclass, remote code): its config is rebuilt from its model_type."""
    import transformers

    model_cls = getattr(transformers, architecture, None) if isinstance(architecture, str) else None
    if not (isinstance(model_cls, type) and issubclass(model_cls, transformers.PreTrainedModel)):
        return transformers.AutoConfig.for_model(**dict(config)), None
    return model_cls.config_class.from_dict(dict(config)), model_cls


def _skeleton(model_cls: type | None, config: Any) -> Any:
    """The model on the meta device (no memory): its keys, tied weights and generation config."""
    if model_cls is None:
        return None
    try:
        with torch.device("meta"):
            return model_cls(config)
    except Exception as err:  # an __init__ that computes on its weights: no names to check against
        raise ValueError(
            f"cannot check the weights against {model_cls.__name__}: it cannot be built on the meta device ({err}); "
            "nothing was written. Fix: pass HFModel(model_cls=None) to write the weights unchecked (transformers "
            "then reports missing or unexpected weights when it loads the folder)."
        ) from err


def _weight_converter(skeleton: Any) -> Callable[[dict[str, torch.Tensor]], dict[str, torch.Tensor]] | None:
    """transformers >= 5 keeps some weights fused in memory (e.g. MoE experts) and splits them on save.

    Returns the function that turns in-memory names and layouts back into the on-disk ones, or
    None when the architecture has no such conversion (or transformers predates it).
    """
    try:
        from transformers.conversion_mapping import get_model_conversion_mapping
        from transformers.core_model_loading import PrefixChange, revert_weight_conversion
    except ImportError:
        return None
    mapping = [m for m in get_model_conversion_mapping(skeleton, add_legacy=False) if not isinstance(m, PrefixChange)]
    if not mapping:
        return None
    return lambda tensors: revert_weight_conversion(skeleton, tensors)


def _check_names(folder: Path, model: HFModel, arch: str, names: list[str], skeleton: Any) -> None:
    expected = set(skeleton.state_dict())
    missing = sorted(expected - set(names))
    unexpected = sorted(set(names) - expected)
    if not (missing or unexpected):
        return
    hint = ""
    if any(".lora_" in n or ".base_layer." in n for n in unexpected):
        hint = (
            " The weights carry LoRA adapters: merge them before saving (peft's merge_and_unload), "
            "or export the adapter with peft's save_pretrained."
        )
    raise ValueError(
        f"cannot write {folder}: the weights from {model.source} do not match {arch}: missing {missing[:6]}, "
        f"unexpected {unexpected[:6]}.{hint} Fix: export the weights of an unmodified {arch}, without an attribute "
        "prefix (from a checkpoint, `zeropp consolidate` without --hf gives a Lightning file to start from)."
    )


# -- planning: every check that needs no writing ---------------------------------------------------


def _plan_shards(sizes: list[tuple[str, int]], max_shard_bytes: int) -> list[list[str]]:
    """Greedy, in key order (as HF does): a tensor bigger than the limit gets a shard of its own."""
    shards: list[list[str]] = []
    current: list[str] = []
    current_bytes = 0
    for name, nbytes in sizes:
        if current and current_bytes + nbytes > max_shard_bytes:
            shards.append(current)
            current, current_bytes = [], 0
        current.append(name)
        current_bytes += nbytes
    if current:
        shards.append(current)
    return shards


def _check_extras(folder: Path, model: HFModel) -> None:
    for names, suffix in ((model.extra_tensors, ".safetensors"), (model.extra_json, ".json")):
        for name in names:
            taken = name in _MODEL_FILES or name.startswith("model-")  # model-0000k-of-0000n.safetensors
            if Path(name).name != name or not name.endswith(suffix) or taken:
                raise ValueError(
                    f"cannot write {folder}: extra file name {name!r} is invalid: it must be a plain file name ending "
                    f"in {suffix}, not one of the model's files (config.json, model*.safetensors, ...). Fix: rename it."
                )
    empty = [name for name, tensors in model.extra_tensors.items() if not tensors]
    if empty:
        raise ValueError(f"cannot write {folder}: extra_tensors[{empty[0]!r}] holds no tensors. Fix: drop it.")
    tok = model.tokenizer
    if isinstance(tok, (str, os.PathLike)) and not Path(tok).is_dir():
        raise ValueError(f"cannot write {folder}: tokenizer={str(tok)!r} is not a folder. Fix: pass the folder "
                         "tokenizer.save_pretrained wrote, or the tokenizer object.")
    if tok is not None and not isinstance(tok, (str, os.PathLike)) and not hasattr(tok, "save_pretrained"):
        raise ValueError(f"cannot write {folder}: tokenizer={type(tok).__name__} has no save_pretrained. "
                         "Fix: pass a transformers tokenizer, or the folder of its files.")


def _set_config_dtype(config: Any, dtype: torch.dtype) -> None:
    # transformers 5 calls it `dtype`; 4.x `torch_dtype`
    setattr(config, "dtype" if hasattr(config, "dtype") else "torch_dtype", dtype)


def _plan(model: HFModel, folder: Path, dtype: torch.dtype | None, max_shard_bytes: int) -> _Plan:
    weights = model.weights
    reader = weights if isinstance(weights, WeightReader) else WeightReader.of(weights, folder)
    config = copy.deepcopy(model.config)
    skeleton = _skeleton(model.model_cls, config)
    arch = model.model_cls.__name__ if model.model_cls is not None else type(config).__name__
    names = list(reader.specs)
    if skeleton is not None:
        _check_names(folder, model, arch, names, skeleton)
        aliases = tied_aliases(skeleton)
        names = [n for n in names if n not in aliases]
    if model.model_cls is not None:
        config.architectures = [arch]
    if not names:
        raise ValueError(
            f"cannot write {folder}: {model.source} holds no weights of {arch}, so the folder would be empty; "
            "nothing was written. Fix: pass the model's full state dict."
        )
    _check_extras(folder, model)
    out_dtypes = {n: (dtype if dtype and reader.specs[n][1].is_floating_point else reader.specs[n][1]) for n in names}
    float_dtypes = [dt for dt in out_dtypes.values() if dt.is_floating_point]
    if float_dtypes:
        _set_config_dtype(config, max(set(float_dtypes), key=float_dtypes.count))
    sizes = [(n, reader.specs[n][0].numel() * out_dtypes[n].itemsize) for n in names]
    convert = _weight_converter(skeleton) if skeleton is not None else None
    return _Plan(model, folder, reader, config, skeleton, arch, _plan_shards(sizes, max_shard_bytes), out_dtypes,
                 sum(b for _, b in sizes), convert)


# -- writing and reading back ------------------------------------------------------------------


def _unshared(tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Copies of tensors that share storage with one before them (safetensors refuses those)."""
    seen: set[int] = set()
    out = {}
    for name, t in tensors.items():
        ptr = t.untyped_storage().data_ptr()
        out[name] = t.clone() if ptr in seen and t.numel() else t
        seen.add(ptr)
    return out


def _write_tokenizer(staged: Path, tokenizer: Any) -> None:
    if tokenizer is None:
        return
    if isinstance(tokenizer, (str, os.PathLike)):
        shutil.copytree(tokenizer, staged, dirs_exist_ok=True)
    else:
        tokenizer.save_pretrained(str(staged))


def _write_model(plan: _Plan, staged: Path) -> None:
    """One model's files into ``staged`` (created), then read back (the order is in the module docstring)."""
    from safetensors.torch import save_file

    model = plan.model
    staged.mkdir(parents=True, exist_ok=True)
    _write_tokenizer(staged, model.tokenizer)  # first, so that our config.json wins should it bring one

    weight_map: dict[str, str] = {}
    count = len(plan.shards)
    for n, names in enumerate(plan.shards, start=1):
        filename = "model.safetensors" if count == 1 else f"model-{n:05d}-of-{count:05d}.safetensors"
        tensors = _unshared({name: cast_floating(plan.reader.read(name), plan.out_dtypes[name]) for name in names})
        if plan.convert is not None:
            try:
                tensors = plan.convert(tensors)
            except Exception as err:  # a conversion needs tensors that landed in another shard
                raise RuntimeError(
                    f"cannot write {plan.folder}: could not turn {plan.arch}'s fused weights back into their saved "
                    f"layout shard by shard ({err}). Fix: raise --max-shard-size (max_shard_bytes)."
                ) from err
        save_file(tensors, str(staged / filename), metadata={"format": "pt"})
        weight_map.update(dict.fromkeys(tensors, filename))
        log.info("wrote %s (%d tensors)", plan.folder / filename, len(tensors))
        del tensors  # at most one shard in memory
    if count > 1:
        index = {"metadata": {"total_size": plan.total_bytes}, "weight_map": dict(sorted(weight_map.items()))}
        (staged / INDEX_FILE).write_text(json.dumps(index, indent=2) + "\n", encoding="utf-8")

    plan.config.save_pretrained(str(staged))
    generation = model.generation_config
    if isinstance(generation, Mapping):
        from transformers import GenerationConfig

        generation = GenerationConfig.from_dict(dict(generation))
    if generation is None and plan.skeleton is not None and plan.skeleton.can_generate():
        generation = plan.skeleton.generation_config
    if generation is not None:
        generation.save_pretrained(str(staged))

    expected = {filename: {k for k, f in weight_map.items() if f == filename} for filename in set(weight_map.values())}
    for name, extra in model.extra_tensors.items():
        save_file({k: v.detach().to("cpu").contiguous() for k, v in extra.items()}, str(staged / name))
        expected[name] = set(extra)
    for name, body in model.extra_json.items():
        (staged / name).write_text(json.dumps(body) + "\n", encoding="utf-8")
    _read_back(plan.folder, staged, expected)


def _read_back(folder: Path, staged: Path, expected: dict[str, set[str]]) -> None:
    """Every tensor meant for a safetensors file is in its header, and config.json exists."""
    from safetensors import safe_open

    lost: list[str] = []
    for filename, keys in sorted(expected.items()):
        with safe_open(str(staged / filename), "pt") as f:
            lost += [f"{filename}: {k}" for k in sorted(keys - set(f.keys()))]
    total = sum(map(len, expected.values()))
    config = (staged / "config.json").is_file()
    if lost or not total or not config:
        raise CheckpointError(
            f"{folder}: reading back what was written, {len(lost)} of {total} tensors are not there ({lost[:4]})"
            f"{'' if config else ', nor config.json'}; nothing was kept. Fix: check the disk (space, a file system "
            "that drops writes) and export again."
        )


# -- the entry point ------------------------------------------------------------------------------


def write_hf(
    folder: str | os.PathLike[str],
    models: HFModel | Mapping[str, HFModel],
    *,
    dtype: torch.dtype | None = None,
    max_shard_bytes: int = DEFAULT_MAX_SHARD_BYTES,
    overwrite: bool = False,
) -> Path:
    """Write ``models`` as a Hugging Face folder; returns ``folder``.

    Args:
        folder: the folder to create. Written to ``<folder>.tmp-<nonce>``, checked, then
            renamed into place; on any error nothing new is left and an existing folder
            is untouched.
        models: one ``HFModel`` (``folder`` is its folder), or several by subfolder name
            (``{"actor": ..., "critic": ...}``: one subfolder each, all published together).
        dtype: cast floating-point weights to it (``torch.bfloat16``...); None keeps theirs.
        max_shard_bytes: the largest safetensors file, in bytes; a larger single tensor
            gets a file of its own. More than one file: ``model-0000k-of-0000n.safetensors``
            plus ``model.safetensors.index.json``.
        overwrite: replace an existing ``folder``; False raises ``FileExistsError``.
    """
    path = Path(folder)
    if isinstance(max_shard_bytes, bool) or not isinstance(max_shard_bytes, int) or max_shard_bytes <= 0:
        raise ValueError(f"max_shard_bytes={max_shard_bytes!r} is invalid: must be a positive int. Fix: e.g. 2**30.")
    if dtype is not None and not (isinstance(dtype, torch.dtype) and dtype.is_floating_point):
        raise ValueError(f"dtype={dtype!r} is invalid: weights are cast to a floating torch.dtype. "
                         "Fix: e.g. dtype=torch.bfloat16, or None to keep theirs.")
    named = {"": models} if isinstance(models, HFModel) else dict(models)
    bad = [k for k, m in named.items() if not isinstance(m, HFModel)
           or not isinstance(models, HFModel) and (not k or Path(k).name != k or k in (".", ".."))]
    if not named or bad:
        what = f"the entries {bad[:4]}" if bad else "it is empty"
        raise ValueError(f"models is invalid: {what}. Fix: pass one HFModel, or a mapping from plain subfolder "
                         "names to HFModel, e.g. {'actor': HFModel(...), 'critic': HFModel(...)}.")
    if (path.exists() or path.is_symlink()) and not overwrite:
        raise FileExistsError(f"{path} already exists. Fix: choose another folder, or pass overwrite=True.")
    plans = {sub: _plan(model, path / sub, dtype, max_shard_bytes) for sub, model in named.items()}

    with published_directory(path) as tmp:
        for sub, plan in plans.items():
            _write_model(plan, tmp / sub)
    return path

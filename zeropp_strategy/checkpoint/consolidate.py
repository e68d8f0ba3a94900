"""Turn a zeropp sharded checkpoint into one full file, or into a Hugging Face folder.

    zeropp consolidate runs/ckpts/step=100 full.ckpt              # what strategy="ddp" would have saved
    zeropp consolidate fabric-ckpt full.ckpt                      # Fabric: what fabric.save under DDP saves
    zeropp consolidate ckpts/checkpoint_3 full.pt                 # Accelerate: its zeropp_state, as one file
    zeropp consolidate runs/ckpts/step=100 hf-model --hf --dtype bf16 --max-shard-size 5GB
    zeropp consolidate full.ckpt hf-model --hf                    # a full (one-file) checkpoint works too

    from zeropp_strategy.checkpoint.consolidate import consolidate
    consolidate("runs/ckpts/step=100", "full.ckpt")

One CPU process, no process group, no GPU: the sharded checkpoint is read with
``torch.distributed.checkpoint`` (DCP) in its single-process mode, one tensor at a time
(see [Note: one tensor at a time]). The output is written to a ``OUT.tmp-<pid>`` sibling
and renamed into place when complete, so an interrupted run never leaves a half-written OUT.

Which layouts are read (Lightning, Fabric, Accelerate; sharded or full) and how they are
told apart: checkpoint/layout.py. A sharded directory's checksums are verified before
anything is read, and nothing is written unless every tensor of the checkpoint made it
into OUT (checkpoint/integrity.py). The Lightning sharded format (v1) is a directory:
    .metadata, __<rank>_0.distcp  DCP files, tensors only, keys ``model.<fqn>`` and
                                  ``optim.<i>.<fqn>.<state_key>`` (fqn: LightningModule
                                  ``state_dict()`` key), global shapes
    zeropp_meta.pt                everything else, written last: Lightning's checkpoint dict
                                  without "state_dict", optimizer states keyed by fqn, and
                                  a "zeropp" entry (format, version, stage, world size,
                                  config, Hugging Face models, tokenizer folder)
    tokenizer/                    optional, ``tokenizer.save_pretrained`` output

Tests: python -m pytest tests/test_consolidate.py -q
"""

from __future__ import annotations

import json
import logging
import os
import re
import shutil
import sys
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

import torch

from zeropp_strategy.checkpoint.integrity import check_written
from zeropp_strategy.checkpoint.layout import LIGHTNING, FullCheckpoint, ShardedCheckpoint, open_checkpoint
from zeropp_strategy.checkpoint.sharded import CALLBACK_TENSORS_ID
from zeropp_strategy.checkpoint.sharded import TENSOR as TENSOR_MARK
from zeropp_strategy.errors import USAGE_EXIT, UsageError, run
from zeropp_strategy.parsers import CONSOLIDATE_DTYPES
from zeropp_strategy.parsers import consolidate_parser as build_parser

__all__ = ["consolidate", "parse_size", "main"]

log = logging.getLogger(__name__)

CONSOLIDATED_FORMAT = "zeropp-consolidated"  # the "zeropp" block's format in a file we write
DEFAULT_MAX_SHARD_BYTES = 2 * 2**30

DTYPES: dict[str, torch.dtype] = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}
assert tuple(sorted(DTYPES)) == CONSOLIDATE_DTYPES  # what `zeropp consolidate --dtype` offers
_DTYPE_ALIASES = {"float32": "fp32", "bfloat16": "bf16", "float16": "fp16", "half": "fp16", "float": "fp32"}

# [Note: one tensor at a time]
# A sharded checkpoint exists because the full state does not fit one accelerator; it may
# barely fit host memory. Each tensor is therefore read by its own ``dcp.load`` into a freshly
# allocated tensor of the global size and dtype recorded in the DCP metadata. DCP gathers the
# pieces every rank wrote (DTensor shards, uneven or empty ones included) into it. Peak memory
# is the output plus one tensor for a Lightning file, and one safetensors shard for a Hugging
# Face folder, plus transient copies while a tensor is read or a shard written (DCP reads raw
# bytes, then deserializes; safetensors serializes before writing). Measured on a 545 MB
# Llama: Lightning file +685 MB over the imports, Hugging Face folder with 64 MB shards
# +370 MB (its largest tensor, 125 MB, is a shard alone). Fresh tensors are also contiguous and
# share no storage, as safetensors requires (tied weights in a torch.save'd file do share:
# those are copied).


# -- (a) one Lightning checkpoint file ------------------------------------------------------


def _cast(t: torch.Tensor, dtype: torch.dtype | None) -> torch.Tensor:
    return t.to(dtype) if dtype is not None and t.is_floating_point() and t.dtype != dtype else t


def _is_mark(value: Any) -> bool:
    return isinstance(value, str) and value == TENSOR_MARK


def _optimizer_state(src: ShardedCheckpoint, i: int | str, entry: Mapping[str, Any]) -> dict[str, Any]:
    """fqn-keyed optimizer entry -> ``Optimizer.state_dict()`` form (keys are param indices).

    A parameter's index is its position in the param groups' "params" lists, concatenated in
    group order: the numbering ``torch.optim.Optimizer.state_dict`` uses.
    """
    fqns = [fqn for group in entry["param_groups"] for fqn in group["params"]]
    index = {fqn: idx for idx, fqn in enumerate(fqns)}
    if len(index) != len(fqns):
        raise ValueError(f"{src.path}: optimizer {i} lists a parameter in two param groups: the checkpoint is damaged.")
    unknown = [fqn for fqn in entry["state_meta"] if fqn not in index]
    if unknown:
        raise ValueError(
            f"{src.path}: optimizer {i} has state for {unknown[:4]}, which no param group lists: "
            "the checkpoint is damaged."
        )
    state: dict[int, dict[str, Any]] = {}
    for fqn in sorted(entry["state_meta"], key=index.__getitem__):
        state[index[fqn]] = {
            key: src.read(f"optim.{i}.{fqn}.{key}") if _is_mark(value) else value
            for key, value in entry["state_meta"][fqn].items()
        }
    groups = [{k: ([index[f] for f in v] if k == "params" else v) for k, v in g.items()} for g in entry["param_groups"]]
    return {"state": state, "param_groups": groups}


def _write_lightning(src: ShardedCheckpoint, out: Path, dtype: torch.dtype | None) -> None:
    # Model first, then each optimizer: one tensor read at a time, see [Note: one tensor at a time].
    state_dict = {fqn: _cast(src.read_model(fqn), dtype) for fqn in src.model_keys()}
    checkpoint: dict[str, Any] = {}
    for key, value in src.meta.items():
        if key == "optimizer_states":
            value = [_optimizer_state(src, i, entry) for i, entry in enumerate(value)]
        elif key == "callbacks" and isinstance(value, Mapping):
            value = {k: _callback_state(src, v) for k, v in value.items()}
        elif key == "zeropp":
            # Kept so that `--hf` works on this file too; the tokenizer folder does not come along.
            value = {**value, "format": CONSOLIDATED_FORMAT, "tokenizer_dir": None}
        checkpoint[key] = value
        if key == "pytorch-lightning_version":
            checkpoint["state_dict"] = state_dict  # where Lightning puts it
    checkpoint.setdefault("state_dict", state_dict)
    _save_checked(src, checkpoint, out, len(state_dict))


def _callback_state(src: ShardedCheckpoint, state: Any) -> Any:
    """A callback state whose tensors were saved with the model (ShardedEMA) gets them back,
    whole, under "ema": the form a full-format save writes."""
    if not isinstance(state, Mapping) or CALLBACK_TENSORS_ID not in state:
        return state
    prefix = f"callbacks.{state[CALLBACK_TENSORS_ID]}."
    tensors = {k[len(prefix) :]: src.read(k) for k in src.entries if k.startswith(prefix)}
    return {**{k: v for k, v in state.items() if k != CALLBACK_TENSORS_ID}, "ema": tensors}


def _write_objects(src: ShardedCheckpoint, out: Path, dtype: torch.dtype | None) -> None:
    """Fabric / Accelerate: the full layout those front ends save (see checkpoint/objects.py)."""
    checkpoint: dict[str, Any] = dict(src.meta.get("state") or {})
    count = 0
    for module in src.modules:
        prefix = f"{module}."
        checkpoint[module] = {k[len(prefix) :]: _cast(src.read_model(k), dtype) for k in src.model_keys(module)}
        count += len(checkpoint[module])
    owners = {}
    for key, entry in (src.meta.get("optimizers") or {}).items():
        checkpoint[key] = _optimizer_state(src, key, entry)
        owners[key] = entry["module"]
    checkpoint["zeropp"] = {**src.zeropp, "format": CONSOLIDATED_FORMAT, "modules": src.modules, "optimizers": owners}
    _save_checked(src, checkpoint, out, count)


def _save_checked(src: ShardedCheckpoint, checkpoint: dict[str, Any], out: Path, model_tensors: int) -> None:
    """Write ``out`` only when it holds every tensor of the checkpoint, model weights first of all."""
    check_written(out, f"model tensors (modules {src.modules})", model_tensors, len(src.model_keys()))
    check_written(out, "tensors of the checkpoint", len(src.consumed & set(src.entries)), len(src.entries))
    torch.save(checkpoint, out)


# -- (b) Hugging Face folder ----------------------------------------------------------------


def _hf_config(entry: Mapping[str, Any]) -> tuple[Any, type | None]:
    """Rebuild the PretrainedConfig; also return the model class if transformers has it."""
    import transformers

    arch = entry.get("architecture")
    model_cls = getattr(transformers, arch, None) if isinstance(arch, str) else None
    if not (isinstance(model_cls, type) and issubclass(model_cls, transformers.PreTrainedModel)):
        model_cls = None  # a user subclass or remote code: rebuild the config from its model_type
    cfg = dict(entry["config"])
    if model_cls is not None:
        config = model_cls.config_class.from_dict(cfg)
        config.architectures = [arch]
    else:
        config = transformers.AutoConfig.for_model(**cfg)
    return config, model_cls


def _skeleton(model_cls: type | None, config: Any) -> Any:
    """The model on the meta device (no memory): its keys, tied weights and generation config."""
    if model_cls is None:
        return None
    try:
        with torch.device("meta"):
            return model_cls(config)
    except Exception as err:  # an __init__ that computes on its weights: export without the checks
        log.warning("could not build %s on the meta device (%s): exporting its weights unchecked", model_cls, err)
        return None


def _tied_aliases(skeleton: Any) -> set[str]:
    """Keys that alias another key (tied weights): HF writes only the one it reloads."""
    sd = skeleton.state_dict()
    try:
        from transformers.modeling_utils import remove_tied_weights_from_state_dict

        return set(sd) - set(remove_tied_weights_from_state_dict(dict(sd), skeleton))
    except ImportError:  # older transformers: keep the first name of each shared tensor
        seen: set[int] = set()
        aliases = set()
        for name, t in skeleton.state_dict(keep_vars=True).items():
            if id(t) in seen:
                aliases.add(name)
            seen.add(id(t))
        return aliases


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


def _check_keys(src: Any, entry: Mapping[str, Any], names: list[str], skeleton: Any) -> None:
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
        f"{src.path}: the weights under {entry['prefix']!r} do not match {entry['architecture']}: "
        f"missing {missing[:6]}, unexpected {unexpected[:6]}.{hint} Fix: export a checkpoint of an "
        "unmodified transformers model, or consolidate without --hf to get a Lightning checkpoint."
    )


def _set_config_dtype(config: Any, dtype: torch.dtype) -> None:
    # transformers 5 calls it `dtype`; 4.x `torch_dtype`
    setattr(config, "dtype" if hasattr(config, "dtype") else "torch_dtype", dtype)


def _export_hf_model(
    src: ShardedCheckpoint | FullCheckpoint,
    entry: Mapping[str, Any],
    folder: Path,
    dtype: torch.dtype | None,
    max_shard_bytes: int,
) -> None:
    from safetensors.torch import save_file

    prefix: str = entry["prefix"]
    config, model_cls = _hf_config(entry)
    skeleton = _skeleton(model_cls, config)
    keys = {fqn[len(prefix) :]: fqn for fqn in src.model_keys() if fqn.startswith(prefix)}
    if skeleton is not None:
        _check_keys(src, entry, list(keys), skeleton)
        for alias in _tied_aliases(skeleton):
            keys.pop(alias, None)
    if not keys:
        raise ValueError(f"{src.path}: no weights under the prefix {prefix!r} of {entry.get('architecture')}.")

    specs = {name: src.model_spec(fqn) for name, fqn in keys.items()}
    out_dtypes = {name: (dtype if dtype and dt.is_floating_point else dt) for name, (_, dt) in specs.items()}
    float_dtypes = [dt for dt in out_dtypes.values() if dt.is_floating_point]
    if float_dtypes:
        _set_config_dtype(config, max(set(float_dtypes), key=float_dtypes.count))
    sizes = [(name, specs[name][0].numel() * out_dtypes[name].itemsize) for name in keys]
    shards = _plan_shards(sizes, max_shard_bytes)
    convert = _weight_converter(skeleton) if skeleton is not None else None

    folder.mkdir(parents=True, exist_ok=True)
    if src.tokenizer_dir is not None and src.tokenizer_dir.is_dir():
        # First, so that our config.json wins should the tokenizer folder hold one.
        shutil.copytree(src.tokenizer_dir, folder, dirs_exist_ok=True)

    weight_map: dict[str, str] = {}
    exported = 0
    for n, names in enumerate(shards, start=1):
        filename = "model.safetensors" if len(shards) == 1 else f"model-{n:05d}-of-{len(shards):05d}.safetensors"
        tensors = {name: _cast(src.read_model(keys[name]), dtype) for name in names}
        exported += len(tensors)
        if convert is not None:
            try:
                tensors = convert(tensors)
            except Exception as err:  # a conversion needs tensors that landed in another shard
                raise RuntimeError(
                    f"could not turn {entry['architecture']}'s fused weights back into their saved layout "
                    f"shard by shard ({err}). Fix: raise --max-shard-size (max_shard_bytes)."
                ) from err
        save_file(tensors, str(folder / filename), metadata={"format": "pt"})
        weight_map.update(dict.fromkeys(tensors, filename))
        log.info("wrote %s (%d tensors)", folder / filename, len(tensors))
        del tensors  # at most one shard in memory
    check_written(folder, f"weights of {entry.get('architecture')}", exported, len(keys))
    if len(shards) > 1:
        index = {"metadata": {"total_size": sum(b for _, b in sizes)}, "weight_map": dict(sorted(weight_map.items()))}
        text = json.dumps(index, indent=2) + "\n"
        (folder / "model.safetensors.index.json").write_text(text, encoding="utf-8")

    config.save_pretrained(folder)
    saved = entry.get("generation_config")  # the run's own, when the writer recorded it
    if saved:
        from transformers import GenerationConfig

        GenerationConfig.from_dict(dict(saved)).save_pretrained(folder)
    elif skeleton is not None and skeleton.can_generate():
        skeleton.generation_config.save_pretrained(folder)


def _write_hf(
    src: ShardedCheckpoint | FullCheckpoint, out: Path, dtype: torch.dtype | None, max_shard_bytes: int
) -> None:
    entries = src.zeropp.get("hf") or []
    if not entries:
        if isinstance(src, FullCheckpoint) and not src.zeropp:
            kind = "Lightning" if src.front_end == LIGHTNING else "Fabric/Accelerate"
            raise ValueError(
                f"{src.path} is a {kind} checkpoint without zeropp metadata, so it does not say which "
                "Hugging Face model (architecture and config) it holds. Fix: export from the zeropp sharded "
                "checkpoint directory, or from a file written by `zeropp consolidate`."
            )
        raise ValueError(
            f"{src.path} has no Hugging Face model to export: the saved module(s) held no transformers "
            "PreTrainedModel. Fix: consolidate without --hf to get one full checkpoint file."
        )
    # One model: OUT is its folder. Several (e.g. PPO's actor and critic): one subfolder each,
    # named after the attribute path.
    for entry in entries:
        folder = out if len(entries) == 1 else out / (entry["prefix"].rstrip(".") or "model")
        _export_hf_model(src, entry, folder, dtype, max_shard_bytes)


# -- the entry point ------------------------------------------------------------------------


def _dtype(value: torch.dtype | str | None) -> torch.dtype | None:
    if value is None or isinstance(value, torch.dtype):
        dt = value
    else:
        name = _DTYPE_ALIASES.get(str(value).lower(), str(value).lower())
        if name not in DTYPES:
            raise ValueError(f"dtype={value!r} is invalid: must be one of {sorted(DTYPES)}. Fix: e.g. dtype='bf16'.")
        dt = DTYPES[name]
    if dt is not None and not dt.is_floating_point:
        raise ValueError(f"dtype={value!r} is invalid: weights are cast to a floating dtype. Fix: e.g. dtype='bf16'.")
    return dt


def _remove(path: Path) -> None:
    if path.is_dir() and not path.is_symlink():
        shutil.rmtree(path)
    elif path.exists() or path.is_symlink():
        path.unlink()


def consolidate(
    ckpt: str | os.PathLike[str],
    out: str | os.PathLike[str],
    *,
    hf: bool = False,
    dtype: torch.dtype | str | None = None,
    max_shard_bytes: int = DEFAULT_MAX_SHARD_BYTES,
    weights_only: bool = True,
    overwrite: bool = False,
    ema: bool = False,
) -> Path:
    """Consolidate the checkpoint ``ckpt`` into ``out``; returns ``out``.

    Args:
        ckpt: a zeropp sharded checkpoint directory of the Lightning strategy, the Fabric
            strategy or the Accelerate accelerator (its ``save_state`` folder or the
            ``zeropp_state`` in it); with ``hf=True`` also a one-file checkpoint that carries
            zeropp metadata (e.g. this function's own output).
        out: with ``hf=False`` the full checkpoint file to write: for Lightning the dict
            ``strategy="ddp"`` would have saved (``torch.load`` / ``load_from_checkpoint``);
            for Fabric and Accelerate their full format, ``{<module key>: state dict,
            <optimizer key>: optimizer state dict, ...}``.
            With ``hf=True`` a folder for ``from_pretrained``: config.json, safetensors
            weights, generation_config.json, the tokenizer files when the checkpoint has them.
        hf: export the LightningModule's Hugging Face model(s) instead.
        dtype: cast floating-point model weights ("fp32", "bf16", "fp16" or a torch.dtype);
            None keeps the stored dtypes. Optimizer state is never cast.
        max_shard_bytes: the largest safetensors file with ``hf=True``, in bytes (a single
            larger tensor gets a file of its own).
        weights_only: load the pickled parts with ``torch.load(weights_only=True)``. Pass False
            only for trusted files that hold other Python objects.
        overwrite: replace an existing ``out``.
        ema: write the weights averaged by the run's ``ShardedEMA`` callback instead of the
            trained ones (parameters it did not average, e.g. frozen ones, as saved).
    """
    src_path, out_path = Path(ckpt), Path(out)
    cast = _dtype(dtype)
    if isinstance(max_shard_bytes, bool) or not isinstance(max_shard_bytes, int) or max_shard_bytes <= 0:
        raise ValueError(f"max_shard_bytes={max_shard_bytes!r} is invalid: must be a positive int. Fix: e.g. 2**30.")
    if src_path.exists() and out_path.exists():
        src_real, out_real = src_path.resolve(), out_path.resolve()
        if out_real == src_real or out_real in src_real.parents:
            raise ValueError(
                f"out={out_path} is invalid: it is the checkpoint {src_path} or contains it. Fix: write elsewhere."
            )
    if (out_path.exists() or out_path.is_symlink()) and not overwrite:
        raise FileExistsError(
            f"{out_path} already exists. Fix: choose another path, or pass --overwrite (overwrite=True)."
        )

    src = open_checkpoint(src_path, weights_only=weights_only)
    if ema:
        src.use_ema()
    if not hf and isinstance(src, FullCheckpoint):
        raise ValueError(
            f"{src_path} is already a full (one-file) {src.front_end} checkpoint: there is nothing to "
            "consolidate. Fix: load it as it is, or pass --hf (hf=True) to export its Hugging Face model."
        )

    out_path.parent.mkdir(parents=True, exist_ok=True)
    tmp = out_path.with_name(f"{out_path.name}.tmp-{os.getpid()}")
    _remove(tmp)
    try:
        if hf:
            _write_hf(src, tmp, cast, max_shard_bytes)
        else:
            assert isinstance(src, ShardedCheckpoint)
            (_write_lightning if src.front_end == LIGHTNING else _write_objects)(src, tmp, cast)
        if out_path.exists() or out_path.is_symlink():
            _remove(out_path)
        os.replace(tmp, out_path)
    finally:
        _remove(tmp)
    return out_path


# -- command line ---------------------------------------------------------------------------

_UNITS = {"": 1, "b": 1, "kb": 10**3, "mb": 10**6, "gb": 10**9, "tb": 10**12,
          "kib": 2**10, "mib": 2**20, "gib": 2**30, "tib": 2**40}  # fmt: skip


def parse_size(text: str) -> int:
    """'2GB' -> 2_000_000_000, '2GiB' -> 2 * 2**30, '500MB', '1.5GB', '1000' (bytes): HF's units."""
    m = re.fullmatch(r"\s*(\d+(?:\.\d*)?)\s*([a-zA-Z]*)\s*", text)
    unit = m.group(2).lower() if m else None
    if m is None or unit not in _UNITS or int(float(m.group(1)) * _UNITS[unit]) <= 0:
        raise ValueError(f"size {text!r} is invalid: write a positive number and a unit, e.g. 2GB, 500MB, 2GiB.")
    return int(float(m.group(1)) * _UNITS[unit])


def main(argv: list[str] | None = None, prog: str | None = None) -> int:
    """The ``zeropp consolidate`` command: any error is one line ``error: ...`` and status 2."""
    return run(lambda args: _main(args, prog), sys.argv[1:] if argv is None else argv)


def _main(argv: list[str], prog: str | None = None) -> int:
    parser = build_parser(prog)
    args = parser.parse_args(argv)
    try:
        max_shard_bytes = parse_size(args.max_shard_size)
    except ValueError as err:
        parser.error(f"--max-shard-size: {err}")
    try:
        out = consolidate(
            args.ckpt,
            args.out,
            hf=args.hf,
            dtype=args.dtype,
            max_shard_bytes=max_shard_bytes,
            weights_only=not args.unsafe_load,
            overwrite=args.overwrite,
            ema=args.ema,
        )
    except UsageError:
        raise
    except (OSError, ValueError, RuntimeError, KeyError) as err:
        # Every error consolidate raises names the file and the fix: one line, whatever its type.
        message = " ".join(str(err).split())
        print(f"error: {message}", file=sys.stderr)
        return USAGE_EXIT
    files = [out] if out.is_file() else [p for p in out.rglob("*") if p.is_file()]
    total = sum(p.stat().st_size for p in files)
    print(f"wrote {out} ({len(files)} file{'s' * (len(files) != 1)}, {total / 2**20:.1f} MiB)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

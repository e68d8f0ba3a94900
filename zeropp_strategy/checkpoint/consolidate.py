"""Layer: checkpoint. Turn a zeropp sharded checkpoint into one full file, or into a Hugging Face folder.

    zeropp consolidate runs/ckpts/step=100 full.ckpt              # what strategy="ddp" would have saved
    zeropp consolidate fabric-ckpt full.ckpt                      # Fabric: what fabric.save under DDP saves
    zeropp consolidate ckpts/checkpoint_3 full.pt                 # Accelerate: its zeropp_state, as one file
    zeropp consolidate runs/ckpts/step=100 hf-model --hf --dtype bf16 --max-shard-size 5GB
    zeropp consolidate full.ckpt hf-model --hf                    # a full (one-file) checkpoint works too

    from zeropp_strategy.checkpoint.consolidate import consolidate
    consolidate("runs/ckpts/step=100", "full.ckpt")

One CPU process, no process group, no GPU: the sharded checkpoint is read with
``torch.distributed.checkpoint`` (DCP) in its single-process mode, one tensor at a time
(see [Note: one tensor at a time]). The output is written to a ``OUT.tmp-<nonce>`` sibling
and renamed into place when complete (checkpoint/atomic.py), so an interrupted run never
leaves a half-written OUT. A Hugging Face folder is written by checkpoint/hf.py, the one
exporter the RLHF modules' ``export_dir`` uses too; this file only hands it the weights
(read one tensor at a time) and the config the strategy recorded.

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

import os
import re
import sys
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch

from zeropp_strategy.checkpoint.atomic import atomic_torch_save
from zeropp_strategy.checkpoint.hf import (DEFAULT_MAX_SHARD_BYTES, HFModel, WeightReader, cast_floating,
                                           config_from_record, write_hf)
from zeropp_strategy.checkpoint.integrity import check_written
from zeropp_strategy.checkpoint.layout import LIGHTNING, FullCheckpoint, ShardedCheckpoint, open_checkpoint
from zeropp_strategy.checkpoint.sharded import CALLBACK_TENSORS_ID, QGZ_ERROR
from zeropp_strategy.checkpoint.sharded import TENSOR as TENSOR_MARK
from zeropp_strategy.errors import USAGE_EXIT, UsageError, run
from zeropp_strategy.parsers import CONSOLIDATE_DTYPES
from zeropp_strategy.parsers import consolidate_parser as build_parser

__all__ = ["consolidate", "parse_size", "main", "weights_dtype"]

CONSOLIDATED_FORMAT = "zeropp-consolidated"  # the "zeropp" block's format in a file we write

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
    state_dict = {fqn: cast_floating(src.read_model(fqn), dtype) for fqn in src.model_keys()}
    checkpoint: dict[str, Any] = {}
    for key, value in src.meta.items():
        if key == "optimizer_states":
            value = [_optimizer_state(src, i, entry) for i, entry in enumerate(value)]
        elif key == "callbacks" and isinstance(value, Mapping):
            value = {k: _callback_state(src, v) for k, v in value.items()}
        elif key == "zeropp":
            # Kept so that `--hf` works on this file too; the tokenizer folder does not come along.
            value = {**{k: v for k, v in value.items() if k != QGZ_ERROR}, "format": CONSOLIDATED_FORMAT,
                     "tokenizer_dir": None}
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
        checkpoint[module] = {k[len(prefix) :]: cast_floating(src.read_model(k), dtype) for k in src.model_keys(module)}
        count += len(checkpoint[module])
    owners = {}
    for key, entry in (src.meta.get("optimizers") or {}).items():
        checkpoint[key] = _optimizer_state(src, key, entry)
        owners[key] = entry["module"]
    checkpoint["zeropp"] = {**{k: v for k, v in src.zeropp.items() if k != QGZ_ERROR}, "format": CONSOLIDATED_FORMAT,
                            "modules": src.modules, "optimizers": owners}
    _save_checked(src, checkpoint, out, count)


def _save_checked(src: ShardedCheckpoint, checkpoint: dict[str, Any], out: Path, model_tensors: int) -> None:
    """Write ``out`` only when it holds every tensor of the checkpoint, model weights first of all."""
    check_written(out, f"model tensors (modules {src.modules})", model_tensors, len(src.model_keys()))
    check_written(out, "tensors of the checkpoint", len(src.consumed & set(src.entries)), len(src.entries))
    atomic_torch_save(checkpoint, out)


# -- (b) Hugging Face folder: the weights and the recorded config, for checkpoint/hf.py ------


def _hf_model(src: ShardedCheckpoint | FullCheckpoint, entry: Mapping[str, Any]) -> HFModel:
    """One recorded model (``hf_models`` in checkpoint/sharded.py), its weights read on demand."""
    prefix: str = entry["prefix"]
    config, model_cls = config_from_record(entry.get("architecture"), entry["config"])
    keys = {fqn[len(prefix) :]: fqn for fqn in src.model_keys() if fqn.startswith(prefix)}
    weights = WeightReader({name: src.model_spec(fqn) for name, fqn in keys.items()}, lambda n: src.read_model(keys[n]))
    tokenizer = src.tokenizer_dir if src.tokenizer_dir is not None and src.tokenizer_dir.is_dir() else None
    return HFModel(weights=weights, config=config, model_cls=model_cls, tokenizer=tokenizer,
                   generation_config=entry.get("generation_config"),  # the run's own, when recorded
                   source=f"{src.path} under the prefix {prefix!r}")


def _write_hf(src: ShardedCheckpoint | FullCheckpoint, out: Path, dtype: torch.dtype | None, max_shard_bytes: int,
              overwrite: bool) -> None:
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
    models = {entry["prefix"].rstrip(".") or "model": _hf_model(src, entry) for entry in entries}
    one = next(iter(models.values())) if len(models) == 1 else models
    write_hf(out, one, dtype=dtype, max_shard_bytes=max_shard_bytes, overwrite=overwrite)


# -- the entry point ------------------------------------------------------------------------


def weights_dtype(value: torch.dtype | str | None, field: str = "dtype") -> torch.dtype | None:
    """A floating dtype for weights from a torch dtype or a name (``bf16``/``bfloat16``,
    ``fp16``/``float16``/``half``, ``fp32``/``float32``/``float``); ``None`` and ``"auto"``
    (TRL's and transformers' word for the checkpoint's own) give ``None``. Anything else
    raises one line naming ``field``, the value and the fix."""
    if isinstance(value, str) and value.lower() == "auto":
        return None
    if value is None or isinstance(value, torch.dtype):
        dt = value
    else:
        name = _DTYPE_ALIASES.get(str(value).lower(), str(value).lower())
        if name not in DTYPES:
            raise ValueError(f"{field}={value!r} is invalid: must be one of {sorted(DTYPES)} (or their torch "
                             f"names, e.g. 'bfloat16'). Fix: e.g. {field}='bf16'.")
        dt = DTYPES[name]
    if dt is not None and not dt.is_floating_point:
        raise ValueError(f"{field}={value!r} is invalid: weights are cast to a floating dtype. Fix: e.g. {field}='bf16'.")
    return dt


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
    cast = weights_dtype(dtype)
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

    if hf:
        _write_hf(src, out_path, cast, max_shard_bytes, overwrite)
    else:
        assert isinstance(src, ShardedCheckpoint)
        (_write_lightning if src.front_end == LIGHTNING else _write_objects)(src, out_path, cast)
    return out_path


# -- command line ---------------------------------------------------------------------------

_UNITS = {"": 1, "b": 1, "kb": 10**3, "mb": 10**6, "gb": 10**9, "tb": 10**12, "pb": 10**15,
          "kib": 2**10, "mib": 2**20, "gib": 2**30, "tib": 2**40, "pib": 2**50}  # fmt: skip


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
    size = next(f"{total / 2**e:.1f} {unit}" for e, unit in ((30, "GiB"), (20, "MiB"), (10, "KiB"), (0, "bytes"))
                if total >= 2**e or e == 0)
    print(f"wrote {out} ({len(files)} file{'s' * (len(files) != 1)}, {size})")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

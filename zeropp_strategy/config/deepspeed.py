"""Layer: plan (config). DeepSpeed JSON to ``ZeroConfig``: which ``zero_optimization`` keys
map to which fields (sizes in elements become bytes), which top-level settings live
elsewhere with Lightning, and one ``ZeroConfigWarning`` listing everything ignored."""

from __future__ import annotations

import numbers
import re
import warnings
from collections.abc import Mapping
from typing import Any



from zeropp_strategy.config.checks import (
    _DS_COMM_DTYPES,
    _DS_TOP_LEVEL_HINTS,
    _DS_TOP_LEVEL_KEYS,
    ZeroConfigWarning,
    _invalid,
)


_DS_ZERO_KEYS = {  # zero_optimization key -> (ZeroConfig field, kind); "elems" sizes become bytes
    "stage": ("stage", "int"),
    "zero_quantized_weights": ("quantized_weights", "value"),
    "zero_hpz_partition_size": ("hpz_partition_size", "int"),
    "zero_quantized_gradients": ("quantized_gradients", "value"),
    "zero_quantized_nontrainable_weights": ("quantize_frozen_weights", "value"),
    "reduce_bucket_size": ("reduce_bucket_bytes", "elems"),
    "allgather_bucket_size": ("allgather_bucket_bytes", "elems"),
}
_DS_OFFLOAD_KEYS = {  # zero_optimization.offload_{optimizer,param} key -> (OffloadConfig field, kind)
    "device": ("device", "value"),
    "nvme_path": ("nvme_path", "value"),
    "pin_memory": ("pin_memory", "value"),
    "buffer_count": ("buffer_count", "int"),
    "buffer_size": ("buffer_bytes", "elems"),
}
_DS_LOCO_KEYS = {  # zero_optimization.zeropp_loco_param key -> (ZeroConfig field, kind); the block turns it on
    "err_beta": ("gradient_error_beta", "value"),
    "reset_T": ("gradient_error_reset_steps", "int"),
}
_DS_SAVE_KEYS = ("stage3_gather_16bit_weights_on_model_save", "gather_16bit_weights_on_model_save")
_TRUE = (True, "true", "True")


def _looks_like_deepspeed(d: Mapping[str, Any], fields: tuple[str, ...]) -> bool:
    """Whether ``d`` (keys of a config file) is a DeepSpeed config rather than ours
    (``fields``: ZeroConfig's field names)."""
    # "activation_checkpointing" is both a DeepSpeed block (a dict) and our bool field.
    return any(k in _DS_TOP_LEVEL_KEYS and k not in fields for k in d) or isinstance(
        d.get("activation_checkpointing"), Mapping)


def _ds_int(key: str, value: object, source: str) -> int:
    """5e8, "5e8", 500000000.0 -> 500000000; anything that is not a whole number is an error."""
    number = value
    if isinstance(value, str):
        try:
            number = float(value)
        except ValueError:
            pass
    if isinstance(number, float) and number.is_integer():
        return int(number)
    if isinstance(number, numbers.Integral) and not isinstance(number, bool):
        return int(number)
    _invalid(f"ZeroConfig.from_deepspeed: {source}: {key}", value, "must be a whole number",
             'write an integer such as 500000000 (or 5e8), or "auto" for our default')


def _ds_block(d: Mapping[str, Any], key: str, source: str) -> Mapping[str, Any]:
    block = d.get(key)
    if block is not None and not isinstance(block, Mapping):
        _invalid(f"ZeroConfig.from_deepspeed: {source}: {key}", block, "must be a JSON object",
                 f'write "{key}": {{...}}', TypeError)
    return block or {}


# [Note: DeepSpeed sizes] DeepSpeed counts bucket and buffer sizes in elements of the
# communication / parameter dtype; we count bytes. A size converts at 2 bytes per element when
# bf16 or fp16 is enabled, else at 4 (fp32), so the buffers keep the size DeepSpeed gave them.
def _from_deepspeed(cls: type[Any], d: Mapping[str, Any], source: str, *, warn: bool,
                    stacklevel: int) -> Any:
    half = any(_ds_block(d, k, source).get("enabled") in _TRUE for k in ("bf16", "fp16"))
    elem_bytes = 2 if half else 4  # [Note: DeepSpeed sizes]
    kwargs: dict[str, Any] = {}
    origin: dict[str, str] = {}  # ZeroConfig field (dotted) -> DeepSpeed key, for error messages
    ignored: list[str] = [k for k in d if k not in ("zero_optimization", "communication_data_type")]

    def take(table: dict[str, tuple[str, str]], block: Mapping[str, Any], prefix: str, out: dict[str, Any]) -> None:
        for key, value in block.items():
            if key not in table:
                ignored.append(f"{prefix}.{key}")
            elif value != "auto":
                name, kind = table[key]
                if kind != "value":
                    value = _ds_int(f"{prefix}.{key}", value, source) * (elem_bytes if kind == "elems" else 1)
                out[name] = value
                origin[(prefix.split(".", 1)[1] + "." if "." in prefix else "") + name] = f"{prefix}.{key}"

    zero = _ds_block(d, "zero_optimization", source)
    stage = zero.get("stage", 0)
    if stage != "auto" and _ds_int("zero_optimization.stage", stage, source) == 0:
        origin_note = "from zero_optimization.stage" if "stage" in zero else (
            "zero_optimization.stage is missing, and DeepSpeed's default is 0")
        _invalid("ZeroConfig.stage", stage, f"stage 0 is plain data parallel; use strategy='ddp' ({origin_note} "
                 f"in {source})", "use strategy='ddp' for plain data parallel, or set zero_optimization.stage to 1, 2 or 3")
    blocks = ("offload_optimizer", "offload_param", "zeropp_loco_param", *_DS_SAVE_KEYS)
    take(_DS_ZERO_KEYS, {k: v for k, v in zero.items() if k not in blocks}, "zero_optimization", kwargs)
    for key in ("offload_optimizer", "offload_param"):
        if block := _ds_block(zero, key, f"{source}: zero_optimization"):
            take(_DS_OFFLOAD_KEYS, block, f"zero_optimization.{key}", sub := {})
            kwargs[key] = sub
    if zero.get("zeropp_loco_param") is not None:  # DeepSpeed's LoCo: error feedback for qgZ
        loco = _ds_block(zero, "zeropp_loco_param", f"{source}: zero_optimization")
        take(_DS_LOCO_KEYS, loco, "zero_optimization.zeropp_loco_param", kwargs)
        for key, (name, _) in _DS_LOCO_KEYS.items():  # errors name the DeepSpeed key, not the block's field
            origin[name] = f"zero_optimization.zeropp_loco_param.{key}"
        for name in ("gradient_error_feedback", "gradient_error_feedback_intra"):  # DeepSpeed feeds back both hops
            kwargs[name] = True
            origin[name] = "zero_optimization.zeropp_loco_param (set zero_quantized_gradients: true)"
    if any(zero.get(k) in _TRUE for k in _DS_SAVE_KEYS):
        kwargs["state_dict_type"] = "full"
    comm_dtype = d.get("communication_data_type")
    if comm_dtype is not None and comm_dtype != "auto":
        if str(comm_dtype).lower() not in _DS_COMM_DTYPES:
            _invalid(f"ZeroConfig.from_deepspeed: {source}: communication_data_type", comm_dtype,
                     f"must be one of {', '.join(sorted(_DS_COMM_DTYPES))}", 'write "bf16", "fp16" or "fp32"')
        kwargs["reduce_dtype"] = _DS_COMM_DTYPES[str(comm_dtype).lower()]
        origin["reduce_dtype"] = "communication_data_type"

    try:
        cfg = cls(**kwargs)
    except (ValueError, TypeError) as e:  # point at the DeepSpeed key the bad value came from
        m = re.match(r"ZeroConfig\.([\w.]+)=", str(e))
        ds_key = origin.get(m.group(1)) if m else None
        raise type(e)(f"{e} (from {ds_key or 'the DeepSpeed config'} in {source})") from None
    if warn and ignored:
        lines = "\n".join(f"  {k}" + (f": {_DS_TOP_LEVEL_HINTS[k]}" if k in _DS_TOP_LEVEL_HINTS else "")
                          for k in ignored)
        warnings.warn(f"ZeroConfig.from_deepspeed({source}) ignored {len(ignored)} DeepSpeed setting(s) that "
                      f"ZeroConfig does not use:\n{lines}", ZeroConfigWarning, stacklevel=stacklevel)
    return cfg


"""Layer: plan (config). The validators behind every ``ZeroConfig`` field: each raises
naming the field, the value, why it is wrong and the fix (TypeError for a wrong type,
ValueError for a bad value)."""

from __future__ import annotations

import difflib
import math
import numbers
from collections.abc import Mapping
from typing import Any, NoReturn




class ZeroConfigWarning(UserWarning):
    """A setting was read but not used (e.g. DeepSpeed keys that have no ZeroConfig field)."""


# -- checking helpers: every user error goes through _invalid, so all share one form ----------


REDUCE_DTYPE_NAMES = ("fp32", "bf16", "fp16")
"""``ZeroConfig.reduce_dtype`` values; the engine maps them to torch dtypes."""
_DS_COMM_DTYPES = {"fp32": "fp32", "float32": "fp32", "bf16": "bf16", "bfloat16": "bf16", "fp16": "fp16",
                   "float16": "fp16", "half": "fp16"}


def _invalid(where: str, value: object, why: str, fix: str, exc: type[Exception] = ValueError) -> NoReturn:
    end = "" if fix.endswith((".", "?")) else "."
    raise exc(f"{where}={value!r} is invalid: {why}. Fix: {fix}{end}")


def _int(where: str, value: object, fix: str) -> int:
    # bool is an int subclass, but True is never a sensible count: reject it.
    if isinstance(value, bool) or not isinstance(value, numbers.Integral):
        _invalid(where, value, f"must be an int, not {type(value).__name__}", fix, TypeError)
    return int(value)


def _bool(where: str, value: object, fix: str) -> bool:
    if not isinstance(value, bool):
        _invalid(where, value, f"must be True or False, not {type(value).__name__}", fix, TypeError)
    return value


def _at_least(where: str, value: object, low: int, fix: str) -> int:
    n = _int(where, value, fix)
    if n < low:
        _invalid(where, value, f"must be >= {low}", fix)
    return n


def _seconds(where: str, value: object, fix: str) -> float:
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        _invalid(where, value, f"must be a number of seconds, not {type(value).__name__}", fix, TypeError)
    if not math.isfinite(float(value)) or float(value) < 0:  # type: ignore[arg-type]
        _invalid(where, value, "must be finite and >= 0", fix)
    return float(value)  # type: ignore[arg-type]


def _block_elems(where: str, value: object) -> int:
    fix = "use a power of two between 32 and 65536, e.g. 256"
    n = _int(where, value, fix)
    if not (32 <= n <= 65536 and n & (n - 1) == 0):
        _invalid(where, value, "must be a power of two between 32 and 65536 (one fp32 scale per block)", fix)
    return n


def _check_keys(d: Mapping[Any, Any], valid: tuple[str, ...], where: str) -> None:
    """Reject unknown keys, suggesting the closest valid name: a typo must not pass silently."""
    for key, value in d.items():
        if not isinstance(key, str):
            _invalid(f"{where}[{key!r}]", value, "keys must be field names (str)", f"use one of: {', '.join(valid)}",
                     TypeError)
        if key in valid:
            continue
        close = difflib.get_close_matches(key, valid, n=1)
        if where == "ZeroConfig" and key in _DS_TOP_LEVEL_KEYS:
            fix = "this looks like a DeepSpeed config; load it with ZeroConfig.from_deepspeed(...)"
        else:
            fix = f"did you mean {close[0]!r}?" if close else f"use one of: {', '.join(valid)}"
        _invalid(f"{where}.{key}", value, "no such field", fix)


#: Environment variable that supplies ``nvme_path`` when an NVMe offload block names none.


_DS_TOP_LEVEL_HINTS = {  # where the setting lives with Lightning instead
    "gradient_clipping": "use Trainer(gradient_clip_val=...)",
    "gradient_accumulation_steps": "use Trainer(accumulate_grad_batches=...)",
    "bf16": "use Trainer(precision='bf16-mixed')",
    "fp16": "use Trainer(precision='16-mixed')",
    "amp": "use Trainer(precision=...)",
    "train_micro_batch_size_per_gpu": "set your DataLoader batch_size",
    "train_batch_size": "it is DataLoader batch_size x Trainer(accumulate_grad_batches) x world size",
    "optimizer": "build it in LightningModule.configure_optimizers()",
    "scheduler": "build it in LightningModule.configure_optimizers()",
    "steps_per_print": "use Trainer(log_every_n_steps=...)",
    "activation_checkpointing": "use ZeroConfig(activation_checkpointing=True)",
}
_DS_TOP_LEVEL_KEYS = frozenset(_DS_TOP_LEVEL_HINTS) | {
    "zero_optimization", "wall_clock_breakdown", "zero_allow_untested_optimizer", "communication_data_type",
    "prescale_gradients", "gradient_predivide_factor", "sparse_gradients", "flops_profiler", "tensorboard",
    "wandb", "csv_monitor", "comms_logger", "aio", "elasticity", "checkpoint", "data_types",
    "zero_force_ds_cpu_optimizer", "memory_breakdown", "dump_state",
}

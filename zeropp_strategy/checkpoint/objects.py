"""Layer: checkpoint. Checkpoints of named modules and optimizers, for the front-ends without Lightning's
checkpoint dict (Fabric's ``state`` dict, Accelerate's ``save_state``).

Same two formats as the Lightning strategy (docs/checkpointing.md), with several
modules allowed:

- **sharded**: a directory every rank writes with DCP: ``{<module key>: {fqn: tensor},
  "optim": {<optimizer key>: {fqn: {state key: tensor}}}}`` plus ``zeropp_meta.pt`` (rank
  0) with the other entries, each optimizer's param groups by parameter name, and which
  module each optimizer belongs to. Published atomically, loadable at any stage and
  rank count.
- **full**: one file from rank 0: ``{<module key>: module state dict, <optimizer key>:
  optimizer state dict, ...other entries}``, the layout Fabric's DDP strategy saves.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

from torch import Tensor
from torch.nn import Module
from torch.optim import Optimizer

from zeropp_strategy.checkpoint.atomic import new_nonce, safe_load
from zeropp_strategy.checkpoint.comm_state import QGZ_ERROR, error_feedback_tensors, load_error_feedback
from zeropp_strategy.checkpoint.protocol import open_sharded, write_full, write_sharded
from zeropp_strategy.checkpoint.sharded import (
    FORMAT,
    VERSION,
    _inner,
    _param_names,
    hf_models,
    load_model,
    load_optimizer,
    model_tensors,
    optimizer_tensors_and_meta,
)
from zeropp_strategy.engine.state import (
    full_model_state,
    full_optimizer_state,
    load_full_model_state,
    load_full_optimizer_state,
)

OPTIM = "optim"  # DCP key of optimizer tensors, as in the Lightning format
ZEROPP = "zeropp"  # the layout marker: format, version, front end, modules, optimizers
FULL_FORMAT = "zeropp-full"


def owner_of(optimizer: Optimizer, modules: Mapping[str, Module], unwrap: Callable[[Module], Module]) -> str:
    """The key of the module whose parameters the optimizer holds."""
    ids = {id(p) for g in _inner(optimizer).param_groups for p in g["params"]}
    for key, module in modules.items():  # stage 1's shards are named through their full params
        if ids <= set(_param_names(unwrap(module), optimizer)):
            return key
    raise ValueError(
        "an optimizer's parameters do not all belong to one module being saved. Fix: save each optimizer "
        "together with the module it optimizes, e.g. {'model': model, 'optimizer': optimizer}."
    )


def save_objects(
    path: Path,
    modules: Mapping[str, Module],
    optimizers: Mapping[str, Optimizer],
    rest: Mapping[str, Any],
    *,
    full: bool,
    rank_zero: bool,
    barrier: Callable[[], None],
    broadcast: Callable[[Any], Any],
    unwrap: Callable[[Module], Module],
    ledger: Any = None,
    info: Mapping[str, Any] | None = None,
) -> None:
    """Collective: every rank calls it with the same keys. A failed write (a full disk)
    raises on every rank and publishes nothing."""
    nonce = broadcast(new_nonce())
    zeropp = {"format": FULL_FORMAT if full else FORMAT, "version": VERSION, **(info or {}),
              "hf": [{**entry, "prefix": f"{key}.{entry['prefix']}"}
                     for key, module in modules.items() for entry in hf_models(unwrap(module))]}
    if full:
        out: dict[str, Any] = {}
        for key, module in modules.items():  # collectives: every rank, same order
            out[key] = full_model_state(unwrap(module), keep=rank_zero, ledger=ledger)
        for key, opt in optimizers.items():
            out[key] = full_optimizer_state(opt, keep=rank_zero, ledger=ledger)
        # The layout marker (which entries are modules, which optimizers) lets `zeropp consolidate`
        # recognise the file; load_objects drops it again.
        zeropp.update(modules=list(modules), optimizers={k: owner_of(o, modules, unwrap) for k, o in optimizers.items()})
        write_full(path, {**rest, **out, ZEROPP: zeropp}, barrier=barrier)
        return
    tensors: dict[str, Any] = {key: model_tensors(unwrap(m)) for key, m in modules.items()}
    optim_tensors: dict[str, Any] = {}
    optim_meta: dict[str, Any] = {}
    for key, opt in optimizers.items():
        owner = owner_of(opt, modules, unwrap)
        optim_tensors[key], optim_meta[key] = optimizer_tensors_and_meta(unwrap(modules[owner]), opt)
        optim_meta[key]["module"] = owner
    tensors[OPTIM] = optim_tensors
    for key, module in modules.items():  # [Note: error feedback in checkpoints]
        if (feedback := error_feedback_tensors(unwrap(module))) is not None:
            tensors.setdefault(QGZ_ERROR, {})[key] = feedback[0]
            zeropp.setdefault(QGZ_ERROR, {})[key] = feedback[1]
    meta = {"state": dict(rest), "optimizers": optim_meta, "modules": list(modules), ZEROPP: zeropp}
    write_sharded(path, nonce, tensors, meta, rank_zero=rank_zero, barrier=barrier)


def load_objects(
    path: Path,
    modules: Mapping[str, Module],
    optimizers: Mapping[str, Optimizer],
    *,
    strict: bool,
    weights_only: bool | None,
    unwrap: Callable[[Module], Module],
) -> dict[str, Any]:
    """Load modules and optimizers in place from either format; returns the other entries."""
    if path.is_dir():
        meta = open_sharded(path, weights_only)
        for key, module in modules.items():
            if key not in meta.get("modules", []):
                raise KeyError(f"checkpoint {path} has no module {key!r} (it has {meta.get('modules')}).")
            load_model(unwrap(module), path, strict=strict, key=key)
            load_error_feedback(unwrap(module), path, meta.get(ZEROPP, {}).get(QGZ_ERROR, {}).get(key), key=key)
        for key, opt in optimizers.items():
            entry = meta.get("optimizers", {}).get(key)
            if entry is None:
                if strict:
                    raise KeyError(f"checkpoint {path} has no optimizer {key!r}. Fix: pass strict=False.")
                continue
            owner = modules.get(entry["module"])
            if owner is None:
                raise KeyError(
                    f"optimizer {key!r} belongs to module {entry['module']!r}, which is not among those loaded. "
                    f"Fix: load {{'{entry['module']}': model, '{key}': optimizer}} together."
                )
            load_optimizer(unwrap(owner), opt, path, key, entry)
        return dict(meta.get("state", {}))
    if not path.is_file():
        raise FileNotFoundError(f"checkpoint {path} does not exist. Fix: check the path.")
    checkpoint = safe_load(path, weights_only)
    checkpoint.pop(ZEROPP, None)
    for key, module in modules.items():
        load_error_feedback(unwrap(module), None, None, key=key)
        if key in checkpoint:
            load_full_model_state(unwrap(module), checkpoint.pop(key), strict=strict)
        elif strict:
            raise KeyError(f"checkpoint {path} has no entry {key!r}. Fix: save it, or pass strict=False.")
    for key, opt in optimizers.items():
        if key in checkpoint:
            load_full_optimizer_state(opt, checkpoint.pop(key))
        elif strict:
            raise KeyError(f"checkpoint {path} has no entry {key!r}. Fix: save it, or pass strict=False.")
    return checkpoint


def split_state(state: Mapping[str, Any]) -> tuple[dict[str, Module], dict[str, Optimizer], dict[str, Any]]:
    """(modules, optimizers, everything else) of a Fabric-style state dict."""
    modules = {k: v for k, v in state.items() if isinstance(v, Module)}
    optimizers = {k: v for k, v in state.items() if isinstance(v, Optimizer)}
    rest = {k: v for k, v in state.items() if k not in modules and k not in optimizers}
    return modules, optimizers, rest


def stateful(value: Any) -> bool:
    return hasattr(value, "state_dict") and hasattr(value, "load_state_dict") and not isinstance(value, (dict, Tensor))

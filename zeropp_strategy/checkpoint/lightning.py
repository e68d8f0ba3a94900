"""Layer: checkpoint. Lightning's checkpoint layout on the one protocol (``protocol.py``).

Lightning hands a strategy one checkpoint dict (``state_dict``, ``optimizer_states``,
``callbacks``, loop counters, hyper-parameters); these functions write and read it in our
two formats without importing Lightning (the dict is plain data):

- **sharded** ([Note: sharded checkpoint format v1] in sharded.py): the DCP tensors are
  ``{"model": {fqn: shard}, "optim": {"<i>": ...}, "callbacks": {"<i>": ...}}``, and
  ``zeropp_meta.pt`` is Lightning's dict without those tensors, plus our ``zeropp`` block.
  A tokenizer the module holds is saved beside them (``tokenizer/``).
- **full**: one file, the dict as ``strategy="ddp"`` writes it, plus the ``zeropp`` block
  (``strategy="ddp"`` ignores unknown top-level keys; ``zeropp consolidate --hf`` reads it).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

from torch import nn
from torch.optim import Optimizer

from zeropp_strategy.checkpoint.atomic import safe_load
from zeropp_strategy.checkpoint.comm_state import QGZ_ERROR, error_feedback_tensors, load_error_feedback
from zeropp_strategy.checkpoint.protocol import move_callback_tensors, open_sharded, write_full, write_sharded
from zeropp_strategy.checkpoint.sharded import (
    FORMAT,
    VERSION,
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

__all__ = ["TENSORS", "info", "load_model_state", "load_optimizer_states", "model_state", "open_checkpoint",
           "optimizer_state", "save"]

TENSORS = "__zeropp_tensors__"  # optimizer_state() -> save() hand-off key


def _tokenizer(module: nn.Module) -> Any:
    tokenizer = getattr(module, "tokenizer", None)
    return tokenizer if callable(getattr(tokenizer, "save_pretrained", None)) else None


def info(module: nn.Module, *, stage: int, world_size: int, config: Mapping[str, Any]) -> dict[str, Any]:
    """The ``zeropp`` block of a sharded Lightning checkpoint."""
    return {
        "format": FORMAT,
        "version": VERSION,
        "stage": stage,
        "world_size": world_size,
        "config": dict(config),
        "hf": hf_models(module),
        "tokenizer_dir": "tokenizer" if _tokenizer(module) is not None else None,
    }


def model_state(module: nn.Module, *, sharded: bool, keep: bool, ledger: Any) -> dict[str, Any]:
    """``state_dict`` of the checkpoint: this rank's shards (sharded), or the full state
    gathered tensor by tensor (complete where ``keep``, empty elsewhere)."""
    if sharded:
        return model_tensors(module)
    return full_model_state(module, keep=keep, ledger=ledger)


def optimizer_state(module: nn.Module, optimizer: Optimizer, *, sharded: bool, keep: bool, ledger: Any) -> dict[str, Any]:
    """One entry of ``optimizer_states``; sharded: the DCP tensors under ``TENSORS``."""
    if sharded:
        tensors, meta = optimizer_tensors_and_meta(module, optimizer)
        return {TENSORS: tensors, **meta}
    return full_optimizer_state(optimizer, keep=keep, ledger=ledger)


def save(
    path: Path,
    checkpoint: Mapping[str, Any],
    module: nn.Module,
    *,
    nonce: str,
    full: bool,
    zeropp: Mapping[str, Any],
    rank_zero: bool,
    barrier: Callable[[], None],
) -> None:
    """Collective: write Lightning's ``checkpoint`` dict to ``path`` in the format whose
    pieces ``model_state``/``optimizer_state`` produced (``full``)."""
    if full or not isinstance(checkpoint.get("state_dict"), dict):
        write_full(path, {**checkpoint, "zeropp": {**zeropp, "format": "zeropp-full", "tokenizer_dir": None}},
                   barrier=barrier)
        return
    checkpoint = dict(checkpoint)
    tensors: dict[str, Any] = {"model": checkpoint.pop("state_dict")}
    optimizer_states = checkpoint.pop("optimizer_states", None)
    if optimizer_states is not None:
        tensors["optim"] = {str(i): dict(s)[TENSORS] for i, s in enumerate(optimizer_states)}
        checkpoint["optimizer_states"] = [{k: v for k, v in s.items() if k != TENSORS} for s in optimizer_states]
    moved = move_callback_tensors(checkpoint.get("callbacks"))
    if moved:
        tensors["callbacks"] = moved
    checkpoint["zeropp"] = dict(zeropp)
    if (feedback := error_feedback_tensors(module)) is not None:  # [Note: error feedback in checkpoints]
        tensors[QGZ_ERROR] = {"model": feedback[0]}
        checkpoint["zeropp"][QGZ_ERROR] = {"model": feedback[1]}
    tokenizer = _tokenizer(module)

    def extra(tmp: Path) -> None:
        if tokenizer is not None:
            tokenizer.save_pretrained(str(tmp / "tokenizer"))

    write_sharded(path, nonce, tensors, checkpoint, rank_zero=rank_zero, barrier=barrier, extra=extra)


def open_checkpoint(path: Path, weights_only: bool | None) -> tuple[dict[str, Any], Path | None]:
    """(Lightning's checkpoint dict, the sharded directory or None for a full file)."""
    if path.is_dir():
        return open_sharded(path, weights_only), path
    if not path.is_file():
        raise FileNotFoundError(f"checkpoint {path} does not exist. Fix: check ckpt_path.")
    return safe_load(path, weights_only), None


def load_model_state(module: nn.Module, checkpoint: Mapping[str, Any], sharded: Path | None, *, strict: bool) -> None:
    if sharded is not None:
        load_model(module, sharded, strict=strict)
    else:
        load_full_model_state(module, checkpoint["state_dict"], strict=strict)
    load_error_feedback(module, sharded, checkpoint.get("zeropp", {}).get(QGZ_ERROR, {}).get("model"), key="model")


def load_optimizer_states(module: nn.Module, optimizers: list[Optimizer], checkpoint: Mapping[str, Any],
                          sharded: Path | None) -> None:
    states = checkpoint.get("optimizer_states")
    if not states:
        return
    if len(states) != len(optimizers):
        raise ValueError(
            f"checkpoint has {len(states)} optimizer states, this run configures {len(optimizers)}. "
            "Fix: return the same optimizers from configure_optimizers."
        )
    for index, (optimizer, state) in enumerate(zip(optimizers, states)):
        if sharded is not None:
            load_optimizer(module, optimizer, sharded, index, state)
        else:
            load_full_optimizer_state(optimizer, state)

"""Layer: checkpoint. qgZ's kept quantization errors ([Note: qgZ error feedback]) in
sharded checkpoints, so that a resumed run continues with the errors the interrupted one
had: its next steps are the uninterrupted run's.

[Note: error feedback in checkpoints]
Each rank's errors are its own (the quantization residue of its node's partial sums), so
each rank writes them under its own DCP keys, ``qgz_error.<key>.rank<r>.<i>`` (``<key>``:
the module's key in the checkpoint, ``<i>``: the FSDP group in module order), and the
``zeropp`` metadata block records the layout they belong to (world size, nodes, ranks per
node) and each group's count of reductions (which sets the next periodic reset). On load,
the same layout reads them back; any other layout (another world size or node split),
a checkpoint without them (saved with feedback off, or in the one-file "full" format,
which rank 0 alone writes), or feedback off now, leaves the errors at zero, as at the
start of a run or a periodic reset, and says so once in the log. The reduction counts
are restored either way when the number of groups matches.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from zeropp_strategy.checkpoint.sharded import QGZ_ERROR, _load, _metadata
from zeropp_strategy.engine.fsdp import error_feedbacks

__all__ = ["QGZ_ERROR", "error_feedback_tensors", "load_error_feedback"]

log = logging.getLogger(__name__)


def _layout(feedbacks: list[Any]) -> list[int]:
    nodes, per_node = feedbacks[0].layout
    return [dist.get_world_size() if dist.is_initialized() else 1, nodes, per_node]


def error_feedback_tensors(module: nn.Module) -> tuple[dict[str, torch.Tensor], dict[str, Any]] | None:
    """This rank's kept errors of ``module`` (DCP tensors, keyed ``rank<r>.<i>``) and the
    metadata every rank agrees on; None when the module has no error feedback."""
    feedbacks = error_feedbacks(module)
    if not feedbacks:
        return None
    rank = dist.get_rank() if dist.is_initialized() else 0
    tensors = {f"rank{rank}.{i}": f.error.detach().clone() for i, f in enumerate(feedbacks) if f.error is not None}
    meta = {"layout": _layout(feedbacks), "reductions": [f.reductions for f in feedbacks]}
    return tensors, meta


def load_error_feedback(module: nn.Module, directory: Path | None, meta: Mapping[str, Any] | None, *,
                        key: str) -> None:
    """Collective (every rank, same arguments): restore ``module``'s kept errors saved under
    ``key`` in the sharded checkpoint ``directory``; see [Note: error feedback in checkpoints]."""
    feedbacks = error_feedbacks(module)
    if not feedbacks:
        return
    why = None
    if directory is None:
        why = "the checkpoint is one full-format file, which does not hold them"
    elif meta is None:
        why = "the checkpoint was saved without error feedback"
    elif len(meta["reductions"]) != len(feedbacks):
        why = f"the checkpoint has {len(meta['reductions'])} groups with kept errors, this model {len(feedbacks)}"
    if why is None:
        assert meta is not None and directory is not None
        for feedback, count in zip(feedbacks, meta["reductions"], strict=True):
            feedback.reductions = int(count)
        saved_layout, layout = list(meta["layout"]), _layout(feedbacks)
        if saved_layout != layout:
            why = (f"they were kept for {saved_layout[0]} ranks as {saved_layout[1]} nodes x {saved_layout[2]}, "
                   f"this run has {layout[0]} as {layout[1]} x {layout[2]}")
    if why is not None:
        for feedback in feedbacks:
            feedback.error = None
        if not dist.is_initialized() or dist.get_rank() == 0:
            log.info("zeropp: qgZ error feedback starts from zero errors: %s.", why)
        return
    rank = dist.get_rank() if dist.is_initialized() else 0
    saved = _metadata(directory)
    targets: dict[str, torch.Tensor] = {}
    for i in range(len(feedbacks)):
        entry = saved.get(f"{QGZ_ERROR}.{key}.rank{rank}.{i}")
        if entry is not None:
            targets[f"rank{rank}.{i}"] = torch.empty(entry.size, dtype=entry.properties.dtype)
    _load({QGZ_ERROR: {key: targets}}, directory)
    for i, feedback in enumerate(feedbacks):
        feedback.error = targets.get(f"rank{rank}.{i}")

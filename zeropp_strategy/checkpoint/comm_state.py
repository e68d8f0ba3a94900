"""Layer: checkpoint. What the collectives keep from step to step, in sharded checkpoints:
qgZ's kept quantization errors of either hop ([Note: qgZ error feedback]) and qwZ's kept
weight rows ([Note: qwZ weight deltas]), so that a resumed run continues with the state the
interrupted one had: its next steps are the uninterrupted run's.

[Note: error feedback in checkpoints]
Each rank writes its own part of the kept state (the quantization residue of its node's
partial sums; of the weight rows, only its own shard's row: the same row is kept on every
node, so the checkpoint holds each once and a rank reads the others from its peers of the
same local index on load) under its own DCP keys,
``qgz_error.<key>.rank<r>.<i>`` (``<key>``: the module's key in the checkpoint, ``<i>``:
the kept state in ``kept_comm_states`` order: per FSDP group, the errors, then the weight
rows; the name is the one it had when errors were all there was), and the ``zeropp``
metadata block records the layout they belong to (world size, nodes, ranks per node),
each state's kind and count (reductions, which set the next periodic reset; gathers). On
load, the same layout and kinds read them back; any other layout (another world size or
node split), other kinds (a feature turned on or off), a checkpoint without them (saved
with these features off, or in the one-file "full" format, which rank 0 alone writes),
or features off now, starts them afresh: errors at zero, as at the start of a run or a
periodic reset, and weight rows from the next gather's shards; it says so once in the
log. The counts are restored when the number and kinds of states match.
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
from zeropp_strategy.comm.feedback import INTRA_FEEDBACK, ErrorFeedback
from zeropp_strategy.engine.fsdp import kept_comm_states

__all__ = ["QGZ_ERROR", "error_feedback_tensors", "load_error_feedback"]

log = logging.getLogger(__name__)


def _layout(states: list[Any]) -> list[int]:
    nodes, per_node = states[0].layout
    return [dist.get_world_size() if dist.is_initialized() else 1, nodes, per_node]


def error_feedback_tensors(module: nn.Module) -> tuple[dict[str, torch.Tensor], dict[str, Any]] | None:
    """This rank's kept comm state of ``module`` (DCP tensors, keyed ``rank<r>.<i>``) and the
    metadata every rank agrees on; None when the module keeps none."""
    states = kept_comm_states(module)
    if not states:
        return None
    rank = dist.get_rank() if dist.is_initialized() else 0
    parts = {f"rank{rank}.{i}": s.part(rank) for i, s in enumerate(states)}
    tensors = {k: v.detach().clone() for k, v in parts.items() if v is not None}
    meta = {"layout": _layout(states), "reductions": [s.count for s in states], "kinds": [s.name for s in states]}
    return tensors, meta


def load_error_feedback(module: nn.Module, directory: Path | None, meta: Mapping[str, Any] | None, *,
                        key: str) -> None:
    """Collective (every rank, same arguments): restore ``module``'s kept errors saved under
    ``key`` in the sharded checkpoint ``directory``; see [Note: error feedback in checkpoints]."""
    states = kept_comm_states(module)
    if not states:
        return
    why = None
    if directory is None:
        why = "the checkpoint is one full-format file, which does not hold them"
    elif meta is None:
        why = "the checkpoint was saved without them"
    elif len(meta["reductions"]) != len(states):
        why = f"the checkpoint has {len(meta['reductions'])} kept states, this model {len(states)}"
    elif meta.get("kinds", [ErrorFeedback.name] * len(states)) != [s.name for s in states]:  # older: errors only
        why = "the checkpoint's kept states are of other features (" + ", ".join(sorted(set(meta["kinds"]))) + ")"
    if why is None:
        assert meta is not None and directory is not None
        for state, count in zip(states, meta["reductions"], strict=True):
            state.count = int(count)
        saved_layout, layout = list(meta["layout"]), _layout(states)
        if saved_layout != layout:
            why = (f"they were kept for {saved_layout[0]} ranks as {saved_layout[1]} nodes x {saved_layout[2]}, "
                   f"this run has {layout[0]} as {layout[1]} x {layout[2]}")
    if why is not None:
        for state in states:
            state.kept = None
        if not dist.is_initialized() or dist.get_rank() == 0:
            afresh = {ErrorFeedback.name: "qgZ error feedback starts from zero errors",
                      INTRA_FEEDBACK: "qgZ intra-node error feedback starts from zero errors",
                      "qwZ weight deltas": "qwZ weight deltas start again from the 16-bit shards"}
            log.info("zeropp: %s: %s.", " and ".join(afresh[n] for n in sorted({s.name for s in states})), why)
        return
    rank = dist.get_rank() if dist.is_initialized() else 0
    saved = _metadata(directory)
    targets: dict[str, torch.Tensor] = {}
    for i, state in enumerate(states):  # a rank's parts, and for weight rows its peers' on the other nodes
        for source in state.sources(rank):
            entry = saved.get(f"{QGZ_ERROR}.{key}.rank{source}.{i}")
            if entry is not None:
                targets[f"rank{source}.{i}"] = torch.empty(entry.size, dtype=entry.properties.dtype)
    _load({QGZ_ERROR: {key: targets}}, directory)
    for i, state in enumerate(states):
        state.restore([targets.get(f"rank{source}.{i}") for source in state.sources(rank)])

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
load each kind is matched on its own: the j-th state of a kind reads the j-th saved one,
where the checkpoint holds as many of that kind as the model keeps, so turning one
feature on or off keeps the others' state. A kind the checkpoint lacks or holds in
another number, any other layout (another world size or node split, for every kind), or
a checkpoint without them (saved with these features off, or in the one-file "full"
format, which rank 0 alone writes) starts afresh: errors at zero, as at the start of a
run or a periodic reset, and weight rows from the next gather's shards; rank 0 says so in
one INFO line per reason. A matched kind's counts are restored, in another layout too.
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
from zeropp_strategy.comm.zeropp import WeightDeltas
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


_AFRESH = {ErrorFeedback.name: "qgZ error feedback starts from zero errors",
           INTRA_FEEDBACK: "qgZ intra-node error feedback starts from zero errors",
           WeightDeltas.name: "qwZ weight deltas start again from the 16-bit shards"}


def _saved_index(saved_kinds: list[str], states: list[Any]) -> tuple[list[int | None], dict[int, str]]:
    """For each state, the index of its saved counterpart: the j-th state of a kind takes the
    j-th saved one of that kind, where the checkpoint holds as many of the kind as the model
    keeps; otherwise None, with why (by state index)."""
    found: list[int | None] = [None] * len(states)
    why: dict[int, str] = {}
    for kind in dict.fromkeys(s.name for s in states):
        mine = [i for i, s in enumerate(states) if s.name == kind]
        theirs = [i for i, k in enumerate(saved_kinds) if k == kind]
        if len(mine) == len(theirs):
            for i, j in zip(mine, theirs, strict=True):
                found[i] = j
            continue
        reason = ("the checkpoint was saved without them" if not theirs else
                  f"the checkpoint has {len(theirs)} of them, this model {len(mine)}")
        why.update(dict.fromkeys(mine, reason))
    return found, why


def load_error_feedback(module: nn.Module, directory: Path | None, meta: Mapping[str, Any] | None, *,
                        key: str) -> None:
    """Collective (every rank, same arguments): restore ``module``'s kept errors saved under
    ``key`` in the sharded checkpoint ``directory``; see [Note: error feedback in checkpoints]."""
    states = kept_comm_states(module)
    if not states:
        return
    why: dict[int, str] = {}
    found: list[int | None] = [None] * len(states)
    if directory is None:
        why = dict.fromkeys(range(len(states)), "the checkpoint is one full-format file, which does not hold them")
    elif meta is None:
        why = dict.fromkeys(range(len(states)), "the checkpoint was saved without them")
    else:
        found, why = _saved_index(list(meta.get("kinds", [ErrorFeedback.name] * len(meta["reductions"]))), states)
        for state, j in zip(states, found, strict=True):
            if j is not None:
                state.count = int(meta["reductions"][j])
        saved_layout, layout = list(meta["layout"]), _layout(states)
        if saved_layout != layout:
            why = dict.fromkeys(range(len(states)), (
                f"they were kept for {saved_layout[0]} ranks as {saved_layout[1]} nodes x {saved_layout[2]}, "
                f"this run has {layout[0]} as {layout[1]} x {layout[2]}"))
    for i in why:
        states[i].kept = None
    if why and (not dist.is_initialized() or dist.get_rank() == 0):
        for reason in dict.fromkeys(why.values()):
            names = sorted({states[i].name for i, r in why.items() if r == reason})
            log.info("zeropp: %s: %s.", " and ".join(_AFRESH[n] for n in names), reason)
    restore = [i for i in range(len(states)) if i not in why]
    if not restore:
        return
    assert directory is not None
    rank = dist.get_rank() if dist.is_initialized() else 0
    saved = _metadata(directory)
    targets: dict[str, torch.Tensor] = {}
    for i in restore:  # a rank's parts, and for weight rows its peers' on the other nodes
        for source in states[i].sources(rank):
            entry = saved.get(f"{QGZ_ERROR}.{key}.rank{source}.{found[i]}")
            if entry is not None:
                targets[f"rank{source}.{found[i]}"] = torch.empty(entry.size, dtype=entry.properties.dtype)
    _load({QGZ_ERROR: {key: targets}}, directory)
    for i in restore:
        states[i].restore([targets.get(f"rank{source}.{found[i]}") for source in states[i].sources(rank)])

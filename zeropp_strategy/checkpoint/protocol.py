"""Layer: checkpoint. The one save/load protocol every front-end uses.

A checkpoint is named modules, named optimizers, tensors that callbacks hold (a sharded
EMA), and everything else (loop counters, RNG, hyper-parameters). The front-ends differ
only in how they lay those out (Lightning's checkpoint dict, Fabric's ``state`` dict,
Accelerate's ``save_state`` folder: ``objects.py`` and ``lightning.py`` beside this file);
how they are written is the same, and lives here:

- **sharded** (``write_sharded``): every rank writes its DCP shards of ``tensors`` into a
  staged sibling directory, rank 0 writes the metadata (and extra files such as a
  tokenizer) once every shard is on disk, and publishes the directory atomically ([Note:
  atomic saves] in atomic.py) with its checksums ([Note: checkpoint checksums]). A failed
  write on any rank raises on every rank and publishes nothing; the previous checkpoint of
  that name stays.
- **full** (``write_full``): rank 0 writes one file atomically; a failure raises on every
  rank.
- reading (``open_sharded``): a directory must hold the metadata file, which is written
  last, so an interrupted save is never mistaken for a checkpoint; checksums are verified
  before anything is read.

Callback tensors: a callback whose ``state_dict()`` holds DTensor shards puts them under
``CALLBACK_TENSORS``; a sharded save moves them into the DCP tensors (``callbacks/<i>``)
and leaves ``CALLBACK_TENSORS_ID`` in the callback's state (``move_callback_tensors``); on
load the callback reads them back into its own shards (``load_callback_tensors``).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

import torch
from torch import Tensor

from zeropp_strategy.checkpoint.atomic import META_FILE, atomic_torch_save, publish, safe_load, staged_directory
from zeropp_strategy.checkpoint.integrity import rank_zero_writes
from zeropp_strategy.checkpoint.sharded import CALLBACK_TENSORS, CALLBACK_TENSORS_ID, save_tensors

__all__ = [
    "load_callback_tensors",
    "move_callback_tensors",
    "open_sharded",
    "write_full",
    "write_sharded",
]


def write_sharded(
    path: Path,
    nonce: str,
    tensors: Mapping[str, Any],
    meta: Any,
    *,
    rank_zero: bool,
    barrier: Callable[[], None],
    extra: Callable[[Path], None] | None = None,
) -> None:
    """Collective: publish ``path`` holding ``tensors`` (DCP, every rank its shards) and
    ``meta`` (``zeropp_meta.pt``, rank 0). ``nonce``: the same on every rank (broadcast by
    the caller). ``extra(tmp)``: rank 0 writes more files into the staged directory."""
    with staged_directory(path, nonce, is_writer=rank_zero) as tmp:
        barrier()  # the directory exists before anyone writes
        save_tensors(tensors, tmp)  # raises on every rank if any rank's write failed

        def finish() -> None:  # rank 0, once every shard is on disk
            torch.save(meta, tmp / META_FILE)
            if extra is not None:
                extra(tmp)
            publish(tmp, path, nonce)

        barrier()  # every shard is on disk
        rank_zero_writes(f"writing {tmp / META_FILE}", finish)
    barrier()


def write_full(path: Path, checkpoint: Mapping[str, Any], *, barrier: Callable[[], None]) -> None:
    """Collective: rank 0 writes ``checkpoint`` to ``path`` atomically (only rank 0's
    ``checkpoint`` needs its tensors); a failed write raises on every rank."""
    rank_zero_writes(f"writing {path}", lambda: atomic_torch_save(dict(checkpoint), path))
    barrier()


def open_sharded(path: Path, weights_only: bool | None) -> Any:
    """The metadata of the sharded checkpoint directory ``path`` (checksums verified)."""
    if not (path / META_FILE).is_file():
        raise FileNotFoundError(
            f"{path} is a directory without {META_FILE}, so it is not a complete zeropp sharded checkpoint "
            "(an interrupted save leaves a '.tmp-' sibling, never this name). Fix: pass a complete checkpoint; "
            "zeropp_strategy.checkpoint.find_checkpoints(dir) lists them."
        )
    return safe_load(path / META_FILE, weights_only)


def move_callback_tensors(callback_states: Any) -> dict[str, Any]:
    """Take the ``CALLBACK_TENSORS`` out of each callback's state (in place, leaving a
    ``CALLBACK_TENSORS_ID``) and return them keyed by that id, for the DCP tensors."""
    moved: dict[str, Any] = {}
    if not isinstance(callback_states, dict):
        return moved
    for i, (key, state) in enumerate(list(callback_states.items())):
        if isinstance(state, dict) and CALLBACK_TENSORS in state:
            moved[str(i)] = state[CALLBACK_TENSORS]
            callback_states[key] = {**{k: v for k, v in state.items() if k != CALLBACK_TENSORS},
                                    CALLBACK_TENSORS_ID: str(i)}
    return moved


def load_callback_tensors(path: Path | None, state: Mapping[str, Any], targets: dict[str, Tensor]) -> bool:
    """Read a callback's sharded tensors saved by ``move_callback_tensors`` into ``targets``
    (DTensors laid out as now, filled in place) from the sharded checkpoint ``path``.
    Returns False when ``state`` holds no such reference (a full checkpoint: the callback's
    state has the tensors itself)."""
    if CALLBACK_TENSORS_ID not in state:
        return False
    if path is None:
        raise RuntimeError("a callback's sharded tensors are referenced, but no sharded checkpoint is being "
                           "loaded. Fix: resume from the checkpoint directory the state came from.")
    import torch.distributed.checkpoint as dcp

    dcp.load({"callbacks": {state[CALLBACK_TENSORS_ID]: targets}}, checkpoint_id=str(path))
    return True

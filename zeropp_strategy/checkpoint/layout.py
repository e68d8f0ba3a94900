"""Layer: checkpoint. Which checkpoint a path holds, and reading it for ``zeropp consolidate``.

Six layouts, three front ends by two formats (docs/checkpointing.md):

============  =====================================================  ==========================================
front end     sharded (a directory, ``zeropp_meta.pt`` + DCP files)  full (one ``torch.save`` file)
============  =====================================================  ==========================================
Lightning     DCP keys ``model.<fqn>``, ``optim.<i>.<fqn>.<key>``;   ``state_dict``, ``optimizer_states``, ...
              meta: Lightning's dict without ``state_dict``          (what ``strategy="ddp"`` writes)
Fabric        DCP keys ``<module key>.<fqn>``,                       ``{<module key>: state dict, <optimizer
Accelerate    ``optim.<optimizer key>.<fqn>.<key>``; meta:           key>: optimizer state dict, ...}`` plus a
              ``modules``, ``optimizers``, ``state``                 ``zeropp`` block naming which is which
============  =====================================================  ==========================================

The ``zeropp`` block's ``front_end`` tells Fabric (``"fabric"``) from Accelerate
(``"accelerate"``, saved in ``<save_state dir>/zeropp_state``). Anything else is refused
with an error that says what was found. Names a reader hands out ("model keys") are the
Lightning fqns for the Lightning layouts, ``<module key>.<fqn>`` for the others.
"""

from __future__ import annotations

import glob
import logging
import warnings
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import FileSystemReader
from torch.distributed.checkpoint.metadata import Metadata, TensorStorageMetadata

from zeropp_strategy.checkpoint.atomic import META_FILE, OLD_TAG, TMP_TAG, safe_load
from zeropp_strategy.checkpoint.integrity import CheckpointError
from zeropp_strategy.checkpoint.sharded import CALLBACK_TENSORS_ID, QGZ_ERROR, canonical
from zeropp_strategy.checkpoint.sharded import FORMAT as SHARDED_FORMAT
from zeropp_strategy.checkpoint.sharded import VERSION as FORMAT_VERSION

log = logging.getLogger(__name__)

ACCELERATE_DIR = "zeropp_state"  # where ZeroPPAccelerator.save_state puts models and optimizers
LIGHTNING = "lightning"


@contextmanager
def _quiet_dcp() -> Iterator[None]:
    # Single-process DCP is what we want here; its warning says it assumed exactly that.
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=".*torch.distributed is disabled.*")
        yield


class _MetadataOnceReader(FileSystemReader):
    """A FileSystemReader that unpickles ``.metadata`` once, not once per ``dcp.load``.

    Unpickling costs time in proportion to the number of keys, so with one load per tensor it
    made the whole read quadratic: 57 ms per tensor at 1,200 keys on a 2-core CPU, 1.6 ms cached.
    """

    _metadata: Metadata | None = None

    def read_metadata(self, *args: Any, **kwargs: Any) -> Metadata:
        if args or kwargs:  # a rank-local metadata request: not cached
            return super().read_metadata(*args, **kwargs)
        if self._metadata is None:
            self._metadata = super().read_metadata()
        return self._metadata


class ShardedCheckpoint:
    """A zeropp sharded checkpoint directory; tensors are read on demand, one at a time."""

    def __init__(self, path: Path, meta: dict[str, Any]) -> None:
        self.path = path
        self.meta = meta
        self.zeropp: dict[str, Any] = meta["zeropp"]
        self.front_end: str = (self.zeropp.get("front_end") or "fabric") if "modules" in meta else LIGHTNING
        # Lightning: one module, its DCP keys "model.<fqn>" handed out as "<fqn>". Fabric and
        # Accelerate: named modules, their DCP keys "<module key>.<fqn>" handed out unchanged.
        self.modules: list[str] = list(meta["modules"]) if "modules" in meta else ["model"]
        self._strip = "model." if "modules" not in meta else ""
        self._reader = _MetadataOnceReader(str(path))
        metadata = self._reader.read_metadata()
        # Not qgZ's kept errors: each rank's own training state, which a one-file checkpoint
        # does not hold ([Note: error feedback in checkpoints] in comm_state.py).
        self.entries = {k: v for k, v in metadata.state_dict_metadata.items() if not k.startswith(f"{QGZ_ERROR}.")}
        # state_dict_metadata is ordered by which rank wrote what (a replicated tensor goes to one
        # rank only); planner_data, when the writer flattened, lists rank 0's keys in its
        # state_dict order: the order strategy="ddp" saves in.
        ordered = [k for k in (metadata.planner_data or {}) if isinstance(k, str) and k in self.entries]
        self._order = list(dict.fromkeys([*ordered, *self.entries]))
        tok = self.zeropp.get("tokenizer_dir")
        self.tokenizer_dir = path / tok if tok else None
        self.ema_keys: dict[str, str] = {}  # model fqn -> DCP key of its average (use_ema)
        self.consumed: set[str] = set()  # DCP keys read (or replaced by their average)

    def model_keys(self, module: str | None = None) -> list[str]:
        prefixes = tuple(f"{m}." for m in ([module] if module else self.modules))
        return [key[len(self._strip) :] for key in self._order if key.startswith(prefixes)]

    def spec(self, key: str) -> tuple[torch.Size, torch.dtype]:
        md = self.entries.get(key)
        if md is None:
            raise CheckpointError(
                f"{self.path} is missing the tensor {key!r} that {META_FILE} lists. The checkpoint "
                "is damaged or its metadata was written by a different run. Fix: use another checkpoint."
            )
        if not isinstance(md, TensorStorageMetadata):
            raise CheckpointError(
                f"{self.path}: DCP entry {key!r} is not a tensor; zeropp format v{FORMAT_VERSION} stores "
                "only tensors there. Fix: use a checkpoint written by zeropp-strategy."
            )
        return md.size, md.properties.dtype

    def model_spec(self, name: str) -> tuple[torch.Size, torch.dtype]:
        return self.spec(self._strip + name)

    def read(self, key: str) -> torch.Tensor:
        size, dtype = self.spec(key)
        out = torch.empty(size, dtype=dtype)
        with _quiet_dcp():
            dcp.load({key: out}, storage_reader=self._reader, no_dist=True)
        self.consumed.add(key)
        return out

    def read_model(self, name: str) -> torch.Tensor:
        if name in self.ema_keys:  # consolidate(ema=True): the averaged weights instead
            self.consumed.add(self._strip + name)
            return self.read(self.ema_keys[name]).to(self.model_spec(name)[1])
        return self.read(self._strip + name)

    def use_ema(self) -> int:
        """Read ShardedEMA's averages in place of the trained weights; returns how many."""
        state = ema_state(self.meta.get("callbacks"), self.path)
        ident = state.get(CALLBACK_TENSORS_ID)
        if ident is None:
            raise ValueError(f"{self.path}: the ShardedEMA state holds no sharded tensors. Fix: consolidate the "
                             "checkpoint the run wrote, unchanged.")
        prefix = f"callbacks.{ident}."
        self.ema_keys = {canonical(k[len(prefix):]): k for k in self.entries if k.startswith(prefix)}
        return len(self.ema_keys)


class FullCheckpoint:
    """A one-file checkpoint (memory-mapped: tensors are read on use)."""

    def __init__(self, path: Path, checkpoint: dict[str, Any], front_end: str, modules: list[str]) -> None:
        self.path = path
        self.front_end = front_end
        self.zeropp: dict[str, Any] = checkpoint.get("zeropp") or {}
        if front_end == LIGHTNING:
            self._state: dict[str, Any] = checkpoint["state_dict"]
        else:
            self._state = {f"{m}.{k}": v for m in modules for k, v in checkpoint[m].items()}
        self._callbacks = checkpoint.get("callbacks")
        self.tokenizer_dir = None
        self.ema: dict[str, torch.Tensor] = {}

    def use_ema(self) -> int:
        """Read ShardedEMA's averages in place of the trained weights; returns how many."""
        state = ema_state(self._callbacks, self.path)
        self.ema = {canonical(k): v for k, v in (state.get("ema") or {}).items()}
        return len(self.ema)

    def model_keys(self) -> list[str]:
        return [k for k, v in self._state.items() if isinstance(v, torch.Tensor)]

    def model_spec(self, name: str) -> tuple[torch.Size, torch.dtype]:
        t = self._state[name]
        return t.shape, t.dtype

    def read_model(self, name: str) -> torch.Tensor:
        if name in self.ema:
            return self.ema[name].to(self._state[name].dtype).clone(memory_format=torch.contiguous_format)
        # A copy: tied weights share storage in a torch.save'd file, and safetensors refuses that.
        return self._state[name].clone(memory_format=torch.contiguous_format)


def ema_state(callbacks: Any, path: Path) -> Mapping[str, Any]:
    """The ShardedEMA entry of a checkpoint's callback states."""
    found = [v for k, v in (callbacks or {}).items() if str(k).startswith("ShardedEMA") and isinstance(v, Mapping)]
    if not found:
        raise ValueError(f"{path} holds no ShardedEMA state, so there is no average to export. Fix: train with "
                         "Trainer(callbacks=[zeropp_strategy.callbacks.ShardedEMA(...)]), or drop --ema.")
    if len(found) > 1:
        raise ValueError(f"{path} holds {len(found)} ShardedEMA states. Fix: use one ShardedEMA per run.")
    return found[0]


def _listing(path: Path) -> str:
    names = sorted(p.name + ("/" if p.is_dir() else "") for p in path.iterdir())
    return ", ".join(names[:8]) + (f" and {len(names) - 8} more" if len(names) > 8 else "") if names else "nothing"


def _not_sharded_error(path: Path) -> CheckpointError:
    siblings = sorted(p.name for p in path.parent.glob(f"{glob.escape(path.name)}{TMP_TAG}*"))
    lines = [f"{path} is not a complete zeropp sharded checkpoint: it has no {META_FILE} (written last by a save);"
             f" it holds {_listing(path)}."]
    if (path / ".metadata").is_file():
        lines.append(
            "It holds torch.distributed.checkpoint files (.metadata), so it may be another tool's DCP checkpoint "
            "(e.g. Lightning's FSDPStrategy or ModelParallelStrategy), which has its own converter."
        )
    lines.append(
        "An interrupted zeropp save never leaves a directory like this: it leaves a `*.tmp-*` sibling "
        "instead" + (f" (found: {', '.join(siblings)})." if siblings else ".")
    )
    lines.append(
        "Fix: pass the directory of a checkpoint whose save completed (for Accelerate, the save_state "
        f"folder or its {ACCELERATE_DIR})."
    )
    return CheckpointError(" ".join(lines))


def _is_optimizer_state(value: Any) -> bool:
    return isinstance(value, Mapping) and "param_groups" in value and "state" in value


def _full_layout(path: Path, checkpoint: Any) -> tuple[str, list[str]]:
    """(front end, module keys) of a one-file checkpoint, or an error saying what it holds."""
    if isinstance(checkpoint, Mapping):
        if isinstance(checkpoint.get("state_dict"), Mapping):
            return LIGHTNING, []
        info = checkpoint.get("zeropp")
        modules = info.get("modules") if isinstance(info, Mapping) else None
        if isinstance(modules, list) and all(isinstance(checkpoint.get(m), Mapping) for m in modules):
            return str(info.get("front_end") or "fabric"), modules
        if any(_is_optimizer_state(v) for v in checkpoint.values()):
            # A Fabric / Accelerate full file saved before the layout marker existed.
            return "fabric", [k for k, v in checkpoint.items()
                              if isinstance(v, Mapping) and v and all(isinstance(t, torch.Tensor) for t in v.values())]
        found = f"a dict with keys {sorted(map(str, checkpoint))[:8]}"
    else:
        found = f"a {type(checkpoint).__name__}"
    raise CheckpointError(
        f"{path} is a torch file holding {found}, not a checkpoint layout zeropp reads (Lightning: a "
        "'state_dict' entry; Fabric/Accelerate: module and optimizer entries with a 'zeropp' block). "
        "Fix: pass a checkpoint written by a Lightning Trainer, fabric.save or accelerator.save_state."
    )


def open_checkpoint(path: Path, *, weights_only: bool) -> ShardedCheckpoint | FullCheckpoint:
    """Detect the layout of ``path`` (verifying a sharded directory's checksums) and open it."""
    if not path.exists():
        # A save over an existing checkpoint moves the old one aside for an instant (atomic.py).
        old = sorted(path.parent.glob(f"{glob.escape(path.name)}{OLD_TAG}*")) if path.parent.is_dir() else []
        where = f" A save over it was interrupted: the previous checkpoint is {old[-1]}." if old else ""
        raise FileNotFoundError(f"checkpoint {path} does not exist.{where} Fix: pass an existing directory or file.")
    if path.is_dir() and not (path / META_FILE).is_file() and (path / ACCELERATE_DIR).exists():
        log.info("%s is an Accelerate save_state folder: reading its %s", path, ACCELERATE_DIR)
        return open_checkpoint(path / ACCELERATE_DIR, weights_only=weights_only)
    if path.is_dir():
        meta_path = path / META_FILE
        if not meta_path.is_file():
            raise _not_sharded_error(path)
        meta = safe_load(meta_path, weights_only, collective=False)  # verifies the checksums first
        info = meta.get("zeropp") if isinstance(meta, dict) else None
        if not isinstance(info, dict) or info.get("format") != SHARDED_FORMAT:
            raise CheckpointError(
                f"{meta_path} is not zeropp checkpoint metadata (no 'zeropp' entry with format "
                f"{SHARDED_FORMAT!r}). Fix: pass a checkpoint directory written by zeropp-strategy."
            )
        version = info.get("version")
        if not isinstance(version, int) or version > FORMAT_VERSION:
            raise CheckpointError(
                f"{path} is zeropp sharded format version {version!r}; this zeropp-strategy reads versions up "
                f"to {FORMAT_VERSION}. Fix: upgrade zeropp-strategy to the version that wrote the checkpoint."
            )
        return ShardedCheckpoint(path, meta)
    if path.name == META_FILE:
        raise CheckpointError(f"{path} is the metadata of a sharded checkpoint. Fix: pass its directory, {path.parent}.")
    # mmap: tensors stay on disk until read, so a full checkpoint costs no more memory than a sharded one
    checkpoint = safe_load(path, weights_only, mmap=True)
    front_end, modules = _full_layout(path, checkpoint)
    return FullCheckpoint(path, checkpoint, front_end, modules)

"""Layer: checkpoint. Atomic checkpoint writes: a checkpoint either exists complete or not at all.

[Note: atomic saves]
Everything is written into a temporary sibling (``<name>.tmp-<nonce>``) and renamed
onto ``<name>`` only once complete (rename is atomic within a file system). Saving over
an existing checkpoint moves the old one aside (``<name>.old-<nonce>``), renames the new
one in, then deletes the old one, so at every instant a complete checkpoint exists
under ``<name>`` or under the ``.old-`` name. A SIGKILL mid-save leaves at most a
``.tmp-`` sibling, which no loader treats as a checkpoint (``is_complete`` is False and
``find_checkpoints`` skips it) and which the next save to that name removes.
"""

from __future__ import annotations

import os
import secrets
import shutil
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import torch

from zeropp_strategy.checkpoint import integrity

META_FILE = "zeropp_meta.pt"
TMP_TAG = integrity.TMP_TAG
OLD_TAG = integrity.OLD_TAG


def new_nonce() -> str:
    return secrets.token_hex(4)


def tmp_sibling(path: Path, nonce: str) -> Path:
    return path.with_name(f"{path.name}{TMP_TAG}{nonce}")


def is_temporary(path: Path) -> bool:
    return TMP_TAG in path.name or OLD_TAG in path.name


def _fsync_dir(path: Path) -> None:
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


def _fsync_tree(path: Path) -> None:
    for root, _, files in os.walk(path):
        for name in files:
            with open(os.path.join(root, name), "rb") as f:
                os.fsync(f.fileno())
        _fsync_dir(Path(root))


def remove_stale(path: Path) -> None:
    """Delete leftovers of interrupted saves of ``path`` (``.tmp-`` / ``.old-`` siblings)."""
    parent = path.parent
    if not parent.is_dir():
        return
    for sibling in parent.iterdir():
        if sibling.name.startswith(path.name + TMP_TAG) or sibling.name.startswith(path.name + OLD_TAG):
            _remove(sibling)


def remove_path(path: Path) -> None:
    """Delete a checkpoint file or sharded directory (ModelCheckpoint's top-k removal)."""
    _remove(Path(path))


def safe_load(path: Path, weights_only: bool | None = None, *, mmap: bool = False,
              collective: bool | None = None) -> Any:
    """``torch.load`` with ``weights_only=True`` unless the caller opted out explicitly.

    Loading a sharded checkpoint's ``META_FILE`` first verifies the directory's files
    against their checksums, any other file the CRC-32 of its zip entries ([Note:
    checkpoint checksums]). ``collective`` (default for ``META_FILE``: a process group is
    up; for any other file: False) means every rank loads it, and they share the reading.
    """
    import pickle

    path = Path(path)
    if path.name == META_FILE and path.parent.is_dir():
        if collective is None:
            import torch.distributed as dist

            collective = dist.is_available() and dist.is_initialized()
        integrity.verify(path.parent, collective=collective)  # the directory's record covers this file too
    else:  # shared only when asked: a caller may load a full file on one rank alone
        integrity.verify_file(path, collective=bool(collective))
    weights_only = True if weights_only is None else weights_only
    try:
        return torch.load(path, map_location="cpu", weights_only=weights_only, mmap=mmap)
    except pickle.UnpicklingError as err:
        # torch's message is long; keep the line that names the refused global.
        lines = [ln.strip() for ln in str(err).splitlines() if "GLOBAL" in ln or "global" in ln.lower()]
        if not weights_only or not lines:  # not a refused type: the bytes are wrong
            raise integrity.damaged_file(path, err) from err
        raise ValueError(
            f"checkpoint {path} could not be loaded with torch.load(weights_only=True): it holds objects that "
            f"weights_only loading refuses ({lines[0]}). Fix, only for files you trust: allow that type with "
            "torch.serialization.add_safe_globals([TheType]) before fit/validate (Lightning does not pass "
            "Trainer.fit(weights_only=...) to strategies that restore after setup), or rewrite the file once "
            "with `zeropp consolidate --unsafe-load` (consolidate(..., weights_only=False))."
        ) from err
    except (RuntimeError, EOFError) as err:  # e.g. "PytorchStreamReader failed reading zip archive"
        raise integrity.damaged_file(path, err) from err


def _remove(path: Path) -> None:
    if path.is_dir() and not path.is_symlink():
        shutil.rmtree(path, ignore_errors=True)
    elif path.exists() or path.is_symlink():
        path.unlink(missing_ok=True)


def publish(tmp: Path, path: Path, nonce: str) -> None:
    """Rename the complete ``tmp`` onto ``path`` (see [Note: atomic saves]). Rank 0 only."""
    if tmp.is_dir():
        integrity.add(tmp, [META_FILE])  # written last: see [Note: checkpoint checksums]
        _fsync_tree(tmp)
        # Staged privately (0700); published with the permissions any new directory gets.
        umask = os.umask(0)
        os.umask(umask)
        os.chmod(tmp, 0o777 & ~umask)
    old = path.with_name(f"{path.name}{OLD_TAG}{nonce}")
    if path.exists() or path.is_symlink():
        os.replace(path, old)
    os.replace(tmp, path)
    _fsync_dir(path.parent)
    _remove(old)


def atomic_torch_save(obj: Any, path: Path) -> None:
    """``torch.save`` to a temporary sibling, fsync, rename: no half-written file ever
    carries the final name."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    remove_stale(path)
    nonce = new_nonce()
    tmp = tmp_sibling(path, nonce)
    try:
        with open(tmp, "wb") as f:
            torch.save(obj, f)
            f.flush()
            os.fsync(f.fileno())
    except Exception as err:
        _remove(tmp)
        raise integrity.write_failed(path, err) from err
    publish(tmp, path, nonce)


@contextmanager
def staged_directory(path: Path, nonce: str, *, is_writer: bool) -> Iterator[Path]:
    """Yield the temporary directory every rank writes into; the caller publishes it.

    Rank 0 (``is_writer``) clears stale siblings and creates the directory; the others
    must wait at a barrier before writing (the strategy does).
    """
    tmp = tmp_sibling(path, nonce)
    if is_writer:
        path.parent.mkdir(parents=True, exist_ok=True)
        remove_stale(path)
        tmp.mkdir(mode=0o700)
    yield tmp


@contextmanager
def published_directory(path: Path) -> Iterator[Path]:
    """One writer's folder: yield a private sibling to write into; published onto ``path``
    (replacing an existing one) when the block ends without an error, removed otherwise."""
    path.parent.mkdir(parents=True, exist_ok=True)
    remove_stale(path)
    nonce = new_nonce()
    tmp = tmp_sibling(path, nonce)
    tmp.mkdir(mode=0o700)
    try:
        yield tmp
        publish(tmp, path, nonce)
    finally:
        remove_path(tmp)  # gone already once published


def is_complete(path: Path) -> bool:
    """A published checkpoint: a file, or a sharded directory with its meta file."""
    path = Path(path)
    if is_temporary(path) or not path.exists():
        return False
    return path.is_file() or (path / META_FILE).is_file()


def find_checkpoints(directory: Path, pattern: str = "*.ckpt") -> list[Path]:
    """Complete checkpoints in ``directory`` matching ``pattern`` (Lightning names them
    ``*.ckpt``, files and sharded directories alike), oldest first (modification time)."""
    found = [p for p in Path(directory).glob(pattern) if is_complete(p)]
    return sorted(found, key=lambda p: p.stat().st_mtime)

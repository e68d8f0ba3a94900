"""Layer: checkpoint. Integrity of checkpoints: per-file checksums, damaged files, empty or partial outputs.

[Note: checkpoint checksums]
A full (one-file) checkpoint needs no record of its own: ``torch.save`` writes a zip
archive whose entries carry their CRC-32, which ``verify_file`` checks before loading.
A sharded checkpoint directory carries ``zeropp_checksums.json``: for every DCP file
(``__<rank>_<n>.distcp``, ``.metadata``) and for ``zeropp_meta.pt``, its size and CRC-32.
Each rank checksums the shard files it wrote itself, right after ``dcp.save`` (they are
still in the page cache), and rank 0 gathers them (``record``); ``publish`` adds the meta
file, written last, just before the rename. Loading verifies the files against the record
before anything is read (``verify``): each rank reads its share of the files (collective
when a process group is up, so the directory is read once in all, not once per rank), and
every rank raises the same error naming the first bad file. That catches a truncated or
bit-flipped shard, a missing one, and a ``zeropp_meta.pt`` (or ``.metadata``) that belongs
to another save. Reading is streamed in 8 MiB chunks: CRC-32 runs at several GB/s, so
the cost is one extra sequential read of the checkpoint. Directories saved before this
record existed have no ``zeropp_checksums.json``: they load unverified (a debug message
says so).
"""

from __future__ import annotations

import json
import logging
import os
import re
import shutil
import zlib
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any

# Names of a save in progress and of the checkpoint it replaces (atomic.py publishes):
# ``<name>.tmp-<nonce>`` while the ranks write, ``<name>.old-<nonce>`` while it is swapped.
TMP_TAG = ".tmp-"
OLD_TAG = ".old-"

log = logging.getLogger(__name__)

CHECKSUM_FILE = "zeropp_checksums.json"
_FORMAT = "zeropp-checksums"
_CHUNK = 8 * 2**20
_RANK_FILE = re.compile(r"__(\d+)_")


class CheckpointError(ValueError):
    """A checkpoint that is damaged, incomplete, or not a checkpoint this package reads."""


def digest(path: Path) -> list[int]:
    """[size in bytes, CRC-32] of a file, read in chunks."""
    crc, size = 0, 0
    with open(path, "rb") as f:
        while chunk := f.read(_CHUNK):
            crc = zlib.crc32(chunk, crc)
            size += len(chunk)
    return [size, crc]


def _world() -> tuple[int, int]:
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    return 0, 1


def _gather(value: Any, world: int) -> list[Any]:
    if world == 1:
        return [value]
    from zeropp_strategy.comm.control import all_gather_object

    return all_gather_object(value)


def _owner(name: str, world: int) -> int:
    """The rank that checksums ``name``: its writer (``__<rank>_...``), else rank 0."""
    m = _RANK_FILE.match(name)
    return int(m.group(1)) % world if m else 0


def _tensor_files(directory: Path) -> list[str]:
    return sorted(p.name for p in directory.iterdir() if p.is_file() and (p.suffix == ".distcp" or p.name == ".metadata"))


def record(directory: Path) -> None:
    """Collective, after ``dcp.save`` into ``directory``: rank 0 writes the checksums of its DCP files."""
    rank, world = _world()
    mine = {name: digest(directory / name) for name in _tensor_files(directory) if _owner(name, world) == rank}
    files: dict[str, list[int]] = {}
    for part in _gather(mine, world):
        files.update(part)
    rank_zero_writes(f"writing {directory / CHECKSUM_FILE}", lambda: _write(directory, files))


def is_writer() -> bool:
    return _world()[0] == 0


def rank_zero_writes(what: str, write: Callable[[], Any]) -> None:
    """Collective: rank 0 runs ``write``; if it fails (a full disk), every rank raises with
    rank 0's message (``engine.guards.agree`` would only say that rank 0 failed), and none
    waits for rank 0 in the next collective."""
    rank, world = _world()
    error: Exception | None = None
    if rank == 0:
        try:
            write()
        except Exception as err:  # noqa: BLE001 - re-raised below, after the others know
            error = err
    message = [_one_line(str(error) or type(error).__name__) if error is not None else None]
    if world > 1:
        from zeropp_strategy.comm.control import broadcast_object

        message = [broadcast_object(message[0], 0)]
    if error is not None:
        raise error
    if message[0] is not None:
        raise OSError(f"rank 0 failed {what}: {message[0]}")


def add(directory: Path, names: Iterable[str]) -> None:
    """Rank 0: add files written after ``record`` (the meta file) to the directory's record."""
    path = directory / CHECKSUM_FILE
    if not path.is_file():
        return
    files = _read(directory)
    files.update({name: digest(directory / name) for name in names if (directory / name).is_file()})
    _write(directory, files)


def _write(directory: Path, files: dict[str, list[int]]) -> None:
    body = {"format": _FORMAT, "version": 1, "algorithm": "crc32", "files": dict(sorted(files.items()))}
    (directory / CHECKSUM_FILE).write_text(json.dumps(body, indent=1) + "\n", encoding="utf-8")


def _read(directory: Path) -> dict[str, list[int]]:
    path = directory / CHECKSUM_FILE
    try:
        body = json.loads(path.read_text(encoding="utf-8"))
        files = body["files"]
        assert body.get("format") == _FORMAT and isinstance(files, dict)
        return {str(k): [int(v[0]), int(v[1])] for k, v in files.items()}
    except (OSError, ValueError, KeyError, TypeError, AssertionError, IndexError) as err:
        raise CheckpointError(
            f"{path} is damaged ({type(err).__name__}: {err}), so the checkpoint cannot be verified. "
            f"Fix: restore the file from a copy, or delete it to load the checkpoint unverified."
        ) from err


def _problem(directory: Path, name: str, expected: list[int]) -> str | None:
    path = directory / name
    if not path.is_file():
        return f"{path} is missing (the checkpoint was saved with it)"
    size = path.stat().st_size
    if size != expected[0]:
        return f"{path} has {size} bytes, {expected[0]} were written (truncated or replaced)"
    if digest(path)[1] != expected[1]:
        return f"{path} has the right size but not the content that was written (CRC-32 differs: corrupted or replaced)"
    return None


def verify(directory: Path, *, collective: bool) -> None:
    """Check a sharded checkpoint's files against its record; raises ``CheckpointError``.

    ``collective``: every rank of the default process group calls it and reads a share of
    the files; all raise the same error. Otherwise this process reads them all.
    """
    directory = Path(directory)
    if not (directory / CHECKSUM_FILE).is_file():
        log.debug("%s has no %s (saved before checksums were recorded): loading it unverified", directory, CHECKSUM_FILE)
        return
    rank, world = _world() if collective else (0, 1)
    files = _read(directory)
    mine = [(n, e) for n, e in files.items() if _owner(n, world) == rank]
    local = [p for n, e in mine if (p := _problem(directory, n, e)) is not None]
    problems = sorted(p for part in _gather(local, world) for p in part)
    if not problems:
        return
    if len(problems) == len(files) and len(files) > 1:
        cause = f"none of its {len(files)} files match {CHECKSUM_FILE}, which comes from another save"
    else:
        more = f" (and {len(problems) - 1} more file(s))" if len(problems) > 1 else ""
        cause = problems[0] + more
    raise CheckpointError(
        f"checkpoint {directory} is damaged: {cause}. Nothing was loaded from it. Fix: resume from another "
        "checkpoint (zeropp_strategy.checkpoint.find_checkpoints(dir) lists them) or restore the directory "
        "from a copy; a file copied in from another checkpoint directory cannot be mixed with this one's."
    )


def verify_file(path: Path, *, collective: bool) -> None:
    """A full (one-file) checkpoint against the CRC-32 of each of its entries; raises
    ``CheckpointError``.

    ``torch.save`` writes a zip archive whose every entry (the pickle, one per tensor
    storage) carries the CRC-32 of its bytes, and ``torch.load`` does not check them: a
    flipped byte in a tensor loads as a wrong weight. Here every entry is read through
    ``zipfile``, which does; ``collective``: every rank reads a share of the entries and all
    raise the same error. A file that is not a zip archive (the legacy format) is left to
    ``torch.load``.
    """
    import zipfile

    path = Path(path)
    if not path.is_file() or not zipfile.is_zipfile(path):
        return
    rank, world = _world() if collective else (0, 1)
    local: list[str] = []
    try:
        with zipfile.ZipFile(path) as archive:
            for i, entry in enumerate(archive.infolist()):
                if i % world != rank:
                    continue
                try:
                    with archive.open(entry) as f:
                        while f.read(_CHUNK):
                            pass
                except zipfile.BadZipFile as err:
                    local.append(f"its entry {entry.filename} {_one_line(str(err))}")
    except (zipfile.BadZipFile, OSError, EOFError) as err:
        local.append(f"it cannot be read as the zip archive torch.save writes ({_one_line(str(err))})")
    problems = sorted(p for part in _gather(local, world) for p in part)
    if problems:
        more = f" (and {len(problems) - 1} more)" if len(problems) > 1 else ""
        raise CheckpointError(
            f"checkpoint {path} is damaged: {problems[0]}{more}: corrupted or replaced since it was saved. Nothing "
            "was loaded from it. Fix: resume from another checkpoint, or restore this file from a copy."
        )


def damaged_file(path: Path, err: BaseException) -> CheckpointError:
    """torch.load failed for a reason other than an unsafe type: the file is not what a save wrote."""
    said = _one_line(str(err) or type(err).__name__)
    if not os.path.isfile(path):
        return CheckpointError(f"{path} is missing ({said}). Fix: use another checkpoint, or restore this one from a copy.")
    size = os.path.getsize(path)
    return CheckpointError(
        f"{path} ({size} bytes) could not be read by torch.load: it is truncated, corrupted or not a "
        f"checkpoint (torch said: {said}). Fix: use another checkpoint, or restore this one from a copy."
    )


def write_failed(path: Path, err: BaseException) -> OSError:
    """A save that failed (a full disk): what failed, on which rank, and that nothing was published."""
    failures = getattr(err, "failures", None)  # DCP's CheckpointException: {rank: (exception, traceback)}
    causes = [(r, w[0] if isinstance(w, tuple) else w) for r, w in sorted((failures or {}).items())] or [(None, err)]
    # An OSError says why (ENOSPC); torch.save's own error for the same cause does not ("unexpected pos").
    rank, cause = next(((r, c) for r, c in causes if isinstance(c, OSError)), causes[0])
    where = f"rank {rank}: " if rank is not None else ""
    free = ""
    try:
        usage = shutil.disk_usage(next(p for p in Path(path).parents if p.exists()))
        # torch.save's stream writer reports a full disk as "unexpected pos ...", without ENOSPC.
        full = not isinstance(cause, OSError) and usage.free < max(16 * 2**20, usage.total // 100)
        free = f"; {usage.free} bytes are free there{': the disk is full' if full else ''}"
    except (OSError, StopIteration):
        pass
    message = (
        f"could not save the checkpoint {published_name(Path(path))} ({where}{type(cause).__name__}: "
        f"{_one_line(str(cause))}{free}). Nothing was published: the previous checkpoint under this name, if "
        "any, is unchanged and loadable. Fix: free space on that file system (df -h) or save to another "
        "directory, then save again."
    )
    errno = getattr(cause, "errno", None)
    return OSError(errno, message) if errno else OSError(message)


def published_name(path: Path) -> Path:
    """``<name>.tmp-<nonce>`` (a save being staged, see atomic.py) -> ``<name>``."""
    return path.with_name(path.name.split(TMP_TAG)[0]) if TMP_TAG in path.name else path


def _one_line(text: str) -> str:
    return " ".join(ln.strip() for ln in str(text).strip().splitlines() if ln.strip())[:400]


def check_written(out: Path, what: str, written: int, expected: int) -> None:
    """No converter reports success on an empty or partial result: ``written`` of ``expected``."""
    if written <= 0 or written != expected:
        raise CheckpointError(
            f"{out}: wrote {written} of {expected} {what}, so the result would be "
            f"{'empty' if written <= 0 else 'partial'}; nothing was kept. Fix: check that the input is a "
            "complete checkpoint of the layout it claims (see docs/checkpointing.md)."
        )

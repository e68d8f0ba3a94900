"""Layer: offload. NVMe swap: per-run swap directories, swap files, aligned host buffers, parallel I/O, and the
write-behind thread of the parameter store (``WriteBehind``, [Note: write-behind] in offload/params.py).

[Note: swap I/O]
A swap file holds one flat array (one optimizer-state key of one dtype stream, see
``offload.optimizer``). Reads and writes move whole batches between the file and an
aligned host buffer, split into ``io_block_bytes`` requests that a thread pool issues
with ``os.preadv`` / ``os.pwritev`` (both release the GIL, so requests run in parallel
and the disk sees a queue depth of ``io_threads``). With ``direct=True`` the file is
opened ``O_DIRECT`` (no page cache: host memory stays what the buffers take, and the
disk, not the cache, is measured); offsets and lengths are then multiples of
``ALIGN`` and buffers start on an ``ALIGN`` boundary. A filesystem that refuses
``O_DIRECT`` at open or at the first aligned read/write (tmpfs before Linux 6.6, some
FUSE and network filesystems) gets buffered I/O instead.

Swap directories are created per run and per rank with mode 0700 under the user's
``nvme_path`` and removed when the optimizer is closed, at interpreter exit, and on the
next start for directories whose process (same host) no longer exists (a SIGKILL
leaves no chance to clean up).

[Note: writing mapped pages back]
``offload.params`` keeps parameter shards in ``MAP_SHARED`` mappings and writes them back
from a background thread. ``write_back`` does that for one byte range without holding the
GIL (a ctypes call; Python's ``mmap.flush`` keeps the GIL for the whole synchronous
``msync``, so it stalls the training thread even when called from another thread). On
Linux it is ``sync_file_range(WAIT_BEFORE | WRITE | WAIT_AFTER)``: the dirty pages of the
range are written and waited for, no journal commit and no drive cache flush (a swap file
is deleted at the end of the run, so durability across a crash is not needed, only clean
pages, which the page cache can then drop). Elsewhere it is ``msync(MS_SYNC)``.
``start_write_back`` only queues the writes (``SYNC_FILE_RANGE_WRITE``), so that a batch of
ranges reaches the drive as one queue before the first wait.
"""

from __future__ import annotations

import ctypes
import errno
import logging
import mmap
import os
import shutil
import socket
import sys
import tempfile
import threading
import time
import weakref
from collections import deque
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path
from typing import Any

import torch

log = logging.getLogger(__name__)

ALIGN = 4096
_PREFIX = "zeropp-swap-"


def align_up(n: int, a: int = ALIGN) -> int:
    return -(-n // a) * a


def aligned_buffer(nbytes: int, *, pin: bool) -> torch.Tensor:
    """A uint8 CPU tensor of ``nbytes`` starting on an ``ALIGN`` boundary (pinned if asked).

    Pinned blocks are page-aligned already; asking for ``nbytes + ALIGN`` there would make
    PyTorch's pinned allocator (which rounds up to a power of two) take twice the memory.
    """
    if pin:
        raw = torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)
        if raw.data_ptr() % ALIGN == 0:
            return raw
    raw = torch.empty(nbytes + ALIGN, dtype=torch.uint8, pin_memory=pin)
    skip = (-raw.data_ptr()) % ALIGN
    return raw[skip : skip + nbytes]


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def _remove_stale(root: Path) -> None:
    """Remove swap directories of dead processes on this host (a killed run's leftovers)."""
    host = socket.gethostname()
    for d in root.glob(f"{_PREFIX}{host}-*"):
        try:
            pid = int(d.name[len(_PREFIX) + len(host) + 1 :].split("-", 1)[0])
        except ValueError:
            continue
        if pid != os.getpid() and not _pid_alive(pid):
            log.info("zeropp: removing stale swap directory %s (process %d is gone)", d, pid)
            shutil.rmtree(d, ignore_errors=True)


def check_swap_root(path: str | os.PathLike[str], field: str) -> Path:
    """The ``nvme_path`` as a usable directory, or an error that names the field and the fix."""
    root = Path(path)
    if not root.is_dir():
        raise FileNotFoundError(
            f"ZeroConfig.{field}.nvme_path={str(root)!r} does not exist or is not a directory. Fix: create it "
            "(e.g. mkdir -p on a local NVMe drive) or point nvme_path at an existing directory."
        )
    if not os.access(root, os.W_OK | os.X_OK):
        raise PermissionError(
            f"ZeroConfig.{field}.nvme_path={str(root)!r} is not writable by this process. Fix: choose a "
            "directory you can write to, or change its permissions."
        )
    return root


class SwapDir:
    """A per-run, per-rank directory (mode 0700) that removes itself."""

    def __init__(self, root: str | os.PathLike[str], rank: int, *, field: str = "offload_optimizer") -> None:
        base = check_swap_root(root, field)
        _remove_stale(base)
        prefix = f"{_PREFIX}{socket.gethostname()}-{os.getpid()}-rank{rank}-"
        self.path = Path(tempfile.mkdtemp(prefix=prefix, dir=base))  # mkdtemp: mode 0700
        self.root = base
        self.field = field
        self._finalizer = weakref.finalize(self, shutil.rmtree, str(self.path), True)

    def ensure_space(self, nbytes: int) -> None:
        free = shutil.disk_usage(self.path).free
        if free < nbytes:
            raise OSError(
                errno.ENOSPC,
                f"not enough space for {self.field} swap files under {self.root}: need {nbytes} bytes "
                f"({nbytes / 2**30:.2f} GiB) on this rank, {free} bytes free. Fix: free space, point nvme_path at a "
                "larger drive, or offload to 'cpu'",
            )

    def close(self) -> None:
        self._finalizer()

    @property
    def closed(self) -> bool:
        return not self._finalizer.alive


class SwapFile:
    """A preallocated file of ``nbytes`` read and written in parallel blocks."""

    def __init__(
        self,
        path: Path,
        nbytes: int,
        pool: ThreadPoolExecutor,
        *,
        direct: bool,
        io_block_bytes: int,
    ) -> None:
        self.path = path
        self.nbytes = align_up(max(nbytes, 1))
        self.pool = pool
        self.io_block_bytes = align_up(io_block_bytes)
        flags = os.O_RDWR | os.O_CREAT | os.O_EXCL
        self.direct = False
        fd = -1
        if direct and hasattr(os, "O_DIRECT"):
            try:
                fd = os.open(path, flags | os.O_DIRECT, 0o600)
                self.direct = True
            except OSError as e:
                if e.errno != errno.EINVAL:
                    raise
                log.info("zeropp: %s refuses O_DIRECT; using buffered I/O", path.parent)
        if fd >= 0 and not self._direct_works(fd):
            os.close(fd)
            path.unlink()
            fd, self.direct = -1, False
            log.info("zeropp: %s accepts O_DIRECT at open but not for I/O; using buffered I/O", path.parent)
        if fd < 0:
            fd = os.open(path, flags, 0o600)
        self.fd = fd
        try:
            os.posix_fallocate(fd, 0, self.nbytes)
        except OSError as e:
            os.close(fd)
            path.unlink(missing_ok=True)
            if e.errno in (errno.ENOSPC, errno.EDQUOT):
                raise OSError(
                    e.errno,
                    f"no space left for swap file {path}: it needs {self.nbytes} bytes. Fix: free space, point "
                    "nvme_path at a larger drive, or offload to 'cpu'",
                ) from None
            if e.errno not in (errno.EOPNOTSUPP, errno.EINVAL):
                raise
            os.ftruncate(fd, self.nbytes)

    @staticmethod
    def _direct_works(fd: int) -> bool:
        probe = aligned_buffer(ALIGN, pin=False)
        try:
            os.pwritev(fd, [memoryview(probe.numpy())], 0)
            os.preadv(fd, [memoryview(probe.numpy())], 0)
        except OSError as e:
            if e.errno == errno.EINVAL:
                return False
            raise
        return True

    def _io(self, write: bool, buf: torch.Tensor, offset: int) -> list[Future]:
        """Split [offset, offset + len(buf)) into blocks, one pool task each."""
        n = buf.numel()
        view = memoryview(buf.numpy())
        futures = []
        for start in range(0, n, self.io_block_bytes):
            stop = min(n, start + self.io_block_bytes)
            futures.append(self.pool.submit(self._rw, write, view[start:stop], offset + start))
        return futures

    def _rw(self, write: bool, mv: memoryview, offset: int) -> None:
        done = 0
        total = len(mv)
        while done < total:
            chunk = mv[done:]
            n = os.pwritev(self.fd, [chunk], offset + done) if write else os.preadv(self.fd, [chunk], offset + done)
            if n <= 0:
                what = "write" if write else "read"
                raise OSError(errno.EIO, f"short {what} on swap file {self.path} at byte {offset + done}")
            done += n

    def read_into(self, buf: torch.Tensor, offset: int) -> list[Future]:
        """Start reading ``buf.numel()`` bytes at ``offset`` into the uint8 ``buf``."""
        return self._io(False, buf, offset)

    def write_from(self, buf: torch.Tensor, offset: int) -> list[Future]:
        """Start writing the uint8 ``buf`` to ``offset``."""
        return self._io(True, buf, offset)

    def mapped(self, dtype: torch.dtype, numel: int) -> torch.Tensor:
        """The file as a shared memory map (page cache, not anonymous memory): for checkpoints.

        Writes through the map reach the file; call ``sync()`` before the next direct read.
        """
        os.fsync(self.fd)  # direct writes are on disk; buffered ones must not hide behind the map
        return torch.from_file(str(self.path), shared=True, size=numel, dtype=dtype)

    def sync(self) -> None:
        os.fsync(self.fd)

    def close(self) -> None:
        if self.fd >= 0:
            os.close(self.fd)
            self.fd = -1


def _libc_function(name: str, argtypes: list) -> object | None:
    try:
        fn = getattr(ctypes.CDLL(None, use_errno=True), name)
    except (OSError, AttributeError):
        return None
    fn.argtypes, fn.restype = argtypes, ctypes.c_int
    return fn


_SYNC_FILE_RANGE = _libc_function("sync_file_range", [ctypes.c_int, ctypes.c_int64, ctypes.c_int64, ctypes.c_uint])
_MSYNC = _libc_function("msync", [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int])
_SFR_WAIT_BEFORE, _SFR_WRITE, _SFR_WAIT_AFTER = 1, 2, 4  # <linux/fs.h>
_MS_SYNC = 0x10 if sys.platform == "darwin" else 4  # <sys/mman.h>


def _check(ret: int, what: str) -> None:
    if ret != 0:
        err = ctypes.get_errno()
        raise OSError(err, f"{what}: {os.strerror(err)}")


def start_write_back(fd: int, offset: int, nbytes: int) -> None:
    """Queue the dirty pages of ``[offset, offset + nbytes)`` for writing; do not wait.
    A no-op where ``sync_file_range`` does not exist (``write_back`` then does it all)."""
    if _SYNC_FILE_RANGE is not None and nbytes:
        _check(_SYNC_FILE_RANGE(fd, offset, nbytes, _SFR_WRITE), "sync_file_range(WRITE)")


def write_back(fd: int, addr: int, offset: int, nbytes: int) -> None:
    """Write the dirty pages of a mapped file range back and wait for them (see [Note:
    writing mapped pages back]); ``addr`` is where byte ``offset`` is mapped. Releases the
    GIL; raises ``OSError`` (with the errno of the failed write) on an I/O error."""
    if not nbytes:
        return
    if _SYNC_FILE_RANGE is not None:
        flags = _SFR_WAIT_BEFORE | _SFR_WRITE | _SFR_WAIT_AFTER
        _check(_SYNC_FILE_RANGE(fd, offset, nbytes, flags), "sync_file_range")
    elif _MSYNC is not None:
        _check(_MSYNC(addr, nbytes, _MS_SYNC), "msync")
    else:  # pragma: no cover - no libc through ctypes: the data-only fsync of the whole file
        os.fdatasync(fd) if hasattr(os, "fdatasync") else os.fsync(fd)


def pwrite_tensor(fd: int, tensor: torch.Tensor, offset: int) -> None:
    """Write a CPU tensor's bytes to ``fd`` at ``offset`` (buffered, through the page cache:
    whole pages are filled without reading what the file held). Releases the GIL."""
    data = memoryview(tensor.detach().contiguous().view(-1).view(torch.uint8).numpy())
    done = 0
    while done < len(data):
        n = os.pwrite(fd, data[done:], offset + done)
        if n <= 0:
            raise OSError(errno.EIO, f"short write to file descriptor {fd} at byte {offset + done}")
        done += n


def wait(futures: list[Future]) -> None:
    for f in futures:
        f.result()


class MappedRegion:
    """One tensor's bytes in a memory-mapped swap file (the NVMe ``ParamStore``) (4 KiB aligned).

    ``uses`` counts read-ahead requests: the write-behind thread drops a region's pages
    only if it did not change since the region was queued ([Note: write-behind])."""

    __slots__ = ("mm", "fd", "path", "addr", "start", "nbytes", "length", "uses")

    def __init__(self, mm: mmap.mmap, fd: int, path: Path, base_addr: int, start: int, nbytes: int) -> None:
        self.mm, self.fd, self.path, self.start, self.nbytes = mm, fd, path, start, nbytes
        self.addr = base_addr + start
        self.length = align_up(nbytes) if nbytes else 0
        self.uses = 0

    def prefetch(self) -> None:
        if self.length:
            self.uses += 1
            self.mm.madvise(mmap.MADV_WILLNEED, self.start, self.length)

    def evict(self, *, drop_cache: bool) -> None:
        """Unmap the pages from this process; with ``drop_cache``, ask the page cache to drop
        them too (it drops the clean ones; dirty ones stay until written), so that they rest
        on disk, not in RAM."""
        if self.length:
            self.mm.madvise(mmap.MADV_DONTNEED, self.start, self.length)
            if drop_cache:
                os.posix_fadvise(self.fd, self.start, self.length, os.POSIX_FADV_DONTNEED)


class NoPool:
    """ParamStore reads and writes through the mapping, never through the pool."""

    def submit(self, *args: Any, **kwargs: Any) -> Any:  # pragma: no cover
        raise RuntimeError("ParamStore swap files are memory mapped")


class WriteBehind:
    """The write-behind thread of ``offload.params.ParamStore`` ([Note: write-behind] in
    offload/params.py): writes queued regions back, then evicts them.

    Holds no reference to the store, so a store that is garbage collected stops it."""

    def __init__(self, limit_bytes: int) -> None:
        self._cond = threading.Condition()
        self._batches: deque[list[tuple[MappedRegion, int]]] = deque()
        self._limit_bytes = limit_bytes
        self._stopping = False
        self.error: Exception | None = None  # the first failure (an OSError naming the file, normally)
        self.pending_bytes = 0
        self.written_bytes = 0
        self.busy_s = 0.0  # this thread, writing and evicting
        self.wait_s = 0.0  # the training thread, blocked on this one (throttle and flush)
        self._thread = threading.Thread(target=self._run, name="zeropp-param-write-behind", daemon=True)
        self._thread.start()

    def submit(self, regions: list[MappedRegion]) -> None:
        nbytes = sum(r.length for r in regions)
        if not nbytes:
            return
        batch = [(r, r.uses) for r in regions]
        with self._cond:
            if self.pending_bytes and self.pending_bytes + nbytes > self._limit_bytes and self.error is None:
                t0 = time.perf_counter()
                self._cond.wait_for(lambda: self.pending_bytes + nbytes <= self._limit_bytes or self.error is not None)
                self.wait_s += time.perf_counter() - t0
            self._batches.append(batch)
            self.pending_bytes += nbytes
            self._cond.notify_all()

    def flush(self) -> None:
        """Wait until every queued region is written back (or the thread failed)."""
        with self._cond:
            if self.pending_bytes:
                t0 = time.perf_counter()
                self._cond.wait_for(lambda: not self.pending_bytes)
                self.wait_s += time.perf_counter() - t0

    def stop(self) -> None:
        """Flush, then end the thread. Idempotent; a no-op on the thread itself."""
        if threading.current_thread() is self._thread:
            return
        with self._cond:
            self._stopping = True
            self._cond.notify_all()
        self._thread.join()

    def _run(self) -> None:
        while True:
            with self._cond:
                self._cond.wait_for(lambda: self._batches or self._stopping)
                if not self._batches:
                    return
                batch = self._batches[0]
                failed = self.error is not None
            t0 = time.perf_counter()
            error = None
            if not failed:  # after a failure the drive is suspect: the pages stay dirty in the cache
                try:
                    self._write(batch)
                except Exception as e:  # noqa: BLE001 - kept, raised on the training thread
                    error = e
            with self._cond:
                self._batches.popleft()
                nbytes = sum(r.length for r, _ in batch)
                self.pending_bytes -= nbytes
                self.written_bytes += 0 if failed or error else nbytes
                self.busy_s += time.perf_counter() - t0
                if error is not None and self.error is None:
                    self.error = error
                self._cond.notify_all()

    @staticmethod
    def _write(batch: list[tuple[MappedRegion, int]]) -> None:
        for region, _ in batch:  # one queue of writes for the drive, then the waits
            start_write_back(region.fd, region.start, region.length)
        for region, uses in batch:
            try:
                write_back(region.fd, region.addr, region.start, region.length)
            except OSError as e:
                raise OSError(
                    e.errno,
                    f"writing {'gradient' if region.path.name.startswith('grads.') else 'parameter'} shards back "
                    f"to the swap file {region.path} (bytes {region.start} to "
                    f"{region.start + region.length}) failed: {e.strerror or e}. Fix: check the drive under "
                    "offload_param.nvme_path (the kernel log names I/O errors), point nvme_path at a healthy local "
                    "drive, or set offload_param='cpu'",
                ) from e
            if region.uses == uses:  # nobody asked for it since: drop it
                region.evict(drop_cache=True)

"""Layer: offload. Parameter offload to NVMe (stage 3): sharded parameters rest in memory-mapped swap files.

[Note: parameters on NVMe]
With ``offload_param="nvme"`` FSDP2 first keeps the sharded parameters in host memory
(``CPUOffloadPolicy``, unpinned). ``ParamStore`` then moves each shard's storage into a
swap file mapped ``MAP_SHARED``: the DTensor's local tensor and FSDP2's padded flat copy
become views of the mapping, so every reader (the all-gather copy-in, the optimizer step,
``state_dict``, user code) reads the file through the page cache and nothing can see
freed memory. What makes them *rest* on disk:

- after each FSDP group's all-gather has copied its shards in, their pages are dropped
  from this process (``madvise(MADV_DONTNEED)``: for a shared file mapping the data stays
  in the file and the page cache, which the kernel reclaims under pressure);
- after the optimizer steps a batch of parameters, the same for those parameters, once
  they are written back: by the write-behind thread, see [Note: write-behind];
- ahead of each group's all-gather, ``madvise(MADV_WILLNEED)`` asks the kernel to read
  the groups that followed it last time, so their pages are read from disk while the
  current group computes. The order is learned from the previous step and keyed by the
  last *two* groups: forward and backward visit the blocks in opposite orders, so the
  successor of block k is k+1 after (k-1, k) and k-1 after (k+1, k).

Resident parameter memory is then the groups being gathered plus those prefetched plus
those still being written back, not P/N. Regions are 4 KiB aligned so that every advice
covers exactly one parameter.

[Note: gradients on NVMe]
Where the reduced gradient shards live is the memory plan's decision ([Note: the memory
plan] in engine/memory_plan.py): in host memory, as FSDP2 leaves them, when the budget
has room for them (``4 P/N`` bytes in fp32); in a gradient swap file laid out like the
parameter file when it has not (or when there is no plan: ``host_memory_budget_bytes=
None``). A gradient lives only from its backward to the next step, so the file costs a
write and a read of every gradient per step; measured on the 5.5M-parameter model of
``benchmarks/offload.py --part param``, gradients in the file instead of in memory took
the step from about 1.2x to about 1.5x of no offload.

In the file: FSDP2 calls ``_grad_to_file`` (a post-accumulate-grad hook) right after it
stores a reduced shard. The hook writes the shard into its region with ``pwrite``, which
fills the page cache without reading what the file held (a copy through the mapping
would first read every page of the region from the drive, since the previous step's
pages were dropped, and fault on each), points ``param.grad`` at the region's mapped
view and queues the region for write-behind. The step reads the gradient through the
mapping, and ``release`` drops its pages afterwards. When FSDP2 accumulates into the
existing ``.grad`` (gradient accumulation) it writes through the mapping itself, and the
hook only queues the region.

[Note: write-behind]
``release`` (after the optimizer stepped a batch) hands the batch to one background
thread and returns: the step does not wait for the disk. The thread queues the batch's
writes (``swap.start_write_back``), waits for each region (``swap.write_back``, which
releases the GIL), then drops the region's pages from the process and the page cache.
Why this is safe:

- With ``MAP_SHARED`` the mapping *is* the page cache: a parameter read while its
  write-back is queued or running sees the new values (the same pages), and so does a
  checkpoint save. ``MADV_DONTNEED`` on a shared file mapping only unmaps; a dirty page
  table entry passes its dirty bit to the page, so nothing written is lost, whenever the
  unmap happens (the all-gather's eviction may run before the write-back).
  ``POSIX_FADV_DONTNEED`` drops clean pages only: a page dirtied again after its write-back
  (the next step) stays until it is written.
- The thread drops a region only if nobody asked for it since it was queued: the
  read-ahead of the next forward counts a *use*, and a region used since is left in the
  page cache (clean now), so the read-ahead is not thrown away (the all-gather's own
  eviction drops it later).
- At most ``WRITE_BEHIND_LIMIT_BYTES`` (or the store's size, if smaller) are queued:
  ``release`` and the gradient hook wait while more is, so a disk slower than the steps throttles the steps
  instead of filling memory with dirty pages. Time spent waiting is ``io_stats()``'s
  ``write_wait_s``.
- ``flush()`` is the barrier: it returns once every queued region is written (and raises
  the writer's error, if any). ``close()`` flushes before it closes the files. A
  checkpoint does not need it (it reads through the mapping).
- An I/O error in the thread is kept, and raised on the training thread at the first
  all-gather after the next optimizer step (the start of the next forward: one place per
  step, the same on every rank that has the error, never in the middle of a backward),
  or at ``flush`` or ``close``, naming the file and the fix; once
  raised it is raised again by every later step (a failed write-back may leave the file
  behind the mapping, so continuing would train on values the drive does not hold).
"""

from __future__ import annotations

import logging
import mmap
import resource
import time
import weakref
from collections.abc import Callable, Iterable
from typing import Any

import torch
from torch import Tensor, nn
from torch.distributed.fsdp import FSDPModule
from torch.distributed.tensor import DTensor

from zeropp_strategy.config import OffloadConfig
from zeropp_strategy.fsdp_private import (
    group_params,
    param_groups,
    set_sharded_data,
    sharded_data,
    sharded_param,
    unshard_is_noop,
    wrap_unshard,
)
from zeropp_strategy.offload.swap import ALIGN, MappedRegion as _Region, NoPool as _NoPool, SwapDir, SwapFile, align_up
from zeropp_strategy.offload.swap import WriteBehind as _WriteBehind, pwrite_tensor, write_back

log = logging.getLogger(__name__)

_THREAD_USAGE = getattr(resource, "RUSAGE_THREAD", None)  # Linux: faults of this thread only


def _major_faults() -> int:
    return resource.getrusage(_THREAD_USAGE).ru_majflt if _THREAD_USAGE is not None else 0


WRITE_BEHIND_LIMIT_BYTES = 512 * 2**20
"""At most this many bytes (or the store's size, if smaller) queued for write-behind: the
queued regions are dirty pages mapped into the process, counted in its resident size, so
the queue is part of the memory plan ([Note: the memory plan] in engine/memory_plan.py)."""


class ParamStore:
    """Re-homes every FSDP2 sharded parameter under ``root`` into NVMe swap files.

    Call after ``fully_shard`` (with ``CPUOffloadPolicy(pin_memory=False)``) and after
    the parameters are initialized; FSDP2's lazy init later finds the same storage.
    """

    def __init__(self, root: nn.Module, config: OffloadConfig, *, rank: int = 0, prefetch: int = 2,
                 grads_on_nvme: bool = True) -> None:
        if config.device != "nvme" or config.nvme_path is None:
            raise ValueError("ParamStore needs offload_param.device='nvme' with an nvme_path")
        self.prefetch = prefetch
        self.grads_on_nvme = grads_on_nvme  # else FSDP2 keeps them in host memory ([Note: gradients on NVMe])
        self._dir = SwapDir(config.nvme_path, rank, field="offload_param")
        self._regions: dict[int, _Region] = {}  # id(sharded param) -> its region
        self._slots: dict[int, tuple[Any, Any, int]] = {}  # id(FSDPParam) -> (params map, grads map or None, offset)
        self._grads: dict[int, tuple[_Region, Tensor]] = {}  # id(sharded param) -> its gradient's region, view
        self._group_regions: dict[int, list[_Region]] = {}
        self._next: dict[int, int] = {}  # group -> the group unsharded after it last time
        self._next2: dict[tuple[int, int], int] = {}  # (previous, group) -> the one after them
        self._last: int | None = None
        self._prev: int | None = None
        self._closed = False
        self._step_boundary = True  # the next all-gather starts a step ([Note: write-behind])
        self._error_raised = False
        self._groups: dict[int, Any] = {}
        self._maps: list[mmap.mmap] = []
        self._files: list[SwapFile] = []
        self._gathers = 0
        self._gather_s = 0.0
        self._gather_faults = 0
        try:
            self._rehome(root)
        except BaseException:
            # Shards already re-homed view the mappings, so those stay; the files and the
            # directory go now rather than at garbage collection.
            for f in self._files:
                f.close()
            self._dir.close()
            raise
        self._writer = _WriteBehind(limit_bytes=min(self.disk_bytes(), WRITE_BEHIND_LIMIT_BYTES))
        weakref.finalize(self, self._writer.stop)  # before the directory's finalizer at exit

    # -- layout -----------------------------------------------------------------------------

    def _rehome(self, root: nn.Module) -> None:
        groups = [g for m in root.modules() if isinstance(m, FSDPModule) for g in param_groups(m)]
        by_dtype: dict[torch.dtype, list[Any]] = {}
        for g in groups:
            for fp in group_params(g):
                data = sharded_data(fp)
                if data.device.type not in ("cpu", "meta"):
                    raise RuntimeError("offload_param='nvme' needs FSDP2's CPU offload policy underneath")
                by_dtype.setdefault(data.dtype, []).append(fp)
        sizes = {id(fp): align_up(sharded_data(fp).nbytes) for fps in by_dtype.values() for fp in fps}
        self._dir.ensure_space((1 + self.grads_on_nvme) * sum(sizes.values()))  # the shards (and their gradients)
        for dtype, fps in by_dtype.items():
            offsets, cursor = [], 0
            for fp in fps:
                offsets.append(cursor)
                cursor += sizes[id(fp)]
            name = str(dtype).replace("torch.", "")
            params = self._map(f"params.{name}.swap", cursor)
            grads = self._map(f"grads.{name}.swap", cursor) if self.grads_on_nvme else None
            for fp, off in zip(fps, offsets):
                self._slots[id(fp)] = (params, grads, off)
        for g in groups:
            self._groups[id(g)] = g
            self._group_regions[id(g)] = []
            self._wrap(g)
        # Shards that hold values already (a model built on a device) move into the files now;
        # shards still on the meta device are placed by ``fill`` as the engine initializes
        # them, one group at a time ([Note: streaming initialization]).
        for g in groups:
            if not any(sharded_data(fp).is_meta for fp in group_params(g)):
                self.fill(g)
        log.info("zeropp: parameter shards %srest in %s (%d bytes)",
                 "and their gradients " if self.grads_on_nvme else "", self._dir.path, sum(f.nbytes for f in self._files))

    def _map(self, filename: str, nbytes: int) -> tuple[mmap.mmap, SwapFile, Tensor]:
        file = SwapFile(self._dir.path / filename, nbytes, _NoPool(), direct=False, io_block_bytes=ALIGN)
        self._files.append(file)
        mm = mmap.mmap(file.fd, file.nbytes, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE)
        self._maps.append(mm)
        return mm, file, torch.frombuffer(mm, dtype=torch.uint8)

    def groups(self) -> list[Any]:
        """The FSDP parameter groups whose shards live here, in module order."""
        return list(self._groups.values())

    @torch.no_grad()
    def fill(self, group: Any) -> None:
        """Move ``group``'s shards (real tensors now, initialized) into their regions of the
        swap file, write them out and drop their pages: afterwards the group holds no host
        memory. With gradients on NVMe, each trainable parameter's gradient gets its region
        of the gradient file."""
        regions = self._group_regions[id(group)]
        for fp in group_params(group):
            (mm, file, flat), grads, off = self._slots[id(fp)]
            data = sharded_data(fp)
            if data.is_meta:
                raise RuntimeError("ParamStore.fill: a shard is still on the meta device; materialize its group first")
            nbytes = data.numel() * data.element_size()
            region = flat[off : off + nbytes].view(data.dtype)
            region.copy_(data)
            set_sharded_data(fp, region)  # FSDP2's flat copy and the DTensor's local tensor now view the file
            param = sharded_param(fp)
            self._regions[id(param)] = r = _Region(mm, file.fd, file.path, flat.data_ptr(), off, nbytes)
            regions.append(r)
            if param.requires_grad and grads is not None:
                gmm, gfile, gflat = grads
                local = param.to_local()
                view = gflat[off : off + local.numel() * data.element_size()].view(data.dtype).view(local.shape)
                self._grads[id(param)] = (_Region(gmm, gfile.fd, gfile.path, gflat.data_ptr(), off, nbytes), view)
                param.register_post_accumulate_grad_hook(_weak_hook(self._grad_to_file))
        for r in regions:
            write_back(r.fd, r.addr, r.start, r.length)
            r.evict(drop_cache=True)

    @torch.no_grad()
    def _grad_to_file(self, param: Tensor) -> None:
        """FSDP2 calls this right after it stores ``param``'s reduced gradient shard: write the
        shard into its region of the gradient file (unless FSDP2 accumulated into it in
        place), point ``.grad`` at the region and queue it for write-behind ([Note:
        gradients on NVMe])."""
        grad = param.grad
        entry = self._grads.get(id(param))
        if grad is None or entry is None or self._closed:
            return
        region, view = entry
        local = grad.to_local() if isinstance(grad, DTensor) else grad
        if local.data_ptr() != view.data_ptr():
            pwrite_tensor(region.fd, local, region.start)
            param.grad = (DTensor.from_local(view, grad.device_mesh, grad.placements, run_check=False,
                                             shape=grad.shape, stride=grad.stride())
                          if isinstance(grad, DTensor) else view)
        # A write error is raised at the next all-gather or step ([Note: write-behind]), not
        # here, in the middle of FSDP2's reduce.
        self._writer.submit([region])

    def _wrap(self, group: Any) -> None:
        gid = id(group)

        def unshard_from_nvme(unshard: Callable[[bool], Any], async_op: bool) -> Any:
            if unshard_is_noop(group):
                # FSDP2's own no-op (a prefetch already issued it, [Note: prefetch] in engine/
                # fsdp.py): not a gather, so it must not teach the read-ahead a false order.
                return unshard(async_op)
            self._before_unshard(gid)
            faults, t0 = _major_faults(), time.perf_counter()
            try:
                return unshard(async_op)
            finally:
                # The copy-in has read the shards (host tensors are copied synchronously,
                # and unpinned ones are staged before a device copy returns).
                if not self._closed:  # the page cache keeps them for backward and the step
                    for region in self._group_regions[gid]:
                        region.evict(drop_cache=False)
                self._gathers += 1
                self._gather_s += time.perf_counter() - t0
                self._gather_faults += _major_faults() - faults

        wrap_unshard(group, unshard_from_nvme)

    def _before_unshard(self, gid: int) -> None:
        if self._closed:
            return
        if self._step_boundary:  # the first gather after a step: where write errors surface
            self._step_boundary = False
            self._raise_write_error()
        if self._last is not None and self._last != gid:
            self._next[self._last] = gid
            if self._prev is not None:
                self._next2[(self._prev, self._last)] = gid
            self._prev = self._last
        self._last = gid
        for nxt in self.predicted(self.prefetch):
            for region in self._group_regions[nxt]:
                region.prefetch()

    def predicted(self, count: int) -> list[int]:
        """The next ``count`` groups expected after the current one (learned order)."""
        a, b, out = self._prev, self._last, []
        while b is not None and len(out) < count:
            c = self._next2.get((a, b)) if a is not None else None
            if c is None:
                c = self._next.get(b)
            if c is None or c in out or c == self._last:
                break
            out.append(c)
            a, b = b, c
        return out

    # -- optimizer and lifetime --------------------------------------------------------------

    def owns(self, param: Tensor) -> bool:
        return id(param) in self._regions

    def prefetch_params(self, params: Iterable[Tensor]) -> None:
        """Ask the kernel to start reading ``params`` (the optimizer's next batch)."""
        if self._closed:
            return
        for p in params:
            for region in (self._regions.get(id(p)), self._grads.get(id(p), (None,))[0]):
                if region is not None:
                    region.prefetch()

    def release(self, params: Iterable[Tensor]) -> None:
        """After the optimizer stepped ``params``: queue them for write-behind (returns at
        once, see [Note: write-behind]); their pages are dropped once written."""
        if self._closed:
            return
        self._step_boundary = True
        params = list(params)
        regions = [r for r in (self._regions.get(id(p)) for p in params) if r is not None]
        self._writer.submit(regions)
        for p in params:  # the step read the gradients and will not again: their pages go
            entry = self._grads.get(id(p))
            if entry is not None:
                entry[0].evict(drop_cache=True)

    def flush(self) -> None:
        """Wait until every parameter released so far is written to its swap file; raises
        the write-behind thread's error, if any. A no-op once closed."""
        if self._closed:
            return
        self._writer.flush()
        self._raise_write_error()

    def _raise_write_error(self) -> None:
        error = self._writer.error if hasattr(self, "_writer") else None
        if error is None:
            return
        self._error_raised = True
        if isinstance(error, OSError):
            raise OSError(error.errno, str(error.strerror or error)) from error
        raise RuntimeError(f"zeropp: the parameter write-behind thread failed: {error!r}. Fix: this is a bug in "
                           "zeropp_strategy, please report it; offload_param='cpu' avoids the thread") from error

    def pending_bytes(self) -> int:
        """Bytes released but not yet written back (their pages may still be mapped)."""
        return self._writer.pending_bytes

    def io_stats(self) -> dict[str, float]:
        """What the I/O cost the training thread and the write-behind thread so far:
        ``gathers`` (all-gather copy-ins), ``gather_s`` (seconds in them, reads included),
        ``gather_major_faults`` (pages the copy-ins had to read from the drive themselves:
        the read-ahead missed them), ``written_bytes``, ``write_s`` (the thread's busy
        seconds) and ``write_wait_s`` (seconds the training thread waited for it)."""
        w = self._writer
        return {"gathers": self._gathers, "gather_s": self._gather_s, "gather_major_faults": self._gather_faults,
                "written_bytes": w.written_bytes, "write_s": w.busy_s, "write_wait_s": w.wait_s}

    def resident_bytes(self) -> int:
        """Bytes of the swap files mapped into this process's memory now (``Rss`` of the
        mappings in /proc/self/smaps; 0 where that file does not exist)."""
        names = {str(f.path) for f in self._files}
        total = 0
        try:
            lines = open("/proc/self/smaps").read().splitlines()
        except OSError:
            return 0
        inside = False
        for line in lines:
            head = line.split()
            if head and "-" in head[0] and len(head) >= 5:  # a mapping's header line
                inside = len(head) >= 6 and " ".join(head[5:]).removesuffix(" (deleted)") in names
            elif inside and line.startswith("Rss:"):
                total += int(head[1]) * 1024
        return total

    def disk_bytes(self) -> int:
        return sum(f.nbytes for f in self._files)

    @property
    def swap_dir(self) -> str:
        return str(self._dir.path)

    def close(self) -> None:
        """Wait for the write-behind, then remove the swap directory. The mappings stay
        valid (the files are unlinked, not unmapped) for as long as the parameters that
        view them exist; from now on the parameters simply stay resident (no more advice
        on the closed files). Raises a write-behind error not raised before, after the
        clean-up. Idempotent."""
        if self._closed:
            return
        self._writer.stop()
        self._closed = True
        for f in self._files:
            f.close()
        self._dir.close()
        if not self._error_raised:
            self._raise_write_error()


def _weak_hook(method: Callable[[Tensor], None]) -> Callable[[Tensor], None]:
    """``method`` (a store's) as a tensor hook that does not keep its store alive. A hook
    lives in the tensor's C++ side, where the garbage collector cannot see it: a strong
    one made parameter -> hook -> store -> ... -> module -> parameter a cycle that was never
    collected, and a fit with parameters on NVMe kept its trainer, its optimizer, their swap
    threads and files until the process exited (found by tests/_dist.py's rank pool)."""
    ref = weakref.WeakMethod(method)  # type: ignore[arg-type]

    def hook(param: Tensor) -> None:
        bound = ref()
        if bound is not None:
            bound(param)

    return hook

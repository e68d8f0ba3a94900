"""Parameter offload to NVMe (stage 3): sharded parameters rest in memory-mapped swap files.

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
- after the optimizer steps a batch of parameters, the same for those parameters, after
  an ``msync`` that writes them back (synchronous: Python's ``mmap.flush``);
- ahead of each group's all-gather, ``madvise(MADV_WILLNEED)`` asks the kernel to read
  the groups that followed it last time, so their pages are read from disk while the
  current group computes. The order is learned from the previous step and keyed by the
  last *two* groups: forward and backward visit the blocks in opposite orders, so the
  successor of block k is k+1 after (k-1, k) and k-1 after (k+1, k).

Resident parameter memory is then the groups being gathered plus those prefetched, not
P/N. Gradients are not swapped: FSDP2 keeps the reduced shards in host RAM until the step.
Regions are 4 KiB aligned so that every advice covers exactly one parameter.
"""

from __future__ import annotations

import logging
import mmap
import os
from collections.abc import Iterable
from typing import Any

import torch
from torch import Tensor, nn
from torch.distributed.fsdp import FSDPModule

from zeropp_strategy.config import OffloadConfig
from zeropp_strategy.offload.swap import ALIGN, SwapDir, SwapFile, align_up

log = logging.getLogger(__name__)


class _Region:
    """One parameter shard's bytes in a mapped swap file (4 KiB aligned)."""

    __slots__ = ("mm", "fd", "start", "nbytes")

    def __init__(self, mm: mmap.mmap, fd: int, start: int, nbytes: int) -> None:
        self.mm, self.fd, self.start, self.nbytes = mm, fd, start, nbytes

    def prefetch(self) -> None:
        if self.nbytes:
            self.mm.madvise(mmap.MADV_WILLNEED, self.start, align_up(self.nbytes))

    def evict(self, *, dirty: bool) -> None:
        """Unmap the pages from this process; with ``dirty``, start writing them back. The
        page cache is asked to drop them too, so they rest on disk, not in RAM."""
        if not self.nbytes:
            return
        length = align_up(self.nbytes)
        if dirty:
            self.mm.flush(self.start, length)
        self.mm.madvise(mmap.MADV_DONTNEED, self.start, length)
        os.posix_fadvise(self.fd, self.start, length, os.POSIX_FADV_DONTNEED)


class ParamStore:
    """Re-homes every FSDP2 sharded parameter under ``root`` into NVMe swap files.

    Call after ``fully_shard`` (with ``CPUOffloadPolicy(pin_memory=False)``) and after
    the parameters are initialized; FSDP2's lazy init later finds the same storage.
    """

    def __init__(self, root: nn.Module, config: OffloadConfig, *, rank: int = 0, prefetch: int = 2) -> None:
        if config.device != "nvme" or config.nvme_path is None:
            raise ValueError("ParamStore needs offload_param.device='nvme' with an nvme_path")
        self.prefetch = prefetch
        self._dir = SwapDir(config.nvme_path, rank, field="offload_param")
        self._regions: dict[int, _Region] = {}  # id(sharded param) -> its region
        self._group_regions: dict[int, list[_Region]] = {}
        self._next: dict[int, int] = {}  # group -> the group unsharded after it last time
        self._next2: dict[tuple[int, int], int] = {}  # (previous, group) -> the one after them
        self._last: int | None = None
        self._prev: int | None = None
        self._closed = False
        self._groups: dict[int, Any] = {}
        self._maps: list[mmap.mmap] = []
        self._files: list[SwapFile] = []
        try:
            self._rehome(root)
        except BaseException:
            # Shards already re-homed view the mappings, so those stay; the files and the
            # directory go now rather than at garbage collection.
            for f in self._files:
                f.close()
            self._dir.close()
            raise

    # -- layout -----------------------------------------------------------------------------

    def _rehome(self, root: nn.Module) -> None:
        groups = []
        for m in root.modules():
            if isinstance(m, FSDPModule):
                state = m._get_fsdp_state()  # noqa: SLF001 - FSDP2 has no public handle on its groups
                groups.extend(state._fsdp_param_groups)  # noqa: SLF001
        by_dtype: dict[torch.dtype, list[Any]] = {}
        for g in groups:
            for fp in g.fsdp_params:
                data = fp._sharded_param_data  # noqa: SLF001
                if data.device.type != "cpu":
                    raise RuntimeError("offload_param='nvme' needs FSDP2's CPU offload policy underneath")
                by_dtype.setdefault(data.dtype, []).append(fp)
        total = sum(align_up(fp._sharded_param_data.numel() * fp._sharded_param_data.element_size())  # noqa: SLF001
                    for fps in by_dtype.values() for fp in fps)
        self._dir.ensure_space(total)
        for dtype, fps in by_dtype.items():
            esize = torch.empty((), dtype=dtype).element_size()
            offsets, cursor = [], 0
            for fp in fps:
                offsets.append(cursor)
                cursor += align_up(fp._sharded_param_data.numel() * esize)  # noqa: SLF001
            name = str(dtype).replace("torch.", "")
            file = SwapFile(self._dir.path / f"params.{name}.swap", cursor, _NoPool(), direct=False,
                            io_block_bytes=ALIGN)
            self._files.append(file)
            mm = mmap.mmap(file.fd, file.nbytes, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE)
            self._maps.append(mm)
            flat = torch.frombuffer(mm, dtype=torch.uint8)
            for fp, off in zip(fps, offsets):
                self._rehome_one(fp, flat, off, esize, mm, file.fd)
        for g in groups:
            self._groups[id(g)] = g
            self._group_regions[id(g)] = [self._regions[id(fp.sharded_param)] for fp in g.fsdp_params]
            self._wrap(g)
        for region in self._regions.values():
            region.evict(dirty=True)
        log.info("zeropp: %d parameter shards rest in %s (%d bytes)", len(self._regions), self._dir.path, total)

    @torch.no_grad()
    def _rehome_one(self, fp: Any, flat: Tensor, off: int, esize: int, mm: mmap.mmap, fd: int) -> None:
        data = fp._sharded_param_data  # noqa: SLF001
        n = data.numel()
        region = flat[off : off + n * esize].view(data.dtype)
        region.copy_(data)
        padded = region.view(fp.padded_sharded_param_size)
        local = fp.sharded_param._local_tensor  # noqa: SLF001
        length = local.size(0) if local.numel() > 0 else 0
        fp._sharded_param_data = region  # noqa: SLF001 - the two references FSDP2 reads
        fp.sharded_param._local_tensor = padded.narrow(0, 0, length)  # noqa: SLF001
        self._regions[id(fp.sharded_param)] = _Region(mm, fd, off, n * esize)

    def _wrap(self, group: Any) -> None:
        unshard = group.unshard
        gid = id(group)

        def unshard_from_nvme(async_op: bool = False) -> Any:
            self._before_unshard(gid)
            try:
                return unshard(async_op)
            finally:
                # The copy-in has read the shards (host tensors are copied synchronously,
                # and unpinned ones are staged before a device copy returns).
                if not self._closed:
                    for region in self._group_regions[gid]:
                        region.evict(dirty=False)

        group.unshard = unshard_from_nvme

    def _before_unshard(self, gid: int) -> None:
        if self._closed:
            return
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
            region = self._regions.get(id(p))
            if region is not None:
                region.prefetch()

    def release(self, params: Iterable[Tensor]) -> None:
        """After the optimizer stepped ``params``: write them back, drop their pages."""
        if self._closed:
            return
        for p in params:
            region = self._regions.get(id(p))
            if region is not None:
                region.evict(dirty=True)

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
        """Remove the swap directory. The mappings stay valid (the files are unlinked, not
        unmapped) for as long as the parameters that view them exist; from now on the
        parameters simply stay resident (no more advice on the closed files). Idempotent."""
        if self._closed:
            return
        self._closed = True
        for f in self._files:
            f.close()
        self._dir.close()


class _NoPool:
    """ParamStore reads and writes through the mapping, never through the pool."""

    def submit(self, *args: Any, **kwargs: Any) -> Any:  # pragma: no cover
        raise RuntimeError("ParamStore swap files are memory mapped")

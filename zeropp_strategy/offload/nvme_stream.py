"""Layer: offload. ``NvmeStream``: the NVMe half of ``OffloadOptimizer`` (optimizer.py),
as a mixin: how the optimizer state of every shard is laid out in the swap files
(``_layout_nvme``), and the step that streams it through staging buffers in batches,
reading batch b+1 and writing batch b-1 while batch b steps (``_step_stream``). See
[Note: how offload steps] in optimizer.py.
"""

from __future__ import annotations

import logging
import math
from concurrent.futures import Future
from typing import Any

import torch
from torch import Tensor

from zeropp_strategy.offload.host_state import _Batch, _Stream
from zeropp_strategy.offload.swap import ALIGN, SwapDir, SwapFile, aligned_buffer, wait
from zeropp_strategy.primitives import local as _local
from zeropp_strategy.primitives import trim_heap

log = logging.getLogger(__name__)


class NvmeStream:
    """Mixin of ``OffloadOptimizer``: the NVMe state layout and the streamed step."""

    _streams: dict[torch.dtype, _Stream]
    _pool: Any
    _swap_dir: SwapDir | None

    def _layout_nvme(self, params: list[tuple[int, Tensor]], *, direct_io: bool, io_block_bytes: int) -> None:
        assert self._swap_dir is not None and self._pool is not None
        by_dtype: dict[torch.dtype, list[tuple[int, int, Tensor]]] = {}
        for index, (gi, p) in enumerate(params):
            by_dtype.setdefault(p.dtype, []).append((index, gi, p))
        cfg = self.config
        k = max(1, len(self._elementwise))
        needed = 0
        for dtype, entries in by_dtype.items():
            esize = torch.empty((), dtype=dtype).element_size()
            # One buffer holds a batch's state (k keys) plus, when some parameter lives on an
            # accelerator, staging for its values and grads (host-resident ones are stepped in place).
            staging = 2 if any(_local(p).device.type != "cpu" for _, _, p in entries) else 0
            per_elem = esize * (k + staging)
            batch = max(ALIGN // esize, (cfg.buffer_bytes // per_elem) // (ALIGN // esize) * (ALIGN // esize))
            total = sum(_local(p).numel() for _, _, p in entries)
            stream = _Stream(dtype, esize, batch, total, staging)
            offset = 0
            for index, gi, p in entries:
                n = _local(p).numel()
                if n == 0:  # an empty shard: stepped in RAM (it has state, as without offload, but no bytes)
                    self._ram_pieces.append(self._add_piece(p, index, gi, 0, 0, offset))
                    continue
                start = 0
                while start < n:  # cut at batch boundaries of the stream
                    stop = min(n, start + batch - (offset % batch))
                    piece = self._add_piece(p, index, gi, start, stop, offset, swapped=True)
                    stream.batch_of(offset).pieces.append(piece)
                    offset += stop - start
                    start = stop
            needed += len(self._elementwise) * math.ceil(total * esize / ALIGN) * ALIGN
            self._streams[dtype] = stream
        self._swap_dir.ensure_space(needed)
        for dtype, stream in self._streams.items():
            name = str(dtype).replace("torch.", "")
            stream.files = {
                key: SwapFile(self._swap_dir.path / f"{key}.{name}.swap", stream.total * stream.esize, self._pool,
                              direct=direct_io, io_block_bytes=io_block_bytes)
                for key in self._elementwise
            }
            stream.buffers = [
                aligned_buffer(stream.batch * stream.esize * (len(self._elementwise) + stream.staging), pin=self._pin)
                for _ in range(cfg.buffer_count)
            ]
        log.info("zeropp: optimizer state swaps to %s (%d bytes on disk)", self._swap_dir.path, needed)

    def _regions(
        self, stream: _Stream, buf: Tensor, batch: _Batch
    ) -> tuple[dict[str, Tensor], Tensor | None, Tensor | None]:
        """Typed views of one buffer: each state key's batch, then values and grads staging."""
        n = stream.batch
        typed = buf.view(stream.dtype)
        keys = {key: typed[i * n : i * n + (batch.stop - batch.start)] for i, key in enumerate(self._elementwise)}
        k = len(self._elementwise)
        if not stream.staging:
            return keys, None, None
        return keys, typed[k * n : (k + 1) * n], typed[(k + 1) * n : (k + 2) * n]

    def _io(self, stream: _Stream, buf: Tensor, batch: _Batch, write: bool) -> list[Future]:
        futures: list[Future] = []
        nbytes = -(-(batch.stop - batch.start) * stream.esize // ALIGN) * ALIGN
        for i, key in enumerate(self._elementwise):
            region = buf[i * stream.batch * stream.esize :][:nbytes]
            file = stream.files[key]
            offset = batch.start * stream.esize
            futures += file.write_from(region, offset) if write else file.read_into(region, offset)
        return futures

    def _step_stream(self, stream: _Stream) -> None:
        nb = len(stream.batches)
        slots = len(stream.buffers)
        reads: dict[int, list[Future]] = {}
        writes: dict[int, list[Future]] = {}  # slot -> pending write-back of the batch using it

        def start_read(b: int) -> None:
            slot = b % slots
            wait(writes.get(slot, []))  # the buffer is free once its last batch is on disk
            writes.pop(slot, None)  # (only once all its requests are done: see finally below)
            batch = stream.batches[b]
            if self._on_prefetch is not None:
                self._on_prefetch(list({id(pc.param): pc.param for pc in batch.pieces}.values()))
            if any(pc.initialized for pc in batch.pieces):
                reads[b] = self._io(stream, stream.buffers[slot], batch, write=False)
            else:
                reads[b] = []

        for b in range(min(nb, slots - 1)):
            start_read(b)
        try:
            for b in range(nb):
                batch = stream.batches[b]
                buf = stream.buffers[b % slots]
                keys, values, grads = self._regions(stream, buf, batch)
                active = self._bind(batch.pieces, values, grads)
                wait(reads[b])
                del reads[b]
                for pc in active:
                    lo = pc.offset - batch.start
                    state = self.host_optimizer.state[pc.host]
                    if pc.initialized:
                        for key in self._elementwise:
                            state[key] = keys[key][lo : lo + pc.numel]
                        state.update(stream.scalars[id(pc)])
                if active:
                    self._run_host_step(active)
                fresh = False  # the optimizer created state for this batch (first step)
                for pc in active:
                    state = self.host_optimizer.state.pop(pc.host)
                    lo = pc.offset - batch.start
                    for key in self._elementwise:
                        view = keys[key][lo : lo + pc.numel]
                        if state[key].data_ptr() != view.data_ptr():  # first step: created by the optimizer
                            view.copy_(state[key])
                            fresh = True
                    stream.scalars[id(pc)] = {k: v for k, v in state.items() if k not in self._elementwise}
                    pc.initialized = True
                if fresh:  # the first step made each state tensor fresh and freed it at once: without
                    del state  # a trim the fragmented heap keeps about one per batch (+24 MiB for 48 MiB)
                    trim_heap()
                if active:
                    writes[b % slots] = self._io(stream, buf, batch, write=True)
                if b + slots - 1 < nb:  # after the step: write-back of batch b-1 had a step's time
                    start_read(b + slots - 1)
            for slot in list(writes):
                wait(writes[slot])
                del writes[slot]
        finally:  # on error, let in-flight requests finish before buffers can be reused
            for futures in [*reads.values(), *writes.values()]:
                for f in futures:
                    f.exception()

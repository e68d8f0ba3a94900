"""Layer: engine. Evaluation with a different number of batches per rank, without a hang at stage 3.

[Note: uneven evaluation]
At stage 3 every forward all-gathers parameters, so it is a collective: a rank with one
batch more than the others waits in its extra forward forever (until the process-group
timeout). Lightning's DistributedSampler evens the counts by repeating samples, but a
custom sampler, ``use_distributed_sampler=False`` or an ``IterableDataset`` split by rank
gives ranks different counts.

``EvenBatches`` wraps such a loader. Before each batch the ranks all-gather whether they
still have one (one small collective per batch; the forward gathers far more). A rank
that has run out yields its last batch again, as padding, until every rank is done, so
every rank runs the same number of forwards. The strategy runs a padding batch's step
with its logged values discarded, so metrics count each real sample once. A rank that
never had a batch receives one from the lowest rank that has (an object broadcast),
and its padding steps log normally: it must log the same keys as the others, or their
end-of-epoch ``sync_dist`` reductions would wait for it.

``len()`` is the largest count over the ranks (computed once, when wrapping), so
Lightning's per-rank batch limits agree.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Iterator
from typing import Any

import torch
import torch.distributed as dist

from zeropp_strategy.comm.control import book_control_all_gather, broadcast_object


class EvenBatches:
    """Iterate ``loader`` so that every rank yields the same number of batches.

    Collective: every rank must wrap its loader and iterate it in step. After each yielded
    batch, ``take_padding_flag()`` (once per step, in order) says whether that batch was
    padding (a repeat on a rank that ran out).
    """

    def __init__(self, loader: Any, *, device: torch.device | None = None) -> None:
        self.loader = loader
        self.device = device if device is not None else torch.device("cpu")
        self._flags: deque[bool] = deque()
        self.real_batches: int | None = None  # this rank's own count, once exhausted
        try:
            mine = len(loader)
            sized = 1
        except TypeError:
            mine, sized = 0, 0
        both = self._gather([mine, sized])
        self._len = max(row[0] for row in both) if all(row[1] for row in both) else None

    def __len__(self) -> int:
        if self._len is None:
            raise TypeError("EvenBatches over a loader without len() on some rank")
        return self._len

    _OWN = frozenset({"loader", "device", "_flags", "real_batches", "_len"})

    def __setattr__(self, name: str, value: Any) -> None:
        # Lightning sets e.g. worker_init_fn on the loader it was given: pass it through
        if name in self._OWN:
            object.__setattr__(self, name, value)
        else:
            setattr(self.loader, name, value)

    def __getattr__(self, name: str) -> Any:
        # sampler, batch_size, num_workers, dataset...: Lightning inspects these
        if name == "loader":
            raise AttributeError(name)
        return getattr(self.loader, name)

    def _gather(self, values: list[int]) -> list[list[int]]:
        if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() == 1:
            return [values]
        t = torch.tensor(values, dtype=torch.int64, device=self.device)
        out = [torch.empty_like(t) for _ in range(dist.get_world_size())]
        book_control_all_gather(t)  # a vote: booked in the running session's ledger
        dist.all_gather(out, t)
        return [row.tolist() for row in out]

    def take_padding_flag(self) -> bool:
        """Whether the oldest batch not yet accounted for was padding (call once per step)."""
        return self._flags.popleft() if self._flags else False

    def __iter__(self) -> Iterator[Any]:
        self._flags.clear()
        self.real_batches = None
        source = iter(self.loader)
        last: Any = None
        has_last = False
        count = 0
        while True:
            try:
                batch, have = next(source), 1
            except StopIteration:
                batch, have = None, 0
                if self.real_batches is None:
                    self.real_batches = count
            rows = self._gather([have, int(has_last)])
            if not any(row[0] for row in rows):
                return
            if any(not row[0] and not row[1] for row in rows):
                # some rank has never had a batch: the lowest rank with one lends it
                lender = next(r for r, row in enumerate(rows) if row[0])
                lent = broadcast_object(batch if have else None, src=lender)
                if not has_last and not have:
                    last, has_last = lent, True
            if have:
                count += 1
                last, has_last = batch, True
                self._flags.append(False)
                yield batch
            else:
                self._flags.append(True)
                yield last

"""The gloo reduce-scatter's local sum against gloo's own all-reduce ([Note: ring order]).

    pytest tests/test_ring_order.py -q

One spawned group of 4 gloo ranks checks groups of 4, 3 and 2 ranks (and, on 4, a
buffer gloo cuts into more than 2W segments):
- with ``ring_order``, ``reduce_scatter`` gives ``dist.all_reduce``'s bits (SUM), and
  DDP's (AVG = every summand times 1/W, then the ring sum), also for a chunk laid out
  back to front;
- without it, the sum is the exact one (of DDP's scaled summands) rounded once, which
  differs from the ring's somewhere on 3 and 4 ranks (so the first check can fail).
"""

from __future__ import annotations

import pytest
import torch

from tests._dist import run_ranks
from zeropp_strategy.comm.hierarchical import ring_blocks

pytestmark = pytest.mark.timeout(360)  # its longest run_ranks timeout + 60 s (pyproject's 300 s would cut it)

SMALL, LARGE = 37, 700_001  # per rank: gloo cuts 2W segments; 12 from 11 MB (4 ranks only)


def _worker(rank: int, world_size: int) -> dict:
    import torch.distributed as dist

    from zeropp_strategy.comm.collectives import group_ranks
    from zeropp_strategy.comm.hierarchical import reduce_scatter
    from zeropp_strategy.comm.ledger import CommKind, CommLedger
    from zeropp_strategy.topology import Topology

    ledger = CommLedger(Topology(world_size=world_size, rank=rank, ranks_per_node=world_size))
    groups = {4: dist.group.WORLD, 3: dist.new_group([0, 1, 2]), 2: dist.new_group([0, 1])}
    out: dict = {}
    for w, group in groups.items():
        if rank >= w:
            continue
        ranks = group_ranks(group)
        for s in (SMALL, LARGE) if w == 4 else (SMALL,):
            gen = torch.Generator().manual_seed(1000 * w + rank)
            x = torch.randn(w * s, generator=gen) * torch.logspace(-3, 3, w * s)
            everyone = [torch.empty_like(x) for _ in range(w)]
            dist.all_gather(everyone, x, group=group)
            mine = slice(rank * s, (rank + 1) * s)
            order = ring_blocks(torch.arange(mine.start, mine.stop), w * s, w, x.element_size())

            def rs(inp: torch.Tensor, op: dist.ReduceOp, ring: torch.Tensor | None, s: int = s,
                   group: dist.ProcessGroup = group, ranks: list[int] = ranks) -> torch.Tensor:
                got = torch.empty(s)
                reduce_scatter(got, inp, group=group, ranks=ranks, op=op, ledger=ledger, kind=CommKind.OTHER,
                               nodes=None, ring_order=ring)
                return got

            ring_sum = x.clone()
            dist.all_reduce(ring_sum, group=group)
            ddp_avg = x * (1.0 / w)  # DDP's bucket: each gradient times 1/W, then the all-reduce
            dist.all_reduce(ddp_avg, group=group)
            # The same chunks laid out back to front: blocks come in descending runs.
            flipped = x.view(w, s).flip(1).reshape(-1)
            exact = (torch.stack(everyone) * (1.0 / w)).double().sum(0).float()
            plain = rs(x, dist.ReduceOp.AVG, None)
            out[(w, s)] = {
                "ring_sum": torch.equal(rs(x, dist.ReduceOp.SUM, order), ring_sum[mine]),
                "ring_avg": torch.equal(rs(x, dist.ReduceOp.AVG, order), ddp_avg[mine]),
                "ring_flipped": torch.equal(rs(flipped, dist.ReduceOp.SUM, order.flip(0)), ring_sum[mine].flip(0)),
                "exact_avg": torch.equal(plain, exact[mine]),
                "exact_vs_ring": (plain != ddp_avg[mine]).sum().item(),
            }
    return out


@pytest.fixture(scope="module")
def results() -> list[dict]:
    return run_ranks(_worker, 4, timeout_s=300, init_process_group=True)


def test_ring_order_gives_the_all_reduce_bits(results):
    for rank, out in enumerate(results):
        assert out, rank
        for key, r in out.items():
            assert r["ring_sum"] and r["ring_avg"] and r["ring_flipped"], (rank, key, r)


def test_without_ring_order_the_sum_is_exact(results):
    differs = 0
    for rank, out in enumerate(results):
        for (w, s), r in out.items():
            assert r["exact_avg"], (rank, w, s, r)
            if w == 2:  # two summands commute: every order is gloo's
                assert r["exact_vs_ring"] == 0, (rank, s, r)
            else:
                differs += r["exact_vs_ring"] > 0
    assert differs >= 4 + 3, differs  # at least once on every rank of the 4- and 3-rank groups


def test_bad_ring_arguments_name_the_field():
    with pytest.raises(ValueError, match="numel=0"):
        ring_blocks(torch.arange(3), 0, 4, 4)
    with pytest.raises(ValueError, match="world=0"):
        ring_blocks(torch.arange(3), 8, 0, 4)
    import torch.distributed as dist

    from zeropp_strategy.comm.hierarchical import reduce_scatter
    from zeropp_strategy.comm.ledger import CommKind, CommLedger
    from zeropp_strategy.topology import Topology

    # Raised before any collective (no process group exists here).
    with pytest.raises(ValueError, match=r"ring_order has shape \(4,\), expected \(3,\)"):
        reduce_scatter(torch.empty(3), torch.zeros(6), group=None, ranks=[0, 1], op=dist.ReduceOp.SUM,
                       ledger=CommLedger(Topology(world_size=2, rank=0, ranks_per_node=2)), kind=CommKind.OTHER, nodes=None,
                       ring_order=torch.zeros(4, dtype=torch.int64))

"""The recipes' evaluation loaders count each record once, on any number of ranks, and
``trainer.validate()`` prints no sampler warning (``rlhf.data.EvalShard``).

    pytest tests/test_eval_shard.py -q

Reference: the same module validated in one process. On 2 gloo ranks at stage 3 with an
odd number of validation records (one rank has one record more, so the ranks' batch
counts differ too), ``val_loss`` and ``val_accuracy`` must equal the one-process values;
with Lightning's own ``DistributedSampler`` one record was counted twice.
"""

from __future__ import annotations

import pytest

from tests._dist import run_ranks

pytestmark = pytest.mark.timeout(240)

BATCH = 5


def _worker(rank: int, world: int) -> dict:
    import warnings

    import lightning.pytorch as L
    import torch

    import zeropp_strategy
    from tests._models import trainer_kwargs
    from zeropp_strategy.recipes import RewardModule

    torch.manual_seed(0)
    module = RewardModule(batch_size=BATCH, val_fraction=0.035)  # 31 of the 899 pairs
    kw = trainer_kwargs(world)
    del kw["limit_val_batches"]
    trainer = L.Trainer(strategy=zeropp_strategy.ZeroPPStrategy(stage=3), **kw)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        trainer.validate(module, verbose=False)
    return {"records": len(module._split("preferences")[1]),
            "metrics": {k: float(v) for k, v in trainer.callback_metrics.items()},
            "warnings": [str(w.message) for w in caught if "DistributedSampler" in str(w.message)]}


@pytest.fixture(scope="module")
def runs():
    return run_ranks(_worker, 1, timeout_s=180)[0], run_ranks(_worker, 2, timeout_s=180)


def test_each_record_counts_once_on_two_ranks(runs) -> None:
    one, two = runs
    n = one["records"]  # uneven records, and uneven batches: 16 records in 4 batches on rank 0, 15 in 3 on rank 1
    assert n % 2 == 1 and -(-(n // 2 + 1) // BATCH) != -(-(n // 2) // BATCH), n
    for rank in two:
        assert rank["metrics"].keys() == one["metrics"].keys() >= {"val_loss", "val_accuracy"}
        for k, want in one["metrics"].items():
            assert rank["metrics"][k] == pytest.approx(want, rel=1e-5, abs=1e-6), k


def test_validate_prints_no_sampler_warning(runs) -> None:
    one, two = runs
    assert not one["warnings"] and not any(r["warnings"] for r in two), two

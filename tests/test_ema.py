"""ShardedEMA at stage 3 on 2 ranks equals a plain full-model EMA of the same run (fp32,
20 steps), also when the run is saved after 10 steps and resumed, in both checkpoint
formats; it keeps only each rank's shard."""

from __future__ import annotations

import pytest

from tests._dist import run_ranks

pytestmark = pytest.mark.timeout(360)  # its longest run_ranks timeout + 60 s (pyproject's 300 s would cut it)

DECAY = 0.9


def _worker(rank: int, world: int, tmp: str, fmt: str) -> dict:
    from pathlib import Path

    import torch
    from lightning.pytorch import Callback, Trainer, seed_everything

    from tests._models import ParityModule, trainer_kwargs
    from zeropp_strategy import ZeroPPStrategy
    from zeropp_strategy.callbacks import ShardedEMA
    from zeropp_strategy.engine.state import full_model_state

    class Reference(Callback):
        """A plain EMA of the whole model, from the gathered weights after every step."""

        def _full(self, pl_module):
            names = {n for n, p in pl_module.named_parameters() if p.requires_grad}
            return {k: v.float() for k, v in full_model_state(pl_module).items() if k in names}

        def on_fit_start(self, trainer, pl_module):
            self.ema = self._full(pl_module)

        def on_train_batch_end(self, trainer, pl_module, *args):
            for k, v in self._full(pl_module).items():
                self.ema[k] = DECAY * self.ema[k] + (1 - DECAY) * v

    def trainer(epochs, callbacks):  # 10 steps per epoch; resume at an epoch boundary
        return Trainer(strategy=ZeroPPStrategy(stage=3, state_dict_type=fmt), callbacks=callbacks,
                       **trainer_kwargs(world, max_steps=-1, max_epochs=epochs, limit_train_batches=10))

    seed_everything(0)
    ema, ref = ShardedEMA(decay=DECAY, validate_with_ema=False), Reference()
    trainer(2, [ema, ref]).fit(ParityModule())
    whole = ema.full_average()
    local = sum(t.numel() for t in ema.ema.values())
    full = sum(t.numel() for t in whole.values())

    seed_everything(0)
    first = ShardedEMA(decay=DECAY, validate_with_ema=False)
    t1 = trainer(1, [first])
    t1.fit(ParityModule())
    path = f"{tmp}/step10" + (".ckpt" if fmt == "full" else "")
    t1.save_checkpoint(path)
    at_save = first.full_average()
    exported = None
    if rank == 0:  # `zeropp consolidate --ema`: the averages in place of the trained weights
        from zeropp_strategy.checkpoint import consolidate as c

        if fmt == "sharded":
            out = c.consolidate(path, f"{tmp}/ema.ckpt", ema=True)
            state = torch.load(out, weights_only=True)["state_dict"]
        else:
            src = c.open_checkpoint(Path(path), weights_only=True)
            src.use_ema()
            state = {k: src.read_model(k) for k in src.model_keys()}
        exported = max((state[k] - at_save[k]).abs().max().item() for k in at_save)
    seed_everything(0)
    resumed = ShardedEMA(decay=DECAY, validate_with_ema=False)
    trainer(2, [resumed]).fit(ParityModule(), ckpt_path=path)
    again = resumed.full_average()
    return {
        "vs_reference": max((whole[k] - ref.ema[k]).abs().max().item() for k in whole),
        "resumed_vs_uninterrupted": max((again[k] - whole[k]).abs().max().item() for k in whole),
        "updates": (ema.num_updates, resumed.num_updates),
        "exported_vs_average": exported,
        "local_elems": local,
        "full_elems": full,
    }


@pytest.mark.parametrize("fmt", ["sharded", "full"])
def test_sharded_ema_equals_a_full_ema_through_save_and_resume(tmp_path, fmt):
    results = run_ranks(_worker, 2, (str(tmp_path), fmt), timeout_s=300)
    for r in results:
        assert r["vs_reference"] <= 1e-6, r
        assert r["resumed_vs_uninterrupted"] <= 1e-6, r
        assert r["updates"] == (20, 20)
        assert r["local_elems"] < 0.6 * r["full_elems"]  # about P/2 per rank, not P
    assert results[0]["exported_vs_average"] == 0.0


def test_sharded_ema_validates_on_the_average_and_restores_the_weights(tmp_path):
    import torch
    from lightning.pytorch import Callback, Trainer

    from tests._models import ParityModule, trainer_kwargs
    from zeropp_strategy.callbacks import ShardedEMA

    seen = {}

    class Look(Callback):
        def on_validation_epoch_start(self, trainer, pl_module):
            seen["val"] = {n: p.detach().clone() for n, p in pl_module.named_parameters()}

    ema = ShardedEMA(decay=0.5)
    trainer = Trainer(callbacks=[ema, Look()], **trainer_kwargs(1, max_steps=4, limit_val_batches=1,
                                                                val_check_interval=4))
    module = ParityModule()
    trainer.fit(module)
    for name, p in module.named_parameters():
        torch.testing.assert_close(seen["val"][name], ema.ema[name])  # validation saw the average
        assert not torch.equal(p.detach(), ema.ema[name])  # and training weights came back
    with pytest.raises(ValueError, match=r"ShardedEMA\(decay=1.5\) is invalid.*Fix"):
        ShardedEMA(decay=1.5)

"""Faults injected on spawned gloo ranks: each must end in a clear error on every rank,
within a bounded time, never a hang."""

from __future__ import annotations

from tests._dist import run_ranks


def _mismatched_configs(rank: int, world: int) -> str:
    from lightning.pytorch import Trainer

    from tests._models import ParityModule, trainer_kwargs
    from zeropp_strategy import ZeroPPStrategy

    # rank 1 was launched with another stage and without qwZ: a mistake in a launch script
    fields = {"stage": 3, "quantized_weights": True} if rank == 0 else {"stage": 2}
    trainer = Trainer(strategy=ZeroPPStrategy(**fields), **trainer_kwargs(world, max_steps=2))
    try:
        trainer.fit(ParityModule())
    except ValueError as e:
        return str(e)
    return "no error"


def test_ranks_with_different_configs_all_raise_the_same_clear_error():
    messages = run_ranks(_mismatched_configs, 2, timeout_s=120)
    assert messages[0] == messages[1], messages
    text = messages[0]
    assert "different ZeroConfigs" in text and "Fix: give every rank the same configuration" in text
    assert "stage: ranks 0 have 3; ranks 1 have 2" in text
    assert "quantized_weights: ranks 0 have True; ranks 1 have False" in text


def _same_but_nvme_path(rank: int, world: int, tmp: str) -> bool:
    import os

    import torch.distributed as dist

    from zeropp_strategy.config import OffloadConfig, ZeroConfig
    from zeropp_strategy.engine.core import check_same_config

    path = os.path.join(tmp, f"node{rank}")
    os.makedirs(path, exist_ok=True)
    check_same_config(ZeroConfig(stage=3, offload_optimizer=OffloadConfig(device="nvme", nvme_path=path)), world)
    dist.barrier()
    return True


def test_nvme_paths_may_differ_per_rank(tmp_path):
    assert run_ranks(_same_but_nvme_path, 2, (str(tmp_path),), timeout_s=60, init_process_group=True) == [True, True]


def _nonfinite(rank: int, world: int, stage: int, policy: str) -> dict:
    import torch
    from lightning.pytorch import Trainer, seed_everything

    from tests._models import ParityModule, trainer_kwargs
    from zeropp_strategy import ZeroPPStrategy

    class Poisoned(ParityModule):
        """Rank 1's loss is NaN at optimizer step 2 (a bad batch on one rank)."""

        def training_step(self, batch, batch_idx):
            loss = super().training_step(batch, batch_idx)
            if self.trainer.global_step == 2 and self.global_rank == 1:
                loss = loss * float("nan")
            return loss

    seed_everything(0)
    strategy = ZeroPPStrategy(stage=stage, on_nonfinite=policy)
    trainer = Trainer(strategy=strategy, **trainer_kwargs(world, max_steps=5))
    module = Poisoned()
    try:
        trainer.fit(module)
    except FloatingPointError as e:
        return {"error": str(e)}
    finite = all(torch.isfinite(p.to_local() if hasattr(p, "to_local") else p).all().item()
                 for p in module.parameters())
    opt = trainer.strategy.optimizers[0]
    inner = getattr(opt, "optimizer", opt)
    steps = sorted({float(s["step"]) for s in inner.state.values() if "step" in s})
    return {"finite": finite, "skipped": strategy.skipped_steps, "global_step": trainer.global_step, "steps": steps}


def test_nonfinite_raise_stops_every_rank_with_the_step_and_the_parameter():
    results = run_ranks(_nonfinite, 2, (3, "raise"), timeout_s=120)
    assert results[0] == results[1], results
    text = results[0]["error"]
    assert "non-finite values at optimizer step 2: non-finite loss on rank(s) 1; first non-finite gradient in" in text
    assert "rank 1: nan" in text
    assert "Fix:" in text


def test_nonfinite_skip_drops_the_step_on_every_rank_at_stages_1_and_3():
    for stage in (1, 3):
        results = run_ranks(_nonfinite, 2, (stage, "skip"), timeout_s=120)
        for r in results:
            assert r["finite"] and r["skipped"] == 1, (stage, r)
            # 5 optimizer steps taken by the loop, 4 of them updated the weights (Adam's counter).
            assert r["global_step"] == 5 and r["steps"] == [4.0], (stage, r)


def _export_into_a_file(rank: int, world: int, tmp: str) -> str:
    import os

    from zeropp_strategy.rlhf.export import export_causal_lm
    from zeropp_strategy.rlhf.models import build_causal_lm, tiny_llama_config

    blocker = os.path.join(tmp, "not-a-dir")
    if rank == 0:
        open(blocker, "w").close()  # the export's parent is a file: rank 0's write fails
    model = build_causal_lm(tiny_llama_config(hidden_size=32, intermediate_size=64, num_hidden_layers=1))
    try:
        export_causal_lm(model, os.path.join(blocker, "actor"))
    except Exception as e:  # noqa: BLE001 - the test compares what each rank saw
        return f"{type(e).__name__}: {e}"
    return "no error"


def test_an_export_failing_on_rank_0_stops_every_rank(tmp_path):
    results = run_ranks(_export_into_a_file, 2, (str(tmp_path),), timeout_s=120, init_process_group=True)
    assert results[0].startswith(("FileExistsError", "NotADirectoryError", "OSError")), results
    assert results[1].startswith("RuntimeError: zeropp: exporting ") and "failed on rank 0" in results[1], results

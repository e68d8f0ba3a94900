"""Checkpoints: exact resume, resharding across stages and rank counts, atomic saves.

Reference states are the full (gathered) model and index-keyed optimizer state, so
every comparison is exact (atol 0) regardless of how either side is sharded.
"""

from __future__ import annotations

import copy
import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest
import torch

from tests._dist import run_ranks

pytestmark = pytest.mark.timeout(660)  # its longest run_ranks timeout + 60 s (pyproject's 300 s would cut it)

STAGES = ("zeropp_stage_1", "zeropp_stage_2", "zeropp_stage_3")


def _module():
    from tests._models import ParityModule

    class WithScheduler(ParityModule):
        def configure_optimizers(self):
            opt = super().configure_optimizers()
            sched = torch.optim.lr_scheduler.StepLR(opt, step_size=7, gamma=0.5)
            return {"optimizer": opt, "lr_scheduler": {"scheduler": sched, "interval": "step"}}

    return WithScheduler()


def _strategy(name: str, state_dict_type: str | None = None):
    from zeropp_strategy import ZeroPPStrategy

    if name == "ddp":
        return "ddp"
    stage = int(name[-1])
    return ZeroPPStrategy(stage=stage, state_dict_type=state_dict_type)


def _trainer(strategy, world, **kw):
    from lightning.pytorch import Trainer

    from tests._models import trainer_kwargs

    kw.setdefault("max_steps", -1)
    return Trainer(strategy=strategy, **trainer_kwargs(world, **kw))


def _full(trainer):
    """(full model state, index-keyed full optimizer state) on every rank (collective)."""
    from zeropp_strategy.engine.state import full_model_state, full_optimizer_state

    return full_model_state(trainer.lightning_module), full_optimizer_state(trainer.optimizers[0])


def _equal(a, b) -> bool:
    if isinstance(a, torch.Tensor):
        return isinstance(b, torch.Tensor) and a.shape == b.shape and torch.equal(a.float(), b.float())
    if isinstance(a, dict):
        return isinstance(b, dict) and a.keys() == b.keys() and all(_equal(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)):
        return len(a) == len(b) and all(_equal(x, y) for x, y in zip(a, b))
    return a == b


# -- exact resume ------------------------------------------------------------------------


def _resume_worker(rank, world, tmp):
    from lightning.pytorch import seed_everything

    import zeropp_strategy  # noqa: F401

    out = {}
    for stage in STAGES:
        for fmt in ("sharded", "full"):
            seed_everything(0)
            t = _trainer(_strategy(stage, fmt), world, max_epochs=2)
            t.fit(_module())
            straight = _full(t)

            seed_everything(0)
            t = _trainer(_strategy(stage, fmt), world, max_epochs=1)
            t.fit(_module())
            ckpt = Path(tmp) / f"{stage}-{fmt}.ckpt"
            t.save_checkpoint(ckpt)
            seed_everything(0)
            t = _trainer(_strategy(stage, fmt), world, max_epochs=2)
            t.fit(_module(), ckpt_path=ckpt)
            resumed = _full(t)
            out[(stage, fmt)] = {
                "model": _equal(straight[0], resumed[0]),
                "optim": _equal(straight[1], resumed[1]),
                "step": t.global_step,
                "is_dir": ckpt.is_dir(),
            }
    return out


@pytest.mark.compat
def test_resume_is_bit_exact(tmp_path):
    per_rank = run_ranks(_resume_worker, 2, (str(tmp_path),), timeout_s=600)
    for rank, out in enumerate(per_rank):
        for (stage, fmt), r in out.items():
            assert r["model"] and r["optim"], f"rank {rank} {stage} {fmt}: resumed run differs: {r}"
            assert r["step"] == 40, r
            assert r["is_dir"] == (fmt == "sharded"), r


# -- resharding --------------------------------------------------------------------------


class _Capture:
    """Callback: the full state right after the checkpoint was restored."""

    def __new__(cls):
        from lightning.pytorch import Callback

        class Capture(Callback):
            state = None

            def on_train_start(self, trainer, pl_module):
                if isinstance(trainer.strategy, __import__("zeropp_strategy").ZeroPPStrategy):
                    self.state = _full(trainer)
                else:
                    self.state = (
                        {k: v.detach().cpu().clone() for k, v in pl_module.state_dict().items()},
                        copy.deepcopy(trainer.optimizers[0].state_dict()),  # live tensors otherwise
                    )

        return Capture()


def _save_and_load(rank, world, tmp, saves, loads):
    """Train and save each (strategy, format, name) of ``saves``, then ``_load`` each of ``loads``
    (one process group for both: spawning the ranks is most of a small job's time)."""
    from lightning.pytorch import seed_everything

    import zeropp_strategy  # noqa: F401

    for strategy_name, fmt, name in saves:
        seed_everything(0)
        t = _trainer(_strategy(strategy_name, fmt), world, max_steps=3)
        t.fit(_module())
        t.save_checkpoint(Path(tmp) / name)
        ref = _full(t) if strategy_name != "ddp" else (
            {k: v.detach().cpu().clone() for k, v in t.lightning_module.state_dict().items()},
            t.optimizers[0].state_dict(),
        )
        if rank == 0:
            torch.save(ref, Path(tmp) / f"{name}.ref")
        t.strategy.barrier()
    return _load(rank, world, tmp, loads)


def _load(rank, world, tmp, jobs):
    """Load each (checkpoint name, strategy) and compare with the saved reference."""
    from lightning.pytorch import seed_everything

    import zeropp_strategy  # noqa: F401

    out = {}
    for name, strategy_name in jobs:
        seed_everything(0)
        cap = _Capture()
        t = _trainer(_strategy(strategy_name), world, max_steps=4, callbacks=[cap])
        t.fit(_module(), ckpt_path=Path(tmp) / name)
        ref_model, ref_optim = torch.load(Path(tmp) / f"{name}.ref", weights_only=False)
        got_model, got_optim = cap.state
        out[(name, strategy_name)] = {
            "model": _equal(ref_model, got_model),
            "optim_state": _equal(ref_optim["state"], got_optim["state"]),
            "lr": got_optim["param_groups"][0]["lr"] == ref_optim["param_groups"][0]["lr"],
        }
    return out


def test_resharding_every_direction(tmp_path):
    tmp = str(tmp_path)
    run_ranks(_save_and_load, 2, (tmp, [("zeropp_stage_1", "sharded", "s1_n2"), ("ddp", None, "ddp_n2.ckpt"),
                                        ("zeropp_stage_3", "full", "s3full_n2.ckpt")], []), timeout_s=300)
    results = {}
    for world, saves, jobs in (
        (4, [("zeropp_stage_3", "sharded", "s3_n4")], [("s1_n2", "zeropp_stage_3")]),
        (2, [], [("s3_n4", "zeropp_stage_1"), ("s3_n4", "zeropp_stage_2"), ("ddp_n2.ckpt", "zeropp_stage_3"),
                 ("s3full_n2.ckpt", "ddp"), ("s3full_n2.ckpt", "zeropp_stage_1")]),
        (1, [], [("s3_n4", "zeropp_stage_3"), ("s1_n2", "zeropp_stage_2")]),
    ):
        for out in run_ranks(_save_and_load, world, (tmp, saves, jobs), timeout_s=600):
            results.update({(world, *k): v for k, v in out.items()})
    bad = {k: v for k, v in results.items() if not all(v.values())}
    assert not bad, "\n".join(f"{k}: {v}" for k, v in bad.items())
    assert len(results) == 8


# -- ModelCheckpoint, weights-only, same path twice -----------------------------------------


def _callbacks_worker(rank, world, tmp):
    from lightning.pytorch import seed_everything
    from lightning.pytorch.callbacks import ModelCheckpoint

    import zeropp_strategy  # noqa: F401
    from zeropp_strategy.checkpoint.atomic import find_checkpoints, is_complete

    seed_everything(0)
    topk = ModelCheckpoint(dirpath=Path(tmp) / "topk", monitor="train_loss", save_top_k=2, every_n_train_steps=2)
    weights = ModelCheckpoint(dirpath=Path(tmp) / "weights", save_weights_only=True, every_n_train_steps=5)
    t = _trainer(_strategy("zeropp_stage_3"), world, max_steps=10, callbacks=[topk, weights],
                 enable_checkpointing=True, limit_val_batches=2)
    t.fit(_module())
    same = Path(tmp) / "same.ckpt"
    t.save_checkpoint(same)
    t.save_checkpoint(same)
    names = sorted(p.name for p in (Path(tmp) / "topk").iterdir())
    complete = [p.name for p in find_checkpoints(Path(tmp) / "topk")]
    weight_ckpt = find_checkpoints(Path(tmp) / "weights")[-1]
    meta = torch.load(weight_ckpt / "zeropp_meta.pt", weights_only=True)
    # A weights-only checkpoint still serves validate().
    val = t.validate(_module(), ckpt_path=weight_ckpt, verbose=False)
    return {
        "topk": names,
        "complete": complete,
        "same_ok": is_complete(same) and not any(".tmp-" in p.name for p in Path(tmp).iterdir()),
        "weights_has_optim": "optimizer_states" in meta,
        "val": bool(val),
    }


def test_model_checkpoint_topk_weights_only_and_same_path(tmp_path):
    out = run_ranks(_callbacks_worker, 2, (str(tmp_path),), timeout_s=300)[0]
    assert len(out["topk"]) == 2 and sorted(out["complete"]) == out["topk"], out
    assert out["same_ok"] and not out["weights_has_optim"] and out["val"], out


# -- kill during save ----------------------------------------------------------------------

_SAVER = textwrap.dedent(
    """
    import sys, torch
    from pathlib import Path
    from zeropp_strategy.checkpoint.atomic import META_FILE, atomic_torch_save, new_nonce, publish, staged_directory
    from zeropp_strategy.checkpoint.sharded import save_tensors
    root = Path(sys.argv[1])
    version = 0
    while True:
        version += 1
        big = torch.full((4_000_000,), float(version))  # 16 MB: the write takes a while
        nonce = new_nonce()
        with staged_directory(root / "ckpt", nonce, is_writer=True) as tmp:
            save_tensors({"model": {"w": big}}, tmp)
            torch.save({"version": version}, tmp / META_FILE)
            publish(tmp, root / "ckpt", nonce)
        atomic_torch_save({"w": big, "version": version}, root / "full.ckpt")
        print(version, flush=True)
    """
)


@pytest.mark.parametrize("delay_s", [0.35, 0.8, 1.3])
def test_sigkill_during_save_leaves_a_complete_checkpoint(tmp_path, delay_s):
    import torch.distributed.checkpoint as dcp

    from zeropp_strategy.checkpoint.atomic import META_FILE, find_checkpoints, is_complete
    from zeropp_strategy.checkpoint.layout import _quiet_dcp

    proc = subprocess.Popen([sys.executable, "-c", _SAVER, str(tmp_path)], stdout=subprocess.PIPE, text=True)
    try:
        assert proc.stdout.readline().strip() == "1"  # one complete version exists
        time.sleep(delay_s)
    finally:
        os.kill(proc.pid, signal.SIGKILL)
        proc.wait(timeout=30)
    ckpt = tmp_path / "ckpt"
    assert is_complete(ckpt)
    version = torch.load(ckpt / META_FILE, weights_only=True)["version"]
    target = {"model": {"w": torch.zeros(4_000_000)}}
    with _quiet_dcp():  # torch 2.13 warns that it assumes one process even with no_dist=True
        dcp.load(target, checkpoint_id=str(ckpt), no_dist=True)
    assert torch.all(target["model"]["w"] == version), "meta and tensors come from the same save"
    full = torch.load(tmp_path / "full.ckpt", weights_only=True)
    assert torch.all(full["w"] == full["version"])
    # Leftovers of the interrupted save never pass for checkpoints.
    assert sorted(p.name for p in find_checkpoints(tmp_path, "*")) == ["ckpt", "full.ckpt"]
    assert all(".tmp-" not in p.name and ".old-" not in p.name for p in find_checkpoints(tmp_path, "*"))


# -- safe loading --------------------------------------------------------------------------


class _Custom:
    pass


def test_unsafe_checkpoint_raises_with_the_way_out(tmp_path):
    from zeropp_strategy.checkpoint.atomic import safe_load

    path = tmp_path / "x.ckpt"
    torch.save({"state_dict": {}, "hyper_parameters": {"thing": _Custom()}}, path)
    with pytest.raises(ValueError, match=r"Unsupported global.*_Custom.*Fix.*add_safe_globals"):
        safe_load(path)
    assert isinstance(safe_load(path, weights_only=False)["hyper_parameters"]["thing"], _Custom)


# -- end to end: sharded training checkpoint -> consolidate -> Hugging Face ---------------


def _hf_worker(rank, world, tmp):
    from lightning.pytorch import seed_everything

    import zeropp_strategy  # noqa: F401
    from tests._models import tiny_llama_config
    from zeropp_strategy.engine.state import full_model_state

    class TinyLM(__import__("tests._models", fromlist=["x"]).LoraLlama):
        def configure_model(self):
            if self.model is None:
                from transformers import LlamaForCausalLM

                torch.manual_seed(3)
                self.model = LlamaForCausalLM(tiny_llama_config())

    seed_everything(0)
    module = TinyLM()
    t = _trainer(_strategy("zeropp_stage_3"), world, max_steps=5)
    t.fit(module)
    t.save_checkpoint(Path(tmp) / "lm.ckpt")
    full = full_model_state(t.lightning_module)
    if rank == 0:
        torch.save(full, Path(tmp) / "trained_state.pt")
    t.strategy.barrier()
    return True


def test_consolidate_hf_from_a_real_sharded_run(tmp_path):
    from transformers import AutoModelForCausalLM, LlamaForCausalLM

    from tests._models import tiny_llama_config
    from zeropp_strategy.cli import main

    run_ranks(_hf_worker, 2, (str(tmp_path),), timeout_s=300)
    assert (tmp_path / "lm.ckpt").is_dir()
    assert main(["consolidate", str(tmp_path / "lm.ckpt"), str(tmp_path / "hf"), "--hf"]) in (0, None)
    assert main(["consolidate", str(tmp_path / "lm.ckpt"), str(tmp_path / "full.ckpt")]) in (0, None)
    exported = AutoModelForCausalLM.from_pretrained(tmp_path / "hf").eval()
    reference = LlamaForCausalLM(tiny_llama_config()).eval()
    state = torch.load(tmp_path / "trained_state.pt", weights_only=True)
    reference.load_state_dict({k[len("model."):]: v for k, v in state.items()})
    ids = torch.randint(0, 61, (2, 9), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        assert torch.equal(exported(ids).logits, reference(ids).logits)
    assert exported.generate(ids, max_new_tokens=3, do_sample=False).shape == (2, 12)
    consolidated = torch.load(tmp_path / "full.ckpt", weights_only=True)
    assert all(torch.equal(consolidated["state_dict"][k], v) for k, v in state.items())
    assert consolidated["global_step"] == 5 and len(consolidated["optimizer_states"]) == 1

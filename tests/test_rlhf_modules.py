"""SFTModule and RewardModule: they train on the embedded task, mask what they should,
score at the last real token, and keep the reward statistics in the checkpoint."""

from __future__ import annotations

import math
import sys

import pytest
import torch

from zeropp_strategy.recipes.reward import RewardModule
from zeropp_strategy.recipes.sft import SFTModule
from zeropp_strategy.rlhf.models import ScalarHeadModel, tiny_llama_config

SMALL = tiny_llama_config(hidden_size=32, intermediate_size=64, num_hidden_layers=2)


def _trainer(tmp_path, steps):
    from lightning.pytorch import Trainer

    return Trainer(accelerator="cpu", devices=1, max_steps=steps, limit_val_batches=2, val_check_interval=steps,
                   logger=False, enable_progress_bar=False, enable_model_summary=False, default_root_dir=tmp_path)


def test_sft_loss_counts_only_the_response(tmp_path):
    torch.manual_seed(0)
    module = SFTModule(model=SMALL, batch_size=8)
    module.configure_model()
    batch = next(iter(module.train_dataloader()))
    loss = module.model(**batch).loss
    # Same loss by hand, over the labelled (response + EOS) positions only.
    logits = module.model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).logits
    labels = batch["labels"][:, 1:]
    keep = labels != -100
    by_hand = torch.nn.functional.cross_entropy(logits[:, :-1][keep], labels[keep])
    torch.testing.assert_close(loss, by_hand)


def test_sft_trains(tmp_path):
    torch.manual_seed(0)
    module = SFTModule(model=SMALL, batch_size=16, lr=3e-3)
    trainer = _trainer(tmp_path, 30)
    trainer.fit(module)
    # An untrained model is near log(384) = 5.95 per token; 30 steps must at least halve it.
    assert trainer.callback_metrics["train_loss"] < 3.0
    assert torch.isfinite(trainer.callback_metrics["val_ppl"])


@pytest.mark.parametrize("padding", ["left", "right"])
def test_reward_is_scored_at_the_last_real_token(padding):
    torch.manual_seed(0)
    head = ScalarHeadModel(SMALL).eval()
    ids = torch.randint(3, 300, (1, 5))
    ones = torch.ones(1, 5, dtype=torch.long)
    alone = head.score(ids, ones)
    pad = torch.zeros(1, 3, dtype=torch.long)
    if padding == "left":
        # Left padding shifts positions, so compare with the per-token value of the same row.
        padded, mask = torch.cat([pad, ids], 1), torch.cat([pad, ones], 1)
        values = head(padded, mask)
        assert head.score(padded, mask).item() == values[0, -1].item()
    else:
        padded, mask = torch.cat([ids, pad], 1), torch.cat([ones, pad], 1)
        torch.testing.assert_close(head.score(padded, mask), alone)


def test_reward_model_trains_and_stores_its_statistics(tmp_path):
    torch.manual_seed(0)
    module = RewardModule(model=SMALL, batch_size=16, lr=3e-3, center_coef=0.01)
    trainer = _trainer(tmp_path, 20)
    trainer.fit(module)
    assert torch.isfinite(trainer.callback_metrics["train_loss"])
    assert module.reward_std > 0 and module.reward_mean != 0.0
    path = tmp_path / "rm.ckpt"
    trainer.save_checkpoint(path)
    saved = torch.load(path, weights_only=True)
    assert saved["reward_stats"] == {"mean": module.reward_mean, "std": module.reward_std}


def test_dpo_starts_at_log2_and_keeps_the_reference_frozen_and_in_eval(tmp_path):
    from zeropp_strategy.recipes.dpo import DPOModule, sequence_logprobs

    torch.manual_seed(0)
    module = DPOModule(model={**SMALL, "attention_dropout": 0.1}, batch_size=8)
    module.configure_model()
    batch = next(iter(module.train_dataloader()))
    module.eval()
    with torch.no_grad():  # policy == reference at the start: every implicit reward is 0
        assert module._pair_losses(batch, "val")[0].item() == pytest.approx(0.6931, abs=1e-4)
    # Response log-probs count the response tokens only (mask from lengths).
    lp = sequence_logprobs(module.policy, batch)
    assert lp.shape == (16,) and (lp < 0).all()
    before = {k: v.clone() for k, v in module.reference.state_dict().items()}
    module.train()  # Lightning keeps the mode it finds (and warns about eval modules)
    trainer = _trainer(tmp_path, 5)
    trainer.fit(module)
    assert dropout_off(module.reference) and not any(p.requires_grad for p in module.reference.parameters())
    assert all(torch.equal(before[k], v) for k, v in module.reference.state_dict().items())
    assert torch.isfinite(trainer.callback_metrics["train_loss"])
    with pytest.raises(ValueError, match="beta=0.*Fix"):
        DPOModule(beta=0)


def test_zeropp_fit_runs_a_recipe_with_command_line_overrides(tmp_path, monkeypatch):
    """The console command on the shipped SFT recipe, one process (overrides on the CLI)."""
    from pathlib import Path

    import yaml

    from zeropp_strategy.cli import main

    recipe = Path(__file__).resolve().parents[1] / "recipes" / "sft.yaml"
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(sys, "argv", ["zeropp"])  # as from Python: pytest's own argv is not the command's
    code = main(["fit", "--config", str(recipe), "--trainer.devices", "1", "--trainer.strategy", "auto",
                 "--trainer.max_steps", "2", "--trainer.val_check_interval", "2", "--trainer.limit_val_batches", "1",
                 "--trainer.enable_progress_bar", "false", "--model.lr", "0.0042",
                 "--model.model", json_small()])
    assert code == 0
    saved = yaml.safe_load(next((tmp_path / "runs" / "sft").rglob("config.yaml")).read_text())
    assert saved["model"]["init_args"]["lr"] == 0.0042
    assert list((tmp_path / "runs" / "sft").rglob("*.ckpt"))


def json_small() -> str:
    import json

    return json.dumps(SMALL)


def test_modules_load_a_local_from_pretrained_folder_and_lora_trains_only_adapters(tmp_path):
    from transformers import AutoConfig, AutoModelForCausalLM

    from zeropp_strategy.rlhf.models import merged

    torch.manual_seed(0)
    cfg = dict(SMALL)
    lm = AutoModelForCausalLM.from_config(AutoConfig.for_model(cfg.pop("model_type"), **cfg))
    lm.save_pretrained(tmp_path / "sft")
    sft = SFTModule(model=str(tmp_path / "sft"), lora={"r": 4, "lora_alpha": 8, "target_modules": ["q_proj", "v_proj"]})
    sft.configure_model()
    trainable = [n for n, p in sft.model.named_parameters() if p.requires_grad]
    assert trainable and all("lora_" in n for n in trainable)
    base = {k: v for k, v in lm.state_dict().items()}
    exported = merged(sft.model).state_dict()  # adapters start at zero: merged == the folder
    assert all(torch.equal(exported[k], base[k]) for k in base)
    rm = RewardModule(model=str(tmp_path / "sft"))
    rm.configure_model()
    batch = next(iter(rm.train_dataloader()))
    assert rm._scores(batch)[0].shape == (rm.batch_size,)
    with pytest.raises(ValueError, match="lora=.*Fix"):
        SFTModule(model=SMALL, lora={"rank": 4}).configure_model()


def test_reward_model_with_lora_exports_a_folder_that_scores_the_same(tmp_path):
    torch.manual_seed(0)
    rm = RewardModule(model=SMALL, lora={"r": 4, "target_modules": ["q_proj", "v_proj"]})
    rm.configure_model()
    trainable = {n for n, p in rm.model.named_parameters() if p.requires_grad}
    assert trainable and all("lora_" in n or n == "head.weight" for n in trainable) and "head.weight" in trainable
    with torch.no_grad():
        for name, p in rm.model.named_parameters():
            if "lora_B" in name:
                p.normal_()  # adapters that change the scores, to check the merge
    rm.reward_mean, rm.reward_std = 0.5, 2.0
    rm.export_hf(str(tmp_path / "rm"))
    loaded = ScalarHeadModel(str(tmp_path / "rm")).eval()
    assert loaded.reward_stats == {"mean": 0.5, "std": 2.0}
    batch = next(iter(rm.val_dataloader()))
    with torch.no_grad():
        torch.testing.assert_close(loaded.score(batch["input_ids"], batch["attention_mask"]),
                                   rm.model.eval().score(batch["input_ids"], batch["attention_mask"]),
                                   atol=1e-5, rtol=1e-5)


def test_dpo_precomputed_reference_matches_the_live_one_and_frees_the_model(tmp_path):
    from zeropp_strategy.recipes.dpo import DPOModule

    torch.manual_seed(0)
    live = DPOModule(model=SMALL, batch_size=4)
    live.configure_model()
    torch.manual_seed(0)
    cached = DPOModule(model=SMALL, batch_size=4, precompute_reference=True)
    cached.configure_model()
    assert cached.reference is None and cached.reference_logps["train"].shape == (len(cached._split("preferences")[0]), 2)
    batch = next(iter(cached.val_dataloader()))
    assert torch.equal(batch["index"], torch.arange(4))
    with torch.no_grad():
        torch.testing.assert_close(cached._pair_losses(batch, "val")[0], live._pair_losses(batch, "val")[0])
        torch.testing.assert_close(cached._pair_losses(batch, "val")[0], torch.tensor(math.log(2.0)))
    trainer = _trainer(tmp_path, 3)
    trainer.fit(cached)
    assert torch.isfinite(trainer.callback_metrics["train_loss"])


def test_sft_with_packing_trains(tmp_path):
    torch.manual_seed(0)
    module = SFTModule(model=SMALL, batch_size=16, lr=3e-3, packing=True, max_length=48)
    batch = next(iter(module.train_dataloader()))
    assert batch["input_ids"].shape[0] < 16 and "position_ids" in batch
    trainer = _trainer(tmp_path, 5)
    trainer.fit(module)
    assert torch.isfinite(trainer.callback_metrics["train_loss"])


def dropout_off(net) -> bool:
    """No dropout can fire in ``net``, whatever its train/eval mode (rlhf.models.disable_dropout)."""
    return all(m.p == 0.0 for m in net.modules() if isinstance(m, torch.nn.Dropout)) and not any(
        isinstance(getattr(m, "attention_dropout", None), float) and m.attention_dropout for m in net.modules())

"""``RolloutModule`` (recipes/rollout.py), the base of ``PPOModule`` and ``GRPOModule``: its
messages name the class that was built, and the two recipes read the same evaluation
prompts and draw from the same sampling streams (GRPO's ``eval_batch_size`` = PPO's
``rollout_batch_size`` samples the same numbers). No training here: a few seconds."""

from __future__ import annotations

import pytest
import torch

from zeropp_strategy.recipes.grpo import GRPOModule
from zeropp_strategy.recipes.ppo import PPOModule
from zeropp_strategy.recipes.rollout import RolloutModule
from zeropp_strategy.rlhf.models import tiny_llama_config

SMALL = tiny_llama_config(hidden_size=32, intermediate_size=64, num_hidden_layers=2)


def test_both_recipes_are_rollout_modules_and_messages_name_the_class_built():
    assert issubclass(PPOModule, RolloutModule) and issubclass(GRPOModule, RolloutModule)
    with pytest.raises(ValueError, match=r"^PPOModule\(top_k=-1\) is invalid\. Fix: use 0 \(off\)"):
        PPOModule(top_k=-1)
    with pytest.raises(ValueError, match=r"^GRPOModule\(top_k=-1\) is invalid\. Fix: use 0 \(off\)"):
        GRPOModule(top_k=-1)

    class MyPPO(PPOModule):
        pass

    with pytest.raises(ValueError, match=r"^MyPPO\(temperature=0\) is invalid"):
        MyPPO(temperature=0)
    grpo = GRPOModule(actor=SMALL, eval_data=None)
    grpo.configure_model()
    ids = torch.ones(1, 3, dtype=torch.long)
    with pytest.raises(ValueError, match=r"GRPOModule\.forward\(kind='values'\): no such network"):
        grpo("values", ids, ids)


def test_ppo_and_grpo_share_evaluation_prompts_and_sampling_streams():
    ppo = PPOModule(actor=SMALL, reward_model=SMALL, rollout_batch_size=32, seed=3)
    grpo = GRPOModule(actor=SMALL, eval_batch_size=32, seed=3)
    for a, b in zip(ppo.val_dataloader(), grpo.val_dataloader(), strict=True):
        assert torch.equal(a["input_ids"], b["input_ids"]) and a["prompts"] == b["prompts"]
        assert b["columns"] == {}  # the embedded task's records keep the prompt only
    for step in (0, 7, 10**6):
        assert torch.equal(torch.rand(4, generator=ppo._generator(step)), torch.rand(4, generator=grpo._generator(step)))

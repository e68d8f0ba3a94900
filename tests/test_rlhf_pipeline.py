"""``zeropp pipeline`` end to end on 2 CPU processes with a small recipe: every stage reads
the previous one's folder, summary.json has the promised fields, the final actor loads
with ``from_pretrained`` and generates. Plus the recipe checks."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import yaml

from zeropp_strategy.pipeline import load_recipe

SMALL = {"model_type": "llama", "hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 2,
         "num_attention_heads": 2, "num_key_value_heads": 2, "vocab_size": 384, "max_position_embeddings": 64,
         "tie_word_embeddings": False, "pad_token_id": 0, "eos_token_id": 1, "bos_token_id": 1}
RECIPE = {
    "trainer": {"strategy": "zeropp", "accelerator": "cpu", "devices": 2, "precision": "32-true"},
    "sft": {"model": {"model": SMALL, "batch_size": 8}, "trainer": {"max_steps": 4, "limit_val_batches": 1}},
    "reward": {"model": {"batch_size": 4}, "trainer": {"max_steps": 3, "limit_val_batches": 2}},
    "ppo": {"model": {"rollout_batch_size": 4, "mini_batch_size": 2, "max_new_tokens": 3, "actor_lr": 1e-3},
            "trainer": {"max_epochs": 1, "limit_train_batches": 2, "limit_val_batches": 1}},
}
KEYS = ("sft_task_accuracy_greedy", "rm_pairwise_accuracy", "ppo_reward_before", "ppo_reward_after",
        "ppo_task_accuracy_sampled_before", "ppo_task_accuracy_sampled_after", "final_actor", "bytes_sent_rank0")


def test_pipeline_runs_the_three_stages_and_writes_the_summary(tmp_path):
    recipe = tmp_path / "small.yaml"
    recipe.write_text(yaml.safe_dump(RECIPE))
    out = tmp_path / "run"
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    proc = subprocess.run([sys.executable, "-m", "zeropp_strategy.cli", "pipeline", "--config", str(recipe),
                           "--output-dir", str(out)], capture_output=True, text=True, timeout=600, env=env,
                          cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr[-4000:]
    summary = json.loads((out / "summary.json").read_text())
    for key in KEYS:
        assert key in summary, key
    for key in KEYS[:6]:
        assert 0.0 <= summary[key] <= 1.0 or key.startswith("ppo_reward"), (key, summary[key])
    assert all(summary["bytes_sent_rank0"][s] > 0 for s in ("sft", "reward", "ppo"))
    assert (out / "reward" / "value_head.safetensors").is_file() and (out / "reward" / "reward_stats.json").is_file()
    from transformers import AutoModelForCausalLM
    import torch

    actor = AutoModelForCausalLM.from_pretrained(summary["final_actor"])
    generated = actor.generate(torch.tensor([[52, 46, 53, 64]]), max_new_tokens=3, do_sample=False)
    assert 4 < generated.shape[1] <= 7  # it may stop at an EOS


def test_embedded_recipe_is_valid_and_bad_recipes_name_the_block(tmp_path):
    recipe = load_recipe(None)
    assert set(recipe) == {"trainer", "sft", "reward", "ppo"}
    assert recipe["trainer"]["strategy"] == "zeropp" and recipe["trainer"]["devices"] == 2
    bad = tmp_path / "bad.yaml"
    bad.write_text("trainer: {}\nrm: {}\n")
    with pytest.raises(ValueError, match=r"unknown block\(s\) \['rm'\].*Fix"):
        load_recipe(str(bad))
    bad.write_text("sft: {lr: 0.1}\n")
    with pytest.raises(ValueError, match=r"sft has unknown key\(s\) \['lr'\].*sft.model"):
        load_recipe(str(bad))
    with pytest.raises(FileNotFoundError, match="no such file"):
        load_recipe(str(tmp_path / "missing.yaml"))


GRPO_RECIPE = {
    "trainer": RECIPE["trainer"],
    "sft": RECIPE["sft"],
    "grpo": {"model": {"rollout_batch_size": 2, "num_generations": 4, "mini_batch_size": 8, "max_new_tokens": 3,
                       "lr": 1e-3},
             "trainer": {"max_epochs": 1, "limit_train_batches": 2, "limit_val_batches": 1}},
}


def test_pipeline_rl_grpo_runs_sft_then_grpo_and_writes_the_summary(tmp_path):
    """``--rl grpo``: no reward stage, the summary names the RL stage and has the GRPO fields."""
    recipe = tmp_path / "small_grpo.yaml"
    recipe.write_text(yaml.safe_dump(GRPO_RECIPE))
    out = tmp_path / "run"
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    proc = subprocess.run([sys.executable, "-m", "zeropp_strategy.cli", "pipeline", "--rl", "grpo", "--config",
                           str(recipe), "--output-dir", str(out)], capture_output=True, text=True, timeout=600,
                          env=env, cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr[-4000:]
    summary = json.loads((out / "summary.json").read_text())
    assert summary["rl"] == "grpo" and not (out / "reward").exists() and "rm_pairwise_accuracy" not in summary
    for key in ("sft_task_accuracy_greedy", "grpo_task_accuracy_sampled_before", "grpo_task_accuracy_sampled_after",
                "actor_greedy_task_accuracy"):
        assert 0.0 <= summary[key] <= 1.0, (key, summary[key])
    assert set(summary["bytes_sent_rank0"]) == {"sft", "grpo"} and all(summary["bytes_sent_rank0"].values())
    assert summary["final_actor"] == str(out / "actor") and (out / "actor" / "config.json").is_file()


def test_embedded_grpo_recipe_shares_the_sft_stage_and_rl_is_checked():
    from zeropp_strategy.pipeline import main

    grpo, ppo = load_recipe(None, rl="grpo"), load_recipe(None)
    assert set(grpo) == {"trainer", "sft", "grpo"}
    assert grpo["sft"] == ppo["sft"] and grpo["trainer"] == ppo["trainer"]  # the same SFT model
    with pytest.raises(ValueError, match=r"argument --rl: invalid choice: 'dpo'.*Fix"):
        main(["--rl", "dpo", "--output-dir", "x"])

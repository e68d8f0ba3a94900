"""A correct run prints nothing alarming: warnings our own code caused, checked at the cause.

- Every ``zeropp fit`` recipe logs its training metrics within the first epoch
  (``log_every_n_steps`` at most the batches of an epoch): otherwise Lightning warns and
  ``metrics.csv`` may hold no training loss at all (the PPO recipe has 3 rollouts per
  epoch). Each recipe also names its seed and its logger (no fallback warnings).
- Loading a Hugging Face folder goes without transformers' ``torch_dtype`` deprecation.

Elsewhere: the FSDP2 view-output warning in tests/test_rlhf_ppo.py, the launch module's
runpy warning in tests/test_accelerate.py.
"""

from __future__ import annotations

import importlib
import math
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

ROOT = Path(__file__).resolve().parents[1]
FIT_RECIPES = sorted(p for p in (ROOT / "recipes").glob("*.yaml") if "class_path" in p.read_text())


def _batches_per_epoch(recipe: dict) -> int:
    """Training batches per process and epoch, as Lightning's distributed sampler splits them."""
    module_path, name = recipe["model"]["class_path"].rsplit(".", 1)
    module = getattr(importlib.import_module(module_path), name)(**recipe["model"]["init_args"])
    loader = module.train_dataloader()
    per_rank = math.ceil(len(loader.dataset) / recipe["trainer"].get("devices", 1))
    return per_rank // loader.batch_size if loader.drop_last else math.ceil(per_rank / loader.batch_size)


def test_fit_recipes_are_found():
    assert {p.stem for p in FIT_RECIPES} >= {"sft", "reward", "dpo", "ppo"}


@pytest.mark.parametrize("path", FIT_RECIPES, ids=lambda p: p.stem)
def test_recipe_logs_training_metrics_every_epoch(path):
    recipe = yaml.safe_load(path.read_text())
    trainer = recipe["trainer"]
    every = trainer.get("log_every_n_steps", 50)  # Lightning's default
    batches = _batches_per_epoch(recipe)
    assert 1 <= every <= batches, f"{path.name}: log_every_n_steps={every} > {batches} training batches per epoch"
    steps = trainer.get("max_steps", -1)
    if steps is not None and steps > 0:
        assert every <= steps, f"{path.name}: max_steps={steps} ends before the first log"
    # Named, not left to Lightning's fallbacks (each of which warns).
    assert isinstance(recipe.get("seed_everything"), int), path.name
    assert trainer["logger"]["class_path"].endswith("CSVLogger"), path.name


def test_loading_a_pretrained_folder_has_no_deprecation_warning(tmp_path):
    """transformers' ``torch_dtype`` warning is logged once per process: a fresh one loads."""
    from zeropp_strategy.rlhf.models import build_causal_lm, tiny_llama_config

    build_causal_lm(tiny_llama_config(hidden_size=16, intermediate_size=32, num_hidden_layers=1)).save_pretrained(
        tmp_path / "lm")
    code = ("import torch; from zeropp_strategy.rlhf.models import build_causal_lm; "
            f"build_causal_lm({str(tmp_path / 'lm')!r}); build_causal_lm({str(tmp_path / 'lm')!r}, dtype=torch.bfloat16)")
    proc = subprocess.run([sys.executable, "-W", "default", "-c", code], capture_output=True, text=True, timeout=300,
                          cwd=ROOT)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "deprecated" not in proc.stderr.lower(), proc.stderr[-3000:]

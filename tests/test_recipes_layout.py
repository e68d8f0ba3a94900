"""The RLHF LightningModules live in ``recipes/`` (``zeropp_strategy.recipes``), beside their
YAML: the old homes in ``zeropp_strategy.rlhf`` are gone (docs/changes.md) and a recipe that
names one is told the new home in one line (so is one naming the Lightning strategy or
precision plugin by its module before the move to ``zeropp_strategy.lightning``), importing
the package for its YAML loads neither torch nor Lightning, and sampling hands the KV cache
over by the name the installed transformers takes (``cache`` in 5.x, ``past_key_values`` in
4.x), so it warns nothing."""

from __future__ import annotations

import importlib
import subprocess
import sys
import warnings
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
import yaml
from torch import nn

ROOT = Path(__file__).resolve().parents[1]

from zeropp_strategy.fit import _REMOVED_PATHS as MOVED  # the old import path -> the new home


def _resolve(path: str) -> object:
    module, _, name = path.rpartition(".")
    return getattr(importlib.import_module(module), name)


def test_the_old_import_paths_are_gone_and_the_new_homes_resolve() -> None:
    import zeropp_strategy.recipes as recipes

    for old, new in MOVED.items():
        with pytest.raises(ModuleNotFoundError):
            _resolve(old)
        assert _resolve(new).__name__ == old.rpartition(".")[2], new
    for name in recipes.__all__:  # the lazy names of the package
        assert getattr(recipes, name) is _resolve(f"zeropp_strategy.recipes.{name.lower().removesuffix('module')}"
                                                   f".{name}"), name
    with pytest.raises(AttributeError, match="NoSuchModule"):
        recipes.NoSuchModule  # noqa: B018


def test_shipped_recipes_name_the_new_homes() -> None:
    shipped = {}
    for path in sorted(ROOT.glob("recipes/*.yaml")):
        model = (yaml.safe_load(path.read_text()) or {}).get("model") or {}
        if "class_path" in model:
            shipped[path.name] = model["class_path"]
    assert set(shipped) == {"sft.yaml", "reward.yaml", "dpo.yaml", "ppo.yaml", "grpo.yaml"}, shipped
    for name, class_path in shipped.items():
        assert class_path in MOVED.values(), (name, class_path)
        module = class_path.rsplit(".", 2)[-2]
        assert (ROOT / "recipes" / f"{module}.py").is_file() and name == f"{module}.yaml", (name, class_path)


def test_importing_recipes_for_the_yaml_loads_neither_torch_nor_lightning(tmp_path: Path) -> None:
    code = (
        "import sys\n"
        "from importlib import resources\n"
        "import zeropp_strategy.recipes\n"
        "assert resources.files('zeropp_strategy.recipes').joinpath('sft.yaml').is_file()\n"
        "print(sorted(m for m in ('torch', 'lightning', 'transformers') if m in sys.modules))\n"
    )
    proc = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-4000:]
    assert proc.stdout.strip() == "[]", proc.stdout


def test_a_recipe_with_an_old_class_path_is_told_the_new_home(tmp_path: Path, capsys,
                                                              monkeypatch: pytest.MonkeyPatch) -> None:
    """``zeropp fit`` on a recipe written before the move (``zeropp_strategy.rlhf.modules``):
    one line naming the removed path and the class's home, before anything starts."""
    from zeropp_strategy.cli import main

    recipe = tmp_path / "old.yaml"
    recipe.write_text(yaml.safe_dump({"model": {"class_path": "zeropp_strategy.rlhf.modules.SFTModule"},
                                      "trainer": {"default_root_dir": str(tmp_path / "run")}}))
    argv = ["fit", "--config", str(recipe)]
    monkeypatch.setattr(sys, "argv", ["zeropp", *argv])  # as the console command runs it
    assert main(argv) == 2
    err = capsys.readouterr().err.strip()
    assert err == ("error: zeropp fit: class_path 'zeropp_strategy.rlhf.modules.SFTModule' was removed. Fix: use "
                   "'zeropp_strategy.recipes.sft.SFTModule', the class's home since the recipes moved to recipes/"), err
    assert not (tmp_path / "run").exists()


def test_a_recipe_naming_the_strategy_by_its_old_module_is_told_the_new_home(
        tmp_path: Path, capsys, monkeypatch: pytest.MonkeyPatch) -> None:
    """The Lightning front-end moved to ``zeropp_strategy.lightning`` (docs/changes.md): a
    recipe whose trainer names ``zeropp_strategy.strategy.ZeroPPStrategy`` gets one line."""
    from zeropp_strategy.cli import main

    recipe = tmp_path / "old.yaml"
    recipe.write_text(yaml.safe_dump({
        "model": {"class_path": "zeropp_strategy.recipes.sft.SFTModule"},
        "trainer": {"default_root_dir": str(tmp_path / "run"),
                    "strategy": {"class_path": "zeropp_strategy.strategy.ZeroPPStrategy"}}}))
    argv = ["fit", "--config", str(recipe)]
    monkeypatch.setattr(sys, "argv", ["zeropp", *argv])
    assert main(argv) == 2
    err = capsys.readouterr().err.strip()
    assert err == ("error: zeropp fit: class_path 'zeropp_strategy.strategy.ZeroPPStrategy' was removed. Fix: use "
                   "'zeropp_strategy.lightning.strategy.ZeroPPStrategy', the class's home since the Lightning "
                   "front-end moved to zeropp_strategy.lightning"), err
    assert not (tmp_path / "run").exists()


# -- the KV cache's name --------------------------------------------------------------------


class _CacheLM(nn.Module):
    """A causal LM of transformers 5.x's calling convention: the KV cache in and out as ``cache``."""

    def __init__(self, vocab: int = 11) -> None:
        super().__init__()
        self.vocab, self.seen = vocab, []

    def _out(self, input_ids: torch.Tensor, cache: object, name: str) -> SimpleNamespace:
        self.seen.append(cache)
        logits = torch.zeros(*input_ids.shape, self.vocab)
        return SimpleNamespace(logits=logits, **{name: len(self.seen)})

    def forward(self, input_ids, attention_mask=None, position_ids=None, cache=None, use_cache=None, **kwargs):
        assert not kwargs, kwargs  # an unknown name would land here, unused
        return self._out(input_ids, cache, "cache")


class _PastKeyValuesLM(_CacheLM):
    """transformers 4.x's convention: ``past_key_values`` in and out."""

    def forward(self, input_ids, attention_mask=None, position_ids=None, past_key_values=None, use_cache=None,
                **kwargs):
        assert not kwargs, kwargs
        return self._out(input_ids, past_key_values, "past_key_values")


@pytest.mark.parametrize("lm", [_CacheLM, _PastKeyValuesLM])
@pytest.mark.parametrize("wrapped", [False, True])
def test_sample_passes_the_cache_by_the_name_the_model_takes(lm: type[_CacheLM], wrapped: bool) -> None:
    from zeropp_strategy.rlhf.generation import sample

    model = lm()
    call = (lambda **kwargs: model(**kwargs)) if wrapped else model  # a wrapper: read from the output
    ids, mask = torch.ones(2, 3, dtype=torch.long), torch.ones(2, 3, dtype=torch.long)
    out = sample(call, ids, mask, max_new_tokens=4, eos_id=99, pad_id=0)
    assert out.shape == (2, 4)
    assert model.seen == [None, 1, 2, 3]  # each step got the cache the previous one returned


def test_sampling_a_transformers_model_warns_nothing() -> None:
    from zeropp_strategy.rlhf.generation import sample
    from zeropp_strategy.rlhf.models import build_causal_lm, tiny_llama_config

    torch.manual_seed(0)
    model = build_causal_lm(tiny_llama_config(hidden_size=32, intermediate_size=64, num_hidden_layers=2)).eval()
    ids, mask = torch.randint(3, 300, (2, 3)), torch.ones(2, 3, dtype=torch.long)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # transformers 5.x: `past_key_values` is a FutureWarning per call
        first = sample(model, ids, mask, max_new_tokens=5, eos_id=1, pad_id=0, top_k=1, stop_when_done=False)
    with torch.no_grad():  # the cache carried the prompt: greedy steps equal full forwards
        seq = ids
        for _ in range(5):
            nxt = model(input_ids=seq, attention_mask=torch.ones_like(seq)).logits[:, -1].argmax(-1, keepdim=True)
            seq = torch.cat([seq, nxt], 1)
    assert torch.equal(first, seq[:, 3:])

"""The arguments ``SFTModule``, ``RewardModule`` and ``DPOModule`` share (documented once, on
``recipes.base.DatasetModule``): ``zeropp fit`` shows each with its class's own default and
the base's help, the unknown-key check knows them, every argument is a hyper-parameter,
and a checkpoint rebuilds the module from them."""

from __future__ import annotations

import inspect
import sys

import pytest
import torch
import yaml

from zeropp_strategy.cli import UsageError, check_arguments
from zeropp_strategy.recipes.base import DatasetModule
from zeropp_strategy.recipes.dpo import DPOModule
from zeropp_strategy.recipes.reward import RewardModule
from zeropp_strategy.recipes.sft import SFTModule
from zeropp_strategy.rlhf.models import tiny_llama_config

SHARED = {"model": None, "tokenizer": None, "data": "embedded:addition", "batch_size": 32, "max_length": 64,
          "lr": 1e-3, "weight_decay": 0.0, "val_fraction": 0.1, "seed": 0, "export_dir": None, "dtype": None}
# each class's defaults: the shared ones (where a class differs, it says so in its docstring) and its own
DEFAULTS = {
    SFTModule: {**SHARED, "val_fraction": 0.05, "train_on_prompt": False, "packing": False, "lora": None},
    RewardModule: {**SHARED, "margin": 0.0, "center_coef": 0.0, "lora": None},
    DPOModule: {**SHARED, "batch_size": 16, "lr": 5e-4, "beta": 0.1, "lora": None, "precompute_reference": False},
}
CLASSES = list(DEFAULTS)
SMALL = tiny_llama_config(hidden_size=32, intermediate_size=64, num_hidden_layers=2)


def _fit_stdout(argv: list[str], monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> str:
    from zeropp_strategy.fit import fit

    monkeypatch.setattr(sys, "argv", ["zeropp"])  # LightningCLI warns when sys.argv has args (pytest's)
    capsys.readouterr()
    with pytest.raises(SystemExit) as exc:  # --print_config and --model.help print, then exit
        fit(argv)
    assert exc.value.code == 0, argv
    return capsys.readouterr().out


def test_the_shared_arguments_are_documented_once_on_the_base() -> None:
    doc = inspect.getdoc(DatasetModule)
    for name in SHARED:
        assert f"\n    {name}: " in doc, name
    for cls in CLASSES:
        assert "recipes.base.DatasetModule" in inspect.getdoc(cls), cls.__name__


@pytest.mark.parametrize("cls", CLASSES, ids=lambda c: c.__name__)
def test_zeropp_fit_shows_each_argument_with_the_class_default(cls, monkeypatch, capsys) -> None:
    config = yaml.safe_load(_fit_stdout(["--model", cls.__name__, "--print_config"], monkeypatch, capsys))
    assert config["model"]["init_args"] == DEFAULTS[cls]
    # the order of the signature: the shared arguments with the class's own in between
    assert list(config["model"]["init_args"]) == list(inspect.signature(cls).parameters)


@pytest.mark.parametrize("cls", CLASSES, ids=lambda c: c.__name__)
def test_zeropp_fit_help_describes_every_shared_argument(cls, monkeypatch, capsys) -> None:
    text = " ".join(_fit_stdout(["--model.help", cls.__name__], monkeypatch, capsys).split())
    for name, default in DEFAULTS[cls].items():
        assert f"--model.{name} " in text, name
    for phrase in ("AdamW's learning rate. (type: float, default: {lr})",
                   "the train/validation split and the shuffling. (type: int, default: 0)",
                   "part of the records held out for validation, in [0, 1). (type: float, default: {val_fraction})"):
        assert phrase.format(**DEFAULTS[cls]) in text, phrase


@pytest.mark.parametrize("cls", CLASSES, ids=lambda c: c.__name__)
def test_the_unknown_key_check_knows_every_argument(cls) -> None:
    check_arguments(cls, DEFAULTS[cls], "test")  # a **kwargs would turn the check off
    with pytest.raises(UsageError, match="rename 'weightdecay' to 'weight_decay'"):
        check_arguments(cls, ["weightdecay"], "test")


@pytest.mark.parametrize("cls", CLASSES, ids=lambda c: c.__name__)
def test_every_argument_is_a_hyper_parameter_and_reaches_the_module(cls) -> None:
    assert dict(cls().hparams) == DEFAULTS[cls]
    given = {"model": SMALL, "tokenizer": "byt5", "batch_size": 4, "max_length": 48, "lr": 0.25,
             "weight_decay": 0.01, "val_fraction": 0.2, "seed": 7, "export_dir": "out", "dtype": "bf16"}
    module = cls(**given)
    assert dict(module.hparams) == {**DEFAULTS[cls], **given}
    assert module.model_spec == SMALL and module.weights_dtype == torch.bfloat16 and module.export_dir == "out"
    for name in ("batch_size", "max_length", "lr", "weight_decay", "val_fraction", "seed"):
        assert getattr(module, name) == given[name], name
    module.configure_model()
    adamw = module.configure_optimizers().defaults
    assert (adamw["lr"], adamw["weight_decay"]) == (0.25, 0.01)
    with pytest.raises(ValueError, match="val_fraction=1.0 is invalid"):
        cls(val_fraction=1.0)


@pytest.mark.parametrize("cls", CLASSES, ids=lambda c: c.__name__)
def test_a_checkpoint_rebuilds_the_module_from_its_hyper_parameters(cls, tmp_path) -> None:
    import lightning

    module = cls(model=SMALL, batch_size=4, lr=0.01, seed=3)
    module.configure_model()
    path = tmp_path / "m.ckpt"
    torch.save({"state_dict": module.state_dict(), "hyper_parameters": dict(module.hparams),
                "pytorch-lightning_version": lightning.__version__}, path)
    loaded = cls.load_from_checkpoint(path)
    assert dict(loaded.hparams) == dict(module.hparams)
    assert (loaded.lr, loaded.batch_size, loaded.seed) == (0.01, 4, 3)
    expected = module.state_dict()
    assert all(torch.equal(t, expected[k]) for k, t in loaded.state_dict().items())


def test_the_values_handed_on_are_the_ones_used() -> None:
    """The base takes what its subclass passes on, not what Lightning's hparams gather from
    every __init__ up the stack: a subclass that changes an argument first, and a recipe built
    inside another module's __init__ (whose own arguments have the same names), get their
    own values."""
    from lightning.pytorch import LightningModule

    class Scaled(SFTModule):
        def __init__(self, lr: float = 1.0, batch_size: int = 4, **kwargs):
            super().__init__(lr=lr / 100, batch_size=batch_size * 2, **kwargs)

    scaled = Scaled()
    assert (scaled.lr, scaled.batch_size) == (0.01, 8)

    class Wrapper(LightningModule):
        def __init__(self, lr: float = 7.0, batch_size: int = 999, data: str = "mine.jsonl"):
            super().__init__()
            self.inner = SFTModule(model=SMALL, lr=1e-4, batch_size=2)

    inner = Wrapper().inner
    assert (inner.lr, inner.batch_size, inner.data) == (1e-4, 2, "embedded:addition")
    assert DatasetModule.shared({**DEFAULTS[SFTModule], "self": None}) == {k: DEFAULTS[SFTModule][k] for k in SHARED}

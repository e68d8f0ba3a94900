"""Layer: commands. ``zeropp fit``: LightningCLI over the RLHF modules (the recipes).

    zeropp fit --config recipes/sft.yaml
    zeropp fit --config recipes/reward.yaml --model.model runs/sft/hf --trainer.max_steps 200
    zeropp fit --help                                  # every field
    zeropp fit --model.help SFTModule                  # one module's fields

Every ``__init__`` argument of the module (``--model.*``) and of ``Trainer``
(``--trainer.*``) is a field of the recipe and can be overridden on the command line; the
module is chosen by ``model.class_path`` in the recipe (``SFTModule``, ``RewardModule``,
``DPOModule``, ``PPOModule``, ``GRPOModule``). Importing ``zeropp_strategy`` first registers ``strategy: zeropp``.

A field LightningCLI rejects, or one the module or ``Trainer`` refuses when built, is a
``UsageError``: one line ``error: ... Fix: ...`` and exit status 2 (see ``zeropp_strategy.cli``).
"""

from __future__ import annotations

import importlib
import re
import sys
from argparse import ArgumentError
from typing import Any

from lightning.fabric.utilities.exceptions import MisconfigurationException
from lightning.pytorch import LightningModule, Trainer
from lightning.pytorch.cli import LightningCLI

import zeropp_strategy  # noqa: F401 - registers the strategy names
import zeropp_strategy.recipes.dpo  # noqa: F401 - makes the short class names resolvable
import zeropp_strategy.recipes.grpo  # noqa: F401
import zeropp_strategy.recipes.ppo  # noqa: F401
import zeropp_strategy.recipes.reward  # noqa: F401
import zeropp_strategy.recipes.sft  # noqa: F401
from zeropp_strategy.errors import UsageError, check_arguments

__all__ = ["fit"]

_HELP = "run `zeropp fit --help` for fit's fields (a module's own: `zeropp fit --model.help SFTModule`)"
# jsonargparse's lines that say nothing about the mistake itself
_NOISE = ("Does not validate against any of the", "Subtypes:", "Errors:", "Expected a <class 'NoneType'>",
          "Given value")
_UNKNOWN_OPTION = re.compile(r"class_path '([\w.]+)':\s*Option '(\w+)' is not accepted")
# Import paths removed on 2026-11-27 (docs/changes.md) -> the class's home: a recipe naming one
# (the model's class_path, or the trainer's strategy or plugins) is told where it went
_REMOVED_PATHS = {
    "zeropp_strategy.rlhf.modules.SFTModule": "zeropp_strategy.recipes.sft.SFTModule",
    "zeropp_strategy.rlhf.modules.RewardModule": "zeropp_strategy.recipes.reward.RewardModule",
    "zeropp_strategy.rlhf.modules.DPOModule": "zeropp_strategy.recipes.dpo.DPOModule",
    "zeropp_strategy.rlhf.ppo.PPOModule": "zeropp_strategy.recipes.ppo.PPOModule",
    "zeropp_strategy.rlhf.grpo.GRPOModule": "zeropp_strategy.recipes.grpo.GRPOModule",
    "zeropp_strategy.strategy.ZeroPPStrategy": "zeropp_strategy.lightning.strategy.ZeroPPStrategy",
    "zeropp_strategy.precision.ZeroPPPrecision": "zeropp_strategy.lightning.precision.ZeroPPPrecision",
}
# the new home's package -> the move that put the class there (the fix names it)
_MOVES = {
    "zeropp_strategy.recipes.": "the recipes moved to recipes/",
    "zeropp_strategy.lightning.": "the Lightning front-end moved to zeropp_strategy.lightning",
}
_UNKNOWN_TRAINER_FIELD = re.compile(r"(?:unrecognized arguments: --|does not accept option ')trainer\.(\w+)")


def _unknown_field(message: str) -> UsageError | None:
    """For an unknown module or Trainer field: the error naming the valid fields and the closest one."""
    model, trainer = _UNKNOWN_OPTION.search(message), _UNKNOWN_TRAINER_FIELD.search(message)
    if model:
        module, _, name = model.group(1).rpartition(".")
        func, key, block = getattr(importlib.import_module(module), name), model.group(2), "model"
    elif trainer:
        func, key, block = Trainer, trainer.group(1), "trainer"
    else:
        return None
    try:
        check_arguments(func, [key], f"zeropp fit: {block}")
    except UsageError as usage:
        return UsageError(usage.what, f"{usage.fix}; {_HELP}")
    return None


def _usage_error(err: ArgumentError) -> UsageError:
    message = str(err)
    if "arguments are required: fit.model" in message:
        return UsageError("zeropp fit: no model given",
                          "pass a recipe, e.g. `zeropp fit --config recipes/sft.yaml`, or --model CLASS; " + _HELP)
    moved = next((old for old in _REMOVED_PATHS if f"'{old}'" in message), None)
    if moved is not None:
        home = _REMOVED_PATHS[moved]
        why = next(move for package, move in _MOVES.items() if home.startswith(package))
        return UsageError(f"zeropp fit: class_path {moved!r} was removed",
                          f"use {home!r}, the class's home since {why}")
    lines = [line.strip().removeprefix("- ") for line in message.splitlines()]
    return _unknown_field(message) or UsageError(
        "zeropp fit: " + " ".join(line for line in lines if line and not line.startswith(_NOISE)), _HELP)


class _FitCLI(LightningCLI):
    """Only ``fit``, and a rejected field raises ``UsageError`` instead of exiting."""

    @staticmethod
    def subcommands() -> dict[str, set[str]]:
        return {"fit": LightningCLI.subcommands()["fit"]}

    def parse_arguments(self, parser: Any, args: Any) -> None:
        try:
            super().parse_arguments(parser, args)
        except ArgumentError as err:
            raise _usage_error(err) from None

    def instantiate_classes(self) -> None:
        try:
            super().instantiate_classes()
        except (ValueError, MisconfigurationException) as err:  # e.g. --trainer.strategy nonsense
            if isinstance(err, UsageError):
                raise
            raise UsageError(f"zeropp fit: {err}", _HELP) from None


def fit(argv: list[str]) -> int:
    command = ["fit", *argv]
    _FitCLI(
        LightningModule,
        subclass_mode_model=True,
        # From the `zeropp` command, LightningCLI reads sys.argv itself: giving the same
        # arguments again as `args` is what its "args and command line" warning is about.
        args=None if sys.argv[1:] == command else command,
        save_config_kwargs={"overwrite": True},
        auto_configure_optimizers=False,
        parser_kwargs={"prog": "zeropp", "exit_on_error": False, "fit": {"exit_on_error": False}},
    )
    return 0

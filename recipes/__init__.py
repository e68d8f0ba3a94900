"""Layer: recipes. The ready-made LightningModules and their YAML recipes, installed as
``zeropp_strategy.recipes``.

    from zeropp_strategy.recipes import SFTModule, RewardModule, DPOModule, PPOModule, GRPOModule

One module per recipe, beside its YAML: ``sft.py`` / ``sft.yaml``, ``reward.py``,
``dpo.py``, ``ppo.py``, ``grpo.py`` (``base.py``: what SFT, reward and DPO share;
``rollout.py``: ``RolloutModule``, what PPO and GRPO share, not a recipe of its own); the
pipeline recipes (``pipeline*.yaml``) and the Accelerate launch configs (``accelerate/``)
are data only. The modules are built on the framework-free pieces of ``zeropp_strategy.rlhf``
(formulas, data, models, generation, export).

The names above load on first use (PEP 562): ``import zeropp_strategy.recipes``, e.g. to
find the YAML files, imports neither torch nor Lightning.
"""

from __future__ import annotations

import importlib
from typing import Any

# public name -> the file of this package that defines it
_HOMES = {"DPOModule": "dpo", "GRPOModule": "grpo", "PPOModule": "ppo", "RewardModule": "reward", "SFTModule": "sft"}

__all__ = sorted(_HOMES)


def __getattr__(name: str) -> Any:
    if name not in _HOMES:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    return getattr(importlib.import_module(f"{__name__}.{_HOMES[name]}"), name)

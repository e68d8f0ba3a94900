"""Layer: recipes (the old import path). ``PPOModule`` now lives in
``zeropp_strategy.recipes.ppo`` (``recipes/ppo.py``, beside ``ppo.yaml``); this module
re-exports it, so that imports and recipe ``class_path``s naming
``zeropp_strategy.rlhf.ppo`` keep working.
"""

from zeropp_strategy.recipes.ppo import PPOModule

__all__ = ["PPOModule"]

"""Layer: recipes (the old import path). ``GRPOModule`` now lives in
``zeropp_strategy.recipes.grpo`` (``recipes/grpo.py``, beside ``grpo.yaml``); this module
re-exports it, so that imports and recipe ``class_path``s naming
``zeropp_strategy.rlhf.grpo`` keep working.
"""

from zeropp_strategy.recipes.grpo import GRPOModule

__all__ = ["GRPOModule"]

"""Layer: recipes (the old import path). ``SFTModule``, ``RewardModule`` and ``DPOModule``
now live in ``zeropp_strategy.recipes`` (``recipes/sft.py``, ``reward.py`` and ``dpo.py``,
beside their YAML); this module re-exports them, so that imports and recipe
``class_path``s naming ``zeropp_strategy.rlhf.modules`` keep working.
"""

from zeropp_strategy.recipes.dpo import DPOModule, sequence_logprobs
from zeropp_strategy.recipes.reward import RewardModule
from zeropp_strategy.recipes.sft import SFTModule

__all__ = ["DPOModule", "RewardModule", "SFTModule", "sequence_logprobs"]

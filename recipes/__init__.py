"""Ready-made recipes for zeropp-strategy, installed as ``zeropp_strategy.recipes``."""

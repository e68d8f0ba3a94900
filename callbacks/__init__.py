"""Lightning callbacks for zeropp-strategy, installed as ``zeropp_strategy.callbacks``."""

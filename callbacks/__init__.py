"""Layer: recipes (callbacks). Lightning callbacks for zeropp-strategy, installed as ``zeropp_strategy.callbacks``.

    from zeropp_strategy.callbacks import CommVolumeMonitor, MemoryMonitor, ShardedEMA, ThroughputMonitor
"""

from zeropp_strategy.callbacks.ema import ShardedEMA
from zeropp_strategy.callbacks.monitors import CommVolumeMonitor, MemoryMonitor, ThroughputMonitor, count_tokens

__all__ = ["CommVolumeMonitor", "MemoryMonitor", "ShardedEMA", "ThroughputMonitor", "count_tokens"]

"""ZeRO stages 1/2/3 and ZeRO++ for PyTorch, as a Lightning strategy.

Importing this package registers ``zeropp``, ``zeropp_stage_1``, ``zeropp_stage_2`` and
``zeropp_stage_3`` in Lightning's strategy registry (``lightning.pytorch``, and the
standalone ``pytorch_lightning`` package too when it is installed), so that
``Trainer(strategy="zeropp_stage_3")`` works after ``import zeropp_strategy``.
"""

from zeropp_strategy.config import OffloadConfig, ZeroConfig, ZeroConfigWarning
from zeropp_strategy.topology import Topology
from zeropp_strategy.comm.ledger import CommKind, CommLedger, CommTotals, Phase
from zeropp_strategy.engine.memory import MemoryStats
from zeropp_strategy.precision import ShardedGradScaler, ZeroPPPrecision
from zeropp_strategy.strategy import PRESETS, ZeroPPStrategy
from zeropp_strategy._registry import register_all

__version__ = "0.1.0"

__all__ = [
    "PRESETS",
    "CommKind",
    "CommLedger",
    "CommTotals",
    "MemoryStats",
    "OffloadConfig",
    "Phase",
    "ShardedGradScaler",
    "Topology",
    "ZeroConfig",
    "ZeroConfigWarning",
    "ZeroPPPrecision",
    "ZeroPPStrategy",
]

register_all()

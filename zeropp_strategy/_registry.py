"""Register our strategy names with every Lightning flavour that is installed.

``lightning.pytorch`` and the standalone ``pytorch_lightning`` are separate packages
with separate base classes: a ``lightning.pytorch`` strategy is rejected by a
``pytorch_lightning.Trainer``. Lightning itself ships the second as a source-level
mirror of the first, so we do the same for our two Lightning-facing modules: load
their source with the package names swapped, under private module names.
"""

from __future__ import annotations

import importlib
import importlib.util
import sys
from types import ModuleType

_MIRRORED = ("precision", "strategy")
_SWAPS = (
    ("lightning.pytorch", "pytorch_lightning"),
    ("lightning.fabric", "lightning_fabric"),
    ("zeropp_strategy.precision", "zeropp_strategy._pl_precision"),
)


def _mirror(name: str) -> ModuleType:
    """``zeropp_strategy.<name>`` rebuilt against ``pytorch_lightning``."""
    mirror_name = f"zeropp_strategy._pl_{name}"
    if mirror_name in sys.modules:
        return sys.modules[mirror_name]
    spec = importlib.util.find_spec(f"zeropp_strategy.{name}")
    assert spec is not None and spec.origin is not None
    with open(spec.origin, encoding="utf-8") as f:
        source = f.read()
    for old, new in _SWAPS:
        source = source.replace(old, new)
    module = ModuleType(mirror_name)
    module.__file__ = spec.origin
    module.__package__ = "zeropp_strategy"
    sys.modules[mirror_name] = module
    exec(compile(source, spec.origin, "exec"), module.__dict__)  # noqa: S102 - our own source
    return module


def pytorch_lightning_strategy() -> type | None:
    """``ZeroPPStrategy`` for ``pytorch_lightning.Trainer``, or None if not installed."""
    if importlib.util.find_spec("pytorch_lightning") is None:
        return None
    for name in _MIRRORED:
        _mirror(name)
    return sys.modules["zeropp_strategy._pl_strategy"].ZeroPPStrategy


def register_all() -> None:
    from lightning.pytorch.strategies import StrategyRegistry

    from zeropp_strategy.strategy import ZeroPPStrategy

    ZeroPPStrategy.register_strategies(StrategyRegistry)

    from lightning.fabric.strategies import STRATEGY_REGISTRY

    from zeropp_strategy.fabric import ZeroPPFabricStrategy

    ZeroPPFabricStrategy.register_strategies(STRATEGY_REGISTRY)
    pl_cls = pytorch_lightning_strategy()
    if pl_cls is not None:
        from pytorch_lightning.strategies import StrategyRegistry as PLRegistry

        pl_cls.register_strategies(PLRegistry)

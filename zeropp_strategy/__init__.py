"""Layer: package root. ZeRO stages 1/2/3 and ZeRO++ for PyTorch, as a Lightning strategy.

``import zeropp_strategy`` registers the names of ``PRESETS`` (``zeropp``,
``zeropp_stage_1`` ... ``zeropp_stage_3`` and the others listed in docs/strategy.md) in Lightning's strategy registries (``lightning.pytorch``,
``lightning.fabric``, and the standalone ``pytorch_lightning`` package when it is used),
so that ``Trainer(strategy="zeropp_stage_3")`` works after ``import zeropp_strategy``,
whichever of the two is imported first.

The import itself is cheap: the names below are loaded on first use (PEP 562), and the
registration runs as soon as Lightning is imported (see ``_registry``). That keeps
``zeropp --help`` free of torch and Lightning.
"""

from __future__ import annotations

import importlib
from typing import Any

from zeropp_strategy._registry import register_when_imported

__version__ = "0.1.0"

# public name -> the module that defines it
_EXPORTS = {
    "PRESETS": "zeropp_strategy.presets",
    "CommKind": "zeropp_strategy.comm.ledger",
    "CommLedger": "zeropp_strategy.comm.ledger",
    "CommTotals": "zeropp_strategy.comm.ledger",
    "GradientReadWarning": "zeropp_strategy.engine.grad_reads",
    "MemoryStats": "zeropp_strategy.engine.memory",
    "OffloadConfig": "zeropp_strategy.config",
    "Phase": "zeropp_strategy.comm.ledger",
    "ShardedGradScaler": "zeropp_strategy.engine.precision",
    "Topology": "zeropp_strategy.topology",
    "ZeroConfig": "zeropp_strategy.config",
    "ZeroConfigWarning": "zeropp_strategy.config",
    "ZeroPPPrecision": "zeropp_strategy.lightning.precision",
    "ZeroPPStrategy": "zeropp_strategy.lightning.strategy",
    "export_adapters": "zeropp_strategy.checkpoint.export",
    "export_pretrained": "zeropp_strategy.checkpoint.export",
    "from_pretrained": "zeropp_strategy.engine.pretrained",
}

__all__ = sorted(_EXPORTS)


def __getattr__(name: str) -> Any:
    if name in _EXPORTS:
        value = getattr(importlib.import_module(_EXPORTS[name]), name)
    elif name.startswith("__"):
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    else:  # a submodule, as `import zeropp_strategy; zeropp_strategy.engine` worked when everything was eager
        try:
            value = importlib.import_module(f"{__name__}.{name}")
        except ModuleNotFoundError as err:
            if err.name != f"{__name__}.{name}":
                raise
            raise AttributeError(f"module {__name__!r} has no attribute {name!r}") from None
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted({*globals(), *__all__})


register_when_imported()

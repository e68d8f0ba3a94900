"""Layer: front-end registry (above the front-ends). Register our strategy names with every
Lightning flavour in use, when it is imported.

``import zeropp_strategy`` must not import Lightning (``zeropp --help`` would pay seconds
for it), yet ``import zeropp_strategy`` then ``Trainer(strategy="zeropp")`` must work,
whichever of the two was imported first. So ``register_when_imported`` registers at once
with each Lightning package already imported, and installs a ``sys.meta_path`` finder that
registers with the others right after their import completes. Lightning 2.6 offers no
hook of its own for this (no entry-point group for strategies: its only entry points,
``lightning.pytorch.callbacks_factory``, are read after the strategy name is checked).

[Note: registering only between our own imports]
Registering imports ``zeropp_strategy.lightning.strategy`` and everything it imports. If
Lightning is first imported *by* one of our modules (``import
zeropp_strategy.lightning.strategy`` in a fresh process), registering at that moment would
meet that module half-initialized. So the finder also watches our own submodules (every
``zeropp_strategy.*``, at any depth) and registers only when none is executing: after the
outermost one completes.

``lightning.pytorch`` and the standalone ``pytorch_lightning`` are separate packages
with separate base classes: a ``lightning.pytorch`` strategy is rejected by a
``pytorch_lightning.Trainer``. So ``pytorch_lightning`` gets its own ``ZeroPPStrategy``,
from ``lightning/_pytorch_lightning.py`` (see [Note: two Lightning packages] there).
"""

from __future__ import annotations

import importlib
import importlib.abc
import importlib.machinery
import importlib.util
import sys
from types import ModuleType


def pytorch_lightning_strategy() -> type | None:
    """``ZeroPPStrategy`` for ``pytorch_lightning.Trainer``, or None if not installed."""
    if importlib.util.find_spec("pytorch_lightning") is None:
        return None
    from zeropp_strategy.lightning._pytorch_lightning import ZeroPPStrategy

    return ZeroPPStrategy


_TARGETS = {  # top-level package -> who registers there
    "lightning": "_register_lightning",  # imports lightning.fabric and lightning.pytorch whole
    "pytorch_lightning": "_register_pytorch_lightning",
}
_PACKAGE = __name__.rpartition(".")[0]
_pending: set[str] = set()  # packages not registered with yet
_imported: set[str] = set()  # of those, the ones whose import completed
_running = 0  # our own submodules executing right now (see [Note: registering only between our own imports])
_registering = False


def _register_lightning() -> None:
    from lightning.fabric.strategies import STRATEGY_REGISTRY
    from lightning.pytorch.strategies import StrategyRegistry

    from zeropp_strategy.fabric import ZeroPPFabricStrategy
    from zeropp_strategy.lightning.strategy import ZeroPPStrategy

    ZeroPPStrategy.register_strategies(StrategyRegistry)
    ZeroPPFabricStrategy.register_strategies(STRATEGY_REGISTRY)


def _register_pytorch_lightning() -> None:
    from pytorch_lightning.strategies import StrategyRegistry

    strategy = pytorch_lightning_strategy()
    assert strategy is not None  # pytorch_lightning is imported
    strategy.register_strategies(StrategyRegistry)


def _register_ready() -> None:
    global _registering
    if _running or _registering:
        return
    _registering = True
    try:
        while _pending & _imported:  # registering may import the other package
            package = min(_pending & _imported)
            _pending.discard(package)
            globals()[_TARGETS[package]]()
    finally:
        _registering = False
    if not _pending and _FINDER in sys.meta_path:
        sys.meta_path.remove(_FINDER)


class _Loader(importlib.abc.Loader):
    """Runs the real loader, then ``_register_ready``."""

    def __init__(self, loader: importlib.abc.Loader, ours: bool) -> None:
        self._loader = loader
        self._ours = ours

    def __getattr__(self, name: str) -> object:  # get_code, get_source, get_resource_reader, ...
        return getattr(self._loader, name)

    def create_module(self, spec: importlib.machinery.ModuleSpec) -> ModuleType | None:
        return self._loader.create_module(spec)

    def exec_module(self, module: ModuleType) -> None:
        global _running
        # the module keeps the real loader: nothing after the import sees this wrapper
        module.__loader__ = self._loader
        if module.__spec__ is not None:
            module.__spec__.loader = self._loader
        _running += self._ours
        try:
            self._loader.exec_module(module)
        finally:
            _running -= self._ours
        if not self._ours:
            _imported.add(module.__name__)
        _register_ready()


class _Finder(importlib.abc.MetaPathFinder):
    """Hands out the other finders' specs, the loader wrapped in ``_Loader``, for the
    Lightning packages not registered with yet and for our own submodules."""

    def find_spec(self, fullname: str, path: object, target: ModuleType | None = None) -> object:
        ours = fullname.startswith(_PACKAGE + ".")
        if not (ours or fullname in _pending):
            return None
        for finder in sys.meta_path:
            if finder is self or not hasattr(finder, "find_spec"):
                continue
            spec = finder.find_spec(fullname, path, target)
            if spec is not None:
                break
        else:
            return None
        if hasattr(spec.loader, "exec_module"):
            spec.loader = _Loader(spec.loader, ours)
        return spec


_FINDER = _Finder()


def register_when_imported() -> None:
    """Register with the Lightning packages imported already, and with the others as soon
    as they are imported."""
    _pending.update(_TARGETS)
    _imported.update(package for package in _TARGETS if package in sys.modules)
    # The finder goes in first: registering with one package may import the other (the
    # standalone pytorch_lightning's classes import lightning.pytorch's), and that import
    # must be seen; _register_ready takes the finder out once nothing is pending.
    if _FINDER not in sys.meta_path:
        sys.meta_path.insert(0, _FINDER)
    _register_ready()

"""Layer: front-end (Lightning). The Lightning Trainer's front-end, beside ``fabric.py``
(Lightning Fabric) and ``accelerate/`` (HF Accelerate):

- ``strategy.py``: ``ZeroPPStrategy``, the adapter from Lightning's hooks to ``ZeroSession``
  calls (``StrategyMixin``, and that mixin on ``lightning.pytorch``'s ``ParallelStrategy``);
- ``precision.py``: ``ZeroPPPrecision``, Lightning's precision plugin;
- ``resume.py``: ``ZeroPPStrategy(resume=...)`` and its launcher;
- ``evaluation.py``, ``checkpoint_hooks.py``: the strategy's evaluation and checkpoint hooks;
- ``_pytorch_lightning.py``: the same classes for the standalone ``pytorch_lightning``.

What the Trainer's and Fabric's strategies share stays one level up: ``_process.py`` (the
process plumbing both inherit) and ``_registry.py`` (which registers both, and is imported
by ``import zeropp_strategy``). The public names are imported from ``zeropp_strategy``
(``from zeropp_strategy import ZeroPPStrategy, ZeroPPPrecision``).

Nothing is imported here: ``import zeropp_strategy.lightning`` imports no Lightning
package. Inside ``zeropp_strategy`` this package is always named in full
(``zeropp_strategy.lightning``); a bare ``import lightning`` is the Lightning package.
"""

"""Layer: front-end (Lightning). ``ZeroPPStrategy`` for the standalone ``pytorch_lightning``
package: the same strategy, precision plugin and launcher as ``strategy.py``,
``precision.py`` and ``resume.py``, on ``pytorch_lightning``'s base classes.

    import pytorch_lightning as pl
    import zeropp_strategy  # registers the names with pytorch_lightning when it is imported
    pl.Trainer(strategy="zeropp_stage_2", accelerator="cpu", devices=2)

Imported on first use by ``pytorch_lightning_strategy()`` (``zeropp_strategy/_registry.py``),
never by ``import zeropp_strategy``.

[Note: two Lightning packages]
``lightning.pytorch`` and the standalone ``pytorch_lightning`` are the same code shipped
twice, with distinct classes: a ``pytorch_lightning.Trainer`` rejects a strategy built on
``lightning.pytorch``'s ``ParallelStrategy``, and its ``ModelCheckpoint`` is not
``lightning.pytorch``'s. So the hooks live in mixins that name no Lightning package
(``StrategyMixin``, ``PrecisionMixin``, ``ResumingLauncherMixin``, and the strategy's
``EvaluationMixin`` and ``CheckpointMixin``), and each package has thin classes that add
only its base class and a short table of its own names, the ``_..._cls`` attributes: the
classes a hook builds or checks with ``isinstance`` (``_ResultCollection``,
``ModelCheckpoint``, the forward redirections), its ``TrainerFn`` and
``prepare_for_backward``. ``lightning.fabric``'s functions (``_sync_ddp_if_available``,
``_optimizers_to_device``, ``rank_zero_info``) are imported once, as
``zeropp_strategy/_process.py`` does; they build no class a trainer checks.

Why mixins and not a class factory (one function that defines the classes, called once per
package with its namespace): with mixins every class is written once, at module level, where
a reader, a traceback, ``inspect`` and pickle find it; a factory nests every class body in a
function, and each built class needs its ``__module__`` and ``__qualname__`` repaired and a
module-level name to pickle. The price of mixins is the table, repeated in each package's
class. Both replace what was here before: the four modules' source rewritten by string
replacement and executed under private module names.
"""

from __future__ import annotations

from pytorch_lightning.callbacks import ModelCheckpoint
from pytorch_lightning.overrides.distributed import prepare_for_backward
from pytorch_lightning.plugins.precision import Precision
from pytorch_lightning.strategies.ddp import _DDPForwardRedirection
from pytorch_lightning.strategies.launchers import _SubprocessScriptLauncher
from pytorch_lightning.strategies.parallel import ParallelStrategy
from pytorch_lightning.strategies.strategy import _ForwardRedirection
from pytorch_lightning.trainer.connectors.logger_connector.result import _ResultCollection
from pytorch_lightning.trainer.states import TrainerFn

from zeropp_strategy.lightning.precision import PrecisionMixin
from zeropp_strategy.lightning.resume import ResumingLauncherMixin
from zeropp_strategy.lightning.strategy import StrategyMixin

__all__ = ["ResumingLauncher", "ZeroPPPrecision", "ZeroPPStrategy"]


class ZeroPPPrecision(PrecisionMixin, Precision):
    """``zeropp_strategy.lightning.precision.ZeroPPPrecision`` for ``pytorch_lightning``."""


class ResumingLauncher(ResumingLauncherMixin, _SubprocessScriptLauncher):
    """``zeropp_strategy.lightning.resume.ResumingLauncher`` for ``pytorch_lightning``."""


class ZeroPPStrategy(StrategyMixin, ParallelStrategy):
    """``zeropp_strategy.lightning.strategy.ZeroPPStrategy`` (the same arguments) for
    ``pytorch_lightning.Trainer``."""

    # pytorch_lightning's own names ([Note: two Lightning packages])
    _launcher_cls = ResumingLauncher
    _precision_cls = ZeroPPPrecision
    _result_collection_cls = _ResultCollection
    _trainer_fn = TrainerFn
    _forward_redirection_cls = _ForwardRedirection
    _ddp_forward_redirection_cls = _DDPForwardRedirection
    _prepare_for_backward = staticmethod(prepare_for_backward)
    _model_checkpoint_cls = ModelCheckpoint

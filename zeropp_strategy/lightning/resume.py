"""Layer: front-end (Lightning). ``ZeroPPStrategy(resume=...)``: restart where the job died.

When ``trainer.fit`` is called without ``ckpt_path``, the launcher (the one place a
strategy sees that argument before the checkpoint is restored) fills it in with the newest
complete checkpoint of the resume directory; once the process group exists, every rank
checks that all chose the same one. Interrupted saves (``.tmp-`` siblings, directories
without their meta file) are never chosen (``checkpoint.atomic.find_checkpoints``).

``ResumingLauncherMixin`` names no Lightning package: ``ResumingLauncher`` is it on
``lightning.pytorch``'s script launcher, and ``_pytorch_lightning.py`` puts it on the
standalone ``pytorch_lightning``'s ([Note: two Lightning packages] there).
"""

from __future__ import annotations

import inspect
from pathlib import Path
from typing import Any

from lightning.fabric.utilities.rank_zero import rank_zero_info
from lightning.pytorch.strategies.launchers import _SubprocessScriptLauncher

from zeropp_strategy.checkpoint.atomic import find_checkpoints
from zeropp_strategy.comm.control import all_gather_object

__all__ = ["ResumingLauncher", "ResumingLauncherMixin", "check_same_choice", "resume_path"]


class ResumingLauncherMixin:
    """For a Lightning script launcher (listed before it): for a strategy with ``resume`` set,
    fills in ``trainer.fit``'s ``ckpt_path`` when the caller gave none, with the strategy's
    ``resume_path(trainer)``, and hands the choice to the strategy (``_resume_choice``) for
    ``check_same_choice``."""

    def launch(self, function: Any, *args: Any, trainer: Any = None, **kwargs: Any) -> Any:
        strategy = getattr(trainer, "strategy", None)
        if getattr(strategy, "resume", None) is not None and getattr(function, "__name__", "") == "_fit_impl":
            bound = inspect.signature(function).bind(*args, **kwargs)
            if bound.arguments.get("ckpt_path") is None:
                bound.arguments["ckpt_path"] = choice = strategy.resume_path(trainer)
                strategy._resume_choice = [choice]
            args, kwargs = bound.args, bound.kwargs
        return super().launch(function, *args, trainer=trainer, **kwargs)


class ResumingLauncher(ResumingLauncherMixin, _SubprocessScriptLauncher):
    """``lightning.pytorch``'s script launcher, filling in ``ckpt_path`` for ``resume``."""


def resume_path(resume: str | Path | None, trainer: Any, checkpoint_cls: type) -> str | None:
    """The checkpoint ``resume`` picks for ``trainer`` now (newest complete one), or None.
    Rank-local (no collective); raises ``ValueError`` when there is no directory to look in.
    ``checkpoint_cls``: the ``ModelCheckpoint`` of the trainer's Lightning package."""
    if resume is None:
        return None
    if str(resume) == "auto":
        dirs = sorted({str(cb.dirpath) for cb in trainer.checkpoint_callbacks
                       if isinstance(cb, checkpoint_cls) and cb.dirpath is not None})
        if not dirs:
            raise ValueError(
                "ZeroPPStrategy(resume='auto') needs a ModelCheckpoint with a fixed directory, and this "
                "Trainer has none (the default directory, lightning_logs/version_N/checkpoints, changes with "
                "every run, so a restarted job would not find its checkpoints). Fix: pass "
                "callbacks=[ModelCheckpoint(dirpath='checkpoints/', ...)], or resume='checkpoints/'."
            )
    else:
        dirs = [str(resume)]
    found = [p for d in dirs if Path(d).is_dir() for p in find_checkpoints(Path(d))]
    if not found:
        rank_zero_info(f"zeropp: resume={str(resume)!r}: no complete checkpoint in {', '.join(dirs)}; "
                       "starting from scratch")
        return None
    newest = max(found, key=lambda p: (p.stat().st_mtime, str(p)))
    rank_zero_info(f"zeropp: resume={str(resume)!r}: resuming from {newest}")
    return str(newest)


def check_same_choice(choices: list[str | None]) -> None:
    """Collective (when the launcher chose): every rank must resume from the same checkpoint
    (or none): ranks of one job that see the file system differently would otherwise load
    different states, or some would wait in a load the others never start."""
    if not choices:
        return
    everyone = all_gather_object(choices.pop())
    if any(c != everyone[0] for c in everyone):
        shown = "; ".join(f"rank {r}: {c}" for r, c in enumerate(everyone))
        raise ValueError(f"ZeroPPStrategy(resume=...) chose different checkpoints on different ranks ({shown}). "
                         "Fix: keep the checkpoint directory on a file system every node sees the same way, or "
                         "pass ckpt_path explicitly.")

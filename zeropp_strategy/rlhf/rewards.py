"""Layer: recipes (rlhf). Reward functions for ``GRPOModule``: verifiable checks as plain callables (recipes layer).

A reward function is called with keywords, ``f(prompts=[...], completions=[...], **columns)``,
one entry per completion (a prompt appears once per completion of its group; ``columns``
are the prompt records' other fields, e.g. ``answer``), and returns one float per
completion, or ``None`` where it does not apply. That is the convention of TRL's
``GRPOTrainer``, so a reward function written for it runs here unchanged as long as it
reads plain-text completions (this module passes strings, not chat messages).

A recipe names a function by its import path, ``package.module.function`` or
``package.module:function``; ``resolve_reward_funcs`` turns names into callables.
"""

from __future__ import annotations

import importlib
import math
from collections.abc import Callable, Sequence
from typing import Any

from zeropp_strategy.rlhf.task import AdditionTask

__all__ = ["RewardFunc", "addition_reward", "call_reward_func", "import_path", "resolve_reward_funcs"]

RewardFunc = Callable[..., Sequence[float | None]]


def addition_reward(prompts: Sequence[str], completions: Sequence[str], **columns: Any) -> list[float]:
    """The embedded task's verifiable reward: 1.0 for the right sum, 0.0 otherwise
    (``AdditionTask.score``; surrounding whitespace ignored)."""
    return [AdditionTask.score(p, c) for p, c in zip(prompts, completions)]


def _import(name: str) -> RewardFunc:
    module, sep, attr = name.partition(":") if ":" in name else name.rpartition(".")
    fix = "name a function by its import path, e.g. zeropp_strategy.rlhf.rewards.addition_reward"
    if not sep or not module or not attr:
        raise ValueError(f"reward function {name!r} is not an import path. Fix: {fix}.")
    try:
        func = getattr(importlib.import_module(module), attr)
    except (ImportError, AttributeError) as err:
        raise ValueError(f"reward function {name!r} cannot be imported ({err}). Fix: {fix}.") from None
    if not callable(func):
        raise ValueError(f"reward function {name!r} is a {type(func).__name__}, not a function. Fix: {fix}.")
    return func


def resolve_reward_funcs(spec: str | RewardFunc | Sequence[str | RewardFunc] | None) -> list[tuple[str, RewardFunc]]:
    """``(name, callable)`` per reward function: import paths imported, callables kept;
    the name (for the logs) is the function's ``__name__``, made unique with a suffix."""
    if spec is None:
        return []
    items = [spec] if isinstance(spec, str) or callable(spec) else list(spec)
    out: list[tuple[str, RewardFunc]] = []
    for item in items:
        if isinstance(item, str):
            func = _import(item)
        elif callable(item):
            func = item
        else:
            raise ValueError(f"reward function {item!r} is neither a callable nor an import path. Fix: pass a "
                             "function or its import path (package.module.function).")
        name = getattr(func, "__name__", type(func).__name__).strip("<>") or "reward"
        taken = {n for n, _ in out}
        unique, k = name, 1
        while unique in taken:
            k += 1
            unique = f"{name}_{k}"
        out.append((unique, func))
    return out


def import_path(func: RewardFunc) -> str:
    """``package.module.function`` of a module-level function (what a recipe would write)."""
    return f"{getattr(func, '__module__', '?')}.{getattr(func, '__qualname__', repr(func))}"


def call_reward_func(name: str, func: RewardFunc, prompts: Sequence[str], completions: Sequence[str],
                     columns: dict[str, Sequence[Any]]) -> list[float]:
    """The function's rewards, checked: one number (``None`` becomes NaN) per completion."""
    values = func(prompts=list(prompts), completions=list(completions), **columns)
    values = list(values) if values is not None else []
    if len(values) != len(completions):
        raise ValueError(f"reward function {name!r} returned {len(values)} values for {len(completions)} completions. "
                         "Fix: return one float (or None) per completion.")
    out = []
    for v in values:
        if v is None:
            out.append(math.nan)
        elif isinstance(v, (int, float)) or hasattr(v, "__float__"):
            out.append(float(v))
        else:
            raise ValueError(f"reward function {name!r} returned {v!r}. Fix: return floats (or None where the "
                             "function does not apply).")
    return out

"""Layer: base. User errors, as one line: ``error: <what>. Fix: <how>`` and exit status 2.

Every layer may raise these (no import beyond the standard library): a mistake of the
user's (a bad flag, a missing file, an unknown recipe key, a checkpoint that cannot be
read) is a ``UsageError(what, fix)``; ``run`` prints it as one line on stderr and returns
status 2. Any other exception is a bug and keeps its traceback. The ``zeropp`` command
(``zeropp_strategy.cli``) runs every subcommand through ``run``.
"""

from __future__ import annotations

import argparse
import difflib
import inspect
import sys
from collections.abc import Callable, Iterable
from typing import Any, NoReturn

__all__ = ["USAGE_EXIT", "ArgumentParser", "MissingPathError", "UsageError", "check_arguments", "run"]

USAGE_EXIT = 2  # what argparse uses for a bad command line


class UsageError(ValueError):
    """A mistake in what the user gave (``what``) and how to put it right (``fix``)."""

    def __init__(self, what: str, fix: str) -> None:
        super().__init__(what, fix)
        self.what = " ".join(what.split()).rstrip(".")  # one line, whatever the source wrapped
        self.fix = " ".join(fix.split())

    def __str__(self) -> str:
        return f"{self.what}. Fix: {self.fix}"


class MissingPathError(UsageError, FileNotFoundError):
    """A file or folder the user named does not exist."""


class ArgumentParser(argparse.ArgumentParser):
    """``argparse.ArgumentParser`` whose command-line errors are ``UsageError``s."""

    def error(self, message: str) -> NoReturn:
        raise UsageError(f"{self.prog}: {message}", f"see `{self.prog} --help`")


def check_arguments(func: Callable[..., Any], given: Iterable[str], where: str) -> None:
    """Raise ``UsageError`` if a key of ``given`` is not a keyword argument of ``func``
    (a class: its ``__init__``), naming each unknown key, ``where`` it is, the valid keys
    and the closest match."""
    params = inspect.signature(func).parameters.values()
    if any(p.kind is p.VAR_KEYWORD for p in params):
        return
    valid = [p.name for p in params if p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY) and p.name != "self"]
    unknown = [key for key in given if key not in valid]
    if not unknown:
        return
    name = getattr(func, "__name__", repr(func))
    fixes = []
    for key in unknown:
        close = difflib.get_close_matches(key, valid, n=1)
        fixes.append(f"rename {key!r} to {close[0]!r}" if close else f"remove {key!r}")
    raise UsageError(f"{where}: unknown key(s) {unknown}; {name} takes {', '.join(valid)}", "; ".join(fixes))


def run(command: Callable[[list[str]], int], argv: list[str]) -> int:
    """``command(argv)``, with a ``UsageError`` turned into one line on stderr and status 2."""
    try:
        return command(argv)
    except UsageError as err:
        print(f"error: {err}", file=sys.stderr)
        return USAGE_EXIT

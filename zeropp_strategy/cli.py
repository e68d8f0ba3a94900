"""The ``zeropp`` command: one subcommand per function.

    zeropp --help
    zeropp demo [--strategy ddp] [--max-steps 60] ...   # see `zeropp demo --help`
    zeropp fit --config recipes/sft.yaml [--model.lr 1e-4 --trainer.max_steps 100 ...]
    zeropp pipeline --output-dir runs/pipeline [--config recipes/pipeline.yaml]
    zeropp report runs/demo                             # PNG plots + report.md of a logged run

A subcommand is a function ``argv -> exit code`` plus one line in ``SUBCOMMANDS``; it
parses its own flags, so the top-level parser only picks the function and forwards the
rest. Imports happen inside each function: `zeropp --help` must not pay for torch.

A mistake of the user's (a bad flag, a missing file, an unknown recipe key) is raised as
``UsageError(what, fix)``; ``run`` prints it as the one line ``error: <what>. Fix: <how>``
on stderr and exits with status 2. Any other exception is a bug and keeps its traceback.
"""

from __future__ import annotations

import argparse
import difflib
import inspect
import sys
from collections.abc import Callable, Iterable
from typing import Any, NoReturn

__all__ = ["ArgumentParser", "MissingPathError", "SUBCOMMANDS", "UsageError", "check_arguments", "main", "run"]

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


def _demo(argv: list[str]) -> int:
    from zeropp_strategy import demo

    return demo.main(argv, prog="zeropp demo")


def _fit(argv: list[str]) -> int:
    from zeropp_strategy.rlhf.cli import fit

    return fit(argv)


def _pipeline(argv: list[str]) -> int:
    from zeropp_strategy.rlhf.pipeline import main

    return main(argv, prog="zeropp pipeline")


def _report(argv: list[str]) -> int:
    from zeropp_strategy import report

    return report.main(argv, prog="zeropp report")


def _consolidate(argv: list[str]) -> int:
    from zeropp_strategy.checkpoint import consolidate

    return consolidate.main(argv, prog="zeropp consolidate")


# name -> (function, one-line help).
SUBCOMMANDS: dict[str, tuple[Callable[[list[str]], int], str]] = {
    "demo": (_demo, "train a tiny causal LM on 2 CPU processes under strategy='zeropp'"),
    "fit": (_fit, "LightningCLI fit of an RLHF module: zeropp fit --config recipes/sft.yaml [--field value ...]; "
                  "its fields: zeropp fit --help"),
    "pipeline": (_pipeline, "SFT -> reward model -> PPO in sequence, with summary.json: zeropp pipeline --output-dir DIR"),
    "report": (_report, "a run's metrics.csv as PNG plots (loss, bytes, memory, throughput) and report.md"),
    "consolidate": (_consolidate, "sharded checkpoint -> one Lightning file, or a Hugging Face folder (--hf)"),
}


def build_parser() -> ArgumentParser:
    parser = ArgumentParser(
        prog="zeropp",
        description="ZeRO stages 1/2/3 and ZeRO++ for PyTorch, as a Lightning strategy.",
        epilog="Run `zeropp COMMAND --help` for a command's own flags.",
    )
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)
    for name, (func, help_line) in SUBCOMMANDS.items():
        # add_help=False: `zeropp demo --help` reaches the subcommand's own parser
        sub.add_parser(name, help=help_line, add_help=False).set_defaults(func=func)
    return parser


def _dispatch(argv: list[str]) -> int:
    args, rest = build_parser().parse_known_args(argv)
    return args.func(rest)


def main(argv: list[str] | None = None) -> int:
    return run(_dispatch, sys.argv[1:] if argv is None else argv)


if __name__ == "__main__":
    # `python -m zeropp_strategy.cli`: run the imported module's main, so that the UsageError
    # the subcommands raise (zeropp_strategy.cli.UsageError) is the class `run` catches
    from zeropp_strategy.cli import main as _main

    raise SystemExit(_main())

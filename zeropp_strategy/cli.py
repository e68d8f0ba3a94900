"""Layer: commands. The ``zeropp`` command: one subcommand per function.

    zeropp --help
    zeropp demo [--strategy ddp] [--max-steps 60] ...   # see `zeropp demo --help`
    zeropp fit --config recipes/sft.yaml [--model.lr 1e-4 --trainer.max_steps 100 ...]
    zeropp pipeline --output-dir runs/pipeline [--config recipes/pipeline.yaml]
    zeropp report runs/demo                             # PNG plots + report.md of a logged run
    zeropp chat runs/pipeline/actor [--prompt "3+4="]   # talk to an exported model folder
    zeropp plan MODEL --nodes 2 --gpus-per-node 8       # which config fits, and how fast

A subcommand is a function ``argv -> exit code`` plus one line in ``SUBCOMMANDS``; it
parses its own flags, so the top-level parser only picks the function and forwards the
rest. Imports happen inside each function: `zeropp --help` must not pay for torch.

A mistake of the user's (a bad flag, a missing file, an unknown recipe key) is raised as
``UsageError(what, fix)`` (``zeropp_strategy.errors``, re-exported here); ``run`` prints
it as the one line ``error: <what>. Fix: <how>`` on stderr and exits with status 2. Any
other exception is a bug and keeps its traceback.
"""

from __future__ import annotations

import sys
from collections.abc import Callable

from zeropp_strategy.errors import ArgumentParser, MissingPathError, UsageError, check_arguments, run
from zeropp_strategy.parsers import chat_parser, consolidate_parser, demo_parser, pipeline_parser

__all__ = ["ArgumentParser", "MissingPathError", "SUBCOMMANDS", "UsageError", "check_arguments", "main", "run"]


def _demo(argv: list[str]) -> int:
    demo_parser("zeropp demo").parse_args(argv)  # --help and flag errors without torch
    from zeropp_strategy import demo

    return demo.main(argv, prog="zeropp demo")


def _fit(argv: list[str]) -> int:
    from zeropp_strategy.fit import fit

    return fit(argv)


def _pipeline(argv: list[str]) -> int:
    pipeline_parser("zeropp pipeline").parse_args(argv)
    from zeropp_strategy.pipeline import main

    return main(argv, prog="zeropp pipeline")


def _report(argv: list[str]) -> int:
    from zeropp_strategy import report

    return report.main(argv, prog="zeropp report")


def _consolidate(argv: list[str]) -> int:
    consolidate_parser("zeropp consolidate").parse_args(argv)
    from zeropp_strategy.checkpoint import consolidate

    return consolidate.main(argv, prog="zeropp consolidate")


def _plan(argv: list[str]) -> int:
    from zeropp_strategy import estimate

    return estimate.main(argv, prog="zeropp plan")


def _chat(argv: list[str]) -> int:
    chat_parser("zeropp chat").parse_args(argv)
    from zeropp_strategy import chat

    return chat.main(argv, prog="zeropp chat")


# name -> (function, one-line help).
SUBCOMMANDS: dict[str, tuple[Callable[[list[str]], int], str]] = {
    "demo": (_demo, "train a tiny causal LM on 2 CPU processes under strategy='zeropp'"),
    "fit": (_fit, "LightningCLI fit of an RLHF module: zeropp fit --config recipes/sft.yaml [--field value ...]; "
                  "its fields: zeropp fit --help"),
    "pipeline": (_pipeline, "SFT -> reward model -> PPO (or --rl grpo: SFT -> GRPO), with summary.json: zeropp pipeline --output-dir DIR"),
    "report": (_report, "a run's metrics.csv as PNG plots (loss, bytes, memory, throughput) and report.md"),
    "consolidate": (_consolidate, "sharded checkpoint -> one Lightning file, or a Hugging Face folder (--hf)"),
    "plan": (_plan, "memory, bytes and step time per config for a model on a cluster, and the one to use: "
                    "zeropp plan MODEL --nodes N --gpus-per-node G ..."),
    "chat": (_chat, "talk to a Hugging Face model folder (the pipeline's actor): zeropp chat DIR [--prompt TEXT]"),
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
    raise SystemExit(main())

"""Layer: commands. The command lines of ``zeropp demo``, ``pipeline``, ``consolidate`` and ``chat`` (CLI layer).

Standard library only: ``zeropp`` parses a subcommand's flags here before importing the
subcommand's module, so ``zeropp demo --help`` and a mistyped flag answer at once,
without paying seconds for torch and Lightning. Each subcommand's ``main`` parses with
the same parser, so there is one definition of its flags.
"""

from __future__ import annotations

import argparse
from collections.abc import Callable
from typing import Any

from zeropp_strategy.errors import ArgumentParser

__all__ = ["CONSOLIDATE_DTYPES", "PIPELINE_RL", "chat_parser", "consolidate_parser", "demo_parser", "pipeline_parser"]

CONSOLIDATE_DTYPES = ("bf16", "fp16", "fp32")  # the keys of checkpoint.consolidate.DTYPES
PIPELINE_RL = ("ppo", "grpo")  # zeropp pipeline --rl: the stages of pipeline.RL_STAGES


def demo_parser(prog: str | None = None) -> argparse.ArgumentParser:
    p = ArgumentParser(prog=prog, description="Train a tiny causal LM under a ZeRO strategy on CPU.")
    p.add_argument("--strategy", default="zeropp", help="Lightning strategy name (default: zeropp; try ddp)")
    p.add_argument("--devices", type=int, default=2, help="CPU processes (default: 2)")
    p.add_argument("--max-steps", type=int, default=60, help="optimizer steps (default: 60)")
    p.add_argument("--precision", default="32-true", help="Lightning precision (default: 32-true)")
    p.add_argument("--batch-size", type=int, default=8, help="windows per rank per step (default: 8)")
    p.add_argument("--seed", type=int, default=1234)
    p.add_argument("--output-dir", default=None, help="where the CSV log goes (default: a fresh temp dir)")
    return p


def pipeline_parser(prog: str | None = None) -> argparse.ArgumentParser:
    p = ArgumentParser(prog=prog, description="SFT -> reward model -> PPO (or SFT -> GRPO on the task's verifiable "
                                              "reward, --rl grpo), each stage reading the previous one's output.")
    p.add_argument("--config", default=None, help="pipeline recipe (default: the embedded one for --rl)")
    p.add_argument("--output-dir", required=True, help="where the models and summary.json go")
    p.add_argument("--rl", choices=PIPELINE_RL, default="ppo",
                   help="the RL stage: ppo (reward model, then PPO; default) or grpo (no reward model)")
    p.add_argument("--strategy", default=None, help="override trainer.strategy (e.g. ddp, zeropp_stage_2)")
    p.add_argument("--devices", type=int, default=None, help="override trainer.devices")
    return p


def consolidate_parser(prog: str | None = None) -> argparse.ArgumentParser:
    p = ArgumentParser(
        prog=prog,
        description=(
            "Turn a zeropp sharded checkpoint directory (Lightning, Fabric, or Accelerate's save_state "
            "folder) into one full checkpoint file (for Lightning what strategy='ddp' would have saved), "
            "or with --hf into a Hugging Face folder for from_pretrained. Verifies the checkpoint's "
            "checksums; runs in one CPU process; reads one tensor at a time. Errors exit with status 2."
        ),
    )
    p.add_argument("ckpt", metavar="CKPT", help="sharded checkpoint directory, or Accelerate save_state folder (with --hf also a one-file checkpoint)")
    p.add_argument("out", metavar="OUT", help="output file, or folder with --hf")
    p.add_argument("--hf", action="store_true", help="write a Hugging Face folder: config.json, safetensors, tokenizer")
    p.add_argument("--dtype", choices=CONSOLIDATE_DTYPES, default=None,
                   help="cast floating-point model weights (default: keep the stored dtype)")  # fmt: skip
    p.add_argument("--max-shard-size", default="2GiB", metavar="SIZE",
                   help="largest safetensors file with --hf, e.g. 5GB, 500MB, 2GiB (default: 2GiB)")  # fmt: skip
    p.add_argument("--unsafe-load", action="store_true",
                   help="torch.load with weights_only=False: runs arbitrary code, trusted files only")  # fmt: skip
    p.add_argument("--overwrite", action="store_true", help="replace OUT if it exists")
    p.add_argument("--ema", action="store_true", help="the ShardedEMA callback's averaged weights instead of the trained ones")
    return p


def _at_least(low: float, kind: type) -> Callable[[str], Any]:
    """An argparse ``type``: ``kind(text)``, refused below ``low``."""

    def check(text: str) -> Any:
        value = kind(text)
        if value < low:
            raise argparse.ArgumentTypeError(f"{text} is below {low}")
        return value

    check.__name__ = kind.__name__  # argparse names the type in "invalid <name> value"
    return check


def _probability(text: str) -> float:
    value = float(text)
    if not 0.0 < value <= 1.0:
        raise argparse.ArgumentTypeError(f"{text} is not in (0, 1]")
    return value


def chat_parser(prog: str | None = None) -> argparse.ArgumentParser:
    p = ArgumentParser(
        prog=prog,
        description=(
            "Talk to a Hugging Face model folder (the pipeline's actor, a `zeropp consolidate --hf` output): "
            "one answer with --prompt, else an interactive session that keeps the history (through the "
            "tokenizer's chat template when it has one). Reads local files only. In a session: /reset clears "
            "the history, /exit or Ctrl-D ends it."
        ),
    )
    p.add_argument("model_dir", metavar="MODEL_DIR", help="folder with config.json, the weights and the tokenizer")
    p.add_argument("--prompt", default=None, metavar="TEXT", help="print the answer to TEXT on stdout and exit")
    p.add_argument("--temperature", type=_at_least(0.0, float), default=0.7, metavar="T",
                   help="sampling temperature; 0 decodes greedily (default: 0.7)")  # fmt: skip
    p.add_argument("--top-k", type=_at_least(0, int), default=50, metavar="K",
                   help="sample among the k likeliest tokens; 0: all (default: 50)")  # fmt: skip
    p.add_argument("--top-p", type=_probability, default=0.95, metavar="P",
                   help="sample within the smallest set of tokens of this total probability; 1: all "
                        "(default: 0.95)")  # fmt: skip
    p.add_argument("--max-new-tokens", type=_at_least(1, int), default=None, metavar="N",
                   help="longest answer in tokens (default: 256, or half the model's positions if fewer)")  # fmt: skip
    p.add_argument("--seed", type=int, default=0, metavar="N",
                   help="the same seed and input lines give the same answers (default: 0)")  # fmt: skip
    p.add_argument("--device", default="cpu", help="torch device, e.g. cpu, cuda, cuda:1 (default: cpu)")
    p.add_argument("--tokenizer", default=None, metavar="DIR",
                   help="tokenizer folder, when MODEL_DIR has none (default: MODEL_DIR)")  # fmt: skip
    return p

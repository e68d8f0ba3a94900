"""The command lines of ``zeropp demo``, ``pipeline`` and ``consolidate`` (CLI layer).

Standard library only: ``zeropp`` parses a subcommand's flags here before importing the
subcommand's module, so ``zeropp demo --help`` and a mistyped flag answer at once,
without paying seconds for torch and Lightning. Each subcommand's ``main`` parses with
the same parser, so there is one definition of its flags.
"""

from __future__ import annotations

import argparse

from zeropp_strategy.errors import ArgumentParser

__all__ = ["CONSOLIDATE_DTYPES", "consolidate_parser", "demo_parser", "pipeline_parser"]

CONSOLIDATE_DTYPES = ("bf16", "fp16", "fp32")  # the keys of checkpoint.consolidate.DTYPES


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
    p = ArgumentParser(prog=prog, description="SFT -> reward model -> PPO, each stage reading the previous one's output.")
    p.add_argument("--config", default=None, help="pipeline recipe (default: the embedded one)")
    p.add_argument("--output-dir", required=True, help="where the three models and summary.json go")
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

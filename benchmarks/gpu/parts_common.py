"""What every part of the GPU check shares (benchmarks/gpu/parts.py has the parts): its time
budget, its result file (written whole, or partly by a part that may be killed), whether it
runs on CUDA, env's result and the kernels' benchmark module (benchmarks/kernels.py)."""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[2]


class Budget:
    def __init__(self, seconds: float) -> None:
        self.end = time.monotonic() + seconds

    def left(self) -> float:
        return self.end - time.monotonic()


def _text(out: bytes | str | None) -> str:
    return out.decode(errors="replace") if isinstance(out, bytes) else (out or "")


def _save_partial(args: argparse.Namespace, r: dict) -> None:
    """The part's figures so far, where check.py reads them: a part killed by its backstop
    (a child that takes long to die: 64 GiB of pinned host memory to unpin) keeps what finished."""
    _write_json(args.result, {**r, "status": "partial"})


def _write_json(path: Path, r: dict) -> None:
    """Whole or not at all: the driver's backstop kill may land mid-write."""
    tmp = path.with_suffix(".partial")
    tmp.write_text(json.dumps(r, indent=1) + "\n")
    os.replace(tmp, path)


def _cuda(dry_run: bool) -> bool:
    return torch.cuda.is_available() and not dry_run


def _bench_kernels():
    spec = importlib.util.spec_from_file_location("bench_kernels", ROOT / "benchmarks" / "kernels.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _env_result(args: argparse.Namespace) -> dict:
    path = Path(args.work) / "env.json"
    return json.loads(path.read_text()) if path.exists() else {}

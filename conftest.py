"""Session set-up shared by every test.

Bytecode for this repository's sources, compiled once per session: every multi-rank test
starts fresh interpreters (tests/_dist.py), and with ``PYTHONDONTWRITEBYTECODE=1`` (set on
the CI machine) each of them would compile the package and the test modules from source
again: about 1 s of a 2-rank call's 9.6 s (``python benchmarks/spawn_cost.py`` with and
without the compiled files, 2 cores). ``compileall`` writes the same ``__pycache__`` files
an import would; they are ignored by git.
"""

from __future__ import annotations

import compileall
from pathlib import Path

_ROOT = Path(__file__).resolve().parent


def pytest_configure(config: object) -> None:
    for folder in ("zeropp_strategy", "recipes", "callbacks", "tests", "benchmarks"):
        compileall.compile_dir(str(_ROOT / folder), quiet=2, workers=1)

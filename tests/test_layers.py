"""The layering contracts of pyproject.toml's [tool.importlinter] (kernels <- comm <-
engine <- front-ends <- recipes and CLI; no import cycles; kernels, comm and the engine
free of Lightning and Accelerate), checked by running import-linter's ``lint-imports``
from the repository root, so that ``python -m pytest`` enforces them."""

from __future__ import annotations

import importlib.util
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def _lint_imports() -> str | None:
    """The ``lint-imports`` script of this interpreter's environment, else the one on PATH."""
    name = "lint-imports.exe" if os.name == "nt" else "lint-imports"
    beside = Path(sys.executable).with_name(name)
    return str(beside) if beside.is_file() else shutil.which("lint-imports")


@pytest.mark.skipif(
    importlib.util.find_spec("importlinter") is None or _lint_imports() is None,
    reason="import-linter is not installed (it is in the `test` extra: pip install -e '.[test]')",
)
def test_import_contracts_hold() -> None:
    proc = subprocess.run(
        [_lint_imports(), "--config", "pyproject.toml", "--no-cache", "--no-logo"],
        cwd=ROOT, capture_output=True, text=True, timeout=120,
    )
    assert proc.returncode == 0, f"lint-imports found broken contracts:\n{proc.stdout}\n{proc.stderr}"
    assert "0 broken" in proc.stdout, proc.stdout


def test_nothing_below_the_session_takes_the_config() -> None:
    """docs/architecture.md: the session resolves the ``ZeroConfig`` into a ``Plan`` once; the
    engine, offload, comm, checkpoint and kernel modules take the plan (or the blocks it
    carries) and never import ``ZeroConfig`` (import-linter sees modules, not names: the
    offload blocks, ``OffloadConfig``, come from the same package)."""
    import ast

    below = [p for part in ("engine", "offload", "comm", "checkpoint", "kernels")
             for p in sorted((ROOT / "zeropp_strategy" / part).rglob("*.py"))]
    assert len(below) > 30
    offenders = [f"{path.relative_to(ROOT)}:{node.lineno}" for path in below
                 for node in ast.walk(ast.parse(path.read_text()))
                 if (isinstance(node, ast.ImportFrom) and any(a.name == "ZeroConfig" for a in node.names))
                 or (isinstance(node, ast.Attribute) and node.attr == "ZeroConfig")]
    assert not offenders, offenders


def test_rlhf_imports_no_recipe() -> None:
    """The recipes (recipes/, installed as zeropp_strategy.recipes, which import-linter cannot
    see from inside the package) are built on rlhf's blocks; rlhf must not import them back
    (``zeropp fit`` and ``zeropp pipeline``, which drive the recipes, live above it)."""
    import ast

    offenders = []
    for path in sorted((ROOT / "zeropp_strategy" / "rlhf").rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            names = ([node.module or ""] if isinstance(node, ast.ImportFrom)
                     else [a.name for a in node.names] if isinstance(node, ast.Import) else [])
            if any(n == "zeropp_strategy.recipes" or n.startswith("zeropp_strategy.recipes.") for n in names):
                offenders.append(f"{path.relative_to(ROOT)}:{node.lineno}")
    assert not offenders, offenders


# Each folder's layer (docs/architecture.md, "The layers"); a file at the package root names its own.
_FOLDER_LAYERS = {
    "recipes": ("recipes",), "callbacks": ("recipes (callbacks)",), "zeropp_strategy/rlhf": ("recipes (rlhf)",),
    "zeropp_strategy/lightning": ("front-end",), "zeropp_strategy/accelerate": ("front-end",),
    "zeropp_strategy/checkpoint": ("checkpoint",), "zeropp_strategy/engine": ("engine",),
    "zeropp_strategy/offload": ("offload",), "zeropp_strategy/comm": ("comm",), "zeropp_strategy/kernels": ("kernels",),
    "zeropp_strategy/config": ("plan",), "zeropp_strategy/data": ("base",),
}
_ROOT_LAYERS = ("commands", "front-end", "session", "plan", "primitives", "base", "package root")


def test_every_file_names_its_layer_first() -> None:
    """docs/architecture.md promises that each file's docstring starts with ``Layer: ...``:
    every module of the package, the recipes and the callbacks, with its folder's layer."""
    import ast

    wrong = []
    for folder in ("zeropp_strategy", "recipes", "callbacks"):
        for path in sorted((ROOT / folder).rglob("*.py")):
            rel = path.relative_to(ROOT)
            doc = ast.get_docstring(ast.parse(path.read_text()), clean=False) or ""
            allowed = _FOLDER_LAYERS.get(rel.parent.as_posix(), _ROOT_LAYERS)
            if not any(doc.startswith(f"Layer: {layer}") for layer in allowed):
                wrong.append(f"{rel}: {doc[:60]!r} (expected 'Layer: ' and one of {allowed})")
    assert not wrong, "\n".join(wrong)


def test_every_file_stays_under_500_lines() -> None:
    """docs/architecture.md's rule, for the package, the recipes, the callbacks and the
    benchmark scripts alike: one concept per file, 500 lines at most."""
    long = [f"{path.relative_to(ROOT)}: {n} lines"
            for folder in ("zeropp_strategy", "recipes", "callbacks", "benchmarks")
            for path in sorted((ROOT / folder).rglob("*.py"))
            if (n := len(path.read_text().splitlines())) > 500]
    assert not long, "\n".join(long)

"""What gets installed: the wheel's file list, the editable install, the CLI, the set-up docs.

The folders callbacks/ and recipes/ sit at the repository root but must install as
``zeropp_strategy.callbacks`` / ``zeropp_strategy.recipes``: generic top-level names in
site-packages would collide with other projects (DESIGN.md, section 3).
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
import zipfile
from collections.abc import Iterator
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]

MAIN_COMMAND = "pip install torch==2.13.0 && pip install -e . && zeropp pipeline --output-dir runs/pipeline"
TEST_COMMAND = 'pip install torch==2.13.0 && pip install -e ".[test]" && python -m pytest -x -q'
TEST_MARKER = "<!-- test-command -->"


# -- the wheel ---------------------------------------------------------------------------


@pytest.fixture(scope="module")
def wheel(tmp_path_factory: pytest.TempPathFactory) -> Iterator[zipfile.ZipFile]:
    # Build from a clean copy of the packaging inputs: an in-tree build reuses build/,
    # where files deleted from the source tree linger and would end up in the wheel.
    tmp = tmp_path_factory.mktemp("wheel")
    src = tmp / "src"
    src.mkdir()
    skip = shutil.ignore_patterns("__pycache__", "*.pyc", "*.egg-info")
    for entry in REPO.iterdir():
        if entry.is_file() and not entry.name.startswith("."):
            shutil.copy2(entry, src / entry.name)
    for folder in ("zeropp_strategy", "callbacks", "recipes"):
        shutil.copytree(REPO / folder, src / folder, ignore=skip)

    out = tmp / "dist"
    proc = subprocess.run(
        [sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-w", str(out), str(src)],
        capture_output=True,
        text=True,
        timeout=180,
    )
    assert proc.returncode == 0, f"pip wheel failed:\n{proc.stdout}\n{proc.stderr}"
    (path,) = out.glob("zeropp_strategy-*.whl")
    with zipfile.ZipFile(path) as zf:
        yield zf


@pytest.fixture(scope="module")
def wheel_names(wheel: zipfile.ZipFile) -> list[str]:
    return wheel.namelist()


def test_wheel_maps_callbacks_and_recipes_under_the_package(wheel_names: list[str]) -> None:
    for required in (
        "zeropp_strategy/__init__.py",
        "zeropp_strategy/cli.py",
        "zeropp_strategy/demo.py",
        "zeropp_strategy/lightning/__init__.py",  # the Lightning front-end's package (pyproject's `packages`)
        "zeropp_strategy/lightning/strategy.py",
        "zeropp_strategy/accelerate/__init__.py",
        "zeropp_strategy/callbacks/__init__.py",
        "zeropp_strategy/recipes/__init__.py",
        "zeropp_strategy/data/tiny_corpus.txt",
    ):
        assert required in wheel_names, f"{required} missing from the wheel"
    top_level = {name.split("/", 1)[0] for name in wheel_names}
    dist_info = {t for t in top_level if t.endswith(".dist-info")}
    assert len(dist_info) == 1
    assert top_level - dist_info == {"zeropp_strategy"}, f"unexpected top-level entries: {sorted(top_level)}"


def test_wheel_declares_the_console_script(wheel: zipfile.ZipFile, wheel_names: list[str]) -> None:
    (name,) = [n for n in wheel_names if n.endswith(".dist-info/entry_points.txt")]
    text = wheel.read(name).decode()
    assert re.search(r"^\[console_scripts\]$", text, re.M), text
    assert re.search(r"^zeropp\s*=\s*zeropp_strategy\.cli:main$", text, re.M), text


# -- the editable install ----------------------------------------------------------------


def test_editable_install_imports_mapped_packages() -> None:
    import zeropp_strategy.callbacks
    import zeropp_strategy.recipes

    assert Path(zeropp_strategy.callbacks.__file__).parent.name == "callbacks"
    assert Path(zeropp_strategy.recipes.__file__).parent.name == "recipes"


def test_no_generic_top_level_names_outside_the_repo(tmp_path: Path) -> None:
    # From another folder only the install is on sys.path, not the repository root.
    code = (
        "import importlib.util, zeropp_strategy.callbacks, zeropp_strategy.recipes; "
        "print(importlib.util.find_spec('callbacks'), importlib.util.find_spec('recipes'))"
    )
    proc = subprocess.run([sys.executable, "-c", code], cwd=tmp_path, capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip() == "None None"


# -- the CLI -----------------------------------------------------------------------------


def test_cli_help_lists_demo(tmp_path: Path) -> None:
    commands = [[sys.executable, "-m", "zeropp_strategy.cli", "--help"]]
    if shutil.which("zeropp"):
        commands.append(["zeropp", "--help"])
    for command in commands:
        proc = subprocess.run(command, cwd=tmp_path, capture_output=True, text=True, timeout=60)
        assert proc.returncode == 0, proc.stderr
        assert re.search(r"^\s+demo\s", proc.stdout, re.M), proc.stdout


@pytest.mark.parametrize("argv", [["no-such-command"], []])
def test_cli_usage_errors_exit_2(argv: list[str], capsys: pytest.CaptureFixture[str]) -> None:
    from zeropp_strategy import cli

    assert cli.main(argv) == 2
    err = capsys.readouterr().err
    assert re.fullmatch(r"error: zeropp: .+\. Fix: see `zeropp --help`\n", err), err


def test_cli_forwards_flags_to_the_subcommand(monkeypatch: pytest.MonkeyPatch) -> None:
    from zeropp_strategy import cli

    seen: list[list[str]] = []
    monkeypatch.setitem(cli.SUBCOMMANDS, "demo", (lambda argv: seen.append(argv) or 0, "demo"))
    assert cli.main(["demo", "--strategy", "ddp", "--max-steps", "6"]) == 0
    assert seen == [["--strategy", "ddp", "--max-steps", "6"]]


# -- README set-up and CI ----------------------------------------------------------------


def _section(markdown: str, title: str) -> str:
    match = re.search(rf"^## {re.escape(title)}\n(.*?)(?=^## |\Z)", markdown, re.M | re.S)
    assert match, f"README.md has no '## {title}' section"
    return match.group(1)


def _fenced_blocks(markdown: str) -> list[str]:
    return [b.strip() for b in re.findall(r"^```[a-z]*\n(.*?)^```", markdown, re.M | re.S)]


def test_readme_setup_has_exactly_the_two_commands() -> None:
    readme = (REPO / "README.md").read_text()
    assert _fenced_blocks(_section(readme, "Set-up")) == [MAIN_COMMAND, TEST_COMMAND]
    # the block .ci/run extracts is the one right after the marker
    after_marker = readme.split(TEST_MARKER, 1)[1]
    assert _fenced_blocks(after_marker)[0] == TEST_COMMAND


def test_ci_runs_the_readme_test_command() -> None:
    script = REPO / ".ci" / "run"
    assert os.access(script, os.X_OK), ".ci/run must be executable"
    text = script.read_text()
    assert "set -euo pipefail" in text
    assert TEST_MARKER in text and "README.md" in text and 'eval "$test_command"' in text
    assert "pip install torch==2.13.0" in text


def test_ci_runs_the_compatibility_selection_on_the_floor_and_the_newest_torch() -> None:
    """.ci/run ends with the `compat` tests on torch 2.11 (pyproject.toml's floor, the GPU
    image's) and the newest release that resolves, each a torch fsdp_private.py was checked
    on; the selection covers what the issue of record asks of it."""
    from zeropp_strategy import fsdp_private

    compat = REPO / ".ci" / "compat"
    assert os.access(compat, os.X_OK), ".ci/compat must be executable"
    assert "set -euo pipefail" in compat.read_text() and "-m compat" in compat.read_text()
    calls = [ln.split(">")[0].split() for ln in (REPO / ".ci" / "run").read_text().splitlines()
             if "bash .ci/compat" in ln and not ln.lstrip().startswith("#")]
    calls = [c[c.index(".ci/compat") + 1:] for c in calls]  # after `[setsid nice ...] bash .ci/compat`
    assert [c[0] for c in calls] == ["--prepare", "--test"], calls  # made in the background, tested after
    assert calls[0][1:] == calls[1][1:], calls
    versions = calls[1][1:]
    assert versions[0] == "2.11.0" and len(versions) == 2, versions
    floor = fsdp_private.SUPPORTED_TORCH.removeprefix(">=")
    assert versions[0].startswith(floor + ".")
    for v in versions:
        assert ".".join(v.split(".")[:2]) in fsdp_private.CHECKED_TORCH, (v, fsdp_private.CHECKED_TORCH)
    proc = subprocess.run([sys.executable, "-m", "pytest", "--collect-only", "-q", "-m", "compat", "-p",
                           "no:cacheprovider"], cwd=REPO, capture_output=True, text=True, timeout=240)
    assert proc.returncode == 0, proc.stdout[-2000:]
    ids = [ln for ln in proc.stdout.splitlines() if "::" in ln]
    covered = {i.split("::")[0].removeprefix("tests/") for i in ids}
    assert covered == {"test_fsdp_private.py", "test_parity.py", "test_zeropp.py", "test_checkpoint.py",
                       "test_offload.py", "test_accelerate.py", "test_rlhf_ppo.py", "test_estimate.py"}, covered
    assert "tests/test_parity.py::test_parameters_equal_ddp[2ranks]" in ids
    assert not any("[4ranks]" in i for i in ids)  # a few minutes: 2 ranks only


def test_no_spawned_job_outlives_its_tests_timeout() -> None:
    """pytest-timeout's limit (pyproject's ``timeout``, or a module's ``pytestmark``) covers
    a test's fixtures too: a ``run_ranks(..., timeout_s=N)`` above it would be cut off by the
    limit before its own, more telling timeout (issue 33: one slow fixture stopped a run)."""
    default = int(re.search(r"^timeout = (\d+)", (REPO / "pyproject.toml").read_text(), re.M).group(1))
    short = []
    for path in sorted((REPO / "tests").glob("test_*.py")):
        text = path.read_text()
        spawned = [int(v) for v in re.findall(r"timeout_s=(\d+)", text)]
        marked = re.search(r"^pytestmark = .*pytest\.mark\.timeout\((\d+)\)", text, re.M)
        limit = int(marked.group(1)) if marked else default
        if spawned and max(spawned) >= limit:
            short.append(f"{path.name}: run_ranks timeout_s={max(spawned)} >= the test timeout {limit}")
    assert not short, short

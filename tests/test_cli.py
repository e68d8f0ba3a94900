"""The ``zeropp`` command: a user error is one line ``error: <what>. Fix: <how>`` with exit
status 2 (never a traceback), ``zeropp --help`` imports neither torch nor Lightning, and
``import zeropp_strategy`` registers the strategy names whichever of it and Lightning is
imported first.

Every command runs in a fresh interpreter: what it imports and prints is the point.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from zeropp_strategy import cli

ONE_ERROR_LINE = re.compile(r"error: \S.*\. Fix: \S.*")


def _python(code_or_args: str | list[str], cwd: Path, env: dict[str, str] | None = None,
            timeout: int = 180) -> subprocess.CompletedProcess[str]:
    args = ["-c", code_or_args] if isinstance(code_or_args, str) else code_or_args
    return subprocess.run([sys.executable, *args], cwd=cwd, capture_output=True, text=True, timeout=timeout,
                          env={**os.environ, **(env or {})})


def _zeropp(argv: list[str], cwd: Path, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    return _python(["-m", "zeropp_strategy.cli", *argv], cwd, env)


def _assert_one_error_line(proc: subprocess.CompletedProcess[str], *needles: str) -> str:
    assert proc.returncode == 2, (proc.returncode, proc.stdout[-2000:], proc.stderr[-4000:])
    lines = proc.stderr.splitlines()
    assert len(lines) == 1 and ONE_ERROR_LINE.fullmatch(lines[0]), proc.stderr[-4000:]
    for needle in needles:
        assert needle in lines[0], (needle, lines[0])
    return lines[0]


# -- the mechanism, in process -----------------------------------------------------------


def test_usage_error_is_one_line_and_a_bug_keeps_its_traceback(capsys: pytest.CaptureFixture[str]) -> None:
    def bad_flag(argv: list[str]) -> int:
        raise cli.UsageError("--x: a\nwrapped  message.", "do\n this")

    assert cli.run(bad_flag, []) == 2
    assert capsys.readouterr().err == "error: --x: a wrapped message. Fix: do this\n"

    def bug(argv: list[str]) -> int:
        raise KeyError("a bug")

    with pytest.raises(KeyError):
        cli.run(bug, [])
    assert isinstance(cli.MissingPathError("x", "y"), FileNotFoundError)
    assert isinstance(cli.UsageError("x", "y"), ValueError)


def test_argument_parser_errors_are_usage_errors() -> None:
    parser = cli.ArgumentParser(prog="zeropp thing")
    parser.add_argument("--n", type=int)
    with pytest.raises(cli.UsageError, match=r"zeropp thing: argument --n: invalid int value: 'x'\. Fix: see `zeropp thing"):
        parser.parse_args(["--n", "x"])


def test_check_arguments_names_the_key_the_block_and_the_closest_match() -> None:
    def module(model: str = "", batch_size: int = 8, *, lr: float = 1e-3) -> None: ...

    cli.check_arguments(module, ["batch_size", "lr"], "r.yaml: sft.model")
    with pytest.raises(cli.UsageError) as err:
        cli.check_arguments(module, ["batchsize", "zzz"], "r.yaml: sft.model")
    assert err.value.what == "r.yaml: sft.model: unknown key(s) ['batchsize', 'zzz']; module takes model, batch_size, lr"
    assert err.value.fix == "rename 'batchsize' to 'batch_size'; remove 'zzz'"
    cli.check_arguments(lambda **kwargs: None, ["anything"], "x")  # **kwargs takes every key


# -- the command line ----------------------------------------------------------------------


def test_help_and_import_load_neither_torch_nor_lightning(tmp_path: Path) -> None:
    code = (
        "import sys\n"
        "import zeropp_strategy, zeropp_strategy.cli\n"
        "heavy = lambda: sorted(m for m in ('torch', 'lightning', 'pytorch_lightning', 'transformers') if m in sys.modules)\n"
        "seen = [heavy()]\n"
        "for argv in (['--help'], ['report', '--help'], ['demo', '--help'], ['pipeline', '--help'], ['consolidate', '--help']):\n"
        "    try:\n"
        "        zeropp_strategy.cli.main(argv)\n"
        "    except SystemExit as exit:\n"
        "        assert exit.code == 0, exit.code\n"
        "    seen.append(heavy())\n"
        "print('HEAVY', seen, file=sys.stderr)\n"
    )
    proc = _python(code, tmp_path)
    assert proc.returncode == 0, proc.stderr[-4000:]
    assert "HEAVY [[], [], [], [], [], []]" in proc.stderr, proc.stderr[-4000:]
    assert re.search(r"^\s+fit\s.*zeropp fit\s+--help", proc.stdout, re.M | re.S), proc.stdout


@pytest.mark.parametrize("first", ["zeropp_strategy", "lightning.pytorch", "zeropp_strategy.lightning.strategy"])
def test_import_registers_the_names_in_either_order(first: str, tmp_path: Path) -> None:
    code = (
        "import sys\n"
        f"import {first}\n"
        "lazy = 'lightning' not in sys.modules\n"
        "import zeropp_strategy\n"
        "import lightning.pytorch as L\n"
        "from lightning.fabric.strategies import STRATEGY_REGISTRY\n"
        "from zeropp_strategy import ZeroPPStrategy\n"
        "trainer = L.Trainer(strategy='zeropp_stage_3', accelerator='cpu', devices=1, logger=False)\n"
        "print('RESULT', lazy, type(trainer.strategy) is ZeroPPStrategy, trainer.strategy.stage,\n"
        "      'zeropp_stage_3' in STRATEGY_REGISTRY)\n"
    )
    proc = _python(code, tmp_path)
    assert proc.returncode == 0, proc.stderr[-4000:]
    # importing the package alone leaves Lightning unimported; a submodule that needs it imports it
    assert f"RESULT {first == 'zeropp_strategy'} True 3 True" in proc.stdout, proc.stdout + proc.stderr[-2000:]


def test_unknown_command_is_one_error_line(tmp_path: Path) -> None:
    _assert_one_error_line(_zeropp(["nope"], tmp_path), "invalid choice: 'nope'", "zeropp --help")


def test_report_without_metrics_csv(tmp_path: Path) -> None:
    _assert_one_error_line(_zeropp(["report", str(tmp_path)], tmp_path), "no metrics.csv under", "CSVLogger")


def test_report_without_matplotlib(tmp_path: Path) -> None:
    blocked = tmp_path / "blocked" / "matplotlib"
    blocked.mkdir(parents=True)
    (blocked / "__init__.py").write_text("raise ImportError('matplotlib is blocked by the test')\n")
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    (run_dir / "metrics.csv").write_text("epoch,step,train_loss\n0,0,2.5\n0,1,2.0\n")
    path = os.pathsep.join(p for p in (str(tmp_path / "blocked"), os.environ.get("PYTHONPATH")) if p)
    proc = _zeropp(["report", str(run_dir)], tmp_path, env={"PYTHONPATH": path})
    _assert_one_error_line(proc, "needs matplotlib", "Fix: pip install matplotlib")


def test_default_install_runs_report(tmp_path: Path) -> None:
    """What the demo's last line suggests works without extras: matplotlib is a dependency."""
    if sys.version_info >= (3, 11):
        import tomllib
    else:  # pragma: no cover
        pytest.skip("tomllib is Python 3.11+")
    project = tomllib.loads((Path(__file__).resolve().parents[1] / "pyproject.toml").read_text())["project"]
    assert any(re.match(r"matplotlib\b", dep) for dep in project["dependencies"]), project["dependencies"]


def test_pipeline_unknown_model_key_names_it_before_anything_starts(tmp_path: Path) -> None:
    recipe = tmp_path / "recipe.yaml"
    recipe.write_text(yaml.safe_dump({"sft": {"model": {"batchsize": 8}}}))
    proc = _zeropp(["pipeline", "--config", str(recipe), "--output-dir", str(tmp_path / "out")], tmp_path)
    _assert_one_error_line(proc, "sft.model", "['batchsize']", "SFTModule takes", "rename 'batchsize' to 'batch_size'")
    assert not (tmp_path / "out").exists()


def test_fit_bad_field_is_one_line_without_lightning_cli_warning(tmp_path: Path) -> None:
    recipe = tmp_path / "sft.yaml"
    recipe.write_text(yaml.safe_dump({"model": {"class_path": "zeropp_strategy.recipes.sft.SFTModule"}}))
    proc = _zeropp(["fit", "--config", str(recipe), "--model.batchsize", "3"], tmp_path)
    _assert_one_error_line(proc, "['batchsize']", "rename 'batchsize' to 'batch_size'", "zeropp fit --help")


def test_fit_help_lists_fit_fields_and_warns_nothing(tmp_path: Path) -> None:
    proc = _zeropp(["fit", "--help"], tmp_path)
    assert proc.returncode == 0, proc.stderr[-4000:]
    assert proc.stdout.startswith("usage: zeropp [options] fit"), proc.stdout[:500]
    for field in ("--config", "--model", "--trainer.max_steps", "--trainer.strategy"):
        assert field in proc.stdout, field
    assert proc.stderr == "", proc.stderr  # LightningCLI's "args and command line" warning was here


def test_demo_bad_flag_is_one_error_line(tmp_path: Path) -> None:
    proc = _zeropp(["demo", "--max-steps", "many"], tmp_path)
    _assert_one_error_line(proc, "zeropp demo: argument --max-steps: invalid int value: 'many'", "zeropp demo --help")



def test_chat_help_and_a_missing_folder_load_no_torch(tmp_path: Path) -> None:
    """``zeropp chat``'s flags and its path checks answer before torch is imported."""
    code = (
        "import contextlib, io, sys\n"
        "import zeropp_strategy.cli\n"
        "with contextlib.suppress(SystemExit), contextlib.redirect_stdout(io.StringIO()) as shown:\n"
        "    zeropp_strategy.cli.main(['chat', '--help'])\n"
        "status = zeropp_strategy.cli.main(['chat', 'no/such/folder', '--prompt', 'x'])\n"
        "flags = all(f in shown.getvalue() for f in ('--temperature', '--top-k', '--top-p', '--max-new-tokens'))\n"
        "print('HEAVY', status, flags, [m for m in ('torch', 'lightning', 'transformers') if m in sys.modules],\n"
        "      file=sys.stderr)\n"
    )
    proc = _python(code, tmp_path)
    assert proc.returncode == 0, proc.stderr[-4000:]
    lines = proc.stderr.splitlines()
    assert lines[-1] == "HEAVY 2 True []" and ONE_ERROR_LINE.fullmatch(lines[0]) and "no such folder" in lines[0], lines

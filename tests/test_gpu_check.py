"""The prepared GPU check (benchmarks/gpu/check.py) cannot rot between GPU runs.

    pytest tests/test_gpu_check.py -q

- ``--dry-run``: every part runs on the CPU with tiny sizes, as the GPU run will (the same
  code: the Llama cells under the Trainer, the kernels' GB/s rows, the two-rank stage-3
  check against one process, the pipeline), and writes the three result files the GPU
  machine can send back (at most 8);
- bad input: no CUDA without ``--dry-run`` is one line and exit 2; an unknown part, a
  missing results folder and a missing package each name the fix (the package: the wheel
  to carry).
"""

from __future__ import annotations

import importlib.util
import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]
CHECK = ROOT / "benchmarks" / "gpu" / "check.py"


def _check_module():
    spec = importlib.util.spec_from_file_location("gpu_check", CHECK)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _run(*args: str, timeout: float = 60) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, str(CHECK), *args], cwd=ROOT, capture_output=True, text=True,
                          timeout=timeout)


@pytest.fixture(scope="module")
def dry_run(tmp_path_factory):
    out = tmp_path_factory.mktemp("gpu-check")
    every_part = ",".join(name for name, _, _ in _check_module().PARTS)  # the opt-in part too
    proc = _run(str(out), "--dry-run", "--parts", every_part, timeout=300)
    return out, proc


def test_dry_run_runs_every_part(dry_run):
    out, proc = dry_run
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    result = json.loads((out / "check.json").read_text())
    parts = result["parts"]
    assert list(parts) == [name for name, _, _ in _check_module().PARTS]
    assert {name: p["status"] for name, p in parts.items()} == dict.fromkeys(parts, "ok"), parts
    assert result["dry_run"] is True and result["device"] == "CPU"
    assert parts["env"]["copy_GBps"] > 0 and parts["env"]["matmul_TFLOPs"] > 0
    assert int(parts["tests"]["summary"].split()[0]) >= 100  # tests/test_kernels.py's CUDA cases, collected
    rows = parts["kernels"]["rows"]
    assert rows and all(r["torch_GBps"] > 0 and 0 < r["of_copy"] for r in rows)
    systems = parts["one_gpu"]["systems"]
    assert set(systems) == {"plain", "zeropp_stage_3", "zeropp_offload"}
    for name, s in systems.items():
        assert s["status"] == "ok" and s["tokens_per_s"] > 0 and len(s["losses"]) == len(s["step_s"]), (name, s)
    assert parts["offload_largest"]["largest_trained"]["size"] in ("tiny", "tiny2")
    (attempt,) = parts["two_ranks"]["attempts"]
    assert attempt["backend"] == "gloo" and attempt["max_abs_diff"] <= 1e-5
    summary = parts["pipeline"]["summary_json"]
    assert summary["world_size"] == 1 and "rm_pairwise_accuracy" in summary


def test_dry_run_sends_back_three_files(dry_run):
    out, _ = dry_run
    files = sorted(p.name for p in out.rglob("*"))
    assert files == sorted(_check_module().RESULT_FILES), files  # the GPU machine returns at most 8
    log = (out / "check.log").read_text()
    assert "===== part pipeline" in log and "Traceback" not in log


def test_without_cuda_it_says_so_in_one_line(tmp_path):
    if torch.cuda.is_available():
        pytest.skip("this machine has CUDA")
    proc = _run(str(tmp_path / "r"))
    assert proc.returncode == 2 and proc.stdout == ""
    (line,) = proc.stderr.splitlines()
    assert "no CUDA device here" in line and "--dry-run" in line
    assert not (tmp_path / "r").exists()


def test_bad_arguments_name_the_fix(tmp_path):
    proc = _run(str(tmp_path), "--dry-run", "--parts", "env,kernals")
    assert proc.returncode == 2 and "unknown ['kernals']" in proc.stderr and "choose from env,tests" in proc.stderr
    proc = _run("--dry-run")
    assert proc.returncode == 2 and "no results folder" in proc.stderr


def test_a_missing_package_names_the_wheel_to_carry():
    check = _check_module()
    lines = check.missing_packages({"torch": ("torch", "x"), "zeropp_no_such_module": ("no-such-dist", "a test")})
    (line,) = lines
    assert "'zeropp_no_such_module'" in line and "pip download --no-deps -d .gpu-wheels no-such-dist" in line
    assert "--wheels .gpu-wheels" in line
    assert check.missing_packages() == []  # the test environment has everything the parts import

"""The prepared GPU check: one command on a lent GPU machine, every CUDA path of the project.

    python benchmarks/gpu/check.py RESULTS_DIR                      # on the GPU machine (~9.5 min)
    python benchmarks/gpu/check.py RESULTS_DIR --parts kernels      # re-run one part
    python benchmarks/gpu/check.py RESULTS_DIR --dry-run            # on CPU, tiny sizes (in the suite)
    python benchmarks/gpu/check.py --prepare-wheels .gpu-wheels     # here, before the run: wheels to carry

The GPU machine has no package registry and runs are short (15 minutes of device time in
all, start included; at most 8 result files back), so everything is decided here and the
run costs one command. The driver:

1. checks that CUDA is there (without ``--dry-run``: one line and exit 2 when it is not)
   and that every package the parts import is installed, naming the wheel to carry for
   each one that is missing (``--prepare-wheels`` downloads them here; ``--wheels DIR``
   installs them there with ``pip --no-index``);
2. installs the project over the image's packages (``pip install --no-deps
   --no-build-isolation -e .``: the image has setuptools, and no index to build against);
3. runs the parts in order, each in its own process with its own time budget, so that a
   part that fails, hangs or kills its process leaves the others' results:

   ========== =====================================================================  ======
   part       what it measures (parts.py has each one)                                budget
   ========== =====================================================================  ======
   env        GPU, memory, driver, torch/triton/NCCL versions; the two ceilings:      25 s
              device-to-device copy GB/s and a bf16 matmul's TFLOP/s
   tests      every test that skips without CUDA (tests/test_kernels.py's CUDA       120 s
              cases and the sm_90 PTX check), and FSDP2's private names on this torch
   kernels    qwZ/qgZ quantize, dequantize and the fused kernels, int8/int4,          45 s
              bf16/fp16, 1M-256M elements (then 2 bits, bf16, while the budget
              lasts): GB/s from counted bytes against the copy bandwidth, and
              bit-equality with the torch reference
   one_gpu    a ~1B Llama in bf16-mixed under the Trainer: plain training,           230 s
              zeropp_stage_3 and zeropp_offload at world size 1 (tokens/s, MFU)
   two_ranks  2 ranks on the one GPU: NCCL first, then whatever backend works;       45 s
              stage 3 against one process, with CUDA tensors
   pipeline   the README's main job (``zeropp pipeline``) on the GPU                 115 s
   offload_   only when named in --parts: the largest model that trains with its     250 s
   largest    states on the host (ZeRO-Offload's case), above the sizes trained so far
   ========== =====================================================================  ======

4. writes, after every part (so a killed run still leaves what finished): ``check.json``
   (every part's status, seconds and figures), ``check.log`` (everything the parts
   printed) and, at the end, ``check.png`` (kernel GB/s against the copy bandwidth,
   tokens/s per system). Three files: the machine returns at most 8.

``--dry-run`` runs every part on the CPU with tiny sizes and budgets (gloo, the torch
reference, the tests collected instead of run, a few steps of each model), so the script
cannot rot between GPU runs: ``tests/test_gpu_check.py`` runs it in the suite.

Exit status: 0 when every part that ran passed, 1 when one failed or ran out of time, 2 for
bad input (no CUDA without ``--dry-run``, a missing package, an unknown part).
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
HERE = Path(__file__).resolve().parent

# (part, seconds on a GPU, seconds in --dry-run). The order is the run's: the cheapest
# and most telling first, so a short lease still gets them.
# GPU budgets from two leases (H100). First (2026-11-26): tests 57-64 s, kernels 30-32 s,
# one_gpu 172 s (its budget ran out before the second offload size), two_ranks 18-21 s,
# pipeline 69 s. Second (2026-11-27): tests past 70 s with a cold Triton cache (26 s warm),
# kernels 34 s, two_ranks 43 s, pipeline 88 s of stages plus the process's start and exit.
# Third (H200, 2026-11-27): 468 s in all at --budget-s 520; one_gpu's 4.3B offload cell was
# killed at its 61 s (it needs about 135 s), hence offload_largest, a part of its own.
# tests: 120 s since 2026-11-28, when the 2-bit kernels added 105 Triton cases (about 50%
# more to compile cold; not yet run on a GPU).
PARTS = (("env", 25, 60), ("tests", 120, 90), ("kernels", 45, 60), ("one_gpu", 230, 180),
         ("two_ranks", 45, 90), ("pipeline", 115, 180), ("offload_largest", 250, 60))
OPT_IN = ("offload_largest",)  # longer than a default run leaves: only when --parts names it
BUDGET_S = 560  # the whole run: about 9.5 of the lease's 15 minutes (a start takes about 30 s), leaving a re-run of a part

# import name -> (distribution to carry, what needs it). The GPU image has all but the last
# two (docs/gpu.md); the check names what is missing wherever it runs.
REQUIRED = {
    "torch": ("torch", "everything"),
    "triton": ("triton", "the CUDA kernels"),
    "lightning": ("lightning", "the Trainer of one_gpu and pipeline"),
    "transformers": ("transformers", "the Llama of one_gpu and pipeline"),
    "accelerate": ("accelerate", "zeropp_strategy.accelerate"),
    "peft": ("peft", "the recipes"),
    "safetensors": ("safetensors", "the pipeline's exports"),
    "yaml": ("pyyaml", "the pipeline's recipe"),
    "matplotlib": ("matplotlib", "check.png"),
    "pytest": ("pytest", "the tests part"),
    "hypothesis": ("hypothesis", "tests/test_kernels.py"),
    "jsonargparse": ("jsonargparse", "zeropp_strategy's CLI (LightningCLI)"),
    "docstring_parser": ("docstring-parser", "jsonargparse[signatures]"),
}
RESULT_FILES = ("check.json", "check.log", "check.png")


class BadInput(Exception):
    """A problem with the command or the machine that no part can fix: exit 2, one line."""


def missing_packages(required: dict[str, tuple[str, str]] = REQUIRED) -> list[str]:
    """One line per import name that is not installed: the wheel to carry and why."""
    lines = []
    for name, (dist, why) in required.items():
        if importlib.util.find_spec(name) is None:
            lines.append(f"missing package {name!r} (for {why}): carry its wheel: here, run "
                         f"`python benchmarks/gpu/check.py --prepare-wheels .gpu-wheels` (or `pip download --no-deps "
                         f"-d .gpu-wheels {dist}`), then run with `--wheels .gpu-wheels` and carry .gpu-wheels")
    return lines


def prepare_wheels(folder: Path) -> int:
    """Here, with the package index: download the wheels of what the GPU image lacks
    (``REQUIRED``'s last two, pinned to what this machine runs) into ``folder``."""
    from importlib.metadata import version

    folder.mkdir(parents=True, exist_ok=True)
    pins = [f"{d}=={version(d)}" for d in ("jsonargparse", "docstring-parser", "typeshed-client")]
    cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:", "-d", str(folder), *pins]
    print("check.py:", " ".join(cmd), flush=True)
    return subprocess.call(cmd)


def install_wheels(wheels: Path, log) -> None:
    """The carried wheels (there is no index on the GPU machine)."""
    found = sorted(wheels.glob("*.whl"))
    if not found:
        raise BadInput(f"--wheels {wheels}: no .whl file there. Fix: run --prepare-wheels {wheels} here first")
    rc = _run_logged([sys.executable, "-m", "pip", "install", "--no-index", "--no-deps", *map(str, found)], log)
    if rc != 0:
        raise BadInput(f"pip install of the wheels in {wheels} failed (exit {rc}). Fix: carry wheels for this Python")


def install_project(log) -> None:
    """The project over the image's packages: no dependencies, no build isolation (the
    image has setuptools and no index to fetch a build environment from)."""
    rc = _run_logged([sys.executable, "-m", "pip", "install", "--no-deps", "--no-build-isolation", "-e", str(ROOT)],
                     log)
    if rc != 0:
        raise BadInput(f"pip install -e {ROOT} failed (exit {rc}; check.log has pip's output). Fix: see check.log")


def _run_logged(cmd: list[str], log) -> int:
    log.write(f"\n$ {' '.join(cmd)}\n")
    log.flush()
    return subprocess.call(cmd, stdout=log, stderr=subprocess.STDOUT, cwd=ROOT)


def run_part(name: str, budget_s: float, args: argparse.Namespace, log) -> dict:
    """One part in its own process: its JSON result, or what stopped it."""
    result_file = Path(args.work) / f"{name}.json"
    result_file.unlink(missing_ok=True)
    cmd = [sys.executable, str(HERE / "parts.py"), name, str(result_file), "--budget-s", f"{budget_s:.0f}",
           "--work", str(args.work)] + (["--dry-run"] if args.dry_run else [])
    log.write(f"\n===== part {name} (budget {budget_s:.0f} s) =====\n$ {' '.join(cmd)}\n")
    log.flush()
    t0 = time.monotonic()
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, cwd=ROOT, env=env, start_new_session=True)
    try:
        rc = proc.wait(timeout=budget_s + 15)  # the part watches its own budget; this is the backstop
        timed_out = False
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, 9)
        proc.wait()
        rc, timed_out = -9, True
    seconds = round(time.monotonic() - t0, 1)
    try:
        out = json.loads(result_file.read_text()) if result_file.exists() else {}
    except json.JSONDecodeError:  # cut off mid-write by the kill: the status below says what happened
        out = {}
    if timed_out:
        out.update(status="timeout", error=f"killed after {seconds} s (budget {budget_s:.0f} s)")
    elif "status" not in out:
        out.update(status="failed", error=f"the part's process exited {rc} without a result (check.log)")
    elif rc != 0 and out["status"] == "ok":
        out.update(status="failed", error=f"the part reported ok but exited {rc}")
    out["seconds"] = seconds
    return out


def write_png(results: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(12, 4.5))
    kern = results["parts"].get("kernels", {})
    copy_gbps = results["parts"].get("env", {}).get("copy_GBps")
    rows = kern.get("rows", [])
    for (op, bits), style in zip(sorted({(r["op"], r["bits"]) for r in rows}), ["o-", "s-", "^-", "v-"] * 4):
        pts = sorted((r["numel"], r.get("triton_GBps") or r["torch_GBps"]) for r in rows
                     if r["op"] == op and r["bits"] == bits and r["dtype"] == rows[0]["dtype"])
        ax1.plot([p[0] for p in pts], [p[1] for p in pts], style, label=f"{op} int{bits}")
    if copy_gbps:
        ax1.axhline(copy_gbps, color="k", ls="--", label=f"copy {copy_gbps:.0f} GB/s")
        ax1.axhline(0.8 * copy_gbps, color="gray", ls=":", label="0.8 x copy")
    ax1.set(xscale="log", xlabel="elements", ylabel="GB/s (counted bytes)",
            title=f"kernels ({rows[0]['dtype'] if rows else '-'}, {kern.get('backend', '-')})")
    if ax1.get_legend_handles_labels()[0]:  # a run without the kernels part has nothing to label
        ax1.legend(fontsize=7)
    systems = results["parts"].get("one_gpu", {}).get("systems", {})
    names = [n for n, s in systems.items() if s.get("tokens_per_s")]
    ax2.bar(names, [systems[n]["tokens_per_s"] for n in names])
    ax2.set(ylabel="tokens/s", title=f"one GPU, {results['parts'].get('one_gpu', {}).get('model', '-')}")
    fig.suptitle(f"{results['device']} - torch {results['torch']}" + (" - DRY RUN (CPU)" if results["dry_run"] else ""))
    fig.tight_layout()
    fig.savefig(path, dpi=90)
    plt.close(fig)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("results", nargs="?", help="folder for check.json, check.log and check.png")
    p.add_argument("--parts", default=",".join(n for n, _, _ in PARTS if n not in OPT_IN),
                   help="comma-separated subset, in run order (default: all but " + ", ".join(OPT_IN) + ")")
    p.add_argument("--dry-run", action="store_true", help="every part on CPU with tiny sizes (the suite runs this)")
    p.add_argument("--budget-s", type=float, default=BUDGET_S, help="the whole run; parts are scaled to fit")
    p.add_argument("--wheels", type=Path, help="install these carried wheels first (pip --no-index --no-deps)")
    p.add_argument("--no-install", action="store_true", help="skip `pip install -e .` (already installed)")
    p.add_argument("--prepare-wheels", type=Path, metavar="DIR", help="here: download the wheels to carry, and exit")
    args = p.parse_args(argv)
    if args.prepare_wheels:
        return prepare_wheels(args.prepare_wheels)
    try:
        return _check(args)
    except BadInput as e:
        print(f"check.py: {e}", file=sys.stderr)
        return 2


def _check(args: argparse.Namespace) -> int:
    if not args.results:
        raise BadInput("no results folder. Fix: python benchmarks/gpu/check.py RESULTS_DIR [--dry-run]")
    known = [n for n, _, _ in PARTS]
    chosen = [s.strip() for s in args.parts.split(",") if s.strip()]
    unknown = [s for s in chosen if s not in known]
    if unknown or not chosen:
        raise BadInput(f"--parts {args.parts!r}: unknown {unknown or 'none given'}. Fix: choose from {','.join(known)}")
    import torch

    if not args.dry_run and not torch.cuda.is_available():
        raise BadInput(f"no CUDA device here (torch {torch.__version__}, cuda {torch.version.cuda}): this check "
                       "needs a GPU. Fix: run it on the GPU machine, or add --dry-run to rehearse it on CPU")
    missing = missing_packages()
    if args.wheels is not None and missing:
        install_wheels(args.wheels, sys.stdout)
        missing = missing_packages()
    if missing:
        raise BadInput("\n".join(missing))
    out = Path(args.results)
    out.mkdir(parents=True, exist_ok=True)
    args.work = tempfile.mkdtemp(prefix="zeropp-gpu-check-")  # the parts' scratch: not among the files sent back
    device = torch.cuda.get_device_name(0) if torch.cuda.is_available() and not args.dry_run else "CPU"
    results = {"date": time.strftime("%Y-%m-%d %H:%M:%S %Z"), "device": device, "torch": torch.__version__,
               "dry_run": args.dry_run, "command": " ".join([Path(sys.argv[0]).name, *sys.argv[1:]]),
               "parts": {}}
    json_path = out / "check.json"
    t_start = time.monotonic()
    with open(out / "check.log", "a") as log:
        if not (args.dry_run or args.no_install):
            install_project(log)
        budgets = {n: (dry if args.dry_run else gpu) for n, gpu, dry in PARTS}
        scale = min(1.0, args.budget_s / sum(budgets[n] for n in chosen))
        for name in chosen:
            left = args.budget_s - (time.monotonic() - t_start)
            budget = min(budgets[name] * scale, left)
            if budget < 10:
                results["parts"][name] = {"status": "not run", "error": f"{left:.0f} s of --budget-s left"}
            else:
                results["parts"][name] = run_part(name, budget, args, log)
            r = results["parts"][name]
            print(f"check.py: {name:9s} {r['status']:8s} {r.get('seconds', 0):6.1f} s  {r.get('summary', r.get('error', ''))}",
                  flush=True)
            json_path.write_text(json.dumps(results, indent=1) + "\n")
    results["seconds"] = round(time.monotonic() - t_start, 1)
    json_path.write_text(json.dumps(results, indent=1) + "\n")
    try:
        write_png(results, out / "check.png")
    except Exception as e:  # noqa: BLE001 - the figures are in check.json either way
        print(f"check.py: check.png not written: {type(e).__name__}: {e}", flush=True)
    shutil.rmtree(args.work, ignore_errors=True)
    # "refused": offload_largest's memory plan refused a size, which is the ceiling it looks for
    bad = [n for n, r in results["parts"].items() if r["status"] not in ("ok", "refused")]
    print(f"check.py: {len(chosen) - len(bad)}/{len(chosen)} parts ok in {results['seconds']:.0f} s"
          + (f"; not ok: {', '.join(bad)}" if bad else "") + f"; results in {out}/", flush=True)
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())

"""Optimizer offload: host Adam throughput, NVMe swap bandwidth, end-to-end step time.

    python benchmarks/offload.py --part all                     # all three parts, full size
    python benchmarks/offload.py --part adam --adam-sizes 1M,16M,64x256K
    python benchmarks/offload.py --part swap --dir path/on/nvme --state-mib 256
    python benchmarks/offload.py --part e2e --devices 2
    python benchmarks/offload.py --part param --devices 2 --rounds 3   # offload_param="nvme" vs none
    python benchmarks/offload.py --part all --quick --out-dir some/tmp/dir   # smoke test, tiny sizes

Each part writes ``<out-dir>/offload_<part>.json`` (default ``benchmarks/results/``) and
prints a markdown table. Every JSON records the hardware (CPU, core count, RAM, torch
version, the file system of ``--dir``) and the exact command line. ``--quick`` shrinks
every size so that the whole run takes well under a minute: its figures are a smoke
test, not measurements (the JSON says ``"quick": true``).

``adam``: CPU AdamW step throughput (Mparams/s, and GB/s counting the 28 bytes per element
a step moves: param, grad, two moments read; param, two moments written) on flat fp32
tensors (``--adam-sizes``: ``1M`` is one tensor of 2**20 elements, ``64x256K`` a list of
64 tensors of 2**18). Compared: ``torch.optim.AdamW`` for-loop (``foreach=False``),
``foreach=True``, ``fused=True``, and ours: ``OffloadOptimizer(AdamW(...),
OffloadConfig(device="cpu"))`` stepping the same parameters (it picks the fused CPU kernel
when the user chose no implementation). ``--warmup`` steps, then the median of ``--steps``
timed steps; ratios are throughput over the fused kernel's.

``swap``: NVMe swap bandwidth, in the directory ``--dir`` (default: a new temporary
directory under the current directory, removed afterwards). (a) The drive's sequential
bandwidth, the *reference*: with ``fio`` where it is installed (8 MiB requests, ``psync``,
1 and 4 jobs, ``--direct=1`` unless refused; per direction the faster job count), else
with ``dd`` (8 MiB blocks, ``oflag=direct conv=fdatasync`` to write, ``iflag=direct`` to
read; without the direct flags if dd refuses them). The JSON's ``reference`` says which
tool and job gave each figure. (b) Our swap path: an ``OffloadOptimizer`` with
``device="nvme"`` over ``--state-mib`` MiB of fp32 AdamW state (the step reads and writes
all of it, so I/O dominates; the same step with the state in RAM is timed beside it),
reported as (bytes read + bytes written per step) / step time and as a fraction of what
the reference bandwidths would need for the same bytes (``R/read + W/write``) over the step
time; and the raw ``SwapFile.write_from`` (+ fsync) / ``read_into`` of one ``--size-mib``
buffer, ``O_DIRECT`` and buffered, for each ``--io-threads`` and ``--io-block-mib``,
as a fraction of the reference write/read bandwidth (target >= 0.70). As root, the page cache is
dropped before every buffered read (``sync; echo 3 > /proc/sys/vm/drop_caches``) so
that buffered reads come from the drive; the JSON records whether that succeeded. Not
root: buffered reads may come from the page cache and overstate the drive. Every row
says which I/O mode was actually used: a file system that refuses ``O_DIRECT`` (tmpfs
before Linux 6.6, some network file systems) gets buffered I/O.

``e2e``: median step time of a small Lightning training run on CPU (a residual MLP
language model, ``--e2e-width`` x ``--e2e-depth``, several million parameters, AdamW),
``ZeroPPStrategy(stage=--stage)`` with: no offload (the user's AdamW as PyTorch runs it by
default on CPU, the for-loop), no offload with ``AdamW(fused=True)``, ``offload_optimizer=
"cpu"``, ``offload_optimizer="nvme"`` (in ``--dir``), and ``offload_optimizer="cpu"`` +
``offload_param="cpu"`` (stage 3). A callback records ``time.perf_counter()`` at
``on_before_optimizer_step`` and ``on_train_batch_end``: step time is the median interval
between batch ends after ``--e2e-warmup`` steps, optimizer time the median of
(batch end - before optimizer step). Overhead is relative to no offload. Each cell runs
in its own process (``--devices 2`` launches 2 CPU ranks through Lightning), except under
``--quick`` with one device, where the cells run one after another in this process.
Each cell also records rank 0's CPU seconds, page faults and block I/O per step
(``getrusage``, all its threads) and, with ``offload_param="nvme"``, the parameter
store's ``io_stats()``.

``param``: ``offload_param="nvme"`` against no offload (issue 18 item 6: target step time
<= 1.3x), stage 3, fp32 (the e2e model has no precision flag): the e2e cells ``none``,
``param_nvme`` (your AdamW steps the mapped shards; the memory plan keeps the gradients
in host memory, since the budget has room for them), ``opt_nvme_param_nvme``
(``zeropp_offload_nvme``'s placement) and ``param_nvme_grads_nvme`` (no budget, so no
plan: the gradients go through the drive too), ``--rounds`` times, interleaved, so that
a slow spell of a shared machine lands on both sides of a ratio. Reported per round: the step
time ratio to ``none`` of the same round, rank 0's CPU-time ratio (less sensitive to
other load on the machine than wall time), the major page faults per all-gather copy-in
(pages the read-ahead missed) and the time the step waited for the write-behind; then
the range and median of the ratios. To measure code from another commit with this
benchmark: ``git archive <commit> zeropp_strategy | tar -x -C /tmp/base`` and run it with
``PYTHONPATH=/tmp/base`` (the JSON records which ``zeropp_strategy`` each cell imported).
"""

from __future__ import annotations

import argparse
import json
import shlex
import shutil
import sys
import tempfile
import time
from pathlib import Path

# The parts live beside this file (benchmarks/offload_*.py) and are imported by their own names:
# benchmarks/ is sys.path[0] when this runs as a script, and is put there when it is imported.
# Not the repository root: PYTHONPATH decides which zeropp_strategy the cells measure.
sys.path.insert(0, str(Path(__file__).resolve().parent))
from offload_adam import part_adam, print_adam  # noqa: E402
from offload_common import hardware  # noqa: E402
from offload_e2e import E2E_CELLS, part_e2e, part_param, print_e2e, print_param, run_e2e_cell  # noqa: E402
from offload_swap import part_swap, print_swap  # noqa: E402

RESULTS = Path(__file__).resolve().parent / "results"


# -- main ---------------------------------------------------------------------------------------

QUICK = dict(adam_sizes="64K,4x16K", warmup=1, steps=3, size_mib=16, io_threads="1,4", io_block_mib="1,4",
             repeat=1, state_mib=8, swap_tensors=4, buffer_mib=1, e2e_width=64, e2e_depth=2, e2e_vocab=64,
             e2e_seq=16, e2e_batch=4, e2e_warmup=2, e2e_steps=3, rounds=1)


def _parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--part", choices=("adam", "swap", "e2e", "param", "all"), default="all")
    ap.add_argument("--quick", action="store_true", help="tiny sizes: a smoke test (< 1 min), not a measurement")
    ap.add_argument("--out-dir", type=Path, default=RESULTS, help="where offload_<part>.json go")
    ap.add_argument("--dir", type=Path, default=None,
                    help="directory for swap files and dd/fio (default: a temporary one under the current directory)")
    ap.add_argument("--no-drop-caches", action="store_true", help="never drop the page cache, even as root")
    g = ap.add_argument_group("adam")
    g.add_argument("--adam-sizes", default="1M,16M,64x256K", help="'16M' one tensor; '64x256K' 64 tensors")
    g.add_argument("--warmup", type=int, default=3, help="untimed steps (adam, swap optimizer)")
    g.add_argument("--steps", type=int, default=10, help="timed steps (adam, swap optimizer)")
    g = ap.add_argument_group("swap")
    g.add_argument("--size-mib", type=int, default=1024, help="dd/fio file and raw SwapFile buffer size")
    g.add_argument("--io-threads", default="1,2,4,8", help="raw SwapFile sweep")
    g.add_argument("--io-block-mib", default="1,4,8,16", help="raw SwapFile sweep")
    g.add_argument("--repeat", type=int, default=3, help="raw SwapFile repetitions (median)")
    g.add_argument("--state-mib", type=int, default=256, help="AdamW state of the NVMe optimizer, MiB")
    g.add_argument("--swap-tensors", type=int, default=16, help="parameter tensors it is split into")
    g.add_argument("--buffer-count", type=int, default=4, help="NVMe swap buffers (swap optimizer and e2e nvme)")
    g.add_argument("--buffer-mib", type=int, default=64, help="MiB per NVMe swap buffer (swap optimizer and e2e nvme)")
    g.add_argument("--opt-io-threads", type=int, default=4)
    g.add_argument("--opt-io-block-mib", type=int, default=8)
    g = ap.add_argument_group("e2e")
    g.add_argument("--devices", type=int, default=1, help="CPU ranks per cell")
    g.add_argument("--stage", type=int, default=3, choices=(1, 2, 3))
    g.add_argument("--e2e-width", type=int, default=384)
    g.add_argument("--e2e-depth", type=int, default=4)
    g.add_argument("--e2e-vocab", type=int, default=1024)
    g.add_argument("--e2e-seq", type=int, default=32)
    g.add_argument("--e2e-batch", type=int, default=4, help="sequences per rank per step")
    g.add_argument("--e2e-warmup", type=int, default=3)
    g.add_argument("--e2e-steps", type=int, default=10)
    g.add_argument("--cell-timeout", type=int, default=600, help="seconds per e2e cell (subprocess)")
    g.add_argument("--rounds", type=int, default=3, help="param: interleaved rounds of none / nvme cells")
    ap.add_argument("--e2e-cell", choices=E2E_CELLS, help=argparse.SUPPRESS)
    ap.add_argument("--cell-out", type=Path, help=argparse.SUPPRESS)
    return ap


def main() -> None:
    ap = _parser()
    args = ap.parse_args()
    if args.quick:  # shrink what the user did not set
        given = {a.dest for a in ap._actions for arg in sys.argv[1:] for opt in a.option_strings
                 if arg == opt or arg.startswith(opt + "=")}
        for k, v in QUICK.items():
            if k not in given:
                setattr(args, k, v)

    if args.e2e_cell:  # one e2e cell, in its own process (Lightning may launch more ranks of it)
        res = run_e2e_cell(args.e2e_cell, args, args.dir)
        if res:
            args.cell_out.write_text(json.dumps(res))
        return

    command = "python " + shlex.join(sys.argv)
    parts = ["adam", "swap", "e2e", "param"] if args.part == "all" else [args.part]
    temp = None
    if args.dir is None and parts != ["adam"]:
        temp = Path(tempfile.mkdtemp(prefix="offload-bench-", dir="."))
    d = args.dir or temp or Path(".")
    args.out_dir.mkdir(parents=True, exist_ok=True)
    try:
        for part in parts:
            t0 = time.perf_counter()
            if part == "adam":
                res = part_adam(args)
                print_adam(res)
            elif part == "swap":
                res = part_swap(args, d)
                print_swap(res)
            elif part == "e2e":
                res = part_e2e(args, d)
                print_e2e(res)
            else:
                res = part_param(args, d)
                print_param(res)
            res.update(command=command, quick=args.quick, wall_s=time.perf_counter() - t0, hardware=hardware(d),
                       dir="temporary directory under the current directory" if temp else str(d))
            path = args.out_dir / f"offload_{part}.json"
            path.write_text(json.dumps(res, indent=1))
            print(f"\nwrote {path} ({res['wall_s']:.1f} s)", flush=True)
    finally:
        if temp is not None:
            shutil.rmtree(temp, ignore_errors=True)


if __name__ == "__main__":
    main()

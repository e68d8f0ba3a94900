"""Loading a published model on 2 ranks at stage 3: every rank whole (the old way) against
each rank reading only its shard (``zeropp_strategy.from_pretrained``), side by side.

    python benchmarks/pretrained.py --write /var/tmp/llama-2.7B --size 2.7B     # once: a bf16 folder
    python benchmarks/pretrained.py --load /var/tmp/llama-2.7B                  # old, new, plain; the table

``--write`` streams a Llama of a shape from benchmarks/llama.py into a ``save_pretrained``-
style folder (config.json, ``model-0000k-of-0000n.safetensors`` of at most 2 GiB each and
the index), random N(0, 0.02) bf16 weights, one file's tensors in memory at a time.

``--load`` runs, each in fresh processes: ``plain`` (one process,
``AutoModelForCausalLM.from_pretrained(folder, dtype=bf16)``: the reference time), ``old``
(2 ranks under the Trainer, ``ZeroPPStrategy(stage=3, meta_init=False)``, every rank calling
transformers' ``from_pretrained`` in ``configure_model``) and ``new`` (2 ranks, the default
stage 3, ``zeropp_strategy.from_pretrained`` in ``configure_model``); with ``--modes
stage1,stage1_rank0``, ``stage1`` (2 ranks, ``ZeroPPStrategy(stage=1)``, the same call in
``configure_model``: every rank reads and holds the whole model, as under DDP) and
``stage1_rank0`` (the model built under ``trainer.init_module(empty_init=True)``: rank 0
reads, the others get its values with DDP's broadcast). Per rank: seconds
from the Trainer's start to the first training batch (load and shard; ``plain``: the one
``from_pretrained`` call), with the imports both sides need (transformers' Llama; Lightning
and this package) done before the clock starts and timed beside it (``import_s``), peak RSS (``VmHWM``
and a 20 ms sampler, with its anonymous part: mapped file pages are page cache), against
the shard plus the largest tensor. ``--dtype fp32`` (the default): ``bf16-mixed`` as users
train, fp32 parameters converted from the bf16 files; ``--dtype bf16``: ``bf16-true``, the
files' own dtype. With ``--digests`` (and ``plain`` among the modes), after the timing every
rank of ``old``/``new`` hashes each parameter's local shard and ``plain`` hashes the rows
FSDP2 gives each of 2 ranks (outside the timed and sampled part); every pair must be equal,
bit for bit, or the command fails, after saving the results with the verdict.
Writes benchmarks/results/pretrained.json (one entry per folder and dtype).

``--finetune FOLDER``: benchmarks/pretrained_finetune.py (what it runs and checks: its
docstring). Writes benchmarks/results/pretrained_finetune.json.

    python benchmarks/pretrained.py --write /var/tmp/llama3-8B --size llama3-8B
    python benchmarks/pretrained.py --finetune /var/tmp/llama3-8B --export /var/tmp/llama3-8B-out --steps 5
"""

from __future__ import annotations

import argparse
import json
import math
import os
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))
from llama import SIZES, llama_config, llama_params  # noqa: E402
from pretrained_finetune import finetune, finetune_cell  # noqa: E402
from rss import PeakRSS, status  # noqa: E402

RESULTS = ROOT / "benchmarks" / "results" / "pretrained.json"
FINETUNE_RESULTS = ROOT / "benchmarks" / "results" / "pretrained_finetune.json"
DTYPES = {"fp32": None, "bf16": None}  # filled with torch dtypes where torch is imported
FILE_BYTES = 2 * 2**30


def write_folder(folder: Path, size: str) -> None:
    import torch
    from safetensors.torch import save_file
    from transformers import LlamaForCausalLM

    folder.mkdir(parents=True, exist_ok=True)
    cfg = llama_config(size, 2048)
    cfg.dtype = "bfloat16"
    cfg.save_pretrained(folder)
    with torch.device("meta"):
        shapes = {k: v.shape for k, v in LlamaForCausalLM(cfg).state_dict().items()}
    groups, current, nbytes = [], [], 0
    for name, shape in shapes.items():
        size_b = 2 * torch.Size(shape).numel()
        if current and nbytes + size_b > FILE_BYTES:
            groups.append(current)
            current, nbytes = [], 0
        current.append(name)
        nbytes += size_b
    groups.append(current)
    weight_map, g = {}, torch.Generator().manual_seed(0)
    for i, names in enumerate(groups):
        file = f"model-{i + 1:05d}-of-{len(groups):05d}.safetensors"
        tensors = {n: (torch.randn(shapes[n], generator=g) * 0.02).to(torch.bfloat16) for n in names}
        for n in names:
            if n.endswith("norm.weight"):
                tensors[n].fill_(1.0)
        save_file(tensors, folder / file, metadata={"format": "pt"})
        weight_map.update(dict.fromkeys(names, file))
        del tensors
        print(f"wrote {file} ({len(names)} tensors)", flush=True)
    total = sum(2 * torch.Size(s).numel() for s in shapes.values())
    (folder / "model.safetensors.index.json").write_text(json.dumps(
        {"metadata": {"total_size": total}, "weight_map": weight_map}, indent=1))


def _digest(t) -> str:  # noqa: ANN001 - a tensor
    """The tensor's shape, dtype and bytes, hashed: equal digests mean bit-for-bit equal."""
    import hashlib

    import torch

    data = t.detach().contiguous().reshape(-1).view(torch.uint8).numpy()
    return f"{tuple(t.shape)}/{t.dtype}/{hashlib.blake2b(data, digest_size=16).hexdigest()}"


def _shard_rows(shape, world: int, rank: int) -> tuple[int, int]:  # noqa: ANN001
    """The rows FSDP2 gives ``rank`` of a tensor of ``shape`` sharded on dim 0 over ``world``."""
    rows = shape[0] if len(shape) else 1
    per = -(-rows // world)
    return min(rows, rank * per), min(rows, (rank + 1) * per)


def run_cell(args: argparse.Namespace) -> None:
    """One rank of ``old``/``new``/``stage1``/``stage1_rank0``, or the ``plain`` process."""
    import torch

    DTYPES.update(fp32=torch.float32, bf16=torch.bfloat16)
    torch.set_num_threads(1 if args.mode != "plain" else 2)
    peak = PeakRSS()
    peak.start()
    out: dict = {"mode": args.mode, "rss_before": status()["VmRSS"]}
    t0 = time.perf_counter()
    # the code both sides run is imported before the clock starts (Lightning's import alone is 3-4 s
    # on this machine, transformers' Llama 1-2 s): load_s is the load, import_s beside it
    import importlib

    importlib.import_module("transformers.models.llama.modeling_llama")
    from transformers import AutoModelForCausalLM

    if args.mode != "plain":
        import lightning.pytorch as L

        import zeropp_strategy
        from zeropp_strategy import ZeroPPStrategy
    out["import_s"] = time.perf_counter() - t0
    import resource

    usage0 = resource.getrusage(resource.RUSAGE_SELF)
    t0 = time.perf_counter()

    def measured(loaded: bool = True) -> None:  # the load's time and peaks end here, before any hashing
        if "peak_rss" in out:
            return
        if loaded:
            out["load_s"] = time.perf_counter() - t0
            usage = resource.getrusage(resource.RUSAGE_SELF)  # the kernel's account of the same window
            out.update(user_s=usage.ru_utime - usage0.ru_utime, sys_s=usage.ru_stime - usage0.ru_stime,
                       minor_faults=usage.ru_minflt - usage0.ru_minflt)
        peak.stop.set()
        last = peak.sample()
        out.update(peak_rss=peak.peak["VmRSS"], peak_anon=peak.peak["RssAnon"], VmHWM=last["VmHWM"])

    if args.mode == "plain":
        model = AutoModelForCausalLM.from_pretrained(args.load, dtype=DTYPES[args.dtype])
        measured()
        if args.digests:  # the rows each of 2 ranks should hold, for the bit-for-bit check
            out["digests"] = {name: [_digest(p[slice(*_shard_rows(p.shape, 2, r))] if p.dim() else p)
                                     for r in range(2)] for name, p in model.named_parameters()}
    else:
        class Module(L.LightningModule):
            def __init__(self) -> None:
                super().__init__()
                self.model = None

            def configure_model(self) -> None:
                if self.model is None:
                    if args.mode == "old":
                        self.model = AutoModelForCausalLM.from_pretrained(args.load, dtype=DTYPES[args.dtype])
                    else:
                        self.model = zeropp_strategy.from_pretrained(args.load, dtype=DTYPES[args.dtype])

            def on_train_batch_start(self, batch, batch_idx):
                measured()
                if args.digests and args.mode in ("old", "new"):  # this rank's shards, after the timing
                    from zeropp_strategy.primitives import local

                    out["digests"] = {name: _digest(local(p)) for name, p in self.model.named_parameters()}
                return -1  # loaded and sharded: the measurement ends before the first batch's compute

            def training_step(self, batch, batch_idx):
                raise AssertionError("not reached")

            def configure_optimizers(self):
                return torch.optim.SGD(self.parameters(), lr=0.0)

            def train_dataloader(self):
                return torch.utils.data.DataLoader(torch.zeros(2, 8, dtype=torch.long), batch_size=1)

        strategy = ZeroPPStrategy(stage=1) if args.mode.startswith("stage1") else ZeroPPStrategy(
            stage=3, meta_init=args.mode == "new", wrap_modules=["LlamaDecoderLayer"])
        precision = "bf16-true" if args.dtype == "bf16" else "bf16-mixed"
        trainer = L.Trainer(accelerator="cpu", devices=2, strategy=strategy, precision=precision, max_epochs=1,
                            limit_train_batches=1,
                            logger=False, enable_checkpointing=False, enable_progress_bar=False,
                            enable_model_summary=False)
        module = Module()
        if args.mode == "stage1_rank0":  # init_module(empty_init=True): rank 0 reads, DDP broadcasts
            with trainer.init_module(empty_init=True):
                module.model = zeropp_strategy.from_pretrained(args.load, dtype=DTYPES[args.dtype])
        trainer.fit(module)
        out["rank"] = trainer.global_rank
    measured(loaded=False)  # the peaks of a cell that never reached its first batch
    Path(f"{args.out}.{args.mode}.{out.get('rank', 0)}").write_text(json.dumps(out))


def measure(args: argparse.Namespace) -> dict:
    from safetensors import safe_open

    folder = Path(args.load)
    index = json.loads((folder / "model.safetensors.index.json").read_text())
    largest = 0
    for file in sorted(set(index["weight_map"].values())):
        with safe_open(str(folder / file), "pt") as f:
            for k in f.keys():
                shape = f.get_slice(k).get_shape()
                largest = max(largest, 2 * math.prod(shape))
    total = index["metadata"]["total_size"]
    per = 2 if args.dtype == "bf16" else 4  # bytes per parameter in memory; the files hold bf16
    res: dict = {"folder_bytes": total, "largest_tensor_bytes": largest * per // 2, "shard_bytes": total * per // 4,
                 "cells": []}
    for mode in args.modes.split(","):
        out = f"/tmp/zeropp-pretrained-{os.getpid()}"
        cmd = [sys.executable, __file__, "--cell", "--mode", mode, "--load", str(folder), "--out", out, "--dtype",
               args.dtype, *(["--digests"] if args.digests else [])]
        if mode != "plain":
            cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", __file__, *cmd[2:]]
        t0 = time.perf_counter()
        rc = subprocess.run(cmd, cwd=ROOT).returncode
        ranks = [json.loads(Path(f"{out}.{mode}.{r}").read_text()) for r in range(1 if mode == "plain" else 2)
                 if Path(f"{out}.{mode}.{r}").exists()]
        res["cells"].append({"mode": mode, "returncode": rc, "wall_s": time.perf_counter() - t0, "ranks": ranks})
        print(json.dumps({k: v for k, v in res["cells"][-1].items() if k != "ranks"}), flush=True)
    if args.digests:
        res["bit_for_bit"] = compare_digests(res["cells"])
        print(json.dumps(res["bit_for_bit"]), flush=True)
    for cell in res["cells"]:  # the verdict is kept, not the hashes
        for r in cell["ranks"]:
            r.pop("digests", None)
    return res


def compare_digests(cells: list[dict]) -> dict:
    """Every sharded cell's rank shards against the rows of one process's
    ``transformers.from_pretrained``: equal bit for bit, tensor by tensor. A cell with a
    rank or a tensor missing is not equal (nothing passes on a partial result)."""
    plains = [c["ranks"][0].get("digests") if c["ranks"] else None for c in cells if c["mode"] == "plain"]
    plain = plains[0] if plains else None
    if not plain:
        return {"error": "no digests from the plain process: run --modes with plain and --digests"}
    verdict = {}
    if any(d != plain for d in plains[1:]):  # plain must repeat itself
        verdict["plain"] = {"equal_bit_for_bit": False, "differ": ["a later plain run differs from the first"]}
    for mode in ("old", "new"):
        runs = [c["ranks"] for c in cells if c["mode"] == mode]  # every repeat of the mode is compared
        if not runs:
            continue
        compared, differ, missing, extra = 0, [], [], set()
        for ranks in runs:
            got = {r.get("rank"): r.get("digests") or {} for r in ranks}
            for name, want in plain.items():
                for rank in range(2):
                    have = got.get(rank, {}).get(name)
                    if have is None:
                        missing.append(f"rank {rank}: {name}")
                    elif have != want[rank]:
                        differ.append(f"rank {rank}: {name}")
                    else:
                        compared += 1
            extra |= {n for d in got.values() for n in d} - set(plain)
        expected = 2 * len(plain) * len(runs)
        verdict[mode] = {"runs": len(runs), "tensors_equal": compared, "tensors_expected": expected,
                         "differ": differ[:10], "missing": missing[:10], "unexpected": sorted(extra)[:10],
                         "equal_bit_for_bit": compared == expected > 0 and not differ and not missing and not extra}
    if not verdict:
        return {"error": "no old or new cell to compare with plain: run --modes with old or new and --digests"}
    return verdict


def table(res: dict) -> str:
    gib = 2**30
    bound = (res["shard_bytes"] + res["largest_tensor_bytes"]) * 1.1
    lines = [f"folder {res['folder_bytes'] / gib:.2f} GiB; per-rank bound (shard + largest tensor + 10%) "
             f"{bound / gib:.2f} GiB", "",
             "| mode | rank | load s | user s | system s | minor faults | peak RSS GiB | of which anonymous, peak GiB "
             "| VmHWM GiB |", "|---|---|---|---|---|---|---|---|---|"]
    for c in res["cells"]:
        for r in c["ranks"]:
            nan = float("nan")
            lines.append(f"| {c['mode']} | {r.get('rank', '-')} | {r.get('load_s', nan):.1f} | "
                         f"{r.get('user_s', nan):.1f} | {r.get('sys_s', nan):.1f} | {r.get('minor_faults', '-')} | "
                         f"{r['peak_rss'] / gib:.2f} | {r['peak_anon'] / gib:.2f} | {r['VmHWM'] / gib:.2f} |")
    return "\n".join(lines)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--write", type=Path, help="write a random bf16 folder of --size here, and exit")
    p.add_argument("--size", default="2.7B", choices=list(SIZES))
    p.add_argument("--load", help="the folder to load")
    p.add_argument("--modes", default="plain,old,new")
    p.add_argument("--digests", action="store_true",
                   help="--load: also check every rank's shards against plain's rows, bit for bit (hashes, after the "
                        "timing)")
    p.add_argument("--dtype", default="fp32", choices=["fp32", "bf16"],
                   help="the parameters' dtype: fp32 (bf16-mixed, as users train: the bf16 files are converted) or "
                        "bf16 (bf16-true: the files' own)")
    p.add_argument("--finetune", help="fine-tune this folder on 2 ranks (int4 base, LoRA r=16) and check the exports")
    p.add_argument("--export", help="--finetune: where the adapters and the merged model go")
    p.add_argument("--steps", type=int, default=5)
    p.add_argument("--lr", type=float, default=3e-4,
                   help="AdamW's learning rate of the fine-tune (LoRA); 1e-3 overshoots near zero by step 5")
    p.add_argument("--precision", default="bf16-mixed",
                   help="--finetune: the Trainer's precision (32-true on a CPU without bf16 matmul units: there "
                        "bf16-mixed's autocast runs emulated bf16 matmuls, about 10x slower)")
    p.add_argument("--budget-gib", type=float, default=11.0, help="--finetune: host_memory_budget_bytes per rank")
    p.add_argument("--cell", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--mode", help=argparse.SUPPRESS)
    p.add_argument("--out", help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.write:
        write_folder(args.write, args.size)
        print(f"{args.write}: {llama_params(args.size) / 1e9:.2f}B parameters in bf16")
    elif args.cell:
        finetune_cell(args) if args.mode == "finetune" else run_cell(args)
    elif args.finetune:
        res = finetune(args)
        # the allocator's settings change the resident figures: they are part of the command
        env = " ".join(f"{k}={v}" for k, v in sorted(os.environ.items()) if k.startswith("MALLOC_"))
        res["date"], res["command"] = time.strftime("%Y-%m-%d"), (env + " " if env else "") + \
            "python benchmarks/pretrained.py " + " ".join(a if not a.startswith("/") else "DIR" for a in sys.argv[1:])
        print(json.dumps(res, indent=1))
        if res["returncode"] != 0 or len(res["ranks"]) != 2:  # the last good results stay as they are
            sys.exit("pretrained.py --finetune: the run failed or left ranks without results (see the log above); "
                     f"{FINETUNE_RESULTS.name} is left unchanged")
        FINETUNE_RESULTS.write_text(json.dumps(res, indent=1) + "\n")
    else:
        res = measure(args)
        res["date"], res["command"] = time.strftime("%Y-%m-%d"), "python benchmarks/pretrained.py " + " ".join(
            "DIR/" + Path(a).name if a.startswith("/") else a for a in sys.argv[1:])  # no machine's paths
        res["dtype"] = args.dtype
        runs = json.loads(RESULTS.read_text()) if RESULTS.exists() else {}
        print(table(res))
        bad = [c["mode"] for c in res["cells"]
               if c["returncode"] != 0 or len(c["ranks"]) != (1 if c["mode"] == "plain" else 2)]
        if bad:  # a cell that died leaves no figure: the table is partial; the saved results stay
            sys.exit(f"pretrained.py: cells {', '.join(bad)} failed or left ranks without results (see the log "
                     f"above); {RESULTS.name} is left unchanged")
        key = f"{Path(args.load).name}-{args.dtype}"
        if key in runs:  # other modes of the same folder measured before are kept beside these (all repeats)
            now = {c["mode"] for c in res["cells"]}
            res["cells"] = [c for c in runs[key].get("cells", []) if c["mode"] not in now] + res["cells"]
        runs[key] = res
        RESULTS.write_text(json.dumps(runs, indent=1) + "\n")
        check = res.get("bit_for_bit")
        if check is not None and ("error" in check or not all(v["equal_bit_for_bit"] for v in check.values())):
            sys.exit(f"pretrained.py: the shards are not equal bit for bit to from_pretrained's rows: {check}")


if __name__ == "__main__":
    main()

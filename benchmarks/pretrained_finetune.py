"""``python benchmarks/pretrained.py --finetune FOLDER``: the fine-tune of a folder written by
``--write``, its ranks (benchmarks/pretrained.py ``--cell --mode finetune``, started by
torchrun) and the check of its exports. Imported by benchmarks/pretrained.py.

``--finetune FOLDER`` fine-tunes it the way docs/pretrained.md's Lightning section tells
users: ``zeropp_strategy.from_pretrained(FOLDER, dtype=torch.float32)`` in
``configure_model`` and peft LoRA r=16 on the attention and MLP projections, under the
Trainer on 2 ranks, ``bf16-mixed`` (``--precision``), ``ZeroPPStrategy(stage=3, quantize_frozen_weights=True,
frozen_weight_bits=4)`` with the optimizer offloaded to host memory under
``host_memory_budget_bytes`` (so that the memory plan is made and logged), ``--steps``
steps (AdamW, ``--lr``) on one fixed batch of 2 rows of 32 random byte-range ids per rank,
repeated: an overfit check, so the loss must fall at every step; then the live model's logits on a fixed row
(``trainer.predict``), the adapters (``export_adapters``) and the merged model in bf16
(``export_pretrained``) are written under ``--export``. A third process
checks them: the merged folder loaded by transformers gives the live model's logits on a
fixed batch within bf16 rounding, and ``PeftModel.from_pretrained`` of the base folder and
the adapter folder holds the trained adapters bit for bit. Writes
benchmarks/results/pretrained_finetune.json.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

from rss import PeakRSS, status  # a sibling: benchmarks/pretrained.py puts benchmarks/ on sys.path

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = str(Path(__file__).with_name("pretrained.py"))  # the entry point the ranks run
LORA = {"r": 16, "lora_alpha": 32, "lora_dropout": 0.0,
        "target_modules": ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]}


def _probe_ids():
    import torch

    return torch.randint(3, 384, (1, 8), generator=torch.Generator().manual_seed(1))


def finetune_cell(args: argparse.Namespace) -> None:
    """One rank of ``--finetune``: docs/pretrained.md's Lightning module with LoRA (fp32
    parameters under ``bf16-mixed``, as users train), under the Trainer."""
    import lightning.pytorch as L
    import torch
    from peft import LoraConfig, get_peft_model

    import zeropp_strategy
    from zeropp_strategy.engine.state import to_full_cpu

    torch.set_num_threads(1)
    peak = PeakRSS()
    peak.phase = "load"
    peak.start()
    export = Path(args.export)
    out: dict = {"losses": [], "step_s": []}

    class FineTune(L.LightningModule):
        def __init__(self, folder: str) -> None:
            super().__init__()
            self.folder, self.model = folder, None

        def configure_model(self) -> None:
            if self.model is None:  # on the meta device at stage 3: nothing is read yet
                base = zeropp_strategy.from_pretrained(self.folder, dtype=torch.float32)
                self.model = get_peft_model(base, LoraConfig(**LORA))

        def training_step(self, batch, batch_idx):
            loss = self.model(input_ids=batch, labels=batch).loss
            out["losses"].append(float(loss.detach()))
            return loss

        def predict_step(self, batch, batch_idx):  # the live model's logits, through the strategy's forward
            return self.model(input_ids=batch).logits.float()

        def configure_optimizers(self):
            return torch.optim.AdamW((p for p in self.parameters() if p.requires_grad), lr=args.lr)

    class Clock(L.Callback):
        def on_train_batch_start(self, trainer, module, batch, batch_idx):
            if "load_s" not in out:
                out["load_s"] = time.perf_counter() - t0
                out["rss_after_load"] = status()["VmRSS"]
                peak.phase = "train"
            self.t = time.perf_counter()

        def on_train_batch_end(self, trainer, module, outputs, batch, batch_idx):
            out["step_s"].append(time.perf_counter() - self.t)

    budget = int(args.budget_gib * 2**30)
    strategy = zeropp_strategy.ZeroPPStrategy(stage=3, quantize_frozen_weights=True, frozen_weight_bits=4,
                                              offload_optimizer="cpu", host_memory_budget_bytes=budget)
    trainer = L.Trainer(accelerator="cpu", devices=2, strategy=strategy, precision=args.precision,
                        max_steps=args.steps, callbacks=[Clock()], logger=False, enable_checkpointing=False,
                        enable_progress_bar=False, enable_model_summary=False)
    # One batch of 2 rows of byte ids per rank, the same at every step: an overfit check, so
    # the loss must fall step by step (fresh random rows have nothing to learn beyond their
    # uniform distribution, and a loader shorter than the run repeats them out of order).
    tokens = torch.randint(3, 384, (4, 32), generator=torch.Generator().manual_seed(0))
    module = FineTune(args.finetune)
    t0 = time.perf_counter()
    trainer.fit(module, train_dataloaders=torch.utils.data.DataLoader(tokens, batch_size=2))
    out["fit_s"] = time.perf_counter() - t0
    peak.phase = "predict"
    rows = _probe_ids().repeat(2, 1)  # one row per rank: predict splits its loader without repeats
    logits = trainer.predict(module, dataloaders=torch.utils.data.DataLoader(rows, batch_size=1))[0]
    # the adapters only, gathered one at a time (the whole state would be the model on every rank)
    lora = {k: to_full_cpu(p) for k, p in module.model.named_parameters() if "lora_" in k}
    if trainer.is_global_zero:
        torch.save({"logits": logits, "lora": lora}, export / "live.pt")
    t1 = time.perf_counter()
    peak.phase = "export"
    zeropp_strategy.export_adapters(module.model, export / "adapters")
    zeropp_strategy.export_pretrained(module.model, export / "merged", dtype=torch.bfloat16, max_shard_bytes=2**30)
    out["export_s"] = time.perf_counter() - t1
    memory_plan = trainer.strategy._session.engine.memory_plan if trainer.strategy._session else None
    peak.stop.set()
    last = peak.sample()
    out.update(rank=trainer.global_rank, plan=memory_plan.describe() if memory_plan is not None else None,
               peak_rss=peak.peak["VmRSS"], peak_anon=peak.peak["RssAnon"], VmHWM=last["VmHWM"], budget_bytes=budget,
               phases=peak.phases)  # peaks of setup+load, train, predict, export
    Path(f"{args.out}.finetune.{trainer.global_rank}").write_text(json.dumps(out))


def finetune_check(args: argparse.Namespace) -> dict:
    """The exports, read back by transformers and peft in one process (ranks gone)."""
    import gc

    import torch
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    export = Path(args.export)
    live = torch.load(export / "live.pt")
    t0 = time.perf_counter()
    merged = AutoModelForCausalLM.from_pretrained(export / "merged", dtype=torch.bfloat16)
    with torch.no_grad():
        logits = merged(input_ids=_probe_ids()).logits.float()
    diff = (logits - live["logits"]).abs()
    res = {"merged_load_and_forward_s": time.perf_counter() - t0, "logits_max_abs_diff": diff.max().item(),
           "logits_mean_abs_diff": diff.mean().item(), "live_logits_max_abs": live["logits"].abs().max().item(),
           "same_argmax_fraction": (logits.argmax(-1) == live["logits"].argmax(-1)).float().mean().item()}
    del merged
    gc.collect()
    base = AutoModelForCausalLM.from_pretrained(args.finetune, dtype=torch.bfloat16)
    peft_model = PeftModel.from_pretrained(base, export / "adapters")
    loaded = {k.replace(".default", ""): v for k, v in peft_model.state_dict().items() if "lora_" in k}
    want = live["lora"]
    matched = [k for k in want if k.replace(".default", "") in loaded]
    # an empty or partial match is no proof: every trained adapter must be there and equal
    equal = len(matched) == len(want) > 0 and all(
        torch.equal(loaded[k.replace(".default", "")].float(), want[k].float()) for k in matched)
    res.update(adapters_trained=len(want), adapters_loaded_by_peft=len(loaded), adapters_matched=len(matched),
               adapters_equal_bit_for_bit=equal)
    return res


def finetune(args: argparse.Namespace) -> dict:
    export = Path(args.export)
    export.mkdir(parents=True, exist_ok=True)
    out = f"/tmp/zeropp-finetune-{os.getpid()}"
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", SCRIPT, "--cell", "--mode",
           "finetune", "--finetune", args.finetune, "--export", str(export), "--steps", str(args.steps), "--out", out,
           "--budget-gib", str(args.budget_gib), "--precision", args.precision, "--lr", str(args.lr)]
    t0 = time.perf_counter()
    rc = subprocess.run(cmd, cwd=ROOT).returncode
    ranks = [json.loads(Path(f"{out}.finetune.{r}").read_text()) for r in range(2)
             if Path(f"{out}.finetune.{r}").exists()]
    res: dict = {"folder": Path(args.finetune).name, "returncode": rc, "wall_s": time.perf_counter() - t0,
                 "ranks": ranks, "lora": LORA, "steps": args.steps, "precision": args.precision, "lr": args.lr,
                 "data": "one batch of 2 rows x 32 byte ids per rank, repeated every step"}
    if rc == 0 and len(ranks) == 2:
        res["check"] = finetune_check(args)
    return res

"""PPO rollouts under ZeRO-3: the actor gathered once per ``generate`` call vs once per token.

    python benchmarks/ppo_generation.py                          # 2 ranks, 32 and 128 new tokens
    python benchmarks/ppo_generation.py --tokens 16,64 --hidden 256 --layers 8 --repeat 5
    python benchmarks/ppo_generation.py --quick --out some/tmp/file.json   # smoke test

Spawns ``--devices`` gloo ranks on 127.0.0.1 (CPU), builds a ``PPOModule`` whose actor and
reward model are Llama configs of ``--hidden`` x ``--layers`` (from scratch; the numbers do
not depend on the weights), shards it with ``strategy="zeropp_stage_3"``, and times
``PPOModule.rollout`` (sampling ``--tokens`` new tokens for ``--batch`` prompts per rank,
plus the reward model's score) with ``gather_for_generation`` True and False. It records the
median wall time of ``--repeat`` rollouts after one warm-up, and the parameter all-gather
calls and bytes of one rollout from the comm ledger. Sampling never stops early (every row
runs to ``--tokens``) so that both modes generate the same number of tokens.

Writes ``--out`` (default ``benchmarks/results/ppo_generation.json``) with the hardware and
the command line, and prints a markdown table.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


def _worker(rank: int, world: int, args: argparse.Namespace) -> list[dict]:
    import torch
    from lightning.pytorch import Trainer, seed_everything

    import zeropp_strategy  # noqa: F401
    from zeropp_strategy.comm.ledger import CommKind
    from zeropp_strategy.rlhf.models import tiny_llama_config
    from zeropp_strategy.recipes.ppo import PPOModule

    torch.set_num_threads(max(1, (os.cpu_count() or 2) // world))
    cfg = tiny_llama_config(hidden_size=args.hidden, intermediate_size=3 * args.hidden,
                            num_hidden_layers=args.layers, max_position_embeddings=max(args.tokens) + 64)
    rows = []
    seed_everything(0)
    module = PPOModule(actor=cfg, reward_model=cfg, rollout_batch_size=args.batch, mini_batch_size=args.batch,
                       eval_data=None)
    trainer = Trainer(accelerator="cpu", devices=world, strategy="zeropp_stage_3", max_epochs=1,
                      limit_train_batches=0, logger=False, enable_progress_bar=False, enable_model_summary=False,
                      enable_checkpointing=False)
    trainer.fit(module)  # sets up and shards the model; trains nothing
    strategy = trainer.strategy
    batch = next(iter(module.train_dataloader()))
    ledger = strategy.comm_ledger
    for tokens in args.tokens:
        module.hparams.max_new_tokens = tokens
        for once in (True, False):
            module.hparams.gather_for_generation = once
            # stop_when_done=False in both: the same number of tokens either way.
            saved = module.eos_id
            module.eos_id = -1  # no EOS can be sampled: every row runs to `tokens`
            times = []
            for i in range(args.repeat + 1):
                ledger.reset()
                with strategy._fsdp_root.routed_forward():
                    strategy.barrier()
                    start = time.perf_counter()
                    module.rollout(batch, module._generator(i))
                    strategy.barrier()
                    times.append(time.perf_counter() - start)
            module.eos_id = saved
            totals = ledger.totals(CommKind.PARAM_ALLGATHER_FWD)
            rows.append({"tokens": tokens, "gather_once": once, "seconds": statistics.median(times[1:]),
                         "allgather_calls": totals.calls, "allgather_bytes": totals.total_bytes})
    return rows


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--devices", type=int, default=2)
    p.add_argument("--tokens", default="32,128")
    p.add_argument("--hidden", type=int, default=256)
    p.add_argument("--layers", type=int, default=8)
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--repeat", type=int, default=3)
    p.add_argument("--quick", action="store_true")
    p.add_argument("--out", default=str(Path(__file__).parent / "results" / "ppo_generation.json"))
    args = p.parse_args()
    args.tokens = [int(t) for t in str(args.tokens).split(",")]
    if args.quick:
        args.tokens, args.hidden, args.layers, args.batch, args.repeat = [4], 32, 2, 2, 1
    from tests._dist import run_ranks

    rows = run_ranks(_worker, args.devices, (args,), timeout_s=3600)[0]
    by = {(r["tokens"], r["gather_once"]): r for r in rows}
    print("| new tokens | gather | all-gather calls | all-gather MB (rank 0) | rollout s | speedup |")
    print("|---:|---|---:|---:|---:|---:|")
    for tokens in args.tokens:
        for once in (False, True):
            r = by[(tokens, once)]
            speedup = by[(tokens, False)]["seconds"] / r["seconds"]
            print(f"| {tokens} | {'once per generate' if once else 'per token'} | {r['allgather_calls']} | "
                  f"{r['allgather_bytes'] / 1e6:.1f} | {r['seconds']:.3f} | {speedup:.2f}x |")
    import torch

    record = {"command": " ".join(["python", *sys.argv]), "quick": args.quick, "rows": rows,
              "hardware": {"cpu": platform.processor() or platform.machine(), "cores": os.cpu_count(),
                           "torch": torch.__version__, "devices": args.devices, "backend": "gloo"},
              "model": {"hidden": args.hidden, "layers": args.layers, "batch_per_rank": args.batch}}
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(record, indent=2) + "\n")


if __name__ == "__main__":
    main()

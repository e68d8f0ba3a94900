"""Cross-node bytes per step as the job grows: 4, 8 and 16 ranks, every stage and ZeRO++ switch.

    python benchmarks/scaling.py                     # 4, 8, 16 ranks; about 6 min on 2 cores
    python benchmarks/scaling.py --worlds 4 8 --out /tmp/scaling.json --docs /tmp/scaling.md

One ``torchrun`` per world size on this machine (no network shaping: only the ledger is
read), nodes simulated with ``ZeroConfig.simulated_nodes`` at 4 ranks per node where the
world allows it (4 = 2 x 2, 8 = 2 x 4, 16 = 4 x 4). Every system trains a small GPT-2
(2 layers, width 128, vocab 512, seq 64) in ``bf16-mixed`` for 3 steps; the CommLedger's
inter-node bytes of step 3, summed over all ranks, are set against the formula of
docs/stages.md ("Across nodes") and docs/zeropp.md: with M nodes and P parameters (P_root
of them in the root group, gathered once per step), a two-hop collective puts (M-1) x
bytes(P) across in all.

    stage 1   (M-1) (4P + 4P)                 fp32 reduce-scatter + fp32 gather of updated rows
    stage 2   (M-1) (2P + 4P)                 bf16 gather, fp32 reduce-scatter
    stage 3   (M-1) (2P + 2(P-P_root) + 4P)   gathers in forward and (blocks) backward
    qwZ       int8 gathers: q8 = 1 + 4/256 bytes per element
    hpZ       backward gathers stay in the node: (M-1) (2P + 4P)
    qgZ       int4 reduce: q4 = 1/2 + 4/64 bytes per element (one hop across)
    zeropp    (M-1) (q8 P + q4 P)

FSDP2 pads every parameter's dim 0 to a multiple of the world size, so the ledger sits a few
percent above the formula; the ratio column shows by how much.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
# the systems measured; their ZeroConfig fields are bench_train.py's (ours_fields), one table
SYSTEMS = ("zeropp_stage_1", "zeropp_stage_2", "zeropp_stage_3", "qwZ", "hpZ", "qgZ", "zeropp")
Q8 = 1 + 4 / 256
Q4 = 0.5 + 4 / 64


def formula(system: str, nodes: int, params: int, root_params: int) -> float:
    m, p, pb = nodes - 1, params, params - root_params
    return m * {
        "zeropp_stage_1": 4 * p + 4 * p,
        "zeropp_stage_2": 2 * p + 4 * p,
        "zeropp_stage_3": 2 * p + 2 * pb + 4 * p,
        "qwZ": Q8 * p + Q8 * pb + 4 * p,
        "hpZ": 2 * p + 4 * p,
        "qgZ": 2 * p + 2 * pb + Q4 * p,
        "zeropp": Q8 * p + Q4 * p,
    }[system]


def worker(out: Path) -> None:
    """Runs on every rank under torchrun: each system for 3 steps, rank 0 writes ``out``."""
    import torch
    import torch.distributed as dist
    from lightning.pytorch import Callback, LightningModule, Trainer, seed_everything
    from transformers import GPT2Config, GPT2LMHeadModel

    from benchmarks.bench_train import ours_fields
    from zeropp_strategy import ZeroPPStrategy
    from zeropp_strategy.comm.ledger import CommKind

    torch.set_num_threads(1)
    world = int(os.environ["WORLD_SIZE"])
    per_node = 4 if world % 4 == 0 and world > 4 else 2
    nodes = world // per_node

    class GPT(LightningModule):
        def __init__(self) -> None:
            super().__init__()
            cfg = GPT2Config(n_layer=2, n_embd=128, n_head=4, vocab_size=512, n_positions=64, resid_pdrop=0.0,
                             embd_pdrop=0.0, attn_pdrop=0.0, bos_token_id=0, eos_token_id=0)
            self.model = GPT2LMHeadModel(cfg)
            self.model.loss_type = "ForCausalLM"  # the loss it defaults to, named: no warning (bench_train.gpt2)

        def training_step(self, batch, batch_idx):  # noqa: ANN001, ANN201
            return self.model(input_ids=batch, labels=batch).loss

        def configure_optimizers(self):  # noqa: ANN201
            return torch.optim.AdamW(self.parameters(), lr=1e-3)

        def train_dataloader(self):  # noqa: ANN201
            g = torch.Generator().manual_seed(0)
            return torch.utils.data.DataLoader(torch.randint(0, 512, (64, 64), generator=g), batch_size=2)

    class Record(Callback):
        def __init__(self) -> None:
            self.inter: list[int] = []

        def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):  # noqa: ANN001
            ledger = trainer.strategy.comm_ledger
            self.inter.append(sum(ledger.totals(k).inter_bytes for k in CommKind if k is not CommKind.OTHER))
            ledger.reset()

    results = {}
    for name in SYSTEMS:
        cfg = ours_fields(name)
        seed_everything(0)
        rec = Record()
        module = GPT()
        params = sum(p.numel() for p in module.parameters())
        root = sum(p.numel() for n, p in module.model.named_parameters() if ".h." not in n)
        trainer = Trainer(strategy=ZeroPPStrategy(simulated_nodes=nodes, wrap_modules=["GPT2Block"], **cfg),
                          accelerator="cpu", devices=world, max_steps=3, precision="bf16-mixed", callbacks=[rec],
                          logger=False, enable_checkpointing=False, enable_progress_bar=False,
                          enable_model_summary=False)
        trainer.fit(module)
        everyone = [None] * world
        dist.all_gather_object(everyone, rec.inter[-1])
        results[name] = {"world": world, "nodes": nodes, "ranks_per_node": per_node, "params": params,
                         "root_params": root, "ledger_inter_bytes": sum(everyone),
                         "formula_bytes": formula(name, nodes, params, root)}
    if dist.get_rank() == 0:
        out.write_text(json.dumps(results, indent=1))


def render(results: dict[str, dict], docs: Path, command: str) -> str:
    lines = ["# Cross-node bytes per step at 4, 8 and 16 ranks", "",
             "<!-- generated by benchmarks/scaling.py; edit the script, not this file -->", "",
             f"Command: `{command}`. The CommLedger's inter-node payload bytes of one training step, summed over "
             "all ranks (nodes simulated on one 2-core machine, gloo), small GPT-2 (2 x 128), `bf16-mixed`, against "
             "the formula in the docstring of benchmarks/scaling.py (docs/stages.md, \"Across nodes\").", "",
             "| ranks (nodes x per node) | system | ledger MB/step | formula MB/step | ledger / formula |",
             "|---|---|---:|---:|---:|"]
    for world, cells in sorted(results.items(), key=lambda kv: int(kv[0])):
        for name, c in cells.items():
            lines.append(f"| {world} ({c['nodes']} x {c['ranks_per_node']}) | {name} | "
                         f"{c['ledger_inter_bytes'] / 1e6:.3f} | {c['formula_bytes'] / 1e6:.3f} | "
                         f"{c['ledger_inter_bytes'] / c['formula_bytes']:.3f} |")
    text = "\n".join(lines) + "\n"
    docs.write_text(text)
    return text


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--worlds", type=int, nargs="+", default=[4, 8, 16])
    parser.add_argument("--out", type=Path, default=ROOT / "benchmarks" / "results" / "scaling.json")
    parser.add_argument("--docs", type=Path, default=ROOT / "docs" / "benchmarks_scaling.md")
    parser.add_argument("--worker-out", type=Path, default=None, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker_out is not None:
        worker(args.worker_out)
        return
    results: dict[str, dict] = {}
    for world in args.worlds:
        with tempfile.TemporaryDirectory() as tmp:
            cell = Path(tmp) / "cell.json"
            cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={world}",
                   str(Path(__file__).resolve()), "--worker-out", str(cell)]
            subprocess.run(cmd, check=True, env={**os.environ, "PYTHONPATH": str(ROOT)})
            results[str(world)] = json.loads(cell.read_text())
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(results, indent=1))
    print(render(results, args.docs, "python benchmarks/scaling.py"))


if __name__ == "__main__":
    main()

"""PPO's frozen reference and reward models stored dense, as int8 or as int4: per-rank bytes,
and what it does to ``zeropp pipeline``'s figures.

    python benchmarks/frozen_bits.py --bits 8 --output-dir runs/frozen8
    python benchmarks/frozen_bits.py --bits 4 --output-dir runs/frozen4
    python benchmarks/frozen_bits.py --bits 0 --output-dir runs/frozen0     # dense: the pipeline as shipped

Runs the embedded pipeline recipe (``zeropp pipeline``'s default: SFT -> reward model ->
PPO on the addition task, tiny Llama, 2 CPU processes, fp32) with one change: the PPO
stage's strategy is the ``zeropp`` preset plus ``quantize_frozen_weights=True`` and
``frozen_weight_bits=BITS`` (``--bits 0``: the preset alone). SFT and reward stages are the
same in every run. The pipeline has no flag for ZeroConfig fields (its recipe names the
strategy as a string), hence this driver, which passes a ``ZeroPPStrategy`` instance.

At the end of PPO's fit every rank reads ``engine.memory.memory_stats`` of the reference
and of the reward model (storage bytes held, at rest: codes + scales for quantized
weights, the fp32 shard otherwise) and of the whole module; rank 0 adds the pipeline's
``summary.json`` and writes ``frozen_bits.json`` into the output folder.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any

from lightning.pytorch import Callback, LightningModule, Trainer


class FrozenBytes(Callback):
    """Per-rank bytes of the PPO module's frozen networks, read when fit ends."""

    def __init__(self) -> None:
        self.ranks: list[dict[str, Any]] = []

    def on_fit_end(self, trainer: Trainer, pl_module: LightningModule) -> None:
        from zeropp_strategy.engine.frozen import int8_weights
        from zeropp_strategy.engine.memory import memory_stats

        row: dict[str, Any] = {}
        for name in ("reference", "reward_model", "actor", "critic"):
            net = getattr(pl_module, name)
            stats = memory_stats(net, [], stage=3, rank=trainer.global_rank, world_size=trainer.world_size)
            quantized = int8_weights(net.parameters())
            row[name] = {"param_bytes": stats.param_bytes, "predicted_param_bytes": stats.predicted_param_bytes,
                         "num_params": stats.num_params, "quantized_weights": len(quantized),
                         "quantized_elems_local": sum(q.numel() for q in quantized)}
        whole = trainer.strategy.memory_stats()
        row["module"] = {"param_bytes": whole.param_bytes, "grad_bytes": whole.grad_bytes,
                         "optimizer_bytes": whole.optimizer_bytes, "peak_rss_bytes": whole.peak_rss_bytes}
        self.ranks = _all_gather_object(row)


def _all_gather_object(obj: Any) -> list[Any]:
    import torch.distributed as dist

    if not (dist.is_available() and dist.is_initialized()):
        return [obj]
    out: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(out, obj)
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--bits", type=int, choices=(0, 4, 8), required=True,
                        help="frozen_weight_bits of the PPO stage; 0 = frozen weights stay dense")
    parser.add_argument("--output-dir", required=True)
    args = parser.parse_args()

    from zeropp_strategy import PRESETS, ZeroPPStrategy
    from zeropp_strategy.pipeline import load_recipe, run_pipeline

    recipe = load_recipe(None)
    if args.bits:
        strategy: Any = ZeroPPStrategy(**PRESETS["zeropp"], quantize_frozen_weights=True,
                                       frozen_weight_bits=args.bits)
    else:
        strategy = "zeropp"
    probe = FrozenBytes()
    ppo = recipe.setdefault("ppo", {}).setdefault("trainer", {})
    ppo.update(strategy=strategy, callbacks=[probe])
    summary = run_pipeline(recipe, args.output_dir)
    if not probe.ranks:
        raise RuntimeError("frozen_bits: PPO's fit ended without the byte probe running. Fix: check the PPO stage.")
    if summary.get("world_size") and len(probe.ranks) != summary["world_size"]:
        raise RuntimeError(f"frozen_bits: {len(probe.ranks)} ranks reported bytes, expected {summary['world_size']}")
    import torch.distributed as dist

    if not dist.is_initialized() or dist.get_rank() == 0:
        out = {"bits": args.bits, "per_rank": probe.ranks, "summary": summary}
        path = Path(args.output_dir) / "frozen_bits.json"
        path.write_text(json.dumps(out, indent=2) + "\n")
        print(json.dumps({"bits": args.bits, "rank0": probe.ranks[0], "summary": summary}, indent=2))


if __name__ == "__main__":
    main()

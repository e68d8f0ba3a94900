"""Layer: recipes (rlhf). Writing trained RLHF models as Hugging Face folders, from inside a (sharded) run.

Every function here is **collective**: each rank calls it. Both go through
``checkpoint.export.export_pretrained`` ([Note: streamed export]): the weights are gathered
one tensor at a time in the order rank 0 writes them, LoRA adapters merged as peft merges
them, and rank 0 never holds more than one safetensors shard; ``checkpoint.hf.write_hf``
checks the names against the architecture, stages, reads back and publishes (an existing
folder of the same name is replaced only then). A failure on rank 0 raises on every rank.

- a causal LM (the SFT, DPO and PPO policies): it loads with
  ``AutoModelForCausalLM.from_pretrained``;
- a ``ScalarHeadModel`` (reward model, critic): the backbone's folder plus
  ``value_head.safetensors`` and ``reward_stats.json`` (the reward mean and std PPO
  normalises with); it loads with ``ScalarHeadModel(folder)``.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
from torch import nn

from zeropp_strategy.checkpoint.export import export_pretrained
from zeropp_strategy.engine.state import to_full_cpu
from zeropp_strategy.rlhf.models import HEAD_FILE, STATS_FILE

__all__ = ["HEAD_FILE", "STATS_FILE", "export_causal_lm", "export_scalar_model"]


def export_causal_lm(model: nn.Module, directory: str | Path, *, tokenizer: Any = None) -> None:
    """Collective. ``model`` (sharded or not, LoRA or not) as a ``from_pretrained`` folder."""
    export_pretrained(model, directory, tokenizer=tokenizer)


def export_scalar_model(
    model: nn.Module, directory: str | Path, *, tokenizer: Any = None, stats: dict[str, float] | None = None
) -> None:
    """Collective. A ``ScalarHeadModel``: backbone folder + value head + reward statistics."""
    with torch.no_grad():
        head = to_full_cpu(model.head.weight.detach())  # collective; every rank keeps the small head
    export_pretrained(model.backbone, directory, tokenizer=tokenizer, extra_tensors={HEAD_FILE: {"weight": head}},
                      extra_json={STATS_FILE: stats or {"mean": 0.0, "std": 1.0}})

"""Writing trained RLHF models as Hugging Face folders, from inside a (sharded) run.

Every function here is **collective**: each rank calls it; the parameters are gathered
one tensor at a time (``engine.state.full_model_state``) and only rank 0 holds the whole
model, on the CPU. Rank 0 loads it into a CPU copy of the architecture (LoRA adapters
merged into the base) and hands that to ``checkpoint.hf.write_hf``, the package's one
Hugging Face exporter (``zeropp consolidate --hf`` uses it too): it checks the weights
against the architecture, writes a temporary sibling, reads it back and renames it into
place, replacing an existing folder of the same name only then. A failure on rank 0
raises on every rank (``engine.core.agree``).

- a causal LM (the SFT, DPO and PPO policies): it loads with
  ``AutoModelForCausalLM.from_pretrained``;
- a ``ScalarHeadModel`` (reward model, critic): the backbone's folder plus
  ``value_head.safetensors`` and ``reward_stats.json`` (the reward mean and std PPO
  normalises with); it loads with ``ScalarHeadModel(folder)``.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch.distributed as dist
from torch import nn

from zeropp_strategy.checkpoint.hf import HFModel, write_hf
from zeropp_strategy.engine.core import agree
from zeropp_strategy.engine.state import full_model_state
from zeropp_strategy.rlhf.models import HEAD_FILE, STATS_FILE, merged

__all__ = ["HEAD_FILE", "STATS_FILE", "export_causal_lm", "export_scalar_model"]


def _is_writer() -> bool:
    return not dist.is_initialized() or dist.get_rank() == 0


def _skeleton(model: nn.Module) -> nn.Module:
    """A CPU model of the same architecture (LoRA adapters included) to load the gathered
    state into. Built for real, not on the meta device: buffers that are not in the state
    dict (rotary frequencies) must be computed by the constructor."""
    from transformers import AutoModel, AutoModelForCausalLM

    peft_config = getattr(model, "peft_config", None)
    base = model.get_base_model() if peft_config else model
    factory = AutoModelForCausalLM if base.can_generate() else AutoModel
    skeleton = factory.from_config(base.config)
    if peft_config:
        from peft import get_peft_model

        skeleton = get_peft_model(skeleton, peft_config["default"])
    return skeleton


def _load(skeleton: nn.Module, state: dict[str, Any]) -> nn.Module:
    missing, unexpected = skeleton.load_state_dict(state, strict=False)
    if hasattr(skeleton, "tie_weights"):  # tied weights appear once in the state dict
        skeleton.tie_weights()
    tied = set(getattr(skeleton, "_tied_weights_keys", None) or [])
    missing = [k for k in missing if k not in tied]
    if missing or unexpected:
        raise RuntimeError(f"export: the gathered state does not fit the model: missing {missing[:5]}, "
                           f"unexpected {unexpected[:5]}, so the folder would be partial; nothing was written. "
                           "Fix: export the model the run trained (same architecture and LoRA config).")
    return skeleton


def _hf_model(plain: nn.Module, **extra: Any) -> HFModel:
    """A plain transformers model (adapters merged) as what ``write_hf`` writes."""
    return HFModel(weights=plain.state_dict(), config=plain.config, model_cls=type(plain),
                   source="the gathered state", **extra)


def export_causal_lm(model: nn.Module, directory: str | Path, *, tokenizer: Any = None) -> None:
    """Collective. ``model`` (sharded or not, LoRA or not) as a ``from_pretrained`` folder."""
    writer = _is_writer()
    state = full_model_state(model, keep=writer)
    # Rank 0 writes; a failure there (disk full) stops every rank, not just rank 0.
    agree(f"exporting {directory}", lambda: _write_causal_lm(model, state, directory, tokenizer) if writer else None)


def _write_causal_lm(model: nn.Module, state: dict[str, Any], directory: str | Path, tokenizer: Any) -> None:
    plain = merged(_load(_skeleton(model), state))
    generation = getattr(model, "generation_config", None)  # the run's own, not the class default
    write_hf(directory, _hf_model(plain, tokenizer=tokenizer, generation_config=generation), overwrite=True)


def export_scalar_model(
    model: nn.Module, directory: str | Path, *, tokenizer: Any = None, stats: dict[str, float] | None = None
) -> None:
    """Collective. A ``ScalarHeadModel``: backbone folder + value head + reward statistics."""
    writer = _is_writer()
    state = full_model_state(model, keep=writer)
    agree(f"exporting {directory}",
          lambda: _write_scalar_model(model, state, directory, tokenizer, stats) if writer else None)


def _write_scalar_model(model: nn.Module, state: dict[str, Any], directory: str | Path, tokenizer: Any,
                        stats: dict[str, float] | None) -> None:
    backbone_state = {k[len("backbone."):]: v for k, v in state.items() if k.startswith("backbone.")}
    backbone = merged(_load(_skeleton(model.backbone), backbone_state))
    folder = _hf_model(backbone, tokenizer=tokenizer, extra_tensors={HEAD_FILE: {"weight": state["head.weight"]}},
                       extra_json={STATS_FILE: stats or {"mean": 0.0, "std": 1.0}})
    write_hf(directory, folder, overwrite=True)

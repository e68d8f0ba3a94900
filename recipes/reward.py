"""Layer: recipes. ``RewardModule``: step 2 of the InstructGPT pipeline, a pairwise reward
model (recipe: ``reward.yaml`` beside this file); it exports the folder ``PPOModule`` and
``GRPOModule`` read.

    zeropp fit --config recipes/reward.yaml

Moved here from ``zeropp_strategy.rlhf.modules`` (that path was removed: docs/changes.md).
"""

from __future__ import annotations

from typing import Any

import torch

from zeropp_strategy.toolkit import all_gather_object
from zeropp_strategy.recipes.base import PairDatasetModule
from zeropp_strategy.rlhf import ops
from zeropp_strategy.rlhf.models import ScalarHeadModel, apply_lora, build_causal_lm

__all__ = ["RewardModule"]


class RewardModule(PairDatasetModule):
    """A pairwise reward model: causal-LM backbone, scalar head at the last real token.

    Loss: ``-log sigmoid(r_chosen - r_rejected - margin)``, plus
    ``center_coef * mean((r_chosen + r_rejected)^2)`` when ``center_coef > 0`` (keeps the
    scores near 0). Logs pairwise accuracy and the mean chosen/rejected scores; the mean and
    std of the scores seen in validation are stored in the checkpoint
    (``reward_mean``/``reward_std``) for reward normalisation in PPO.

    The arguments not listed below are those ``SFTModule``, ``RewardModule`` and
    ``DPOModule`` share, documented on ``recipes.base.DatasetModule``. The default that
    differs here: ``val_fraction=0.1`` (``SFTModule``: 0.05).

    Args:
        model: as ``DatasetModule`` (a causal LM folder: its transformer body is used), or the
            SFT stage's output folder.
        margin: the pairwise margin (0 = plain Bradley-Terry).
        center_coef: reward-centering coefficient (0 = off).
        lora: as ``SFTModule``, on the transformer body; the scalar head always trains.
        export_dir: at the end of ``fit``, the backbone folder plus ``value_head.safetensors``
            and ``reward_stats.json`` (what ``PPOModule(reward_model=...)`` reads).
    """

    def __init__(
        self,
        model: str | dict[str, Any] | None = None,
        tokenizer: str | None = None,
        data: str = "embedded:addition",
        margin: float = 0.0,
        center_coef: float = 0.0,
        lora: dict[str, Any] | None = None,
        batch_size: int = 32,
        max_length: int = 64,
        lr: float = 1e-3,
        weight_decay: float = 0.0,
        val_fraction: float = 0.1,
        seed: int = 0,
        export_dir: str | None = None,
        dtype: str | None = None,
    ) -> None:
        super().__init__(**self.shared(locals()))  # DatasetModule sets the shared ones
        self.save_hyperparameters()
        self.margin, self.center_coef = margin, center_coef
        self.lora = lora
        self.model: ScalarHeadModel | None = None
        self.reward_mean, self.reward_std = 0.0, 1.0
        # record index -> (chosen, rejected) scores of this validation: a batch seen twice (a
        # padding batch of an uneven evaluation at stage 3, [Note: uneven evaluation]) counts once
        self._val_scores: dict[int, tuple[float, float]] = {}

    def configure_model(self) -> None:
        if self.model is None:
            spec = self.model_spec
            dtype = self.weights_dtype
            model = ScalarHeadModel(spec if isinstance(spec, dict) else build_causal_lm(spec, dtype=dtype).get_decoder(),
                                    dtype=dtype)
            if self.lora:  # adapters on the body; the head is new and trains in full
                model.backbone = apply_lora(model.backbone, self.lora)
            self.model = model.train()  # from_pretrained's eval mode: see SFTModule.configure_model

    def _scores(self, batch: dict[str, torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
        assert self.model is not None
        scores = self.model.score(batch["input_ids"], batch["attention_mask"])
        half = scores.shape[0] // 2
        return scores[:half], scores[half:]

    def _step(self, batch: dict[str, torch.Tensor], stage: str) -> torch.Tensor:
        chosen, rejected = self._scores(batch)
        loss = ops.pairwise_reward_loss(chosen, rejected, margin=self.margin)
        if self.center_coef > 0:
            loss = loss + self.center_coef * (chosen + rejected).pow(2).mean()
        pairs = len(chosen)
        self.log(f"{stage}_loss", loss, sync_dist=True, prog_bar=stage == "train", batch_size=pairs)
        self.log(f"{stage}_accuracy", (chosen > rejected).float().mean(), sync_dist=True, prog_bar=True,
                 batch_size=pairs)
        self.log(f"{stage}_chosen", chosen.mean(), sync_dist=True, batch_size=pairs)
        self.log(f"{stage}_rejected", rejected.mean(), sync_dist=True, batch_size=pairs)
        if stage == "val":
            pairs_scores = torch.stack([chosen, rejected], dim=1).detach().float().cpu().tolist()
            self._val_scores.update(zip(batch["index"].tolist(), map(tuple, pairs_scores), strict=True))
        return loss

    def on_validation_epoch_end(self) -> None:
        """The score statistics PPO normalizes with, over every validation record once: the
        ranks hold different records (rlhf.data.EvalShard), gathered as objects and told
        apart by record index (a record seen twice, as padding, counts once)."""
        scores: dict[int, tuple[float, float]] = {}
        for part in all_gather_object(self._val_scores):  # rank order, each rank's records by index
            for i in sorted(part):
                scores.setdefault(i, part[i])
        self._val_scores.clear()
        if scores:
            values = torch.tensor([v for pair in scores.values() for v in pair])
            self.reward_mean, self.reward_std = values.mean().item(), values.std().clamp(min=1e-6).item()

    def export_hf(self, directory: str) -> None:
        """Backbone folder + ``value_head.safetensors`` + ``reward_stats.json`` (what
        ``PPOModule(reward_model=directory)`` reads)."""
        from zeropp_strategy.rlhf.export import export_scalar_model

        export_scalar_model(self.model, directory, tokenizer=self.tokenizer,
                            stats={"mean": self.reward_mean, "std": self.reward_std})

    def on_save_checkpoint(self, checkpoint: dict[str, Any]) -> None:
        checkpoint["reward_stats"] = {"mean": self.reward_mean, "std": self.reward_std}

    def on_load_checkpoint(self, checkpoint: dict[str, Any]) -> None:
        stats = checkpoint.get("reward_stats", {})
        self.reward_mean, self.reward_std = stats.get("mean", 0.0), stats.get("std", 1.0)

"""Layer: recipes. ``SFTModule``: step 1 of the InstructGPT pipeline, supervised
fine-tuning of a causal LM on prompt/response records (recipe: ``sft.yaml`` beside this
file).

    zeropp fit --config recipes/sft.yaml

Moved here from ``zeropp_strategy.rlhf.modules`` (that path was removed: docs/changes.md).
"""

from __future__ import annotations

import math
from typing import Any

import torch
from torch.utils.data import DataLoader

from zeropp_strategy.recipes.base import DatasetModule
from zeropp_strategy.rlhf.data import EvalShard, SFTCollator
from zeropp_strategy.rlhf.models import apply_lora, build_causal_lm

__all__ = ["SFTModule"]


class SFTModule(DatasetModule):
    """Supervised fine-tuning of a causal LM on prompt/response records.

    The loss covers the response tokens and the EOS (the prompt is masked by its tokenized
    length; ``train_on_prompt=True`` trains on everything). Validation logs the loss and
    the perplexity ``exp(loss)``.

    The arguments not listed below are those ``SFTModule``, ``RewardModule`` and
    ``DPOModule`` share, documented on ``recipes.base.DatasetModule``. The default that
    differs here: ``val_fraction=0.05`` (``RewardModule`` and ``DPOModule``: 0.1).

    Args:
        train_on_prompt: also train on the prompt tokens.
        packing: pack several examples into each row of up to ``max_length`` tokens (fewer
            rows, no padding to speak of); positions restart at each example. Attention is
            causal over the whole row, so an example can see the ones before it in its row
            (as TRL's ``ConstantLengthDataset``); leave it off when that matters.
        lora: peft ``LoraConfig`` fields (e.g. ``{"r": 8, "target_modules": ["q_proj", "v_proj"]}``):
            only the adapters train; ``None`` trains every weight.
    """

    def __init__(
        self,
        model: str | dict[str, Any] | None = None,
        tokenizer: str | None = None,
        data: str = "embedded:addition",
        train_on_prompt: bool = False,
        packing: bool = False,
        lora: dict[str, Any] | None = None,
        batch_size: int = 32,
        max_length: int = 64,
        lr: float = 1e-3,
        weight_decay: float = 0.0,
        val_fraction: float = 0.05,
        seed: int = 0,
        export_dir: str | None = None,
        dtype: str | None = None,
    ) -> None:
        super().__init__(**self.shared(locals()))  # DatasetModule sets the shared ones
        self.save_hyperparameters()
        self.train_on_prompt = train_on_prompt
        self.packing = packing
        self.lora = lora
        self.model: torch.nn.Module | None = None

    def configure_model(self) -> None:
        if self.model is None:
            # train(): from_pretrained returns a model in eval mode, and Lightning keeps the
            # mode it finds (it would train with dropout off and warn about eval modules).
            self.model = apply_lora(build_causal_lm(self.model_spec, dtype=self.weights_dtype), self.lora).train()

    def _loader(self, records: list[dict[str, str]], shuffle: bool) -> DataLoader:
        collate = SFTCollator(self.tokenizer, max_length=self.max_length, train_on_prompt=self.train_on_prompt,
                              pack=self.packing)
        return DataLoader(records, batch_size=self.batch_size, shuffle=shuffle, collate_fn=collate,
                          sampler=None if shuffle else EvalShard(records),
                          generator=torch.Generator().manual_seed(self.seed))

    def train_dataloader(self) -> DataLoader:
        return self._loader(self._split("sft")[0], shuffle=True)

    def val_dataloader(self) -> DataLoader:
        return self._loader(self._split("sft")[1], shuffle=False)

    def training_step(self, batch: dict[str, torch.Tensor], batch_idx: int) -> torch.Tensor:
        assert self.model is not None
        loss = self.model(**batch).loss
        self.log("train_loss", loss, prog_bar=True, sync_dist=True, batch_size=len(batch["input_ids"]))
        return loss

    def export_hf(self, directory: str) -> None:
        from zeropp_strategy.rlhf.export import export_causal_lm

        export_causal_lm(self.model, directory, tokenizer=self.tokenizer)

    def validation_step(self, batch: dict[str, torch.Tensor], batch_idx: int) -> None:
        assert self.model is not None
        loss = self.model(**batch).loss
        rows = len(batch["input_ids"])
        self.log("val_loss", loss, sync_dist=True, batch_size=rows)
        self.log("val_ppl", math.exp(min(loss.item(), 50.0)), sync_dist=True, batch_size=rows)

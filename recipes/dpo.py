"""Layer: recipes. ``DPOModule``: direct preference optimisation, without a reward model
(recipe: ``dpo.yaml`` beside this file).

    zeropp fit --config recipes/dpo.yaml --model.model PATH

Moved here from ``zeropp_strategy.rlhf.modules`` (that path was removed: docs/changes.md).
"""

from __future__ import annotations

import contextlib
from typing import Any

import torch

from zeropp_strategy.recipes.base import PairDatasetModule
from zeropp_strategy.rlhf import ops
from zeropp_strategy.rlhf.models import apply_lora, build_causal_lm, disable_dropout

__all__ = ["DPOModule", "sequence_logprobs"]


def sequence_logprobs(model: torch.nn.Module, batch: dict[str, torch.Tensor], *, temperature: float = 1.0) -> torch.Tensor:
    """Sum over each row's response tokens (``response_mask``) of log p(token | prefix)."""
    logits = model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).logits
    logp = ops.token_logprobs(logits[:, :-1], batch["input_ids"][:, 1:], temperature=temperature)
    return (logp * batch["response_mask"][:, 1:].to(logp.dtype)).sum(-1)


class DPOModule(PairDatasetModule):
    """Direct preference optimisation (sigmoid loss) of a causal LM against a frozen
    reference, on prompt/chosen/rejected records.

    The reference is a second copy of the starting policy, frozen, with its dropout off
    (``disable_dropout``). It is built from the same ``model`` folder, or, for a config dict, copied from the
    policy before training (so both start equal; under meta-device init the two are
    initialized separately, so start DPO from a trained folder, as one does).

    Logs loss, preference accuracy (implicit reward of chosen > rejected) and the margin.

    The arguments not listed below are those ``SFTModule``, ``RewardModule`` and
    ``DPOModule`` share, documented on ``recipes.base.DatasetModule``. The defaults that
    differ here: ``batch_size=16`` and ``lr=5e-4`` (``SFTModule`` and ``RewardModule``: 32
    and 1e-3), ``val_fraction=0.1`` (``SFTModule``: 0.05).

    Args:
        model: the SFT stage's output folder (or any ``from_pretrained`` name / config dict).
        beta: the DPO temperature (0.1 is the paper's default).
        lora: as ``SFTModule`` (adapters on the policy; the reference has none).
        precompute_reference: compute the reference's log-probs of every training and
            validation pair once, in ``configure_model`` (before sharding, on every rank),
            then drop the reference model: one model's memory less during training.
    """

    def __init__(
        self,
        model: str | dict[str, Any] | None = None,
        tokenizer: str | None = None,
        data: str = "embedded:addition",
        beta: float = 0.1,
        lora: dict[str, Any] | None = None,
        precompute_reference: bool = False,
        batch_size: int = 16,
        max_length: int = 64,
        lr: float = 5e-4,
        weight_decay: float = 0.0,
        val_fraction: float = 0.1,
        seed: int = 0,
        export_dir: str | None = None,
        dtype: str | None = None,
    ) -> None:
        super().__init__(**self.shared(locals()))  # DatasetModule sets the shared ones
        self.save_hyperparameters()
        if beta <= 0:
            raise ValueError(f"DPOModule(beta={beta}) is invalid: it must be > 0. Fix: e.g. beta=0.1.")
        self.beta = beta
        self.lora = lora
        self.precompute_reference = precompute_reference
        self.policy: torch.nn.Module | None = None
        self.reference: torch.nn.Module | None = None
        #: with precompute_reference: split -> [records, 2] summed log-probs (chosen, rejected)
        self.reference_logps: dict[str, torch.Tensor] = {}

    def configure_model(self) -> None:
        if self.policy is not None:
            return
        import copy

        self.policy = build_causal_lm(self.model_spec, dtype=self.weights_dtype).train()  # see SFTModule.configure_model
        if isinstance(self.model_spec, dict):
            self.reference = copy.deepcopy(self.policy)
        else:  # precomputed here, in configure_model: it must exist for real (every rank holds it)
            with torch.device("cpu") if self.precompute_reference else contextlib.nullcontext():
                self.reference = build_causal_lm(self.model_spec, dtype=self.weights_dtype)
        disable_dropout(self.reference.requires_grad_(False)).train()  # from_pretrained gives eval mode; Lightning warns
        self.policy = apply_lora(self.policy, self.lora)
        if self.precompute_reference:
            self.reference_logps = {"train": self._reference_logps(self._split("preferences")[0]),
                                    "val": self._reference_logps(self._split("preferences")[1])}
            self.reference = None  # never sharded, never run again: its memory is freed

    @torch.no_grad()
    def _reference_logps(self, records: list[dict[str, str]]) -> torch.Tensor:
        """The reference's summed log-probs of every record's chosen and rejected response.
        Runs here, in configure_model, where the reference is still a whole model on every
        rank (before the strategy shards anything): no collective, the same on every rank."""
        assert self.reference is not None
        out = torch.zeros(len(records), 2)
        for batch in self._loader(records, shuffle=False):
            logps = sequence_logprobs(self.reference, batch)
            half = logps.shape[0] // 2
            out[batch["index"]] = torch.stack([logps[:half], logps[half:]], dim=1).float()
        return out

    def export_hf(self, directory: str) -> None:
        from zeropp_strategy.rlhf.export import export_causal_lm

        export_causal_lm(self.policy, directory, tokenizer=self.tokenizer)

    def _step(self, batch: dict[str, torch.Tensor], stage: str) -> torch.Tensor:
        loss, chosen, rejected = self._pair_losses(batch, stage)
        pairs = chosen.shape[0]
        self.log(f"{stage}_loss", loss, sync_dist=True, prog_bar=stage == "train", batch_size=pairs)
        self.log(f"{stage}_accuracy", (chosen > rejected).float().mean(), sync_dist=True, prog_bar=True,
                 batch_size=pairs)
        self.log(f"{stage}_margin", (chosen - rejected).mean(), sync_dist=True, batch_size=pairs)
        return loss

    def _pair_losses(self, batch: dict[str, torch.Tensor],
                     stage: str) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """The DPO loss of ``batch`` (chosen rows, then rejected) and each pair's implicit
        rewards of the chosen and the rejected response; logs nothing, so it runs outside a
        Trainer too. ``stage`` picks the precomputed reference's split."""
        assert self.policy is not None and (self.reference is not None or self.reference_logps)
        policy = sequence_logprobs(self.policy, batch)
        if self.reference_logps:
            cached = self.reference_logps["train" if stage == "train" else "val"][batch["index"].cpu()]
            reference = cached.t().reshape(-1).to(policy.device, policy.dtype)  # chosen rows, then rejected
        else:
            with torch.no_grad():
                reference = sequence_logprobs(self.reference, batch)
        half = policy.shape[0] // 2
        return ops.dpo_loss(policy[:half], policy[half:], reference[:half], reference[half:], beta=self.beta)

"""LightningModules of the InstructGPT pipeline: ``SFTModule``, ``RewardModule``, and
``DPOModule`` (preference optimisation without a reward model).

Each builds its networks in ``configure_model`` (meta-device friendly under ``zeropp``),
runs under any Lightning strategy, and reads its data through ``rlhf.data``. Every
hyper-parameter is an ``__init__`` argument, so LightningCLI recipes can set and override
all of them.
"""

from __future__ import annotations

import math
from typing import Any

import torch
from lightning.pytorch import LightningModule
from torch.utils.data import DataLoader

from zeropp_strategy.rlhf import ops
from zeropp_strategy.rlhf.data import PairCollator, SFTCollator, load_records
from zeropp_strategy.rlhf.models import ScalarHeadModel, apply_lora, build_causal_lm, build_tokenizer, tiny_llama_config

__all__ = ["DPOModule", "RewardModule", "SFTModule", "sequence_logprobs"]


class _Base(LightningModule):
    def __init__(
        self,
        *,
        model: str | dict[str, Any] | None,
        tokenizer: str | None,
        data: str,
        batch_size: int,
        max_length: int,
        lr: float,
        weight_decay: float,
        val_fraction: float,
        seed: int,
        export_dir: str | None = None,
    ) -> None:
        super().__init__()
        self.export_dir = export_dir
        self.model_spec = model if model is not None else tiny_llama_config()
        self.tokenizer = build_tokenizer(tokenizer)
        self.data, self.batch_size, self.max_length = data, batch_size, max_length
        self.lr, self.weight_decay, self.val_fraction, self.seed = lr, weight_decay, val_fraction, seed
        if not 0.0 <= val_fraction < 1.0:
            raise ValueError(f"val_fraction={val_fraction} is invalid: it must be in [0, 1). Fix: e.g. 0.1.")
        self._train: list[dict[str, str]] | None = None
        self._val: list[dict[str, str]] | None = None

    def _split(self, kind: str) -> tuple[list[dict[str, str]], list[dict[str, str]]]:
        if self._train is None:
            records = load_records(self.data, kind=kind)
            g = torch.Generator().manual_seed(self.seed)
            order = torch.randperm(len(records), generator=g).tolist()
            n_val = int(len(records) * self.val_fraction)
            self._val = [records[i] for i in order[:n_val]]
            self._train = [records[i] for i in order[n_val:]]
        assert self._val is not None
        return self._train, self._val

    def configure_optimizers(self) -> Any:
        params = [p for p in self.parameters() if p.requires_grad]
        return torch.optim.AdamW(params, lr=self.lr, weight_decay=self.weight_decay)

    def on_fit_end(self) -> None:
        if self.export_dir:
            self.export_hf(self.export_dir)

    def export_hf(self, directory: str) -> None:
        """Collective (every rank calls it): the trained model as a Hugging Face folder."""
        raise NotImplementedError


class _PairModule(_Base):
    """Modules trained on preference pairs: chosen rows then rejected rows in one batch.
    Their ``self.log`` calls count pairs (``batch_size=``): Lightning would guess from the
    batch's tensors, which hold two rows per pair and one index per pair."""

    def _loader(self, records: list[dict[str, str]], shuffle: bool) -> DataLoader:
        indexed = [{**r, "__index__": i} for i, r in enumerate(records)]  # for per-record caches
        return DataLoader(indexed, batch_size=self.batch_size, shuffle=shuffle,
                          collate_fn=PairCollator(self.tokenizer, max_length=self.max_length),
                          generator=torch.Generator().manual_seed(self.seed))

    def train_dataloader(self) -> DataLoader:
        return self._loader(self._split("preferences")[0], shuffle=True)

    def val_dataloader(self) -> DataLoader:
        return self._loader(self._split("preferences")[1], shuffle=False)

    def _step(self, batch: dict[str, torch.Tensor], stage: str) -> torch.Tensor:
        raise NotImplementedError

    def training_step(self, batch: dict[str, torch.Tensor], batch_idx: int) -> torch.Tensor:
        return self._step(batch, "train")

    def validation_step(self, batch: dict[str, torch.Tensor], batch_idx: int) -> None:
        self._step(batch, "val")


class SFTModule(_Base):
    """Supervised fine-tuning of a causal LM on prompt/response records.

    The loss covers the response tokens and the EOS (the prompt is masked by its tokenized
    length; ``train_on_prompt=True`` trains on everything). Validation logs the loss and
    the perplexity ``exp(loss)``.

    Args:
        model: a ``from_pretrained`` folder or hub name, or a transformers config dict
            (trained from scratch). Default: the embedded tiny Llama.
        tokenizer: a folder/hub name, or ``None``/``"byt5"`` (byte-level, no files).
        data: a ``.jsonl`` file, a ``datasets`` name, or ``"embedded:addition"``.
        train_on_prompt: also train on the prompt tokens.
        packing: pack several examples into each row of up to ``max_length`` tokens (fewer
            rows, no padding to speak of); positions restart at each example. Attention is
            causal over the whole row, so an example can see the ones before it in its row
            (as TRL's ``ConstantLengthDataset``); leave it off when that matters.
        lora: peft ``LoraConfig`` fields (e.g. ``{"r": 8, "target_modules": ["q_proj", "v_proj"]}``):
            only the adapters train; ``None`` trains every weight.
        batch_size, max_length, lr, weight_decay: as usual.
        val_fraction: part of the records held out for validation.
        seed: the train/validation split.
        export_dir: at the end of ``fit`` the model is written there as a Hugging Face
            folder (``from_pretrained``-loadable, LoRA merged), with the tokenizer.
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
    ) -> None:
        super().__init__(model=model, tokenizer=tokenizer, data=data, batch_size=batch_size, max_length=max_length,
                         lr=lr, weight_decay=weight_decay, val_fraction=val_fraction, seed=seed,
                         export_dir=export_dir)
        self.save_hyperparameters()
        self.train_on_prompt = train_on_prompt
        self.packing = packing
        self.lora = lora
        self.model: torch.nn.Module | None = None

    def configure_model(self) -> None:
        if self.model is None:
            # train(): from_pretrained returns a model in eval mode, and Lightning keeps the
            # mode it finds (it would train with dropout off and warn about eval modules).
            self.model = apply_lora(build_causal_lm(self.model_spec), self.lora).train()

    def _loader(self, records: list[dict[str, str]], shuffle: bool) -> DataLoader:
        collate = SFTCollator(self.tokenizer, max_length=self.max_length, train_on_prompt=self.train_on_prompt,
                              pack=self.packing)
        return DataLoader(records, batch_size=self.batch_size, shuffle=shuffle, collate_fn=collate,
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


class RewardModule(_PairModule):
    """A pairwise reward model: causal-LM backbone, scalar head at the last real token.

    Loss: ``-log sigmoid(r_chosen - r_rejected - margin)``, plus
    ``center_coef * mean((r_chosen + r_rejected)^2)`` when ``center_coef > 0`` (keeps the
    scores near 0). Logs pairwise accuracy and the mean chosen/rejected scores; the mean and
    std of the scores seen in validation are stored in the checkpoint
    (``reward_mean``/``reward_std``) for reward normalisation in PPO.

    Args:
        model: as ``SFTModule`` (a causal LM folder: its transformer body is used), or the
            SFT stage's output folder.
        margin: the pairwise margin (0 = plain Bradley-Terry).
        center_coef: reward-centering coefficient (0 = off).
        lora: as ``SFTModule``, on the transformer body; the scalar head always trains.
        (others as ``SFTModule``)
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
    ) -> None:
        super().__init__(model=model, tokenizer=tokenizer, data=data, batch_size=batch_size, max_length=max_length,
                         lr=lr, weight_decay=weight_decay, val_fraction=val_fraction, seed=seed,
                         export_dir=export_dir)
        self.save_hyperparameters()
        self.margin, self.center_coef = margin, center_coef
        self.lora = lora
        self.model: ScalarHeadModel | None = None
        self.reward_mean, self.reward_std = 0.0, 1.0
        self._val_scores: list[torch.Tensor] = []

    def configure_model(self) -> None:
        if self.model is None:
            spec = self.model_spec
            model = ScalarHeadModel(spec if isinstance(spec, dict) else build_causal_lm(spec).get_decoder())
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
            self._val_scores.append(torch.cat([chosen, rejected]).detach().float())
        return loss


    def on_validation_epoch_end(self) -> None:
        if self._val_scores:
            scores = self.all_gather(torch.cat(self._val_scores)).flatten()
            self.reward_mean, self.reward_std = scores.mean().item(), scores.std().clamp(min=1e-6).item()
            self._val_scores.clear()

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


def sequence_logprobs(model: torch.nn.Module, batch: dict[str, torch.Tensor], *, temperature: float = 1.0) -> torch.Tensor:
    """Sum over each row's response tokens (``response_mask``) of log p(token | prefix)."""
    logits = model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).logits
    logp = ops.token_logprobs(logits[:, :-1], batch["input_ids"][:, 1:], temperature=temperature)
    return (logp * batch["response_mask"][:, 1:].to(logp.dtype)).sum(-1)


class DPOModule(_PairModule):
    """Direct preference optimisation (sigmoid loss) of a causal LM against a frozen
    reference, on prompt/chosen/rejected records.

    The reference is a second copy of the starting policy, frozen and in eval mode (dropout
    off). It is built from the same ``model`` folder, or, for a config dict, copied from the
    policy before training (so both start equal; under meta-device init the two are
    initialized separately, so start DPO from a trained folder, as one does).

    Args:
        model: the SFT stage's output folder (or any ``from_pretrained`` name / config dict).
        beta: the DPO temperature (0.1 is the paper's default).
        lora: as ``SFTModule`` (adapters on the policy; the reference has none).
        precompute_reference: compute the reference's log-probs of every training and
            validation pair once, in ``configure_model`` (before sharding, on every rank),
            then drop the reference model: one model's memory less during training.
        (others as ``SFTModule``)
    Logs loss, preference accuracy (implicit reward of chosen > rejected) and the margin.
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
    ) -> None:
        super().__init__(model=model, tokenizer=tokenizer, data=data, batch_size=batch_size, max_length=max_length,
                         lr=lr, weight_decay=weight_decay, val_fraction=val_fraction, seed=seed,
                         export_dir=export_dir)
        if beta <= 0:
            raise ValueError(f"DPOModule(beta={beta}) is invalid: it must be > 0. Fix: e.g. beta=0.1.")
        self.save_hyperparameters()
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

        self.policy = build_causal_lm(self.model_spec).train()  # see SFTModule.configure_model
        if isinstance(self.model_spec, dict):
            self.reference = copy.deepcopy(self.policy)
        else:
            self.reference = build_causal_lm(self.model_spec)
        self.reference.requires_grad_(False).eval()
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

    def train(self, mode: bool = True) -> DPOModule:
        super().train(mode)
        if self.reference is not None:
            self.reference.eval()  # Lightning's train() must not switch its dropout back on
        return self

    def export_hf(self, directory: str) -> None:
        from zeropp_strategy.rlhf.export import export_causal_lm

        export_causal_lm(self.policy, directory, tokenizer=self.tokenizer)

    def _step(self, batch: dict[str, torch.Tensor], stage: str) -> torch.Tensor:
        assert self.policy is not None and (self.reference is not None or self.reference_logps)
        policy = sequence_logprobs(self.policy, batch)
        if self.reference_logps:
            cached = self.reference_logps["train" if stage == "train" else "val"][batch["index"].cpu()]
            reference = cached.t().reshape(-1).to(policy.device, policy.dtype)  # chosen rows, then rejected
        else:
            with torch.no_grad():
                reference = sequence_logprobs(self.reference, batch)
        half = policy.shape[0] // 2
        loss, chosen, rejected = ops.dpo_loss(policy[:half], policy[half:], reference[:half], reference[half:],
                                              beta=self.beta)
        pairs = half
        self.log(f"{stage}_loss", loss, sync_dist=True, prog_bar=stage == "train", batch_size=pairs)
        self.log(f"{stage}_accuracy", (chosen > rejected).float().mean(), sync_dist=True, prog_bar=True,
                 batch_size=pairs)
        self.log(f"{stage}_margin", (chosen - rejected).mean(), sync_dist=True, batch_size=pairs)
        return loss


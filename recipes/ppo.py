"""Layer: recipes. ``PPOModule``: step 3 of the InstructGPT pipeline, RLHF with PPO (recipe:
``ppo.yaml`` beside this file). Moved here from ``zeropp_strategy.rlhf.ppo`` (that path was removed: docs/changes.md).

Four networks, all built in ``configure_model`` and sharded together by the strategy:

- **actor** (trained): the policy, from the SFT output folder;
- **critic** (trained): a ``ScalarHeadModel`` initialised from the reward model;
- **reference** (frozen): a second copy of the SFT actor, for the KL penalty;
- **reward model** (frozen): the step-2 output (backbone, head and score statistics).

One training step = one rollout and its PPO updates (manual optimization):

1. *Experience* (no grad): sample responses to a batch of left-padded prompts
   (``generation.sample``, the actor's blocks gathered once per call under ZeRO-3); the
   response mask ends at the first EOS; recompute the actor's and the reference's
   log-probs of the sampled tokens with the sampling temperature and top-k, the critic's
   values, and the reward model's score at the last real token (the EOS). The score is
   normalised with the reward model's statistics, optionally penalised when the EOS is
   missing, clipped, and added at the last response token to ``-kl_coef * KL`` per token
   (``k1`` or ``k3`` estimator). GAE gives advantages (whitened) and returns.
2. *Updates*: ``ppo_epochs`` passes over the rollout in shuffled mini-batches; each one
   backpropagates ``policy_loss + vf_coef * value_loss (+ ptx_coef * ptx_loss)`` once and
   steps both optimizers (actor and critic have their own learning rates).
3. Optional EMA of the actor, updated on each rank's own shard under ZeRO-3.

What it shares with ``GRPOModule`` (set-up, ``forward`` by kind, prompt loaders, sampling,
the update loop, validation, export) is ``RolloutModule``'s, in ``rollout.py``; its header
says why every network has its dropout off and every forward goes through ``self(kind, ...)``.
"""

from __future__ import annotations

import copy
from typing import Any

import torch
from torch import Tensor, nn
from torch.utils.data import DataLoader

from zeropp_strategy.recipes.rollout import RolloutModule
from zeropp_strategy.toolkit import copy_on_materialize
from zeropp_strategy.rlhf import ops
from zeropp_strategy.rlhf.data import SFTCollator, load_records
from zeropp_strategy.rlhf.generation import decode_responses
from zeropp_strategy.rlhf.models import ScalarHeadModel, apply_lora, build_causal_lm, tiny_llama_config
from zeropp_strategy.toolkit import local as _local

__all__ = ["PPOModule"]

# what one PPO update reads of the rollout
_UPDATE_KEYS = ["prompt_ids", "response", "mask", "sequences", "attention", "old_logp", "old_values", "advantages",
                "returns"]


class PPOModule(RolloutModule):
    """PPO on prompts, with actor, critic, reference and reward model.

    Args:
        actor: the SFT output folder (``from_pretrained``), a hub name, or a transformers
            config dict (trained from scratch: tests only). Default: the embedded tiny Llama.
        reward_model: a folder written by ``RewardModule`` (``export_dir``), or a config
            dict (a fresh head: tests only). Default: the embedded tiny Llama config.
        critic: where the critic starts; ``None``: a copy of the reward model (as InstructGPT).
        reference: the frozen KL anchor; ``None``: a copy of the starting actor.
        tokenizer: as ``SFTModule``.
        data: prompts to train on (``prompt`` field of a ``.jsonl``/dataset, or
            ``embedded:addition``, whose SFT prompts are used).
        eval_data: prompts for validation (reward and, for the embedded task, accuracy); ``None``: no
            validation.
        ptx_data: SFT records for the pretraining-loss mixture (``ptx_coef > 0``).
        rollout_batch_size: prompts per rank per step.
        mini_batch_size: sequences per rank per PPO update.
        ppo_epochs: passes over each rollout.
        max_prompt_length, max_new_tokens: prompt tokens kept (from the right), response cap.
        temperature, top_k: sampling. Log-probs (the ratio, the KL penalty) are recomputed at
            ``temperature`` over the whole vocabulary: ``top_k`` shapes the sampling only.
            ``top_k=0`` samples from the full distribution (recommended for PPO).
        kl_coef: weight of the per-token KL penalty in the reward.
        kl_estimator: ``"k1"`` (log-ratio, InstructGPT) or ``"k3"`` (never negative).
        reward_clip: the score is clipped to ``[-reward_clip, reward_clip]`` (``None``: no clip).
        normalize_reward: score = (raw - mean) / std with the reward model's statistics.
        missing_eos_penalty: subtracted from the score of a response without EOS (``None``: off).
        gamma, lam: GAE discount and lambda.
        whiten_advantages: advantages to zero mean, unit variance per rollout (per rank).
        clip_eps: the policy ratio clip.
        value_clip: the value clip around the old values (``None``: plain squared error).
        vf_coef: weight of the value loss.
        ptx_coef: weight of the SFT loss on ``ptx_data`` mixed into each update.
        ema_decay: keep an EMA of the actor's weights (e.g. 0.992); ``None``: off.
        actor_lr, critic_lr, weight_decay: AdamW settings of the two optimizers.
        max_grad_norm: gradient clipping of each optimizer (``None``: off).
        lora: peft ``LoraConfig`` fields for the actor (the reference has no adapters).
        gather_for_generation: under ZeRO-3, gather the actor's blocks once per rollout
            (``True``) instead of once per generated token.
        export_dir: at the end of ``fit``, the actor is written there as a Hugging Face
            folder (and the EMA actor to ``<export_dir>-ema`` when ``ema_decay`` is set).
        seed: prompt order, mini-batch order and the sampling generator.
        dtype: the weights' dtype of every network built from a folder or config
            (``bf16``, ``fp16``, ``fp32``; ``None``: the folder's own). See ``SFTModule``.
    """

    def __init__(
        self,
        actor: str | dict[str, Any] | None = None,
        reward_model: str | dict[str, Any] | None = None,
        critic: str | dict[str, Any] | None = None,
        reference: str | dict[str, Any] | None = None,
        tokenizer: str | None = None,
        data: str = "embedded:addition",
        eval_data: str | None = "embedded:addition",
        ptx_data: str | None = None,
        rollout_batch_size: int = 32,
        mini_batch_size: int = 16,
        ppo_epochs: int = 1,
        max_prompt_length: int = 32,
        max_new_tokens: int = 8,
        temperature: float = 1.0,
        top_k: int = 0,
        kl_coef: float = 0.05,
        kl_estimator: str = "k1",
        reward_clip: float | None = 5.0,
        normalize_reward: bool = True,
        missing_eos_penalty: float | None = None,
        gamma: float = 1.0,
        lam: float = 0.95,
        whiten_advantages: bool = True,
        clip_eps: float = 0.2,
        value_clip: float | None = 0.2,
        vf_coef: float = 1.0,
        ptx_coef: float = 0.0,
        ema_decay: float | None = None,
        actor_lr: float = 1e-5,
        critic_lr: float = 1e-5,
        weight_decay: float = 0.0,
        max_grad_norm: float | None = 1.0,
        lora: dict[str, Any] | None = None,
        gather_for_generation: bool = True,
        export_dir: str | None = None,
        seed: int = 0,
        dtype: str | None = None,
    ) -> None:
        super().__init__()
        self._check(rollout_batch_size >= 1, "rollout_batch_size", rollout_batch_size, "use a positive number, e.g. 32")
        self._check(1 <= mini_batch_size <= rollout_batch_size, "mini_batch_size", mini_batch_size,
                    f"use 1..rollout_batch_size ({rollout_batch_size})")
        self._check(ppo_epochs >= 1, "ppo_epochs", ppo_epochs, "use 1 or more")
        self._check(max_new_tokens >= 1, "max_new_tokens", max_new_tokens, "use 1 or more")
        self._check(temperature > 0, "temperature", temperature, "use a value > 0, e.g. 1.0")
        self._check(top_k >= 0, "top_k", top_k, "use 0 (off) or a positive count")
        self._check(kl_estimator in ("k1", "k2", "k3"), "kl_estimator", kl_estimator, "use 'k1', 'k2' or 'k3'")
        self._check(kl_coef >= 0, "kl_coef", kl_coef, "use a value >= 0, e.g. 0.05")
        self._check(reward_clip is None or reward_clip > 0, "reward_clip", reward_clip, "use None or a value > 0")
        self._check(0 <= gamma <= 1, "gamma", gamma, "use a value in [0, 1]")
        self._check(0 <= lam <= 1, "lam", lam, "use a value in [0, 1]")
        self._check(clip_eps > 0, "clip_eps", clip_eps, "use a value > 0, e.g. 0.2")
        self._check(value_clip is None or value_clip > 0, "value_clip", value_clip, "use None or a value > 0")
        self._check(ptx_coef >= 0, "ptx_coef", ptx_coef, "use a value >= 0")
        self._check(ptx_coef == 0 or ptx_data is not None, "ptx_data", ptx_data,
                    "name the SFT records to mix in (e.g. embedded:addition) when ptx_coef > 0")
        self._check(ema_decay is None or 0 < ema_decay < 1, "ema_decay", ema_decay, "use None or a value in (0, 1)")
        self._check(max_grad_norm is None or max_grad_norm > 0, "max_grad_norm", max_grad_norm,
                    "use None or a value > 0")
        self.save_hyperparameters()
        self._set_up(actor=actor, reference=reference, tokenizer=tokenizer, eval_data=eval_data, dtype=dtype)
        self.reward_spec = reward_model if reward_model is not None else tiny_llama_config()
        self.critic_spec = critic
        self.critic: ScalarHeadModel | None = None
        self.ema_actor: nn.Module | None = None
        self._ptx: Any = None  # endless iterator over ptx_data batches, made on first use

    # -- networks ---------------------------------------------------------------------------

    def _build_networks(self) -> None:
        hp = self.hparams
        dtype = self.weights_dtype
        actor = build_causal_lm(self.actor_spec, dtype=dtype)
        if self.reference_spec is not None:
            reference = build_causal_lm(self.reference_spec, dtype=dtype)
        elif isinstance(self.actor_spec, dict):
            reference = copy.deepcopy(actor)
        else:
            reference = build_causal_lm(self.actor_spec, dtype=dtype)
        reward = ScalarHeadModel(self.reward_spec, dtype=dtype)
        if self.critic_spec is not None:
            critic = ScalarHeadModel(self.critic_spec, dtype=dtype)
        elif isinstance(self.reward_spec, dict):
            critic = copy.deepcopy(reward)
        else:
            critic = ScalarHeadModel(self.reward_spec, dtype=dtype)
        for frozen in (reference, reward):
            frozen.requires_grad_(False)
        self.actor = apply_lora(actor, hp.lora)
        self.critic, self.reference, self.reward_model = critic, reference, reward
        if hp.ema_decay is not None:
            ema = copy_on_materialize(self.actor).requires_grad_(False)  # starts as the actor, on meta too
            ema.zeropp_keep_dense = True  # updated in place: never stored as frozen int8
            self.ema_actor = ema

    def _networks(self) -> tuple[nn.Module | None, ...]:
        return self.actor, self.critic, self.reference, self.reward_model, self.ema_actor

    def _forward_other(self, kind: str, input_ids: Tensor, attention_mask: Tensor, pos: Tensor, **kwargs: Any) -> Any:
        """PPO's own kinds: ``values`` (critic), ``ptx`` (the actor's SFT loss)."""
        assert self.critic is not None
        if kind == "ptx":
            return self.actor(input_ids=input_ids, attention_mask=attention_mask, labels=kwargs["labels"]).loss
        if kind == "values":
            return self.critic(input_ids, attention_mask, pos)
        raise ValueError(f"PPOModule.forward(kind={kind!r}) is unknown.")

    # -- data -------------------------------------------------------------------------------

    def _ptx_batches(self) -> Any:
        records = load_records(self.hparams.ptx_data, kind="sft")
        collate = SFTCollator(self.tokenizer, max_length=self.hparams.max_prompt_length + self.hparams.max_new_tokens)
        generator = torch.Generator().manual_seed(self.hparams.seed + 1)
        while True:
            yield from DataLoader(records, batch_size=self.hparams.mini_batch_size, shuffle=True, drop_last=True,
                                  collate_fn=collate, generator=generator)

    # -- experience -------------------------------------------------------------------------

    @torch.no_grad()
    def rollout(self, batch: dict[str, Any], generator: torch.Generator) -> dict[str, Tensor]:
        """Sample responses and score them: sequences, masks, raw and shaped rewards."""
        prompt_ids, prompt_mask = batch["input_ids"], batch["attention_mask"]
        response, mask = self._sample(prompt_ids, prompt_mask, generator)
        sequences = torch.cat([prompt_ids, response], dim=1)
        attention = torch.cat([prompt_mask.long(), mask], dim=1)
        raw = self("score", sequences, attention)
        has_eos = (response == self.eos_id).any(dim=1)
        return {"prompt_ids": prompt_ids, "response": response, "mask": mask, "sequences": sequences,
                "attention": attention, "raw_score": raw, "has_eos": has_eos}

    @staticmethod
    def _sequences(exp: dict[str, Tensor]) -> tuple[Tensor, Tensor]:
        return exp["sequences"], exp["attention"]  # kept by the rollout

    @torch.no_grad()
    def make_experience(self, batch: dict[str, Any], generator: torch.Generator) -> dict[str, Tensor]:
        """A rollout with everything PPO needs: old log-probs, reference log-probs, values,
        per-token rewards, advantages and returns."""
        hp = self.hparams
        exp = self.rollout(batch, generator)
        mask = exp["mask"]
        exp["old_logp"] = self._logp("actor", exp)[0]
        exp["ref_logp"] = self._logp("reference", exp)[0]
        exp["old_values"] = self._per_response_token("values", exp) * mask
        score = exp["raw_score"]
        if hp.normalize_reward:
            score = self._normalized(score)
        if hp.missing_eos_penalty is not None:
            score = torch.where(exp["has_eos"], score, score - hp.missing_eos_penalty)
        exp["score"] = score
        exp["kl"] = ops.kl_penalty(exp["old_logp"], exp["ref_logp"], hp.kl_estimator) * mask
        rewards = ops.token_rewards(score, exp["kl"], mask, kl_coef=hp.kl_coef, clip=hp.reward_clip)
        advantages, returns = ops.gae(rewards, exp["old_values"], mask, gamma=hp.gamma, lam=hp.lam)
        if hp.whiten_advantages:
            advantages = ops.masked_whiten(advantages, mask)
        exp["advantages"], exp["returns"] = advantages, returns
        return exp

    # -- updates ----------------------------------------------------------------------------

    def ppo_losses(self, exp: dict[str, Tensor]) -> tuple[Tensor, dict[str, Tensor]]:
        """The loss of one mini-batch (``exp`` sliced to it) and its statistics."""
        hp = self.hparams
        mask = exp["mask"]
        logp, logits = self._logp("actor", exp)
        pg_loss, pg_stats = ops.policy_loss(logp, exp["old_logp"], exp["advantages"], mask, clip_eps=hp.clip_eps)
        values = self._per_response_token("values", exp)
        vf_loss, vf_stats = ops.value_loss(values, exp["old_values"], exp["returns"], mask, clip=hp.value_clip)
        loss = pg_loss + hp.vf_coef * vf_loss
        stats = {"policy_loss": pg_loss.detach(), "value_loss": vf_loss.detach(),
                 "entropy": self._entropy(logits, mask), **pg_stats, **vf_stats}
        return loss, stats

    def _update_loss(self, exp: dict[str, Tensor]) -> tuple[Tensor, dict[str, Tensor]]:
        """``ppo_losses``, plus ``ptx_coef`` times the SFT loss of a ``ptx_data`` batch."""
        loss, stats = self.ppo_losses(exp)
        if self.hparams.ptx_coef > 0:
            ptx_batch = {k: v.to(self.device) for k, v in next(self._ptx_iter()).items()}
            ptx_loss = self("ptx", ptx_batch["input_ids"], ptx_batch["attention_mask"], labels=ptx_batch["labels"])
            loss = loss + self.hparams.ptx_coef * ptx_loss
            stats["ptx_loss"] = ptx_loss.detach()
        return loss, stats

    def training_step(self, batch: dict[str, Any], batch_idx: int) -> None:
        hp = self.hparams
        exp = self.make_experience(batch, self._generator(self.global_step))
        logs = self._update(exp, _UPDATE_KEYS, hp.ppo_epochs, self._update_loss)
        self._update_ema()
        mask = exp["mask"].float()
        logs.update({
            "reward": exp["raw_score"].mean(),
            "score": exp["score"].mean(),
            "kl": (exp["kl"] * mask).sum(-1).mean(),
            "response_length": mask.sum(-1).mean(),
            "eos_fraction": exp["has_eos"].float().mean(),
        })
        checker = self.task_checker(hp.data)
        if checker is not None:
            logs["task_accuracy"] = self._accuracy(checker, batch["prompts"], self._responses(exp))
        self._log_train(logs, len(mask))  # per prompt of this rollout (this rank's)

    def _ptx_iter(self) -> Any:
        if self._ptx is None:
            self._ptx = self._ptx_batches()
        return self._ptx

    @torch.no_grad()
    def _update_ema(self) -> None:
        """EMA of the actor: under ZeRO-3 each rank updates its own shard only."""
        if self.ema_actor is None:
            return
        weight = 1.0 - self.hparams.ema_decay
        for ema, live in zip(self.ema_actor.parameters(), self.actor.parameters()):
            if live.requires_grad:
                _local(ema).lerp_(_local(live).to(ema.dtype), weight)

    # -- evaluation -------------------------------------------------------------------------

    def _responses(self, exp: dict[str, Tensor]) -> list[str]:
        return decode_responses(self.tokenizer, exp["response"], self.eos_id)

    def _validation_metrics(self, batch: dict[str, Any], generator: torch.Generator) -> dict[str, tuple[Tensor, bool]]:
        exp = self.rollout(batch, generator)
        mask = exp["mask"].float()
        out = {"reward": (exp["raw_score"].mean(), True), "response_length": (mask.sum(-1).mean(), False),
               "eos_fraction": (exp["has_eos"].float().mean(), False)}
        checker = self.task_checker(self.hparams.eval_data)
        if checker is not None:
            out["task_accuracy"] = (self._accuracy(checker, batch["prompts"], self._responses(exp)), True)
        return out

    # -- optimizers and export --------------------------------------------------------------

    def configure_optimizers(self) -> Any:
        return self._adamw(self.actor, self.hparams.actor_lr), self._adamw(self.critic, self.hparams.critic_lr)

    def export_hf(self, directory: str) -> None:
        """Collective: the actor (LoRA merged) as a Hugging Face folder; with EMA, the EMA
        actor too, to ``<directory>-ema``."""
        from zeropp_strategy.rlhf.export import export_causal_lm

        super().export_hf(directory)
        if self.ema_actor is not None:
            export_causal_lm(self.ema_actor, f"{directory}-ema", tokenizer=self.tokenizer)

"""Layer: recipes. ``GRPOModule``: critic-free RL on verifiable rewards, GRPO and its
variants (recipe: ``grpo.yaml`` beside this file). Moved here from
``zeropp_strategy.rlhf.grpo`` (that path was removed: docs/changes.md).

No critic and no learned value: each prompt gets ``num_generations`` (G) sampled
completions, each completion a reward, and its advantage is its reward against the others
of its group (``grpo_ops.group_advantages``: ``grpo``, ``dr_grpo``, ``rloo``,
``reinforce_pp``). Networks, built in ``configure_model`` and sharded by the strategy:

- **actor** (trained): the policy, from the SFT output folder;
- **reference** (frozen): a copy of the starting actor for the KL term, built only when
  ``beta > 0`` (with ``beta = 0``, the default, it does not exist: no memory, no forward);
- **reward model** (frozen, optional): a ``RewardModule`` folder, scored at the EOS.

One training step = one rollout and its updates (manual optimization):

1. *Rollout* (no grad): G completions per prompt (``generation.sample``; under ZeRO-3 the
   actor's blocks gathered once per call); rewards from the reward functions
   (``f(prompts, completions, **columns)``, see ``rlhf.rewards``) and the reward model,
   combined with ``reward_weights``. With ``dynamic_sampling`` the groups whose rewards are
   all equal are dropped and more prompts drawn, up to ``max_sampling_rounds`` draws, every
   rank drawing as long as one rank still lacks groups (each draw is collective under
   ZeRO-3); a batch that cannot be filled is completed with dropped groups
   (``grpo_ops.fill_groups``) and ``train_filled_fraction`` says so.
2. *Advantages*: one per completion, from its group (``reinforce_pp`` whitens over the
   whole batch of all ranks). The log-probs of the rollout (``old_logp``) and, with
   ``beta > 0``, the reference's, at the sampling temperature and top-k.
3. *Updates*: ``num_iterations`` passes over the rollout in shuffled mini-batches; the
   loss is the clipped surrogate with ``clip_low``/``clip_high`` on the ratio against
   ``old_logp``, plus ``beta * KL`` per token, aggregated by ``loss_aggregation``. With one
   pass in one mini-batch the ratio is 1 and the rollout's forward is skipped.

What it shares with ``PPOModule`` (set-up, ``forward`` by kind, prompt loaders, sampling,
the update loop, validation, export) is ``RolloutModule``'s, in ``rollout.py``: every
network has its dropout off (``disable_dropout``, in train mode), and every forward goes
through ``self(kind, ...)``, for the reasons given in that file's header.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from typing import Any

import torch
from torch import Tensor

from zeropp_strategy.recipes.rollout import EMBEDDED, RolloutModule
from zeropp_strategy.toolkit import copy_on_materialize
from zeropp_strategy.rlhf import grpo_ops, ops
from zeropp_strategy.rlhf.data import PromptCollator
from zeropp_strategy.rlhf.generation import decode_responses
from zeropp_strategy.rlhf.models import ScalarHeadModel, apply_lora, build_causal_lm
from zeropp_strategy.rlhf.rewards import addition_reward, call_reward_func, import_path, resolve_reward_funcs

__all__ = ["GRPOModule"]

# what one update reads of the rollout (``old_logp`` and ``ref_logp`` when it has them)
_UPDATE_KEYS = ["prompt_ids", "prompt_mask", "response", "mask", "advantages", "old_logp", "ref_logp"]


def _std(x: Tensor) -> Tensor:
    """The unbiased std, 0 for fewer than two values (torch warns and gives NaN)."""
    return x.std() if x.numel() > 1 else x.new_zeros(())


class _GroupCollator:
    """Prompt records -> ``PromptCollator``'s left-padded batch, plus ``columns``: every
    other field of the records, one list per field (what reward functions receive)."""

    def __init__(self, tokenizer: Any, max_length: int) -> None:
        self.prompts = PromptCollator(tokenizer, max_length=max_length)

    def __call__(self, records: Sequence[dict[str, Any]]) -> dict[str, Any]:
        out = self.prompts(records)
        keys = sorted({k for r in records for k in r} - {"prompt"})
        out["columns"] = {k: [r.get(k) for r in records] for k in keys}
        return out


class GRPOModule(RolloutModule):
    """GRPO-family policy optimisation: groups of sampled completions, verifiable rewards.

    Args:
        actor: the SFT output folder, a hub name, or a transformers config dict (tests).
            Default: the embedded tiny Llama config.
        reward_funcs: reward functions, each a callable or an import path
            (``package.module.function``), called ``f(prompts=, completions=, **columns)``.
            ``None`` with no ``reward_model`` and ``data="embedded:addition"``: the task's
            check, ``rlhf.rewards.addition_reward``.
        reward_model: a ``RewardModule`` folder (its score, normalised with its statistics,
            is one more reward, after the functions); ``None``: none.
        reward_weights: one weight per reward (functions first, then the reward model);
            ``None``: all 1. The reward of a completion is the weighted sum (``None`` values
            a function returns are left out).
        reference: the frozen KL anchor (``beta > 0`` only); ``None``: a copy of the actor.
        tokenizer: as ``SFTModule``.
        data: prompts to train on (``prompt`` field plus any others, passed to the reward
            functions as columns), or ``embedded:addition``.
        eval_data: prompts for validation (one completion each); ``None``: no validation.
        eval_batch_size: prompts per rank per validation batch (the draws depend on the
            batch: 32, as ``PPOModule``'s recipe, samples the same numbers as PPO does).
        rollout_batch_size: prompts per rank per rollout.
        num_generations: completions per prompt (G, the group).
        mini_batch_size: completions per rank per update.
        num_iterations: passes over each rollout (the ratio is against the rollout's policy).
        max_prompt_length, max_new_tokens: prompt tokens kept (from the right), completion cap.
        temperature, top_k: sampling. Log-probs are recomputed at ``temperature`` over the
            whole vocabulary: ``top_k`` shapes the sampling only.
        advantage_estimator: ``grpo``, ``dr_grpo``, ``rloo`` or ``reinforce_pp``.
        loss_aggregation: ``sequence``, ``token`` (DAPO) or ``fixed_length`` (Dr. GRPO,
            divides by ``max_new_tokens``).
        clip_low, clip_high: the ratio is clipped to ``[1 - clip_low, 1 + clip_high]``.
        beta: weight of the per-token KL to the reference in the loss; 0: no reference.
        kl_estimator: ``k1``, ``k2`` or ``k3`` (``ops.kl_penalty``).
        dynamic_sampling: drop groups with equal rewards and draw more prompts (DAPO).
        max_sampling_rounds: draws per rollout at most, the first included.
        lr, weight_decay, max_grad_norm: AdamW and gradient clipping (``None``: off).
        lora: peft ``LoraConfig`` fields for the actor.
        gather_for_generation: under ZeRO-3, gather the actor's blocks once per rollout.
        export_dir: at the end of ``fit`` the actor is written there as a HF folder.
        seed: prompt order, mini-batch order, sampling.
        dtype: the weights' dtype of every network built from a folder or config
            (``bf16``, ``fp16``, ``fp32``; ``None``: the folder's own). See ``SFTModule``.
    """

    def __init__(
        self,
        actor: str | dict[str, Any] | None = None,
        # import paths first: jsonargparse (zeropp fit) tries a union's members in order, and a Callable
        # member tried on a list of paths warns "Unable to serialize instance" when it saves the config
        reward_funcs: list[str] | str | list[Callable[..., Any]] | Callable[..., Any] | None = None,
        reward_model: str | dict[str, Any] | None = None,
        reward_weights: list[float] | None = None,
        reference: str | dict[str, Any] | None = None,
        tokenizer: str | None = None,
        data: str = EMBEDDED,
        eval_data: str | None = EMBEDDED,
        eval_batch_size: int = 32,
        rollout_batch_size: int = 8,
        num_generations: int = 8,
        mini_batch_size: int = 64,
        num_iterations: int = 1,
        max_prompt_length: int = 32,
        max_new_tokens: int = 8,
        temperature: float = 1.0,
        top_k: int = 0,
        advantage_estimator: str = "grpo",
        loss_aggregation: str = "token",
        clip_low: float = 0.2,
        clip_high: float = 0.28,
        beta: float = 0.0,
        kl_estimator: str = "k3",
        dynamic_sampling: bool = False,
        max_sampling_rounds: int = 4,
        lr: float = 1e-5,
        weight_decay: float = 0.0,
        max_grad_norm: float | None = 1.0,
        lora: dict[str, Any] | None = None,
        gather_for_generation: bool = True,
        export_dir: str | None = None,
        seed: int = 0,
        dtype: str | None = None,
    ) -> None:
        super().__init__()
        completions = rollout_batch_size * num_generations
        self._check(rollout_batch_size >= 1, "rollout_batch_size", rollout_batch_size,
                    "use a positive number, e.g. 8")
        self._check(num_generations >= 2, "num_generations", num_generations,
                    "use 2 or more: the advantage compares completions of the same prompt")
        self._check(1 <= mini_batch_size <= completions, "mini_batch_size", mini_batch_size,
                    f"use 1..rollout_batch_size * num_generations ({completions})")
        self._check(num_iterations >= 1, "num_iterations", num_iterations, "use 1 or more")
        self._check(eval_batch_size >= 1, "eval_batch_size", eval_batch_size, "use a positive number, e.g. 32")
        self._check(max_new_tokens >= 1, "max_new_tokens", max_new_tokens, "use 1 or more")
        self._check(temperature > 0, "temperature", temperature, "use a value > 0, e.g. 1.0")
        self._check(top_k >= 0, "top_k", top_k, "use 0 (off) or a positive count")
        self._check(advantage_estimator in grpo_ops.ADVANTAGE_ESTIMATORS, "advantage_estimator", advantage_estimator,
                    f"use one of {', '.join(grpo_ops.ADVANTAGE_ESTIMATORS)}")
        self._check(loss_aggregation in grpo_ops.LOSS_AGGREGATIONS, "loss_aggregation", loss_aggregation,
                    f"use one of {', '.join(grpo_ops.LOSS_AGGREGATIONS)}")
        self._check(0 < clip_low < 1, "clip_low", clip_low, "use a value in (0, 1), e.g. 0.2")
        self._check(clip_high > 0, "clip_high", clip_high, "use a value > 0, e.g. 0.28 (DAPO) or clip_low")
        self._check(beta >= 0, "beta", beta, "use 0 (no KL term, no reference) or a positive weight, e.g. 0.04")
        self._check(kl_estimator in ("k1", "k2", "k3"), "kl_estimator", kl_estimator, "use 'k1', 'k2' or 'k3'")
        self._check(reference is None or beta > 0, "reference", reference,
                    "set beta > 0 to use a reference (with beta=0 none is built), or drop reference")
        self._check(max_sampling_rounds >= 1, "max_sampling_rounds", max_sampling_rounds, "use 1 or more, e.g. 4")
        self._check(lr > 0, "lr", lr, "use a value > 0, e.g. 1e-5")
        self._check(max_grad_norm is None or max_grad_norm > 0, "max_grad_norm", max_grad_norm,
                    "use None or a value > 0")
        if reward_funcs is None and reward_model is None:
            self._check(data == EMBEDDED, "reward_funcs", reward_funcs,
                        "name a reward function (e.g. mypkg.rewards.accuracy) or a reward_model folder: only "
                        "data='embedded:addition' has a built-in check")
            reward_funcs = [addition_reward]
        self.reward_funcs = resolve_reward_funcs(reward_funcs)
        sources = len(self.reward_funcs) + (reward_model is not None)
        self._check(reward_weights is None or len(reward_weights) == sources, "reward_weights", reward_weights,
                    f"give one weight per reward ({sources}: the reward functions, then the reward model), or None")
        self.save_hyperparameters(ignore=["reward_funcs"])
        # What a recipe would write, so the checkpoint's hyper-parameters stay plain data.
        self.hparams["reward_funcs"] = [import_path(f) for _, f in self.reward_funcs]
        self.reward_names = [n for n, _ in self.reward_funcs] + (["reward_model"] if reward_model is not None else [])
        self.reward_weights = torch.tensor(reward_weights if reward_weights is not None else [1.0] * sources)
        self._set_up(actor=actor, reference=reference, tokenizer=tokenizer, eval_data=eval_data, dtype=dtype)
        self.reward_spec = reward_model
        self._refill: Iterator[dict[str, Any]] | None = None

    # -- networks ---------------------------------------------------------------------------

    def _build_networks(self) -> None:
        dtype = self.weights_dtype
        actor = build_causal_lm(self.actor_spec, dtype=dtype)
        if self.hparams.beta > 0:  # the reference serves the KL term only: none without it
            spec = self.reference_spec if self.reference_spec is not None else self.actor_spec
            self.reference = copy_on_materialize(actor) if isinstance(spec, dict) else build_causal_lm(spec, dtype=dtype)
            self.reference.requires_grad_(False)
        if self.reward_spec is not None:
            self.reward_model = ScalarHeadModel(self.reward_spec, dtype=dtype).requires_grad_(False)
        self.actor = apply_lora(actor, self.hparams.lora)

    # -- data -------------------------------------------------------------------------------

    def _collator(self) -> _GroupCollator:
        return _GroupCollator(self.tokenizer, self.hparams.max_prompt_length)

    def _eval_batch_size(self) -> int:
        return self.hparams.eval_batch_size

    def _refill_batch(self) -> dict[str, Any]:
        """The next prompts for dynamic sampling: this rank's own endless shuffled stream."""
        if self._refill is None:
            hp, rank = self.hparams, self.global_rank

            def stream() -> Iterator[dict[str, Any]]:
                g = torch.Generator().manual_seed(hp.seed * 1_000_003 + 7 + rank)
                while True:
                    yield from self._loader(hp.data, "sft", hp.rollout_batch_size, g)

            self._refill = stream()
        return {k: v.to(self.device) if isinstance(v, Tensor) else v for k, v in next(self._refill).items()}

    # -- rollout ----------------------------------------------------------------------------

    @torch.no_grad()
    def rollout(self, batch: dict[str, Any], generator: torch.Generator, group_size: int) -> dict[str, Any]:
        """``group_size`` completions per prompt, and their rewards: ``rewards`` (weighted
        sum, ``[n]``) and ``by_source`` (``[sources, n]``, NaN where a function gave None)."""
        prompt_ids = batch["input_ids"].repeat_interleave(group_size, 0)
        prompt_mask = batch["attention_mask"].repeat_interleave(group_size, 0)
        response, mask = self._sample(prompt_ids, prompt_mask, generator)
        prompts = [p for p in batch["prompts"] for _ in range(group_size)]
        completions = decode_responses(self.tokenizer, response, self.eos_id)
        columns = {k: [v for v in values for _ in range(group_size)] for k, values in batch["columns"].items()}
        by_source = [call_reward_func(name, f, prompts, completions, columns) for name, f in self.reward_funcs]
        exp = {"prompt_ids": prompt_ids, "prompt_mask": prompt_mask.long(), "response": response, "mask": mask}
        rows = [torch.tensor(v, dtype=torch.float32, device=self.device) for v in by_source]
        if self.reward_model is not None:
            rows.append(self._normalized(self("score", *self._sequences(exp)).float()))
        exp["by_source"] = torch.stack(rows)
        weights = self.reward_weights.to(self.device).unsqueeze(1)
        exp["rewards"] = torch.nansum(exp["by_source"] * weights, dim=0)
        exp["prompts"], exp["completions"] = prompts, completions
        return exp

    def _any_rank(self, flag: bool) -> bool:
        """Collective: is ``flag`` true on some rank?"""
        total = self.trainer.strategy.reduce(torch.tensor(float(flag), device=self.device), reduce_op="sum")
        return bool(total > 0)

    @torch.no_grad()
    def make_experience(self, batch: dict[str, Any], generator: torch.Generator) -> tuple[dict[str, Any], dict]:
        """The rollout to train on (``rollout_batch_size`` groups, refilled with dynamic
        sampling), its advantages and old log-probs; and the first draw, for the logs."""
        hp, group = self.hparams, self.hparams.num_generations
        draws = [self.rollout(batch, generator, group)]
        signal = grpo_ops.groups_with_signal(draws[0]["rewards"], group)
        if hp.dynamic_sampling:
            while len(draws) < hp.max_sampling_rounds and self._any_rank(int(signal.sum()) < hp.rollout_batch_size):
                draws.append(self.rollout(self._refill_batch(), generator, group))
                signal = torch.cat([signal, grpo_ops.groups_with_signal(draws[-1]["rewards"], group)])
        keys = {"prompt_ids": (self.pad_id, True), "prompt_mask": (0, True), "response": (self.pad_id, False),
                "mask": (0, False)}
        exp: dict[str, Any] = {k: grpo_ops.cat_padded([d[k] for d in draws], value=v, left=left)
                               for k, (v, left) in keys.items()}
        exp["rewards"] = torch.cat([d["rewards"] for d in draws])
        chosen, filled = grpo_ops.fill_groups(signal, hp.rollout_batch_size)
        rows = (chosen.unsqueeze(1) * group + torch.arange(group, device=chosen.device)).flatten()
        exp = {k: v[rows.to(v.device)] for k, v in exp.items()}
        exp["filled_fraction"] = torch.tensor(filled / hp.rollout_batch_size, device=self.device)
        exp["rounds"] = torch.tensor(float(len(draws)), device=self.device)
        rewards = exp["rewards"]
        if hp.advantage_estimator == "reinforce_pp":  # whitened over every rank's batch
            everyone = self.all_gather(rewards).reshape(-1, rewards.numel())
            exp["advantages"] = grpo_ops.group_advantages(everyone.flatten(), group, "reinforce_pp")[
                self.global_rank * rewards.numel() : (self.global_rank + 1) * rewards.numel()]
        else:
            exp["advantages"] = grpo_ops.group_advantages(rewards, group, hp.advantage_estimator)
        if not self._on_policy(len(rows)):
            exp["old_logp"] = self._logp("actor", exp)[0]
        if self.reference is not None:
            exp["ref_logp"] = self._logp("reference", exp)[0]
        return exp, draws[0]

    def _on_policy(self, n: int) -> bool:
        """One pass in one mini-batch: the ratio is 1, the rollout's log-probs are the update's."""
        return self.hparams.num_iterations == 1 and self.hparams.mini_batch_size >= n

    # -- updates ----------------------------------------------------------------------------

    def grpo_loss(self, exp: dict[str, Tensor]) -> tuple[Tensor, dict[str, Tensor]]:
        """The loss of one mini-batch (``exp`` sliced to it) and its statistics."""
        hp = self.hparams
        mask = exp["mask"]
        logp, logits = self._logp("actor", exp)
        old = exp["old_logp"] if "old_logp" in exp else logp.detach()
        per_token, stats = grpo_ops.clipped_surrogate(logp, old, exp["advantages"], mask, clip_low=hp.clip_low,
                                                      clip_high=hp.clip_high)
        stats["policy_loss"] = grpo_ops.aggregate_loss(per_token, mask, hp.loss_aggregation,
                                                       max_tokens=hp.max_new_tokens).detach()
        if self.reference is not None:
            kl = ops.kl_penalty(logp, exp["ref_logp"], hp.kl_estimator) * mask
            per_token = per_token + hp.beta * kl
            stats["kl"] = ops.masked_mean(kl, mask).detach()
        loss = grpo_ops.aggregate_loss(per_token, mask, hp.loss_aggregation, max_tokens=hp.max_new_tokens)
        stats["entropy"] = self._entropy(logits, mask)
        stats["loss"] = loss.detach()
        return loss, stats

    def training_step(self, batch: dict[str, Any], batch_idx: int) -> None:
        hp = self.hparams
        exp, first = self.make_experience(batch, self._generator(self.global_step))
        logs = self._update(exp, [k for k in _UPDATE_KEYS if k in exp], hp.num_iterations, self.grpo_loss)
        logs.update(self._rollout_stats(first, hp.data, hp.num_generations))
        if hp.dynamic_sampling:
            logs.update({"filled_fraction": exp["filled_fraction"], "sampling_rounds": exp["rounds"]})
        self._log_train(logs, len(batch["prompts"]))

    def _rollout_stats(self, exp: dict[str, Any], source: str | None, group_size: int) -> dict[str, Tensor]:
        """What users watch, from one draw (the first: an unbiased sample of the policy)."""
        mask = exp["mask"].float()
        out = {"reward": exp["rewards"].mean(), "reward_std": _std(exp["rewards"]),
               "completion_length": mask.sum(-1).mean(),
               "eos_fraction": (exp["response"] == self.eos_id).any(dim=1).float().mean()}
        for name, row in zip(self.reward_names, exp["by_source"]):
            out[f"reward_{name}_mean"], out[f"reward_{name}_std"] = row.nanmean(), _std(row[~row.isnan()])
        if group_size > 1:
            signal = grpo_ops.groups_with_signal(exp["rewards"], group_size)
            out["zero_variance_fraction"] = 1.0 - signal.float().mean()
        checker = self.task_checker(source)
        if checker is not None:
            out["task_accuracy"] = self._accuracy(checker, exp["prompts"], exp["completions"])
        return out

    # -- evaluation -------------------------------------------------------------------------

    def _validation_metrics(self, batch: dict[str, Any], generator: torch.Generator) -> dict[str, tuple[Tensor, bool]]:
        exp = self.rollout(batch, generator, 1)  # one completion per prompt
        stats = self._rollout_stats(exp, self.hparams.eval_data, 1)
        return {key: (stats[key], key != "completion_length")
                for key in ("reward", "completion_length", "eos_fraction", "task_accuracy") if key in stats}

    # -- optimizers -------------------------------------------------------------------------

    def configure_optimizers(self) -> Any:
        return self._adamw(self.actor, self.hparams.lr)

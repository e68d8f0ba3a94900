"""Layer: recipes. ``RolloutModule``: what ``PPOModule`` (``ppo.py``) and ``GRPOModule``
(``grpo.py``) share, on-policy RL on prompts: an actor that samples responses, a frozen
reference and reward model, and updates in shuffled mini-batches (manual optimization).

Held here: the ``__init__`` set-up both make (tokenizer, EOS and pad ids, the weights'
dtype, no validation without ``eval_data``), ``configure_model``'s frame (each subclass
builds its own networks; every network then has its dropout off), ``forward`` by kind,
the prompt loaders, the sampling generator and the sampling call, the log-probs of the
response tokens, the update loop, the task accuracy, the validation logging, the
optimizers' AdamW and the export of the actor at the end of ``fit``. The subclasses keep
their arguments (each ``__init__`` lists every one, for LightningCLI), checks, networks,
experience and losses.

Every network has its dropout off (``rlhf.models.disable_dropout``: p = 0, in train
mode): dropout would make the recomputed log-probs differ from the sampled ones and bias
the KL and the ratio.

Every forward goes through ``self(kind, ...)`` (``forward`` dispatches on ``kind``): under
``zeropp`` stage 3 that is the FSDP root's forward, which gathers the parameters outside
the transformer blocks (embeddings, heads) and registers the backward hooks.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from lightning.pytorch import LightningModule
from torch import Tensor, nn
from torch.utils.data import DataLoader

from zeropp_strategy.rlhf import ops
from zeropp_strategy.rlhf.data import EvalShard, PromptCollator, load_records
from zeropp_strategy.rlhf.generation import gathered, sample
from zeropp_strategy.rlhf.models import (
    ScalarHeadModel,
    build_tokenizer,
    disable_dropout,
    positions,
    tiny_llama_config,
)
from zeropp_strategy.toolkit import fsdp_modules, weights_dtype

__all__ = ["EMBEDDED", "RolloutModule"]

#: the embedded task's data source: its prompts, and its own correctness check
EMBEDDED = "embedded:addition"

# a mini-batch -> its loss and its statistics
LossFn = Callable[[dict[str, Tensor]], tuple[Tensor, dict[str, Tensor]]]


class RolloutModule(LightningModule):
    """The base of the RL recipes on prompts. Not a recipe itself: a subclass lists its
    arguments in its own ``__init__`` (calling ``save_hyperparameters`` there, then
    ``_set_up``), builds its networks in ``_build_networks`` and writes ``training_step``
    and ``_validation_metrics``.

    Read from ``self.hparams``, so every subclass takes them: ``data``, ``eval_data``,
    ``rollout_batch_size``, ``mini_batch_size``, ``max_prompt_length``, ``max_new_tokens``,
    ``temperature``, ``top_k``, ``weight_decay``, ``max_grad_norm``,
    ``gather_for_generation``, ``export_dir`` and ``seed``.
    """

    def _check(self, ok: bool, field: str, value: Any, fix: str) -> None:
        """A bad argument: ``ValueError`` naming the class, the field, its value and the fix."""
        if not ok:
            raise ValueError(f"{type(self).__name__}({field}={value!r}) is invalid. Fix: {fix}.")

    def _set_up(self, *, actor: str | dict[str, Any] | None, reference: str | dict[str, Any] | None,
                tokenizer: str | None, eval_data: str | None, dtype: str | None) -> None:
        """The ``__init__`` work every subclass does, after its checks and ``save_hyperparameters``."""
        self.automatic_optimization = False
        if eval_data is None:
            # No evaluation prompts, no validation: Lightning skips it, quietly, when neither
            # hook is overridden. (An empty val_dataloader made it warn that its length is zero.)
            self.validation_step = self.val_dataloader = None  # type: ignore[assignment, method-assign]
        self.weights_dtype = weights_dtype(dtype)  # a bad name fails here, on every rank
        self.actor_spec = actor if actor is not None else tiny_llama_config()
        self.reference_spec = reference
        self.tokenizer = build_tokenizer(tokenizer)
        if self.tokenizer.eos_token_id is None:
            raise ValueError(f"{type(self).__name__}(tokenizer=...) has no eos_token_id. Fix: use a tokenizer with "
                             "an EOS token.")
        self.eos_id = self.tokenizer.eos_token_id
        self.pad_id = self.tokenizer.pad_token_id if self.tokenizer.pad_token_id is not None else self.eos_id
        self.actor: nn.Module | None = None
        self.reference: nn.Module | None = None
        self.reward_model: ScalarHeadModel | None = None

    # -- networks ---------------------------------------------------------------------------

    def configure_model(self) -> None:
        if self.actor is not None:
            return
        self._build_networks()
        for net in self._networks():
            if net is not None:  # dropout off, in train mode (see the module docstring)
                disable_dropout(net).train(self.training)

    def _build_networks(self) -> None:
        """Set ``self.actor`` (and whatever else the subclass has), in ``self.weights_dtype``."""
        raise NotImplementedError

    def _networks(self) -> tuple[nn.Module | None, ...]:
        """Every network of the module (``None`` for one not built)."""
        return self.actor, self.reference, self.reward_model

    def forward(self, kind: str, input_ids: Tensor, attention_mask: Tensor, **kwargs: Any) -> Any:
        """Every network call, by ``kind``: ``sample`` (responses), ``actor`` / ``reference``
        (logits), ``score`` (reward model); any other kind goes to ``_forward_other``."""
        assert self.actor is not None
        if kind == "sample":
            with gathered(self.actor, enabled=self.hparams.gather_for_generation):
                return sample(self.actor, input_ids, attention_mask, **kwargs)
        pos = positions(attention_mask)
        if kind == "actor" or (kind == "reference" and self.reference is not None):
            net = self.actor if kind == "actor" else self.reference
            return net(input_ids=input_ids, attention_mask=attention_mask, position_ids=pos).logits
        if kind == "score" and self.reward_model is not None:
            return self.reward_model.score(input_ids, attention_mask, pos)
        return self._forward_other(kind, input_ids, attention_mask, pos, **kwargs)

    def _forward_other(self, kind: str, input_ids: Tensor, attention_mask: Tensor, pos: Tensor, **kwargs: Any) -> Any:
        """The kinds of a subclass's own networks (``pos``: the position ids of the rows)."""
        raise ValueError(f"{type(self).__name__}.forward(kind={kind!r}): no such network in this module.")

    # -- data -------------------------------------------------------------------------------

    def _records(self, source: str, kind: str) -> list[dict[str, Any]]:
        """One record per distinct prompt; the embedded task's records keep the prompt only
        (their ``response`` is a demonstration, not a reference answer)."""
        seen: set[str] = set()
        out = []
        for record in load_records(source, kind=kind):
            if record["prompt"] not in seen:
                seen.add(record["prompt"])
                out.append({"prompt": record["prompt"]} if source == EMBEDDED else dict(record))
        return out

    def _collator(self) -> Callable[[list[dict[str, Any]]], dict[str, Any]]:
        """Records -> a batch of left-padded prompts (``PromptCollator``: it reads the prompt only)."""
        return PromptCollator(self.tokenizer, max_length=self.hparams.max_prompt_length)

    def _loader(self, source: str, kind: str, batch_size: int, generator: torch.Generator | None) -> DataLoader:
        """Training prompts (shuffled by ``generator``, whole batches) or, with no generator,
        evaluation prompts (each rank its share, in order)."""
        records = self._records(source, kind)
        return DataLoader(records, batch_size=batch_size, shuffle=generator is not None,
                          sampler=None if generator is not None else EvalShard(records),
                          drop_last=generator is not None, generator=generator, collate_fn=self._collator())

    def train_dataloader(self) -> DataLoader:
        hp = self.hparams
        return self._loader(hp.data, "sft", hp.rollout_batch_size, torch.Generator().manual_seed(hp.seed))

    def val_dataloader(self) -> DataLoader | list:
        if self.hparams.eval_data is None:
            return []
        return self._loader(self.hparams.eval_data, "eval", self._eval_batch_size(), None)

    def _eval_batch_size(self) -> int:
        """Prompts per rank per validation batch."""
        return self.hparams.rollout_batch_size

    # -- sampling and log-probs -------------------------------------------------------------

    def _generator(self, step: int) -> torch.Generator:
        """One sampling stream per (seed, step, rank): reproducible, and the same under every
        strategy with the same number of processes."""
        g = torch.Generator(device=self.device)
        g.manual_seed(self.hparams.seed * 1_000_003 + step * 1009 + self.global_rank)
        return g

    def _sample(self, prompt_ids: Tensor, prompt_mask: Tensor, generator: torch.Generator) -> tuple[Tensor, Tensor]:
        """Responses to left-padded prompts, and their masks (ending at the first EOS)."""
        hp = self.hparams
        response = self("sample", prompt_ids, prompt_mask, max_new_tokens=hp.max_new_tokens, eos_id=self.eos_id,
                        pad_id=self.pad_id, temperature=hp.temperature, top_k=hp.top_k, generator=generator,
                        stop_when_done=hp.gather_for_generation or not fsdp_modules(self.actor))
        return response, ops.response_mask(response, self.eos_id)

    def _normalized(self, score: Tensor) -> Tensor:
        """A reward model's score with its statistics: ``(score - mean) / std``."""
        stats = self.reward_model.reward_stats
        return (score - stats["mean"]) / max(stats["std"], 1e-6)

    @staticmethod
    def _sequences(exp: dict[str, Tensor]) -> tuple[Tensor, Tensor]:
        """The rows of ``exp``, prompt then response: token ids and attention mask."""
        return (torch.cat([exp["prompt_ids"], exp["response"]], 1), torch.cat([exp["prompt_mask"], exp["mask"]], 1))

    def _per_response_token(self, kind: str, exp: dict[str, Tensor]) -> Tensor:
        """``kind``'s outputs at the positions that predict the response tokens."""
        prompt_len = exp["prompt_ids"].shape[1]
        return self(kind, *self._sequences(exp))[:, prompt_len - 1 : -1]

    def _logp(self, kind: str, exp: dict[str, Tensor]) -> tuple[Tensor, Tensor]:
        """Log-probs of the response tokens under ``kind`` at the sampling temperature, and the
        logits they come from.

        Over the whole vocabulary, not the ``top_k`` that sampling keeps: another network (the
        reference) or the actor after an update may rank a sampled token outside its own top
        k, where the truncated distribution gives it -inf, and the ratio or the KL penalty of
        that token would be infinite (NaN weights after one step). ``top_k`` shapes the
        sampling only, as in TRL and OpenRLHF."""
        hp = self.hparams
        logits = self._per_response_token(kind, exp)
        return ops.token_logprobs(logits, exp["response"], temperature=hp.temperature), logits

    def _entropy(self, logits: Tensor, mask: Tensor) -> Tensor:
        """The mean entropy of the policy the log-probs are of (``_logp``: the temperature, the
        whole vocabulary) over the response tokens (no grad)."""
        with torch.no_grad():
            return ops.masked_mean(ops.entropy_from_logits(logits, temperature=self.hparams.temperature), mask)

    # -- updates ----------------------------------------------------------------------------

    def _update(self, exp: dict[str, Any], keys: list[str], epochs: int, loss_fn: LossFn) -> dict[str, Tensor]:
        """``epochs`` passes over the rollout ``exp`` in shuffled mini-batches (``keys``
        sliced); each one backpropagates ``loss_fn`` once and steps every optimizer, each
        clipped to ``max_grad_norm``. Returns the statistics' means over the updates."""
        hp = self.hparams
        optimizers = self.optimizers()
        optimizers = optimizers if isinstance(optimizers, list) else [optimizers]
        n = exp["mask"].shape[0]
        order = torch.Generator().manual_seed(hp.seed + 7919 * self.global_step)
        totals: dict[str, Tensor] = {}
        updates = 0
        for _ in range(epochs):
            perm = torch.randperm(n, generator=order)
            for start in range(0, n, hp.mini_batch_size):
                idx = perm[start : start + hp.mini_batch_size].to(self.device)
                loss, stats = loss_fn({k: exp[k][idx] for k in keys})
                for opt in optimizers:
                    opt.zero_grad()
                self.manual_backward(loss)
                if hp.max_grad_norm is not None:
                    for opt in optimizers:
                        self.clip_gradients(opt, gradient_clip_val=hp.max_grad_norm, gradient_clip_algorithm="norm")
                for opt in optimizers:
                    opt.step()
                for k, v in stats.items():
                    totals[k] = totals.get(k, 0.0) + v
                updates += 1
        return {k: v / updates for k, v in totals.items()}

    def _log_train(self, logs: dict[str, Tensor], prompts: int) -> None:
        """``train_<name>`` for every statistic, and ``train_reward_mean`` on the progress bar."""
        self.log_dict({f"train_{k}": v for k, v in logs.items()}, sync_dist=True, prog_bar=False, batch_size=prompts)
        self.log("train_reward_mean", logs["reward"], sync_dist=True, prog_bar=True, batch_size=prompts)

    def _adamw(self, net: nn.Module, lr: float) -> torch.optim.AdamW:
        """AdamW over ``net``'s trainable parameters."""
        params = [p for p in net.parameters() if p.requires_grad]
        return torch.optim.AdamW(params, lr=lr, weight_decay=self.hparams.weight_decay)

    # -- evaluation -------------------------------------------------------------------------

    @staticmethod
    def task_checker(source: str | None) -> Any:
        """The task's own correctness check for prompts from ``source``: the embedded
        task's ``score`` for ``embedded:addition``, ``None`` (no task accuracy) otherwise."""
        if source == EMBEDDED:
            from zeropp_strategy.rlhf.task import AdditionTask

            return AdditionTask.score
        return None

    def _accuracy(self, checker: Any, prompts: list[str], completions: list[str]) -> Tensor:
        """The fraction of ``completions`` that ``checker`` finds right."""
        return torch.tensor([checker(p, t) for p, t in zip(prompts, completions)], device=self.device).mean()

    def validation_step(self, batch: dict[str, Any], batch_idx: int) -> None:
        # The same draws before and after training: the generator depends on the batch only.
        metrics = self._validation_metrics(batch, self._generator(10**6 + batch_idx))
        for name, (value, prog_bar) in metrics.items():
            self.log(f"val_{name}", value, sync_dist=True, prog_bar=prog_bar, batch_size=len(batch["prompts"]))

    def _validation_metrics(self, batch: dict[str, Any], generator: torch.Generator) -> dict[str, tuple[Tensor, bool]]:
        """``name -> (value, on the progress bar)`` of one validation batch, logged as ``val_<name>``."""
        raise NotImplementedError

    # -- export -----------------------------------------------------------------------------

    def on_fit_end(self) -> None:
        if self.hparams.export_dir:
            self.export_hf(self.hparams.export_dir)

    def export_hf(self, directory: str) -> None:
        """Collective: the actor (LoRA merged) as a Hugging Face folder."""
        from zeropp_strategy.rlhf.export import export_causal_lm

        export_causal_lm(self.actor, directory, tokenizer=self.tokenizer)

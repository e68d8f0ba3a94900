"""Layer: recipes (rlhf). The formulas of RLHF training, as plain tensor functions (no modules, no state).

Conventions, shared by every function here:

- Sequences are ``[batch, time]``; ``mask`` is 1 on the tokens that count (the response
  tokens, the EOS included) and 0 on prompt and padding, wherever the padding sits (left
  or right). No function infers positions from token ids (``pad == eos`` would hide the
  EOS action and misplace the reward).
- ``logp`` is the log-probability of the token actually taken at each position, computed
  with the same temperature as sampling (``token_logprobs``): recomputing at another
  temperature makes the KL estimate negative.
- Means over tokens are masked means; nothing is averaged over padding.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor

__all__ = [
    "dpo_loss",
    "entropy_from_logits",
    "gae",
    "kl_penalty",
    "last_index",
    "masked_mean",
    "masked_whiten",
    "pairwise_reward_loss",
    "policy_loss",
    "response_mask",
    "sampling_logits",
    "token_logprobs",
    "token_rewards",
    "value_loss",
]


def masked_mean(x: Tensor, mask: Tensor, dim: int | None = None) -> Tensor:
    """Mean of ``x`` where ``mask`` is 1 (over everything, or along ``dim``); 0 where empty."""
    mask = mask.to(x.dtype)
    if dim is None:
        return (x * mask).sum() / mask.sum().clamp(min=1)
    return (x * mask).sum(dim) / mask.sum(dim).clamp(min=1)


def masked_whiten(x: Tensor, mask: Tensor, *, shift_mean: bool = True, eps: float = 1e-8) -> Tensor:
    """(x - mean) / std over the masked entries; masked-out entries come back as 0.

    ``shift_mean=False`` keeps the mean (scales only), as some PPO variants do for rewards.
    The variance is the unbiased one when more than one entry counts.
    """
    mean = masked_mean(x, mask)
    centred = x - mean
    n = mask.sum()
    var = (centred.pow(2) * mask).sum() / (n - 1).clamp(min=1)
    out = centred * torch.rsqrt(var + eps)
    if not shift_mean:
        out = out + mean
    return out * mask.to(x.dtype)


def last_index(mask: Tensor) -> Tensor:
    """Per row, the position of the last 1 in ``mask`` (left or right padding alike).

    A row with no 1 gives -1; callers must treat such rows as empty.
    """
    positions = torch.arange(mask.shape[-1], device=mask.device).expand_as(mask)
    return torch.where(mask.bool(), positions, torch.full_like(positions, -1)).max(dim=-1).values


def sampling_logits(logits: Tensor, *, temperature: float = 1.0, top_k: int = 0) -> Tensor:
    """The logits of the distribution tokens are sampled from: ``logits / temperature``, with
    every token outside the ``top_k`` largest set to -inf when ``top_k > 0``. Sampling and
    every recomputation of log-probs go through this one function, so they cannot differ."""
    if temperature <= 0:
        raise ValueError(f"temperature={temperature} is invalid: it must be > 0. Fix: pass the sampling "
                         "temperature (1.0 samples from the model as it is).")
    logits = logits.float() / temperature
    if top_k and top_k < logits.shape[-1]:
        kth = logits.topk(top_k, dim=-1).values[..., -1:]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    return logits


def token_logprobs(logits: Tensor, tokens: Tensor, *, temperature: float = 1.0, top_k: int = 0) -> Tensor:
    """log p(token) under ``softmax(sampling_logits(logits, temperature, top_k))``, per position.

    ``logits[:, t]`` must be the prediction for ``tokens[:, t]`` (shift before calling).
    """
    logp = F.log_softmax(sampling_logits(logits, temperature=temperature, top_k=top_k), dim=-1)
    return logp.gather(-1, tokens.unsqueeze(-1)).squeeze(-1)


def entropy_from_logits(logits: Tensor, *, temperature: float = 1.0, top_k: int = 0) -> Tensor:
    """Entropy of the sampling distribution (``sampling_logits``) at each position."""
    logp = F.log_softmax(sampling_logits(logits, temperature=temperature, top_k=top_k), dim=-1)
    return -(logp.exp() * logp.masked_fill(torch.isinf(logp), 0.0)).sum(-1)


def kl_penalty(logp: Tensor, ref_logp: Tensor, kind: str = "k1") -> Tensor:
    """Per-token estimate of KL(policy || reference) from the sampled token's log-probs.

    ``k1``: ``logp - ref_logp`` (unbiased, can be negative per token); ``k2``:
    ``(logp - ref_logp)^2 / 2``; ``k3``: ``exp(r) - 1 - r`` with ``r = ref_logp - logp``
    (unbiased and never negative). See J. Schulman, "Approximating KL divergence" (2020).
    """
    diff = logp - ref_logp
    if kind == "k1":
        return diff
    if kind == "k2":
        return 0.5 * diff.pow(2)
    if kind == "k3":
        r = -diff
        return torch.expm1(r) - r
    raise ValueError(f"kl_penalty(kind={kind!r}) is invalid. Fix: use 'k1', 'k2' or 'k3'.")


def token_rewards(
    score: Tensor, kl: Tensor, mask: Tensor, *, kl_coef: float, clip: float | None = None
) -> Tensor:
    """Per-token rewards: ``-kl_coef * kl`` on every response token, plus the sequence's
    score (clipped to ``[-clip, clip]`` when given) on its last response token (the EOS, or
    the last token generated when there is none). ``score``: ``[batch]``."""
    rewards = -kl_coef * kl * mask.to(kl.dtype)
    if clip is not None:
        score = score.clamp(-clip, clip)
    last = last_index(mask)
    rows = torch.nonzero(last >= 0).squeeze(-1)
    rewards[rows, last[rows]] += score[rows].to(rewards.dtype)
    return rewards


def response_mask(response: Tensor, eos_id: int) -> Tensor:
    """1 on each generated token up to and including the first EOS (or on all of them when
    there is none), 0 after it; found from the EOS id's position, so a pad id equal to
    the EOS id cannot hide the EOS."""
    is_eos = (response == eos_id).long()
    after_eos = (is_eos.cumsum(-1) - is_eos) > 0  # strictly after the first EOS
    return (~after_eos).long()


def gae(rewards: Tensor, values: Tensor, mask: Tensor, *, gamma: float, lam: float) -> tuple[Tensor, Tensor]:
    """Generalized advantage estimation over the masked (response) tokens.

    ``delta_t = r_t + gamma * V_{t+1} - V_t`` and ``A_t = delta_t + gamma * lam * A_{t+1}``,
    where ``t+1`` is the next *masked* token (so left padding and prompt tokens inside the
    row are skipped) and the value after the last response token is 0 (the episode ends).
    Returns ``(advantages, returns = advantages + values)``, 0 outside the mask.
    """
    mask_f = mask.to(values.dtype)
    advantages = torch.zeros_like(values)
    next_value = torch.zeros_like(values[:, 0])
    next_adv = torch.zeros_like(values[:, 0])
    for t in reversed(range(values.shape[1])):
        m = mask_f[:, t]
        delta = rewards[:, t] + gamma * next_value - values[:, t]
        adv = delta + gamma * lam * next_adv
        advantages[:, t] = adv * m
        # Outside the mask, carry the next token's value and advantage through unchanged.
        next_value = torch.where(m.bool(), values[:, t], next_value)
        next_adv = torch.where(m.bool(), adv, next_adv)
    returns = (advantages + values) * mask_f
    return advantages, returns


def policy_loss(
    logp: Tensor, old_logp: Tensor, advantages: Tensor, mask: Tensor, *, clip_eps: float
) -> tuple[Tensor, dict[str, Tensor]]:
    """PPO's clipped surrogate: ``-min(ratio * A, clip(ratio, 1 +- eps) * A)``, masked mean.

    Also returns the fraction of tokens where the clipped term was chosen and the
    approximate KL between the old and the new policy (``k3`` estimator)."""
    log_ratio = logp - old_logp
    ratio = log_ratio.exp()
    unclipped = -advantages * ratio
    clipped = -advantages * ratio.clamp(1.0 - clip_eps, 1.0 + clip_eps)
    loss = masked_mean(torch.maximum(unclipped, clipped), mask)
    with torch.no_grad():
        stats = {
            "clip_fraction": masked_mean((clipped > unclipped).float(), mask),
            "approx_kl": masked_mean(torch.expm1(-log_ratio) + log_ratio, mask),
        }
    return loss, stats


def value_loss(
    values: Tensor, old_values: Tensor, returns: Tensor, mask: Tensor, *, clip: float | None
) -> tuple[Tensor, dict[str, Tensor]]:
    """Clipped value loss: ``0.5 * max((V - R)^2, (V_old + clip(V - V_old, +-c) - R)^2)``,
    masked mean; ``clip=None`` gives the plain squared error."""
    err = (values - returns).pow(2)
    if clip is None:
        return 0.5 * masked_mean(err, mask), {"value_clip_fraction": torch.zeros((), device=values.device)}
    clipped_values = old_values + (values - old_values).clamp(-clip, clip)
    err_clipped = (clipped_values - returns).pow(2)
    loss = 0.5 * masked_mean(torch.maximum(err, err_clipped), mask)
    with torch.no_grad():
        frac = masked_mean((err_clipped > err).float(), mask)
    return loss, {"value_clip_fraction": frac}


def pairwise_reward_loss(chosen: Tensor, rejected: Tensor, *, margin: float | Tensor = 0.0) -> Tensor:
    """Bradley-Terry loss of a reward model: ``mean(-log sigmoid(r_c - r_r - margin))``."""
    return -F.logsigmoid(chosen - rejected - margin).mean()


def dpo_loss(
    policy_chosen: Tensor,
    policy_rejected: Tensor,
    ref_chosen: Tensor,
    ref_rejected: Tensor,
    *,
    beta: float,
) -> tuple[Tensor, Tensor, Tensor]:
    """Sigmoid DPO (Rafailov et al., 2023) from summed sequence log-probs (``[batch]`` each).

    Returns ``(loss, chosen_reward, rejected_reward)``, the implicit rewards being
    ``beta * (log pi - log pi_ref)`` (detached)."""
    chosen = policy_chosen - ref_chosen
    rejected = policy_rejected - ref_rejected
    loss = -F.logsigmoid(beta * (chosen - rejected)).mean()
    return loss, (beta * chosen).detach(), (beta * rejected).detach()

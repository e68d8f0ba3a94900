"""Layer: recipes (rlhf). The formulas of GRPO and its variants, as plain tensor functions (recipes layer).

Critic-free policy optimisation on groups: each prompt gets ``G`` sampled completions
(rows ``[g * G, (g + 1) * G)`` of a batch are group ``g``), each completion one scalar
reward, and the advantage of a completion is its reward against the others of its group.
Conventions as in ``rlhf.ops``: ``[batch, time]`` tensors, ``mask`` 1 on the completion
tokens (EOS included), every token mean a masked mean.

- ``group_advantages``: the advantage estimators, by name (``ADVANTAGE_ESTIMATORS``);
- ``clipped_surrogate``: PPO's clipped ratio objective with separate lower and upper clips
  (DAPO's clip-higher), per token, with the fractions of tokens clipped at each side;
- ``aggregate_loss``: per-token losses to one number, by name (``LOSS_AGGREGATIONS``);
- ``groups_with_signal`` and ``fill_groups``: DAPO's dynamic sampling (drop the groups
  whose rewards are all equal, they carry no gradient; refill from later draws);
- ``cat_padded``: rollouts of different lengths joined into one batch.

The KL estimators (``k1``, ``k2``, ``k3``) are ``rlhf.ops.kl_penalty``.

[Note: which estimator with which aggregation]
DeepSeekMath's GRPO divides by the group's std and averages each sequence over its own
tokens (``grpo`` + ``sequence``); Dr. GRPO (Liu et al., 2025) shows that both terms bias
the update (towards easy or hard groups, and towards long wrong answers) and drops them
(``dr_grpo`` + ``fixed_length``); DAPO (Yu et al., 2025) averages over all the tokens of
the batch (``token``) and clips the ratio higher above 1 than below (``clip_high >
clip_low``) so that unlikely tokens can still gain probability. RLOO (Ahmadian et al.,
2024) uses the mean of the *other* completions as the baseline; REINFORCE++-baseline (Hu,
2025) subtracts the group mean and then whitens over the whole batch. Any estimator runs
with any aggregation.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import Tensor

from zeropp_strategy.rlhf.ops import masked_mean

__all__ = [
    "ADVANTAGE_ESTIMATORS",
    "LOSS_AGGREGATIONS",
    "aggregate_loss",
    "cat_padded",
    "clipped_surrogate",
    "fill_groups",
    "group_advantages",
    "groups_with_signal",
]

ADVANTAGE_ESTIMATORS = ("grpo", "dr_grpo", "rloo", "reinforce_pp")
LOSS_AGGREGATIONS = ("sequence", "token", "fixed_length")


def _groups(rewards: Tensor, group_size: int) -> Tensor:
    """``rewards`` ``[n_groups * G]`` as ``[n_groups, G]``, refusing a partial group."""
    if group_size < 1 or rewards.dim() != 1 or rewards.numel() % group_size:
        raise ValueError(f"rewards of shape {tuple(rewards.shape)} do not split into groups of "
                         f"group_size={group_size}. Fix: pass one reward per completion, G per prompt, "
                         "the completions of each prompt next to each other.")
    return rewards.float().view(-1, group_size)


def _scaled(centred: Tensor, std: Tensor, eps: float) -> Tensor:
    """``centred / (std + eps)``, and 0 where ``std`` is 0 (equal rewards: no signal, not NaN)."""
    return torch.where(std > 0, centred / (std + eps), torch.zeros_like(centred))


def group_advantages(rewards: Tensor, group_size: int, estimator: str = "grpo", *, eps: float = 1e-4) -> Tensor:
    """One advantage per completion (``[n_groups * G]``) from its reward, by ``estimator``:

    - ``grpo``: ``(r - mean_g) / (std_g + eps)``, ``std_g`` the group's unbiased std;
    - ``dr_grpo``: ``r - mean_g`` (no division by the std);
    - ``rloo``: ``r_i - mean_{j != i} r_j = G / (G - 1) * (r_i - mean_g)`` (needs ``G >= 2``);
    - ``reinforce_pp``: ``a = r - mean_g``, then ``(a - mean(a)) / (std(a) + eps)`` over every
      completion passed (pass the whole batch, all ranks', for the batch-whitened baseline).

    A group whose rewards are all equal gets advantage 0 under ``grpo``, ``dr_grpo`` and
    ``rloo`` (whatever ``eps``); under ``reinforce_pp`` only when the whole batch is equal.
    """
    groups = _groups(rewards, group_size)
    centred = groups - groups.mean(dim=1, keepdim=True)
    if estimator == "grpo":
        std = groups.std(dim=1, keepdim=True) if group_size > 1 else torch.zeros_like(centred)
        return _scaled(centred, std, eps).flatten()
    if estimator == "dr_grpo":
        return centred.flatten()
    if estimator == "rloo":
        if group_size < 2:
            raise ValueError(f"group_advantages(estimator='rloo', group_size={group_size}): leave-one-out needs two "
                             "completions per prompt or more. Fix: num_generations >= 2.")
        return (centred * group_size / (group_size - 1)).flatten()
    if estimator == "reinforce_pp":
        flat = centred.flatten()
        std = flat.std() if flat.numel() > 1 else flat.new_zeros(())
        return _scaled(flat - flat.mean(), std, eps)
    raise ValueError(f"group_advantages(estimator={estimator!r}) is unknown. Fix: use one of "
                     f"{', '.join(ADVANTAGE_ESTIMATORS)}.")


def clipped_surrogate(
    logp: Tensor, old_logp: Tensor, advantages: Tensor, mask: Tensor, *, clip_low: float, clip_high: float
) -> tuple[Tensor, dict[str, Tensor]]:
    """Per-token loss ``-min(ratio * A, clip(ratio, 1 - clip_low, 1 + clip_high) * A)``,
    ``ratio = exp(logp - old_logp)``, ``A`` one advantage per row (``[batch]``) or per token.

    Returns the loss ``[batch, time]`` (0 outside ``mask``) and, over the masked tokens, the
    fraction clipped below (``ratio < 1 - clip_low`` with ``A < 0``: the token's probability
    may fall no further) and above (``ratio > 1 + clip_high`` with ``A > 0``): exactly the
    tokens whose gradient the clip zeroes.
    """
    if advantages.dim() == 1:
        advantages = advantages.unsqueeze(1)
    advantages = advantages.to(logp.dtype)
    ratio = (logp - old_logp).exp()
    unclipped = ratio * advantages
    clipped = ratio.clamp(1.0 - clip_low, 1.0 + clip_high) * advantages
    loss = -torch.minimum(unclipped, clipped) * mask.to(logp.dtype)
    with torch.no_grad():
        low = (ratio < 1.0 - clip_low) & (advantages < 0)
        high = (ratio > 1.0 + clip_high) & (advantages > 0)
        stats = {"clip_low_fraction": masked_mean(low.float(), mask),
                 "clip_high_fraction": masked_mean(high.float(), mask)}
    return loss, stats


def aggregate_loss(per_token: Tensor, mask: Tensor, how: str = "token", *, max_tokens: int | None = None) -> Tensor:
    """One loss from per-token losses ``[batch, time]``, by ``how``:

    - ``sequence``: each row's mean over its own tokens, then the mean over rows (GRPO);
    - ``token``: the sum over every masked token of the batch / their count (DAPO);
    - ``fixed_length``: the sum over every masked token / (rows * ``max_tokens``), a
      constant (Dr. GRPO: ``max_tokens`` is the completion cap, ``max_new_tokens``).
    """
    mask_f = mask.to(per_token.dtype)
    if how == "sequence":
        return masked_mean(per_token, mask_f, dim=1).mean()
    if how == "token":
        return masked_mean(per_token, mask_f)
    if how == "fixed_length":
        if max_tokens is None or max_tokens < 1:
            raise ValueError(f"aggregate_loss(how='fixed_length', max_tokens={max_tokens!r}): the constant divisor is "
                             "missing. Fix: pass the completion cap (max_new_tokens).")
        return (per_token * mask_f).sum() / (per_token.shape[0] * max_tokens)
    raise ValueError(f"aggregate_loss(how={how!r}) is unknown. Fix: use one of {', '.join(LOSS_AGGREGATIONS)}.")


def groups_with_signal(rewards: Tensor, group_size: int, *, tol: float = 0.0) -> Tensor:
    """Per group (``[n_groups]`` bool): do its rewards differ (max - min > ``tol``)? A group
    of equal rewards has zero advantage under every group-relative estimator: it adds no
    policy gradient, only dilutes the batch."""
    groups = _groups(rewards, group_size)
    return (groups.max(dim=1).values - groups.min(dim=1).values) > tol


def fill_groups(signal: Tensor, target: int) -> tuple[Tensor, int]:
    """Dynamic sampling's choice among the groups drawn so far (``signal``: one bool per
    group, in draw order): the indices of ``target`` groups, the ones with signal first, in
    draw order, then, when there are too few, groups without signal in draw order, so the
    batch always has ``target`` groups. Returns ``(indices [target], groups with signal
    among them)``."""
    if signal.numel() < target:
        raise ValueError(f"fill_groups: {signal.numel()} groups drawn, {target} needed. Fix: draw at least one "
                         "batch before filling.")
    order = torch.arange(signal.numel(), device=signal.device)
    kept, dropped = order[signal.bool()], order[~signal.bool()]
    chosen = torch.cat([kept, dropped])[:target]
    return chosen, min(int(kept.numel()), target)


def cat_padded(tensors: Sequence[Tensor], *, value: int | float, left: bool) -> Tensor:
    """``[rows_i, time_i]`` tensors joined along rows, each padded with ``value`` to the
    longest time, on the left (prompts) or on the right (completions)."""
    width = max(t.shape[1] for t in tensors)
    out = []
    for t in tensors:
        pad = t.new_full((t.shape[0], width - t.shape[1]), value)
        out.append(torch.cat([pad, t] if left else [t, pad], dim=1))
    return torch.cat(out, dim=0)

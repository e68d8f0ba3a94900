"""The GRPO formulas (zeropp_strategy.rlhf.grpo_ops) and the reward-function helpers
(zeropp_strategy.rlhf.rewards) against hand-computed cases. Fast, one process."""

from __future__ import annotations

import math

import pytest
import torch

from zeropp_strategy.rlhf import grpo_ops
from zeropp_strategy.rlhf.rewards import addition_reward, call_reward_func, import_path, resolve_reward_funcs

# Two groups of 4: the first has signal (mean 0.5, unbiased std sqrt(1/3)), the second none.
REWARDS = torch.tensor([1.0, 0.0, 0.0, 1.0, 2.0, 2.0, 2.0, 2.0])


def test_grpo_divides_by_the_group_std():
    adv = grpo_ops.group_advantages(REWARDS, 4, "grpo")
    a = 0.5 / (math.sqrt(1 / 3) + 1e-4)
    torch.testing.assert_close(adv, torch.tensor([a, -a, -a, a, 0.0, 0.0, 0.0, 0.0]))
    # eps=0 gives the plain z-score; a zero-variance group still gives 0, not NaN
    adv0 = grpo_ops.group_advantages(REWARDS, 4, "grpo", eps=0.0)
    assert adv0[0].item() == pytest.approx(math.sqrt(3) / 2) and adv0[4:].tolist() == [0.0] * 4


def test_dr_grpo_only_centres():
    adv = grpo_ops.group_advantages(REWARDS, 4, "dr_grpo")
    torch.testing.assert_close(adv, torch.tensor([0.5, -0.5, -0.5, 0.5, 0.0, 0.0, 0.0, 0.0]))
    # no division: scaling the rewards scales the advantages (the std would cancel it)
    torch.testing.assert_close(grpo_ops.group_advantages(3 * REWARDS, 4, "dr_grpo"), 3 * adv)


def test_rloo_is_the_leave_one_out_baseline():
    adv = grpo_ops.group_advantages(torch.tensor([3.0, 0.0, 0.0, 1.0, 2.0, 6.0]), 3, "rloo")
    # 3 - mean(0, 0) = 3; 0 - mean(3, 0) = -1.5; ... 1 - mean(2, 6) = -3; 2 - 3.5; 6 - 1.5
    torch.testing.assert_close(adv, torch.tensor([3.0, -1.5, -1.5, -3.0, -1.5, 4.5]))
    with pytest.raises(ValueError, match="group_size=1.*Fix: num_generations >= 2"):
        grpo_ops.group_advantages(torch.tensor([1.0, 2.0]), 1, "rloo")


def test_reinforce_pp_whitens_the_centred_rewards_over_the_batch():
    # centred: [0.5, -0.5, 0, 0]; batch mean 0, unbiased std sqrt(0.5 / 3)
    adv = grpo_ops.group_advantages(torch.tensor([1.0, 0.0, 3.0, 3.0]), 2, "reinforce_pp", eps=0.0)
    a = 0.5 / math.sqrt(0.5 / 3)
    torch.testing.assert_close(adv, torch.tensor([a, -a, 0.0, 0.0]))
    # a zero-signal group next to groups with a shifted mean: whitening moves it off 0
    adv = grpo_ops.group_advantages(torch.tensor([1.0, 0.0, 5.0, 5.0, 4.0, 2.0]), 2, "reinforce_pp", eps=0.0)
    assert adv.sum().item() == pytest.approx(0.0, abs=1e-6) and adv.std().item() == pytest.approx(1.0)


def test_estimator_errors_name_the_fix():
    with pytest.raises(ValueError, match=r"estimator='ppo'.*Fix: use one of grpo, dr_grpo, rloo, reinforce_pp"):
        grpo_ops.group_advantages(REWARDS, 4, "ppo")
    with pytest.raises(ValueError, match=r"shape \(8,\).*group_size=3.*Fix"):
        grpo_ops.group_advantages(REWARDS, 3, "grpo")


def test_aggregations_by_hand():
    per_token = torch.tensor([[1.0, 2.0, 3.0], [4.0, 9.0, 9.0]])
    mask = torch.tensor([[1, 1, 1], [1, 0, 0]])
    # sequence: mean(mean(1, 2, 3), mean(4)) = (2 + 4) / 2; token: (1 + 2 + 3 + 4) / 4;
    # fixed_length: (1 + 2 + 3 + 4) / (2 rows * 5)
    assert grpo_ops.aggregate_loss(per_token, mask, "sequence").item() == pytest.approx(3.0)
    assert grpo_ops.aggregate_loss(per_token, mask, "token").item() == pytest.approx(2.5)
    assert grpo_ops.aggregate_loss(per_token, mask, "fixed_length", max_tokens=5).item() == pytest.approx(1.0)
    with pytest.raises(ValueError, match="max_tokens=None.*Fix: pass the completion cap"):
        grpo_ops.aggregate_loss(per_token, mask, "fixed_length")
    with pytest.raises(ValueError, match=r"how='mean'.*Fix: use one of sequence, token, fixed_length"):
        grpo_ops.aggregate_loss(per_token, mask, "mean")


def test_clip_higher_by_hand():
    ratios = torch.tensor([[1.5, 1.25, 0.5, 1.5]])
    logp, old = ratios.log(), torch.zeros(1, 4)
    adv = torch.tensor([[1.0, 1.0, -1.0, -1.0]])
    mask = torch.ones(1, 4)
    loss, stats = grpo_ops.clipped_surrogate(logp, old, adv, mask, clip_low=0.2, clip_high=0.28)
    # A>0: min(1.5, 1.28) = 1.28 (clipped high); min(1.25, 1.28) = 1.25 (inside clip-higher,
    # symmetric 0.2 would have clipped it to 1.2). A<0: min(-0.5, -0.8) = -0.8 (clipped low);
    # min(-1.5, -1.28) = -1.5 (the pessimistic side, not clipped).
    torch.testing.assert_close(loss, torch.tensor([[-1.28, -1.25, 0.8, 1.5]]))
    assert stats["clip_high_fraction"].item() == 0.25 and stats["clip_low_fraction"].item() == 0.25
    symmetric, _ = grpo_ops.clipped_surrogate(logp, old, adv, mask, clip_low=0.2, clip_high=0.2)
    assert symmetric[0, 1].item() == pytest.approx(-1.2)
    # one advantage per row broadcasts over its tokens; masked tokens give 0
    loss, _ = grpo_ops.clipped_surrogate(logp, old, torch.tensor([2.0]), torch.tensor([[1, 1, 0, 0]]),
                                         clip_low=0.2, clip_high=0.28)
    torch.testing.assert_close(loss, torch.tensor([[-2.56, -2.5, 0.0, 0.0]]))


def test_clipped_gradient_is_zero_where_the_clip_binds():
    ratios = torch.tensor([[1.5, 1.1, 0.5]])
    logp = ratios.log().requires_grad_()
    loss, _ = grpo_ops.clipped_surrogate(logp, torch.zeros(1, 3), torch.tensor([[1.0, 1.0, -1.0]]), torch.ones(1, 3),
                                         clip_low=0.2, clip_high=0.28)
    loss.sum().backward()
    # d(-ratio * A)/d logp = -ratio * A inside the clip, 0 where it binds
    torch.testing.assert_close(logp.grad, torch.tensor([[0.0, -1.1, 0.0]]))


def test_dynamic_sampling_filter_and_refill():
    signal = grpo_ops.groups_with_signal(torch.tensor([1.0, 1.0, 0.0, 1.0, 2.0, 2.0, 0.0, 0.5]), 2)
    assert signal.tolist() == [False, True, False, True]
    # enough groups with signal: the first ones, in draw order
    drawn = torch.tensor([False, True, False, True, True])
    idx, filled = grpo_ops.fill_groups(drawn, 2)
    assert idx.tolist() == [1, 3] and filled == 2
    # too few after every draw: the batch is completed with dropped groups, in draw order
    idx, filled = grpo_ops.fill_groups(drawn, 4)
    assert idx.tolist() == [1, 3, 4, 0] and filled == 3
    idx, filled = grpo_ops.fill_groups(torch.tensor([False, False]), 2)
    assert idx.tolist() == [0, 1] and filled == 0
    with pytest.raises(ValueError, match="1 groups drawn, 2 needed"):
        grpo_ops.fill_groups(torch.tensor([True]), 2)
    # a tolerance treats nearly equal rewards as equal
    assert grpo_ops.groups_with_signal(torch.tensor([1.0, 1.0 + 1e-9]), 2, tol=1e-6).tolist() == [False]


def test_cat_padded_left_and_right():
    a, b = torch.tensor([[1, 2]]), torch.tensor([[3, 4, 5], [6, 7, 8]])
    assert grpo_ops.cat_padded([a, b], value=0, left=True).tolist() == [[0, 1, 2], [3, 4, 5], [6, 7, 8]]
    assert grpo_ops.cat_padded([a, b], value=9, left=False).tolist() == [[1, 2, 9], [3, 4, 5], [6, 7, 8]]


# -- reward functions -------------------------------------------------------------------------


def _length(prompts, completions, **columns):
    return [float(len(c)) for c in completions]


def _answer_column(prompts, completions, answer, **columns):  # TRL style: a dataset column by name
    return [1.0 if c == a else None for c, a in zip(completions, answer)]


def test_addition_reward_is_the_task_check():
    assert addition_reward(prompts=["3+4=", "3+4=", "10+5="], completions=["7", " 7 ", "16"]) == [1.0, 1.0, 0.0]


def test_reward_funcs_resolve_by_import_path_and_get_unique_names():
    funcs = resolve_reward_funcs(["zeropp_strategy.rlhf.rewards.addition_reward", _length,
                                  "zeropp_strategy.rlhf.rewards:addition_reward"])
    assert [n for n, _ in funcs] == ["addition_reward", "_length", "addition_reward_2"]
    assert funcs[0][1] is addition_reward and import_path(addition_reward) == funcs[0][1].__module__ + ".addition_reward"
    assert resolve_reward_funcs(None) == [] and len(resolve_reward_funcs(_length)) == 1
    with pytest.raises(ValueError, match="'nope' is not an import path.*Fix"):
        resolve_reward_funcs("nope")
    with pytest.raises(ValueError, match="cannot be imported.*Fix"):
        resolve_reward_funcs("zeropp_strategy.rlhf.rewards.missing")
    with pytest.raises(ValueError, match="is a tuple, not a function"):
        resolve_reward_funcs("zeropp_strategy.rlhf.grpo_ops.LOSS_AGGREGATIONS")


def test_call_reward_func_passes_columns_and_checks_the_result():
    out = call_reward_func("answer", _answer_column, ["p", "p"], ["7", "8"], {"answer": ["7", "7"]})
    assert out[0] == 1.0 and math.isnan(out[1])  # None: the function does not apply
    with pytest.raises(ValueError, match="returned 1 values for 2 completions.*Fix"):
        call_reward_func("short", lambda prompts, completions: [1.0], ["p", "p"], ["a", "b"], {})
    with pytest.raises(ValueError, match="returned 'x'.*Fix"):
        call_reward_func("text", lambda prompts, completions: ["x", "y"], ["p", "p"], ["a", "b"], {})

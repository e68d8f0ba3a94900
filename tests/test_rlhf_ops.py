"""The RLHF formulas (zeropp_strategy.rlhf.ops) against hand-computed cases."""

from __future__ import annotations

import math

import pytest
import torch

from zeropp_strategy.rlhf import ops


def test_gae_matches_a_hand_computed_case_with_left_and_right_padding():
    gamma, lam = 0.9, 0.8
    # Response tokens at positions 1..3 (position 0 is prompt/padding).
    rewards = torch.tensor([[9.0, 1.0, 0.0, 2.0]])
    values = torch.tensor([[7.0, 0.5, 0.2, 0.1]])
    mask = torch.tensor([[0, 1, 1, 1]])
    adv, ret = ops.gae(rewards, values, mask, gamma=gamma, lam=lam)
    # By hand: d3 = 2 - 0.1 = 1.9; d2 = 0 + 0.9*0.1 - 0.2 = -0.11; d1 = 1 + 0.9*0.2 - 0.5 = 0.68
    # A3 = 1.9; A2 = -0.11 + 0.72*1.9 = 1.258; A1 = 0.68 + 0.72*1.258 = 1.58576
    expected = torch.tensor([[0.0, 1.58576, 1.258, 1.9]])
    torch.testing.assert_close(adv, expected)
    torch.testing.assert_close(ret, torch.tensor([[0.0, 2.08576, 1.458, 2.0]]))
    # The same response right-padded gives the same numbers, shifted.
    adv_r, _ = ops.gae(torch.roll(rewards, -1, 1), torch.roll(values, -1, 1), torch.tensor([[1, 1, 1, 0]]),
                       gamma=gamma, lam=lam)
    torch.testing.assert_close(adv_r, torch.roll(expected, -1, 1))


def test_gae_lambda_one_gamma_one_is_reward_to_go_minus_value():
    rewards = torch.tensor([[0.5, -1.0, 3.0]])
    values = torch.tensor([[1.0, 2.0, 0.5]])
    adv, _ = ops.gae(rewards, values, torch.ones(1, 3), gamma=1.0, lam=1.0)
    torch.testing.assert_close(adv, torch.tensor([[2.5 - 1.0, 2.0 - 2.0, 3.0 - 0.5]]))


@pytest.mark.parametrize("padding", ["left", "right"])
def test_reward_lands_on_the_last_response_token(padding):
    mask = torch.tensor([[0, 0, 1, 1], [0, 1, 1, 1]]) if padding == "left" else torch.tensor([[1, 1, 0, 0],
                                                                                            [1, 1, 1, 0]])
    kl = torch.full((2, 4), 0.5)
    r = ops.token_rewards(torch.tensor([4.0, -9.0]), kl, mask, kl_coef=0.1, clip=5.0)
    last = [3, 3] if padding == "left" else [1, 2]
    for row, pos in enumerate(last):
        score = [4.0, -5.0][row]  # -9 clipped to -5
        assert r[row, pos].item() == pytest.approx(score - 0.05)
        others = [t for t in range(4) if t != pos]
        for t in others:
            assert r[row, t].item() == pytest.approx(-0.05 if mask[row, t] else 0.0)


def test_last_index_and_empty_rows():
    assert ops.last_index(torch.tensor([[1, 1, 0], [0, 0, 1], [0, 0, 0]])).tolist() == [1, 2, -1]


def test_kl_estimators_are_unbiased_and_k3_nonnegative():
    torch.manual_seed(0)
    p = torch.softmax(torch.tensor([1.0, 0.2, -0.5, 2.0]), 0)
    q = torch.softmax(torch.tensor([0.3, 0.9, -0.1, 1.0]), 0)
    true_kl = (p * (p / q).log()).sum().item()
    tokens = torch.multinomial(p, 400_000, replacement=True)
    logp, ref = p.log()[tokens], q.log()[tokens]
    k1, k3 = ops.kl_penalty(logp, ref, "k1"), ops.kl_penalty(logp, ref, "k3")
    assert k1.mean().item() == pytest.approx(true_kl, abs=3e-3)
    assert k3.mean().item() == pytest.approx(true_kl, abs=3e-3)
    assert (k3 >= 0).all()
    assert ops.kl_penalty(torch.tensor(0.3), torch.tensor(0.1), "k2").item() == pytest.approx(0.02)
    with pytest.raises(ValueError, match="kind='k4'.*Fix"):
        ops.kl_penalty(logp, ref, "k4")


def test_clipped_policy_loss_by_hand():
    old = torch.zeros(1, 2)
    logp = torch.full((1, 2), math.log(1.5))
    mask = torch.ones(1, 2)
    loss, stats = ops.policy_loss(logp, old, torch.ones(1, 2), mask, clip_eps=0.2)
    assert loss.item() == pytest.approx(-1.2) and stats["clip_fraction"].item() == 1.0
    loss, stats = ops.policy_loss(logp, old, -torch.ones(1, 2), mask, clip_eps=0.2)
    assert loss.item() == pytest.approx(1.5) and stats["clip_fraction"].item() == 0.0
    # Masked tokens do not count, whatever their values.
    loss, _ = ops.policy_loss(logp, old, torch.tensor([[1.0, 100.0]]), torch.tensor([[1, 0]]), clip_eps=0.2)
    assert loss.item() == pytest.approx(-1.2)


def test_clipped_value_loss_by_hand():
    one = torch.ones(1, 1)
    loss, stats = ops.value_loss(2 * one, one, 0 * one, one, clip=0.5)  # max(4, 1.5^2) / 2
    assert loss.item() == pytest.approx(2.0) and stats["value_clip_fraction"].item() == 0.0
    loss, stats = ops.value_loss(0.2 * one, one, 3 * one, one, clip=0.5)  # max(7.84, 2.5^2=6.25)/2
    assert loss.item() == pytest.approx(3.92)
    loss, stats = ops.value_loss(2.5 * one, one, 3 * one, one, clip=0.5)  # max(0.25, 1.5^2)/2
    assert loss.item() == pytest.approx(1.125) and stats["value_clip_fraction"].item() == 1.0
    loss, _ = ops.value_loss(2 * one, one, 0 * one, one, clip=None)
    assert loss.item() == pytest.approx(2.0)


def test_pairwise_and_dpo_losses():
    assert ops.pairwise_reward_loss(torch.tensor([1.0]), torch.tensor([1.0])).item() == pytest.approx(math.log(2))
    assert ops.pairwise_reward_loss(torch.tensor([2.0]), torch.tensor([1.0]), margin=1.0).item() == pytest.approx(
        math.log(2))
    pc = torch.tensor([-3.0], requires_grad=True)
    pr = torch.tensor([-2.0], requires_grad=True)
    loss, rc, rr = ops.dpo_loss(pc, pr, torch.tensor([-4.0]), torch.tensor([-1.0]), beta=0.1)
    # chosen margin 1, rejected margin -1: -log sigmoid(0.1 * 2)
    assert loss.item() == pytest.approx(-math.log(1 / (1 + math.exp(-0.2))))
    assert rc.item() == pytest.approx(0.1) and rr.item() == pytest.approx(-0.1)
    loss.backward()
    assert pc.grad.item() < 0 < pr.grad.item()  # descent raises chosen, lowers rejected


def test_token_logprobs_use_the_temperature_and_masked_helpers():
    logits = torch.tensor([[[2.0, 0.0, -1.0]]])
    tokens = torch.tensor([[0]])
    for temp in (1.0, 0.7):
        expected = torch.log_softmax(logits / temp, -1)[0, 0, 0]
        torch.testing.assert_close(ops.token_logprobs(logits, tokens, temperature=temp)[0, 0], expected)
    with pytest.raises(ValueError, match="temperature=0.*Fix"):
        ops.token_logprobs(logits, tokens, temperature=0)
    ent = ops.entropy_from_logits(torch.zeros(1, 1, 4))
    assert ent.item() == pytest.approx(math.log(4))
    x = torch.tensor([[1.0, 2.0, 3.0, 100.0]])
    mask = torch.tensor([[1, 1, 1, 0]])
    assert ops.masked_mean(x, mask).item() == pytest.approx(2.0)
    w = ops.masked_whiten(x, mask)
    assert w[0, 3].item() == 0.0
    assert ops.masked_mean(w, mask).item() == pytest.approx(0.0, abs=1e-6)
    assert w[0, :3].std().item() == pytest.approx(1.0, abs=1e-4)

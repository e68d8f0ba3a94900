"""The embedded addition task: deterministic splits of the stated sizes, no repeated pair, a
checker that is right."""

from __future__ import annotations

import pytest

from zeropp_strategy.rlhf.task import AdditionTask


def test_splits_are_deterministic_and_as_specified():
    task = AdditionTask(seed=3)
    again = AdditionTask(seed=3)
    assert task.sft() == again.sft() and task.preferences() == again.preferences()
    assert task.sft() != AdditionTask(seed=4).sft()
    pool = (task.max_operand + 1) ** 2
    assert len(task.sft()) == pool * task.demos_per_prompt
    # Every prompt gets pairs_per_prompt pairs, except "0+0=": no sum is negative, so it has
    # only three distinct wrong answers (1, 2, 10).
    assert len(task.preferences()) == pool * task.pairs_per_prompt - 1
    assert len({r.prompt for r in task.eval_prompts()}) == task.eval_size
    # No preference pair repeats: a held-out pair was never trained on.
    pairs = [(r.prompt, r.chosen, r.rejected) for r in task.preferences()]
    assert len(set(pairs)) == len(pairs)


def test_sft_demonstrations_are_partly_wrong_and_preferences_prefer_the_right_sum():
    task = AdditionTask()
    wrong = sum(task.score(r.prompt, r.response) == 0.0 for r in task.sft()) / len(task.sft())
    assert wrong == pytest.approx(task.sft_error_rate, abs=0.05)
    for r in task.preferences():
        assert task.score(r.prompt, r.chosen) == 1.0 and task.score(r.prompt, r.rejected) == 0.0
        assert int(r.rejected) >= 0


def test_checker():
    assert AdditionTask.score("12+7=", "19") == 1.0
    assert AdditionTask.score("12+7=", " 19 ") == 1.0
    assert AdditionTask.score("12+7=", "18") == 0.0 and AdditionTask.score("12+7=", "19x") == 0.0
    assert AdditionTask.answer("hello") is None and AdditionTask.score("hello", "") == 0.0
    with pytest.raises(ValueError, match="eval_size=200.*max_operand=3.*Fix"):
        AdditionTask(max_operand=3)

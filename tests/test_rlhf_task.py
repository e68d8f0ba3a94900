"""The embedded addition task: deterministic, disjoint splits, a checker that is right."""

from __future__ import annotations

import pytest

from zeropp_strategy.rlhf.task import AdditionTask


def test_splits_are_deterministic_disjoint_and_as_specified():
    task = AdditionTask(seed=3)
    again = AdditionTask(seed=3)
    assert task.sft() == again.sft() and task.preferences() == again.preferences()
    assert task.sft() != AdditionTask(seed=4).sft()
    prompts = [{r.prompt for r in split} for split in (task.sft(), task.preferences(), task.eval_prompts())]
    assert [len(p) for p in prompts] == [task.sft_size, task.pref_size, task.eval_size]
    assert not (prompts[0] & prompts[1] or prompts[0] & prompts[2] or prompts[1] & prompts[2])


def test_sft_demonstrations_are_partly_wrong_and_preferences_prefer_the_right_sum():
    task = AdditionTask()
    wrong = sum(task.score(r.prompt, r.response) == 0.0 for r in task.sft()) / task.sft_size
    assert wrong == pytest.approx(task.sft_error_rate, abs=0.05)
    for r in task.preferences():
        assert task.score(r.prompt, r.chosen) == 1.0 and task.score(r.prompt, r.rejected) == 0.0
        assert int(r.rejected) >= 0


def test_checker():
    assert AdditionTask.score("12+7=", "19") == 1.0
    assert AdditionTask.score("12+7=", " 19 ") == 1.0
    assert AdditionTask.score("12+7=", "18") == 0.0 and AdditionTask.score("12+7=", "19x") == 0.0
    assert AdditionTask.answer("hello") is None and AdditionTask.score("hello", "") == 0.0
    with pytest.raises(ValueError, match="max_operand=3.*Fix"):
        AdditionTask(max_operand=3)

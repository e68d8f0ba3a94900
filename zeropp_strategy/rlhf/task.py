"""Layer: recipes (rlhf). The embedded task: small additions whose answers can be checked, generated
deterministically (no files, no downloads).

A prompt is ``"a+b="`` with ``a, b`` in ``0..max_operand``; the correct response is the
decimal sum. Every split draws from the same pool of prompts (225 by default):

- **SFT demonstrations**: ``demos_per_prompt`` responses per prompt, each right with
  probability ``1 - sft_error_rate`` and otherwise a plausible wrong sum (off by 1, 2 or
  10), so that the SFT policy learns the demonstrators' mistakes too: sampled at
  temperature 1 it answers about ``1 - sft_error_rate`` of the prompts right;
- **preference pairs**: ``pairs_per_prompt`` per prompt (``0+0=`` has only three distinct
  wrong sums, so it gets at most three), the correct sum as ``chosen`` and
  a different wrong sum as ``rejected`` in each (no pair repeats, so a held-out pair is
  never one the reward model trained on);
- **evaluation prompts**: ``eval_size`` prompts of the pool.

The prompts are shared on purpose: the task measures learning from feedback (does PPO
remove the mistakes the demonstrations taught, guided by a reward model that learned
which answers are preferred), not whether a 1M-parameter model generalises arithmetic
to unseen operands, which it does not in a few minutes of CPU training.

``score(prompt, response)`` is the programmatic check: 1.0 for the right sum, 0.0 for any
other string; the pipeline reports it as task accuracy.
"""

from __future__ import annotations

import random
from dataclasses import dataclass

__all__ = ["AdditionTask", "Record"]


@dataclass(frozen=True)
class Record:
    prompt: str
    response: str = ""
    chosen: str = ""
    rejected: str = ""


@dataclass(frozen=True)
class AdditionTask:
    """Deterministic addition problems; every split is a pure function of the fields."""

    seed: int = 0
    max_operand: int = 14
    demos_per_prompt: int = 8
    pairs_per_prompt: int = 4
    eval_size: int = 200
    sft_error_rate: float = 0.3

    def __post_init__(self) -> None:
        pool = (self.max_operand + 1) ** 2
        if self.max_operand < 1:
            raise ValueError(f"AdditionTask.max_operand={self.max_operand} is invalid. Fix: use 1 or more.")
        if not 1 <= self.eval_size <= pool:
            raise ValueError(
                f"AdditionTask.eval_size={self.eval_size} is invalid: operands up to max_operand={self.max_operand} "
                f"give {pool} prompts. Fix: use 1..{pool}, or raise max_operand."
            )
        if not 1 <= self.pairs_per_prompt <= len(_DELTAS):
            raise ValueError(f"AdditionTask.pairs_per_prompt={self.pairs_per_prompt} is invalid. Fix: use "
                             f"1..{len(_DELTAS)} (one per distinct wrong answer).")
        if self.demos_per_prompt < 1:
            raise ValueError(f"AdditionTask.demos_per_prompt={self.demos_per_prompt} is invalid. Fix: use 1 or more.")
        if not 0.0 <= self.sft_error_rate < 1.0:
            raise ValueError(f"AdditionTask.sft_error_rate={self.sft_error_rate} is invalid: it must be in [0, 1).")

    def _pairs(self) -> list[tuple[int, int]]:
        pairs = [(a, b) for a in range(self.max_operand + 1) for b in range(self.max_operand + 1)]
        random.Random(self.seed).shuffle(pairs)
        return pairs

    @staticmethod
    def prompt(a: int, b: int) -> str:
        return f"{a}+{b}="

    @staticmethod
    def answer(prompt: str) -> str | None:
        """The correct response for a prompt of this task, or None if it is not one."""
        body = prompt.strip()
        if not body.endswith("=") or "+" not in body:
            return None
        left, _, right = body[:-1].partition("+")
        if not (left.isdigit() and right.isdigit()):
            return None
        return str(int(left) + int(right))

    @classmethod
    def score(cls, prompt: str, response: str) -> float:
        """1.0 when ``response`` (surrounding whitespace ignored) is the right sum, else 0.0."""
        return 1.0 if cls.answer(prompt) == response.strip() else 0.0

    @staticmethod
    def _wrong(a: int, b: int, delta: int) -> str:
        wrong = a + b + delta
        return str(wrong if wrong >= 0 else a + b + abs(delta))

    def sft(self) -> list[Record]:
        rng = random.Random(self.seed + 1)
        out = []
        for a, b in self._pairs():
            for _ in range(self.demos_per_prompt):
                right = rng.random() >= self.sft_error_rate
                response = str(a + b) if right else self._wrong(a, b, rng.choice(_DELTAS))
                out.append(Record(self.prompt(a, b), response=response))
        rng.shuffle(out)
        return out

    def preferences(self) -> list[Record]:
        rng = random.Random(self.seed + 2)
        out = []
        for a, b in self._pairs():
            wrongs: list[str] = []
            for delta in rng.sample(_DELTAS, len(_DELTAS)):
                w = self._wrong(a, b, delta)
                if w not in wrongs:
                    wrongs.append(w)
            out.extend(Record(self.prompt(a, b), chosen=str(a + b), rejected=w)
                       for w in wrongs[: self.pairs_per_prompt])
        rng.shuffle(out)
        return out

    def eval_prompts(self) -> list[Record]:
        return [Record(self.prompt(a, b)) for a, b in self._pairs()[: self.eval_size]]


_DELTAS = [-10, -2, -1, 1, 2, 10]

"""The embedded task: small additions whose answers can be checked, generated
deterministically (no files, no downloads).

A prompt is ``"a+b="`` with ``a, b`` in ``0..max_operand``; the correct response is the
decimal sum. Three datasets come from one seed, over disjoint prompt sets:

- **SFT demonstrations**: the prompt with a response that is right with probability
  ``1 - sft_error_rate`` and otherwise a plausible wrong sum (off by a small amount), so
  the SFT policy learns an imperfect habit that preference learning can correct;
- **preference pairs**: the correct response as ``chosen``, a wrong one as ``rejected``;
- **evaluation prompts** (held out from both), for task accuracy and PPO's reward.

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
    max_operand: int = 59
    sft_size: int = 1200
    pref_size: int = 1200
    eval_size: int = 200
    sft_error_rate: float = 0.3

    def __post_init__(self) -> None:
        total = (self.max_operand + 1) ** 2
        need = self.sft_size + self.pref_size + self.eval_size
        if need > total:
            raise ValueError(
                f"AdditionTask needs {need} distinct prompts (sft_size + pref_size + eval_size) but operands up to "
                f"max_operand={self.max_operand} give only {total}. Fix: raise max_operand or shrink the splits."
            )
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
    def _wrong(a: int, b: int, rng: random.Random) -> str:
        delta = rng.choice([-10, -2, -1, 1, 2, 10])
        wrong = a + b + delta
        return str(wrong if wrong >= 0 else a + b + abs(delta))

    def sft(self) -> list[Record]:
        rng = random.Random(self.seed + 1)
        out = []
        for a, b in self._pairs()[: self.sft_size]:
            right = rng.random() >= self.sft_error_rate
            out.append(Record(self.prompt(a, b), response=str(a + b) if right else self._wrong(a, b, rng)))
        return out

    def preferences(self) -> list[Record]:
        rng = random.Random(self.seed + 2)
        start = self.sft_size
        return [Record(self.prompt(a, b), chosen=str(a + b), rejected=self._wrong(a, b, rng))
                for a, b in self._pairs()[start : start + self.pref_size]]

    def eval_prompts(self) -> list[Record]:
        start = self.sft_size + self.pref_size
        return [Record(self.prompt(a, b)) for a, b in self._pairs()[start : start + self.eval_size]]

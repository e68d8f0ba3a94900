"""Layer: recipes (rlhf). Records and collators for SFT, reward modelling, DPO and PPO.

Records are dicts with ``prompt`` and ``response`` (SFT) or ``prompt``, ``chosen`` and
``rejected`` (preferences), from a JSONL file, a ``datasets.load_dataset`` name, or the
embedded addition task (``"embedded:addition"``).

Tokenization rules, each avoiding a known pitfall:

- the prompt and the response are tokenized **separately** and concatenated, so the
  prompt's length in tokens is known exactly; the loss mask comes from that length, never
  from searching the response's token ids in the sequence (a token sequence can tokenize
  differently in context);
- EOS is appended as a token **id** (``tokenizer.eos_token_id``), not as text;
- pad and EOS stay distinct: every mask is built from lengths, so even a tokenizer whose
  pad id equals its EOS id gets the EOS counted as an action and scored;
- training batches are right-padded; PPO prompts are left-padded for generation, and the
  masks travel with the tensors so scoring never assumes a padding side.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor
from torch.utils.data import DistributedSampler

__all__ = ["EvalShard", "PairCollator", "PromptCollator", "SFTCollator", "encode_prompt", "load_records"]

IGNORE = -100


def load_records(source: str, *, split: str = "train", kind: str = "sft") -> list[dict[str, str]]:
    """Records from ``source``: a ``.jsonl`` path, ``embedded:addition`` or a dataset name.

    ``kind`` picks the embedded split: ``sft``, ``preferences`` or ``eval``.
    """
    if source.startswith("embedded:"):
        from zeropp_strategy.rlhf.task import AdditionTask

        if source != "embedded:addition":
            raise ValueError(f"data source {source!r} is unknown. Fix: use 'embedded:addition', a .jsonl file or a "
                             "datasets name.")
        task = AdditionTask()
        records = {"sft": task.sft, "preferences": task.preferences, "eval": task.eval_prompts}
        if kind not in records:
            raise ValueError(f"load_records(kind={kind!r}) is invalid. Fix: use 'sft', 'preferences' or 'eval'.")
        return [{k: v for k, v in vars(r).items() if v or k == "prompt"} for r in records[kind]()]
    path = Path(source)
    if path.suffix == ".jsonl":
        if not path.is_file():
            raise FileNotFoundError(f"data file {source!r} does not exist. Fix: point the recipe's data path at it.")
        out = []
        for n, line in enumerate(path.read_text().splitlines(), 1):
            if line.strip():
                try:
                    out.append(json.loads(line))
                except json.JSONDecodeError as e:
                    raise ValueError(f"{source}:{n} is not valid JSON ({e.msg}). Fix: one JSON object per line.") from None
        return out
    import datasets

    return [dict(r) for r in datasets.load_dataset(source, split=split)]


def encode_prompt(tokenizer: Any, prompt: str) -> list[int]:
    """Token ids of a prompt: through the chat template when the tokenizer has one."""
    if getattr(tokenizer, "chat_template", None):
        # Rendered to text first: with tokenize=True transformers 5 returns a BatchEncoding,
        # whose list() is its keys ('input_ids', 'attention_mask'), not the ids.
        prompt = tokenizer.apply_chat_template([{"role": "user", "content": prompt}], tokenize=False,
                                               add_generation_prompt=True)
    return list(tokenizer(prompt, add_special_tokens=False).input_ids)


def _response_ids(tokenizer: Any, response: str) -> list[int]:
    if tokenizer.eos_token_id is None:
        raise ValueError("the tokenizer has no eos_token_id. Fix: set tokenizer.eos_token (responses end with it).")
    return list(tokenizer(response, add_special_tokens=False).input_ids) + [tokenizer.eos_token_id]


def _pad_id(tokenizer: Any) -> int:
    pad = tokenizer.pad_token_id
    return pad if pad is not None else tokenizer.eos_token_id


def _right_pad(rows: Sequence[list[int]], value: int, length: int) -> Tensor:
    return torch.tensor([r + [value] * (length - len(r)) for r in rows], dtype=torch.long)


class SFTCollator:
    """``{"prompt", "response"}`` records -> ``input_ids``, ``attention_mask``, ``labels``.

    ``labels`` are the input ids with the prompt (unless ``train_on_prompt``) and the
    padding set to -100; the EOS is a label. Sequences longer than ``max_length`` keep the
    prompt's end and the response's start (the prompt is cut from the left).
    """

    def __init__(self, tokenizer: Any, *, max_length: int = 512, train_on_prompt: bool = False,
                 pack: bool = False) -> None:
        self.tokenizer, self.max_length, self.train_on_prompt = tokenizer, max_length, train_on_prompt
        self.pack = pack

    def encode(self, record: dict[str, str]) -> tuple[list[int], list[int]]:
        prompt = encode_prompt(self.tokenizer, record["prompt"])
        response = _response_ids(self.tokenizer, record["response"])[: self.max_length]
        prompt = prompt[max(0, len(prompt) + len(response) - self.max_length):]
        ids = prompt + response
        labels = (ids if self.train_on_prompt else [IGNORE] * len(prompt) + response)[:]
        return ids, labels

    def __call__(self, records: Sequence[dict[str, str]]) -> dict[str, Tensor]:
        encoded = [self.encode(r) for r in records]
        if self.pack:
            return self._packed(encoded)
        length = max(len(ids) for ids, _ in encoded)
        return {
            "input_ids": _right_pad([ids for ids, _ in encoded], _pad_id(self.tokenizer), length),
            "attention_mask": _right_pad([[1] * len(ids) for ids, _ in encoded], 0, length),
            "labels": _right_pad([labels for _, labels in encoded], IGNORE, length),
        }

    def _packed(self, encoded: list[tuple[list[int], list[int]]]) -> dict[str, Tensor]:
        """Examples concatenated in order into rows of at most ``max_length`` tokens, with
        ``position_ids`` restarting at each example; each example keeps its own labels."""
        rows: list[tuple[list[int], list[int], list[int]]] = []
        for ids, labels in encoded:
            if not rows or len(rows[-1][0]) + len(ids) > self.max_length:
                rows.append(([], [], []))
            row_ids, row_labels, row_pos = rows[-1]
            row_ids.extend(ids)
            row_labels.extend(labels)
            row_pos.extend(range(len(ids)))
        length = max(len(r[0]) for r in rows)
        return {
            "input_ids": _right_pad([r[0] for r in rows], _pad_id(self.tokenizer), length),
            "attention_mask": _right_pad([[1] * len(r[0]) for r in rows], 0, length),
            "labels": _right_pad([r[1] for r in rows], IGNORE, length),
            "position_ids": _right_pad([r[2] for r in rows], 0, length),
        }


class PairCollator:
    """Preference records -> chosen and rejected sequences, right-padded, in one batch:
    rows ``[0, B)`` are the chosen, ``[B, 2B)`` the rejected, with ``response_mask``
    marking each response's tokens (its EOS included) for scoring and log-probs."""

    def __init__(self, tokenizer: Any, *, max_length: int = 512) -> None:
        self.tokenizer, self.max_length = tokenizer, max_length

    def __call__(self, records: Sequence[dict[str, str]]) -> dict[str, Tensor]:
        rows, masks = [], []
        for key in ("chosen", "rejected"):
            for r in records:
                prompt = encode_prompt(self.tokenizer, r["prompt"])
                response = _response_ids(self.tokenizer, r[key])[: self.max_length]
                prompt = prompt[max(0, len(prompt) + len(response) - self.max_length):]
                rows.append(prompt + response)
                masks.append([0] * len(prompt) + [1] * len(response))
        length = max(len(r) for r in rows)
        out = {
            "input_ids": _right_pad(rows, _pad_id(self.tokenizer), length),
            "attention_mask": _right_pad([[1] * len(r) for r in rows], 0, length),
            "response_mask": _right_pad(masks, 0, length),
        }
        if all("__index__" in r for r in records):  # the record's position in its split
            out["index"] = torch.tensor([r["__index__"] for r in records], dtype=torch.long)
        return out


class PromptCollator:
    """Prompts -> left-padded ``input_ids`` and ``attention_mask`` for ``generate``, plus
    the prompt strings (for the task checker)."""

    def __init__(self, tokenizer: Any, *, max_length: int = 256) -> None:
        self.tokenizer, self.max_length = tokenizer, max_length

    def __call__(self, records: Sequence[dict[str, str]]) -> dict[str, Any]:
        rows = [encode_prompt(self.tokenizer, r["prompt"])[-self.max_length:] for r in records]
        length = max(len(r) for r in rows)
        pad = _pad_id(self.tokenizer)
        return {
            "input_ids": torch.tensor([[pad] * (length - len(r)) + r for r in rows], dtype=torch.long),
            "attention_mask": torch.tensor([[0] * (length - len(r)) + [1] * len(r) for r in rows], dtype=torch.long),
            "prompts": [r["prompt"] for r in records],
        }


class EvalShard(DistributedSampler):
    """The evaluation records split over the ranks, each record once: rank ``r`` of ``W``
    reads records ``r, r + W, r + 2W, ...`` in order, so the ranks' counts differ by at most
    one. One process (or no process group yet): every record.

    Lightning would put its own ``DistributedSampler`` in the recipes' evaluation loaders,
    which repeats records to give every rank the same count (so a metric counts some twice)
    and warns about it in ``trainer.validate()``. Being a ``DistributedSampler``, this one is
    kept as it is; the zeropp strategy evens the batch counts that differ with padding
    batches whose logged values it discards ([Note: uneven evaluation] in
    engine/uneven.py), so every metric counts each record exactly once."""

    def __init__(self, dataset: Sequence[Any]) -> None:
        ranks, rank = (dist.get_world_size(), dist.get_rank()) if dist.is_available() and dist.is_initialized() else (1, 0)
        super().__init__(dataset, num_replicas=ranks, rank=rank, shuffle=False)
        self.num_samples = len(range(rank, len(dataset), ranks))
        self.total_size = len(dataset)

    def __iter__(self) -> Any:
        return iter(range(self.rank, len(self.dataset), self.num_replicas))

    def __len__(self) -> int:
        return self.num_samples

"""Layer: commands. ``zeropp chat MODEL_DIR``: talk to an exported model folder (CLI command).

    zeropp chat runs/pipeline/actor --prompt "3+4=" --temperature 0   # one answer on stdout
    zeropp chat runs/pipeline/actor                                   # a session: you> ...
    printf '3+4=\\n5+6=\\n' | zeropp chat runs/pipeline/actor         # one answer per input line

``MODEL_DIR`` is any Hugging Face causal-LM folder: the pipeline's ``actor/`` or ``sft/``,
what ``zeropp consolidate CKPT OUT --hf`` writes, a ``save_pretrained`` output. It is read
with ``local_files_only``: nothing is downloaded. The model runs in one process, on the CPU
unless ``--device`` says otherwise, through its own ``generate``.

The conversation (``Chat``) keeps every turn. When the tokenizer has a chat template, the
turns go through it as ``user`` / ``assistant`` messages. Without one (the byte-level
tokenizer of the embedded task), the context is the turns one after the other in the form
the RLHF modules train on: prompt tokens, answer tokens, the EOS id; then the new prompt.
A context that would not leave ``max_new_tokens`` free among the model's positions loses
its oldest turns first (a note on stderr says so).

Reproducible: ``--seed`` seeds torch's generator before the first answer, and ``/reset``
reseeds it, so the same command and the same input lines give the same answers.
``--temperature 0`` decodes greedily.

In a session: ``/reset`` clears the history, ``/exit`` or Ctrl-D (end of input) ends it with
status 0, Ctrl-C ends it at once with status 130 (the shell's convention for an interrupt).
With stdin a terminal, a ``you>`` prompt is shown and input() gets line editing; with
stdin a pipe or a file, no prompt: each non-blank input line's answer is one line on stdout.

A folder that is not a model (missing, a file, a checkpoint directory, a reward model's
backbone, no weights, no tokenizer) is a ``UsageError``: one line and status 2.
"""

from __future__ import annotations

import json
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

from zeropp_strategy.errors import MissingPathError, UsageError
from zeropp_strategy.parsers import chat_parser

__all__ = ["PROMPT", "Chat", "check_model_dir", "load", "main", "max_positions"]

PROMPT = "you> "  # shown before each input line when stdin is a terminal
DEFAULT_MAX_NEW_TOKENS = 256  # or half the model's positions, if fewer
EXIT_INTERRUPTED = 130  # 128 + SIGINT, what shells report for Ctrl-C
_FOLDER_FIX = ("pass a Hugging Face model folder (config.json, weights, tokenizer): the pipeline's "
               "runs/pipeline/actor, or what `zeropp consolidate CKPT OUT --hf` writes")


def check_model_dir(path: str) -> Path:
    """``path`` as a folder that holds a model's ``config.json``, or a ``UsageError`` saying
    what it is instead (nothing heavy is imported for the common mistakes)."""
    folder = Path(path)
    if not folder.exists():
        raise MissingPathError(f"zeropp chat: {path!r}: no such folder", _FOLDER_FIX)
    if not folder.is_dir():
        raise UsageError(f"zeropp chat: {path!r} is a file, not a model folder",
                         f"for a checkpoint file: `zeropp consolidate {path} OUT --hf`, then `zeropp chat OUT`")
    if (folder / "config.json").is_file():
        return folder
    from zeropp_strategy.checkpoint.atomic import META_FILE
    from zeropp_strategy.checkpoint.layout import ACCELERATE_DIR

    if (folder / META_FILE).is_file() or (folder / ACCELERATE_DIR).is_dir():
        raise UsageError(f"zeropp chat: {path!r} is a zeropp checkpoint directory, not a model folder",
                         f"export it first: `zeropp consolidate {path} OUT --hf`, then `zeropp chat OUT`")
    inside = sorted(d.name for d in folder.iterdir() if (d / "config.json").is_file())
    if inside:
        raise UsageError(f"zeropp chat: {path!r} holds model folders ({', '.join(inside)}), not a model",
                         f"name one of them, e.g. `zeropp chat {folder / inside[0]}`")
    raise UsageError(f"zeropp chat: {path!r} has no config.json, so it is not a Hugging Face model folder", _FOLDER_FIX)


def _gist(err: BaseException) -> str:
    """The first sentence of a library's error message: the error line stays one line."""
    text = str(err).strip()
    return text.splitlines()[0].split(". ")[0].rstrip(".") if text else type(err).__name__


def _check_architecture(folder: Path) -> None:
    """Refuse a folder whose ``config.json`` names only models without a language-model
    head (a reward model's or critic's backbone): loaded as a causal LM, its head would be
    random."""
    import transformers

    try:
        config = json.loads((folder / "config.json").read_text("utf-8"))
    except (OSError, ValueError) as err:
        raise UsageError(f"zeropp chat: {folder / 'config.json'} is not valid JSON: {_gist(err)}",
                         "rewrite it with save_pretrained, or re-export the model") from None
    names = (config.get("architectures") or []) if isinstance(config, dict) else []
    known = [getattr(transformers, name, None) for name in names]
    if known and all(cls is not None and not cls.can_generate() for cls in known):
        raise UsageError(f"zeropp chat: {str(folder)!r} holds {', '.join(names)}, a model without a language-model "
                         "head (a reward model's or critic's backbone?), so it cannot write answers",
                         "chat with a causal LM folder: the pipeline's actor/ or sft/, not reward/")


def load(model_dir: str, *, device: str = "cpu", tokenizer: str | None = None) -> tuple[Any, Any]:
    """The causal LM in ``model_dir`` (eval mode, on ``device``) and its tokenizer (from
    ``tokenizer``, default ``model_dir``); local files only. ``UsageError`` for a folder
    that does not hold both."""
    folder = check_model_dir(model_dir)
    tok_dir = folder if tokenizer is None else _tokenizer_dir(tokenizer)
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()  # "Loading weights" bars: not an answer
    try:
        target = torch.device(device)
        if target.type == "cuda" and not torch.cuda.is_available():
            raise RuntimeError("torch sees no CUDA device")
        torch.empty(0, device=target)  # a device torch knows the name of but does not have fails here
    except RuntimeError as err:
        raise UsageError(f"zeropp chat --device {device!r}: {_gist(err)}",
                         "use cpu, or a device this machine has (cuda, cuda:N)") from None
    _check_architecture(folder)
    if tokenizer is None and not any((folder / name).is_file() for name in ("tokenizer_config.json", "tokenizer.json")):
        raise UsageError(f"zeropp chat: {model_dir!r} has no tokenizer (no tokenizer_config.json or tokenizer.json)",
                         "pass --tokenizer DIR (the tokenizer the model was trained with), or save it into the folder "
                         "with tokenizer.save_pretrained")
    try:
        tok = AutoTokenizer.from_pretrained(str(tok_dir), local_files_only=True)
    except (OSError, ValueError) as err:
        raise UsageError(f"zeropp chat: the tokenizer in {str(tok_dir)!r} does not load: {_gist(err)}",
                         "pass --tokenizer DIR with a tokenizer saved by tokenizer.save_pretrained") from None
    try:
        model, info = AutoModelForCausalLM.from_pretrained(str(folder), local_files_only=True,
                                                           output_loading_info=True)
    except (OSError, ValueError) as err:
        raise UsageError(f"zeropp chat: {model_dir!r} does not load as a causal LM: {_gist(err)}",
                         _FOLDER_FIX) from None
    if info.get("missing_keys"):
        missing = sorted(info["missing_keys"])
        raise UsageError(f"zeropp chat: {model_dir!r} lacks weights {missing[:3]} (of {len(missing)} missing), so the "
                         "model would answer with random ones", "export the whole model again")
    return model.to(target).eval(), tok


def _tokenizer_dir(path: str) -> Path:
    folder = Path(path)
    if not folder.is_dir():
        raise MissingPathError(f"zeropp chat --tokenizer {path!r}: no such folder",
                               "pass the folder tokenizer.save_pretrained wrote")
    return folder


def max_positions(config: Any) -> int | None:
    """The longest sequence the model takes, from its config, or None if it does not say."""
    text = config.get_text_config() if hasattr(config, "get_text_config") else config
    for name in ("max_position_embeddings", "n_positions", "max_sequence_length", "seq_length"):
        value = getattr(text, name, None)
        if isinstance(value, int) and value > 0:
            return value
    return None


class Chat:
    """A conversation with ``model``: ``reply(text)`` answers and keeps the turn.

    ``temperature`` 0 decodes greedily; ``top_k`` 0 and ``top_p`` 1 switch those filters
    off. ``max_new_tokens`` None: 256, or half the model's positions if fewer. ``note`` gets
    what the user should know but is not an answer (turns dropped to fit the positions).
    """

    def __init__(self, model: Any, tokenizer: Any, *, temperature: float = 0.7, top_k: int = 50, top_p: float = 0.95,
                 max_new_tokens: int | None = None, seed: int = 0,
                 note: Callable[[str], None] = lambda text: print(text, file=sys.stderr)) -> None:
        self.model, self.tokenizer, self.seed, self.note = model, tokenizer, seed, note
        self.template = bool(getattr(tokenizer, "chat_template", None))
        self.positions = max_positions(model.config)
        if max_new_tokens is None:
            half = self.positions // 2 if self.positions else DEFAULT_MAX_NEW_TOKENS
            max_new_tokens = min(DEFAULT_MAX_NEW_TOKENS, half)
        if self.positions is not None and max_new_tokens >= self.positions:
            raise UsageError(f"zeropp chat --max-new-tokens {max_new_tokens} leaves no room for the prompt: the model "
                             f"takes {self.positions} positions",
                             f"use --max-new-tokens {self.positions // 2} or fewer")
        self.max_new_tokens = max_new_tokens
        self.generation = self._generation_config(temperature, top_k, top_p)
        #: the (user, answer) turns so far, oldest first
        self.history: list[tuple[str, str]] = []
        self.reset()

    def _generation_config(self, temperature: float, top_k: int, top_p: float) -> Any:
        """The model's own generation config (its EOS ids, its penalties) with our sampling."""
        import copy

        config = copy.deepcopy(self.model.generation_config)
        if temperature == 0:
            config.update(do_sample=False, temperature=None, top_k=None, top_p=None)
        else:
            config.update(do_sample=True, temperature=temperature, top_k=top_k, top_p=top_p)
        if config.eos_token_id is None:
            config.eos_token_id = self.tokenizer.eos_token_id
        if config.pad_token_id is None:  # only ever padding after the EOS of a batch of one
            config.pad_token_id = self.tokenizer.pad_token_id
        if config.pad_token_id is None:
            config.pad_token_id = config.eos_token_id
        config.update(max_new_tokens=self.max_new_tokens, max_length=None)
        return config

    def reset(self) -> None:
        """Forget the history and reseed: what follows answers as a fresh session would."""
        import torch

        self.history.clear()
        torch.manual_seed(self.seed)

    def _encode(self, text: str) -> list[int]:
        return list(self.tokenizer(text, add_special_tokens=False).input_ids)

    def _render(self, turns: list[tuple[str, str]], text: str) -> list[int]:
        """Token ids of ``turns`` followed by the new user message ``text``."""
        if self.template:
            messages = []
            for user, answer in turns:
                messages += [{"role": "user", "content": user}, {"role": "assistant", "content": answer}]
            messages.append({"role": "user", "content": text})
            rendered = self.tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
            return self._encode(rendered)  # the template writes any BOS it wants as text
        eos = self.tokenizer.eos_token_id
        ids: list[int] = []
        for user, answer in turns:  # the turns as the RLHF modules train on them: prompt, answer, EOS
            ids += self._encode(user) + self._encode(answer) + ([eos] if eos is not None else [])
        return ids + self._encode(text)

    def context(self, text: str) -> list[int]:
        """The ids the model sees for ``text``: the history, without its oldest turns if the
        whole would leave fewer than ``max_new_tokens`` positions free (they are forgotten)."""
        budget = None if self.positions is None else self.positions - self.max_new_tokens
        ids = self._render(self.history, text)
        dropped = 0
        while budget is not None and len(ids) > budget and dropped < len(self.history):
            dropped += 1
            ids = self._render(self.history[dropped:], text)
        if dropped:
            del self.history[:dropped]
            self.note(f"(the oldest {dropped} turn(s) were forgotten: the model takes {self.positions} positions, "
                      f"{self.max_new_tokens} kept free for the answer)")
        if budget is not None and len(ids) > budget:
            self.note(f"(the message was cut to its last {budget} tokens: the model takes {self.positions} positions, "
                      f"{self.max_new_tokens} kept free for the answer)")
            ids = ids[-budget:]
        return ids

    def reply(self, text: str) -> str:
        """The model's answer to ``text`` after the history; the turn joins the history."""
        import torch

        ids = torch.tensor([self.context(text)], device=self.model.device)
        with torch.no_grad():
            out = self.model.generate(ids, attention_mask=torch.ones_like(ids), generation_config=self.generation)
        new = out[0, ids.shape[1]:].tolist()
        stops = self.generation.eos_token_id
        stops = set(stops if isinstance(stops, list) else [stops])
        end = next((i for i, token in enumerate(new) if token in stops), len(new))
        answer = self.tokenizer.decode(new[:end], skip_special_tokens=True)
        self.history.append((text, answer))
        return answer


def _session(chat: Chat, interactive: bool) -> int:
    """Read-eval loop on stdin until ``/exit`` or end of input; returns the exit status."""
    if interactive:
        try:
            import readline  # noqa: F401 - line editing and up-arrow recall for input()
        except ImportError:  # pragma: no cover - Windows
            pass
    while True:
        try:
            line = input(PROMPT if interactive else "")
        except EOFError:
            if interactive:
                print()  # the shell's prompt on a line of its own
            return 0
        command = line.strip()
        if command == "/exit":
            return 0
        if command == "/reset":
            chat.reset()
            print("(history cleared)", file=sys.stderr)
            continue
        if not command:
            continue
        print(chat.reply(line).strip(), flush=True)


def main(argv: list[str] | None = None, prog: str = "zeropp chat") -> int:
    args = chat_parser(prog).parse_args(argv)
    if args.prompt is not None and not args.prompt.strip():
        raise UsageError(f"{prog} --prompt is empty", 'give the text to answer, e.g. --prompt "3+4="')
    interactive = args.prompt is None and sys.stdin.isatty()
    try:
        model, tokenizer = load(args.model_dir, device=args.device, tokenizer=args.tokenizer)
        chat = Chat(model, tokenizer, temperature=args.temperature, top_k=args.top_k, top_p=args.top_p,
                    max_new_tokens=args.max_new_tokens, seed=args.seed)
        if args.prompt is not None:
            print(chat.reply(args.prompt).strip(), flush=True)
            return 0
        if interactive:
            params = sum(p.numel() for p in model.parameters())
            mode = "chat template" if chat.template else "no chat template: turns joined as prompt, answer, EOS"
            print(f"{type(model).__name__} from {args.model_dir}, {params / 1e6:.1f}M parameters, {args.device}; "
                  f"{mode}. /reset clears the history, /exit or Ctrl-D ends.", file=sys.stderr)
        return _session(chat, interactive)
    except KeyboardInterrupt:
        if interactive:
            print()
        return EXIT_INTERRUPTED

"""``zeropp chat``: one answer with ``--prompt``, a session on stdin (a pipe and a
pseudo-terminal) that keeps its history, ``/reset``, end of input and Ctrl-C, and one error
line for every folder that is not a model.

The model is a 2-layer Llama written by the pipeline's exporter (``export_causal_lm``, with
the embedded byte-level tokenizer), untrained, with an output head that only scores the
lowercase letters: its greedy answers are letters, so a line of output is one answer, and
they still depend on every token of the context.
"""

from __future__ import annotations

import os
import re
import select
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from zeropp_strategy import cli

ONE_ERROR_LINE = re.compile(r"error: \S.*\. Fix: \S.*")
NEW_TOKENS = 6
GREEDY = ["--temperature", "0", "--max-new-tokens", str(NEW_TOKENS)]
SAMPLED = ["--temperature", "1", "--top-k", "0", "--top-p", "1", "--max-new-tokens", str(NEW_TOKENS)]


def _build(folder: Path, *, backbone_only: bool = False) -> None:
    import torch
    from transformers import AutoModel, ByT5Tokenizer

    from zeropp_strategy.rlhf.export import export_causal_lm
    from zeropp_strategy.rlhf.models import build_causal_lm, tiny_llama_config

    torch.manual_seed(0)
    model = build_causal_lm(tiny_llama_config(hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                              num_attention_heads=2, num_key_value_heads=2))
    letters = [b + 3 for b in range(ord("a"), ord("z") + 1)]  # ByT5: byte b is id b + 3
    with torch.no_grad():
        head = model.lm_head.weight
        head.zero_()
        head[letters] = 0.5 * torch.randn(len(letters), head.shape[1])
    if backbone_only:  # what a reward model's folder holds: the body without the LM head
        AutoModel.from_config(model.config).save_pretrained(folder)
        ByT5Tokenizer().save_pretrained(folder)
    else:
        export_causal_lm(model, folder, tokenizer=ByT5Tokenizer())


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    folder = tmp_path_factory.mktemp("chat") / "actor"
    _build(folder)
    return folder


@pytest.fixture(scope="module")
def loaded(model_dir: Path) -> tuple[object, object]:
    from zeropp_strategy.chat import load

    return load(str(model_dir))


def _fresh_answer(loaded: tuple[object, object], text: str) -> str:
    """What ``zeropp chat DIR --prompt TEXT --temperature 0`` prints, in this process."""
    from zeropp_strategy.chat import Chat

    return Chat(*loaded, temperature=0, max_new_tokens=NEW_TOKENS).reply(text).strip()


def _chat(argv: list[str], cwd: Path, stdin: str | None = None) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "zeropp_strategy.cli", "chat", *argv], cwd=cwd, input=stdin,
                          capture_output=True, text=True, timeout=300, env={**os.environ, "OMP_NUM_THREADS": "1"})


# -- the conversation, in process ----------------------------------------------------------


def test_history_is_in_the_context_and_the_answer_continues_it(loaded: tuple[object, object]) -> None:
    import torch

    from zeropp_strategy.chat import Chat

    model, tok = loaded
    chat = Chat(model, tok, temperature=0, max_new_tokens=NEW_TOKENS)
    first = chat.reply("3+4=")
    assert re.fullmatch(r"[a-z]{%d}" % NEW_TOKENS, first), first
    enc = lambda text: tok(text, add_special_tokens=False).input_ids  # noqa: E731
    # plain concatenation: the turns as the RLHF modules train on them (prompt, answer, EOS)
    expected = enc("3+4=") + enc(first) + [tok.eos_token_id] + enc("5+6=")
    assert chat.context("5+6=") == expected
    second = chat.reply("5+6=")
    ids = torch.tensor([expected])
    out = model.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False, max_new_tokens=NEW_TOKENS)
    assert second == tok.decode(out[0, len(expected):])  # greedy continuation of that exact context
    assert second != _fresh_answer(loaded, "5+6="), "the history did not change the answer"
    assert chat.history == [("3+4=", first), ("5+6=", second)]
    chat.reset()
    assert chat.history == [] and chat.reply("5+6=") == _fresh_answer(loaded, "5+6=")


def test_oldest_turns_are_forgotten_to_fit_the_positions(loaded: tuple[object, object]) -> None:
    from zeropp_strategy.chat import Chat

    notes: list[str] = []
    model, tok = loaded
    chat = Chat(model, tok, temperature=0, max_new_tokens=NEW_TOKENS, note=notes.append)
    assert chat.positions == 64
    # A turn is 12 + 6 + 1 tokens: 2 of them and a new 12-token question fit in the 58 positions
    # left for the context, so each question from the fourth on forgets the oldest turn.
    for n in range(6):
        chat.reply(f"question {n:2d}:")
    assert [user for user, _ in chat.history] == [f"question {n:2d}:" for n in (3, 4, 5)]
    assert len(chat.context("next one")) <= 64 - NEW_TOKENS
    assert notes and all("oldest 1 turn(s) were forgotten" in n and "64 positions" in n for n in notes), notes
    notes.clear()
    assert len(chat.context("x" * 100)) == 64 - NEW_TOKENS and chat.history == []
    assert "cut to its last 58 tokens" in notes[-1], notes
    with pytest.raises(cli.UsageError, match=r"--max-new-tokens 64 leaves no room .* use --max-new-tokens 32"):
        Chat(model, tok, max_new_tokens=64)


def test_chat_template_is_used_when_the_tokenizer_has_one(model_dir: Path, loaded: tuple[object, object],
                                                          tmp_path: Path) -> None:
    from zeropp_strategy.chat import Chat, load

    model, tok = loaded
    tok.save_pretrained(tmp_path / "tok")
    template = ("{% for m in messages %}<{{ m['role'] }}>{{ m['content'] }}\n{% endfor %}"
                "{% if add_generation_prompt %}<assistant>{% endif %}")
    (tmp_path / "tok" / "chat_template.jinja").write_text(template)
    _, templated = load(str(model_dir), tokenizer=str(tmp_path / "tok"))
    assert templated.chat_template == template
    chat = Chat(model, templated, temperature=0, max_new_tokens=NEW_TOKENS)
    first = chat.reply("hi")
    rendered = f"<user>hi\n<assistant>{first}\n<user>again\n<assistant>"
    assert chat.context("again") == tok(rendered, add_special_tokens=False).input_ids


# -- the command ----------------------------------------------------------------------------


def test_prompt_prints_one_answer_and_the_seed_fixes_it(model_dir: Path, tmp_path: Path) -> None:
    runs = [_chat([str(model_dir), "--prompt", "3+4=", *SAMPLED, "--seed", seed], tmp_path) for seed in "001"]
    for proc in runs:
        assert proc.returncode == 0, proc.stderr[-3000:]
        assert proc.stderr == "", proc.stderr[-3000:]  # no warning, no progress bar
        assert proc.stdout.endswith("\n") and proc.stdout.strip(), proc.stdout
    assert runs[0].stdout == runs[1].stdout  # same command, same answer
    assert runs[0].stdout != runs[2].stdout  # another seed, another draw


def test_piped_session_keeps_history_resets_and_exits(model_dir: Path, loaded: tuple[object, object],
                                                      tmp_path: Path) -> None:
    proc = _chat([str(model_dir), *GREEDY], tmp_path, stdin="3+4=\n5+6=\n\n/reset\n5+6=\n/exit\nnot read\n")
    assert proc.returncode == 0, proc.stderr[-3000:]
    answers = proc.stdout.splitlines()  # no prompt string when stdin is not a terminal
    fresh = _fresh_answer(loaded, "5+6=")
    assert answers[0] == _fresh_answer(loaded, "3+4=") and answers[2] == fresh, (answers, fresh)
    assert answers[1] != fresh and len(answers) == 3, answers  # the history was used; nothing after /exit
    assert proc.stderr == "(history cleared)\n", proc.stderr[-3000:]


class Terminal:
    """``zeropp chat`` with a pseudo-terminal as its controlling terminal (stdin, stdout and
    stderr), as a user at a shell runs it: Ctrl-C and Ctrl-D go through the line discipline."""

    def __init__(self, argv: list[str], cwd: Path) -> None:
        self.master, slave = os.openpty()
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "zeropp_strategy.cli", "chat", *argv], cwd=cwd, stdin=slave, stdout=slave,
            stderr=slave, start_new_session=True, env={**os.environ, "OMP_NUM_THREADS": "1", "TERM": "dumb"},
            preexec_fn=self._foreground)
        os.close(slave)
        self.output = ""

    @staticmethod
    def _foreground() -> None:
        """In the child: the terminal becomes its controlling one, and SIGINT is back to its
        default (a test run from a background job inherits it ignored; an interactive shell
        resets it for the commands it starts)."""
        import fcntl
        import termios

        fcntl.ioctl(0, termios.TIOCSCTTY, 0)
        signal.signal(signal.SIGINT, signal.SIG_DFL)

    def read_until(self, needle: str, timeout: float = 240) -> str:
        """Everything read so far, once ``needle`` appears after the text already consumed."""
        start = len(self.output)
        deadline = time.monotonic() + timeout
        while needle not in self.output[start:]:
            assert time.monotonic() < deadline, f"no {needle!r} in {self.output[-3000:]!r}"
            ready, _, _ = select.select([self.master], [], [], 1.0)
            if ready:
                try:
                    chunk = os.read(self.master, 4096)
                except OSError:  # the child closed the terminal
                    chunk = b""
                assert chunk or self.proc.poll() is None, f"exited {self.proc.returncode}: {self.output[-3000:]!r}"
                self.output += chunk.decode("utf-8", "replace")
        return self.output

    def type(self, text: str) -> None:
        os.write(self.master, text.encode())

    def say(self, line: str) -> str:
        """Types ``line`` at the prompt; returns what came back up to the next prompt. Every
        call waits for that prompt, so the program is reading when the next line is typed."""
        from zeropp_strategy.chat import PROMPT

        start = len(self.output)
        self.type(line + "\n")
        return self.read_until(PROMPT)[start:]

    def finish(self) -> int:
        code = self.proc.wait(timeout=60)
        while select.select([self.master], [], [], 0.2)[0]:
            try:
                chunk = os.read(self.master, 4096)
            except OSError:
                break
            if not chunk:
                break
            self.output += chunk.decode("utf-8", "replace")
        os.close(self.master)
        return code


def test_terminal_session_two_turns_reset_and_ctrl_d(model_dir: Path, loaded: tuple[object, object],
                                                     tmp_path: Path) -> None:
    from zeropp_strategy.chat import PROMPT

    term = Terminal([str(model_dir), *GREEDY], tmp_path)
    try:
        term.read_until(PROMPT)
        assert "/reset clears the history, /exit or Ctrl-D ends" in term.output, term.output
        first, fresh = _fresh_answer(loaded, "3+4="), _fresh_answer(loaded, "5+6=")
        assert first in term.say("3+4=")
        second = re.search(r"\b([a-z]{%d})\b" % NEW_TOKENS, term.say("5+6=")).group(1)
        assert second != fresh, "the history did not change the answer"
        assert "(history cleared)" in term.say("/reset")
        assert fresh in term.say("5+6=")
        term.type("\x04")  # Ctrl-D on an empty line: end of input
        assert term.finish() == 0, term.output
    finally:
        if term.proc.poll() is None:
            term.proc.kill()
    assert "Traceback" not in term.output, term.output


def test_terminal_ctrl_c_ends_without_traceback(model_dir: Path, tmp_path: Path) -> None:
    from zeropp_strategy.chat import EXIT_INTERRUPTED, PROMPT

    term = Terminal([str(model_dir), *GREEDY], tmp_path)
    try:
        term.read_until(PROMPT)
        term.type("half a ques")
        # Once readline has echoed the text and is back waiting for input: a SIGINT that lands
        # while it is still busy with the keys is only seen at the next key (CPython's
        # readline loop checks for signals when its select() is interrupted).
        term.read_until("half a ques")
        time.sleep(1.0)
        term.type("\x03")  # Ctrl-C: the terminal sends SIGINT to the session's foreground group
        assert term.finish() == EXIT_INTERRUPTED == 128 + signal.SIGINT, term.output
    finally:
        if term.proc.poll() is None:
            term.proc.kill()
    assert "Traceback" not in term.output and "KeyboardInterrupt" not in term.output, term.output


# -- not a model: one error line, status 2 ---------------------------------------------------


def _not_models(root: Path, model_dir: Path) -> dict[str, tuple[list[str], tuple[str, ...]]]:
    """name -> (zeropp chat arguments, what the error line must say)."""
    (root / "file.ckpt").write_bytes(b"not a folder")
    (root / "empty").mkdir()
    (root / "sharded").mkdir()
    (root / "sharded" / "zeropp_meta.pt").write_bytes(b"")
    (root / "accelerate" / "zeropp_state").mkdir(parents=True)
    (root / "consolidated" / "actor").mkdir(parents=True)
    (root / "consolidated" / "actor" / "config.json").write_text("{}")
    (root / "no_tokenizer").mkdir()
    for name in ("config.json", "generation_config.json", "model.safetensors"):
        (root / "no_tokenizer" / name).write_bytes((model_dir / name).read_bytes())
    (root / "no_weights").mkdir()
    for name in ("config.json", "tokenizer_config.json"):
        (root / "no_weights" / name).write_bytes((model_dir / name).read_bytes())
    (root / "bad_json").mkdir()
    (root / "bad_json" / "config.json").write_text("{oops")
    _build(root / "reward", backbone_only=True)
    d = lambda name: str(root / name)  # noqa: E731
    return {
        "missing": ([d("missing")], ("no such folder", "runs/pipeline/actor")),
        "file": ([d("file.ckpt")], ("is a file, not a model folder", "zeropp consolidate")),
        "empty": ([d("empty")], ("has no config.json", "zeropp consolidate CKPT OUT --hf")),
        "sharded": ([d("sharded")], ("zeropp checkpoint directory", f"zeropp consolidate {d('sharded')} OUT --hf")),
        "accelerate": ([d("accelerate")], ("zeropp checkpoint directory",)),
        "several": ([d("consolidated")], ("holds model folders (actor)", f"zeropp chat {d('consolidated')}/actor")),
        "reward": ([d("reward")], ("LlamaModel, a model without a language-model head", "not reward/")),
        "no_tokenizer": ([d("no_tokenizer")], ("has no tokenizer", "--tokenizer DIR")),
        "no_weights": ([d("no_weights")], ("does not load as a causal LM", "no file named model.safetensors")),
        "bad_json": ([d("bad_json")], ("config.json is not valid JSON",)),
        "tokenizer_missing": ([str(model_dir), "--tokenizer", d("missing")], ("--tokenizer", "no such folder")),
        "device": ([str(model_dir), "--device", "nonsense"],
                   ("--device 'nonsense'", "use cpu, or a device this machine has")),
        "top_p": ([str(model_dir), "--top-p", "2"], ("argument --top-p: 2 is not in (0, 1]", "zeropp chat --help")),
        "temperature": ([str(model_dir), "--temperature", "-1"], ("argument --temperature: -1 is below 0",)),
        "empty_prompt": ([str(model_dir), "--prompt", " "], ("--prompt is empty", '--prompt "3+4="')),
    }


def test_not_a_model_is_one_error_line(model_dir: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    cases = _not_models(tmp_path, model_dir)
    capsys.readouterr()
    for name, (argv, needles) in cases.items():
        assert cli.main(["chat", *argv, *([] if "--prompt" in argv else ["--prompt", "x"])]) == 2, name
        out, err = capsys.readouterr()
        assert out == "" and ONE_ERROR_LINE.fullmatch(err.rstrip("\n")) and err.count("\n") == 1, (name, err)
        for needle in needles:
            assert needle in err, (name, needle, err)


def test_not_a_model_in_a_fresh_process(model_dir: Path, tmp_path: Path) -> None:
    """The same line from the installed command's code path, with no traceback."""
    (tmp_path / "sharded").mkdir()
    (tmp_path / "sharded" / "zeropp_meta.pt").write_bytes(b"")
    proc = _chat([str(tmp_path / "sharded")], tmp_path, stdin="never read\n")
    assert proc.returncode == 2 and proc.stdout == "", (proc.stdout, proc.stderr[-3000:])
    assert ONE_ERROR_LINE.fullmatch(proc.stderr.rstrip("\n")) and "zeropp checkpoint directory" in proc.stderr

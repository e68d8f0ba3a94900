"""The examples in README.md and docs/*.md work.

Every fenced ``python`` / ``bash`` (``sh``, ``console``, ``shell``) block is either

- executed by a test below (listed with ``@covers``; from a temp dir, shrunk only by
  parameters the test passes, e.g. ``--max-steps 2``), or
- marked on the line before its fence, with the reason it is not run here:
  ``<!-- not-run: needs 8 GPUs -->``; or ``<!-- run: parse-only, ... -->`` for a command
  whose arguments a test checks without running it (the fence must then be covered too).

``test_every_example_is_run_or_marked`` fails, listing them, for fences that are neither
(so a new example cannot drift unnoticed), markers without a reason, untagged fences,
and ``@covers`` references that no longer find their fence. Beyond that, every python
fence, run or not, is compiled, and its ``zeropp_strategy`` imports, strategy names and
``ZeroPPStrategy``/``ZeroConfig`` keywords are checked against the code; every
``zeropp ...`` line of every shell fence is parsed by the real argument parsers.

Cost: the in-process checks share one interpreter; each multi-process example is one
launch (about 10-25 s each on 2 CPU cores).
"""

from __future__ import annotations

import ast
import dataclasses
import doctest
import importlib
import inspect
import json
import os
import re
import shlex
import shutil
import subprocess
import sys
import textwrap
import warnings
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

REPO = Path(__file__).resolve().parents[1]
DOC_FILES = ["README.md", *sorted(f"docs/{p.name}" for p in (REPO / "docs").glob("*.md"))]
RUNNABLE = {"python", "bash", "sh", "console", "shell"}
SHELL = RUNNABLE - {"python"}

# README's two set-up blocks sit right after the markers that .ci/run and
# tests/test_packaging.py look for, so they cannot carry a marker of their own.
SETUP_MARKERS = {
    "<!-- main-command -->": ("run", "parse-only: installs packages, then the full pipeline (minutes); "
                                     "test_zeropp_command_lines_parse parses its zeropp command"),
    "<!-- test-command -->": ("not-run", "installs packages and runs this test suite"),
}

_FENCE_OPEN = re.compile(r"^(\s*)```(\S*)\s*$")
_MARKER = re.compile(r"<!--\s*(not[- _]?run|run)\b\s*(:?)\s*(.*?)\s*-->", re.I)


@dataclasses.dataclass(frozen=True)
class Fence:
    path: str  # relative to the repository, e.g. "docs/quickstart.md"
    line: int  # 1-based line of the opening fence
    lang: str
    body: str  # dedented
    before: str  # the line before the opening fence, stripped

    @property
    def where(self) -> str:
        return f"{self.path}:{self.line} ({self.lang or 'untagged'}: {self.body.strip().splitlines()[0][:60]!r})"


def collect_fences(path: str, text: str) -> list[Fence]:
    lines = text.split("\n")
    fences: list[Fence] = []
    i = 0
    while i < len(lines):
        m = _FENCE_OPEN.match(lines[i])
        if not m:
            i += 1
            continue
        indent = m.group(1)
        j = i + 1
        while j < len(lines) and lines[j].strip() != "```":
            j += 1
        assert j < len(lines), f"{path}:{i + 1}: fence never closed"
        body = textwrap.dedent("\n".join(ln[len(indent):] if ln.startswith(indent) else ln for ln in lines[i + 1:j]))
        fences.append(Fence(path, i + 1, m.group(2), body, lines[i - 1].strip() if i else ""))
        i = j + 1
    return fences


FENCES = [f for p in DOC_FILES for f in collect_fences(p, (REPO / p).read_text(encoding="utf-8"))]


def marker(fence: Fence) -> tuple[str, str] | None:
    """(kind, reason) from the line before the fence, or None; kind 'bad' for a malformed one."""
    if fence.path == "README.md" and fence.before in SETUP_MARKERS:
        return SETUP_MARKERS[fence.before]
    m = _MARKER.search(fence.before)
    if m is None:
        return None
    kind = "run" if m.group(1).lower() == "run" else "not-run"
    if m.group(1).lower() not in ("run", "not-run") or not m.group(2) or not m.group(3):
        return ("bad", f"write it as <!-- {kind}: REASON -->")
    return kind, m.group(3)


def find(path: str, snippet: str) -> list[Fence]:
    return [f for f in FENCES if f.path == path and snippet in f.body]


# -- which tests run which fences ----------------------------------------------------------

COVERED: dict[tuple[str, int], str] = {}
COVERED_BY: dict[str, list[tuple[str, str]]] = {}
BROKEN_REFS: list[str] = []


def covers(*refs: tuple[str, str]) -> Callable[[Callable[..., Any]], Callable[..., Any]]:
    """Declares that the decorated test runs the fences found by (file, unique snippet)."""

    def deco(func: Callable[..., Any]) -> Callable[..., Any]:
        COVERED_BY.setdefault(func.__name__, []).extend(refs)
        for path, snippet in refs:
            hits = find(path, snippet)
            if len(hits) != 1:
                BROKEN_REFS.append(f"{func.__name__}: ({path!r}, {snippet!r}) matches {len(hits)} fences, not 1")
            for f in hits:
                COVERED[(f.path, f.line)] = func.__name__
        return func

    return deco


def fence(path: str, snippet: str) -> Fence:
    hits = find(path, snippet)
    assert len(hits) == 1, f"({path!r}, {snippet!r}) matches {len(hits)} fences"
    return hits[0]


# -- running -------------------------------------------------------------------------------


def exec_python(source: str, name: str, ns: dict[str, Any] | None = None) -> dict[str, Any]:
    """Exec ``source`` in a fresh namespace (plus ``ns``); returns the namespace."""
    namespace: dict[str, Any] = {"__name__": "__docs__"}
    namespace.update(ns or {})
    exec(compile(source, name, "exec"), namespace)  # noqa: S102 - our own docs
    return namespace


_SHELL_PRELUDE = """set -euo pipefail
python() { "$DOCS_PYTHON" "$@"; }
zeropp() { "$DOCS_PYTHON" -m zeropp_strategy.cli "$@"; }
accelerate() { "$DOCS_PYTHON" -m accelerate.commands.accelerate_cli "$@"; }
"""


def run_shell(script: str, cwd: Path, timeout: float = 240, env: dict[str, str] | None = None) -> str:
    """Runs a bash script (``python``, ``zeropp`` and ``accelerate`` are this interpreter's)."""
    full_env = {**os.environ, "DOCS_PYTHON": sys.executable, "PYTHONUNBUFFERED": "1", **(env or {})}
    full_env.pop("ZEROPP_CONFIG", None) if "ZEROPP_CONFIG" not in (env or {}) else None
    proc = subprocess.run(["bash", "-c", _SHELL_PRELUDE + script], cwd=cwd, env=full_env, capture_output=True,
                          text=True, timeout=timeout)
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, f"exit {proc.returncode}\n--- script\n{script}\n--- output (tail)\n{out[-6000:]}"
    return out


def shell_commands(body: str) -> list[str]:
    """The commands of a shell fence: continuation lines joined, comments dropped."""
    joined = re.sub(r"\\\n\s*", " ", body)
    out = []
    for line in joined.splitlines():
        line = line.strip()
        if line and not line.startswith("#"):
            out.append(line)
    return out


def with_flags(body: str, program: str, flags: str) -> str:
    """``body`` with ``flags`` added to every command line that starts with ``program``
    (before a trailing comment): the test's shrinking parameters."""
    lines = []
    for line in body.splitlines():
        if line.strip().startswith(program):
            code, sep, comment = line.partition("  #")
            line = f"{code.rstrip()} {flags}" + (f"  {sep.strip()}{comment}" if sep else "")
        lines.append(line)
    return "\n".join(lines)


@pytest.fixture
def workdir(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """A temp dir standing for the user's checkout: ``recipes/`` is there, as in the repo."""
    (tmp_path / "recipes").symlink_to(REPO / "recipes", target_is_directory=True)
    monkeypatch.chdir(tmp_path)
    monkeypatch.delenv("ZEROPP_CONFIG", raising=False)
    return tmp_path


# -- the coverage check ----------------------------------------------------------------------


def test_every_example_is_run_or_marked() -> None:
    problems: list[str] = list(BROKEN_REFS)
    for f in FENCES:
        key = (f.path, f.line)
        if not f.lang:
            problems.append(f"{f.where}: fence without a language; tag output and samples ```text, "
                            "config files ```yaml / ```json")
            continue
        m = marker(f)
        if f.lang not in RUNNABLE:
            if m is not None:
                problems.append(f"{f.where}: a {f.lang} fence is not run; drop the marker")
            continue
        test = COVERED.get(key)
        if m is not None and m[0] == "bad":
            problems.append(f"{f.where}: malformed marker {f.before!r}: {m[1]}")
        elif m is not None and m[0] == "not-run" and test:
            problems.append(f"{f.where}: marked not-run but {test} runs it; drop the marker")
        elif m is not None and m[0] == "run" and not test:
            problems.append(f"{f.where}: marked run ({m[1]}) but no test covers it")
        elif m is None and not test:
            problems.append(f"{f.where}: neither run by a test here (@covers) nor marked "
                            "<!-- not-run: REASON --> on the line before the fence")
    assert not problems, "docs examples:\n" + "\n".join(problems)


def test_the_coverage_check_catches_drift() -> None:
    """The parser and marker rules on a made-up page: an unmarked fence, a marker without a
    reason, and a proper marker."""
    page = "\n".join([
        "# t", "", "```python", "x = 1", "```", "", "<!-- not-run -->", "```bash", "ls", "```", "",
        "<!-- not-run: needs a GPU -->", "  ```python", "  y = 2", "  ```", "",
    ])
    fences = collect_fences("t.md", page)
    assert [(f.line, f.lang, f.body) for f in fences] == [(3, "python", "x = 1"), (8, "bash", "ls"),
                                                          (13, "python", "y = 2")]
    assert [marker(f) for f in fences] == [None, ("bad", "write it as <!-- not-run: REASON -->"),
                                           ("not-run", "needs a GPU")]


# -- links ---------------------------------------------------------------------------------------

_LINK = re.compile(r"\]\(([^()\s]*)\)")  # [text](target): the target, no title
_HEADING = re.compile(r"^#{1,6} +(.*?) *#* *$")


def prose_lines(text: str) -> Iterator[tuple[int, str]]:
    """(1-based number, line) of each line of a page outside its fences and their fence lines."""
    in_fence = False
    for number, line in enumerate(text.split("\n"), 1):
        if _FENCE_OPEN.match(line) or (in_fence and line.strip() == "```"):
            in_fence = not in_fence
        elif not in_fence:
            yield number, line


def heading_anchors(text: str) -> set[str]:
    """The anchors GitHub gives the headings of a page outside its fences: lower case, every
    character but letters, digits, spaces, '-' and '_' dropped, spaces as '-', and '-1', '-2'
    after repeats."""
    anchors: set[str] = set()
    seen: dict[str, int] = {}
    for _, line in prose_lines(text):
        m = _HEADING.match(line)
        if not m:
            continue
        slug = re.sub(r"[^\w\- ]", "", m.group(1).lower()).replace(" ", "-")
        n = seen.get(slug, -1) + 1
        seen[slug] = n
        anchors.add(slug if n == 0 else f"{slug}-{n}")
    return anchors


def broken_links(pages: dict[str, str]) -> list[str]:
    """Relative links of ``pages`` (repository path -> text) whose file does not exist, or
    whose '#anchor' is not a heading of the page it names; links inside fences are code."""
    problems: list[str] = []
    anchors: dict[str, set[str]] = {}  # page -> its headings' anchors, computed once
    for path, text in pages.items():
        for number, line in prose_lines(text):
            for target in _LINK.findall(line):
                if re.match(r"[a-z]+:", target):  # https:, mailto:
                    continue
                file, _, anchor = target.partition("#")
                ref = os.path.normpath(os.path.join(os.path.dirname(path), file)) if file else path
                text_of = pages.get(ref)
                if text_of is None and not (REPO / ref).exists():
                    problems.append(f"{path}:{number}: {target}: no file {ref}")
                elif anchor and ref.endswith(".md"):
                    if ref not in anchors:
                        anchors[ref] = heading_anchors(text_of or (REPO / ref).read_text(encoding="utf-8"))
                    if anchor not in anchors[ref]:
                        problems.append(f"{path}:{number}: {target}: no heading with anchor #{anchor} in {ref}")
    return problems


def test_links_resolve() -> None:
    """Every relative link of README.md and docs/*.md names a file that exists and, with an
    anchor, a heading of that page."""
    pages = {p: (REPO / p).read_text(encoding="utf-8") for p in DOC_FILES}
    problems = broken_links(pages)
    assert not problems, "broken links:\n" + "\n".join(problems)


def test_the_link_check_catches_drift() -> None:
    page = "\n".join([
        "# A `b`: c", "## A `b`: c", "```python", "# not a heading", "x = [1](nowhere.md)", "```",
        "[ok](#a-b-c) [ok](#a-b-c-1) [ok](t.md#a-b-c) [ok](https://x.org/#y) [ok](../README.md)",
        "[bad](#a-b-c-2) [bad](#not-a-heading) [bad](missing.md) [bad](t.md#nope)",
    ])
    assert heading_anchors(page) == {"a-b-c", "a-b-c-1"}
    got = broken_links({"docs/t.md": page})
    assert [g.split(": ")[1] for g in got] == ["#a-b-c-2", "#not-a-heading", "missing.md", "t.md#nope"], got


# -- static checks of every python fence, run or not -----------------------------------------

# Fences that are signatures (``Name(a, *, b=1)``), not statements: checked against
# inspect.signature instead, by test_signatures_match_the_code.
SIGNATURES: dict[tuple[str, str], list[str]] = {
    ("docs/callbacks.md", "ShardedEMA(decay=0.999, *"): ["zeropp_strategy.callbacks:ShardedEMA"],
    ("docs/strategy.md", "    config=None,\n    *,"): ["zeropp_strategy:ZeroPPStrategy"],
    ("docs/strategy.md", "OffloadConfig(*, device=\"none\""): ["zeropp_strategy:OffloadConfig"],
    ("docs/strategy.md", "OffloadOptimizer(optimizer, config, *"): ["zeropp_strategy.offload:OffloadOptimizer"],
    ("docs/strategy.md", "ParamStore(root, config, *"): ["zeropp_strategy.offload.params:ParamStore"],
    ("docs/strategy.md", "LocalStepOptimizer(optimizer)"): ["zeropp_strategy.engine.local_step:LocalStepOptimizer"],
    ("docs/strategy.md", "engine = ZeroEngine(plan, *"): ["zeropp_strategy.engine.core:ZeroEngine"],
    ("docs/strategy.md", "ZeroPPPrecision(precision=\"32-true\""): [
        "zeropp_strategy:ZeroPPPrecision", "zeropp_strategy:ZeroPPPrecision.bind",
        "zeropp_strategy:ShardedGradScaler"],
    ("docs/strategy.md", "Topology(world_size, rank, ranks_per_node"): ["zeropp_strategy:Topology"],
    ("docs/strategy.md", "Meshes(world, node, intra_group"): ["zeropp_strategy.topology:Meshes"],
    ("docs/strategy.md", "QuantizedWeight.from_dense(x, block_elems, bits=8)"): [
        "zeropp_strategy.engine.frozen:QuantizedWeight.from_dense", "zeropp_strategy.engine.frozen:quantize_rows",
        "zeropp_strategy.engine.frozen:dequantize_rows", "zeropp_strategy.engine.frozen:quantize_frozen"],
}


def _signature_key(f: Fence) -> tuple[str, str] | None:
    return next((k for k in SIGNATURES if k[0] == f.path and k[1] in f.body), None)


def _python_sources(f: Fence) -> list[str]:
    """The code of a python fence: doctest examples, or the body itself."""
    if f.body.lstrip().startswith(">>>"):
        return [ex.source for ex in doctest.DocTestParser().get_examples(f.body)]
    return [f.body]


def _strategy_keywords() -> set[str]:
    from zeropp_strategy import ZeroConfig, ZeroPPStrategy
    from zeropp_strategy.fabric import ZeroPPFabricStrategy

    names = {f.name for f in dataclasses.fields(ZeroConfig)}
    for cls in (ZeroPPStrategy, ZeroPPFabricStrategy):
        names |= set(inspect.signature(cls.__init__).parameters) - {"self", "config_fields"}
    return names


def _strategy_names() -> set[str]:
    from lightning.fabric.strategies import STRATEGY_REGISTRY
    from lightning.pytorch.strategies import StrategyRegistry

    import zeropp_strategy  # noqa: F401 - registers our names

    return set(StrategyRegistry.available_strategies()) | set(STRATEGY_REGISTRY.available_strategies())


def _check_python(f: Fence, keywords: set[str], strategies: set[str]) -> list[str]:
    problems = []
    for source in _python_sources(f):
        # A fragment of a class body (``    def configure_model(self): ...``) compiles once dedented.
        try:
            tree = ast.parse(textwrap.dedent(source))
        except SyntaxError as e:
            return [f"{f.where}: line {e.lineno}: {e.msg}"]
        for node in ast.walk(tree):
            if isinstance(node, ast.ImportFrom) and node.module and node.module.split(".")[0] == "zeropp_strategy":
                module = importlib.import_module(node.module)
                problems += [f"{f.where}: {node.module} has no {a.name}" for a in node.names
                             if not hasattr(module, a.name) and not _is_submodule(node.module, a.name)]
            elif isinstance(node, ast.Import):
                for a in node.names:
                    if a.name.split(".")[0] == "zeropp_strategy":
                        importlib.import_module(a.name)
            elif isinstance(node, ast.Call):
                callee = node.func.attr if isinstance(node.func, ast.Attribute) else getattr(node.func, "id", "")
                for kw in node.keywords:
                    if callee in ("ZeroPPStrategy", "ZeroConfig", "ZeroPPFabricStrategy") and kw.arg \
                            and kw.arg not in keywords:
                        problems.append(f"{f.where}: {callee}({kw.arg}=...) is not an option")
                    if kw.arg == "strategy" and isinstance(kw.value, ast.Constant) \
                            and kw.value.value not in strategies:
                        problems.append(f"{f.where}: strategy={kw.value.value!r} is not a registered name")
    return problems


def _is_submodule(package: str, name: str) -> bool:
    try:
        importlib.import_module(f"{package}.{name}")
    except ImportError:
        return False
    return True


def test_python_examples_compile_and_name_real_things() -> None:
    """Run or not, every python fence compiles, and what it imports from zeropp_strategy,
    the strategy names it passes and the ZeroPPStrategy / ZeroConfig keywords it uses exist."""
    keywords, strategies = _strategy_keywords(), _strategy_names()
    problems: list[str] = []
    for f in FENCES:
        if f.lang == "python" and _signature_key(f) is None:
            problems += _check_python(f, keywords, strategies)
    assert not problems, "\n".join(problems)


def test_registered_name_lists_are_complete() -> None:
    """A comment or sentence that lists the names ``import zeropp_strategy`` registers lists
    all of them (or says '...'), and a count of them is right."""
    from zeropp_strategy import PRESETS

    words = {4: "four", 5: "five", 6: "six", 7: "seven", 8: "eight", 9: "nine", 10: "ten"}
    problems = []
    for path in DOC_FILES:
        for n, line in enumerate((REPO / path).read_text(encoding="utf-8").splitlines(), 1):
            m = re.search(r"registers\W+((?:\"zeropp\w*\",?\s*){2,})", line)
            if m and "..." not in line[m.end():m.end() + 6]:
                listed = set(re.findall(r"\"(zeropp\w*)\"", m.group(1)))
                if listed != set(PRESETS):
                    problems.append(f"{path}:{n}: lists {sorted(listed)}, registered: {sorted(PRESETS)}")
            m = re.search(r"registers (\d+|one|two|three|four|five|six|seven|eight|nine|ten) strategy names", line)
            if m and m.group(1) not in (str(len(PRESETS)), words.get(len(PRESETS))):
                problems.append(f"{path}:{n}: says {m.group(1)} names; there are {len(PRESETS)}")
    assert not problems, "\n".join(problems)


def _parse_signature(text: str) -> list[tuple[str, ast.FunctionDef]]:
    """``Name(a, *, b=1) -> ret`` entries (possibly over several lines, with comments and
    an ``x = `` in front) as function definitions."""
    text = "\n".join(line.split("#")[0].rstrip() for line in text.splitlines())
    text = re.sub(r"^\w+\s*=\s*(?=[\w.]+\()", "", text, flags=re.M)
    out = []
    for m in re.finditer(r"^([\w.]+)\(", text, re.M):
        depth, i = 0, m.end() - 1
        for i in range(m.end() - 1, len(text)):  # the matching parenthesis
            depth += {"(": 1, ")": -1}.get(text[i], 0)
            if depth == 0:
                break
        ret = re.match(r"\s*->\s*[^\n]+", text[i + 1:])
        source = f"def {m.group(1).split('.')[-1]}{text[m.end() - 1:i + 1]}{ret.group(0) if ret else ''}: pass"
        out.append((m.group(1), ast.parse(source).body[0]))  # type: ignore[misc]
    return out


def _resolve(target: str) -> Any:
    module, _, attr = target.partition(":")
    obj: Any = importlib.import_module(module)
    for part in attr.split("."):
        obj = getattr(obj, part)
    return obj


@covers(*SIGNATURES)
def test_signatures_match_the_code() -> None:
    """Each signature fence names the real parameters, in order, of the right kind, with
    the real defaults."""
    from datetime import timedelta

    import torch

    problems = []
    for key, targets in SIGNATURES.items():
        f = fence(*key)
        parsed = _parse_signature(f.body)
        assert [name for name, _ in parsed] and len(parsed) == len(targets), (f.where, parsed)
        for (name, func), target in zip(parsed, targets):
            obj = _resolve(target)
            scope = {**vars(sys.modules[obj.__module__]), "timedelta": timedelta, "torch": torch}
            real = inspect.signature(obj)
            real_params = [p for p in real.parameters.values() if p.name not in ("self", "cls")]
            a = func.args
            documented: list[tuple[str, str, Any]] = []
            positional = a.posonlyargs + a.args
            pos_defaults = [None] * (len(positional) - len(a.defaults)) + list(a.defaults)
            for arg, d in zip(positional, pos_defaults):
                documented.append((arg.arg, "POSITIONAL_OR_KEYWORD", d))
            if a.vararg:
                documented.append((a.vararg.arg, "VAR_POSITIONAL", None))
            for arg, d in zip(a.kwonlyargs, a.kw_defaults):
                documented.append((arg.arg, "KEYWORD_ONLY", d))
            if a.kwarg:
                documented.append((a.kwarg.arg, "VAR_KEYWORD", None))
            def shape(params: list[tuple[str, str]]) -> list[tuple[str, str]]:  # *args/**kw: any name
                return [("*" if k.startswith("VAR_") else n, k) for n, k in params]

            got = [(p.name, p.kind.name.replace("POSITIONAL_ONLY", "POSITIONAL_OR_KEYWORD")) for p in real_params]
            if shape([(n, k) for n, k, _ in documented]) != shape(got):
                problems.append(f"{f.where}: {name}{[(n, k) for n, k, _ in documented]} but the code has {got}")
                continue
            for (n, _, d), p in zip(documented, real_params):
                if d is None:
                    if p.default is not inspect.Parameter.empty and p.kind.name not in ("VAR_POSITIONAL",
                                                                                          "VAR_KEYWORD"):
                        problems.append(f"{f.where}: {name}: {n} has the default {p.default!r}, not documented")
                    continue
                value = eval(ast.unparse(d), scope)  # noqa: S307 - our docs, in the code's module scope
                if value != p.default:
                    problems.append(f"{f.where}: {name}: {n}={ast.unparse(d)} but the default is {p.default!r}")
    assert not problems, "\n".join(problems)


# -- shell fences: every `zeropp ...` line parses -----------------------------------------------


def _zeropp_argv(command: str) -> list[str] | None:
    """The arguments of the first ``zeropp`` command in a shell command line."""
    lexer = shlex.shlex(command, posix=True, punctuation_chars=True)
    lexer.whitespace_split = True
    words: list[str] = []
    for token in [*lexer, ";"]:
        if token not in ("&&", "||", ";", "|"):
            words.append(token)
            continue
        while words and re.match(r"^\w+=", words[0]):  # VAR=value prefixes
            words = words[1:]
        if words and words[0] == "zeropp":
            return [w for w in words[1:] if not (w.startswith("[") or w.endswith("]"))]
        words = []
    return None


def _parse_zeropp(argv: list[str], monkeypatch: pytest.MonkeyPatch) -> None:
    """Parses a ``zeropp`` command line with the real parsers, running nothing."""
    from zeropp_strategy import cli

    sub, rest = argv[0], argv[1:]
    assert sub in cli.SUBCOMMANDS, f"zeropp has no subcommand {sub!r}"
    if sub == "demo":
        from zeropp_strategy import demo

        demo.build_parser("zeropp demo").parse_args(rest)
    elif sub == "consolidate":
        from zeropp_strategy.checkpoint import consolidate

        consolidate.build_parser("zeropp consolidate").parse_args(rest)
    elif sub == "pipeline":
        from zeropp_strategy import pipeline

        seen = []
        monkeypatch.setattr(pipeline, "run_pipeline", lambda recipe, out, **kw: seen.append((recipe, out)) or {})
        assert pipeline.main(rest) == 0 and seen, argv
    elif sub == "fit":
        from zeropp_strategy.fit import fit

        # as from the command line: LightningCLI warns when given args while sys.argv has some (pytest's)
        monkeypatch.setattr(sys, "argv", ["zeropp"])
        with pytest.raises(SystemExit) as exc:  # LightningCLI validates and prints the config, then exits
            fit([*rest, "--print_config"])
        assert exc.value.code == 0, argv
    elif sub == "report":
        from zeropp_strategy import report

        seen = []
        monkeypatch.setattr(report, "make_report",
                            lambda run_dir, out: seen.append(run_dir) or {"out": out, "plots": {}, "missing": []})
        assert report.main(rest) == 0 and seen, argv
    elif sub == "plan":
        from zeropp_strategy import estimate

        estimate.parser("zeropp plan").parse_args(rest)


@covers(("README.md", "zeropp pipeline --output-dir runs/pipeline"),
        ("docs/rlhf.md", "zeropp fit --config recipes/sft.yaml --model.model facebook/opt-1.3b"),
        ("docs/rlhf.md", "zeropp pipeline --output-dir runs/pipeline [--config"),
        ("docs/rlhf.md", "zeropp pipeline --output-dir runs/pipeline                 # all three"))
def test_zeropp_command_lines_parse(workdir: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Every ``zeropp ...`` line of every shell fence, run or not, parses with the real
    argument parsers (the pipeline's recipe is loaded, LightningCLI validates ``zeropp fit``)."""
    failures = []
    for f in FENCES:
        if f.lang not in SHELL:
            continue
        for command in shell_commands(f.body):
            argv = _zeropp_argv(command)
            if argv is None:
                continue
            # [--config x] [--strategy ddp] in a usage line: check the options one by one too
            options = re.findall(r"\[(--[\w-]+(?: [^\]\s]+)?)\]", command)
            variants = [argv] + [[*argv, *o.split()] for o in options]
            for v in variants:
                try:
                    _parse_zeropp(v, monkeypatch)
                except (Exception, SystemExit) as e:  # noqa: BLE001 - report every line
                    failures.append(f"{f.where}: `zeropp {' '.join(v)}`: {type(e).__name__}: {e}")
    assert not failures, "\n".join(failures)


# -- python examples that build objects: exec'd here, each in a fresh namespace ---------------


def _page_imports() -> dict[str, Any]:
    """What the pages import at their top, for fragments that continue an earlier block."""
    import lightning.pytorch as L

    from zeropp_strategy import ZeroConfig, ZeroConfigWarning, ZeroPPPrecision, ZeroPPStrategy

    return {"L": L, "ZeroPPStrategy": ZeroPPStrategy, "ZeroConfig": ZeroConfig,
            "ZeroConfigWarning": ZeroConfigWarning, "ZeroPPPrecision": ZeroPPPrecision}


@covers(("README.md", "trainer = lightning.pytorch.Trainer(strategy=\"zeropp\")"),
        ("README.md", "# or configure it yourself"),
        ("docs/callbacks.md", "CommVolumeMonitor(prog_bar=True)"),
        ("docs/offload.md", "# optimizer state in host memory, any stage"),
        ("docs/quickstart.md", "strategy = ZeroPPStrategy(stage=3, offload_optimizer=\"cpu\", offload_param=\"cpu\")"),
        ("docs/quickstart.md", "simulated_nodes=2),   # ranks 0-1"),
        ("docs/strategy.md", "ZeroPPStrategy, PRESETS,"),
        ("docs/strategy.md", "cfg = ZeroConfig(stage=2, wrap_modules=[\"GPT2Block\"]"),
        ("docs/strategy.md", "warnings.filterwarnings(\"ignore\", category=ZeroConfigWarning)"),
        ("docs/strategy.md", "warnings.filterwarnings(\"ignore\", category=GradientReadWarning)"),
        ("docs/strategy.md", "plugins=[ZeroPPPrecision(\"16-mixed\")]"),
        ("docs/accelerate.md", "from zeropp_strategy.accelerate.launch import main"))
def test_object_building_examples_run(workdir: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Examples that only build Trainers, Fabrics, strategies and configs, on the CPU
    (building a Trainer with devices=8 starts no process). ``$ZEROPP_NVME_PATH`` points at
    a temp dir for the NVMe presets."""
    monkeypatch.setenv("ZEROPP_NVME_PATH", str(workdir))
    for path, snippet in COVERED_BY["test_object_building_examples_run"]:
        f = fence(path, snippet)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            exec_python(f.body, f.where, _page_imports())


@covers(("docs/strategy.md", "opt = OffloadOptimizer(torch.optim.AdamW(model.parameters(), lr=1e-3)"))
def test_offload_optimizer_example_prints_what_it_says(workdir: Path, capsys: pytest.CaptureFixture[str]) -> None:
    f = fence("docs/strategy.md", "opt = OffloadOptimizer(torch.optim.AdamW(model.parameters(), lr=1e-3)")
    exec_python(f.body, f.where)
    claimed = re.search(r"print\(opt.offloaded_bytes\(\)\)\s*#\s*(\{.*?\})", f.body).group(1)
    assert capsys.readouterr().out.strip() == claimed


@covers(("docs/strategy.md", ">>> w = Int8Weight.from_dense(x, 32)"))
def test_int8_weight_doctest() -> None:
    import torch

    from zeropp_strategy.engine.frozen import Int8Weight, dequantize_rows, quantize_rows

    f = fence("docs/strategy.md", ">>> w = Int8Weight.from_dense(x, 32)")
    test = doctest.DocTestParser().get_doctest(f.body, {"torch": torch, "Int8Weight": Int8Weight,
                                                        "quantize_rows": quantize_rows,
                                                        "dequantize_rows": dequantize_rows}, f.where, f.path, f.line)
    result = doctest.DocTestRunner(optionflags=doctest.NORMALIZE_WHITESPACE).run(test)
    assert result.failed == 0 and result.attempted == 6


def _warning_sample(after: Fence) -> list[str]:
    """The ``text`` fence that follows ``after`` on its page: a sample of a warning."""
    later = [f for f in FENCES if f.path == after.path and f.line > after.line]
    return [line.rstrip() for line in later[0].body.strip().splitlines()]


@covers(("docs/strategy.md", "ZeroConfig.from_deepspeed({\"zero_optimization\": {\"stage\": 3, \"overlap_comm\": True,"),
        ("docs/quickstart.md", "strategy = ZeroPPStrategy(config=\"ds_config.json\")"))
def test_deepspeed_examples_warn_as_shown(workdir: Path) -> None:
    """The DeepSpeed conversions warn with exactly the sample printed after them. The
    quickstart's ds_config.json is one with the keys its sample lists."""
    from zeropp_strategy import ZeroConfigWarning

    ds = {"train_micro_batch_size_per_gpu": 4, "gradient_accumulation_steps": 2, "gradient_clipping": 1.0,
          "bf16": {"enabled": True},
          "zero_optimization": {"stage": 3, "overlap_comm": True, "contiguous_gradients": True}}
    (workdir / "ds_config.json").write_text(json.dumps(ds))
    for path, snippet in COVERED_BY["test_deepspeed_examples_warn_as_shown"]:
        f = fence(path, snippet)
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            exec_python(f.body, f.where, _page_imports())
        got = [str(w.message) for w in caught if issubclass(w.category, ZeroConfigWarning)]
        assert len(got) == 1, (f.where, got)
        lines = [line.rstrip() for line in f"ZeroConfigWarning: {got[0]}".splitlines()]
        assert lines == _warning_sample(f), f.where



# -- examples that launch training: the shortest form, one launch each -------------------------


def run_zeropp_here(command: str) -> None:
    """A ``zeropp`` command line run in this process (no interpreter start-up): for the
    commands that neither train nor start processes (consolidate, report)."""
    from zeropp_strategy import cli

    argv = _zeropp_argv(command)
    assert argv and argv[0] in ("consolidate", "report"), command
    assert cli.main(argv) == 0, command


@covers(("docs/quickstart.md", "zeropp demo"),
        ("docs/callbacks.md", "zeropp demo --output-dir runs/demo"))
def test_demo_and_report_commands_run(workdir: Path) -> None:
    """``zeropp demo`` (2 steps instead of 60) and the callbacks page's demo + report
    commands (the reports in this process). ``runs/my_run`` of the last line is the demo's
    run, copied."""
    assert shell_commands(fence("docs/quickstart.md", "zeropp demo").body) == ["zeropp demo"]
    commands = shell_commands(fence("docs/callbacks.md", "zeropp demo --output-dir runs/demo").body)
    assert commands[0].startswith("zeropp demo ") and all(c.startswith("zeropp report ") for c in commands[1:])
    out = run_shell(with_flags(commands[0], "zeropp demo", "--max-steps 2"), workdir)
    assert "loss went from" in out
    shutil.copytree(workdir / "runs/demo", workdir / "runs/my_run")
    for command in commands[1:]:
        run_zeropp_here(command)
    for folder in ("runs/demo/report", "somewhere/else"):
        assert (workdir / folder / "report.md").is_file(), folder


@covers(("docs/fabric.md", "# fabric_train.py: python fabric_train.py"),
        ("docs/fabric.md", "fabric.load(\"ckpts/fabric.ckpt\", state)"))
def test_fabric_example_runs(workdir: Path) -> None:
    """fabric_train.py on 2 CPU processes, as written, then the page's next block (loading
    the checkpoint back) appended to it."""
    train = fence("docs/fabric.md", "# fabric_train.py: python fabric_train.py").body
    load = fence("docs/fabric.md", "fabric.load(\"ckpts/fabric.ckpt\", state)").body
    (workdir / "fabric_train.py").write_text(f"{train}\n\n{load}\nfabric.print('loaded step', state['step'])\n")
    out = run_shell("python fabric_train.py", workdir)
    assert re.search(r"loss \d+\.\d+", out) and "loaded step 7" in out, out[-3000:]


ACCELERATE_CPU_LAUNCH = "ZEROPP_CONFIG=recipes/accelerate/zero3.yaml \\\naccelerate launch --config_file recipes/accelerate/zeropp_cpu.yaml"


@covers(("docs/accelerate.md", "# train.py"),
        ("docs/accelerate.md", "accelerate launch --config_file recipes/accelerate/zeropp_cpu.yaml train.py"),
        ("docs/accelerate.md", "import os, zeropp_strategy.recipes as r"))
def test_accelerate_examples_run(workdir: Path) -> None:
    """The command that prints where the configs are installed, then the quick-start
    train.py under ``accelerate launch`` with the CPU config (2 processes)."""
    train = fence("docs/accelerate.md", "# train.py").body
    (workdir / "train.py").write_text(train)
    where = fence("docs/accelerate.md", "import os, zeropp_strategy.recipes as r").body
    launch = fence("docs/accelerate.md", "accelerate launch --config_file recipes/accelerate/zeropp_cpu.yaml train.py")
    out = run_shell(f"{where}\n{launch.body}", workdir)
    assert os.path.samefile(out.strip().splitlines()[0], REPO / "recipes" / "accelerate")
    assert "epoch 1: loss" in out and "ZeroPPAccelerator stage 3" in out, out[-3000:]
    assert (workdir / "ckpts" / "weights" / "model.safetensors").is_file()



@covers(("docs/accelerate.md", "    -m zeropp_strategy.accelerate.launch train.py --lr 1e-4"),
        ("docs/accelerate.md", ACCELERATE_CPU_LAUNCH),
        ("docs/accelerate.md", "ZEROPP_CONFIG=zero.yaml ACCELERATE_GRADIENT_ACCUMULATION_STEPS=4"),
        ("docs/accelerate.md", "ZEROPP_CONFIG=ds_config.json accelerate launch"),
        ("docs/accelerate.md", "ZEROPP_CONFIG=zero.yaml accelerate launch"))
def test_accelerate_launch_commands_parse(workdir: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The launch-module commands, without launching (tests/test_accelerate.py runs the
    launch module): the accelerate config they name parses
    as YAML, and the ``$ZEROPP_CONFIG`` file they name (a shipped recipe, or the page's
    ``zero.yaml`` / ``ds_config.json`` block just above the command) is a valid ZeroConfig."""
    import yaml

    from zeropp_strategy.accelerate import config_from_env

    for path, snippet in COVERED_BY["test_accelerate_launch_commands_parse"]:
        f = fence(path, snippet)
        words = shell_commands(f.body)[0].split()
        env = dict(w.split("=", 1) for w in words if re.match(r"^[A-Z_]+=", w))
        config_file = words[words.index("--config_file") + 1]
        assert yaml.safe_load((REPO / config_file).read_text())["distributed_type"], f.where
        assert words[words.index("-m") + 1:words.index("-m") + 3] == ["zeropp_strategy.accelerate.launch", "train.py"]
        name = env["ZEROPP_CONFIG"]
        if not name.startswith("recipes/"):  # the nearest block above that is this file
            above = [g for g in FENCES if g.path == path and g.line < f.line and g.lang in ("yaml", "json")
                     and (g.lang == "json" if name.endswith(".json") else g.body.startswith(f"# {name}"))]
            (workdir / name).write_text(above[-1].body)
        monkeypatch.setenv("ZEROPP_CONFIG", name)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            assert config_from_env().stage in (1, 2, 3), f.where


@covers(("docs/checkpointing.md", "# litmodel.py"),
        ("docs/checkpointing.md", "# formats.py"),
        ("docs/checkpointing.md", "zeropp consolidate ckpts/sharded.ckpt ckpts/consolidated.ckpt"),
        ("docs/checkpointing.md", "# lm.py"),
        ("docs/checkpointing.md", "python lm.py"),
        ("docs/checkpointing.md", "model = AutoModelForCausalLM.from_pretrained(\"export/lm\")"),
        ("docs/checkpointing.md", "consolidate(\"ckpts/sharded.ckpt\", \"ckpts/sharded-full.ckpt\")"))
def test_checkpoint_examples_run(workdir: Path) -> None:
    """litmodel.py + formats.py (both formats, 2 processes), ``zeropp consolidate`` of the
    sharded one; lm.py, its export to a Hugging Face folder and loading it back; the
    ``consolidate()`` calls on both checkpoints."""
    def body(snippet: str) -> str:
        return fence("docs/checkpointing.md", snippet).body

    (workdir / "litmodel.py").write_text(body("# litmodel.py"))
    (workdir / "formats.py").write_text(body("# formats.py"))
    (workdir / "lm.py").write_text(body("# lm.py"))
    run_shell("python formats.py\n" + body("python lm.py").splitlines()[0], workdir, timeout=300)
    run_zeropp_here(body("zeropp consolidate ckpts/sharded.ckpt ckpts/consolidated.ckpt"))
    run_zeropp_here(body("python lm.py").splitlines()[1])
    exec_python(body("consolidate(\"ckpts/sharded.ckpt\", \"ckpts/sharded-full.ckpt\")"), "consolidate()")
    model = exec_python(body("model = AutoModelForCausalLM.from_pretrained(\"export/lm\")"), "load")["model"]
    assert type(model).__name__ == "LlamaForCausalLM" and str(model.dtype) == "torch.bfloat16"
    assert (workdir / "ckpts/sharded.ckpt").is_dir() and (workdir / "ckpts/full.ckpt").is_file()
    for produced in ("ckpts/consolidated.ckpt", "ckpts/sharded-full.ckpt", "export/lm-bf16/config.json"):
        assert (workdir / produced).exists(), produced


@covers(("docs/quickstart.md", "self.model = build_my_transformer()  # your nn.Module"))
def test_quickstart_lightning_module_works() -> None:
    """The quickstart's LightningModule with a tiny Llama as ``build_my_transformer``: the
    hook builds once, a training step gives a loss, the optimizer covers the model."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    class Tiny(LlamaForCausalLM):
        def forward(self, batch):  # the page's training_step calls self.model(batch).loss
            return super().forward(input_ids=batch, labels=batch)

    def build_my_transformer():
        return Tiny(LlamaConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2,
                                num_key_value_heads=2, vocab_size=50, max_position_embeddings=16))

    f = fence("docs/quickstart.md", "self.model = build_my_transformer()  # your nn.Module")
    lit = exec_python(f.body, f.where, {"build_my_transformer": build_my_transformer})["LitLM"]()
    lit.configure_model()
    first = lit.model
    lit.configure_model()
    assert lit.model is first
    loss = lit.training_step(torch.randint(0, 50, (2, 8)), 0)
    assert torch.isfinite(loss)
    assert len(lit.configure_optimizers().param_groups[0]["params"]) == len(list(first.parameters()))


@covers(("docs/zeropp.md", "# error feedback from a DeepSpeed config"))
def test_error_feedback_example_runs() -> None:
    """zeropp.md's error-feedback example: the strategy takes both settings, and DeepSpeed's
    zeropp_loco_param block maps to them (the fence's own asserts)."""
    ns = exec_python(fence("docs/zeropp.md", "# error feedback from a DeepSpeed config").body, "zeropp.md")
    assert ns["strategy"].config.gradient_error_feedback and ns["strategy"].config.gradient_quant_bits_intra == 8


@covers(("docs/zeropp.md", "# 2-bit gradient codes across nodes, on top of zeropp_delta"))
def test_2bit_gradient_example_runs() -> None:
    """zeropp.md's 2-bit gradient example builds the config it shows (its own assert)."""
    ns = exec_python(fence("docs/zeropp.md", "# 2-bit gradient codes across nodes, on top of zeropp_delta").body,
                     "zeropp.md")
    config = ns["strategy"].config
    assert (config.gradient_quant_bits, config.gradient_quant_bits_intra, config.gradient_error_beta) == (2, 8, 0.0)


@covers(("docs/zeropp.md", "# zeropp with bf16 block scales across nodes"))
def test_bf16_block_scales_example_runs() -> None:
    """zeropp.md's bf16 block scales example builds the config it shows (its own asserts)."""
    ns = exec_python(fence("docs/zeropp.md", "# zeropp with bf16 block scales across nodes").body, "zeropp.md")
    assert ns["strategy"].config.cross_node_scale_bits == 16 and ns["strategy"].config.quantized_gradients


@covers(("docs/zeropp.md", "# the trained-weights table"))
def test_trained_weights_table_script_runs(capsys: pytest.CaptureFixture[str]) -> None:
    """The script behind zeropp.md's block-size table (the MiniLM weights ship with the
    test extra): one row per block size, block int8 below per-tensor int8."""
    f = fence("docs/zeropp.md", "# the trained-weights table")
    exec_python(f.body, f.where)
    rows = [line.split() for line in capsys.readouterr().out.strip().splitlines()]
    assert [r[0] for r in rows] == ["16", "32", "64", "128", "256"]
    assert all(0 < float(r[1]) < 1 for r in rows)


def test_forgotten_import_error_is_the_one_shown(workdir: Path) -> None:
    """README and quickstart show Lightning's error for a name used without
    ``import zeropp_strategy``: the same text, up to Lightning's list of choices."""
    shown = [f for f in FENCES if f.lang == "text" and "invalid strategy name" in f.body]
    assert {f.path for f in shown} == {"README.md", "docs/quickstart.md"}
    names = [re.search(r"strategy='(\w+)'", f.body).group(1) for f in shown]
    code = ("import lightning.pytorch as L\n"
            f"for name in {names!r}:\n"
            "    try:\n        L.Trainer(strategy=name)\n    except ValueError as e:\n        print(f'ValueError: {e}')\n")
    proc = subprocess.run([sys.executable, "-c", code], cwd=workdir, capture_output=True, text=True, timeout=120)
    real = [line for line in proc.stdout.splitlines() if line.startswith("ValueError")]
    assert len(real) == len(shown), proc.stdout + proc.stderr
    for f, line in zip(shown, real):
        assert line.split("Example choices")[0] == f.body.strip().split("Example choices")[0], (f.where, line)


@covers(("docs/checkpointing.md", "# write_hf.py"))
def test_write_hf_example_runs(workdir: Path) -> None:
    """checkpointing.md's ``write_hf`` example: the folder it writes loads back in bf16,
    equal to the model it was written from."""
    import torch

    ns = exec_python(fence("docs/checkpointing.md", "# write_hf.py").body, "write_hf.py")
    loaded, model = ns["loaded"], ns["model"]
    assert type(loaded).__name__ == "LlamaForCausalLM" and loaded.dtype == torch.bfloat16
    want = {k: v.to(torch.bfloat16) for k, v in model.state_dict().items()}
    assert all(torch.equal(loaded.state_dict()[k], v) for k, v in want.items())
    assert not list(workdir.glob("export/tiny.*"))  # no .tmp- sibling left


@covers(("docs/plan.md", "zeropp plan tiny --nodes 2 --gpus-per-node 2 --link 200Mbit"))
def test_plan_example_runs(capsys: pytest.CaptureFixture[str]) -> None:
    from zeropp_strategy.cli import main

    assert main(["plan", "tiny", "--nodes", "2", "--gpus-per-node", "2", "--link", "200Mbit"]) == 0
    out = capsys.readouterr().out
    assert "| zeropp_stage_3 |" in out and out.strip().splitlines()[-1].startswith("recommended: zeropp")


PLAN_CASES = {  # docs/plan.md: a command's fence -> the first line of the output the page shows
    "zeropp plan llama3-8B --nodes 2": "zeropp plan: llama3-8B (shape)",
    "zeropp plan llama-1B --nodes 1": "zeropp plan: llama-1B (shape)",
    "zeropp plan llama3-70B --nodes 2": "zeropp plan: llama3-70B (shape)",
}


@covers(*(("docs/plan.md", command) for command in PLAN_CASES))
@pytest.mark.parametrize("command", list(PLAN_CASES))
def test_plan_cases_print_what_the_page_shows(command: str, capsys: pytest.CaptureFixture[str]) -> None:
    """The page's three `zeropp plan` cases (published shapes, no download) print exactly the
    tables it shows: a change to the arithmetic must print them again."""
    from zeropp_strategy.cli import main

    argv = shlex.split(fence("docs/plan.md", command).body.replace("\\\n", " "))
    assert argv[0] == "zeropp" and main(argv[1:]) == 0
    assert capsys.readouterr().out.strip() == fence("docs/plan.md", PLAN_CASES[command]).body.strip()


@covers(("docs/plan.md", "zeropp plan tiny --nodes 2 --gpus-per-node 8 --with stage=1,offload_optimizer=cpu --explain"))
def test_plan_explain_example_prints_what_the_page_shows(capsys: pytest.CaptureFixture[str]) -> None:
    from zeropp_strategy.cli import main

    assert main(["plan", "tiny", "--nodes", "2", "--gpus-per-node", "8", "--with", "stage=1,offload_optimizer=cpu",
                 "--explain"]) == 0
    shown = fence("docs/plan.md", "stage=1,offload_optimizer=cpu:").body.strip()
    assert shown in capsys.readouterr().out


@covers(("docs/rlhf.md", 'zeropp chat runs/pipeline/actor --prompt "3+4=" --temperature 0'))
def test_chat_commands_run(workdir: Path) -> None:
    """rlhf.md's ``zeropp chat`` lines, on a tiny untrained model written by the pipeline's
    exporter at runs/pipeline/actor (its greedy answers are lowercase letters; the default
    --max-new-tokens is half its 64 positions). Stdin is at its end, so the session line
    ends at once, as Ctrl-D would end it."""
    from tests.test_chat import _build

    _build(workdir / "runs" / "pipeline" / "actor")
    body = fence("docs/rlhf.md", 'zeropp chat runs/pipeline/actor --prompt "3+4=" --temperature 0').body
    out = run_shell("exec </dev/null\n" + body, workdir, timeout=600)
    # stdout and stderr: the answers, and the note that the 32 letters of the first piped answer
    # leave no room for that turn in the next context (64 positions, 32 kept for the answer)
    forgot = "(the oldest 1 turn(s) were forgotten: the model takes 64 positions, 32 kept free for the answer)"
    answers = [line for line in out.splitlines() if line != forgot]
    assert out.count(forgot) == 1 and len(answers) == 3 and all(re.fullmatch(r"[a-z]{32}", a) for a in answers), out
    assert answers[0] == answers[1]  # --prompt "3+4=" and the first piped line: the same greedy answer


@covers(("docs/strategy.md", "from zeropp_strategy.engine.memory_plan import MemoryPlan"))
def test_memory_plan_reference_imports() -> None:
    (fence,) = find("docs/strategy.md", "from zeropp_strategy.engine.memory_plan import MemoryPlan")
    exec(fence.body, {})  # noqa: S102 - the documented import line

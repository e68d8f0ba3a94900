"""A stand-in for bf16 matmul hardware on a CPU that lacks it (benchmarks only).

This project's benchmark machine (x86_64, AVX2, no AVX-512 BF16 or AMX) has no bf16 matmul
instructions: torch falls back to a scalar kernel, and a (512 x 256) @ (256 x 1024) takes
about 230 ms in bf16 against 3-4 ms in fp32. A ``bf16-mixed`` step is then 95% matmul, every
system's step time is the same compute, and no link speed or collective shows. GPUs and
recent server CPUs run bf16 matmuls at least as fast as fp32 ones.

``fp32_matmuls()`` replaces, for its duration, the functions a transformers model multiplies
with (``torch.addmm``/``mm``/``bmm``/``matmul``, ``F.linear``,
``F.scaled_dot_product_attention``) by wrappers that, where the call would run in bf16 (a bf16
operand, or CPU autocast on), round the operands to bf16, compute in fp32 and round the result
to bf16, as bf16 hardware does (fp32 accumulation, bf16 output). The casts are ordinary
autograd ops, so the backward's matmuls run in fp32 too, in C++. Everything else is untouched:
parameters, activations, gradients and every collective keep the dtypes bf16-mixed gives them,
so the bytes on the wire are those of a bf16-mixed run; only the matmuls' speed is fp32's.
Every system of a benchmark runs under it alike (``bench_train.py --bf16-matmul fp32``).

It patches call sites rather than intercepting every operator (a ``TorchDispatchMode``),
because a mode runs Python for every operator, the backward's included: a process with a
Python thread of its own (this project's comm thread) then waits for the GIL far more than it
would on real hardware. A first version did that, and its figures were discarded. The wrappers
still add a few Python-level tensor calls per forward matmul (the casts), each of which can
hand the GIL to another thread of the process; the backward adds none.

Cost, measured on the machine above (GPT-2 4 x 256, 4 x 128 tokens, one process, one thread,
forward + backward): see ``python benchmarks/bf16_matmul.py``.
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Callable, Iterator

import torch
import torch.nn.functional as F

_TARGETS = [(torch, "addmm"), (torch, "mm"), (torch, "bmm"), (torch, "matmul"), (F, "linear"),
            (F, "scaled_dot_product_attention")]


def _bf16_then_fp32(arg):  # noqa: ANN001, ANN202
    if not (isinstance(arg, torch.Tensor) and arg.is_floating_point()):
        return arg
    return (arg if arg.dtype == torch.bfloat16 else arg.to(torch.bfloat16)).float()


def _wrap(fn: Callable) -> Callable:
    @functools.wraps(fn)
    def wrapped(*args, **kwargs):  # noqa: ANN002, ANN003, ANN202
        if not (torch.is_autocast_enabled("cpu") or any(
                isinstance(a, torch.Tensor) and a.dtype == torch.bfloat16 for a in (*args, *kwargs.values()))):
            return fn(*args, **kwargs)
        # autocast would cast the fp32 operands straight back to bf16
        with torch.autocast("cpu", enabled=False):
            out = fn(*map(_bf16_then_fp32, args), **{k: _bf16_then_fp32(v) for k, v in kwargs.items()})
        return out.to(torch.bfloat16)

    wrapped.__wrapped_fp32__ = True  # type: ignore[attr-defined]
    return wrapped


@contextlib.contextmanager
def fp32_matmuls() -> Iterator[None]:
    """bf16 matmuls computed in fp32 and rounded to bf16, within the block (process-wide)."""
    saved = [(mod, name, getattr(mod, name)) for mod, name in _TARGETS]
    try:
        for mod, name, fn in saved:
            setattr(mod, name, _wrap(fn))
        yield
    finally:
        for mod, name, fn in saved:
            setattr(mod, name, fn)


def matmul_mode(choice: str) -> contextlib.AbstractContextManager[None]:
    """The context a benchmark runs in for its ``--bf16-matmul`` choice: ``fp32_matmuls()``
    for ``"fp32"``, nothing for ``"native"`` (torch's own bf16 kernels)."""
    return fp32_matmuls() if choice == "fp32" else contextlib.nullcontext()


def _main() -> None:
    import sys
    import time
    from pathlib import Path

    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
    from benchmarks.bench_train import gpt2

    torch.set_num_threads(1)
    model, ids = gpt2("small"), torch.randint(0, 512, (4, 128))

    def step(ctx) -> float:  # noqa: ANN001
        start = time.perf_counter()
        with ctx:
            with torch.autocast("cpu", dtype=torch.bfloat16, enabled=ctx is not plain):
                loss = model(input_ids=ids, labels=ids).loss
            loss.backward()
        return time.perf_counter() - start

    plain = contextlib.nullcontext()
    for name, make in (("fp32", lambda: plain), ("bf16-mixed, torch's kernels", contextlib.nullcontext),
                       ("bf16-mixed, fp32_matmuls()", fp32_matmuls)):
        step(make())
        print(f"{name}: {min(step(make()) for _ in range(3)):.3f} s per forward + backward")


if __name__ == "__main__":
    _main()

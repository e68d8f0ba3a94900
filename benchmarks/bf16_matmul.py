"""A stand-in for bf16 matmul hardware on a CPU that lacks it (benchmarks only).

This project's benchmark machine (x86_64, AVX2, no AVX-512 BF16 or AMX) has no bf16 matmul
instructions: torch falls back to a scalar kernel, and a (512 x 256) @ (256 x 1024) takes
about 230 ms in bf16 against 3-4 ms in fp32. A ``bf16-mixed`` step is then 95% matmul, every
system's step time is the same compute, and no link speed or collective shows. GPUs and
recent server CPUs run bf16 matmuls at least as fast as fp32 ones.

``Fp32Matmuls`` is a ``TorchDispatchMode`` that runs every matmul (``mm``, ``addmm``,
``bmm``, ``baddbmm``) with a bf16 operand in fp32 and rounds the result to bf16, as bf16
hardware does (fp32 accumulation, bf16 output). Everything else is untouched: parameters,
activations, gradients and every collective keep the dtypes bf16-mixed gives them, so the
bytes on the wire are those of a bf16-mixed run; only the matmuls' speed is fp32's. It sits
below autograd, so the backward's matmuls take the same path. Every system of a benchmark
runs under it alike (``bench_train.py --bf16-matmul fp32``).

Cost, measured on the machine above (GPT-2 4 x 256, 4 x 128 tokens, one process, one thread,
forward + backward): fp32 0.19 s, bf16-mixed 3.6 s, bf16-mixed under this mode 0.31 s. The
gap to fp32 is the bf16 elementwise ops, the casts around each matmul, and the mode's Python
call on every operator (a few microseconds each).
"""

from __future__ import annotations

import torch
from torch.utils._python_dispatch import TorchDispatchMode

_aten = torch.ops.aten
MATMULS = frozenset({_aten.mm.default, _aten.addmm.default, _aten.bmm.default, _aten.baddbmm.default})


def _up(arg):  # noqa: ANN001, ANN202
    return arg.float() if isinstance(arg, torch.Tensor) and arg.dtype == torch.bfloat16 else arg


class Fp32Matmuls(TorchDispatchMode):
    """Matmuls with a bf16 operand run in fp32 and return bf16; every other op as it was."""

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # noqa: ANN001, ANN204
        kwargs = kwargs or {}
        if func in MATMULS and any(isinstance(a, torch.Tensor) and a.dtype == torch.bfloat16 for a in args):
            # autocast sits above this mode in the dispatcher and would cast the fp32 operands
            # straight back to bf16
            with torch.autocast("cpu", enabled=False):
                return func(*map(_up, args), **{k: _up(v) for k, v in kwargs.items()}).to(torch.bfloat16)
        return func(*args, **kwargs)

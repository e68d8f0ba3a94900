"""Block quantization for the ZeRO++ collectives: one API, two back ends.

    from zeropp_strategy import kernels
    codes, scales = kernels.quantize(x, block_elems=256, bits=8)
    y = kernels.dequantize(codes, scales, 256, x.numel(), bits=8, dtype=x.dtype)
    # qwZ: (world, payload_bytes) all-gathered int8 payloads -> world x numel values, one pass
    kernels.dequantize_gathered(gathered, code_bytes=codes.numel(), numel=x.numel(), block_elems=256, out=out)

Layout, rounding and error bound: [Note: quantization conventions] in reference.py.

[Note: kernel dispatch]
Every function here picks its back end per call, from its first tensor argument:
- Triton (triton_quant.py) when that tensor is on a CUDA device and triton imports;
- Triton on any device when the environment has ``ZEROPP_FORCE_TRITON=1`` (read at each
  call). For CPU tensors that needs ``TRITON_INTERPRET=1`` set before triton is first
  imported: that is how tests/test_kernels.py runs the kernels without a GPU;
- the torch reference (reference.py) otherwise: CPU tensors, or CUDA without triton.
``dequantize_gathered`` is the exception: torch on every device (no Triton kernel; a few
elementwise ops, each over all rows at once), equal to ``dequantize`` of each row on either
back end.
Both back ends produce the same bytes (codes, scales and dequantized values; checked by
tests/test_kernels.py), so which one a rank used never changes what its peers receive.
triton is imported on first Triton dispatch only, so this package imports without it.

Arguments are checked the same way on both paths, before any kernel runs: ``bits`` is 8 or 4,
``block_elems`` a power of two in 32..65536 (what the kernels support and what ZeroConfig
accepts), codes are int8 (bits=8) or uint8 (bits=4) with fp32 scales, and the buffers cover
``numel``. So a call that works on CPU also works on a GPU, and a wrong buffer is an error
naming it rather than an out-of-bounds read in a kernel.
"""

from __future__ import annotations

import functools
import importlib.util
import os
from collections.abc import Sequence

import torch

from zeropp_strategy.kernels.reference import (
    QMAX,
    dequant_reduce_quantize_ref,
    dequantize_gathered_ref,
    dequantize_ref,
    num_blocks,
    padded_numel,
    quantize_ref,
    quantized_nbytes,
    swizzle_quantize_ref,
)

__all__ = [
    "QMAX",
    "check_chunks",
    "check_gathered",
    "check_input",
    "check_quant_args",
    "check_quantized",
    "dequant_reduce_quantize",
    "dequantize",
    "dequantize_gathered",
    "kernel_backend",
    "normalize_order",
    "num_blocks",
    "padded_numel",
    "quantize",
    "quantized_nbytes",
    "swizzle_quantize",
]

MIN_BLOCK_ELEMS = 32
MAX_BLOCK_ELEMS = 65536


def check_quant_args(block_elems: int, bits: int) -> None:
    if bits not in QMAX:
        raise ValueError(f"bits={bits} is not supported. Fix: use 8 or 4.")
    if (
        not isinstance(block_elems, int)
        or not MIN_BLOCK_ELEMS <= block_elems <= MAX_BLOCK_ELEMS
        or block_elems & (block_elems - 1)
    ):
        raise ValueError(
            f"block_elems={block_elems!r} is not supported. "
            f"Fix: use a power of two in {MIN_BLOCK_ELEMS}..{MAX_BLOCK_ELEMS} (256 is the default)."
        )


def check_input(x: torch.Tensor) -> None:
    if not x.is_floating_point():
        raise TypeError(f"x has dtype {x.dtype}; quantize takes a floating-point tensor. Fix: cast it to float.")


def check_chunks(numel: int, chunk_elems: int) -> int:
    """Number of chunks of ``chunk_elems`` in ``numel`` elements (which it must divide)."""
    if not isinstance(chunk_elems, int) or chunk_elems <= 0 or numel % chunk_elems:
        raise ValueError(
            f"chunk_elems={chunk_elems!r} does not divide the input's {numel} elements. "
            "Fix: pass a positive chunk size that splits the tensor evenly."
        )
    return numel // chunk_elems


def normalize_order(order: Sequence[int], n_chunks: int) -> list[int]:
    """Chunk indices in [0, n_chunks); negatives count from the end, as in torch indexing."""
    out = []
    for i in order:
        i = int(i)
        if not -n_chunks <= i < n_chunks:
            raise IndexError(f"order contains {i}, outside the {n_chunks} chunks. Fix: use indices 0..{n_chunks - 1}.")
        out.append(i % n_chunks)
    return out


def check_quantized(
    codes: torch.Tensor, scales: torch.Tensor, block_elems: int, numel: int, bits: int, *, sources: int = 1
) -> tuple[int, int]:
    """(codes, scales) elements per source, after checking that ``sources`` quantized copies
    laid back to back each cover ``numel`` elements in blocks of ``block_elems`` at ``bits``."""
    want = torch.int8 if bits == 8 else torch.uint8
    if codes.dtype != want:
        raise TypeError(f"codes have dtype {codes.dtype} for bits={bits}. Fix: pass them as {want} (.view() it).")
    if scales.dtype != torch.float32:
        raise TypeError(f"scales have dtype {scales.dtype}. Fix: pass the fp32 scales that quantize returned.")
    if not isinstance(sources, int) or sources < 1 or codes.numel() % sources or scales.numel() % sources:
        raise ValueError(
            f"sources={sources!r} does not split codes ({codes.numel()}) and scales ({scales.numel()}) evenly. "
            "Fix: pass the number of quantized copies laid back to back."
        )
    codes_per, scales_per = codes.numel() // sources, scales.numel() // sources
    if codes_per * 8 != scales_per * block_elems * bits or not 0 <= numel <= scales_per * block_elems:
        raise ValueError(
            f"codes ({codes_per} per source) and scales ({scales_per} per source) do not hold numel={numel} "
            f"elements in blocks of block_elems={block_elems} at bits={bits}. "
            "Fix: pass the numel, block_elems and bits the tensor was quantized with."
        )
    return codes_per, scales_per


def check_gathered(gathered: torch.Tensor, code_bytes: int, numel: int, block_elems: int, out: torch.Tensor) -> None:
    """``gathered`` holds one int8 payload (codes, then fp32 scales as bytes) per row for
    ``numel`` elements in blocks of ``block_elems``, and ``out`` takes every row's values."""
    if gathered.dtype != torch.uint8 or gathered.dim() != 2:
        raise TypeError(
            f"gathered is {gathered.dtype} of shape {tuple(gathered.shape)}; it must be uint8 of shape "
            "(world, payload_bytes). Fix: pass the all-gathered payloads viewed as uint8, one row per rank."
        )
    if not isinstance(numel, int) or numel < 0:
        raise ValueError(f"numel={numel!r} is not a count of elements. Fix: pass the shard's numel.")
    want_codes, nb = padded_numel(numel, block_elems), num_blocks(numel, block_elems)
    if code_bytes != want_codes or gathered.shape[1] != want_codes + 4 * nb:
        raise ValueError(
            f"code_bytes={code_bytes!r} and payload rows of {gathered.shape[1]} bytes do not hold numel={numel} "
            f"elements as int8 blocks of block_elems={block_elems} (want code_bytes={want_codes} and "
            f"{want_codes + 4 * nb}-byte rows). Fix: pass the numel and block_elems the shard was quantized with."
        )
    if not out.is_floating_point() or out.numel() != gathered.shape[0] * numel or not out.is_contiguous():
        raise ValueError(
            f"out is {out.dtype}{tuple(out.shape)}{'' if out.is_contiguous() else ', not contiguous'}; it must be a "
            f"contiguous float tensor of world x numel = {gathered.shape[0] * numel} elements. "
            "Fix: pass the all-gather output buffer."
        )
    if out.device != gathered.device:
        raise ValueError(f"out is on {out.device}, gathered on {gathered.device}. Fix: put both on one device.")


def _force_triton() -> bool:
    return os.environ.get("ZEROPP_FORCE_TRITON", "") == "1"


@functools.cache
def _triton_importable() -> bool:
    return importlib.util.find_spec("triton") is not None


def kernel_backend(t: torch.Tensor) -> str:
    """"triton" or "torch": the back end a call with ``t`` as first tensor would use."""
    if _force_triton():
        if not _triton_importable():
            raise RuntimeError("ZEROPP_FORCE_TRITON=1 but triton is not installed. Fix: install triton, or unset it.")
        if not t.is_cuda and os.environ.get("TRITON_INTERPRET", "") != "1":
            raise RuntimeError(
                "ZEROPP_FORCE_TRITON=1 with a CPU tensor needs the Triton interpreter. "
                "Fix: also set TRITON_INTERPRET=1 before triton is imported, or unset ZEROPP_FORCE_TRITON."
            )
        return "triton"
    return "triton" if t.is_cuda and _triton_importable() else "torch"


def _triton():
    from zeropp_strategy.kernels import triton_quant

    return triton_quant


def quantize(x: torch.Tensor, block_elems: int, bits: int = 8) -> tuple[torch.Tensor, torch.Tensor]:
    """x (any shape, float) -> (codes, scales): codes int8 [padded] (bits=8) or uint8
    [padded // 2] (bits=4, two per byte), scales fp32 [num_blocks]; padded = numel rounded up
    to whole blocks."""
    check_quant_args(block_elems, bits)
    check_input(x)
    if kernel_backend(x) == "triton":
        return _triton().quantize_triton(x, block_elems, bits)
    return quantize_ref(x, block_elems, bits)


def dequantize(
    codes: torch.Tensor,
    scales: torch.Tensor,
    block_elems: int,
    numel: int,
    bits: int = 8,
    dtype: torch.dtype = torch.float32,
) -> torch.Tensor:
    """Inverse of ``quantize``: a 1-D tensor of ``numel`` elements in ``dtype``."""
    check_quant_args(block_elems, bits)
    check_quantized(codes, scales, block_elems, numel, bits)
    if kernel_backend(codes) == "triton":
        return _triton().dequantize_triton(codes, scales, block_elems, numel, bits, dtype)
    return dequantize_ref(codes, scales, block_elems, numel, bits, dtype)


def dequantize_gathered(
    gathered: torch.Tensor, *, code_bytes: int, numel: int, block_elems: int, out: torch.Tensor
) -> None:
    """qwZ's receive side: ``gathered`` (world, payload_bytes) uint8, row r the payload
    ``cat([codes.view(uint8), scales.view(uint8)])`` of ``quantize(shard, block_elems, 8)`` for
    a ``numel``-element shard (``code_bytes`` = padded numel) -> ``out[r * numel : (r + 1) *
    numel]`` = row r dequantized into out's float dtype, every op over all rows at once (no
    loop over ranks). Equal to ``dequantize`` of each row; torch on every device (see
    [Note: kernel dispatch])."""
    check_quant_args(block_elems, 8)
    check_gathered(gathered, code_bytes, numel, block_elems, out)
    dequantize_gathered_ref(gathered, code_bytes=code_bytes, numel=numel, block_elems=block_elems, out=out)


def swizzle_quantize(
    x: torch.Tensor, order: Sequence[int] | torch.Tensor, chunk_elems: int, block_elems: int, bits: int = 8
) -> tuple[torch.Tensor, torch.Tensor]:
    """Quantize chunk ``order[i]`` of x (x viewed as (n_chunks, chunk_elems)) into output slot
    i, each chunk padded to whole blocks on its own: codes/scales laid out slot after slot.
    The Triton path reads x in place (no reordered copy)."""
    check_quant_args(block_elems, bits)
    check_input(x)
    n_chunks = check_chunks(x.numel(), chunk_elems)
    if kernel_backend(x) == "triton":
        return _triton().swizzle_quantize_triton(x, order, chunk_elems, block_elems, bits)
    if isinstance(order, torch.Tensor):
        order = order.tolist()
    return swizzle_quantize_ref(x, normalize_order(order, n_chunks), chunk_elems, block_elems, bits)


def dequant_reduce_quantize(
    codes: torch.Tensor,
    scales: torch.Tensor,
    *,
    sources: int,
    numel: int,
    block_elems: int,
    bits: int = 8,
    requantize: bool = True,
) -> tuple[torch.Tensor, torch.Tensor] | torch.Tensor:
    """``sources`` quantized copies of a numel-element tensor, back to back -> their fp32 sum
    (added in source order), requantized to (codes, scales), or the fp32 sum itself when
    ``requantize`` is False."""
    check_quant_args(block_elems, bits)
    check_quantized(codes, scales, block_elems, numel, bits, sources=sources)
    if kernel_backend(codes) == "triton":
        return _triton().dequant_reduce_quantize_triton(
            codes, scales, sources=sources, numel=numel, block_elems=block_elems, bits=bits, requantize=requantize
        )
    return dequant_reduce_quantize_ref(
        codes, scales, sources=sources, numel=numel, block_elems=block_elems, bits=bits, requantize=requantize
    )

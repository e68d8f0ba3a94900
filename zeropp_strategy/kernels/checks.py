"""Layer: kernels. Argument checks shared by both back ends of ``zeropp_strategy.kernels``
(the torch reference dispatch in ``__init__`` and triton_quant.py): each raises an error
naming the bad argument and its fix before any kernel runs. Re-exported by the package.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from zeropp_strategy.kernels.reference import QMAX, code_dtype, num_blocks, padded_numel

__all__ = [
    "MAX_BLOCK_ELEMS",
    "MIN_BLOCK_ELEMS",
    "check_chunks",
    "check_gathered",
    "check_input",
    "check_into",
    "check_quant_args",
    "check_quantized",
    "normalize_order",
]

MIN_BLOCK_ELEMS = 32
MAX_BLOCK_ELEMS = 65536


def check_quant_args(block_elems: int, bits: int) -> None:
    if bits not in QMAX:
        raise ValueError(f"bits={bits} is not supported. Fix: use 8, 4 or 2.")
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


def check_into(x: torch.Tensor, codes: torch.Tensor, scales: torch.Tensor, block_elems: int, bits: int,
               residual: bool) -> None:
    """``codes`` and ``scales`` can take ``quantize(x, block_elems, bits)`` in place, and with
    ``residual`` x can take what it drops (fp32, contiguous, whole blocks)."""
    n = x.numel()
    want_codes, want_scales = padded_numel(n, block_elems) * bits // 8, num_blocks(n, block_elems)
    for name, t, dtype, numel in (("codes", codes, code_dtype(bits), want_codes),
                                  ("scales", scales, torch.float32, want_scales)):
        if t.dtype != dtype or t.numel() != numel or not t.is_contiguous() or t.device != x.device:
            raise ValueError(
                f"{name} is {t.dtype}{tuple(t.shape)} on {t.device}; quantize_into writes {numel} {dtype} elements "
                f"for x's {n} at block_elems={block_elems}, bits={bits}. Fix: pass a contiguous buffer of that size "
                "on x's device."
            )
    if residual and (x.dtype != torch.float32 or not x.is_contiguous() or n % block_elems):
        raise ValueError(
            f"x is {x.dtype}{tuple(x.shape)}{'' if x.is_contiguous() else ', not contiguous'}; residual=True "
            f"overwrites it with what the codes drop, which needs fp32, contiguous and whole blocks of "
            f"{block_elems}. Fix: quantize an fp32 copy padded to whole blocks, or pass residual=False."
        )


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
    want = code_dtype(bits)
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


def check_out(out: torch.Tensor, numel: int, device: torch.device) -> None:
    """``out`` can take a dequantized tensor of ``numel`` elements on ``device`` in place."""
    if not out.is_floating_point() or out.numel() != numel or not out.is_contiguous() or out.device != device:
        raise ValueError(
            f"out is {out.dtype}{tuple(out.shape)} on {out.device}{'' if out.is_contiguous() else ', not contiguous'}; "
            f"it must be a contiguous float tensor of numel={numel} elements on {device}. "
            "Fix: pass a buffer of the dequantized size on the codes' device, or no out."
        )


def check_gathered(gathered: torch.Tensor, code_bytes: int, numel: int, block_elems: int, out: torch.Tensor,
                   bits: int = 8) -> None:
    """``gathered`` holds one int8 (or int4) payload (codes, then fp32 scales as bytes) per row
    for ``numel`` elements in blocks of ``block_elems``, and ``out`` takes every row's values."""
    if gathered.dtype != torch.uint8 or gathered.dim() != 2:
        raise TypeError(
            f"gathered is {gathered.dtype} of shape {tuple(gathered.shape)}; it must be uint8 of shape "
            "(world, payload_bytes). Fix: pass the all-gathered payloads viewed as uint8, one row per rank."
        )
    if not isinstance(numel, int) or numel < 0:
        raise ValueError(f"numel={numel!r} is not a count of elements. Fix: pass the shard's numel.")
    want_codes, nb = padded_numel(numel, block_elems) * bits // 8, num_blocks(numel, block_elems)
    if code_bytes != want_codes or gathered.shape[1] != want_codes + 4 * nb:
        raise ValueError(
            f"code_bytes={code_bytes!r} and payload rows of {gathered.shape[1]} bytes do not hold numel={numel} "
            f"elements as int{bits} blocks of block_elems={block_elems} (want code_bytes={want_codes} and "
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

"""Layer: kernels. Block quantization for the ZeRO++ collectives: one API, two back ends.

    from zeropp_strategy import kernels
    codes, scales = kernels.quantize(x, block_elems=256, bits=8)
    y = kernels.dequantize(codes, scales, 256, x.numel(), bits=8, dtype=x.dtype)
    # qwZ: (world, payload_bytes) all-gathered int8 (or int4, bits=4) payloads -> world x numel values
    kernels.dequantize_gathered(gathered, code_bytes=codes.numel(), numel=x.numel(), block_elems=256, out=out)

Layout, rounding and error bound: [Note: quantization conventions] in reference.py.

[Note: kernel dispatch]
Every function here picks its back end per call, from its first tensor argument:
- Triton (triton_quant.py) when that tensor is on a CUDA device and triton imports;
- Triton on any device when the environment has ``ZEROPP_FORCE_TRITON=1`` (read at each
  call). For CPU tensors that needs ``TRITON_INTERPRET=1`` set before triton is first
  imported: that is how tests/test_kernels.py runs the kernels without a GPU;
- the torch reference (reference.py) otherwise: CPU tensors, or CUDA without triton.
``dequantize_gathered`` is the exception for int8: torch on every device (no Triton kernel;
a few elementwise ops, each over all rows at once); its int4 path copies every row's codes
and scales side by side and makes one ``dequantize`` of them (dispatched as above) straight
into ``out`` when a shard is whole blocks; a shard ending in a partial block needs a
transient buffer of the gathered size, whose rows are then copied into ``out``. Either way
it equals ``dequantize`` of each row on either back end.
Both back ends produce the same bytes (codes, scales and dequantized values; checked by
tests/test_kernels.py), so which one a rank used never changes what its peers receive.
(``quantize_into``'s residual, which stays on the rank, may differ in the sign of a zero.)
triton is imported on first Triton dispatch only, so this package imports without it.

Arguments are checked the same way on both paths, before any kernel runs: ``bits`` is 8, 4
or 2 (2-bit codes: qwZ's weight deltas and 2-bit gradients across nodes),
``block_elems`` a power of two in 32..65536 (what the kernels support and what ZeroConfig
accepts), codes are int8 (bits=8) or uint8 (bits=4, 2) with fp32 scales, and the buffers cover
``numel``. So a call that works on CPU also works on a GPU, and a wrong buffer is an error
naming it rather than an out-of-bounds read in a kernel.
"""

from __future__ import annotations

import functools
import importlib.util
import os
from collections.abc import Sequence

import torch

from zeropp_strategy.kernels.checks import (
    MAX_BLOCK_ELEMS as MAX_BLOCK_ELEMS,
    MIN_BLOCK_ELEMS as MIN_BLOCK_ELEMS,
    check_chunks,
    check_gathered,
    check_input,
    check_into,
    check_out,
    check_quant_args,
    check_quantized,
    normalize_order,
)
from zeropp_strategy.kernels.reference import (
    QMAX,
    code_dtype,
    dequant_reduce_quantize_ref,
    dequantize_gathered_ref,
    dequantize_ref,
    num_blocks,
    padded_numel,
    quantize_into_ref,
    quantize_ref,
    quantized_nbytes,
    swizzle_quantize_ref,
)

__all__ = [
    "QMAX",
    "check_chunks",
    "check_gathered",
    "check_input",
    "check_into",
    "check_out",
    "check_quant_args",
    "check_quantized",
    "code_dtype",
    "dequant_reduce_quantize",
    "dequantize",
    "dequantize_gathered",
    "kernel_backend",
    "normalize_order",
    "num_blocks",
    "padded_numel",
    "quantize",
    "quantize_into",
    "quantized_nbytes",
    "swizzle_quantize",
]

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


def quantize(
    x: torch.Tensor, block_elems: int, bits: int = 8, *, bf16_scales: bool = False
) -> tuple[torch.Tensor, torch.Tensor]:
    """x (any shape, float) -> (codes, scales): codes int8 [padded] (bits=8) or uint8
    [padded // 2] (bits=4, two per byte) or [padded // 4] (bits=2, four levels, four per
    byte), scales fp32 [num_blocks]; padded = numel rounded up
    to whole blocks. ``bf16_scales``: every scale rounded up to a bf16 value before the codes
    are computed, for a payload that sends it in 2 bytes ([Note: quantization conventions])."""
    check_quant_args(block_elems, bits)
    check_input(x)
    if kernel_backend(x) == "triton":
        return _triton().quantize_triton(x, block_elems, bits, bf16_scales=bf16_scales)
    return quantize_ref(x, block_elems, bits, bf16_scales=bf16_scales)


def quantize_into(
    x: torch.Tensor, codes: torch.Tensor, scales: torch.Tensor, block_elems: int, bits: int = 8, *,
    bf16_scales: bool = False, residual: bool = False,
) -> None:
    """``quantize`` written into ``codes`` and ``scales`` (contiguous, of quantize's sizes),
    and with ``residual`` x (fp32, contiguous, whole blocks) overwritten with what the codes
    drop, ``x - dequantize(codes, scales)``: error feedback's two steps in one call. The
    torch back end (CPU, or CUDA without triton) takes the residual from the rounded
    quotients instead of decoding the codes: the same values, but for the sign of a zero
    (reference.quantize_into_ref), the one place where the back ends' bytes may differ;
    Triton quantizes, then decodes and subtracts."""
    check_quant_args(block_elems, bits)
    check_input(x)
    check_into(x, codes, scales, block_elems, bits, residual)
    if kernel_backend(x) != "triton":
        quantize_into_ref(x, codes, scales, block_elems, bits, bf16_scales=bf16_scales, residual=residual)
        return
    c, s = _triton().quantize_triton(x, block_elems, bits, bf16_scales=bf16_scales)
    codes.copy_(c.view(-1))
    scales.copy_(s)
    if residual:
        x.view(-1).sub_(_triton().dequantize_triton(c, s, block_elems, x.numel(), bits, torch.float32, out=None))


def dequantize(
    codes: torch.Tensor,
    scales: torch.Tensor,
    block_elems: int,
    numel: int,
    bits: int = 8,
    dtype: torch.dtype = torch.float32,
    *,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """Inverse of ``quantize``: a 1-D tensor of ``numel`` elements in ``dtype``; with ``out``
    (a contiguous float tensor of ``numel`` elements on the codes' device) written there
    instead, in ``out``'s dtype, and ``out`` returned: no buffer of the result's size besides it."""
    check_quant_args(block_elems, bits)
    check_quantized(codes, scales, block_elems, numel, bits)
    flat = None
    if out is not None:
        check_out(out, numel, codes.device)
        flat = out.view(-1)
    if kernel_backend(codes) == "triton":
        result = _triton().dequantize_triton(codes, scales, block_elems, numel, bits, dtype, out=flat)
    else:
        result = dequantize_ref(codes, scales, block_elems, numel, bits, dtype, out=flat)
    return result if out is None else out


def dequantize_gathered(
    gathered: torch.Tensor, *, code_bytes: int, numel: int, block_elems: int, out: torch.Tensor, bits: int = 8
) -> None:
    """qwZ's receive side: ``gathered`` (world, payload_bytes) uint8, row r the payload
    ``cat([codes.view(uint8), scales.view(uint8)])`` of ``quantize(shard, block_elems, bits)``
    for a ``numel``-element shard (``code_bytes`` = padded numel x bits / 8) -> ``out[r * numel
    : (r + 1) * numel]`` = row r dequantized into out's float dtype, every op over all rows
    at once (no loop over ranks). Equal to ``dequantize`` of each row. int8: torch on every
    device; int4: the rows' codes and scales side by side, then one ``dequantize`` of them all
    (Triton on CUDA, [Note: kernel dispatch])."""
    check_quant_args(block_elems, bits)
    check_gathered(gathered, code_bytes, numel, block_elems, out, bits)
    if bits == 8:
        dequantize_gathered_ref(gathered, code_bytes=code_bytes, numel=numel, block_elems=block_elems, out=out)
        return
    world, nb = gathered.shape[0], num_blocks(numel, block_elems)
    if world == 0 or numel == 0:
        return
    codes = gathered[:, :code_bytes].reshape(-1)  # a copy: every row's codes, one after another
    scale_bytes = gathered[:, code_bytes : code_bytes + 4 * nb].reshape(-1)
    if scale_bytes.storage_offset() % 4:  # one row of a misaligned buffer: reshape kept the view
        scale_bytes = scale_bytes.clone()
    scales = scale_bytes.view(torch.float32)
    padded = padded_numel(numel, block_elems)
    if padded == numel:  # whole blocks: the rows' values lie in out as dequantize writes them
        dequantize(codes, scales, block_elems, world * numel, bits, out=out)
        return
    values = dequantize(codes, scales, block_elems, world * padded, bits, dtype=out.dtype)
    out.view(world, numel).copy_(values.view(world, padded)[:, :numel])


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
    bf16_scales: bool = False,
) -> tuple[torch.Tensor, torch.Tensor] | torch.Tensor:
    """``sources`` quantized copies of a numel-element tensor, back to back -> their fp32 sum
    (added in source order), requantized to (codes, scales) (``bf16_scales`` as in
    ``quantize``), or the fp32 sum itself when ``requantize`` is False."""
    check_quant_args(block_elems, bits)
    check_quantized(codes, scales, block_elems, numel, bits, sources=sources)
    kw = dict(sources=sources, numel=numel, block_elems=block_elems, bits=bits, requantize=requantize,
              bf16_scales=bf16_scales)
    if kernel_backend(codes) == "triton":
        return _triton().dequant_reduce_quantize_triton(codes, scales, **kw)
    return dequant_reduce_quantize_ref(codes, scales, **kw)

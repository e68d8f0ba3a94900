"""Layer: kernels. Block quantization in Triton: the CUDA path behind ``zeropp_strategy.kernels``.

    pytest tests/test_kernels.py -q     # vs the reference (on CPU: under TRITON_INTERPRET=1)
    python benchmarks/kernels.py        # GB/s

Each ``_name_kernel`` has a launcher ``name_triton()`` and a torch twin ``name_ref()`` in
reference.py, which owns the layout and [Note: quantization conventions]. The kernels
reproduce the reference bit for bit (codes, scales and dequantized values); see
[Note: bit-exact agreement with the reference] for the places where that takes care.

This module imports triton at the top; ``zeropp_strategy.kernels`` imports it only when a
call dispatches here, so the package works where triton is absent.

[Note: bit-exact agreement with the reference]
- Division. On NVIDIA GPUs Triton lowers fp32 ``a / b`` to ``div.full.f32`` (approximate,
  up to 2 ulp); torch divides correctly rounded. A scale one ulp off moves ``x / scale``
  across a .5 tie, so both ``absmax / qmax`` and ``x / scale`` use ``tl.math.div_rn``.
- Rounding. ``libdevice.rint`` is an extern call, which the Triton interpreter cannot run
  (``extern_elementwise`` is not supported there), so the CPU tests could not cover it.
  We round with ``(y + 1.5 * 2**23) - 1.5 * 2**23`` instead: the sum lies in [2**23, 2**24),
  where fp32 spacing is 1, and IEEE addition rounds to nearest, ties to even, which is
  exactly ``torch.round``. It needs |y| < 2**22; here |y| <= 2 * qmax (|y| <= qmax except
  when the scale is subnormal and its rounding loses up to half a unit of its last place).
  Triton sets no fast-math (reassociation) flags, so the compiler cannot fold it to ``y``.
- 2-bit floor. The level ``2 floor(y / 2) + 1`` takes its floor from the same rounding,
  ``r = rne(y / 2)`` less one where ``r > y / 2``; halving is exact, and no step flushes a
  subnormal (the PTX test checks for ``.ftz``).
- NaN and infinities. A block holding a NaN or an infinity has a NaN scale and codes 0 (at
  2 bits, level +1), as the reference gives: ``_absmax`` flags them itself (``tl.max``
  drops NaNs), and the running absmax of a long block keeps the NaN (``_max_nan``).
- Fused multiply-add. ``dequant_reduce_quantize`` sums ``code * scale`` over sources; torch
  rounds the product, then the sum, and an FMA would round once. Every launch passes
  ``enable_fp_fusion=False`` (Triton 3.9 fuses by default).
- bf16 output. The interpreter truncates fp32 -> bf16 casts; a GPU rounds to nearest even.
  ``_round_to`` rounds on the bits, so both run the same arithmetic.
The interpreter cannot show how the kernels lower for a GPU, so
tests/test_kernels.py::test_ptx_uses_exact_arithmetic compiles them for sm_90 (no GPU
needed) and checks the PTX: ``div.rn.f32`` and no ``div.full`` (which plain ``/`` gives),
no ``fma``, two ``add.rn.f32`` per element for the rounding.

[Note: block tiles]
A program owns ``ROWS`` consecutive blocks laid out as a (ROWS, W) tile, W = min(block_elems,
_TILE_ELEMS), ROWS = _TILE_ELEMS // W: small blocks are batched so each program still moves
_TILE_ELEMS elements, and a block that fits in W is read once (absmax and codes from the same
registers). A block longer than _TILE_ELEMS is swept twice in W-sized pieces (absmax, then
codes); the second read mostly hits L2. Output block ``b`` always starts at element
``b * block_elems`` of the padded code stream; only the source address depends on the op.
"""

from __future__ import annotations

import contextlib
from collections.abc import Sequence

import torch
import triton
import triton.language as tl

from zeropp_strategy.kernels.checks import (
    check_chunks,
    check_input,
    check_out,
    check_quant_args,
    check_quantized,
    normalize_order,
)
from zeropp_strategy.kernels.reference import QMAX, code_dtype, num_blocks, padded_numel

# Elements a program handles per pass: 4096 (16 KiB of fp32 input), the size the Triton
# tutorials and Liger-Kernel use for memory-bound elementwise kernels, with 8 warps (16
# elements per thread: with 16-aligned buffers the PTX has 16-byte vector loads and stores
# and no spills). NOT yet measured on a GPU: none was available when this was written.
# Re-tune with `python benchmarks/kernels.py --tile-sweep` on one and record the table that
# chose the value here.
_TILE_ELEMS = 4096
_NUM_WARPS = 8

_RNE_MAGIC = tl.constexpr(12582912.0)  # 1.5 * 2**23; see [Note: bit-exact agreement ...]


# -- shared pieces -------------------------------------------------------------------------


@triton.jit
def _codes(x, scale, QMAX: tl.constexpr, BITS: tl.constexpr):
    """x (ROWS, W) fp32, scale (ROWS,) fp32 -> int32 codes: in [-QMAX, QMAX] at 8 and 4 bits;
    at 2 bits f in [-2, 1], of the odd level 2 f + 1 nearest x / scale (a tie goes up)."""
    nonzero = scale > 0
    safe = tl.where(nonzero, scale, 1.0)
    y = tl.math.div_rn(x, safe[:, None])
    if BITS == 2:  # f = floor(y / 2): halving is exact, and floor is the rounding below, less
        v = y * 0.5  # one where it went up (no libdevice call, which the interpreter lacks)
        r = (v + _RNE_MAGIC) - _RNE_MAGIC
        y = tl.minimum(tl.maximum(tl.where(r > v, r - 1.0, r), -2.0), 1.0)
    else:
        y = (y + _RNE_MAGIC) - _RNE_MAGIC  # round half to even
        y = tl.minimum(tl.maximum(y, -QMAX * 1.0), QMAX * 1.0)
    y = tl.where(nonzero[:, None], y, 0.0)  # an all-zero block: scale 0, codes 0 (2 bits: level +1)
    return y.to(tl.int32)


@triton.jit
def _max_nan(a, b):
    return tl.maximum(a, b, propagate_nan=tl.PropagateNan.ALL)


@triton.jit
def _absmax(x):
    """(ROWS, W) -> (ROWS,) largest |x| per row, NaN where a row holds a NaN or an infinity, as
    the reference's scales: ``tl.max`` drops NaNs, which would give a block with a NaN a finite
    scale and turn the NaN into a finite code, hiding it from the non-finite checks
    downstream; an infinite absmax would divide the infinity itself to NaN, whose code is
    unspecified. A second max over a flag rather than ``tl.reduce`` with ``_max_nan``: the
    same values, and the interpreter runs a custom combine in Python (the CPU Triton cases:
    121 s against 13 s)."""
    ax = tl.abs(x)
    finite = ax < float("inf")  # false for NaN too
    bad = tl.max(tl.where(finite, 0.0, 1.0), axis=1) > 0
    # the non-finite left out of the max: the interpreter's max warns on a row of NaNs only
    return tl.where(bad, float("nan"), tl.max(tl.where(finite, ax, 0.0), axis=1))


@triton.jit
def _scale_of(absmax, QMAX: tl.constexpr, BF16_SCALES: tl.constexpr):
    scale = tl.math.div_rn(absmax, tl.full(absmax.shape, QMAX, tl.float32))
    if BF16_SCALES:  # reference.round_up_to_bf16, on the bit pattern
        b = scale.to(tl.int32, bitcast=True)
        up = tl.minimum((b + 0xFFFF) & -0x10000, 0x7F7F0000)
        scale = tl.where((b & 0x7F800000) != 0x7F800000, up, b).to(tl.float32, bitcast=True)
    return scale


@triton.jit
def _store_codes(codes_ptr, e0, row_ok, q, ROWS: tl.constexpr, W: tl.constexpr, BITS: tl.constexpr):
    """Codes q (ROWS, W) for elements e0[r] + 0..W-1 of the padded stream."""
    if BITS == 8:
        offs = e0[:, None] + tl.arange(0, W)[None, :]
        tl.store(codes_ptr + offs, q.to(tl.int8), mask=row_ok[:, None])
    elif BITS == 4:  # element 2i in the low nibble, 2i+1 in the high one, each as code + 8
        lo, hi = tl.split(tl.reshape(q + 8, [ROWS, W // 2, 2]))
        offs = e0[:, None] // 2 + tl.arange(0, W // 2)[None, :]
        tl.store(codes_ptr + offs, (lo | (hi << 4)).to(tl.uint8), mask=row_ok[:, None])
    else:  # 2 bits: element 4i + k in bits 2k..2k+1, each as f + 2; k = 2a + b in (a, b) below
        even, odd = tl.split(tl.reshape(q + 2, [ROWS, W // 4, 2, 2]))  # b = 0 (k = 0, 2), b = 1
        c0, c2 = tl.split(even)
        c1, c3 = tl.split(odd)
        offs = e0[:, None] // 4 + tl.arange(0, W // 4)[None, :]
        tl.store(codes_ptr + offs, (c0 | (c1 << 2) | (c2 << 4) | (c3 << 6)).to(tl.uint8), mask=row_ok[:, None])


@triton.jit
def _load_codes(codes_ptr, e0, row_ok, ROWS: tl.constexpr, W: tl.constexpr, BITS: tl.constexpr):
    """fp32 codes (ROWS, W) of elements e0[r] + 0..W-1 of the padded stream."""
    if BITS == 8:
        offs = e0[:, None] + tl.arange(0, W)[None, :]
        return tl.load(codes_ptr + offs, mask=row_ok[:, None], other=0).to(tl.float32)
    elif BITS == 4:
        offs = e0[:, None] // 2 + tl.arange(0, W // 2)[None, :]
        b = tl.load(codes_ptr + offs, mask=row_ok[:, None], other=0x88).to(tl.int32)
        q = tl.join((b & 0xF) - 8, (b >> 4) - 8)  # (ROWS, W // 2, 2): (low, high) pairs
        return tl.reshape(q, [ROWS, W]).to(tl.float32)
    else:  # 2 bits: the levels 2 c - 3 of the stored c, unpacked as _store_codes packed them
        offs = e0[:, None] // 4 + tl.arange(0, W // 4)[None, :]
        b = tl.load(codes_ptr + offs, mask=row_ok[:, None], other=0xAA).to(tl.int32)
        even = tl.join(b & 3, (b >> 4) & 3)  # k = 0, 2
        odd = tl.join((b >> 2) & 3, (b >> 6) & 3)  # k = 1, 3
        q = tl.reshape(tl.join(even, odd), [ROWS, W])  # (ROWS, W // 4, 2, 2) as (a, b), k = 2a + b
        return (q * 2 - 3).to(tl.float32)


@triton.jit
def _round_to(v, dtype: tl.constexpr):
    """fp32 -> dtype, round to nearest even. bf16 is rounded by hand on the bits: the Triton
    interpreter truncates fp32 -> bf16 casts, so the CPU tests would not cover the cast a
    GPU does (cvt.rn.bf16.f32, which this equals for every non-NaN input)."""
    if dtype == tl.bfloat16:
        b = v.to(tl.uint32, bitcast=True)
        b = b + 0x7FFF + ((b >> 16) & 1)
        return (b >> 16).to(tl.uint16).to(tl.bfloat16, bitcast=True)
    else:
        return v.to(dtype)


# -- quantize / swizzle_quantize ------------------------------------------------------------


@triton.jit
def _load_x(x_ptr, src0, valid, row_ok, c0, W: tl.constexpr):
    """fp32 (ROWS, W): source elements src0[r] + c0 + 0..W-1, zero past valid[r] (padding)."""
    cols = c0 + tl.arange(0, W)
    mask = row_ok[:, None] & (cols[None, :] < valid[:, None])
    return tl.load(x_ptr + src0[:, None] + cols[None, :], mask=mask, other=0.0).to(tl.float32)


@triton.jit
def _quantize_kernel(
    x_ptr,  # float [n_chunks * chunk_elems], any float dtype, contiguous
    order_ptr,  # int64 [n_slots]: output slot i holds source chunk order[i] (if HAS_ORDER)
    codes_ptr,  # int8 [total_blocks * BLOCK_ELEMS], or uint8 [total_blocks * BLOCK_ELEMS // 2]
    scales_ptr,  # fp32 [total_blocks]
    chunk_elems,  # a plain quantize is one chunk of numel elements
    blocks_per_chunk,  # cdiv(chunk_elems, BLOCK_ELEMS): each chunk is padded on its own
    total_blocks,  # n_slots * blocks_per_chunk
    HAS_ORDER: tl.constexpr,
    QMAX: tl.constexpr,
    BITS: tl.constexpr,
    BLOCK_ELEMS: tl.constexpr,
    ROWS: tl.constexpr,
    W: tl.constexpr,
    BF16_SCALES: tl.constexpr,
):
    blk = tl.program_id(0).to(tl.int64) * ROWS + tl.arange(0, ROWS)  # (ROWS,) output blocks
    row_ok = blk < total_blocks
    slot = blk // blocks_per_chunk
    j = blk - slot * blocks_per_chunk  # block index inside its chunk
    if HAS_ORDER:
        chunk = tl.load(order_ptr + slot, mask=row_ok, other=0)
    else:
        chunk = slot
    src0 = chunk * chunk_elems + j * BLOCK_ELEMS  # (ROWS,) first source element of each block
    valid = chunk_elems - j * BLOCK_ELEMS  # elements of the block inside its chunk (>= 1)
    e0 = blk * BLOCK_ELEMS  # first element of each block in the padded output stream

    if W == BLOCK_ELEMS:  # whole blocks in registers: read once
        x = _load_x(x_ptr, src0, valid, row_ok, 0, W)
        scale = _scale_of(_absmax(x), QMAX, BF16_SCALES)
        _store_codes(codes_ptr, e0, row_ok, _codes(x, scale, QMAX, BITS), ROWS, W, BITS)
    else:  # ROWS == 1, a long block: absmax pass, then codes pass
        absmax = tl.zeros([ROWS], dtype=tl.float32)
        for c0 in range(0, BLOCK_ELEMS, W):
            x = _load_x(x_ptr, src0, valid, row_ok, c0, W)
            absmax = _max_nan(absmax, _absmax(x))
        scale = _scale_of(absmax, QMAX, BF16_SCALES)
        for c0 in range(0, BLOCK_ELEMS, W):
            x = _load_x(x_ptr, src0, valid, row_ok, c0, W)
            _store_codes(codes_ptr, e0 + c0, row_ok, _codes(x, scale, QMAX, BITS), ROWS, W, BITS)
    tl.store(scales_ptr + blk, scale, mask=row_ok)


def _tile(block_elems: int) -> tuple[int, int]:
    """(ROWS, W) of [Note: block tiles]."""
    w = min(block_elems, _TILE_ELEMS)
    return _TILE_ELEMS // w, w


def _launch_quantize(x_flat, order, n_slots, chunk_elems, block_elems, bits, bf16_scales=False):
    bpc = num_blocks(chunk_elems, block_elems)
    total = n_slots * bpc
    code_elems = total * block_elems * bits // 8
    codes = torch.empty(code_elems, dtype=code_dtype(bits), device=x_flat.device)
    scales = torch.empty(total, dtype=torch.float32, device=x_flat.device)
    if total == 0:
        return codes, scales
    rows, w = _tile(block_elems)
    with _on_device(x_flat):
        _quantize_kernel[(triton.cdiv(total, rows),)](
            x_flat, order if order is not None else x_flat, codes, scales,
            chunk_elems, bpc, total,
            HAS_ORDER=order is not None, QMAX=QMAX[bits], BITS=bits, BLOCK_ELEMS=block_elems,
            ROWS=rows, W=w, BF16_SCALES=bf16_scales, num_warps=_NUM_WARPS, enable_fp_fusion=False,
        )  # fmt: skip
    return codes, scales


def quantize_triton(
    x: torch.Tensor, block_elems: int, bits: int = 8, *, bf16_scales: bool = False
) -> tuple[torch.Tensor, torch.Tensor]:
    """Same contract as ``quantize_ref``: x (any shape, float) -> (codes, scales fp32 [nb])."""
    check_quant_args(block_elems, bits)
    check_input(x)
    flat = x.reshape(-1).contiguous()
    return _launch_quantize(flat, None, 1, flat.numel(), block_elems, bits, bf16_scales)


def swizzle_quantize_triton(
    x: torch.Tensor, order: Sequence[int] | torch.Tensor, chunk_elems: int, block_elems: int, bits: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """Same contract as ``swizzle_quantize_ref``: output slot i is chunk order[i] of x, each
    chunk padded to whole blocks on its own; one launch, no reordered copy of x.

    ``order`` as a list is checked on the host; as an int64 tensor on x's device it is used
    as is (checking it would synchronize), so its entries must lie in [0, n_chunks).
    """
    check_quant_args(block_elems, bits)
    check_input(x)
    flat = x.reshape(-1).contiguous()
    n_chunks = check_chunks(flat.numel(), chunk_elems)
    if isinstance(order, torch.Tensor):
        order_t = order.to(device=flat.device, dtype=torch.int64).reshape(-1).contiguous()
    else:
        order_t = torch.tensor(normalize_order(order, n_chunks), dtype=torch.int64, device=flat.device)
    return _launch_quantize(flat, order_t, order_t.numel(), chunk_elems, block_elems, bits)


# -- dequantize -----------------------------------------------------------------------------


@triton.jit
def _dequantize_kernel(
    codes_ptr,  # int8 [>= total_blocks * BLOCK_ELEMS] or packed uint8 (half that)
    scales_ptr,  # fp32 [>= total_blocks]
    out_ptr,  # [numel] in the output dtype
    numel,
    total_blocks,  # cdiv(numel, BLOCK_ELEMS): blocks past numel are not read
    BITS: tl.constexpr,
    BLOCK_ELEMS: tl.constexpr,
    ROWS: tl.constexpr,
    W: tl.constexpr,
):
    blk = tl.program_id(0).to(tl.int64) * ROWS + tl.arange(0, ROWS)
    row_ok = blk < total_blocks
    scale = tl.load(scales_ptr + blk, mask=row_ok, other=0.0)
    e0 = blk * BLOCK_ELEMS
    for c0 in range(0, BLOCK_ELEMS, W):
        q = _load_codes(codes_ptr, e0 + c0, row_ok, ROWS, W, BITS)
        offs = (e0 + c0)[:, None] + tl.arange(0, W)[None, :]
        # product in fp32, then one rounding to the output dtype, like the reference
        out = _round_to(q * scale[:, None], out_ptr.dtype.element_ty)
        tl.store(out_ptr + offs, out, mask=offs < numel)


def dequantize_triton(
    codes: torch.Tensor,
    scales: torch.Tensor,
    block_elems: int,
    numel: int,
    bits: int = 8,
    dtype: torch.dtype = torch.float32,
    *,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """Same contract as ``dequantize_ref``: a 1-D tensor of ``numel`` elements in ``dtype``,
    or written into ``out`` (contiguous, ``numel`` elements, its own float dtype)."""
    check_quant_args(block_elems, bits)
    check_quantized(codes, scales, block_elems, numel, bits, sources=1)
    if out is None:
        out = torch.empty(numel, dtype=dtype, device=codes.device)
    else:
        check_out(out, numel, codes.device)
    total = num_blocks(numel, block_elems)
    if total == 0:
        return out
    rows, w = _tile(block_elems)
    with _on_device(codes):
        _dequantize_kernel[(triton.cdiv(total, rows),)](
            codes.contiguous(), scales.contiguous(), out, numel, total,
            BITS=bits, BLOCK_ELEMS=block_elems, ROWS=rows, W=w,
            num_warps=_NUM_WARPS, enable_fp_fusion=False,
        )  # fmt: skip
    return out


# -- fused dequantize + reduce + requantize --------------------------------------------------


@triton.jit
def _sum_sources(
    codes_ptr, scales_ptr, blk, e0, row_ok, numel, sources, codes_per_source, scales_per_source,
    ROWS: tl.constexpr, W: tl.constexpr, BITS: tl.constexpr,
):  # fmt: skip
    """fp32 (ROWS, W): sum over sources of code * scale for elements e0[r] + 0..W-1, in source
    order (the reference's order), zero past numel."""
    acc = tl.zeros([ROWS, W], dtype=tl.float32)
    for _ in range(sources):  # advance the pointers: no s * codes_per_source int32 overflow
        q = _load_codes(codes_ptr, e0, row_ok, ROWS, W, BITS)
        scale = tl.load(scales_ptr + blk, mask=row_ok, other=0.0)
        acc += q * scale[:, None]  # two roundings: launched with enable_fp_fusion=False
        codes_ptr += codes_per_source
        scales_ptr += scales_per_source
    offs = e0[:, None] + tl.arange(0, W)[None, :]
    return tl.where(offs < numel, acc, 0.0)


@triton.jit
def _dequant_reduce_quantize_kernel(
    codes_ptr,  # sources x (codes_per_source) codes, back to back
    scales_ptr,  # sources x (scales_per_source) fp32 scales, back to back
    out_codes_ptr,  # [total_blocks * BLOCK_ELEMS * BITS // 8]   (REQUANTIZE)
    out_scales_ptr,  # fp32 [total_blocks]                      (REQUANTIZE)
    sum_ptr,  # fp32 [numel]                                      (not REQUANTIZE)
    numel,
    total_blocks,  # cdiv(numel, BLOCK_ELEMS)
    sources,
    codes_per_source,
    scales_per_source,
    REQUANTIZE: tl.constexpr,
    QMAX: tl.constexpr,
    BITS: tl.constexpr,
    BLOCK_ELEMS: tl.constexpr,
    ROWS: tl.constexpr,
    W: tl.constexpr,
    BF16_SCALES: tl.constexpr,
):
    blk = tl.program_id(0).to(tl.int64) * ROWS + tl.arange(0, ROWS)
    row_ok = blk < total_blocks
    e0 = blk * BLOCK_ELEMS
    if not REQUANTIZE:
        for c0 in range(0, BLOCK_ELEMS, W):
            acc = _sum_sources(codes_ptr, scales_ptr, blk, e0 + c0, row_ok, numel, sources,
                               codes_per_source, scales_per_source, ROWS, W, BITS)  # fmt: skip
            offs = (e0 + c0)[:, None] + tl.arange(0, W)[None, :]
            tl.store(sum_ptr + offs, acc, mask=offs < numel)
    elif W == BLOCK_ELEMS:  # whole blocks in registers: sum once
        acc = _sum_sources(codes_ptr, scales_ptr, blk, e0, row_ok, numel, sources,
                           codes_per_source, scales_per_source, ROWS, W, BITS)  # fmt: skip
        scale = _scale_of(_absmax(acc), QMAX, BF16_SCALES)
        _store_codes(out_codes_ptr, e0, row_ok, _codes(acc, scale, QMAX, BITS), ROWS, W, BITS)
        tl.store(out_scales_ptr + blk, scale, mask=row_ok)
    else:  # a long block: sum twice (absmax, then codes) rather than spill the fp32 sum
        absmax = tl.zeros([ROWS], dtype=tl.float32)
        for c0 in range(0, BLOCK_ELEMS, W):
            acc = _sum_sources(codes_ptr, scales_ptr, blk, e0 + c0, row_ok, numel, sources,
                               codes_per_source, scales_per_source, ROWS, W, BITS)  # fmt: skip
            absmax = _max_nan(absmax, _absmax(acc))
        scale = _scale_of(absmax, QMAX, BF16_SCALES)
        for c0 in range(0, BLOCK_ELEMS, W):
            acc = _sum_sources(codes_ptr, scales_ptr, blk, e0 + c0, row_ok, numel, sources,
                               codes_per_source, scales_per_source, ROWS, W, BITS)  # fmt: skip
            _store_codes(out_codes_ptr, e0 + c0, row_ok, _codes(acc, scale, QMAX, BITS), ROWS, W, BITS)
        tl.store(out_scales_ptr + blk, scale, mask=row_ok)


def dequant_reduce_quantize_triton(
    codes: torch.Tensor,
    scales: torch.Tensor,
    *,
    sources: int,
    numel: int,
    block_elems: int,
    bits: int,
    requantize: bool = True,
    bf16_scales: bool = False,
) -> tuple[torch.Tensor, torch.Tensor] | torch.Tensor:
    """Same contract as ``dequant_reduce_quantize_ref``: ``sources`` quantized copies back to
    back -> their fp32 sum (in source order), requantized with the same block_elems and bits,
    or the fp32 sum itself when ``requantize`` is False. One read of every input byte (two for
    blocks longer than the tile), no fp32 intermediate in memory."""
    check_quant_args(block_elems, bits)
    codes_per, scales_per = check_quantized(codes, scales, block_elems, numel, bits, sources=sources)
    total = num_blocks(numel, block_elems)
    dev = codes.device
    if requantize:
        out_codes = torch.empty(
            padded_numel(numel, block_elems) * bits // 8, dtype=code_dtype(bits), device=dev
        )
        out_scales = torch.empty(total, dtype=torch.float32, device=dev)
        out_sum = out_scales  # unused by the kernel
    else:
        out_sum = torch.empty(numel, dtype=torch.float32, device=dev)
        out_codes, out_scales = codes, out_sum  # unused by the kernel
    if total > 0:
        rows, w = _tile(block_elems)
        with _on_device(codes):
            _dequant_reduce_quantize_kernel[(triton.cdiv(total, rows),)](
                codes.contiguous(), scales.contiguous(), out_codes, out_scales, out_sum,
                numel, total, sources, codes_per, scales_per,
                REQUANTIZE=requantize, QMAX=QMAX[bits], BITS=bits, BLOCK_ELEMS=block_elems,
                ROWS=rows, W=w, BF16_SCALES=bf16_scales, num_warps=_NUM_WARPS, enable_fp_fusion=False,
            )  # fmt: skip
    return (out_codes, out_scales) if requantize else out_sum


# -- helpers ---------------------------------------------------------------------------------


def _on_device(t: torch.Tensor):
    """Launch on the tensor's GPU, not the current one (Triton launches on the current device)."""
    return torch.cuda.device(t.device) if t.is_cuda else contextlib.nullcontext()

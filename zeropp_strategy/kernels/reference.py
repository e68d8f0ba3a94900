"""Layer: kernels (imports torch only). Block quantization in plain torch: the CPU path and
the oracle for the Triton kernels.

    python benchmarks/kernels.py --cpu-suite      # time per call at training sizes, GB/s

[Note: quantization conventions]
- Symmetric, one fp32 scale per block of ``block_elems`` consecutive elements of the
  flattened input; the last block is zero-padded (padding quantizes to code 0 at 8 and 4
  bits, to the level +1 at 2 bits; every consumer drops it).
- int8: ``qmax = 127``; int4: ``qmax = 7`` (codes -7..7; -8 is never produced, so the
  range is symmetric and dequantization needs no zero point); 2 bits: ``qmax = 3`` and
  four levels without zero, -3, -1, +1, +3 times the scale (for qwZ's weight deltas and
  the cross-node hop of 2-bit gradients, whose senders feed the rounding back: a level
  of zero would waste one of the four, and its step would be 1.5x coarser).
- ``scale = absmax(block) / qmax`` computed in fp32; an all-zero block has scale 0 (and
  dequantizes to zeros); a block holding a NaN or an infinity has a NaN scale and codes 0
  (2 bits: level +1), so it dequantizes to NaN everywhere and the non-finite checks
  downstream see it (an infinite scale would divide the infinity to NaN, whose integer
  code neither torch nor Triton specifies: the two back ends decoded such a block apart).
  At 8 and 4 bits ``code = round_half_to_even(x / scale)`` (torch.round; Triton uses
  ``rint``, the same IEEE rounding), clamped to [-qmax, qmax]; an all-zero block has codes 0. At 2 bits the level is the odd integer nearest
  ``x / scale``, ``2 floor(x / (2 scale)) + 1`` (a tie, an even ``x / scale``, goes up),
  clamped to [-3, 3].
- int4 packing: two codes per uint8, element 2i in the low nibble and 2i+1 in the high
  nibble, each stored as ``code + 8`` (0..15). 2-bit packing: four codes per uint8,
  element 4i + k in bits 2k..2k+1, each stored as ``(level + 3) / 2`` (0..3).
- Error bound per element: half a step, |x - dequant(quant(x))| <= absmax(block) / (2 qmax)
  at 8 and 4 bits, absmax(block) / 3 (one scale: levels are two scales apart) at 2 bits.
- bf16 scales (``bf16_scales=True``, for payloads that send each scale in 2 bytes): the
  scale is rounded *up* to the next bf16 value before the codes are computed
  (``round_up_to_bf16``), so |x / scale| <= qmax still holds, the codes agree exactly with
  the scale that is sent, and the bound grows by the factor (1 + 2^-7). The scales stay
  fp32 tensors (whose values are bf16 values): a payload converts them to bf16 and back
  without loss. Edges: a subnormal scale rounds up to bf16's subnormal step (2^-133),
  outside the relative bound; in a block whose absmax is within 2^-7 of fp32's largest
  value (above about 3.38e38), ``qmax`` times the rounded-up scale can overflow, and those codes
  then dequantize to +-inf (no scale reaches bf16's largest finite value, where
  ``round_up_to_bf16`` would cap it: absmax / qmax <= fp32's largest / 3). With fp32
  scales one value does the same at int8: fp32's largest (127 times its 127th rounds up).

[Note: fast CPU reference]
The functions here are the specification and, on CPU, the hot path of every qwZ/qgZ
collective, so they are written for speed without changing a single output bit:
- Work goes chunk by chunk (``_CHUNK_ELEMS`` elements of whole blocks) through scratch
  buffers allocated once per call: every temporary stays in cache, and none is large
  enough to be a fresh mmap (first touch of a 16 MB temporary cost more than the
  arithmetic on it; see docs/zeropp_measurements.md, "On CPU: the torch reference's speed").
- Non-fp32 inputs are converted into the fp32 scratch first; the absmax is then
  ``max(amax, -amin)`` on fp32 (the same value as ``abs().amax()``, without an abs pass;
  bf16 reductions are several times slower than fp32 ones in torch 2.13 on CPU).
- ``absmax / qmax`` and ``x / scale`` stay correctly rounded divisions (a reciprocal
  multiply would move ties; on CUDA torch divides by a Python scalar that way, so qmax is
  a device tensor), rounded in place. The clamp to [-qmax, qmax] and the zeroing of blocks whose
  scale is not > 0 can only change anything when a block's scale is subnormal or NaN
  (otherwise |x / scale| <= qmax (1 + 2^-23) rounds into range, and an all-zero block
  divides to zeros), so on the CPU they run only for chunks that hold such a block.
- Mixed-dtype torch ops (int8 * fp32 into bf16, say) are slow on CPU: TensorIterator
  makes hidden copies and falls off the vectorized path. Every op here has one dtype in
  and out, conversions are explicit ``copy_`` calls.
- int4 packing and unpacking use int16 views of byte pairs: ``w | (w >> 4)`` keeps the low
  nibbles of both bytes in the low byte; ``(w | (w << 4)) & 0x0F0F`` spreads them back.
  These equal the nibble arithmetic of the convention for codes in [-8, 7], which is
  every code quantize writes.
- dequant_reduce_quantize adds the sources in source order, starting from source 0's
  product rather than from 0.0; the two differ only in the sign of a -0.0 product,
  which needs a negative or -0.0 scale, never produced by quantize.
"""

from __future__ import annotations

import torch

QMAX = {8: 127, 4: 7, 2: 3}


def half_step(bits: int) -> float:
    """The error bound per element as a fraction of its block's absmax ([Note: quantization
    conventions]): half a step, 1 / (2 qmax) with a level at every integer, 1 / 3 at 2 bits
    (odd levels, two scales apart)."""
    return 1 / 3 if bits == 2 else 1 / (2 * QMAX[bits])


def code_dtype(bits: int) -> torch.dtype:
    """The dtype codes of ``bits`` travel in: int8 for 8 bits, uint8 (two or four codes a
    byte) for 4 and 2."""
    return torch.int8 if bits == 8 else torch.uint8

# Elements per chunk: 2**20 (4 MiB of fp32 scratch). Chosen with
# `python benchmarks/kernels.py --cpu-suite --chunk-sweep` (AMD EPYC, 2 cores, 1 torch thread as
# in training, torch 2.13; docs/zeropp_measurements.md, "On CPU: the torch reference's
# speed"): per-op dispatch costs ~5 us at one thread and a chunk runs ~15 ops per source, so
# 2**16 was 1.5-2.5x slower at 1M-4M elements; unchunked (whole-tensor temporaries) was
# 1.1-2.2x slower than 2**20 at 4M, 8.8x for dequantize_gathered over 4 ranks (first-touch
# page faults of 16-64 MB scratch, out of cache); 2**20 was best or within noise everywhere.
_CHUNK_ELEMS = 1 << 20
_TINY = torch.finfo(torch.float32).tiny  # smallest normal fp32


def padded_numel(numel: int, block_elems: int) -> int:
    return -(-numel // block_elems) * block_elems


def num_blocks(numel: int, block_elems: int) -> int:
    return -(-numel // block_elems)


def quantized_nbytes(numel: int, block_elems: int, bits: int, scale_bytes: int = 4) -> int:
    """Bytes on the wire for ``numel`` elements: codes plus one scale per block (fp32: 4
    bytes; bf16 scales: 2)."""
    n = padded_numel(numel, block_elems)
    return n * bits // 8 + scale_bytes * num_blocks(numel, block_elems)


_BF16_MAX_BITS = 0x7F7F0000  # the largest finite bf16, as fp32 bits


def round_up_to_bf16(scales: torch.Tensor) -> torch.Tensor:
    """Round non-negative fp32 ``scales`` up, in place, to the nearest bf16 value at or above
    them (the largest finite bf16 at most); NaN and inf stay as they are. Exact on the bit
    pattern: adding 0xFFFF and clearing the low 16 bits moves a positive float to the next
    multiple of its bf16 ulp, carrying into the exponent where the mantissa overflows."""
    bits_ = scales.view(torch.int32)
    finite = bits_.bitwise_and(0x7F800000) != 0x7F800000
    up = bits_.add(0xFFFF).bitwise_and_(-0x10000).clamp_(max=_BF16_MAX_BITS)
    bits_.copy_(torch.where(finite, up, bits_))
    return scales


# -- chunked pieces (see [Note: fast CPU reference]) -------------------------------------------


class _Scratch:
    """Per-call scratch for up to ``rows`` blocks of ``block_elems``: fp32 values, int8 codes
    (int4 and 2 bits) and int16 byte pairs (int4 only)."""

    def __init__(self, rows: int, block_elems: int, bits: int, device: torch.device, bf16_scales: bool) -> None:
        n = rows * block_elems
        self.bf16_scales = bf16_scales
        self.y = torch.empty(n, dtype=torch.float32, device=device)
        # qmax as a tensor on the device: torch's CUDA division by a Python scalar multiplies
        # by its rounded reciprocal, which moves a scale by an ulp now and then (seen on an
        # H100: the reference on CUDA disagreed with itself on the CPU and with Triton)
        self.qmax = torch.full((), float(QMAX[bits]), dtype=torch.float32, device=device)
        if bits != 8:
            self.i8 = torch.empty(n, dtype=torch.int8, device=device)
        if bits == 4:
            self.w16 = torch.empty(n // 2, dtype=torch.int16, device=device)
            self.w16b = torch.empty_like(self.w16)

    def f32(self, rows: int, block_elems: int) -> torch.Tensor:
        return self.y[: rows * block_elems].view(rows, block_elems)


def _chunk_rows(block_elems: int) -> int:
    return max(1, _CHUNK_ELEMS // block_elems)


def _scratch(total_rows: int, block_elems: int, bits: int, device: torch.device, bf16_scales: bool = False) -> _Scratch:
    return _Scratch(min(max(total_rows, 1), _chunk_rows(block_elems)), block_elems, bits, device, bf16_scales)


def _quantize_rows(src: torch.Tensor, codes: torch.Tensor, scales: torch.Tensor, bits: int, sc: _Scratch) -> None:
    """One chunk: src (rows, B) float (may be sc's fp32 buffer itself) -> codes (rows * B *
    bits // 8, int8 or packed uint8) and scales (rows,) fp32, written in place."""
    rows, b = src.shape
    qmax = QMAX[bits]
    y = sc.f32(rows, b)
    if src.dtype != torch.float32:
        src = y.copy_(src)
    torch.maximum(src.amax(dim=1), src.amin(dim=1).neg_(), out=scales)
    scales.abs_().div_(sc.qmax)  # abs: all -0.0 gives +0.0, as abs().amax() does
    scales.masked_fill_(scales == float("inf"), float("nan"))  # an infinity: see the conventions
    if sc.bf16_scales:
        round_up_to_bf16(scales)
    safe = torch.where(scales == 0, 1.0, scales)  # NaN stays NaN: amin() below sees it
    torch.div(src, safe[:, None], out=y)
    if bits == 2:
        y.mul_(0.5).floor_()  # f, of the odd level 2f + 1 nearest y; stored as f + 2
        lo, hi = -2, 1
    else:
        y.round_()
        lo, hi = -qmax, qmax
    # a subnormal or NaN scale: clamp and zero as specified (no-ops otherwise; on a GPU always,
    # since reading the minimum back would stall the host)
    if y.device.type != "cpu" or not float(safe.amin()) >= _TINY:
        y.clamp_(lo, hi)
        y[~(scales > 0)] = 0.0
    if bits == 8:
        codes.view(rows, b).copy_(y)
        return
    if bits == 2:
        four = sc.i8[: rows * b].copy_(y.view(-1)).add_(2).view(torch.uint8).view(-1, 4)  # 0..3
        packed = torch.bitwise_left_shift(four[:, 3], 6)
        for k in (2, 1):
            packed.bitwise_or_(torch.bitwise_left_shift(four[:, k], 2 * k))
        codes.copy_(packed.bitwise_or_(four[:, 0]))
        return
    c = sc.i8[: rows * b]
    c.copy_(y.view(-1)).add_(8)  # 1..15
    w = c.view(torch.int16)  # (code 2i + 8) + 256 (code 2i+1 + 8)
    w2 = torch.bitwise_right_shift(w, 4, out=sc.w16b[: w.numel()])
    w2.bitwise_or_(w)
    codes.copy_(w2)  # the low byte: low | high << 4


def _dequantize_rows(codes: torch.Tensor, scales: torch.Tensor, y: torch.Tensor, bits: int, sc: _Scratch) -> None:
    """One chunk: codes of (rows, B) elements and scales (rows,) -> y (rows, B) fp32 = code * scale."""
    rows, b = y.shape
    if bits == 8:
        y.copy_(codes.view(rows, b))
    elif bits == 2:
        four = sc.i8[: rows * b].view(-1, 4)
        for k in range(4):
            four[:, k].copy_(torch.bitwise_right_shift(codes, 2 * k).bitwise_and_(3))
        y.copy_(four.view(rows, b).mul_(2).sub_(3))  # the level: 2 (f + 2) - 3
    else:
        w = sc.w16[: codes.numel()].copy_(codes)  # packed byte p -> 0x00pp
        w.bitwise_or_(torch.bitwise_left_shift(w, 4, out=sc.w16b[: w.numel()])).bitwise_and_(0x0F0F)
        c = w.view(torch.int8).sub_(8)  # (low, high) nibbles as bytes, minus 8
        y.copy_(c.view(rows, b))
    y.mul_(scales[:, None])


def _code_slice(codes: torch.Tensor, r0: int, r1: int, block_elems: int, bits: int) -> torch.Tensor:
    per = block_elems * bits // 8
    return codes[r0 * per : r1 * per]


def _quantize_flat_into(flat: torch.Tensor, codes: torch.Tensor, scales: torch.Tensor, block_elems: int, bits: int,
                        sc: _Scratch, residual: bool = False) -> None:  # fmt: skip
    """flat (n,) float -> codes (padded n * bits // 8) and scales (num_blocks,), in place.
    ``residual`` (flat fp32, whole blocks): flat then holds what the codes drop
    (``quantize_into_ref``), each chunk's while its rounded quotients are still in ``sc``."""
    n, b = flat.numel(), block_elems
    full = n // b
    assert not (residual and full * b < n), "residual needs whole blocks (kernels.checks.check_into)"
    step = _chunk_rows(b)
    blocks = flat[: full * b].view(full, b)
    for r0 in range(0, full, step):
        r1 = min(full, r0 + step)
        _quantize_rows(blocks[r0:r1], _code_slice(codes, r0, r1, b, bits), scales[r0:r1], bits, sc)
        if residual:
            y = sc.f32(r1 - r0, b)  # the rounded quotients the codes hold (2 bits: f of the level 2f + 1)
            if bits == 2:
                y.mul_(2).add_(1)
            blocks[r0:r1].sub_(y.mul_(scales[r0:r1, None]))
    if full * b < n:  # the last block, zero-padded
        tail = sc.f32(1, b)
        tail[0, n - full * b :] = 0.0
        tail[0, : n - full * b] = flat[full * b :]
        _quantize_rows(tail, _code_slice(codes, full, full + 1, b, bits), scales[full:], bits, sc)


def _empty_quantized(
    numel: int, block_elems: int, bits: int, n: int, device: torch.device
) -> tuple[torch.Tensor, torch.Tensor]:
    """Codes and scales for ``n`` quantized copies of ``numel`` elements, uninitialised."""
    codes = torch.empty(n * padded_numel(numel, block_elems) * bits // 8, dtype=code_dtype(bits), device=device)
    return codes, torch.empty(n * num_blocks(numel, block_elems), dtype=torch.float32, device=device)


# -- the reference functions -------------------------------------------------------------------


def quantize_ref(
    x: torch.Tensor, block_elems: int, bits: int = 8, *, bf16_scales: bool = False
) -> tuple[torch.Tensor, torch.Tensor]:
    """x (any shape, float) -> (codes, scales).

    codes: int8 [padded] for bits=8, uint8 [padded // 2] (packed) for bits=4, uint8
    [padded // 4] for bits=2.
    scales: fp32 [num_blocks] (bf16 values with ``bf16_scales``, see [Note: quantization conventions]).
    """
    if bits not in QMAX:
        raise ValueError(f"bits={bits} is not supported. Fix: use 8, 4 or 2.")
    codes, scales = _empty_quantized(x.numel(), block_elems, bits, 1, x.device)
    quantize_into_ref(x, codes, scales, block_elems, bits, bf16_scales=bf16_scales)
    return codes, scales


def quantize_into_ref(x: torch.Tensor, codes: torch.Tensor, scales: torch.Tensor, block_elems: int, bits: int = 8, *,
                      bf16_scales: bool = False, residual: bool = False) -> None:  # fmt: skip
    """``quantize_ref`` of ``x`` written into ``codes`` and ``scales`` (its layout, contiguous).
    ``residual``: x (fp32, contiguous, whole blocks) is then overwritten with what the codes
    drop, ``x - dequantize_ref(codes, scales)``: each rounded quotient (at 2 bits its level)
    times its scale, the product dequantize_ref forms, without decoding the codes. The same
    values as that difference, bit for bit but for the sign of a zero: an element that is
    itself -0.0 with a quotient of -0.0 leaves -0.0 - -0.0 = +0.0, where decoding (codes
    have no -0) leaves -0.0 - +0.0 = -0.0."""
    sc = _scratch(num_blocks(x.numel(), block_elems), block_elems, bits, x.device, bf16_scales)
    _quantize_flat_into(x.view(-1) if residual else x.reshape(-1), codes, scales, block_elems, bits, sc, residual)


def _dequantize_into(codes: torch.Tensor, scales: torch.Tensor, out: torch.Tensor, block_elems: int, bits: int,
                     sc: _Scratch) -> None:  # fmt: skip
    """codes/scales of one quantized tensor -> out (numel,) of any float dtype, numel <= the
    blocks' elements; out may be a strided view whose last dim is contiguous."""
    n, b = out.numel(), block_elems
    full = n // b
    step = _chunk_rows(b)
    direct = out.dtype == torch.float32
    blocks = out[: full * b].view(full, b)
    for r0 in range(0, full, step):
        r1 = min(full, r0 + step)
        y = blocks[r0:r1] if direct else sc.f32(r1 - r0, b)
        _dequantize_rows(_code_slice(codes, r0, r1, b, bits), scales[r0:r1], y, bits, sc)
        if not direct:
            blocks[r0:r1].copy_(y)
    if full * b < n:
        y = sc.f32(1, b)
        _dequantize_rows(_code_slice(codes, full, full + 1, b, bits), scales[full : full + 1], y, bits, sc)
        out[full * b :].copy_(y[0, : n - full * b])


def dequantize_ref(
    codes: torch.Tensor, scales: torch.Tensor, block_elems: int, numel: int, bits: int = 8,
    dtype: torch.dtype = torch.float32, *, out: torch.Tensor | None = None,
) -> torch.Tensor:
    """Inverse of ``quantize_ref``: a 1-D tensor of ``numel`` elements in ``dtype``
    (each value rounded once, from the fp32 product code * scale), or written into ``out``
    (1-D, ``numel`` elements, its own float dtype) in chunks of the scratch's size."""
    if out is None:
        out = torch.empty(numel, dtype=dtype, device=codes.device)
    else:  # checked by kernels.dequantize, as the codes are (checks imports this module)
        out = out.view(-1)
    sc = _scratch(num_blocks(numel, block_elems), block_elems, bits, codes.device)
    _dequantize_into(codes.reshape(-1), scales.reshape(-1), out, block_elems, bits, sc)
    return out


def dequantize_gathered_ref(
    gathered: torch.Tensor, *, code_bytes: int, numel: int, block_elems: int, out: torch.Tensor
) -> None:
    """gathered (world, code_bytes + 4 * num_blocks) uint8, each row one int8 payload
    ``cat([codes, scales as bytes])`` of ``numel`` elements -> out[r * numel : (r + 1) * numel]
    = row r dequantized, in out's dtype. One pass over all rows: every op spans the world."""
    world, b = gathered.shape[0], block_elems
    nb = num_blocks(numel, b)
    if world == 0 or numel == 0:
        return
    codes = gathered[:, :code_bytes].view(torch.int8)  # (world, nb * B)
    scale_bytes = gathered[:, code_bytes : code_bytes + 4 * nb]
    if scale_bytes.storage_offset() % 4 or scale_bytes.stride(0) % 4:
        scale_bytes = scale_bytes.contiguous()  # a misaligned buffer: view as fp32 needs 4-byte steps
    scales = scale_bytes.view(torch.float32)  # (world, nb)
    dst = out.view(world, numel)
    full = numel // b
    direct = out.dtype == torch.float32
    # blocks per rank per chunk; on a GPU (no cache to keep the scratch in) all at once
    step = max(1, _chunk_rows(b) // world) if gathered.device.type == "cpu" else max(full, 1)
    y_all = torch.empty(world * min(max(full, 1), step) * b, dtype=torch.float32, device=gathered.device)
    for k0 in range(0, full, step):
        k1 = min(full, k0 + step)
        dst_k = dst[:, k0 * b : k1 * b].view(world, k1 - k0, b)
        y = dst_k if direct else y_all[: world * (k1 - k0) * b].view(world, k1 - k0, b)
        y.copy_(codes[:, k0 * b : k1 * b].view(world, k1 - k0, b))
        y.mul_(scales[:, k0:k1, None])
        if not direct:
            dst_k.copy_(y)
    if full * b < numel:  # every row's last, partial block
        rem = numel - full * b
        y = y_all[: world * rem].view(world, rem)
        y.copy_(codes[:, full * b : numel])
        y.mul_(scales[:, full : full + 1])
        dst[:, full * b :].copy_(y)


def pack_int4(codes: torch.Tensor) -> torch.Tensor:
    """int8 codes in [-7, 7] (even count) -> uint8, two per byte (low nibble first)."""
    w = (codes.reshape(-1) + 8).view(torch.int16)  # (code 2i + 8) + 256 (code 2i+1 + 8)
    return (w | (w >> 4)).to(torch.uint8)  # low byte: low | high << 4


def unpack_int4(packed: torch.Tensor) -> torch.Tensor:
    w = packed.reshape(-1).to(torch.int16)  # byte p -> 0x00pp
    w = (w | (w << 4)) & 0x0F0F  # 0x0h0l: (low, high) nibbles as little-endian bytes
    return w.view(torch.int8).sub_(8)


def swizzle_quantize_ref(
    x: torch.Tensor, order: list[int], chunk_elems: int, block_elems: int, bits: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """Reorder ``x``'s chunks (``x.view(-1, chunk_elems)[order]``) and quantize each chunk
    separately (blocks never straddle chunks): codes/scales laid out chunk after chunk."""
    if bits not in QMAX:
        raise ValueError(f"bits={bits} is not supported. Fix: use 8, 4 or 2.")
    chunks = x.reshape(-1, chunk_elems)
    slots, b = len(order), block_elems
    codes, scales = _empty_quantized(chunk_elems, b, bits, slots, x.device)
    codes_per, scales_per = codes.numel() // max(slots, 1), num_blocks(chunk_elems, b)
    if slots and slots * scales_per * b <= _CHUNK_ELEMS:  # small: every slot in one chunk
        sc = _scratch(slots * scales_per, b, bits, x.device)
        y = sc.f32(slots * scales_per, b)
        yv = y.view(slots, scales_per * b)
        idx = torch.tensor(order, dtype=torch.long).remainder_(chunks.shape[0]).to(x.device)
        if yv.shape[1] == chunk_elems and chunks.dtype == torch.float32:
            torch.index_select(chunks, 0, idx, out=yv)  # (index_select: 6x faster than chunks[order])
        else:
            yv[:, chunk_elems:] = 0.0
            yv[:, :chunk_elems] = torch.index_select(chunks, 0, idx)
        _quantize_rows(y, codes, scales, bits, sc)
        return codes, scales
    sc = _scratch(scales_per, b, bits, x.device)
    for slot, i in enumerate(order):  # big slots, one per destination rank: per-slot chunks
        _quantize_flat_into(chunks[i], codes[slot * codes_per : (slot + 1) * codes_per],
                            scales[slot * scales_per : (slot + 1) * scales_per], b, bits, sc)  # fmt: skip
    return codes, scales


def dequant_reduce_quantize_ref(
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
    """``sources`` quantized copies of a ``numel``-element tensor, back to back -> their fp32
    sum, requantized (or returned as fp32 when ``requantize`` is False); ``bf16_scales``
    applies to the requantization.

    Chunk by chunk: the sum of a chunk's blocks over all sources is requantized while it is
    still in cache. The sum is in source order (see [Note: fast CPU reference])."""
    b = block_elems
    per_codes, per_scales = codes.numel() // sources, scales.numel() // sources
    src_codes = [codes[s * per_codes : (s + 1) * per_codes] for s in range(sources)]
    src_scales = [scales[s * per_scales : (s + 1) * per_scales] for s in range(sources)]
    nb, full = num_blocks(numel, b), numel // b
    sc = _scratch(nb, b, bits, codes.device, bf16_scales)
    acc = torch.empty(min(max(nb, 1), _chunk_rows(b)) * b, dtype=torch.float32, device=codes.device)
    if requantize:
        out_codes, out_scales = _empty_quantized(numel, b, bits, 1, codes.device)
    else:
        total = torch.empty(numel, dtype=torch.float32, device=codes.device)

    def reduce_rows(r0: int, r1: int, y: torch.Tensor) -> None:
        """y (r1 - r0, B) fp32 = sum over sources of blocks r0..r1-1."""
        for s in range(sources):
            d = y if s == 0 else sc.f32(r1 - r0, b)
            _dequantize_rows(_code_slice(src_codes[s], r0, r1, b, bits), src_scales[s][r0:r1], d, bits, sc)
            if s:
                y.add_(d)

    step = _chunk_rows(b)
    for r0 in range(0, full, step):
        r1 = min(full, r0 + step)
        if requantize:
            y = acc[: (r1 - r0) * b].view(r1 - r0, b)
            reduce_rows(r0, r1, y)
            _quantize_rows(y, _code_slice(out_codes, r0, r1, b, bits), out_scales[r0:r1], bits, sc)
        else:
            reduce_rows(r0, r1, total[r0 * b : r1 * b].view(r1 - r0, b))
    if full < nb:  # the partial last block: zero past numel, as a numel-element sum would be
        y = acc[:b].view(1, b)
        reduce_rows(full, nb, y)
        y[0, numel - full * b :] = 0.0
        if requantize:
            _quantize_rows(y, _code_slice(out_codes, full, nb, b, bits), out_scales[full:], bits, sc)
        else:
            total[full * b :] = y[0, : numel - full * b]
    return (out_codes, out_scales) if requantize else total

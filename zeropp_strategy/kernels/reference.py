"""Block quantization in plain torch: the CPU path and the oracle for the Triton kernels.

[Note: quantization conventions]
- Symmetric, one fp32 scale per block of ``block_elems`` consecutive elements of the
  flattened input; the last block is zero-padded (padding quantizes to code 0).
- int8: ``qmax = 127``; int4: ``qmax = 7`` (codes -7..7; -8 is never produced, so the
  range is symmetric and dequantization needs no zero point).
- ``scale = absmax(block) / qmax`` computed in fp32; an all-zero block has scale 0 and
  codes 0. ``code = round_half_to_even(x / scale)`` (torch.round; Triton uses
  ``rint``, the same IEEE rounding), clamped to [-qmax, qmax].
- int4 packing: two codes per uint8, element 2i in the low nibble and 2i+1 in the high
  nibble, each stored as ``code + 8`` (0..15).
- Error bound per element: |x - dequant(quant(x))| <= scale / 2 = absmax(block) / (2 qmax).
"""

from __future__ import annotations

import torch

QMAX = {8: 127, 4: 7}


def padded_numel(numel: int, block_elems: int) -> int:
    return -(-numel // block_elems) * block_elems


def num_blocks(numel: int, block_elems: int) -> int:
    return -(-numel // block_elems)


def quantized_nbytes(numel: int, block_elems: int, bits: int) -> int:
    """Bytes on the wire for ``numel`` elements: codes plus one fp32 scale per block."""
    n = padded_numel(numel, block_elems)
    return n * bits // 8 + 4 * num_blocks(numel, block_elems)


def quantize_ref(x: torch.Tensor, block_elems: int, bits: int = 8) -> tuple[torch.Tensor, torch.Tensor]:
    """x (any shape, float) -> (codes, scales).

    codes: int8 [padded] for bits=8, uint8 [padded // 2] (packed) for bits=4.
    scales: fp32 [num_blocks].
    """
    if bits not in QMAX:
        raise ValueError(f"bits={bits} is not supported. Fix: use 8 or 4.")
    qmax = QMAX[bits]
    flat = x.reshape(-1).float()
    n = flat.numel()
    pad = padded_numel(n, block_elems) - n
    if pad:
        flat = torch.nn.functional.pad(flat, (0, pad))
    blocks = flat.view(-1, block_elems)  # (nb, B)
    scales = blocks.abs().amax(dim=1) / qmax  # (nb,)
    safe = torch.where(scales > 0, scales, torch.ones_like(scales))
    codes = torch.round(blocks / safe[:, None]).clamp_(-qmax, qmax)
    codes = torch.where(scales[:, None] > 0, codes, torch.zeros_like(codes)).to(torch.int8).view(-1)
    if bits == 4:
        codes = pack_int4(codes)
    return codes, scales


def dequantize_ref(
    codes: torch.Tensor, scales: torch.Tensor, block_elems: int, numel: int, bits: int = 8, dtype: torch.dtype = torch.float32
) -> torch.Tensor:
    """Inverse of ``quantize_ref``: a 1-D tensor of ``numel`` elements in ``dtype``."""
    q = unpack_int4(codes) if bits == 4 else codes
    vals = q.view(-1, block_elems).float() * scales[:, None]
    return vals.view(-1)[:numel].to(dtype)


def pack_int4(codes: torch.Tensor) -> torch.Tensor:
    """int8 codes in [-7, 7] (even count) -> uint8, two per byte (low nibble first)."""
    u = (codes.to(torch.int16) + 8).to(torch.uint8).view(-1, 2)
    return (u[:, 0] | (u[:, 1] << 4)).contiguous()


def unpack_int4(packed: torch.Tensor) -> torch.Tensor:
    lo = (packed & 0x0F).to(torch.int16) - 8
    hi = (packed >> 4).to(torch.int16) - 8
    return torch.stack([lo, hi], dim=1).view(-1).to(torch.int8)


def swizzle_quantize_ref(
    x: torch.Tensor, order: list[int], chunk_elems: int, block_elems: int, bits: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """Reorder ``x``'s chunks (``x.view(-1, chunk_elems)[order]``) and quantize each chunk
    separately (blocks never straddle chunks): codes/scales laid out chunk after chunk."""
    chunks = x.reshape(-1, chunk_elems)[order]
    parts = [quantize_ref(c, block_elems, bits) for c in chunks]
    return torch.cat([p[0] for p in parts]), torch.cat([p[1] for p in parts])


def dequant_reduce_quantize_ref(
    codes: torch.Tensor,
    scales: torch.Tensor,
    *,
    sources: int,
    numel: int,
    block_elems: int,
    bits: int,
    requantize: bool = True,
) -> tuple[torch.Tensor, torch.Tensor] | torch.Tensor:
    """``sources`` quantized copies of a ``numel``-element tensor, back to back -> their fp32
    sum, requantized (or returned as fp32 when ``requantize`` is False)."""
    per_codes = codes.numel() // sources
    per_scales = scales.numel() // sources
    total = torch.zeros(numel, dtype=torch.float32, device=codes.device)
    for s in range(sources):
        total += dequantize_ref(
            codes[s * per_codes : (s + 1) * per_codes],
            scales[s * per_scales : (s + 1) * per_scales],
            block_elems,
            numel,
            bits,
        )
    return quantize_ref(total, block_elems, bits) if requantize else total

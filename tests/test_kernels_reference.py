"""Quantization kernels: properties of the torch reference (the CPU path of qwZ and qgZ)
and ``dequantize_gathered``, in process.

    pytest tests/test_kernels_reference.py -q

The Triton kernels against this reference: tests/test_kernels.py.
"""

from __future__ import annotations

import pytest
import torch

from tests.test_kernels import BITS, BLOCKS, DTYPES, NUMELS, _assert_equal, _gen, _randn, _tie_ks, _ties
from zeropp_strategy import kernels
from zeropp_strategy.kernels.reference import (
    QMAX,
    dequant_reduce_quantize_ref,
    dequantize_ref,
    half_step,
    pack_int4,
    quantize_ref,
    round_up_to_bf16,
    swizzle_quantize_ref,
    unpack_int4,
)


# -- the reference's own properties (in process) -----------------------------------------------


@pytest.mark.parametrize("bits", BITS)
@pytest.mark.parametrize("block_elems", (32, 256, 4096))
@pytest.mark.parametrize("dname", list(DTYPES))
def test_error_bound_per_block(dname, block_elems, bits):
    """|x - dequant(quant(x))| <= absmax(block) / (2 qmax), up to fp32 rounding of x / scale
    and of code * scale."""
    n = 3 * block_elems + 5
    x = _randn(f"bound-{dname}-{block_elems}-{bits}", n, DTYPES[dname])
    codes, scales = quantize_ref(x, block_elems, bits)
    err = (x.double() - dequantize_ref(codes, scales, block_elems, n, bits).double()).abs()
    xf = torch.nn.functional.pad(x.double(), (0, -n % block_elems)).view(-1, block_elems)
    absmax = xf.abs().amax(dim=1)
    assert torch.allclose(scales.double(), absmax / QMAX[bits], rtol=2**-23, atol=0)
    bound = (absmax * half_step(bits))[:, None] * (1 + 2**-20) + xf.abs() * 2**-22
    err = torch.nn.functional.pad(err, (0, -n % block_elems)).view(-1, block_elems)
    assert bool((err <= bound).all()), float((err - bound).max())
    # the bound is tight: some element uses most of it
    assert float((err / (absmax[:, None] * half_step(bits))).max()) > 0.5


@pytest.mark.parametrize("bits", (8, 4, 2))
def test_bf16_scales_are_rounded_up_and_the_codes_follow_them(bits):
    """bf16_scales=True ([Note: quantization conventions]): every scale is the smallest bf16
    value at or above absmax / qmax, the codes are those of that scale (so the payload's bf16
    scale and its codes agree exactly), and the error bound grows by at most 2^-7."""
    b, n = 64, 64 * 40 + 7
    x = _randn(f"bf16-scales-{bits}", n) * torch.logspace(-20, 20, n)
    codes, scales = quantize_ref(x, b, bits, bf16_scales=True)
    _, plain = quantize_ref(x, b, bits)
    assert torch.equal(scales, scales.to(torch.bfloat16).float())
    assert bool((scales >= plain).all()) and bool((scales <= plain * (1 + 2**-7)).all())
    below = (scales.view(torch.int32) - 0x10000).view(torch.float32)  # the bf16 value under each
    assert bool((below[plain > 0] < plain[plain > 0]).all())  # ... is too small: rounded up, not to nearest
    # the codes are those of the rounded scale: x / scale, rounded half to even (2 bits: to the nearest odd level)
    xf = torch.nn.functional.pad(x, (0, -n % b)).view(-1, b)
    y = xf / torch.where(scales == 0, 1.0, scales)[:, None]
    want = (2 * torch.floor(y / 2) + 1).clamp(-3, 3) if bits == 2 else torch.round(y).clamp(-QMAX[bits], QMAX[bits])
    got = dequantize_ref(codes, torch.ones_like(scales), b, xf.numel(), bits).view(-1, b)
    assert torch.equal(got, want)
    err = (x - dequantize_ref(codes, scales, b, n, bits)).abs()
    bound = torch.nn.functional.pad(xf.abs().amax(dim=1)[:, None].expand(-1, b).reshape(-1), (0, 0))[:n]
    assert bool((err <= bound * (1 + 2**-7) * half_step(bits) * (1 + 2**-20)).all())
    # the fused requantization rounds alike
    q = torch.cat([codes, codes]), torch.cat([scales, scales])
    c2, s2 = dequant_reduce_quantize_ref(*q, sources=2, numel=n, block_elems=b, bits=bits, bf16_scales=True)
    assert torch.equal((c2, s2)[1], quantize_ref(2 * dequantize_ref(codes, scales, b, n, bits), b, bits,
                                                  bf16_scales=True)[1])
    assert torch.equal(c2, quantize_ref(2 * dequantize_ref(codes, scales, b, n, bits), b, bits, bf16_scales=True)[0])


def test_round_up_to_bf16_edges():
    f = torch.tensor([0.0, 1.0, 1.0 + 2**-8, 1.0 + 2**-23, 3.0e38, 3.4028234e38, 1e-45, float("inf"),
                      float("nan")])
    got = round_up_to_bf16(f.clone())
    assert got[:4].tolist() == [0.0, 1.0, 1.0 + 2**-7, 1.0 + 2**-7]
    assert got[4] >= 3.0e38 and got[4] < 3.0e38 * (1 + 2**-7)
    assert got[5] == torch.finfo(torch.bfloat16).max  # the largest finite bf16, not inf
    assert got[6] == 2.0**-133  # the smallest bf16 subnormal
    assert got[7] == float("inf") and got[8].isnan()
    assert torch.equal(got[:8], got[:8].to(torch.bfloat16).float())


@pytest.mark.parametrize("bits", [8, 4])  # 2 bits round to odd levels: their own tie test
def test_reference_ties_round_half_to_even(bits):
    codes, scales = quantize_ref(_ties(bits), 32, bits)
    codes = unpack_int4(codes) if bits == 4 else codes
    assert scales.tolist() == [1.0, 2.0**-7, 2.0**5]
    ks = _tie_ks(bits)
    for block, sign in ((0, 1), (1, 1), (2, -1)):
        got = codes[32 * block + 1 : 32 * block + 1 + len(ks)].tolist()
        assert got == [sign * round(k + 0.5) for k in ks]  # Python's round() is half to even
    assert codes[1 + ks.index(0)] == 0 and codes[1 + ks.index(1)] == 2  # 0.5 -> 0, 1.5 -> 2


def test_zero_block_has_zero_scale_and_codes():
    x = torch.zeros(70)
    x[40] = 3.0
    codes, scales = quantize_ref(x, 32, 8)
    s = torch.tensor(3.0) / 127  # fp32
    assert torch.equal(scales, torch.stack([torch.tensor(0.0), s, torch.tensor(0.0)]))
    assert codes.count_nonzero() == 1 and codes[40] == 127
    assert torch.equal(dequantize_ref(codes, scales, 32, 70), torch.where(x != 0, 127 * s, 0.0))


@pytest.mark.parametrize("bits", BITS)
@pytest.mark.parametrize("bad", ("nan", "inf", "-inf"))
def test_nonfinite_block_has_nan_scale_and_codes_zero(bad, bits):
    """A block holding a NaN or an infinity: NaN scale, codes 0 (2 bits: level +1, stored as
    2), so it decodes to NaN everywhere, on every path that quantizes; the other blocks are
    untouched. On the CPU alone (the Triton cases check the kernels against this)."""
    x = _randn("nonfinite", 32 * 4)
    x[33] = float(bad)
    x[64] = torch.finfo(torch.float32).max  # finite, at the top of fp32: not flagged
    clean = x.clone()
    clean[33] = 0.0
    zero_code = {8: 0, 4: 0x88, 2: 0xAA}[bits]  # codes 0 (2 bits: level +1, stored as 2), packed
    for bf16 in (False, True):
        codes, scales = quantize_ref(x, 32, bits, bf16_scales=bf16)
        _, want_scales = quantize_ref(clean, 32, bits, bf16_scales=bf16)
        assert scales.isnan().tolist() == [False, True, False, False], scales
        assert torch.equal(scales[[0, 2, 3]], want_scales[[0, 2, 3]])
        per_block = codes.numel() // 4
        block1 = codes[per_block : 2 * per_block].view(torch.uint8) if bits != 8 else codes[32:64]
        assert (block1 == zero_code).all(), block1
        d = dequantize_ref(codes, scales, 32, x.numel(), bits)
        assert d[32:64].isnan().all() and not d[:32].isnan().any() and not d[64:].isnan().any()
        # the fused sum: the other source finite (and block 2 small: two of fp32's largest overflow)
        small = x.clone()
        small[64] = 1.0
        parts = [quantize_ref(small, 32, bits), quantize_ref(-small.nan_to_num(0.0, 0.0, 0.0), 32, bits)]
        c2, s2 = torch.cat([p[0] for p in parts]), torch.cat([p[1] for p in parts])
        _, rs = dequant_reduce_quantize_ref(c2, s2, sources=2, numel=x.numel(), block_elems=32, bits=bits,
                                            bf16_scales=bf16)
        assert rs.isnan().tolist() == [False, True, False, False], rs
    _, ss = swizzle_quantize_ref(x, [1, 0], chunk_elems=64, block_elems=32, bits=bits)
    assert ss.isnan().tolist() == [False, False, False, True], ss  # chunk 1's blocks first


@pytest.mark.parametrize("block_elems", (32, 256))
@pytest.mark.parametrize("dname", list(DTYPES))
def test_2bit_codes_layout_bound_and_every_op(dname, block_elems):
    """2-bit codes (qwZ's weight deltas, 2-bit gradients across nodes): four per byte,
    element 4i + k in bits 2k..2k+1 as (level + 3) / 2; levels -3/-1/+1/+3 of absmax / 3,
    each within one scale (absmax / 3, half the two-scale step) of its value; the other ops
    take them as they take int4 (tests/test_kernels.py: the Triton kernels, bit for bit)."""
    x4 = torch.tensor([3.0, -3.0, 0.0, -1.5, 2.0, -2.0, 1.9, -0.1] + [0.0] * 24)
    codes, scales = quantize_ref(x4, 32, 2)
    assert scales.tolist() == [1.0]
    # levels 3, -3, 1 (0: a tie goes up), -1; 3 (2: up), -1 (-2: up), 1, -1; stored as (level + 3) / 2
    assert codes.tolist()[:2] == [3 | (0 << 2) | (2 << 4) | (1 << 6), 3 | (1 << 2) | (2 << 4) | (1 << 6)]
    assert dequantize_ref(codes, scales, 32, 8, 2).tolist() == [3.0, -3.0, 1.0, -1.0, 3.0, -1.0, 1.0, -1.0]
    n = 1000
    x = _randn(f"2bit-{dname}-{block_elems}", n, DTYPES[dname])
    codes, scales = kernels.quantize(x, block_elems, 2)
    assert codes.dtype == torch.uint8 and codes.numel() == -(-n // block_elems) * block_elems // 4
    xf = torch.nn.functional.pad(x.float(), (0, codes.numel() * 4 - n)).view(-1, block_elems)
    assert torch.allclose(scales, xf.abs().amax(dim=1) / 3, rtol=2**-23, atol=0)
    y = kernels.dequantize(codes, scales, block_elems, n, 2)
    padded = torch.nn.functional.pad(y, (0, codes.numel() * 4 - n)).view(-1, block_elems)
    err = (padded - xf).abs()
    assert bool((err <= scales[:, None] * (1 + 2**-20)).all())
    assert float((err / scales[:, None]).max()) > 0.9  # the bound is tight
    levels = (padded / scales[:, None]).reshape(-1)[:n]  # F.pad's zeros past n are no level
    assert set(torch.unique(levels.round()).tolist()) == {-3.0, -1.0, 1.0, 3.0}
    sums = dequant_reduce_quantize_ref(torch.cat([codes, codes]), torch.cat([scales, scales]), sources=2, numel=n,
                                       block_elems=block_elems, bits=2, requantize=False)
    assert torch.equal(sums, 2 * y)
    gathered, parts, code_bytes = _gathered(f"gather-2bit-{block_elems}", 3, n, block_elems, 2)
    out = torch.empty(3 * n)
    kernels.dequantize_gathered(gathered, code_bytes=code_bytes, numel=n, block_elems=block_elems, out=out, bits=2)
    _assert_equal("gathered", out, torch.cat([kernels.dequantize(c, q, block_elems, n, 2) for c, q in parts]))
    swz, _ = swizzle_quantize_ref(x[:512], [1, 0], 256, block_elems, 2)
    assert torch.equal(swz, torch.cat([quantize_ref(x[256:512], block_elems, 2)[0], quantize_ref(x[:256], block_elems,
                                                                                                   2)[0]]))


def test_int4_pack_layout_and_round_trip():
    assert pack_int4(torch.tensor([1, -2, -7, 7], dtype=torch.int8)).tolist() == [9 | (6 << 4), 1 | (15 << 4)]
    g = _gen("int4")
    c = torch.randint(-8, 8, (4098,), generator=g, dtype=torch.int8)
    packed = pack_int4(c)
    assert packed.dtype == torch.uint8 and packed.numel() == 2049
    assert torch.equal(unpack_int4(packed), c)
    # and through quantize: int4 codes unpack to the int8 codes of an int4 quantizer
    x = _randn("int4-q", 300)
    codes4, scales4 = quantize_ref(x, 32, 4)
    assert unpack_int4(codes4).abs().max() <= 7
    absmax = torch.nn.functional.pad(x, (0, 20)).view(-1, 32).abs().amax(dim=1)
    assert torch.equal(scales4, absmax / 7)


@pytest.mark.parametrize(
    "numel,block_elems,bits,want",
    [
        (1000, 256, 8, 1024 + 4 * 4),
        (1000, 256, 4, 512 + 4 * 4),
        (256, 256, 8, 256 + 4),
        (1, 32, 4, 16 + 4),
        (0, 32, 8, 0),
        (10**6, 4096, 8, 245 * 4096 + 4 * 245),
    ],
)
def test_quantized_nbytes(numel, block_elems, bits, want):
    assert kernels.quantized_nbytes(numel, block_elems, bits) == want
    blocks = -(-numel // block_elems)
    assert kernels.quantized_nbytes(numel, block_elems, bits, scale_bytes=2) == want - 2 * blocks
    if numel:
        codes, scales = quantize_ref(torch.ones(numel), block_elems, bits)
        assert codes.numel() * codes.element_size() + scales.numel() * 4 == want


def test_swizzle_reference_is_chunkwise_quantize():
    x = _randn("swz", 5 * 100)
    codes, scales = swizzle_quantize_ref(x, [4, 0, 2], 100, 32, 8)
    assert codes.numel() == 3 * 128 and scales.numel() == 3 * 4
    _assert_equal("slot 0", (codes[:128], scales[:4]), quantize_ref(x[400:500], 32, 8))
    _assert_equal("slot 2", (codes[256:], scales[8:]), quantize_ref(x[200:300], 32, 8))


def test_reduce_reference_sums_sources():
    a, b = _randn("ra", 300), _randn("rb", 300)
    qa, qb = quantize_ref(a, 32, 8), quantize_ref(b, 32, 8)
    total = dequant_reduce_quantize_ref(
        torch.cat([qa[0], qb[0]]), torch.cat([qa[1], qb[1]]), sources=2, numel=300, block_elems=32, bits=8,
        requantize=False,
    )  # fmt: skip
    assert torch.equal(total, dequantize_ref(*qa, 32, 300) + dequantize_ref(*qb, 32, 300))


@pytest.mark.parametrize("bits", BITS)
def test_chunking_changes_no_bit(monkeypatch, bits):
    """[Note: fast CPU reference]: the work goes in chunks of _CHUNK_ELEMS elements; chunks
    of one block must give the same bytes as one chunk for everything (tails, zero and
    subnormal blocks, several sources)."""
    from zeropp_strategy.kernels import reference as ref

    n, b = 5 * 64 + 17, 64
    x = _randn(f"chunks-{bits}", n)
    x[64:128] = 0.0
    x[128:192] *= 1e-40 / x[128:192].abs().max()  # a subnormal scale
    qs = [quantize_ref(x * (s + 1), b, bits) for s in range(3)]
    codes, scales = torch.cat([q[0] for q in qs]), torch.cat([q[1] for q in qs])

    def everything():
        out = [quantize_ref(x, b, bits), quantize_ref(x.bfloat16(), b, bits)]
        out.append(dequantize_ref(*qs[0], b, n, bits, torch.bfloat16))
        out.append(swizzle_quantize_ref(x[:336], [2, 0, 1], 112, b, bits))
        for requantize in (True, False):
            kw = dict(sources=3, numel=n - 3, block_elems=b, bits=bits, requantize=requantize)
            out.append(dequant_reduce_quantize_ref(codes, scales, **kw))
        return out

    monkeypatch.setattr(ref, "_CHUNK_ELEMS", 1 << 30)
    whole = everything()
    monkeypatch.setattr(ref, "_CHUNK_ELEMS", b)
    for i, (got, want) in enumerate(zip(everything(), whole)):
        _assert_equal(f"result {i}", got, want)


def _gathered(name: str, world: int, numel: int, block_elems: int, bits: int = 8) -> tuple[torch.Tensor, list, int]:
    """(world, payload_bytes) uint8 rows as qwZ all-gathers them, each rank its own shard."""
    parts = [quantize_ref(_randn(f"{name}/{r}", numel), block_elems, bits) for r in range(world)]
    rows = [torch.cat([c.view(torch.uint8), s.view(torch.uint8)]) for c, s in parts]
    return torch.stack(rows), parts, parts[0][0].numel()


@pytest.mark.parametrize("bits", (8, 4))
@pytest.mark.parametrize("dname", list(DTYPES))
@pytest.mark.parametrize("block_elems", BLOCKS)
@pytest.mark.parametrize("world", (1, 2, 3, 4, 5))
def test_dequantize_gathered_matches_dequantize_per_row(monkeypatch, world, block_elems, dname, bits):
    from zeropp_strategy.kernels import reference as ref

    dtype = DTYPES[dname]
    for numel in NUMELS:
        gathered, parts, code_bytes = _gathered(f"gather-{world}-{block_elems}", world, numel, block_elems, bits)
        want = torch.cat([kernels.dequantize(c, s, block_elems, numel, bits, dtype) for c, s in parts])
        for chunk in (1 << 30, block_elems):  # one chunk, and a chunk per block
            monkeypatch.setattr(ref, "_CHUNK_ELEMS", chunk)
            out = torch.full((world * numel,), float("nan"), dtype=dtype)
            kw = dict(code_bytes=code_bytes, numel=numel, block_elems=block_elems, out=out, bits=bits)
            assert kernels.dequantize_gathered(gathered, **kw) is None
            _assert_equal(f"numel={numel} chunk={chunk}", out, want)


@pytest.mark.parametrize(("world", "bits"), [(3, 8), (3, 4), (1, 4)])
def test_dequantize_gathered_misaligned_buffer(world, bits):
    """Rows at an odd byte offset (a slice of a bigger receive buffer): the scales cannot be
    viewed as fp32 in place, and are still read right."""
    gathered, parts, code_bytes = _gathered("gather-odd", world, 1000, 256, bits)
    buf = torch.zeros(1 + gathered.numel(), dtype=torch.uint8)
    buf[1:] = gathered.view(-1)
    odd = buf[1:].view(gathered.shape)
    out = torch.empty(world, 1000, dtype=torch.bfloat16)  # any contiguous shape with world x numel elements
    kernels.dequantize_gathered(odd, code_bytes=code_bytes, numel=1000, block_elems=256, out=out, bits=bits)
    want = torch.cat([kernels.dequantize(c, s, 256, 1000, bits, torch.bfloat16) for c, s in parts])
    _assert_equal("misaligned", out.view(-1), want)


def test_dequantize_gathered_bad_arguments():
    gathered, _, code_bytes = _gathered("gather-bad", 2, 300, 32)
    out = torch.empty(600)
    ok = dict(code_bytes=code_bytes, numel=300, block_elems=32, out=out)
    with pytest.raises(TypeError, match="uint8.*Fix:"):
        kernels.dequantize_gathered(gathered.view(torch.int8), **ok)
    with pytest.raises(TypeError, match="uint8.*Fix:"):
        kernels.dequantize_gathered(gathered.view(-1), **ok)
    with pytest.raises(ValueError, match="code_bytes=300.*numel=300.*Fix:"):
        kernels.dequantize_gathered(gathered, **(ok | {"code_bytes": 300}))
    with pytest.raises(ValueError, match="numel=330.*Fix:"):
        kernels.dequantize_gathered(gathered, **(ok | {"numel": 330, "out": torch.empty(660)}))
    with pytest.raises(ValueError, match="block_elems=64.*Fix:"):
        kernels.dequantize_gathered(gathered, **(ok | {"block_elems": 64}))
    with pytest.raises(ValueError, match="block_elems=48.*Fix:"):
        kernels.dequantize_gathered(gathered, **(ok | {"block_elems": 48}))
    with pytest.raises(ValueError, match="600 elements.*Fix:"):
        kernels.dequantize_gathered(gathered, **(ok | {"out": torch.empty(599)}))
    with pytest.raises(ValueError, match="600 elements.*Fix:"):
        kernels.dequantize_gathered(gathered, **(ok | {"out": torch.empty(600, dtype=torch.int32)}))
    with pytest.raises(ValueError, match="not contiguous.*Fix:"):
        kernels.dequantize_gathered(gathered, **(ok | {"out": torch.empty(2, 600)[:, ::2]}))


@pytest.mark.parametrize("bf16", (False, True))
@pytest.mark.parametrize("bits", BITS)
def test_quantize_into_equals_quantize_and_its_residual_the_decoded_difference(monkeypatch, bits, bf16):
    """``kernels.quantize_into`` writes quantize's bytes into the given buffers; with
    ``residual`` the input becomes ``x - dequantize(codes, scales)`` (computed from the
    rounded quotients, not by decoding): equal in value, NaN where that is NaN, across zero,
    -0.0, subnormal, tiny-negative and inf blocks, in chunks of one block and unchunked."""
    from zeropp_strategy.kernels import reference as ref

    b, n = 64, 64 * 9
    x = _randn(f"into-{bits}-{bf16}", n)
    x[:64] = 0.0
    x[64:128] = -0.0
    x[128:192] *= 1e-40 / x[128:192].abs().max()  # a subnormal scale
    x[192:256] = -1e-30
    x[256] = -0.0  # an element that is itself -0.0 (its residual may be +0.0: the sign of a zero)
    x[320:384] *= 1e30
    x[400] = float("inf")
    for chunk in (1 << 30, b):
        monkeypatch.setattr(ref, "_CHUNK_ELEMS", chunk)
        want_codes, want_scales = kernels.quantize(x, b, bits, bf16_scales=bf16)
        codes, scales = torch.empty_like(want_codes), torch.empty_like(want_scales)
        kernels.quantize_into(x, codes, scales, b, bits, bf16_scales=bf16)
        bits_of = lambda c, s: (c, s.view(torch.int32))  # noqa: E731 - NaN scales compared by their bits
        _assert_equal(f"into chunk={chunk}", bits_of(codes, scales), bits_of(want_codes, want_scales))
        dropped = x.clone()
        kernels.quantize_into(dropped, codes, scales, b, bits, bf16_scales=bf16, residual=True)
        _assert_equal(f"into residual chunk={chunk}", bits_of(codes, scales), bits_of(want_codes, want_scales))
        want = x - kernels.dequantize(want_codes, want_scales, b, n, bits)
        assert torch.equal(dropped.isnan(), want.isnan()) and dropped.isnan()[384:448].all(), chunk
        assert torch.equal(dropped[~want.isnan()], want[~want.isnan()]), chunk


def test_quantize_into_bad_arguments():
    x = torch.randn(320)
    codes, scales = torch.empty(160, dtype=torch.uint8), torch.empty(5)
    with pytest.raises(ValueError, match=r"codes is torch.int8\(160,\).*160 torch.uint8.*Fix:"):
        kernels.quantize_into(x, codes.view(torch.int8), scales, 64, 4)
    with pytest.raises(ValueError, match=r"scales is torch.float32\(4,\).*5 torch.float32.*Fix:"):
        kernels.quantize_into(x, codes, scales[:4], 64, 4)
    with pytest.raises(ValueError, match="residual=True.*fp32, contiguous and whole blocks of 64.*Fix:"):
        kernels.quantize_into(x[:300], codes, scales, 64, 4, residual=True)
    with pytest.raises(ValueError, match="residual=True.*Fix:"):
        kernels.quantize_into(x.bfloat16(), codes, scales, 64, 4, residual=True)
    with pytest.raises(TypeError, match="floating-point.*Fix:"):
        kernels.quantize_into(torch.ones(320, dtype=torch.int32), codes, scales, 64, 4)

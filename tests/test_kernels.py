"""Quantization kernels: the Triton kernels against the torch reference, bit for bit, and
properties of the reference itself.

    pytest tests/test_kernels.py -q
    TRITON_INTERPRET=1 ZEROPP_FORCE_TRITON=1 python -m tests.test_kernels   # the Triton cases alone

The Triton interpreter must be switched on before triton is first imported, so the Triton
comparisons run in one subprocess (this file run as a module with TRITON_INTERPRET=1 and
ZEROPP_FORCE_TRITON=1), which goes through every case in ``_triton_cases()`` and prints one
JSON line of results; each case is then its own pytest test. The sizes are small because
the interpreter runs every program in Python: odd lengths (1, 7, 255, 4097 elements), tails
shorter than a block, blocks longer than one kernel tile (8192, 65536).

On a machine with a CUDA GPU the same cases also run in process, compiled (no interpreter),
on CUDA tensors against the reference on the CPU (test_triton_cuda_matches_reference).

"Equal" means exactly equal (torch.equal) everywhere: codes, fp32 scales and dequantized
values. See [Note: bit-exact agreement with the reference] in kernels/triton_quant.py.
"""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
import traceback
import zlib
from collections.abc import Callable
from pathlib import Path

import pytest
import torch

from zeropp_strategy import kernels
from zeropp_strategy.kernels.reference import (
    QMAX,
    dequant_reduce_quantize_ref,
    dequantize_ref,
    padded_numel,
    quantize_into_ref,
    quantize_ref,
    swizzle_quantize_ref,
    unpack_int4,
)

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}
NUMELS = (1, 7, 255, 256, 1000, 4097)
BLOCKS = (32, 256)
BITS = (8, 4, 2)
_TRITON_TIMEOUT_S = 300  # the whole subprocess; it takes about 20 s on 2 idle cores


def _gen(name: str) -> torch.Generator:
    return torch.Generator().manual_seed(zlib.crc32(name.encode()))


def _randn(name: str, n: int, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    # a spread of magnitudes per block, so scales differ from block to block
    g = _gen(name)
    return (torch.randn(n, generator=g) * torch.exp(2 * torch.randn(n, generator=g))).to(dtype)


def _assert_equal(what: str, got, want) -> None:
    if isinstance(want, tuple):
        _assert_equal(what + ".codes", got[0], want[0])
        _assert_equal(what + ".scales", got[1], want[1])
        return
    assert got.dtype == want.dtype and got.shape == want.shape, (
        f"{what}: {got.dtype}{tuple(got.shape)} != {want.dtype}{tuple(want.shape)}"
    )
    if not torch.equal(got, want):
        bad = (got != want).nonzero().flatten()
        i = int(bad[0])
        raise AssertionError(f"{what}: {bad.numel()} elements differ, first at {i}: {got[i]} != {want[i]}")


# -- the Triton cases (run in the subprocess, or in process on a GPU) ---------------------------

_DEVICE = "cpu"  # "cuda" in test_triton_cuda_matches_reference


def _dev(op: str, *args, **kwargs):
    """``kernels.<op>`` with its tensors on _DEVICE, results back on the CPU: the reference runs
    on the CPU, since the same bytes on every device is part of the contract."""

    def move(a):
        return a.to(_DEVICE) if isinstance(a, torch.Tensor) else a

    out = getattr(kernels, op)(*map(move, args), **{k: move(v) for k, v in kwargs.items()})
    return tuple(o.cpu() for o in out) if isinstance(out, tuple) else out.cpu()



def _check_roundtrip(x: torch.Tensor, block_elems: int, bits: int) -> None:
    """quantize, then dequantize into x's dtype and fp32: Triton == reference."""
    got, want = _dev("quantize", x, block_elems, bits), quantize_ref(x, block_elems, bits)
    _assert_equal("quantize", got, want)
    for dtype in {x.dtype, torch.float32}:
        _assert_equal(
            f"dequantize->{dtype}",
            _dev("dequantize", *want, block_elems, x.numel(), bits, dtype),
            dequantize_ref(*want, block_elems, x.numel(), bits, dtype),
        )
    # into a given buffer (its dtype): the same values, written there
    buf = torch.full((x.numel(),), float("nan"), dtype=x.dtype, device=_DEVICE)
    got = kernels.dequantize(*(t.to(_DEVICE) for t in want), block_elems, x.numel(), bits, out=buf)
    assert got.data_ptr() == buf.data_ptr()
    _assert_equal("dequantize->out", buf.cpu(), dequantize_ref(*want, block_elems, x.numel(), bits, x.dtype))


def _tie_ks(bits: int) -> list[int]:
    """k for the ties k + .5 in a test block: around 0 and next to +-qmax."""
    q = QMAX[bits]
    return sorted(set(range(-min(q, 8), min(q, 8))) | set(range(q - 7, q)) | set(range(-q, -q + 7)))


def _ties(bits: int) -> torch.Tensor:
    """Three blocks of 32 whose x / scale lands exactly on .5: [qmax, k + .5 for k in _tie_ks,
    zeros] times 1, 2^-7 and -2^5, so scale = absmax / qmax is a power of two."""
    halves = [k + 0.5 for k in _tie_ks(bits)]
    one = torch.tensor(([float(QMAX[bits])] + halves + [0.0] * 32)[:32])
    return torch.cat([one, one * 2.0**-7, -one * 2.0**5])


def _triton_cases() -> dict[str, Callable[[], None]]:
    cases: dict[str, Callable[[], None]] = {}

    def case(name: str):
        def add(fn):
            cases[name] = fn
            return fn

        return add

    @case("dispatch-chooses-triton")
    def _():
        assert _DEVICE == "cuda" or os.environ.get("TRITON_INTERPRET") == "1"
        assert kernels.kernel_backend(torch.zeros(1, device=_DEVICE)) == "triton"
        _dev("quantize", torch.ones(3), 32)
        assert "zeropp_strategy.kernels.triton_quant" in sys.modules

    for dname, dtype in DTYPES.items():
        for n in NUMELS:
            for b in BLOCKS:
                for bits in BITS:
                    name = f"roundtrip-{dname}-n{n}-b{b}-int{bits}"
                    cases[name] = lambda name=name, n=n, dtype=dtype, b=b, bits=bits: _check_roundtrip(
                        _randn(name, n, dtype), b, bits
                    )
    # blocks longer than one tile: two passes per block in the kernel
    for n, b in ((4097, 8192), (20000, 8192), (70000, 65536)):
        for bits in BITS:
            for dname in ("fp32", "bf16"):
                name = f"roundtrip-longblock-{dname}-n{n}-b{b}-int{bits}"
                cases[name] = lambda name=name, n=n, b=b, bits=bits, dtype=DTYPES[dname]: _check_roundtrip(
                    _randn(name, n, dtype), b, bits
                )
    @case("ties-odd-levels-int2")
    def _():
        # 2 bits: the odd level nearest x / scale, an even x / scale (a tie) going up; three
        # blocks of 32 with scale 1, 2^-7 and 2^5 (absmax 3 times that)
        one = torch.tensor(([3.0, -3.0, -2.0, 2.0, 0.0, -0.0, 1.0, -1.0, 0.5, -0.5, 1.5, -1.5, 2.5, -2.5,
                             2.0 - 2.0**-22, -2.0 + 2.0**-22, -3e-39, 3e-39] + [0.0] * 32)[:32])  # subnormal y / 2
        x = torch.cat([one, one * 2.0**-7, -one * 2.0**5])
        _check_roundtrip(x, 32, 2)
        codes, scales = _dev("quantize", x, 32, 2)
        assert torch.equal(scales, torch.tensor([1.0, 2.0**-7, 2.0**5]))
        levels = dequantize_ref(codes, scales, 32, 96, 2)[:32]
        _assert_equal("tie levels", levels, (2 * torch.floor(x[:32] / 2) + 1).clamp(-3, 3))
        assert levels[2] == -1 and levels[3] == 3 and levels[4] == 1  # -2 -> -1, 2 -> 3, 0 -> +1
        assert levels[16] == -1 and levels[17] == 1  # no flush to zero: -3e-39 -> -1

    for bits in BITS:
        if bits != 2:  # 2 bits round to odd levels: ties-odd-levels-int2 above

            @case(f"ties-round-half-even-int{bits}")
            def _(bits=bits):
                x = _ties(bits)
                _check_roundtrip(x, 32, bits)
                codes = _dev("quantize", x, 32, bits)[0]
                codes = unpack_int4(codes) if bits == 4 else codes
                want = torch.round(x[:32]).to(torch.int8)  # scale 1 in the first block
                _assert_equal("tie codes", codes[:32], want)
                assert int(codes[1 + _tie_ks(bits).index(0)]) == 0  # +0.5 -> 0, not 1

        @case(f"zero-blocks-int{bits}")
        def _(bits=bits):
            x = _randn("zero", 32 * 5)
            x[32:64] = 0.0  # an all-zero block
            x[96:128] = -0.0  # negative zeros
            x[-1] = 0.0
            _check_roundtrip(x, 32, bits)
            _, scales = _dev("quantize", x, 32, bits)
            assert scales[1] == 0 and scales[3] == 0
            _check_roundtrip(torch.zeros(100), 32, bits)

        @case(f"extreme-magnitudes-int{bits}")
        def _(bits=bits):
            # subnormal scales (absmax 1e-40, 1e-44), near-overflow values, single outliers
            x = _randn("extreme", 32 * 6)
            x[0:32] *= 1e-40 / x[0:32].abs().max()
            x[32:64] *= 1e-44 / x[32:64].abs().max()
            x[64:96] *= 3e38 / x[64:96].abs().max()
            x[100] = 1e6
            _check_roundtrip(x, 32, bits)
            _check_roundtrip(torch.full((40,), 65504.0, dtype=torch.float16), 32, bits)

        for kind, first, last in (("nan", float("nan"), float("nan")), ("inf", float("inf"), float("-inf"))):

            @case(f"{kind}-blocks-int{bits}")
            def _(bits=bits, kind=kind, first=first, last=last):
                # a NaN or an infinity gives its block a NaN scale and codes 0 on both back ends,
                # so the block decodes to NaN and the non-finite checks downstream see it (tl.max
                # alone would drop a NaN; with an infinite scale the infinity itself divided to
                # NaN, whose integer code is unspecified, so the back ends could differ)
                x = _randn(kind, 32 * 4 + 9)
                x[40] = first  # block 1
                x[32 * 4 + 3] = last  # the partial last block
                x[70] = torch.finfo(torch.bfloat16).max  # block 2 finite in fp32 and bf16, near the top: not flagged
                long = _randn(f"{kind}-long", 9000)
                long[8191] = last  # a long block: the running absmax over the tile passes
                for b, xs in ((32, x), (32, x.bfloat16()), (8192, long)):
                    got, want = _dev("quantize", xs, b, bits), quantize_ref(xs, b, bits)
                    _assert_equal(f"{kind} codes", got[0], want[0])
                    torch.testing.assert_close(got[1], want[1], rtol=0, atol=0, equal_nan=True)
                    assert want[1].isnan().sum() == (2 if b == 32 else 1), want[1]
                    d = dequantize_ref(*want, b, xs.numel(), bits)
                    bad = torch.zeros(padded_numel(xs.numel(), b), dtype=torch.bool)
                    bad.view(-1, b)[want[1].isnan()] = True
                    assert d.isnan().equal(bad[: xs.numel()]), f"a block with {kind} decodes to NaN, no other"
                    got_d = _dev("dequantize", *want, b, xs.numel(), bits, torch.float32)
                    torch.testing.assert_close(got_d, d, rtol=0, atol=0, equal_nan=True)
                # the fused reduce of such blocks; and a sum that overflows fp32 gives an infinity,
                # flagged the same way
                for sources, all_nan in (([x, x * 0.5], False), ([torch.full((64,), 3e38)] * 2, True)):
                    parts = [quantize_ref(p, 32, bits) for p in sources]
                    codes, scales = torch.cat([p[0] for p in parts]), torch.cat([p[1] for p in parts])
                    kw = dict(sources=2, numel=sources[0].numel(), block_elems=32, bits=bits)
                    got = _dev("dequant_reduce_quantize", codes, scales, **kw)
                    want = dequant_reduce_quantize_ref(codes, scales, **kw)
                    _assert_equal(f"{kind} reduce codes", got[0], want[0])
                    torch.testing.assert_close(got[1], want[1], rtol=0, atol=0, equal_nan=True)
                    assert want[1].isnan().all() if all_nan else want[1].isnan().any(), want[1]

        @case(f"strided-2d-input-int{bits}")
        def _(bits=bits):
            x = _randn("strided", 33 * 65).view(33, 65).t()  # not contiguous
            _check_roundtrip(x, 32, bits)

        for dname, dtype in DTYPES.items():
            for chunk, b, order in (
                (100, 32, [3, 1, 0, 2]),  # chunk not a multiple of the block
                (37, 32, [2, 2, 0]),  # repeated slots, a chunk left out
                (1000, 256, [1, 0]),
                (512, 256, [0, 1, 3, 2]),
                (8192 + 100, 8192, [1, 0]),  # long blocks
                (7, 32, [-1, 0]),  # negative index, as torch indexing allows
            ):
                name = f"swizzle-{dname}-chunk{chunk}-b{b}-int{bits}-order{'_'.join(map(str, order))}"

                @case(name)
                def _(name=name, chunk=chunk, b=b, order=order, bits=bits, dtype=dtype):
                    n_chunks = max(max(order), -min(order)) + 1
                    x = _randn(name, n_chunks * chunk, dtype)
                    want = swizzle_quantize_ref(x, order, chunk, b, bits)
                    _assert_equal("swizzle(list)", _dev("swizzle_quantize", x, order, chunk, b, bits), want)
                    if min(order) >= 0:
                        t = torch.tensor(order)
                        _assert_equal("swizzle(tensor)", _dev("swizzle_quantize", x, t, chunk, b, bits), want)

        for sources in (1, 2, 3, 4):
            for n, b in ((7, 32), (1000, 32), (4097, 256), (1000, 256), (9000, 8192)):
                for requantize in (True, False):
                    name = f"reduce-s{sources}-n{n}-b{b}-int{bits}-{'requant' if requantize else 'fp32'}"

                    @case(name)
                    def _(name=name, sources=sources, n=n, b=b, bits=bits, requantize=requantize):
                        parts = [quantize_ref(_randn(f"{name}/{s}", n), b, bits) for s in range(sources)]
                        codes = torch.cat([p[0] for p in parts])
                        scales = torch.cat([p[1] for p in parts])
                        kw = dict(sources=sources, numel=n, block_elems=b, bits=bits, requantize=requantize)
                        want = dequant_reduce_quantize_ref(codes, scales, **kw)
                        _assert_equal("reduce", _dev("dequant_reduce_quantize", codes, scales, **kw), want)

    for bits in BITS:

        @case(f"bf16-scales-int{bits}")
        def _(bits=bits):
            """Scales rounded up to bf16 before the codes ([Note: quantization conventions]): the
            same bytes as the reference, for plain blocks, extreme magnitudes and long blocks,
            and in the fused requantization."""
            x = _randn("bf16s", 32 * 8)
            x[0:32] *= 1e-40 / x[0:32].abs().max()  # a subnormal scale
            x[32:64] *= 3e38 / x[32:64].abs().max()  # near overflow
            x[64:96] = 0.0
            x[96:128] = torch.tensor(float(QMAX[bits])) * (1 + 2.0**-9)  # a scale just above a bf16 value
            for b, xs in ((32, x), (8192, _randn("bf16s-long", 9000))):
                got = _dev("quantize", xs, b, bits, bf16_scales=True)
                want = quantize_ref(xs, b, bits, bf16_scales=True)
                _assert_equal("quantize(bf16_scales)", got, want)
                assert torch.equal(want[1], want[1].to(torch.bfloat16).float())
            parts = [quantize_ref(_randn(f"bf16s/{s}", 1000), 32, bits) for s in range(3)]
            codes, scales = torch.cat([p[0] for p in parts]), torch.cat([p[1] for p in parts])
            kw = dict(sources=3, numel=1000, block_elems=32, bits=bits, requantize=True, bf16_scales=True)
            want = dequant_reduce_quantize_ref(codes, scales, **kw)
            _assert_equal("reduce(bf16_scales)", _dev("dequant_reduce_quantize", codes, scales, **kw), want)
            assert torch.equal(want[1], want[1].to(torch.bfloat16).float())

    for bits in BITS:

        @case(f"quantize-into-residual-int{bits}")
        def _(bits=bits):
            # error feedback's call (comm/feedback.py): Triton's quantize written into the
            # buffers and its decoded difference left in x, against the CPU reference's
            x = _randn(f"into-{bits}", 64 * 40)
            x[:64] = 0.0
            x[100] = float("inf")
            want_x = x.clone()
            want = tuple(torch.empty_like(t) for t in quantize_ref(x, 64, bits))
            quantize_into_ref(want_x, *want, 64, bits, residual=True)  # the reference, not dispatched
            dev_x = x.to(_DEVICE)
            got = tuple(torch.empty_like(t, device=_DEVICE) for t in want)
            kernels.quantize_into(dev_x, *got, 64, bits, residual=True)
            _assert_equal("quantize_into", (got[0].cpu(), got[1].cpu().view(torch.int32)),
                          (want[0], want[1].view(torch.int32)))
            got_x, nan = dev_x.cpu(), want_x.isnan()
            assert torch.equal(got_x.isnan(), nan) and torch.equal(got_x[~nan], want_x[~nan])

    @case("user-errors")
    def _():
        from zeropp_strategy.kernels import triton_quant as tq

        codes, scales = quantize_ref(torch.ones(100), 32, 8)
        for call in (
            lambda: tq.dequantize_triton(codes, scales, 32, 129, 8),  # numel past the blocks
            lambda: tq.dequantize_triton(codes, scales, 64, 100, 8),  # wrong block size
            lambda: tq.dequant_reduce_quantize_triton(codes, scales, sources=3, numel=100, block_elems=32, bits=8),
            lambda: tq.swizzle_quantize_triton(torch.ones(100), [0], 30, 32, 8),  # chunk does not divide
            lambda: tq.swizzle_quantize_triton(torch.ones(100), [4], 25, 32, 8),  # no chunk 4
            lambda: tq.quantize_triton(torch.ones(100), 48, 8),
            lambda: tq.quantize_triton(torch.ones(100, dtype=torch.int32), 32, 8),
            lambda: tq.dequantize_triton(codes.view(torch.uint8), scales, 32, 100, 8),  # uint8 codes for int8
        ):
            try:
                call()
            except (ValueError, IndexError, TypeError):
                continue
            raise AssertionError("a bad argument was accepted")

    return cases


def _run_triton_cases() -> dict[str, dict]:
    results = {}
    for name, fn in _triton_cases().items():
        try:
            fn()
            results[name] = {"ok": True}
        except Exception as e:  # noqa: BLE001 - every failure is reported per case
            results[name] = {"ok": False, "error": f"{type(e).__name__}: {e}", "tb": traceback.format_exc()[-2000:]}
    return results


_HAVE_TRITON = importlib.util.find_spec("triton") is not None
_MARK = "ZEROPP-TRITON-RESULTS "


@pytest.fixture(scope="module")
def triton_results() -> dict[str, dict]:
    root = Path(__file__).resolve().parents[1]
    env = {**os.environ, "TRITON_INTERPRET": "1", "ZEROPP_FORCE_TRITON": "1", "OMP_NUM_THREADS": "1"}
    proc = subprocess.run(
        [sys.executable, "-m", "tests.test_kernels"],
        cwd=root, env=env, capture_output=True, text=True, timeout=_TRITON_TIMEOUT_S,
    )  # fmt: skip
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith(_MARK)]
    assert proc.returncode == 0 and lines, f"subprocess failed (rc {proc.returncode}):\n{proc.stderr[-4000:]}"
    return json.loads(lines[-1][len(_MARK) :])


@pytest.mark.skipif(not _HAVE_TRITON, reason="triton is not installed")
@pytest.mark.parametrize("name", list(_triton_cases()))
def test_triton_matches_reference(triton_results, name):
    r = triton_results.get(name)
    assert r is not None, f"case {name} did not run"
    assert r["ok"], r["error"] + "\n" + r["tb"]


@pytest.mark.skipif(not (_HAVE_TRITON and torch.cuda.is_available()), reason="needs a CUDA GPU and triton")
@pytest.mark.parametrize("name", list(_triton_cases()))
def test_triton_cuda_matches_reference(name, monkeypatch):
    """The same cases compiled for the GPU (no interpreter): CUDA tensors take the Triton path."""
    monkeypatch.setitem(globals(), "_DEVICE", "cuda")
    monkeypatch.delenv("ZEROPP_FORCE_TRITON", raising=False)
    _triton_cases()[name]()


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("bits", [8, 4, 2])
def test_reference_cuda_matches_cpu(bits):
    """The torch reference on CUDA writes the CPU's bytes: the same data-dependent divisions
    (torch's CUDA division by a Python scalar is a reciprocal multiply, which moved scales by
    an ulp on an H100 until qmax became a tensor). Large enough for such ulps to show."""
    x = _randn(f"ref-cuda-{bits}", 1 << 22, torch.bfloat16)
    b = 256 if bits == 8 else 64
    want = quantize_ref(x, b, bits)
    got = tuple(t.cpu() for t in quantize_ref(x.cuda(), b, bits))
    _assert_equal("quantize_ref on cuda", got, want)
    parts = [quantize_ref(x * (s + 1), b, bits) for s in range(3)]
    codes, scales = torch.cat([p[0] for p in parts]), torch.cat([p[1] for p in parts])
    kw = dict(sources=3, numel=x.numel(), block_elems=b, bits=bits)
    want = dequant_reduce_quantize_ref(codes, scales, **kw)
    got = dequant_reduce_quantize_ref(codes.cuda(), scales.cuda(), **kw)
    _assert_equal("dequant_reduce_quantize_ref on cuda", tuple(t.cpu() for t in got), want)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("bits", [8, 4])
def test_dequantize_gathered_cuda_matches_cpu(bits):
    """qwZ's receive side on CUDA (int4: Triton's dequantize over every rank's codes at once,
    the weight gathers of zeropp_4bit) writes the CPU reference's values, rows at odd sizes."""
    from zeropp_strategy import kernels

    world, numel, b = 3, 1000, 64
    parts = [quantize_ref(_randn(f"gathered-cuda-{bits}-{r}", numel, torch.bfloat16), b, bits) for r in range(world)]
    gathered = torch.stack([torch.cat([c.view(torch.uint8), s.view(torch.uint8)]) for c, s in parts])
    kw = dict(code_bytes=parts[0][0].numel(), numel=numel, block_elems=b, bits=bits)
    want = torch.empty(world * numel, dtype=torch.bfloat16)
    kernels.dequantize_gathered(gathered, out=want, **kw)
    got = torch.full((world * numel,), float("nan"), dtype=torch.bfloat16, device="cuda")
    kernels.dequantize_gathered(gathered.cuda(), out=got, **kw)
    _assert_equal("dequantize_gathered on cuda", got.cpu(), want)


def _compile_ptx(kernel_name: str, signature: dict[str, str], constexprs: dict) -> str:
    import re

    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    from zeropp_strategy.kernels import triton_quant as tq

    sig = signature | {k: "constexpr" for k in constexprs}
    # tt.divisibility=16 on every argument, as a launch with aligned buffers would specialize
    attrs = {(i,): [["tt.divisibility", 16]] for i, v in enumerate(signature.values())}
    src = ASTSource(fn=getattr(tq, kernel_name), signature=sig, constexprs=constexprs, attrs=attrs)
    compiled = triton.compile(src, target=GPUTarget("cuda", 90, 32), options={"num_warps": 8, "enable_fp_fusion": False})
    return re.sub(r"//.*", "", compiled.asm["ptx"])  # drop comments


@pytest.mark.skipif(
    not _HAVE_TRITON or os.environ.get("TRITON_INTERPRET") == "1", reason="needs triton, not its interpreter"
)
def test_ptx_uses_exact_arithmetic():
    """What the interpreter cannot see: how the kernels lower for a GPU (sm_90, compiled here
    without one). [Note: bit-exact agreement with the reference] needs correctly rounded
    division (div.rn, not div.full/div.approx), no fused multiply-add, and the add/subtract
    rounding trick left unfolded (two add.rn.f32 per element); aligned buffers get 16-byte
    vector loads and stores."""
    import triton

    if tuple(int(v) for v in triton.__version__.split(".")[:2]) < (3, 4):
        pytest.skip("ASTSource signature format of triton >= 3.4")
    common = {"BLOCK_ELEMS": 256, "ROWS": 16, "W": 256}  # 4096 elements, 8 warps: 16 per thread

    def quantize_ptx(x: str, codes: str, bits: int, bf16_scales: bool) -> str:
        return _compile_ptx(
            "_quantize_kernel",
            {"x_ptr": x, "order_ptr": "*i64", "codes_ptr": codes, "scales_ptr": "*fp32",
             "chunk_elems": "i32", "blocks_per_chunk": "i32", "total_blocks": "i32"},
            {"HAS_ORDER": False, "QMAX": QMAX[bits], "BITS": bits, "BF16_SCALES": bf16_scales} | common,
        )  # fmt: skip

    ptx = quantize_ptx("*bf16", "*i8", 8, False)
    assert "div.full" not in ptx and "div.approx" not in ptx and "fma." not in ptx
    assert ptx.count("div.rn.f32") >= 16 and ptx.count("add.rn.f32") >= 32
    assert "ld.global.v4" in ptx and "st.global.v4" in ptx and ".local" not in ptx
    ptx = _compile_ptx(
        "_dequant_reduce_quantize_kernel",
        {"codes_ptr": "*u8", "scales_ptr": "*fp32", "out_codes_ptr": "*u8", "out_scales_ptr": "*fp32",
         "sum_ptr": "*fp32", "numel": "i32", "total_blocks": "i32", "sources": "i32", "codes_per_source": "i32",
         "scales_per_source": "i32"},
        {"REQUANTIZE": True, "QMAX": 7, "BITS": 4, "BF16_SCALES": True} | common,
    )  # fmt: skip
    assert "div.full" not in ptx and "div.approx" not in ptx and "fma." not in ptx
    assert "mul.rn.f32" in ptx and "div.rn.f32" in ptx
    # 2 bits (zeropp_delta's weight deltas): the same exact division and rounding trick, four
    # codes packed per byte, in registers
    ptx = quantize_ptx("*fp32", "*u8", 2, True)
    assert "div.full" not in ptx and "div.approx" not in ptx and "fma." not in ptx
    assert ptx.count("div.rn.f32") >= 16 and ptx.count("add.rn.f32") >= 32 and ".local" not in ptx
    assert ".ftz" not in ptx  # the floor compares y / 2 with its rounding: a flushed subnormal would move a level


# -- the dispatch API (in process: CPU tensors take the torch path) ---------------------------


def test_dispatch_rule(monkeypatch):
    monkeypatch.delenv("ZEROPP_FORCE_TRITON", raising=False)
    x = _randn("dispatch", 1000)
    assert kernels.kernel_backend(x) == "torch"
    _assert_equal("quantize", kernels.quantize(x, 256, 4), quantize_ref(x, 256, 4))
    codes, scales = quantize_ref(x, 256, 4)
    want = dequantize_ref(codes, scales, 256, 1000, 4)
    _assert_equal("dequantize", kernels.dequantize(codes, scales, 256, 1000, 4), want)
    want = swizzle_quantize_ref(x, [1, 0], 500, 256, 8)
    _assert_equal("swizzle", kernels.swizzle_quantize(x, torch.tensor([1, 0]), 500, 256, 8), want)
    if _HAVE_TRITON:
        monkeypatch.setenv("ZEROPP_FORCE_TRITON", "1")
        monkeypatch.delenv("TRITON_INTERPRET", raising=False)
        with pytest.raises(RuntimeError, match="TRITON_INTERPRET=1"):
            kernels.quantize(x, 256)


@pytest.mark.parametrize("block_elems,bits", [(48, 8), (16, 8), (131072, 8), (256, 3), (256.0, 8)])
def test_bad_arguments_name_the_parameter(block_elems, bits):
    name = "bits" if bits not in QMAX else "block_elems"
    with pytest.raises(ValueError, match=f"{name}=.*Fix:"):
        kernels.quantize(torch.ones(10), block_elems, bits)


def test_bad_buffers_are_user_errors(monkeypatch):
    monkeypatch.delenv("ZEROPP_FORCE_TRITON", raising=False)
    codes, scales = quantize_ref(torch.ones(100), 32, 8)
    with pytest.raises(ValueError, match="numel=129.*Fix:"):
        kernels.dequantize(codes, scales, 32, 129)
    with pytest.raises(TypeError, match="codes have dtype torch.uint8 for bits=8.*Fix:"):
        kernels.dequantize(codes.view(torch.uint8), scales, 32, 100)
    for out in (torch.empty(99), torch.empty(100, dtype=torch.int32), torch.empty(200)[::2]):
        with pytest.raises(ValueError, match="out is .*numel=100.*Fix:"):
            kernels.dequantize(codes, scales, 32, 100, out=out)
    with pytest.raises(ValueError, match="sources=3.*Fix:"):
        kernels.dequant_reduce_quantize(codes, scales, sources=3, numel=100, block_elems=32)
    with pytest.raises(ValueError, match="chunk_elems=30.*Fix:"):
        kernels.swizzle_quantize(torch.ones(100), [0], 30, 32)
    with pytest.raises(IndexError, match="order contains 4.*Fix:"):
        kernels.swizzle_quantize(torch.ones(100), [4], 25, 32)
    with pytest.raises(TypeError, match="floating-point.*Fix:"):
        kernels.quantize(torch.ones(10, dtype=torch.int64), 32)


if __name__ == "__main__":
    print(_MARK + json.dumps(_run_triton_cases()), flush=True)

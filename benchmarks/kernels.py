"""Quantization kernels: throughput in GB/s from counted bytes, and the block-size sweep.

    python benchmarks/kernels.py                                # GB/s table
    python benchmarks/kernels.py --sizes 1M,16M --blocks 256 --out kernels.json
    python benchmarks/kernels.py --block-sweep --out block_sweep.json
    python benchmarks/kernels.py --tile-sweep                   # CUDA only: re-tune the tile
    python benchmarks/kernels.py --cpu-suite --out cpu.json     # the torch path at training sizes
    python benchmarks/kernels.py --cpu-suite --ops ErrorFeedback.quantize_rows --sizes 256K,1M,4M,8M

GB/s counts each byte an op must move once: quantize reads the input and writes codes plus
fp32 scales; dequantize reads codes plus scales and writes the output; swizzle_quantize moves
what quantize moves; dequant_reduce_quantize reads ``sources`` quantized copies and writes one.
Time is the median over repetitions after a warm-up (CUDA: triton.testing.do_bench).

On CPU only the torch reference is timed: Triton under TRITON_INTERPRET=1 runs each program
in Python, so its timings mean nothing (and are not taken). On CUDA both back ends are timed
and the Triton result is checked to be bit-identical to the reference ("exact" column).

``--cpu-suite`` times the torch reference (the CPU path) per function at the sizes a
training step hands it: flat shards of 0.1M, 1M and 4M elements; weights in bf16 with
int8 blocks of 256 (ZeroConfig.weight_quant_block_elems), gradients in fp32 with int4
blocks of 64 (gradient_quant_block_elems); dequantize_gathered over 4 ranks' payloads,
beside the per-rank dequantize loop it replaces; and qgZ's error feedback on one gradient row
(``ErrorFeedback.quantize_rows``, its error kept in fp32 and as int8 blocks). The tables:
docs/zeropp_measurements.md, "On CPU: the torch reference's speed".

``--block-sweep`` measures what the block size buys: relative L2 error of block int8/int4
quantization against per-tensor int8/int4 for every weight matrix of a GPT-2-shaped model
(transformers GPT2LMHeadModel, 2 layers, width 768, RANDOMLY INITIALISED: N(0, 0.02), so
Gaussian, without the outlier channels of trained weights), for the gradients of one
backward pass on random tokens, and for a heavy-tailed synthetic matrix (Student-t, 3
degrees of freedom) standing in for trained weights; beside the bytes the fp32 scales add.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import platform
import statistics
import sys
import time
from pathlib import Path

import torch

from zeropp_strategy import kernels
from zeropp_strategy.kernels.reference import (
    dequant_reduce_quantize_ref,
    dequantize_ref,
    quantize_ref,
    quantized_nbytes,
    swizzle_quantize_ref,
)

OPS = ("quantize", "dequantize", "swizzle_quantize", "dequant_reduce_quantize")
SWIZZLE_CHUNKS = 8  # chunks reordered by swizzle_quantize (reversed order)
REDUCE_SOURCES = 4  # copies summed by dequant_reduce_quantize
THROUGHPUT_SIZES = "1M,4M,16M,64M"


def _parse_size(s: str) -> int:
    s = s.strip().upper()
    mult = {"K": 2**10, "M": 2**20, "G": 2**30}.get(s[-1], 1)
    return int(s[:-1] if s[-1] in "KMG" else s) * mult


def _hardware(device: torch.device) -> str:
    if device.type == "cuda":
        return torch.cuda.get_device_name(device)
    model = platform.processor() or platform.machine()
    cpuinfo = Path("/proc/cpuinfo")
    if cpuinfo.exists():  # Linux: the name lscpu prints
        names = [ln.split(":", 1)[1].strip() for ln in cpuinfo.read_text().splitlines() if ln.startswith("model name")]
        model = names[0] if names else model
    return f"{model}, {os.cpu_count()} cores, {torch.get_num_threads()} torch threads"


# -- throughput ----------------------------------------------------------------------------------


def _time_ms(fn, device: torch.device) -> float:
    if device.type == "cuda":
        import triton.testing

        return float(triton.testing.do_bench(fn, warmup=25, rep=100, return_mode="median"))
    fn()  # warm-up
    times, t_end = [], time.perf_counter() + 0.5
    while len(times) < 3 or time.perf_counter() < t_end:
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return 1e3 * statistics.median(times)


def _op_setup(op: str, numel: int, block_elems: int, bits: int, dtype: torch.dtype, device: torch.device):
    """-> (bytes moved, {backend: callable}, check callable or None)."""
    x = torch.randn(numel, device=device).to(dtype)
    q_bytes = quantized_nbytes(numel, block_elems, bits)
    x_bytes = numel * x.element_size()
    tq = _triton_module(device)
    if op in ("quantize", "swizzle_quantize"):
        if op == "quantize":
            ref = lambda: quantize_ref(x, block_elems, bits)  # noqa: E731
            tri = tq and (lambda: tq.quantize_triton(x, block_elems, bits))
        else:
            order, chunk = list(range(SWIZZLE_CHUNKS))[::-1], numel // SWIZZLE_CHUNKS
            q_bytes = SWIZZLE_CHUNKS * quantized_nbytes(chunk, block_elems, bits)
            ref = lambda: swizzle_quantize_ref(x, order, chunk, block_elems, bits)  # noqa: E731
            tri = tq and (lambda: tq.swizzle_quantize_triton(x, order, chunk, block_elems, bits))
        nbytes = x_bytes + q_bytes
    elif op == "dequantize":
        codes, scales = quantize_ref(x, block_elems, bits)
        ref = lambda: dequantize_ref(codes, scales, block_elems, numel, bits, dtype)  # noqa: E731
        tri = tq and (lambda: tq.dequantize_triton(codes, scales, block_elems, numel, bits, dtype))
        nbytes = q_bytes + x_bytes
    else:
        parts = [quantize_ref(x * (s + 1), block_elems, bits) for s in range(REDUCE_SOURCES)]
        codes, scales = torch.cat([p[0] for p in parts]), torch.cat([p[1] for p in parts])
        kw = dict(sources=REDUCE_SOURCES, numel=numel, block_elems=block_elems, bits=bits)
        ref = lambda: dequant_reduce_quantize_ref(codes, scales, **kw)  # noqa: E731
        tri = tq and (lambda: tq.dequant_reduce_quantize_triton(codes, scales, **kw))
        nbytes = (REDUCE_SOURCES + 1) * q_bytes
    fns = {"torch": ref} | ({"triton": tri} if tri else {})
    check = None
    if tri:

        def check() -> bool:
            a, b = tri(), ref()
            a, b = (a, b) if isinstance(a, tuple) else ((a,), (b,))
            return all(torch.equal(u, v) for u, v in zip(a, b))

    return nbytes, fns, check


def _triton_module(device: torch.device):
    if device.type != "cuda" or kernels.kernel_backend(torch.empty(0, device=device)) != "triton":
        return None
    from zeropp_strategy.kernels import triton_quant

    return triton_quant


def _chosen_ops(ops: str | None, names: list[str], mode: str) -> list[str] | None:
    """``--ops`` as a list, each checked against this mode's op names before anything is
    measured (an unknown name would otherwise be timed as another op, or as none); None when
    it is not given."""
    if not ops:
        return None
    chosen = [o.strip() for o in ops.split(",")]
    unknown = [o for o in chosen if o not in names]
    if unknown:
        raise SystemExit(f"--ops {ops!r}: {', '.join(unknown)} is no {mode} op. Fix: use one or more of "
                         f"{', '.join(names)}.")
    return chosen


def throughput(args: argparse.Namespace) -> dict:
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    dtype = getattr(torch, args.dtype)
    ops = _chosen_ops(args.ops, list(OPS), "kernel") or list(OPS if device.type == "cuda" else OPS[:2])
    rows = []
    for numel in [_parse_size(s) for s in (args.sizes or THROUGHPUT_SIZES).split(",")]:
        for block_elems in [int(b) for b in args.blocks.split(",")]:
            for bits in [int(b) for b in args.bits.split(",")]:
                for op in ops:
                    nbytes, fns, check = _op_setup(op, numel, block_elems, bits, dtype, device)
                    row = {"op": op, "numel": numel, "block_elems": block_elems, "bits": bits, "bytes": nbytes}
                    for backend, fn in fns.items():
                        ms = _time_ms(fn, device)
                        row[f"{backend}_ms"] = ms
                        row[f"{backend}_GBps"] = nbytes / ms / 1e6
                    if check is not None:
                        row["exact"] = check()
                    rows.append(row)
                    if args.verbose:
                        print(_row_md(row), flush=True)
                    del fns, check
                    if device.type == "cuda":
                        torch.cuda.empty_cache()
    note = "" if device.type == "cuda" else (
        "CPU: torch reference only (Triton under TRITON_INTERPRET=1 runs each program in Python; "
        "its timings are meaningless and not taken). The fused ops run only with --ops on CPU: the "
        "reference's per-chunk and per-source loops make them minutes long at 64M."
    )  # fmt: skip
    return {"device": _hardware(device), "torch": torch.__version__, "dtype": args.dtype, "note": note, "rows": rows}


def _row_md(r: dict) -> str:
    cells = [r["op"], f"{r['numel'] / 2**20:g}M", str(r["block_elems"]), f"int{r['bits']}", f"{r['bytes'] / 1e6:.1f}",
             f"{r['torch_GBps']:.3g}"]  # fmt: skip
    if "triton_GBps" in r:
        cells += [f"{r['triton_GBps']:.3g}", f"{r['torch_ms'] / r['triton_ms']:.1f}x", "yes" if r["exact"] else "NO"]
    return "| " + " | ".join(cells) + " |"


def print_throughput(res: dict) -> None:
    print(f"\n{res['device']}, torch {res['torch']}, input {res['dtype']}. {res['note']}\n")
    head = ["op", "numel", "block_elems", "bits", "MB moved", "torch GB/s"]
    if res["rows"] and "triton_GBps" in res["rows"][0]:
        head += ["triton GB/s", "speed-up", "exact"]
    print("| " + " | ".join(head) + " |\n|" + "---|" * len(head))
    for r in res["rows"]:
        print(_row_md(r))


def tile_sweep(args: argparse.Namespace) -> dict:
    """Triton GB/s per (_TILE_ELEMS, _NUM_WARPS): the measurement behind those constants."""
    if not torch.cuda.is_available():
        sys.exit("--tile-sweep times the Triton kernels and needs a CUDA GPU.")
    from zeropp_strategy.kernels import triton_quant as tq

    device, numel, rows = torch.device("cuda"), _parse_size((args.sizes or THROUGHPUT_SIZES).split(",")[-1]), []
    blocks, bits_list = [int(b) for b in args.blocks.split(",")], [int(b) for b in args.bits.split(",")]
    if len(blocks) != len(bits_list):
        sys.exit(f"--tile-sweep pairs --blocks with --bits one to one; got {len(blocks)} block sizes and "
                 f"{len(bits_list)} widths. Fix: e.g. --blocks 256,64 --bits 8,4 (qwZ int8, qgZ int4)")
    pairs = list(zip(blocks, bits_list))
    ops = _chosen_ops(args.ops, list(OPS), "kernel") or OPS
    saved = tq._TILE_ELEMS, tq._NUM_WARPS
    try:
        for tile in (1024, 2048, 4096, 8192, 16384):
            for warps in (4, 8, 16):
                tq._TILE_ELEMS, tq._NUM_WARPS = tile, warps
                for block_elems, bits in pairs:
                    for op in ops:
                        nbytes, fns, _ = _op_setup(op, numel, block_elems, bits, getattr(torch, args.dtype), device)
                        ms = _time_ms(fns["triton"], device)
                        rows.append({"tile": tile, "warps": warps, "block_elems": block_elems, "bits": bits,
                                     "op": op, "GBps": nbytes / ms / 1e6})  # fmt: skip
                        print(rows[-1], flush=True)
    finally:
        tq._TILE_ELEMS, tq._NUM_WARPS = saved
    return {"device": _hardware(device), "numel": numel, "rows": rows}


# -- CPU suite ------------------------------------------------------------------------------------

CPU_SIZES = "100K,1M,4M"
CPU_CHUNK_SWEEP = (1 << 16, 1 << 17, 1 << 18, 1 << 19, 1 << 20, 1 << 30)  # 1 << 30: no chunking
CPU_GATHER_WORLD = 4  # ranks whose payloads dequantize_gathered reads
CPU_REDUCE_SOURCES = 2  # ranks per node summed by dequant_reduce_quantize (2 nodes x 2 in the tests)


def _cpu_cases(numel: int, wb: int, gb: int) -> list[tuple[str, str, int, object]]:
    """-> [(op, what, bytes moved, callable)]: the calls ZeRO++ makes per step on CPU, each
    with the bytes it must move at least once (inputs read, outputs written)."""
    from zeropp_strategy.kernels.reference import pack_int4, unpack_int4

    w = torch.randn(numel).to(torch.bfloat16)  # a qwZ weight shard (bf16-mixed param dtype)
    g = torch.randn(numel)  # a qgZ gradient (fp32)
    wq = quantize_ref(w, wb, 8)
    w_q_bytes, g_q_bytes = quantized_nbytes(numel, wb, 8), quantized_nbytes(numel, gb, 4)
    world = CPU_GATHER_WORLD
    payload = torch.cat([wq[0].view(torch.uint8), wq[1].view(torch.uint8)])
    gathered = payload.repeat(world, 1)  # (world, payload_bytes)
    out = torch.empty(world * numel, dtype=torch.bfloat16)
    code_bytes = wq[0].numel()

    def gather_loop():  # what comm/zeropp.py did before dequantize_gathered
        for r in range(world):
            c, s = gathered[r, :code_bytes].view(torch.int8), gathered[r, code_bytes:].view(torch.float32)
            out[r * numel : (r + 1) * numel].copy_(kernels.dequantize(c, s, wb, numel, 8, out.dtype))

    gather_kw = dict(code_bytes=code_bytes, numel=numel, block_elems=wb, out=out)
    chunk = numel // 4
    order = [1, 3, 0, 2]  # 2 nodes x 2 ranks, destination-major
    parts = [quantize_ref(g * (s + 1), gb, 4) for s in range(CPU_REDUCE_SOURCES)]
    rc, rs = torch.cat([p[0] for p in parts]), torch.cat([p[1] for p in parts])
    red_kw = dict(sources=CPU_REDUCE_SOURCES, numel=numel, block_elems=gb, bits=4)
    codes8 = torch.randint(-7, 8, (numel,), dtype=torch.int8)
    packed = pack_int4(codes8)
    S = CPU_REDUCE_SOURCES
    return [
        ("quantize", f"bf16 int8 B={wb}", 2 * numel + w_q_bytes, lambda: quantize_ref(w, wb, 8)),
        ("dequantize", f"int8 B={wb} -> bf16", w_q_bytes + 2 * numel,
         lambda: dequantize_ref(*wq, wb, numel, 8, w.dtype)),
        ("dequantize_gathered", f"{world} ranks int8 B={wb} -> bf16", world * (w_q_bytes + 2 * numel),
         lambda: kernels.dequantize_gathered(gathered, **gather_kw)),
        ("  per-rank dequantize loop", f"{world} ranks int8 B={wb} -> bf16", world * (w_q_bytes + 2 * numel),
         gather_loop),
        ("quantize", f"fp32 int4 B={gb}", 4 * numel + g_q_bytes, lambda: quantize_ref(g, gb, 4)),
        ("swizzle_quantize", f"fp32 int4 B={gb}, 4 chunks", 4 * numel + g_q_bytes,
         lambda: swizzle_quantize_ref(g, order, chunk, gb, 4)),
        ("dequant_reduce_quantize", f"{S} sources int4 B={gb}, requantize", (S + 1) * g_q_bytes,
         lambda: dequant_reduce_quantize_ref(rc, rs, **red_kw)),
        ("dequant_reduce_quantize", f"{S} sources int4 B={gb} -> fp32", S * g_q_bytes + 4 * numel,
         lambda: dequant_reduce_quantize_ref(rc, rs, **red_kw, requantize=False)),
        ("pack_int4", "int8 -> uint8", numel + numel // 2, lambda: pack_int4(codes8)),
        ("unpack_int4", "uint8 -> int8", numel // 2 + numel, lambda: unpack_int4(packed)),
        *_feedback_cases(g, gb),
    ]  # fmt: skip


def _feedback_cases(g: torch.Tensor, gb: int) -> list[tuple[str, str, int, object]]:
    """qgZ's error feedback as comm/zeropp.py calls it, one row: the cross-node hop's (its
    error kept in fp32) and the intra-node hop's (kept as int8 blocks), each taking the
    gradient into its scratch row first (the copy the real call makes). Bytes: the gradient
    read, the row written, int4 codes and scales out, the kept error read and written."""
    from zeropp_strategy.comm.feedback import ErrorFeedback

    numel, cpu = g.numel(), torch.device("cpu")
    row = torch.empty_like(g)
    q_bytes = quantized_nbytes(numel, gb, 4)
    cases = []
    for stored, what in ((32, "fp32 error (cross-node)"), (8, "int8 error (intra-node)")):
        fb = ErrorFeedback(beta=0.8, reset_steps=0, stored_bits=stored, block_elems=gb)
        kept_bytes = 4 * numel if stored == 32 else quantized_nbytes(numel, gb, 8)

        def call(fb=fb):
            return fb.quantize_rows(1, numel, lambda i: row.copy_(g), gb, 4, device=cpu)

        cases.append(("ErrorFeedback.quantize_rows", f"fp32 int4 B={gb}, {what}", 8 * numel + q_bytes + 2 * kept_bytes,
                      call))
    return cases


def cpu_suite(args: argparse.Namespace) -> dict:
    """Median ms per call and GB/s of every CPU case; with ``--chunk-sweep`` once per value of
    reference._CHUNK_ELEMS and comm/feedback.py's FEEDBACK_PIECE_ELEMS, set together (the
    measurement behind both constants)."""
    from zeropp_strategy.comm import feedback
    from zeropp_strategy.config import ZeroConfig
    from zeropp_strategy.kernels import reference

    torch.set_num_threads(args.threads)  # training ranks run with 1 (benchmarks/bench_train.py)
    device, cfg = torch.device("cpu"), ZeroConfig()
    wb, gb = cfg.weight_quant_block_elems, cfg.gradient_quant_block_elems
    chunks = CPU_CHUNK_SWEEP if args.chunk_sweep else (reference._CHUNK_ELEMS,)
    # getattr: a package from before the feedback's pieces (PYTHONPATH=BEFORE) runs too
    saved, saved_piece, rows = reference._CHUNK_ELEMS, getattr(feedback, "FEEDBACK_PIECE_ELEMS", None), []
    only = _chosen_ops(args.ops, sorted({op.strip() for op, *_ in _cpu_cases(1024, wb, gb)}), "--cpu-suite")
    try:
        for numel in [_parse_size(s) for s in (args.sizes or CPU_SIZES).split(",")]:
            for op, what, nbytes, fn in _cpu_cases(numel, wb, gb):
                if only is not None and op.strip() not in only:
                    continue
                for chunk in chunks:
                    reference._CHUNK_ELEMS = chunk
                    if args.chunk_sweep and saved_piece is not None:  # the feedback's pieces: the same sizes
                        feedback.FEEDBACK_PIECE_ELEMS = chunk
                    ms = _time_ms(fn, device)
                    rows.append({"op": op, "what": what, "numel": numel, "chunk_elems": chunk, "bytes": nbytes,
                                 "feedback_piece_elems": getattr(feedback, "FEEDBACK_PIECE_ELEMS", None),
                                 "ms": ms, "GBps": nbytes / ms / 1e6})  # fmt: skip
                    if args.verbose:
                        print(_cpu_row_md(rows[-1]), flush=True)
    finally:
        reference._CHUNK_ELEMS = saved
        if saved_piece is not None:
            feedback.FEEDBACK_PIECE_ELEMS = saved_piece
    return {"device": _hardware(device), "torch": torch.__version__, "rows": rows}


def _cpu_row_md(r: dict) -> str:
    return (f"| {r['op']} | {r['what']} | {r['numel'] / 1e6:g}M | {r['chunk_elems']} | {r['ms']:.3f} | "
            f"{r['GBps']:.2f} |")  # fmt: skip


def print_cpu_suite(res: dict) -> None:
    print(f"\n{res['device']}, torch {res['torch']}: torch reference, median ms per call\n")
    print("| op | case | numel | chunk_elems | ms | GB/s |\n|---|---|---|---|---|---|")
    for r in res["rows"]:
        print(_cpu_row_md(r))


# -- block-size sweep ----------------------------------------------------------------------------


SWEEP_BLOCKS = (32, 64, 128, 256, 512, 1024, 2048, 4096, 16384, 65536)


def _rel_l2_parts(w: torch.Tensor, block_elems: int, bits: int) -> tuple[float, float]:
    """(||w - deq(q(w))||^2, ||w||^2) in float64; block_elems=None: one scale for the tensor."""
    flat = w.detach().reshape(-1).float()
    codes, scales = quantize_ref(flat, block_elems, bits)
    err = flat.double() - dequantize_ref(codes, scales, block_elems, flat.numel(), bits).double()
    return float(err.square().sum()), float(flat.double().square().sum())


def _sweep_matrices() -> dict[str, dict[str, torch.Tensor]]:
    from transformers import GPT2Config, GPT2LMHeadModel

    torch.manual_seed(0)
    model = GPT2LMHeadModel(GPT2Config(n_layer=2, n_embd=768))  # random init, see the header
    ids = torch.randint(0, model.config.vocab_size, (4, 128))
    model(input_ids=ids, labels=ids).loss.backward()
    weights, grads, seen = {}, {}, set()
    for name, p in model.named_parameters():
        if p.dim() == 2 and id(p) not in seen:  # lm_head is tied to wte
            seen.add(id(p))
            weights[name] = p.detach()
            grads[name] = p.grad.detach()
    t3 = torch.distributions.StudentT(3.0).sample((768, 3072)) * 0.02  # seeded above
    return {"weights (random init)": weights, "grads (1 step)": grads, "synthetic": {"student-t(3) 768x3072": t3}}


def block_sweep(args: argparse.Namespace) -> dict:
    torch.manual_seed(0)
    groups = _sweep_matrices()
    per_matrix, summary = [], []
    for group, mats in groups.items():
        for bits in (8, 4):
            totals = {b: [0.0, 0.0] for b in (*SWEEP_BLOCKS, "tensor")}
            for name, w in mats.items():
                row = {"group": group, "matrix": name, "shape": list(w.shape), "bits": bits}
                for b in (*SWEEP_BLOCKS, "tensor"):
                    e2, w2 = _rel_l2_parts(w, w.numel() if b == "tensor" else b, bits)
                    totals[b][0] += e2
                    totals[b][1] += w2
                    row[str(b)] = math.sqrt(e2 / w2)
                per_matrix.append(row)
            rel = {str(b): math.sqrt(e / w) for b, (e, w) in totals.items()}
            net = {str(b): -math.log2(rel[str(b)]) - (bits + 32 / b) for b in SWEEP_BLOCKS}
            summary.append({"group": group, "bits": bits} | rel | {"net_bits": net})
            print(f"done {group} int{bits}", file=sys.stderr, flush=True)
    overhead = {str(b): {f"int{bits}": 4 / (b * bits / 8) for bits in (8, 4)} for b in SWEEP_BLOCKS}
    return {"blocks": list(SWEEP_BLOCKS), "per_matrix": per_matrix, "summary": summary, "scale_overhead": overhead,
            "note": "GPT-2 2x768 randomly initialised (N(0, 0.02)); grads from one backward on random tokens; "
                    "relative L2 = ||w - dequant(quant(w))|| / ||w||; 'tensor' = one scale per tensor."}  # fmt: skip


def print_block_sweep(res: dict) -> None:
    blocks = [str(b) for b in res["blocks"]] + ["tensor"]
    print(f"\n{res['note']}\n")
    print("Relative L2 error, all matrices of a group pooled (sqrt(sum err^2 / sum w^2)):\n")
    head = ["group", "bits", *blocks]
    print("| " + " | ".join(head) + " |\n|" + "---|" * len(head))
    for r in res["summary"]:
        print("| " + " | ".join([r["group"], f"int{r['bits']}"] + [f"{r[b]:.4f}" for b in blocks]) + " |")
    print("\nBlock error / per-tensor error:\n")
    print("| " + " | ".join(head) + " |\n|" + "---|" * len(head))
    for r in res["summary"]:
        print("| " + " | ".join([r["group"], f"int{r['bits']}"] + [f"{r[b] / r['tensor']:.3f}" for b in blocks]) + " |")
    print(
        "\nNet precision bits, -log2(rel L2) - (bits + 32 / block_elems): precision gained minus bits sent per "
        "element. One more code bit roughly halves the error (+1), so this prices scale bytes against code "
        "bits; the best block size maximises it.\n"
    )
    print("| " + " | ".join(head[:-1]) + " | best |\n|" + "---|" * len(head))
    for r in res["summary"]:
        net = r["net_bits"]
        best = max(net, key=net.get)
        cells = [r["group"], f"int{r['bits']}"] + [f"{net[b]:.3f}" for b in blocks[:-1]] + [best]
        print("| " + " | ".join(cells) + " |")
    print("\nBytes the fp32 scales add, relative to the codes:\n")
    print("| bits | " + " | ".join(blocks[:-1]) + " |\n|" + "---|" * len(blocks))
    for bits in ("int8", "int4"):
        print(f"| {bits} | " + " | ".join(f"{100 * res['scale_overhead'][b][bits]:.2f}%" for b in blocks[:-1]) + " |")
    print("\nPer matrix (int8):\n")
    head = ["matrix", "shape", *blocks]
    print("| " + " | ".join(head) + " |\n|" + "---|" * len(head))
    for r in res["per_matrix"]:
        if r["bits"] == 8:
            cells = [f"{r['group'].split()[0]}: {r['matrix']}", "x".join(map(str, r["shape"]))]
            print("| " + " | ".join(cells + [f"{r[b]:.4f}" for b in blocks]) + " |")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--sizes", help=f"elements per tensor (K/M/G suffixes); default {THROUGHPUT_SIZES} ({CPU_SIZES} "
                    "with --cpu-suite)")
    ap.add_argument("--blocks", default="64,256,1024,4096", help="block_elems values")
    ap.add_argument("--bits", default="8,4")
    ap.add_argument("--ops", help=f"comma list of {', '.join(OPS)}; default: all on CUDA, the first two on CPU "
                                  "(--cpu-suite: of its op names, e.g. ErrorFeedback.quantize_rows; default all)")
    ap.add_argument("--dtype", default="float32", help="input (quantize) / output (dequantize) dtype")
    ap.add_argument("--block-sweep", action="store_true", help="quantization error vs block size instead of GB/s")
    ap.add_argument("--tile-sweep", action="store_true", help="Triton GB/s per tile size and warp count (CUDA)")
    ap.add_argument("--cpu-suite", action="store_true", help="the torch reference at training sizes (CPU)")
    ap.add_argument("--chunk-sweep", action="store_true",
                    help="--cpu-suite once per value of reference._CHUNK_ELEMS and, set to the same value, "
                         "comm/feedback.py's FEEDBACK_PIECE_ELEMS")
    ap.add_argument("--threads", type=int, default=1, help="--cpu-suite: torch threads (training ranks use 1)")
    ap.add_argument("--out", type=Path, help="write the results as JSON here")
    ap.add_argument("-v", "--verbose", action="store_true", help="print each row as it is measured")
    args = ap.parse_args()
    if args.block_sweep:
        res = block_sweep(args)
        print_block_sweep(res)
    elif args.tile_sweep:
        res = tile_sweep(args)
    elif args.cpu_suite:
        res = cpu_suite(args)
        print_cpu_suite(res)
    else:
        res = throughput(args)
        print_throughput(res)
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(res, indent=1))


if __name__ == "__main__":
    main()

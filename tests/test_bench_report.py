"""benchmarks/run.py's report: targets and rendering from a results dict (no cluster)."""

from __future__ import annotations

import json

from benchmarks import run as bench


def _cell(step_s, veth, loss, ledger=None):
    return {
        "step_s": step_s, "veth_bytes_per_step": veth, "loss": loss, "peak_rss_bytes_per_rank": [2**30, 2**29],
        "ledger_inter_bytes_per_step_by_kind": ledger or {}, "ledger_inter_bytes_per_step": sum((ledger or {}).values()),
        "world_size": 4,
    }


RESULTS = {
    "200mbit/zeropp": _cell(0.4, 7e6, 4.0, {"param_allgather_fwd": 5e6, "grad_reduce": 1e6}),
    "200mbit/zeropp_stage_3": _cell(1.0, 60e6, 3.95, {"param_allgather_fwd": 20e6, "grad_reduce": 20e6}),
    "200mbit/deepspeed_zero3": _cell(0.9, 63e6, 3.96),
    "200mbit/deepspeed_zeropp": {"error": "ValueError: This op had not been implemented on CPU backend."},
    "unlimited/zeropp_stage_3": _cell(0.5, 60e6, 3.95),
    "unlimited/fsdp2": _cell(0.5, 59e6, 3.95),
}


def test_targets_compare_the_right_cells():
    got = {name: (measured, met) for name, measured, met in bench.targets(RESULTS)}
    assert got["200 Mbit/s: zeropp step time <= 0.5 x our stage 3"] == ("0.40x", True)
    assert got["200 Mbit/s: zeropp step time <= 0.5 x DeepSpeed ZeRO-3"] == ("0.44x", True)
    assert got["cross-node bytes/step (veth): zeropp <= 0.30 x our stage 3"] == ("0.12x", True)
    assert got["unlimited: zeropp_stage_3 step time <= 1.1 x Lightning FSDP2"] == ("1.00x", True)
    assert got["unlimited: zeropp_stage_3 step time <= 1.0 x DeepSpeed ZeRO-3"] == ("not measured", None)
    measured, met = got["loss after the run: zeropp within 2% of our stage 3"]
    assert measured == "+1.27%" and met


def test_issue_18_step_targets():
    results = {**RESULTS, "unlimited/zeropp": _cell(0.38, 7e6, 4.0),
               "200mbit/zeropp_stage_3_bf16": _cell(0.85, 45e6, 3.95)}
    got = {name: (measured, met) for name, measured, met in bench.targets(results)}
    assert got["zeropp at 200 Mbit/s <= 1.15 x its unlimited step"] == ("1.05x", True)
    assert got["unlimited: zeropp step time <= 1.05 x our stage 3"] == ("0.76x", True)
    assert got["200 Mbit/s: zeropp_stage_3_bf16 step time <= 1.0 x DeepSpeed ZeRO-3"] == ("0.94x", True)
    got = {name: met for name, _, met in bench.targets(RESULTS)}
    assert got["zeropp at 200 Mbit/s <= 1.15 x its unlimited step"] is None  # no unlimited zeropp cell


def _suite(precision, **extra):
    cells = json.loads(json.dumps(RESULTS))
    for c in cells.values():
        if "step_s" in c:
            c.update(precision=precision, **extra)
    return cells


def test_render_writes_tables_and_nonempty_plots(tmp_path):
    docs = tmp_path / "docs" / "benchmarks.md"
    docs.parent.mkdir()
    fp32 = json.loads(json.dumps(RESULTS))  # cells from before the precision flag: fp32, marked stale
    fp32["200mbit/zeropp"]["step_s"] = 0.5
    bench.render(_suite("bf16-mixed", bf16_matmul="fp32"), docs, second=fp32)
    text = docs.read_text()
    bf16_at, fp32_at = text.index("## bf16-mixed, as users train"), text.index("## fp32 (`32-true`)")
    assert bf16_at < fp32_at < text.index("## Plots (bf16-mixed)")
    assert "Command: `python benchmarks/run.py` (as root)" in text[bf16_at:fp32_at]
    assert "Command: `python benchmarks/run.py --precision 32-true` (as root)" in text[fp32_at:]
    assert "`--bf16-matmul fp32`" in text[bf16_at:fp32_at] and "`--bf16-matmul fp32`" not in text[fp32_at:]
    assert "measured before 2026-11-23" in text[fp32_at:] and "measured before" not in text[:fp32_at]
    assert "| zeropp | 0.400 | 0.40x | 0.44x | 7.00 | 6.00 | 4.0000 | 1024 |" in text[bf16_at:fp32_at]
    assert "| zeropp | 0.500 | 0.50x | 0.56x | 7.00 | 6.00 | 4.0000 | 1024 |" in text[fp32_at:]
    assert "| deepspeed_zeropp | failed: ValueError: This op had not been implemented on CPU backend." in text
    assert "@" not in text.split("## Reading the results")[1]  # every quoted figure filled in
    assert "ZeRO++ puts 7.0 MB per step on the cross-node link against\n  60.0 MB for plain stage 3" in text
    for name in ("bench_step_time.png", "bench_bytes_per_step.png"):
        png = tmp_path / "docs" / "img" / name
        assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and png.stat().st_size > 10_000
        assert f"(img/{name})" in text


def test_volume_page_checks_the_issue_targets(tmp_path):
    """benchmarks/volume.py: ratios against ddp, the formulas and DeepSpeed, from a results dict."""
    from benchmarks import volume

    P = 3_000_000
    cells = {
        "200mbit/ddp": _cell(1.0, volume.formula_bytes("ddp", P), 3.9),
        "200mbit/zeropp_stage_1": _cell(1.1, 1.03 * volume.formula_bytes("zeropp_stage_1", P), 3.9),
        "200mbit/zeropp_stage_2": _cell(1.0, 1.2 * volume.formula_bytes("zeropp_stage_2", P), 3.9),
        "200mbit/zeropp_stage_3": _cell(1.2, volume.formula_bytes("zeropp_stage_3", P), 3.9),
        "200mbit/zeropp": _cell(0.5, 5e6, 3.9),
        "200mbit/deepspeed_zero3": _cell(1.2, 3e7, 3.9),
        "unlimited/zeropp": _cell(0.45, 5e6, 3.9),
        "unlimited/zeropp_stage_3": _cell(0.44, 2e7, 3.9),
    }
    text = volume.render(cells, tmp_path / "v.md", "python benchmarks/volume.py", P)
    rows = {line.split(" | ")[0].lstrip("| "): line for line in text.splitlines() if line.startswith("| ")}
    assert rows["cross-node bytes: zeropp_stage_1 <= 1.05 x ddp"].endswith("| 0.69x | yes |")
    assert rows["cross-node bytes: zeropp_stage_2 within 10% of its formula"].endswith("| 1.20x | no |")
    assert rows["200 Mbit/s: zeropp step <= 0.5 x DeepSpeed ZeRO-3"].endswith("| 0.42x | yes |")
    assert rows["zeropp at 200 Mbit/s <= 1.15 x its unlimited step"].endswith("| 1.11x | yes |")
    assert rows["unlimited: zeropp <= 1.05 x zeropp_stage_3"].endswith("| 1.02x | yes |")
    assert rows["200 Mbit/s: zeropp_stage_3_bf16 step <= 1.0 x DeepSpeed ZeRO-3"].endswith("| - | - |")
    # DeepSpeed's NCCL-ideal bytes: 3e7 less the all-reduce's extra over a reduce-scatter of
    # bf16 gradients (2 crossing links x 3/4 x 2 bytes x P = 9 MB); ours need no correction
    assert rows["200mbit/deepspeed_zero3"].endswith("| 21.00 |")
    assert rows["200mbit/zeropp"].endswith("| - |")
    assert "0.24x: the fairer figure" in text  # 5e6 against 21e6 bytes


def test_volume_page_renders_a_suite_with_its_meta_and_the_earlier_one(tmp_path):
    """The newest suite (rounds, meta, --bf16-matmul fp32) above the earlier flat one."""
    from benchmarks import volume

    P = 3_000_000
    flat = {"200mbit/ddp": _cell(1.0, volume.formula_bytes("ddp", P), 3.9),
            "200mbit/zeropp": _cell(0.5, 5e6, 3.9), "200mbit/deepspeed_zero3": _cell(1.5, 3e7, 3.9)}
    runs = {"200mbit/ddp": [{"step_s": s, "veth_bytes_per_step": 4e7, "loss": 3.9, "load_avg_1min_at_start": 4.0}
                            for s in (2.0, 1.8, 2.2)],
            "200mbit/zeropp": [{"step_s": s, "veth_bytes_per_step": 5e6, "loss": 3.9, "load_avg_1min_at_start": 4.5}
                               for s in (0.6, 0.7, 0.65)],
            "200mbit/deepspeed_zero3": [{"error": "boom"}]}
    meta = {"command": "python benchmarks/volume.py", "date": "2026-11-25", "commit": "abc1234",
            "hardware": "x86_64 VM, 2 CPU cores, no GPU", "steps": 16, "warmup": 4, "batch": 4,
            "precision": "bf16-mixed", "bf16_matmul": "fp32", "cpu_capability": "AVX2",
            "matmul_ms": {"fp32": 3.0, "bf16": 230.0}}
    newest = {"meta": meta, "cells": volume._summarize(runs, {}), "runs": runs}
    text = volume.render(newest, tmp_path / "v.md", "python benchmarks/volume.py", P, earlier=[flat])
    first, second = text.index("bf16 matmuls at fp32 speed (2026-11-25)"), text.index("native bf16 matmuls")
    assert first < second
    assert "--repeat 3` (as root), 2026-11-25, commit abc1234" in text and "230 ms in bf16" in text
    assert "| 200mbit/ddp | 2.000 (2.000, 1.800, 2.200) |" in text
    assert "| 200mbit/deepspeed_zero3 | failed: boom |" in text
    # both suites carry their own targets: the newest misses its DeepSpeed ratio (failed cell), the earlier meets it
    assert text.count("| 200 Mbit/s: zeropp step <= 0.5 x DeepSpeed ZeRO-3 | - | - |") == 1
    assert text.count("| 200 Mbit/s: zeropp step <= 0.5 x DeepSpeed ZeRO-3 | 0.33x | yes |") == 1
    # An archived run of the suite sits between the newest and the flat one, its note in the title.
    archived = {"meta": {**meta, "commit": "0ld0000", "title_note": "before a change"},
                "cells": newest["cells"], "runs": runs}
    text = volume.render(newest, tmp_path / "v.md", "python benchmarks/volume.py", P, earlier=[archived, flat])
    titles = [text.index("fp32 speed (2026-11-25)\n"), text.index("fp32 speed (2026-11-25, before a change)"),
              text.index("native bf16 matmuls")]
    assert titles == sorted(titles) and "commit 0ld0000" in text


def test_bf16_matmul_stand_in_is_fp32_math_rounded_to_bf16():
    """benchmarks/bf16_matmul.py: inside fp32_matmuls() a matmul with a bf16 operand, or under
    autocast, returns bf16 holding the fp32 product of the bf16-rounded operands, forward and
    backward; fp32 math outside autocast and other ops are untouched; the patch is undone."""
    import torch
    import torch.nn.functional as F

    from benchmarks.bf16_matmul import fp32_matmuls

    g = torch.Generator().manual_seed(0)
    a, b = torch.randn(64, 96, generator=g).bfloat16(), torch.randn(96, 32, generator=g).bfloat16()
    ref = (a.float() @ b.float()).bfloat16()
    original = torch.addmm
    with fp32_matmuls():
        assert torch.addmm is not original
        out = torch.matmul(a, b)
        bias = torch.addmm(torch.zeros(32, dtype=torch.bfloat16), a, b)
        batched = torch.bmm(a[None], b[None])[0]
        linear = F.linear(a, b.t())
        fp32 = torch.mm(a.float(), b.float())
    assert torch.addmm is original
    for got in (out, bias, batched, linear):
        assert got.dtype == torch.bfloat16 and torch.equal(got, ref)
    assert fp32.dtype == torch.float32 and torch.equal(fp32, a.float() @ b.float())

    w = torch.randn(96, 32, generator=g, requires_grad=True)
    x = torch.randn(64, 96, generator=g, requires_grad=True)
    with fp32_matmuls(), torch.autocast("cpu", dtype=torch.bfloat16):
        y = torch.matmul(x, w)
    assert y.dtype == torch.bfloat16
    assert torch.equal(y, (x.detach().bfloat16().float() @ w.detach().bfloat16().float()).bfloat16())
    y.float().sum().backward()
    # d(sum)/dx = ones @ w^T, computed in fp32 from bf16-rounded w, rounded to bf16 on its way back
    expect = (torch.ones(64, 32) @ w.detach().bfloat16().float().t()).bfloat16().float()
    assert torch.equal(x.grad, expect)


def test_pretrained_bit_check_passes_equal_shards_only():
    """benchmarks/pretrained.py --digests: rank shards against one process's rows, bit for
    bit; a flipped bit, a missing rank or no reference is not a pass."""
    import sys

    import torch

    path = list(sys.path)
    try:
        from benchmarks import pretrained as P  # it puts benchmarks/ first on sys.path, for its own imports
    finally:
        sys.path[:] = path

    g = torch.Generator().manual_seed(0)
    full = {"w": torch.randn(5, 3, generator=g), "b": torch.randn(7, generator=g), "s": torch.tensor(1.5)}
    plain = {"mode": "plain", "ranks": [{"digests": {
        k: [P._digest(t[slice(*P._shard_rows(t.shape, 2, r))] if t.dim() else t) for r in range(2)]
        for k, t in full.items()}}]}

    def ranks(flip: bool = False, drop: int | None = None) -> dict:
        out = []
        for r in range(2):
            if r == drop:
                continue
            d = {}
            for k, t in full.items():
                part = (t[slice(*P._shard_rows(t.shape, 2, r))] if t.dim() else t).clone()
                if flip and r == 1 and k == "w":
                    part.view(torch.int32)[0, 0] ^= 1  # one bit of one element
                d[k] = P._digest(part)
            out.append({"rank": r, "digests": d})
        return {"mode": "new", "ranks": out}

    ok = P.compare_digests([plain, ranks()])["new"]
    assert ok["equal_bit_for_bit"] and ok["tensors_equal"] == 6 == ok["tensors_expected"], ok
    bad = P.compare_digests([plain, ranks(flip=True)])["new"]
    assert not bad["equal_bit_for_bit"] and bad["differ"] == ["rank 1: w"], bad
    gap = P.compare_digests([plain, ranks(drop=1)])["new"]
    assert not gap["equal_bit_for_bit"] and len(gap["missing"]) == 3, gap
    assert "error" in P.compare_digests([ranks()])  # no reference
    twice = P.compare_digests([plain, ranks(), plain, ranks(flip=True)])  # every repeat is compared
    assert twice["new"]["runs"] == 2 and not twice["new"]["equal_bit_for_bit"], twice
    assert twice["new"]["tensors_equal"] == 11 and twice["new"]["tensors_expected"] == 12, twice
    other = {"mode": "plain", "ranks": [{"digests": {**plain["ranks"][0]["digests"], "w": ["x", "y"]}}]}
    assert not P.compare_digests([plain, ranks(), other])["plain"]["equal_bit_for_bit"]  # plain disagrees with itself
    assert "error" in P.compare_digests([plain])  # nothing to compare with it


def test_volume_page_renders_the_delta_parts_side_by_side(tmp_path):
    """issue 35's section: both delta tables once all three parts have run, ratios against
    the cells of the same part, and a DeepSpeed that did not run named, not dropped."""
    from benchmarks.volume_cells import PART_FILES
    from benchmarks.volume_page import _delta_lines

    def part(rate, cells):
        meta = {"command": f"python benchmarks/volume.py --part delta_{rate}", "date": "2026-11-28",
                "commit": "abc1234", "hardware": "x86_64 VM, 2 CPU cores, no GPU"}
        runs = {key: [{"step_s": c["step_s"]} if "step_s" in c else c] * 3 for key, c in cells.items()}
        return {"meta": meta, "cells": cells, "runs": runs}

    def cell(s, veth, loss=3.5):
        return {"step_s": s, "step_s_runs": [s, s * 1.1], "veth_bytes_per_step": veth, "loss": loss}

    parts = {"delta_50mbit": part("50mbit", {"50mbit/small/zeropp": cell(0.8, 5.5e6),
                                            "50mbit/small/zeropp_delta": cell(0.6, 2.75e6)}),
             "delta_unlimited": part("unlimited", {"unlimited/small/ddp": cell(0.4, 4e7),
                                                   "unlimited/small/zeropp": cell(0.5, 5.3e6),
                                                   "unlimited/small/zeropp_delta": cell(0.5, 2.65e6)}),
             "delta_200mbit": part("200mbit", {"200mbit/small/zeropp": cell(0.5, 5.5e6),
                                               "200mbit/small/zeropp_delta": cell(0.55, 2.7e6),
                                               "200mbit/small/deepspeed_zero3": {"skipped": "not installed"},
                                               "unlimited/small/ddp": cell(0.4, 4e7)})}
    for name, data in list(parts.items())[:2]:
        (tmp_path / PART_FILES[name]).write_text(json.dumps(data))
    assert _delta_lines(tmp_path) == []  # a part missing: no half section
    (tmp_path / PART_FILES["delta_200mbit"]).write_text(json.dumps(parts["delta_200mbit"]))
    text = "\n".join(_delta_lines(tmp_path))
    assert "`python benchmarks/volume.py --part delta_200mbit --repeat 3`" in text
    assert "| zeropp_delta | 0.600 (0.600-0.660, 2 runs) | 0.500 (0.500-0.550, 2 runs) | 1.20x | 2.75 |" in text
    assert "| ddp | - | 0.400 (0.400-0.440, 2 runs) | - | 40.00 (unlimited) |" in text
    assert "| zeropp_delta | 0.550 (0.550-0.605, 2 runs) | - | 1.10x | 1.38x | 2.70 | 3.5000 |" in text
    assert "| deepspeed_zero3 | not installed |" in text


def test_volume_cell_names_carry_batch_buckets_and_package(tmp_path, monkeypatch):
    """A part's cell "name#N*B@before" runs name with N gather buckets, a micro-batch of B
    and the --before-root package; the rest of the run's arguments are the invocation's."""
    import argparse

    from benchmarks import volume

    seen = {}

    def fake_cell(cluster, name, args):
        seen[(name, args.batch, args.overlap_buckets, args.package_root)] = True
        return {"step_s": 0.5, "veth_bytes_per_step": 1.0, "loss": 3.0}

    monkeypatch.setattr(volume, "run_cell", fake_cell)
    args = argparse.Namespace(batch=4, package_root=None, before_root=tmp_path / "before", repeat=1)
    cells = {f"50mbit/small/{s}": ("small", s) for s in ("zeropp*16", "zeropp_delta", "zeropp_stage_1#4*2@before")}
    runs = {key: [] for key in cells}
    volume._run_round(args, None, cells, "50mbit", 0, runs, {}, {}, tmp_path / "out.json")
    assert set(seen) == {("zeropp", 16, None, None), ("zeropp_delta", 4, None, None),
                         ("zeropp_stage_1", 2, 4, tmp_path / "before")}
    assert all(len(r) == 1 for r in runs.values())
    # each run keeps the machine's speed just before it (a matmul probe), beside the load
    assert all(r[0]["matmul_ms_at_start"]["fp32"] > 0 for r in runs.values())


def test_every_part_cell_parses_and_a_suffix_out_of_order_is_refused():
    import pytest

    from benchmarks.volume_cells import PARTS, CellName, parse_cell

    for _, _, systems in PARTS.values():
        for system in systems:
            parse_cell(system)
    assert parse_cell("zeropp_stage_1#4*2@before~50mbit") == CellName("zeropp_stage_1", 4, 2, True, "50mbit")
    assert parse_cell("zeropp_delta*16~unlimited") == CellName("zeropp_delta", None, 16, False, "unlimited")
    for wrong in ("zeropp@before*4", "zeropp*4#2", "zeropp~unlimited*4", "zeropp*", "zeropp*0", "zeropp#0"):
        with pytest.raises(ValueError, match="name#N\\*B@before~RATE"):
            parse_cell(wrong)


def test_meter_reads_cpu_per_step_and_the_summary_bounds_the_step_by_it():
    """bench_train's Meter: each step's CPU seconds of the process (loops that burn a known
    CPU time per step read it, however busy the machine; the warm-up steps are left out as
    for the step times), its system part and the training thread's run-queue delay; volume's
    summary turns every rank's CPU into the shortest step the cores allow: the ranks' sum
    over the cores."""
    import time

    import pytest

    from benchmarks import volume
    from benchmarks.bench_train import Meter

    meter = Meter()
    # the steps measured after a warm-up of 1 are steps 2-4 (20, 30, 40 ms: median 30); a slice
    # one step early or late reads a median of 35 ms
    for burn in (0.1, 0.1, 0.02, 0.03, 0.04):
        end = time.process_time() + burn
        while time.process_time() < end:
            pass
        meter.step_end(1.0)
    cpu, system, runq = meter.result(warmup=1)["cpu_s_per_step"]
    assert 0.030 <= cpu <= 0.033
    assert 0.0 <= system < cpu and runq >= 0.0
    run = {"step_s": 0.7, "veth_bytes_per_step": 1.0, "loss": 3.0, "load_avg_1min_at_start": 0.5,
           "cpu_s_per_step_per_rank": [[0.3, 0.1, 0.2], [0.25, 0.1, 0.2], [0.35, 0.1, 0.2], [0.3, 0.1, 0.2]],
           "cores": 2}
    assert volume.cpu_bound_s(run) == pytest.approx(0.6)
    record = volume._run_record({**run, "losses": [3.0]})
    assert "losses" not in record and record["cores"] == 2
    older = {k: v for k, v in run.items() if k not in ("cpu_s_per_step_per_rank", "cores")}  # before the CPU fields
    cells = volume._summarize({"a": [record, record], "b": [older]}, {})
    assert cells["a"]["cpu_bound_s_runs"] == pytest.approx([0.6, 0.6])
    assert "cpu_bound_s_runs" not in cells["b"]

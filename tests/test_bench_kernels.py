"""benchmarks/kernels.py on the CPU at tiny sizes: ``--ops`` is checked before anything is
timed (the GB/s table and ``--cpu-suite``), and what is timed is the op named (no GPU;
in-process, a few seconds)."""

from __future__ import annotations

import json
import sys

import pytest

from benchmarks import kernels


def _main(monkeypatch, *argv: str) -> None:
    monkeypatch.setattr(sys, "argv", ["kernels.py", *argv])
    kernels.main()


def test_chosen_ops_strips_names_and_keeps_their_order():
    assert kernels._chosen_ops(None, list(kernels.OPS), "kernel") is None
    assert kernels._chosen_ops(" dequantize, quantize", list(kernels.OPS), "kernel") == ["dequantize", "quantize"]


@pytest.mark.parametrize("mode", [[], ["--cpu-suite"]], ids=["throughput", "cpu-suite"])
def test_a_misspelt_op_names_itself_and_the_fix_before_anything_is_timed(monkeypatch, mode):
    # (--tile-sweep makes the same check, after its CUDA check: on CPU it stops at the latter)
    def timed(*_args, **_kwargs):
        raise AssertionError("an op was timed before --ops was checked")

    monkeypatch.setattr(kernels, "_time_ms", timed)
    with pytest.raises(SystemExit) as raised:
        _main(monkeypatch, *mode, "--ops", "dequantize,dequantise", "--sizes", "4K", "--blocks", "64", "--bits", "8")
    message = str(raised.value)
    assert "dequantise is no" in message and "dequantize is no" not in message
    if not mode:
        assert "Fix: use one or more of " + ", ".join(kernels.OPS) in message


def test_throughput_times_the_named_op_and_writes_its_rows(monkeypatch, tmp_path, capsys):
    out = tmp_path / "kernels.json"
    _main(monkeypatch, "--sizes", "4K", "--blocks", "64", "--bits", "8,4", "--ops", "dequantize", "--out", str(out))
    rows = json.loads(out.read_text())["rows"]
    assert [(r["op"], r["bits"]) for r in rows] == [("dequantize", 8), ("dequantize", 4)]
    assert all(r["numel"] == 4096 and r["block_elems"] == 64 and r["bytes"] > 0 for r in rows)
    assert "dequantize" in capsys.readouterr().out

"""Layer: commands. ``zeropp report RUN_DIR``: a run's logged metrics as PNG plots and a markdown summary.

    zeropp demo --output-dir runs/demo && zeropp report runs/demo
    zeropp report runs/my_run --out runs/my_run/report

Reads the newest ``metrics.csv`` under ``RUN_DIR`` (what Lightning's ``CSVLogger`` writes)
and draws what is in it:

- ``loss.png``: every logged column with ``loss`` in its name, against the step;
- ``comm.png``: the bytes this rank sent per step by collective kind, and intra-/inter-node
  (``CommVolumeMonitor``);
- ``memory.png``: parameters, gradients and optimizer state held by the rank beside the ZeRO
  formula's prediction, at the last logged step (``MemoryMonitor``);
- ``throughput.png``: tokens/s and model TFLOP/s per step (``ThroughputMonitor``);

and ``report.md``: the numbers behind them and the images. A plot whose metrics were not
logged is skipped and the summary says which callback logs them. Needs matplotlib, a
dependency of the package: ``zeropp demo`` ends by suggesting this command.
"""

from __future__ import annotations

import csv
import math
import statistics
from pathlib import Path
from typing import Any

from zeropp_strategy.errors import ArgumentParser, MissingPathError, UsageError

__all__ = ["find_metrics", "main", "make_report", "read_metrics"]

MB = 1e6


def find_metrics(run_dir: str | Path) -> Path:
    """The newest ``metrics.csv`` at or below ``run_dir``."""
    root = Path(run_dir)
    if root.is_file() and root.name.endswith(".csv"):
        return root
    found = sorted(root.rglob("metrics.csv"), key=lambda p: p.stat().st_mtime) if root.is_dir() else []
    if not found:
        raise MissingPathError(f"zeropp report: no metrics.csv under {str(run_dir)!r}", "point it at the folder of a "
                               "run logged with lightning's CSVLogger (Trainer(logger=CSVLogger(DIR))), e.g. the "
                               "folder `zeropp demo` prints last")
    return found[-1]


def read_metrics(path: str | Path) -> dict[str, list[tuple[int, float]]]:
    """Column -> [(step, value)], empty cells and non-numbers skipped."""
    series: dict[str, list[tuple[int, float]]] = {}
    with Path(path).open(newline="") as f:
        for row in csv.DictReader(f):
            step_text = row.get("step") or ""
            if not step_text:
                continue
            step = int(float(step_text))
            for key, text in row.items():
                if key in ("step", "epoch") or not text:
                    continue
                try:
                    value = float(text)
                except ValueError:
                    continue
                if math.isfinite(value):
                    series.setdefault(key, []).append((step, value))
    return series


def _plt() -> Any:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError as err:  # a dependency, so only missing from a broken or --no-deps install
        raise UsageError(f"zeropp report needs matplotlib, which does not import ({err})",
                         "pip install matplotlib") from None
    return plt


def _save(fig: Any, path: Path) -> None:
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def make_report(run_dir: str | Path, out: str | Path | None = None) -> dict[str, Any]:
    """Write the PNGs and ``report.md`` to ``out`` (default ``RUN_DIR/report``). Returns,
    per plot, its file, title, axis labels and series (what the tests check)."""
    metrics_path = find_metrics(run_dir)
    plt = _plt()
    data = read_metrics(metrics_path)
    out_dir = Path(out) if out is not None else Path(run_dir) / "report"
    out_dir.mkdir(parents=True, exist_ok=True)
    plots: dict[str, Any] = {}
    try:
        shown = metrics_path.relative_to(Path(run_dir))
    except ValueError:
        shown = Path(metrics_path.name)
    lines = [f"# Run report: {Path(run_dir).name}", "", f"Metrics: `{shown}` in the run folder", ""]
    missing = []

    loss_keys = sorted(k for k in data if "loss" in k.lower())
    if loss_keys:
        fig, ax = plt.subplots(figsize=(7, 4))
        for k in loss_keys:
            ax.plot(*zip(*data[k]), marker="." if len(data[k]) < 30 else None, label=k)
        info = {"title": "Loss", "xlabel": "step", "ylabel": "loss", "series": loss_keys}
        ax.set(title=info["title"], xlabel=info["xlabel"], ylabel=info["ylabel"])
        ax.legend()
        ax.grid(alpha=0.3)
        _save(fig, out_dir / "loss.png")
        plt.close(fig)
        plots["loss"] = {"file": "loss.png", **info}
        lines += ["## Loss", "", "| metric | first | last | min |", "|---|---:|---:|---:|"]
        for k in loss_keys:
            values = [v for _, v in data[k]]
            lines.append(f"| {k} | {values[0]:.4f} | {values[-1]:.4f} | {min(values):.4f} |")
        lines += ["", "![loss](loss.png)", ""]
    else:
        missing.append("loss (log a metric with 'loss' in its name)")

    kind_keys = sorted(k for k in data if k.startswith("comm/") and k.endswith("_bytes")
                       and k not in ("comm/total_bytes", "comm/intra_bytes", "comm/inter_bytes"))
    if "comm/total_bytes" in data:
        fig, (top, bottom) = plt.subplots(2, 1, figsize=(7, 6), sharex=True)
        steps = [s for s, _ in data["comm/total_bytes"]]
        stacked = []
        for k in kind_keys:
            by_step = dict(data[k])
            values = [by_step.get(s, 0.0) / MB for s in steps]
            if any(values):
                stacked.append((k[len("comm/"):-len("_bytes")], values))
        if stacked:  # stacked: kinds of equal size would hide each other as lines
            top.stackplot(steps, *[v for _, v in stacked], labels=[n for n, _ in stacked], alpha=0.85)
        top.set(title="Bytes sent per step by kind (rank 0)", ylabel="MB (stacked)")
        top.legend(fontsize=8)
        for k, label in (("comm/intra_bytes", "intra-node"), ("comm/inter_bytes", "inter-node")):
            if k in data:
                bottom.plot([s for s, _ in data[k]], [v / MB for _, v in data[k]], label=label)
        bottom.set(title="Intra- and inter-node bytes per step (rank 0)", xlabel="step", ylabel="MB")
        bottom.legend(fontsize=8)
        for ax in (top, bottom):
            ax.grid(alpha=0.3)
        _save(fig, out_dir / "comm.png")
        plt.close(fig)
        plots["comm"] = {"file": "comm.png", "title": "Bytes sent per step by kind (rank 0)", "xlabel": "step",
                         "ylabel": "MB", "series": [k[len("comm/"):-len("_bytes")] for k in kind_keys]}
        total = [v for _, v in data["comm/total_bytes"]]
        lines += ["## Communication (rank 0, per step)", "", "| | mean MB |", "|---|---:|",
                  f"| total | {statistics.mean(total) / MB:.3f} |"]
        for k in ("comm/intra_bytes", "comm/inter_bytes"):
            if k in data:
                lines.append(f"| {k[len('comm/'):-len('_bytes')]} | {statistics.mean(v for _, v in data[k]) / MB:.3f} |")
        if "comm/vs_unquantized" in data:
            ratio = statistics.mean(v for _, v in data["comm/vs_unquantized"])
            lines.append(f"| sent / unquantized equivalent | {ratio:.3f} |")
        lines += ["", "![comm](comm.png)", ""]
    else:
        missing.append("communication (add zeropp_strategy.callbacks.CommVolumeMonitor)")

    parts = ("param", "grad", "optimizer")
    if all(f"memory/{p}_bytes" in data for p in parts):
        held = [data[f"memory/{p}_bytes"][-1][1] / 2**20 for p in parts]
        predicted = [data.get(f"memory/predicted_{p}_bytes", [(0, 0.0)])[-1][1] / 2**20 for p in parts]
        fig, ax = plt.subplots(figsize=(7, 4))
        x = range(len(parts))
        ax.bar([i - 0.2 for i in x], held, width=0.4, label="held")
        ax.bar([i + 0.2 for i in x], predicted, width=0.4, label="ZeRO formula")
        ax.set_xticks(list(x), ["parameters", "gradients", "optimizer state"])
        info = {"title": "Memory on rank 0 vs the ZeRO formula (last step)", "xlabel": "", "ylabel": "MiB",
                "series": ["held", "ZeRO formula"]}
        ax.set(title=info["title"], ylabel=info["ylabel"])
        ax.legend()
        ax.grid(alpha=0.3, axis="y")
        _save(fig, out_dir / "memory.png")
        plt.close(fig)
        plots["memory"] = {"file": "memory.png", **info}
        lines += ["## Memory (rank 0, last logged step)", "", "| | held MiB | formula MiB |", "|---|---:|---:|"]
        lines += [f"| {p} | {h:.3f} | {q:.3f} |" for p, h, q in zip(parts, held, predicted)]
        if "memory/peak_rss_bytes" in data:
            lines.append(f"| peak RSS | {data['memory/peak_rss_bytes'][-1][1] / 2**20:.1f} | |")
        lines += ["", "![memory](memory.png)", ""]
    else:
        missing.append("memory (add zeropp_strategy.callbacks.MemoryMonitor)")

    if "throughput/tokens_per_sec" in data:
        fig, (top, bottom) = plt.subplots(2, 1, figsize=(7, 6), sharex=True)
        top.plot(*zip(*data["throughput/tokens_per_sec"]), label="rank 0")
        if "throughput/job_tokens_per_sec" in data:
            top.plot(*zip(*data["throughput/job_tokens_per_sec"]), label="job")
        top.set(title="Tokens per second", ylabel="tokens/s")
        top.legend(fontsize=8)
        if "throughput/tflops" in data:
            bottom.plot(*zip(*data["throughput/tflops"]))
        bottom.set(title="Model TFLOP/s (6 x params x tokens / time), rank 0", xlabel="step", ylabel="TFLOP/s")
        for ax in (top, bottom):
            ax.grid(alpha=0.3)
        _save(fig, out_dir / "throughput.png")
        plt.close(fig)
        plots["throughput"] = {"file": "throughput.png", "title": "Tokens per second", "xlabel": "step",
                               "ylabel": "tokens/s", "series": ["rank 0", "job"]}
        tokens = [v for _, v in data["throughput/tokens_per_sec"]]
        text = f"median {statistics.median(tokens):.1f} tokens/s"
        if "throughput/tflops" in data:
            text += f", {statistics.median(v for _, v in data['throughput/tflops']):.5f} model TFLOP/s"
        lines += ["## Throughput (rank 0)", "", text, "", "![throughput](throughput.png)", ""]
    else:
        missing.append("throughput (add zeropp_strategy.callbacks.ThroughputMonitor)")

    if missing:
        lines += ["## Not in this run", ""] + [f"- {m}" for m in missing] + [""]
    (out_dir / "report.md").write_text("\n".join(lines))
    return {"out": str(out_dir), "plots": plots, "missing": missing}


def main(argv: list[str] | None = None, prog: str = "zeropp report") -> int:
    parser = ArgumentParser(prog=prog, description=__doc__.split("\n\n")[0].removeprefix("Layer: commands. "))
    parser.add_argument("run_dir", metavar="RUN_DIR", help="a CSVLogger run folder (or any folder above it)")
    parser.add_argument("--out", default=None, help="where the PNGs and report.md go (default: RUN_DIR/report)")
    args = parser.parse_args(argv)
    result = make_report(args.run_dir, args.out)
    print(f"zeropp report: wrote {', '.join(p['file'] for p in result['plots'].values()) or 'no plot'} and "
          f"report.md to {result['out']}")
    for m in result["missing"]:
        print(f"  not in this run: {m}")
    return 0

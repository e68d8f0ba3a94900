"""``python benchmarks/offload.py --part adam``: CPU AdamW step throughput, ``torch.optim.AdamW``
(for-loop, foreach, fused) against ``OffloadOptimizer(device="cpu")`` (what it measures:
benchmarks/offload.py's docstring, ``adam``).
"""

from __future__ import annotations

import argparse

import torch

from offload_common import _adam_cases, _gbs, _md, _median_step  # a sibling: benchmarks/ is on sys.path

ADAM_IMPLS = ("forloop", "foreach", "fused", "ours")
ADAM_BYTES_PER_ELEM = 28  # fp32: read param, grad, exp_avg, exp_avg_sq; write param, exp_avg, exp_avg_sq


# -- adam ---------------------------------------------------------------------------------------


def _adam_optimizer(impl: str, params: list[torch.Tensor]):
    from zeropp_strategy.config import OffloadConfig
    from zeropp_strategy.offload import OffloadOptimizer

    if impl == "forloop":
        return torch.optim.AdamW(params, lr=1e-3, foreach=False)
    if impl == "foreach":
        return torch.optim.AdamW(params, lr=1e-3, foreach=True)
    if impl == "fused":
        return torch.optim.AdamW(params, lr=1e-3, fused=True)
    return OffloadOptimizer(torch.optim.AdamW(params, lr=1e-3), OffloadConfig(device="cpu"))


def part_adam(args: argparse.Namespace) -> dict:
    rows = []
    for label, sizes in _adam_cases(args.adam_sizes):
        g = torch.Generator().manual_seed(0)
        params = [torch.randn(n, generator=g).requires_grad_() for n in sizes]
        for p in params:
            p.grad = torch.randn(p.shape, generator=g) * 1e-3
        numel = sum(sizes)
        row: dict = {"case": label, "tensors": len(sizes), "numel": numel}
        for impl in ADAM_IMPLS:
            opt = _adam_optimizer(impl, params)
            med, times = _median_step(opt.step, args.warmup, args.steps)
            row[impl] = {"step_s": med, "min_s": min(times), "times_s": times, "Mparams_per_s": numel / med / 1e6,
                         "GBps": _gbs(ADAM_BYTES_PER_ELEM * numel, med)}
            if impl == "ours":
                d = opt.host_optimizer.defaults
                row["ours_host_impl"] = {"fused": d.get("fused"), "foreach": d.get("foreach")}
                opt.close()
            del opt
        fused = row["fused"]["Mparams_per_s"]
        for impl in ADAM_IMPLS:
            row[impl]["vs_fused"] = row[impl]["Mparams_per_s"] / fused
        rows.append(row)
        del params
    return {"part": "adam", "warmup": args.warmup, "steps": args.steps, "torch_threads": torch.get_num_threads(),
            "bytes_per_elem": ADAM_BYTES_PER_ELEM, "rows": rows}


def print_adam(res: dict) -> None:
    print(f"\n## adam: CPU AdamW step, fp32, {res['torch_threads']} threads, median of {res['steps']} steps\n")
    head = ["case", "numel"]
    for impl in ADAM_IMPLS:
        head += [f"{impl} Mparams/s", f"{impl} GB/s", f"{impl} / fused"]
    rows = []
    for r in res["rows"]:
        cells = [r["case"], f"{r['numel']:,}"]
        for impl in ADAM_IMPLS:
            c = r[impl]
            cells += [f"{c['Mparams_per_s']:.1f}", f"{c['GBps']:.2f}", f"{c['vs_fused']:.2f}x"]
        rows.append(cells)
    print(_md(head, rows))
    impl = res["rows"][0].get("ours_host_impl") if res["rows"] else None
    print(f"\nours: the host optimizer ran with {impl}; GB/s counts {res['bytes_per_elem']} bytes per element.")

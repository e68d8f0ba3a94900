"""What benchmarks/volume.py runs: the suite's cells (``CELLS``), the parts (``PARTS``) and their
results files, and the formulas its page compares the measured cross-node bytes with.
Imported by benchmarks/volume.py and benchmarks/volume_page.py.
"""

from __future__ import annotations

import re
from typing import NamedTuple

CELLS = {
    "200mbit": ["ddp", "zeropp_stage_1", "zeropp_stage_2", "zeropp_stage_3", "zeropp_stage_3_bf16", "zeropp",
                "deepspeed_zero3"],
    "unlimited": ["zeropp_stage_3", "zeropp", "deepspeed_zero3"],
}
MB = 1e6
# --part stage1 / sizes: (rate, sizes, systems); "@before" would run the --before-root package,
# "#N" cuts stage 1's post-step gather into about N buckets (bench_train.py --overlap-buckets).
PARTS = {
    "stage1": ("200mbit", ["small"], ["ddp", "zeropp_stage_1", "zeropp_stage_1_overlap", "zeropp_stage_1_overlap#1",
                                      "zeropp_stage_1_overlap#16"]),
    "sizes": ("1gbit", ["small", "medium"], ["ddp", "zeropp_stage_3", "zeropp", "deepspeed_zero3"]),
    # Beyond ZeRO++ (issue 35): int4 weight gathers against zeropp, at 50 Mbit/s and without a limit
    "4bit_50mbit": ("50mbit", ["small"], ["zeropp", "zeropp_4bit"]),
    "4bit_unlimited": ("unlimited", ["small"], ["zeropp", "zeropp_4bit"]),
    # ... and weight deltas (the zeropp_delta preset), with DDP at unlimited bandwidth beside them
    "delta_50mbit": ("50mbit", ["small"], ["zeropp", "zeropp_delta"]),
    "delta_unlimited": ("unlimited", ["small"], ["ddp", "zeropp", "zeropp_delta"]),
    # the must-show at 200 Mbit/s: the new level beside zeropp, DeepSpeed ZeRO-3 and DDP at
    # unlimited bandwidth ("~RATE": that cell at its own rate, in the same rounds)
    "delta_200mbit": ("200mbit", ["small"], ["zeropp", "zeropp_delta", "deepspeed_zero3", "ddp~unlimited"]),
    # the two presets with int8 gradients (gradient_quant_bits=8) beside them, at 50 Mbit/s and
    # with no limit, in the same rounds
    "grad_int8": ("50mbit", ["small"], ["zeropp", "zeropp_grad_int8", "zeropp_delta", "zeropp_delta_grad_int8",
                                        "zeropp~unlimited", "zeropp_grad_int8~unlimited", "zeropp_delta~unlimited",
                                        "zeropp_delta_grad_int8~unlimited"]),
    # error feedback: LoCo on both of qgZ's hops (DeepSpeed's zeropp_loco_param), and int8
    # inside the node with the cross-node hop fed back, beside zeropp, with no limit and at 50 Mbit/s
    "loco": ("unlimited", ["small"], ["zeropp", "zeropp_loco", "zeropp_ef", "zeropp~50mbit", "zeropp_loco~50mbit",
                                      "zeropp_ef~50mbit"]),
    # the intra-node feedback in cache-sized pieces (2026-11-29), against the package before it
    # (--before-root) in the same rounds, beside zeropp, with no limit (where its CPU time shows)
    "loco_pieces": ("unlimited", ["small"], ["zeropp", "zeropp_loco", "zeropp_loco@before"]),
    # what the 50 Mbit/s targets stand on (2026-11-29): plain FSDP2 (Lightning's ModelParallelStrategy,
    # nothing quantized) beside our stage 3, zeropp and zeropp_delta with no limit, and the two
    # presets at 50 Mbit/s, in the same rounds
    "delta_base": ("unlimited", ["small"], ["ddp", "fsdp2", "zeropp_stage_3", "zeropp", "zeropp_delta",
                                            "zeropp~50mbit", "zeropp_delta~50mbit"]),
    # the same without our stage 3 at bench_train's --size medium (8 x 512, 25.5M parameters, not GPT-2
    # medium): about 7.7x the parameters of small, so 7.7x its bytes and its compute per token
    "delta_base_medium": ("unlimited", ["medium"], ["ddp", "fsdp2", "zeropp", "zeropp_delta", "zeropp~50mbit",
                                                    "zeropp_delta~50mbit"]),
    # more or fewer tokens per step (2026-11-29): "name*B" runs with a micro-batch of B sequences of 128 per
    # rank (the parts above: 4). Compute per step scales with B, the bytes do not, so B moves the two 50 Mbit/s
    # ratios (at most 1.2x its own unlimited step, at most 0.6x zeropp's) against each other; no B met both
    "delta_tokens": ("50mbit", ["small"], [f"{system}*{batch}{rate}" for batch in (1, 2, 4, 16)
                                           for system, rate in (("zeropp", ""), ("zeropp_delta", ""),
                                                                ("zeropp", "~unlimited"),
                                                                ("zeropp_delta", "~unlimited"))]),
    # the comm thread's jobs pipelined (2026-11-29, tried and reverted): this checkout's package against the one in
    # --before-root, at 50 Mbit/s and with no limit. Measured with ba78585's changes (the pipelined jobs) as this
    # package and 9c654b0's in --before-root (docs/zeropp_measurements.md, "The comm thread's jobs pipelined")
    "comm_pipeline": ("50mbit", ["small"], [f"{system}{variant}{rate}" for rate in ("", "~unlimited")
                                            for system in ("zeropp", "zeropp_delta") for variant in ("", "@before")]),
    # the link rate swept (2026-11-29): the two presets at 100, 50, 25 and 12 Mbit/s and with no limit, in the same
    # rounds, to find where halving the bytes shows as time on this machine (at 50 Mbit/s the compute does not let it)
    "delta_rates": ("50mbit", ["small"], [f"{system}{rate}" for rate in ("~100mbit", "", "~25mbit", "~12mbit",
                                                                         "~unlimited")
                                          for system in ("zeropp", "zeropp_delta")]),
    # issue 35's two 50 Mbit/s targets in the same rounds, with every rank's CPU time per step:
    # the shortest step the 2 cores allow each cell, beside its step
    "delta_cpu": ("50mbit", ["small"], ["zeropp", "zeropp_delta", "zeropp~unlimited", "zeropp_delta~unlimited"]),
}
PART_FILES = {"stage1": "volume_stage1_async.json", "sizes": "volume_sizes_1gbit.json",
              "4bit_50mbit": "volume_4bit_50mbit.json", "4bit_unlimited": "volume_4bit_unlimited.json",
              "delta_50mbit": "volume_delta_50mbit.json", "delta_unlimited": "volume_delta_unlimited.json",
              "delta_200mbit": "volume_delta_200mbit.json", "grad_int8": "volume_grad_int8.json",
              "loco": "volume_loco.json", "loco_pieces": "volume_loco_pieces.json",
              "delta_base": "volume_delta_base.json", "delta_base_medium": "volume_delta_base_medium.json",
              "delta_tokens": "volume_delta_tokens.json", "comm_pipeline": "volume_comm_pipeline.json",
              "delta_rates": "volume_delta_rates.json", "delta_cpu": "volume_delta_cpu.json"}
SUITE_FILES = {"fp32": "volume_bf16_fp32mm.json", "native": "volume_bf16.json"}  # by --bf16-matmul
ARCHIVED_SUITES = ["volume_bf16_fp32mm_2026-11-25.json"]
"""Earlier runs of the suite kept on the page below the newest, newest first; each JSON's
``meta["title_note"]`` says what it predates."""


class CellName(NamedTuple):
    """One system of a part, parsed: ``name#N*B@before~RATE``, each suffix optional, in that order."""

    name: str
    buckets: int | None  # "#N": stage 1's post-step gather in about N buckets
    batch: int | None  # "*B": a micro-batch of B sequences per rank instead of --batch
    before: bool  # "@before": the --before-root package
    rate: str | None  # "~RATE": at RATE instead of the part's rate, in the same rounds


_CELL_NAME = re.compile(r"(?P<name>[a-z0-9_]+)(?:#(?P<buckets>[1-9]\d*))?(?:\*(?P<batch>[1-9]\d*))?(?P<before>@before)?"
                        r"(?:~(?P<rate>[a-z0-9]+))?")


def parse_cell(system: str) -> CellName:
    """``system`` as a part lists it; a ValueError naming the expected form when it does not parse
    (a suffix out of order would otherwise run another cell than the one named)."""
    m = _CELL_NAME.fullmatch(system)
    if m is None:
        raise ValueError(f"part cell {system!r} does not parse. Fix: write name#N*B@before~RATE, every suffix "
                         "optional but in that order (e.g. zeropp_delta*16~unlimited)")
    return CellName(m["name"], int(m["buckets"]) if m["buckets"] else None, int(m["batch"]) if m["batch"] else None,
                    bool(m["before"]), m["rate"])


def formula_bytes(system: str, params: int, world: int = 4, nodes: int = 2) -> float | None:
    """Cross-node payload per step, both directions, all ranks ([Note: two-hop collectives]).

    P parameters, bf16 gathers (2 bytes), fp32 (4) or bf16 (2) reduce: a two-hop collective
    puts (M-1)/M of the full tensor's bytes across per node pair, i.e. (M-1) x bytes(P) in all;
    gloo's ring all-reduce (ddp) puts 2 (W-1)/W x bytes(P) on each of the M node-crossing links.
    """
    m = nodes - 1
    if system == "ddp":
        return nodes * 2 * (world - 1) / world * 4 * params
    if system == "zeropp_stage_1":  # fp32 reduce-scatter + fp32 gather of the updated rows
        return m * (4 + 4) * params
    if system == "zeropp_stage_2":  # one bf16 gather + fp32 reduce-scatter
        return m * (2 + 4) * params
    if system == "zeropp_stage_3":  # two bf16 gathers + fp32 reduce-scatter
        return m * (2 + 2 + 4) * params
    if system == "zeropp_stage_3_bf16":
        return m * (2 + 2 + 2) * params
    return None


# Peers whose gradient reduce-scatter gloo runs as an all-reduce (torch's gloo backend has
# no reduce_scatter_tensor of its own), with their reduce dtype's bytes: DeepSpeed ZeRO-3 in
# its bf16 mode, FSDP2 with MixedPrecisionPolicy(reduce_dtype=fp32). Ours uses all-to-all.
RS_AS_ALL_REDUCE = {"deepspeed_zero3": 2, "fsdp2": 4}


def nccl_ideal_bytes(system: str, veth: float, params: int, world: int = 4, nodes: int = 2) -> float | None:
    """An estimate of a peer's cross-node bytes per step with a native reduce-scatter (NCCL):
    the measured bytes less what the all-reduce adds over a reduce-scatter. On the ring of
    ``world`` ranks, ``nodes`` links cross nodes; a reduce-scatter of B bytes puts (W-1)/W x B
    on each link, an all-reduce twice that, so the extra is nodes x (W-1)/W x B. None for
    systems that do not pay it."""
    width = RS_AS_ALL_REDUCE.get(system)
    if width is None:
        return None
    return veth - nodes * (world - 1) / world * width * params

"""Layer: plan. What a ``Plan`` costs on a cluster: the memory per rank, the bytes per step
and the step time of a plan (None: DDP) for a model, with whether it fits.

``cost`` prices every config for ``zeropp plan`` (estimate.py) and a run's own plan at its
start (``ZeroSession.explain``); ``ModelShape``, ``Cluster``, ``Workload`` and ``ByteModel``
are what it reads, ``ConfigEstimate`` what it gives. The plan itself is plan.py's.

[Note: the estimate]
``cost`` is arithmetic on the model's shape (for ``zeropp plan`` read from a meta-device
build, so a 70B model costs seconds, its activations traced on fake tensors; for a run, from
its prepared modules): the parameter count ``P``,
the trainable count ``T`` (``P``, or the LoRA adapters with ``--lora R``), the parameters
outside the repeated blocks (``P_root``: embeddings, head, final norm) and the largest
block. The formulas are the ones docs/stages.md and docs/zeropp.md derive and the ledger
measures; the bytes per element are a ``ByteModel``: under ``bf16-mixed`` with AdamW (the
default) fp32 parameters (``a = 4`` bytes), fp32 gradients (``g = 4``), two fp32 moments
(``k = 8``), 16-bit gathers (``c = 2``), fp32 reduces (``r = 4``); ``ByteModel.of`` reads
them from a run's precision and plan (bits and blocks of qwZ and qgZ per hop). ``M`` nodes
of ``L`` GPUs, ``N = M L`` ranks.

- **Memory per GPU**: parameters, gradients and optimizer state as each stage holds them;
  the gathered working set of stages 2/3 (stage 2: every group, from its forward to its
  backward; stage 3: the root group and the two largest blocks, the one computing and the
  one prefetched); hpZ's secondary shard ``c P / L``; one bucket or one group of unsharded
  gradients; activations from the micro-batch: traced when the model can be (``zeropp
  plan`` runs one training forward of the model on fake tensors under bf16 autocast and
  counts what autograd saves for backward, as the memory plan's ``ActivationMeter``
  measures a real run: ``ActivationTrace``), else ``34 s b h`` bytes per layer as
  Korthikanti et al. count for 16-bit activations without the attention matrix, which
  SDPA does not store (``2 s b h`` per layer with activation checkpointing; plus ``6 s b
  V`` for the logits and their fp32 loss). The formula assumes a fused GeLU and 16-bit
  everything: GPT-2's elementwise ``gelu_new`` saved 1.7x it with 16-bit parameters, 2.2x
  with fp32 ones (plus the fp32 residual stream and autocast's weight copies;
  benchmarks/plan_accuracy.py). The trace follows CPU autocast's op lists (CUDA's keep a
  few more ops in fp32, e.g. ``pow``: GPT-2's ``gelu_new`` would save more on a GPU). ``RUNTIME_GPU_BYTES`` for the CUDA context and allocator.
  Offloaded state moves to the host column (NVMe: to the disk column, with the in-flight
  buffers in host memory).
- **Bytes per step per rank**, as the ledger books them: the collectives of each stage on
  the two-hop routes (docs/stages.md, "Across nodes"): a gather of ``B`` bytes in all sends
  ``B (M-1)/N`` across nodes and ``B (L-1)/L`` inside per rank, a reduce-scatter of ``B``
  bytes per rank the same; DDP's ring all-reduce ``2 (N-1)/N B``, ``M/N`` of it across;
  qwZ at 1 + 4/256 bytes per element, qgZ at 0.5 + 4/64 (int4, blocks of 64; the
  config's bits and blocks per hop), hpZ's backward gather inside the node only; every
  tensor counted as quantized (``quantize_min_elems`` is ignored). NCCL's native rings on GPUs put up to ``M/(M-1)``
  times more of a plain collective on the link (2x on two nodes): the cross-node figures
  are then a lower bound, and ``tests/test_estimate.py`` checks them against the ledger of a
  measured run.
- **Step time**: compute ``(6 P + 2 P_ckpt) tokens / (TFLOPs x MFU)`` for full training
  (``4 P + 2 T`` with frozen weights: the input gradients still pass every layer), plus the
  communication not hidden behind it: the larger of compute and link time, plus one
  block's share of the link time (the first gather and the last reduce have nothing to
  overlap with); with ``Cluster.overlap`` below 1 (``--overlap``: gloo on CPUs, where
  communication takes the cores compute needs) that share of the step moves toward
  compute + link. A node's cross-node bytes share its link (``--link`` per node), a GPU's
  intra-node bytes its ``--intra-link``. Offload adds, not overlapped, the host's AdamW
  step over the optimizer state (``HOST_BYTES_PER_S``) and the PCIe copies
  (``PCIE_BYTES_PER_S``): the gradient shards down once, the parameter shards up once after
  the step, or twice (each gather) when they live on the host; NVMe adds the state's read
  and write (``NVME_BYTES_PER_S``).

It is an estimate: the measured MFU, the allocator's fragmentation and the framework's
buffers decide the rest. ``zeropp plan --json`` and ``ZeroSession.explain`` give every term, so a
measured run can be set beside it (tests/test_callbacks.py sets a run's own plan beside
its ledger; docs/plan.md compares ``zeropp plan`` with measured runs).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from zeropp_strategy.comm.feedback import FEEDBACK_ROW_ELEMS
from zeropp_strategy.plan import Plan, explain

__all__ = [
    "ActivationTrace",
    "ByteModel",
    "Cluster",
    "ConfigEstimate",
    "ModelShape",
    "Workload",
    "activations",
    "cost",
    "leaf_counts",
]


@dataclass(frozen=True)
class ActivationTrace:
    """What one micro-batch's training forward saves for backward, in bytes, traced without
    memory (``estimate.trace_activations``: fake tensors, bf16 autocast, the parameters in
    fp32 or in 16 bits): outside the blocks (embeddings, final norm, logits and loss), in
    all blocks, in the largest one, and the blocks' inputs (what activation checkpointing
    keeps of them)."""

    micro_batch: int
    seq_len: int
    root: int
    blocks: int
    largest_block: int
    block_inputs: int


@dataclass(frozen=True)
class ModelShape:
    """What the estimate needs of a model: counts of elements (global, not per shard)."""

    name: str
    params: int
    trainable: int
    root_params: int  # outside the repeated blocks (embeddings, head, final norm)
    largest_block: int
    blocks: int
    hidden: int
    layers: int
    vocab: int
    # Stage 3's frozen leaves ([Note: frozen leaves] in engine/wrap.py), counted in
    # root_params too: each is gathered around its own forward instead of with the root
    # for the whole step, and the ones whose backward reads the weight (a head, not an
    # embedding) once more in backward.
    largest_leaf: int = 0
    leaf_params: int = 0  # all the leaves
    leaf_backward: int = 0  # the leaves gathered again in backward
    # Traced activations, used for a workload of their micro-batch and length: the forward
    # computing with fp32 parameters (DDP, stage 1: autocast's 16-bit copies of the weights
    # and an fp32 residual stream included) and with 16-bit gathered ones (stages 2/3).
    activation_trace: ActivationTrace | None = None
    activation_trace_16bit: ActivationTrace | None = None
    untraced: str = ""  # why a trace was tried and failed

    @property
    def frozen(self) -> int:
        return self.params - self.trainable


def leaf_counts(leaves: list[tuple[int, bool]]) -> dict[str, int]:
    """``ModelShape``'s leaf fields from (elements, gathered again in backward) per frozen leaf."""
    return {"largest_leaf": max((n for n, _ in leaves), default=0), "leaf_params": sum(n for n, _ in leaves),
            "leaf_backward": sum(n for n, again in leaves if again)}


@dataclass(frozen=True)
class Cluster:
    """The machines: ``link`` and ``intra_link`` in bytes/s (``inf`` when a run does not know
    them: its estimate then has no link time)."""

    nodes: int
    gpus_per_node: int
    gpu_memory: int  # bytes
    host_memory: int  # bytes per node
    link: float  # bytes/s, cross-node, per node
    intra_link: float  # bytes/s, per GPU
    tflops: float = 989.0  # dense bf16 per GPU (H100 SXM)
    mfu: float = 0.4
    nvme: str | None = None
    # The share of the link time that can hide behind compute: 1 where communication runs
    # beside it (NCCL on its own CUDA streams), 0 where it takes the same cores (gloo on a
    # CPU: benchmarks/plan_accuracy.py measured compute + link there).
    overlap: float = 1.0

    @property
    def world(self) -> int:
        return self.nodes * self.gpus_per_node


@dataclass(frozen=True)
class Workload:
    micro_batch: int = 1
    seq_len: int = 2048
    activation_checkpointing: bool = False


@dataclass
class ConfigEstimate:
    """One config's row: bytes per rank by part, per step, and the verdict."""

    name: str
    zero_config: dict[str, Any]
    gpu: dict[str, float] = field(default_factory=dict)  # bytes per GPU by part
    host: dict[str, float] = field(default_factory=dict)  # bytes per rank by part
    disk: float = 0.0  # bytes per node
    intra_bytes: float = 0.0  # per rank per step
    inter_bytes: float = 0.0
    compute_s: float = 0.0
    comm_s: float = 0.0
    offload_s: float = 0.0
    step_s: float = 0.0
    fits: bool = True
    why_not: str = ""
    notes: list[str] = field(default_factory=list)  # the run's own fallbacks (plan.resolve)
    explanation: list[str] = field(default_factory=list)  # explain(plan): what happens, in sentences

    @property
    def gpu_total(self) -> float:
        return sum(self.gpu.values())

    @property
    def host_total(self) -> float:
        return sum(self.host.values())


RUNTIME_GPU_BYTES = 2 * 2**30  # CUDA context, cuBLAS workspaces, allocator slack
RUNTIME_HOST_BYTES = 2**30  # per rank: Python, torch, the framework
# Offload rates per rank, from one H200 with a 16-core host to itself (docs/gpu.md, 2026-11-27):
# the measured offload time, 3.8e-10 s per parameter at 0.95B and 4.0e-10 at 4.3B, is both
# terms below together (they scale alike with the model, so the two runs measure only their
# sum); the split between them is PCIe 5.0 x16's usual pinned-copy rate, not a measurement.
HOST_BYTES_PER_S = 50e9  # a host AdamW step, bytes of optimizer state per second per rank
PCIE_BYTES_PER_S = 50e9  # host <-> GPU copies per rank
NVME_BYTES_PER_S = 3e9  # per node
GPU_HEADROOM = 0.95  # of the GPU memory a plan may fill


@dataclass(frozen=True)
class ByteModel:
    """Bytes per element the estimate counts with; the defaults are bf16-mixed with AdamW and
    ZeroConfig's own quantization defaults (qwZ int8 in blocks of 256, qgZ int4 in blocks of 64)."""

    param: float = 4.0  # the parameters the optimizer steps
    grad: float = 4.0
    optim: float = 8.0  # AdamW's two moments
    gather: float = 2.0  # a gathered parameter
    reduce: float = 4.0  # a reduced gradient
    qw: float = 1 + 4 / 256  # a qwZ code with its share of a scale
    qg_across: float = 0.5 + 4 / 64  # a qgZ code across nodes
    qg_inside: float = 0.5 + 4 / 64  # ... and inside the node
    frozen: float = 0.0  # a frozen int8/int4 code with its share of a scale; 0: the plan's bits in blocks of 256

    @classmethod
    def of(cls, precision: str, plan: Plan) -> ByteModel:
        """The bytes of a run: its precision flag (Lightning's names), the plan's gather and
        reduce dtypes, bits and blocks per hop."""
        half = 2.0 if precision.startswith(("bf16", "16")) else 4.0
        true_half = precision.endswith("-true") and half == 2.0  # bf16-true: everything in 16 bits
        param = half if true_half else 4.0
        gather = param if not precision.endswith("-mixed") else (2.0 if plan.gather_16bit else 4.0)
        reduce = {"fp32": 4.0, "bf16": 2.0, "fp16": 2.0}.get(str(plan.reduce_dtype))  # ZeroConfig.reduce_dtype
        if reduce is None:  # the precision's own: fp32 under mixed precision, the parameters' otherwise
            reduce = 2.0 if true_half else 4.0
        block, weight_block = plan.gradient_block_elems, plan.weight_block_elems  # the frozen shards' too
        across = plan.cross_node_scale_bits / 8  # a scale's bytes in qgZ's cross-node hop and in weight deltas
        return cls(param=param, grad=param, optim=2 * param, gather=gather, reduce=reduce,
                   qw=plan.weight_bits / 8 + (across if plan.weight_delta else 4) / weight_block,
                   frozen=plan.frozen_weight_bits / 8 + 4 / weight_block if plan.frozen_weight_bits else 0.0,
                   qg_across=plan.gradient_bits / 8 + across / block,
                   qg_inside=plan.gradient_bits_inside / 8 + 4 / block)


def activations(model: ModelShape, workload: Workload, *, params_16bit: bool = False) -> float:
    """Activation bytes of one micro-batch ([Note: the estimate]): the model's trace for a
    forward with 16-bit (``params_16bit``) or fp32 parameters when it was traced for this
    micro-batch and length, else the formula."""
    m, w = model, workload
    t = m.activation_trace_16bit if params_16bit else m.activation_trace
    if t is not None and (t.micro_batch, t.seq_len) == (w.micro_batch, w.seq_len):
        # checkpointed: every block's input, and one block's activations while it is recomputed
        return t.root + (t.block_inputs + t.largest_block if w.activation_checkpointing else t.blocks)
    sbh = w.seq_len * w.micro_batch * m.hidden
    per_layer = 2 * sbh if w.activation_checkpointing else 34 * sbh
    extra = 34 * sbh if w.activation_checkpointing else 0  # one block recomputed at a time
    return m.layers * per_layer + extra + 6 * w.seq_len * w.micro_batch * m.vocab


def cost(name: str, plan: Plan | None, model: ModelShape, cluster: Cluster, workload: Workload | None, *,
         b: ByteModel = ByteModel()) -> ConfigEstimate:
    """What ``plan`` (None: DDP) costs for ``model`` on ``cluster``: memory per rank by part,
    bytes per step per rank inside and across nodes, the step time, and whether it fits
    (a memory of 0 in ``cluster`` is not checked). ``workload`` None: no activations and no
    compute time (a run that has not seen a batch). Frozen weights are stored at
    ``plan.frozen_weight_bits`` (0: dense)."""
    m, c, w = model, cluster, workload
    P, T, F, N, L, M = m.params, m.trainable, m.frozen, c.world, c.gpus_per_node, c.nodes
    A, G, K, C, R = b.param, b.grad, b.optim, b.gather, b.reduce
    e = ConfigEstimate(name, {}, explanation=explain(plan))
    stage, qw, hpz_group, qg, opt_off, par_off = 0, False, 1, False, "none", "none"
    delta = plan is not None and plan.weight_delta
    if plan is not None:
        stage, qw, hpz_group, qg = plan.stage, plan.quantized_weights, plan.hpz_group, plan.quantized_gradients
        opt_off, par_off, e.notes = plan.offload_optimizer, plan.offload_param, list(plan.notes)
    frozen_bits = plan.frozen_weight_bits if plan is not None and F else 0
    if frozen_bits:  # FSDP2 keeps no secondary shard of a block with int8/int4 weights: hpZ is off there
        hpz_group = 1
    # -- model states ------------------------------------------------------------------------
    frozen_code = (b.frozen or frozen_bits / 8 + 4 / 256) if frozen_bits else 0.0
    shard_param = (F * frozen_code + A * T) / N if frozen_bits else A * P / N
    if stage == 0:
        e.gpu.update(parameters=A * P, gradients=G * T, optimizer=K * T, buckets=G * T)
    elif stage == 1:
        e.gpu.update(parameters=A * P, gradients=G * T, optimizer=K * T / N, buckets=min(25 * 2**20, G * T))
    else:
        e.gpu.update(parameters=shard_param, gradients=G * T / N, optimizer=K * T / N)
        if stage == 2:
            e.gpu["gathered"] = C * P
        else:
            # the root for the whole step, one frozen leaf at a time, the block computing and the next
            e.gpu["gathered"] = C * (m.root_params - m.leaf_params + m.largest_leaf + 2 * m.largest_block)
        e.gpu["unsharded_gradients"] = G * min(T, max(m.largest_block, m.root_params))
        if hpz_group > 1:  # the secondary shard, in the gather's dtype (never with frozen codes: hpZ is off there)
            e.gpu["hpz_secondary"] = C * P / hpz_group
        if delta:  # qwZ's kept copy of the shards of this local index on every node (frozen codes keep none)
            e.gpu["delta_copies"] = C * (T if frozen_bits else P) / L
    if plan is not None and plan.error_feedback:  # qgZ (stage 2 or 3)'s kept errors: fp32, M chunks of T / N
        e.gpu["feedback_errors"] = 4 * T / L
    if plan is not None and plan.error_feedback_intra:  # ... and inside the node: int8 blocks of the whole gradient,
        # plus three fp32 rows of the largest group's chunks while it is reduced (chunks up to
        # FEEDBACK_ROW_ELEMS elements together, else one chunk, 1/N of the group)
        group = min(T, max(m.largest_block, m.root_params))
        e.gpu["feedback_errors"] = (e.gpu.get("feedback_errors", 0) + (1 + 4 / plan.gradient_block_elems) * T
                                    + 12 * min(group, max(group / N, FEEDBACK_ROW_ELEMS)))
    stepped_on_host = moved_down = 0.0  # optimizer state the host steps, gradient bytes copied down
    if opt_off != "none":
        state = {"optimizer": e.gpu.pop("optimizer"), "gradients": e.gpu.pop("gradients")}
        stepped_on_host, moved_down = state["optimizer"], state["gradients"]
        if opt_off == "cpu":
            e.host.update(state)
        else:
            e.disk += sum(state.values()) * L
            e.host["nvme_buffers"] = min(sum(state.values()), 2 * 2**30)  # staging, as the memory plan sizes it
    if par_off != "none" and opt_off == "none":  # FSDP2's CPUOffloadPolicy: the step runs beside the shards
        e.host.update(optimizer=e.gpu.pop("optimizer"), gradients=e.gpu.pop("gradients"))
        stepped_on_host, moved_down = e.host["optimizer"], e.host["gradients"]
    moved_up = e.gpu.get("parameters", 0.0)  # once, after the host step
    if par_off != "none":
        shard = e.gpu.pop("parameters")
        moved_up = 2 * shard  # for each gather: forward and backward
        if par_off == "cpu":
            e.host["parameters"] = shard
        else:
            e.disk += shard * L
            e.host["parameter_buffers"] = C * 4 * m.largest_block
    if w is not None:
        # the forward computes with the stored parameters (DDP, stage 1) or the gathered ones
        # (stages 2/3): the 16-bit trace when those are 16-bit (traces are of bf16 autocast)
        e.gpu["activations"] = activations(m, w, params_16bit=(C if stage >= 2 else A) < 4)
    e.gpu["runtime"] = RUNTIME_GPU_BYTES
    e.host["runtime"] = RUNTIME_HOST_BYTES
    # -- bytes per step per rank, as the ledger books them ([Note: two-hop collectives]) --------
    # A gather of B bytes in all (B/N per rank): across nodes B (M-1)/N, inside B (L-1)/L (the
    # fan-out); a reduce-scatter of B bytes per rank: inside B (L-1)/L, across B (M-1)/N.
    across, inside = (M - 1) / N, (L - 1) / L
    # Under qwZ (which the plan turns off on one node) a gather sends its quantized payload
    # on both hops: the fan-out inside the node carries the same codes. hpZ's backward gather
    # stays inside the node, unquantized. Frozen int8/int4 shards travel as stored.
    # In a group holding frozen codes, the dense parameters travel with them at the gather
    # width (docs/zeropp.md, "Bytes per gather"), not as qwZ codes.
    wire = b.qw if qw else C
    gather_plain = (F * frozen_code + C * T) if frozen_bits else C * P
    gather_wire = gather_plain if frozen_bits else wire * P
    # weight deltas: the codes cross nodes, the kept 16-bit copies fan out inside the node
    gather_inside = C * P if delta and not frozen_bits else gather_wire
    if stage == 0:  # DDP's ring all-reduce over N ranks: 2 (N-1)/N B per rank, M of the N hops cross
        ring = 2 * R * T * (N - 1) / N
        e.inter_bytes, e.intra_bytes = ring * M / N if M > 1 else 0.0, ring * (1 - M / N) if M > 1 else ring
    elif stage == 1:  # reduce-scatter of the gradients, all-gather of the updated rows
        e.intra_bytes, e.inter_bytes = (R + A) * T * inside, (R + A) * T * across
    else:
        e.intra_bytes, e.inter_bytes = gather_inside * inside, gather_wire * across  # forward gather
        if stage == 3:
            # the root is not gathered again in backward; the blocks and a frozen head are
            blocks = 1 - (m.root_params - m.leaf_backward) / P
            if 1 < hpz_group <= L:  # from the secondary shard, inside the node
                e.intra_bytes += gather_plain * blocks * (hpz_group - 1) / hpz_group
            elif hpz_group > L:  # a group of whole nodes: a two-hop gather over H ranks, quantized if qwZ
                # (with weight deltas, as int8 codes of the weights: deltas need the world's gather)
                hop = (1 + 4 / plan.weight_block_elems) * P if delta and not frozen_bits else gather_wire
                e.intra_bytes += hop * blocks * inside
                e.inter_bytes += hop * blocks * (hpz_group // L - 1) / hpz_group
            else:
                e.intra_bytes += gather_inside * blocks * inside
                e.inter_bytes += gather_wire * blocks * across
        if qg:
            e.intra_bytes += b.qg_inside * T * inside
            e.inter_bytes += b.qg_across * T * across
        else:
            e.intra_bytes += R * T * inside
            e.inter_bytes += R * T * across
    # -- time ----------------------------------------------------------------------------------
    if w is not None:
        tokens = w.micro_batch * w.seq_len
        flops = (6 * P if F == 0 else 4 * P + 2 * T) * tokens + (2 * P * tokens if w.activation_checkpointing else 0)
        e.compute_s = flops / (c.tflops * 1e12 * c.mfu)
    link_s = e.inter_bytes * L / c.link + e.intra_bytes / c.intra_link
    e.comm_s = link_s
    if opt_off != "none" or par_off != "none":
        # over PCIe: the gradient shards down once, the parameter shards up (moved_up); the
        # optimizer state stays where it is stepped (on NVMe it is also read and written)
        e.offload_s = stepped_on_host / HOST_BYTES_PER_S + (moved_down + moved_up) / PCIE_BYTES_PER_S
        if e.disk:
            e.offload_s += 2 * e.disk / NVME_BYTES_PER_S
    hidden = max(e.compute_s, link_s) + link_s / max(m.blocks, 1)
    e.step_s = c.overlap * hidden + (1 - c.overlap) * (e.compute_s + link_s) + e.offload_s
    # -- fits? ---------------------------------------------------------------------------------
    problems = []
    if c.gpu_memory and e.gpu_total > GPU_HEADROOM * c.gpu_memory:
        problems.append(f"GPU {e.gpu_total / 2**30:.1f} GiB > {GPU_HEADROOM:.0%} of {c.gpu_memory / 2**30:.0f} GiB")
    if c.host_memory and e.host_total * L > c.host_memory:
        problems.append(f"host {e.host_total * L / 2**30:.1f} GiB per node > {c.host_memory / 2**30:.0f} GiB")
    if e.disk and not c.nvme:
        problems.append("needs an NVMe path (--nvme)")
    e.fits, e.why_not = not problems, "; ".join(problems)
    return e

"""Layer: engine. The host-memory and disk plan of an offloaded run, checked before it starts.

[Note: the memory plan]
ZeRO-Infinity's promise is a model larger than the machine's memory. Whether a given model
fits is decided by a few terms, all known once the model is built (on the meta device is
enough) and the blocks are chosen, before any parameter is allocated:

- what grows with the model and must not stay in memory: the rank's parameter shards
  (``4 P/N`` bytes in fp32), their gradient shards (the same) and the optimizer state
  (``k P/N``, Adam's two fp32 moments: ``k = 8``). In host memory with ``offload_*="cpu"``;
  on NVMe with ``"nvme"``, where the host holds only what is in flight: the groups being
  gathered, prefetched or written back, and ``buffer_count x buffer_bytes`` of optimizer
  staging;
- where the gradient shards of ``offload_param="nvme"`` go, decided here: in host memory
  when the plan with them there fits the budget, on NVMe (written in backward, read back
  by the step) only when it does not ([Note: gradients on NVMe] in offload/params.py).
  A gradient lives from its backward to the next step; sending it through the drive
  costs a write and a read per step, which only pays when memory is what is short;
- what a step needs at once whatever the offload: on a CPU device, the gathered
  parameters and, in backward, the unsharded gradients of the root and of two blocks (the
  one computing and the one being reduced). Which parameters are gathered at once depends
  on the moment, and so does what else is alive ([Note: two moments of a step]);
- the runtime itself (``RUNTIME_BYTES``: Python, torch, Lightning, the process group;
  measured at 540 MB of RSS after the imports on the reference machine, rounded up).

The plan counts bytes in use. The C library's heap can hold more: glibc serves tensors
below its mmap threshold (raised up to 32 MiB as large blocks are freed) from a heap that
a step's temporaries fragment, so the pages a step frees stayed resident and the RSS grew
step after step while the bytes in use did not (measured with glibc's ``mallinfo2``
beside the RSS: docs/pretrained.md, the Llama-3-8B section). A run this plan holds to a
budget therefore gives the heap's free pages back after each optimizer step
(``primitives.trim_heap``, called by ``ZeroEngine._after_offload_step``); what remains is
the heap's slack within one step, which the plan does not price. It does price, on a CPU
device, the gathered codes of int8/int4 frozen weights: FSDP2 keeps a gathered group's
codes beside the weights dequantized from them until the group is resharded, and its flat
all-gather buffer holds one group's codes again until the next group's gather.

Activations depend on the batch, which the strategy does not see when it shards the
model, so they cannot be planned before the start. The plan logs the headroom the
budget leaves for them, and on a CPU device (where activations are host memory; on an
accelerator they are device memory, outside this plan) an ``ActivationMeter`` measures
them at the first training forward: the bytes of the tensors autograd saves for
backward, which is what a micro-batch keeps alive until its backward. The engine adds
them to the plan as a row, logs the total against the budget once, and warns, with the
fix, when they take it over the budget.

[Note: two moments of a step]
The root group is gathered for the whole step. Beside it, on a CPU device:
- while the blocks and a frozen head ([Note: frozen leaves] in wrap.py) compute, forward
  and backward, activations are alive: the computing block and the
  ``FORWARD_PREFETCH_BLOCKS`` it prefetches, or the head beside the one block FSDP2
  prefetches in backward (in forward the last block is resharded before the head runs);
- while a frozen input embedding of a group of its own computes, at the start of forward,
  no activation exists yet, but the root has put the first ``FORWARD_PREFETCH_BLOCKS``
  blocks in flight beside it (its backward gathers nothing).
The rows price the first moment, activations included once they are measured. Where the
second needs more than the first's gathered rows, the plan holds one more row, what the
embedding's moment needs beyond them less the activations, which that moment does not
hold (``EARLY_ROW``; ``MemoryPlan.with_activations`` lowers it). Summing the largest gather
of either moment with all the activations planned 7-17% above a Llama-3-8B LoRA
fine-tune's training peaks in two runs; the two moments plan -2.5% to +7% (docs/pretrained.md).

``plan_memory`` computes the terms per rank; ``MemoryPlan.problems`` compares them with
the budget (``ZeroConfig.host_memory_budget_bytes``, or ``auto``: this machine's available
memory shared by the ranks on it) and the NVMe terms, times the ranks of a node, with the
free space of the drive. The engine checks the plan through ``agree``, so that a run which
cannot fit is refused on every rank, with the numbers and the fix, before any parameter
is allocated ([Note: parameters on NVMe] in offload/params.py for what streams).
"""

from __future__ import annotations

import math
import os
import shutil
import logging
from collections.abc import Callable, Iterable, Sequence
from typing import Any
from dataclasses import dataclass, field, replace

import torch
from torch import nn

from zeropp_strategy.plan import Plan

__all__ = ["ACTIVATIONS_ROW", "ADAM_STATE_BYTES", "EARLY_ROW", "AUTO_FRACTION", "RUNTIME_BYTES", "ActivationMeter", "MemoryPlan",
           "auto_budget_bytes", "check_memory_plan", "plan_memory"]

RUNTIME_BYTES = 768 * 2**20
"""Host memory of one rank before any model state: measured 540 MB RSS (360 MB anonymous)
after importing torch 2.13, Lightning, transformers and this package and joining a gloo
group; rounded up for the autograd threads, gloo's buffers and a data loader."""
ADAM_STATE_BYTES = 8
"""Optimizer state per trainable element assumed by the plan: AdamW's two fp32 moments.
The optimizer is not known when the model is sharded; the offloaded optimizer lays out
its real state when it is adopted."""
AUTO_FRACTION = 0.9
"""``host_memory_budget_bytes="auto"``: this share of the machine's available memory
(``MemAvailable``, or the cgroup's limit less its usage when lower), split evenly between
the ranks on the machine. The rest is for the page cache and the kernel."""
GiB = 2**30
log = logging.getLogger(__name__)
ACTIVATIONS_ROW = "activations of the first training micro-batch (measured: tensors saved for backward)"
EARLY_ROW = ("the input embedding's forward, before any activation: its gather beside the first blocks, beyond the "
             "gathered rows above")


def _meminfo_bytes(key: str) -> int | None:
    try:
        with open("/proc/meminfo", encoding="ascii") as f:
            for line in f:
                if line.startswith(key + ":"):
                    return int(line.split()[1]) * 1024
    except OSError:
        return None
    return None


def _cgroup_free_bytes() -> int | None:
    """Memory left under this process's cgroup v2 limit, or None without a limit."""
    try:
        with open("/sys/fs/cgroup/memory.max", encoding="ascii") as f:
            limit = f.read().strip()
        if limit == "max":
            return None
        with open("/sys/fs/cgroup/memory.current", encoding="ascii") as f:
            return int(limit) - int(f.read().strip())
    except (OSError, ValueError):
        return None


def auto_budget_bytes(ranks_per_node: int) -> tuple[int, str]:
    """``AUTO_FRACTION`` of this machine's available memory over ``ranks_per_node``, and
    a sentence saying where the number came from."""
    available = _meminfo_bytes("MemAvailable")
    source = "MemAvailable"
    cgroup = _cgroup_free_bytes()
    if cgroup is not None and (available is None or cgroup < available):
        available, source = cgroup, "the cgroup's memory.max less memory.current"
    if available is None:  # not Linux: the total physical memory
        available = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
        source = "physical memory"
    budget = int(available * AUTO_FRACTION) // max(1, ranks_per_node)
    return budget, (f"auto: {AUTO_FRACTION:.0%} of {source} ({available / GiB:.1f} GiB) / {ranks_per_node} "
                    "rank(s) on this machine")


@dataclass(frozen=True)
class MemoryPlan:
    """Per-rank host memory (``host``) and per-node disk (``disk``) of one offloaded model.

    ``host`` and ``disk`` are ``(what, bytes)`` rows; ``disk_free`` maps each swap
    directory to its drive's free bytes; ``ranks_per_node`` ranks share those drives."""

    budget_bytes: int
    budget_source: str
    host: tuple[tuple[str, int], ...]
    disk: tuple[tuple[str, str, int], ...]  # (what, directory, bytes per rank)
    disk_free: dict[str, int] = field(default_factory=dict)
    ranks_per_node: int = 1
    params: int = 0
    grads_on_nvme: bool = False
    """``offload_param="nvme"``: whether the gradient shards go to NVMe too (the plan with
    them in host memory did not fit the budget), or stay in host memory."""

    @property
    def host_bytes(self) -> int:
        return sum(n for _, n in self.host)

    def disk_bytes(self, directory: str | None = None) -> int:
        """Bytes per rank on the drives (one directory's, or all)."""
        return sum(n for _, d, n in self.disk if directory is None or d == directory)

    def disk_traffic_per_step(self) -> tuple[int, int]:
        """Bytes one rank reads and writes on the drives per optimizer step, when nothing
        stays in the page cache between uses (a model several times the memory):
        parameter shards read by the forward gathers, again by the backward gathers and by
        the step, and written by the step; gradient shards written in backward and read by
        the step; the optimizer state read and written by the step."""
        rows = {what: n for what, _, n in self.disk}
        params, grads = rows.get("parameter shards", 0), rows.get("gradient shards", 0)
        state = rows.get("optimizer state, AdamW", 0)
        return 3 * params + grads + state, params + grads + state

    def problems(self) -> list[str]:
        """What does not fit, each with the numbers and a fix; empty when the plan fits."""
        out = []
        if self.host_bytes > self.budget_bytes:
            out.append(
                f"host memory: this rank needs {self.host_bytes / GiB:.2f} GiB for model states and staging, over "
                f"its budget of {self.budget_bytes / GiB:.2f} GiB ({self.budget_source}). Fix: "
                + self._host_fix())
        for directory, free in self.disk_free.items():
            need = self.disk_bytes(directory) * self.ranks_per_node
            if need > free:
                out.append(
                    f"disk: not enough space for the swap files under {directory}: they need {need / GiB:.2f} GiB "
                    f"({self.ranks_per_node} rank(s) x {self.disk_bytes(directory) / GiB:.2f} GiB), and the drive has "
                    f"{free / GiB:.2f} GiB free. "
                    "Fix: free space, point nvme_path at a larger drive, or use more nodes (each rank's share "
                    "falls with the world size)")
        return out

    def _host_fix(self) -> str:
        big = [w.split(" (")[0] for w, n in self.host if "(in memory)" in w and n > self.budget_bytes // 4]
        if big:
            return (f"move the {big[0]} to NVMe (offload_param / offload_optimizer device='nvme'), use more ranks or "
                    "nodes, or raise host_memory_budget_bytes if the machine has the memory")
        return ("use more ranks or nodes, choose smaller blocks (wrap_modules), lower the offload buffer_count or "
                "buffer_bytes, or raise host_memory_budget_bytes if the machine has the memory")

    def with_activations(self, nbytes: int) -> MemoryPlan:
        """This plan with the activations measured by an ``ActivationMeter`` as a host row;
        the input embedding's moment, which holds none of them, then needs ``nbytes`` less
        beyond the other rows ([Note: two moments of a step])."""
        early = sum(n for what, n in self.host if what == EARLY_ROW)
        host = [row for row in self.host if row[0] != EARLY_ROW] + [(ACTIVATIONS_ROW, nbytes)]
        if early > nbytes:
            host.append((EARLY_ROW, early - nbytes))
        return replace(self, host=tuple(host))

    def describe(self) -> str:
        """The plan as the lines logged once at start."""
        lines = [f"zeropp memory plan for {self.params / 1e9:.2f}B parameters, per rank "
                 f"(budget {self.budget_bytes / GiB:.2f} GiB, {self.budget_source}):"]
        lines += [f"  host  {n / GiB:8.2f} GiB  {what}" for what, n in self.host]
        lines.append(f"  host  {self.host_bytes / GiB:8.2f} GiB  total; {(self.budget_bytes - self.host_bytes) / GiB:.2f} "
                     "GiB of the budget left for activations")
        lines += [f"  disk  {n / GiB:8.2f} GiB  {what} in {d}" for what, d, n in self.disk]
        for directory, free in self.disk_free.items():
            lines.append(f"  disk  {self.disk_bytes(directory) * self.ranks_per_node / GiB:8.2f} GiB  needed on the "
                         f"drive of {directory} by {self.ranks_per_node} rank(s), {free / GiB:.2f} GiB free")
        return "\n".join(lines)


def _elems(params: Iterable[nn.Parameter]) -> int:
    return sum(p.numel() for p in params)


def _stored_bytes(root: nn.Module, plan: Plan, esize: int) -> tuple[Callable[[nn.Parameter], int], set[int]]:
    """``(stored, quantized)``: ``stored(p)``, the bytes of a parameter's shard on this rank
    (``esize`` per element, or for a frozen weight that the plan stores as int8/int4,
    ``plan.frozen_weight_bits``, engine/frozen.py's candidates, its codes and fp32 block
    scales), and the ids of those quantized weights."""
    from zeropp_strategy.engine.frozen import code_bytes_per_row, frozen_int8_candidates

    world = plan.world_size
    quantized: set[int] = set()
    if plan.frozen_weight_bits:
        quantized = {id(p) for _, _, _, p in frozen_int8_candidates(root, shard_world_size=world,
                                                                    min_elems=plan.quantize_min_elems)[0]}

    def stored(p: nn.Parameter) -> int:
        if id(p) not in quantized:
            return _shard_elems([p], world) * esize
        rows = math.ceil(p.shape[0] / world)
        cols = p.numel() // max(1, p.shape[0])
        scales = math.ceil(cols / plan.weight_block_elems)
        return rows * (code_bytes_per_row(cols, plan.frozen_weight_bits) + 4 * scales)

    return stored, quantized


def _shard_elems(params: Iterable[nn.Parameter], world: int) -> int:
    """Elements of this rank's padded shards (FSDP2 pads dim 0 to a multiple of ``world``)."""
    total = 0
    for p in params:
        if p.dim() == 0:
            total += 1  # replicated
        else:
            total += math.ceil(p.shape[0] / world) * (p.numel() // max(1, p.shape[0]))
    return total


def plan_memory(root: nn.Module, blocks: list[nn.Module], plan: Plan, *, ranks_per_node: int,
                device: torch.device, gather_bytes: int, leaves: Sequence[nn.Module] = ()) -> MemoryPlan:
    """The memory plan of ``root`` sharded at stage 3 over ``plan.world_size`` ranks into
    ``blocks``, frozen ``leaves`` ([Note: frozen leaves] in wrap.py) and the root group (see
    [Note: the memory plan]), as ``plan`` (``zeropp_strategy.plan.resolve``) decided its
    offload, frozen weights and budget; ``ranks_per_node`` share this machine's memory;
    ``gather_bytes`` per element of a gathered parameter."""
    from zeropp_strategy.engine.fsdp import FORWARD_PREFETCH_BLOCKS
    from zeropp_strategy.engine.wrap import gathered_in_backward

    n = plan.world_size
    params = list(root.parameters())
    block_params = [list(b.parameters()) for b in blocks]
    heads = [leaf for leaf in leaves if gathered_in_backward(leaf)]
    embeds = [leaf for leaf in leaves if not gathered_in_backward(leaf)]
    embed_full = max((_elems(leaf.parameters()) for leaf in embeds), default=0)
    head_full = max((_elems(leaf.parameters()) for leaf in heads), default=0)
    in_blocks = {id(p) for ps in block_params for p in ps} | {id(p) for leaf in leaves for p in leaf.parameters()}
    root_params = [p for p in params if id(p) not in in_blocks]
    esize = max((p.element_size() for p in params), default=4)
    stored, quantized = _stored_bytes(root, plan, esize)
    shard = sum(stored(p) for p in params)
    trainable_shard = _shard_elems([p for p in params if p.requires_grad], n) * esize
    block_full = max((_elems(ps) for ps in block_params), default=0)
    block_shard = max((sum(stored(p) for p in ps) for ps in block_params), default=0)
    root_full = _elems(root_params)
    # int8/int4 frozen weights: each gathered group keeps every rank's codes beside the weights
    # dequantized from them until it is resharded, and FSDP2's flat all-gather buffer holds
    # one group's codes again until the next group's gather
    def codes(ps: Iterable[nn.Parameter]) -> int:
        return sum(stored(p) for p in ps if id(p) in quantized)

    block_codes = max((codes(ps) for ps in block_params), default=0)
    embed_codes = max((codes(leaf.parameters()) for leaf in embeds), default=0)
    head_codes = max((codes(leaf.parameters()) for leaf in heads), default=0)
    root_codes = codes(root_params)
    # gradients exist for trainable parameters only (LoRA on a frozen base: the adapters)
    block_trainable = max((_elems(p for p in ps if p.requires_grad) for ps in block_params), default=0)
    root_trainable = _elems(p for p in root_params if p.requires_grad)
    in_flight = 1 + FORWARD_PREFETCH_BLOCKS  # groups whose shard pages are mapped at once
    pdev, odev = plan.offload_param, plan.offload_optimizer

    budget = plan.host_memory_budget_bytes
    if budget == "auto":
        budget_bytes, source = auto_budget_bytes(ranks_per_node)
    else:
        budget_bytes, source = int(budget), "ZeroConfig.host_memory_budget_bytes"

    def rows(grads_on_nvme: bool) -> tuple[list[tuple[str, int]], list[tuple[str, str, int]]]:
        host: list[tuple[str, int]] = [("runtime (Python, torch, the process group)", RUNTIME_BYTES)]
        disk: list[tuple[str, str, int]] = []
        if pdev == "nvme":
            from zeropp_strategy.offload.params import WRITE_BEHIND_LIMIT_BYTES

            path = plan.offload_param_settings.nvme_path
            host.append(("parameter shards on NVMe: pages of the groups in flight", in_flight * block_shard))
            disk.append(("parameter shards", path, shard))
            if grads_on_nvme:
                host.append(("gradient shards on NVMe: the group being reduced", 2 * block_shard))
                disk.append(("gradient shards", path, trainable_shard))
            else:
                host.append(("gradient shards (in memory: the budget has room for them)", trainable_shard))
            queued = shard + (trainable_shard if grads_on_nvme else 0)
            host.append(("pages queued for write-behind", min(WRITE_BEHIND_LIMIT_BYTES, queued)))
        elif pdev == "cpu" or device.type == "cpu":  # "none" on a CPU device: host memory either way
            host.append(("parameter shards (in memory)", shard))
            host.append(("gradient shards (in memory)", trainable_shard))
        opt_state = trainable_shard // esize * ADAM_STATE_BYTES
        if odev == "nvme":
            o = plan.offload_optimizer_settings
            host.append(("optimizer state on NVMe: staging buffers", o.buffer_count * o.buffer_bytes))
            disk.append(("optimizer state, AdamW", o.nvme_path, opt_state))
        elif odev == "cpu" or device.type == "cpu":
            host.append(("optimizer state, AdamW (in memory)", opt_state))
        if device.type == "cpu":  # the device is the host: what a step computes with lives here too
            # [Note: two moments of a step]
            blocks_full, blocks_codes = in_flight * block_full, in_flight * block_codes
            with_head = head_full + block_full
            what = (f"the root group + {in_flight} blocks" if blocks_full >= with_head else
                    "the root group + its frozen head + the block prefetched in backward")
            gathered = (root_full + max(blocks_full, with_head)) * gather_bytes
            # codes: the same groups' codes; plus one group's again in the flat all-gather buffer
            buffer = max(block_codes, head_codes, root_codes)  # the embedding's were replaced by then
            held = n * (root_codes + max(blocks_codes, head_codes + block_codes) + buffer)
            held = held if held > n * buffer else 0  # no codes of those groups: no row
            grads = (root_trainable + 2 * block_trainable) * (esize + gather_bytes)
            host.append((f"gathered parameters: {what}", gathered))
            if held:
                host.append(("gathered int8/int4 codes of those groups, and one group's in the all-gather buffer",
                             held))
            host.append(("unsharded gradients in backward: the root group + 2 blocks", grads))
            prefetched = in_flight - 1  # the blocks the root's forward puts in flight beside the embedding
            early = ((root_full + embed_full + prefetched * block_full) * gather_bytes + n * (
                root_codes + embed_codes + prefetched * block_codes + max(buffer, embed_codes))) if embeds else 0
            if early > gathered + held + grads:
                host.append((EARLY_ROW, early - gathered - held - grads))
        return host, disk

    host, disk = rows(grads_on_nvme=False)
    grads_on_nvme = pdev == "nvme" and sum(n for _, n in host) > budget_bytes
    if grads_on_nvme:
        host, disk = rows(grads_on_nvme=True)
    free: dict[str, int] = {}
    for _, directory, _ in disk:
        if directory not in free:
            try:
                free[directory] = shutil.disk_usage(directory).free
            except OSError:
                pass  # a missing directory is reported by the swap files' own check
    return MemoryPlan(budget_bytes=budget_bytes, budget_source=source, host=tuple(host), disk=tuple(disk),
                      disk_free=free, ranks_per_node=ranks_per_node, params=_elems(params),
                      grads_on_nvme=grads_on_nvme)


def saved_storage_bytes(t: torch.Tensor, seen: set[Any], *, device_type: str | None = None) -> int:
    """What a tensor autograd saves for backward adds to the activations: its storage's bytes
    the first time that storage is seen (``seen`` collects them), and 0 for parameters,
    leaves requiring grad and views of either (the plan counts those elsewhere), for a storage
    seen already, and with ``device_type`` for a tensor elsewhere. The one rule of both the
    measured activations (``ActivationMeter``) and the traced ones (``estimate.trace_activations``,
    on fake tensors)."""
    from torch.multiprocessing.reductions import StorageWeakRef

    base = t._base if t._base is not None else t
    if device_type is not None and t.device.type != device_type:
        return 0
    if isinstance(base, nn.Parameter) or (base.is_leaf and base.requires_grad):
        return 0
    key = StorageWeakRef(t.untyped_storage())
    if key in seen:
        return 0
    seen.add(key)
    return t.untyped_storage().nbytes()


class ActivationMeter:
    """Measures the activations of ``root``'s first forward with gradients enabled.

    While that forward runs, a ``saved_tensors_hooks`` pack hook sees every tensor autograd
    keeps for backward and counts each host storage once. Parameters, frozen ones included
    (a frozen linear layer keeps its weight for the input's gradient), and views of them such
    as a linear layer's transposed weight, are left out: the plan has them already, and at
    stage 3 the gathered copy a forward saves is resharded until backward gathers it again.
    Leaves requiring grad are left out too. Regions under activation checkpointing install
    their own hooks and are not kept, so they are not counted either. A forward without gradients (a
    validation sanity check) is skipped. The hooks go away after the measured forward;
    ``on_measured(nbytes)`` then runs once."""

    def __init__(self, root: nn.Module, on_measured: Callable[[int], None]) -> None:
        self._on_measured = on_measured
        self._hooks: Any = None
        self._seen: set[Any] = set()  # the storages counted (saved_storage_bytes)
        self.nbytes = 0
        self._pre = root.register_forward_pre_hook(self._start)
        self._post = root.register_forward_hook(self._stop, always_call=True)

    def _pack(self, t: torch.Tensor) -> torch.Tensor:
        self.nbytes += saved_storage_bytes(t, self._seen, device_type="cpu")  # host memory is what it plans
        return t

    def _start(self, module: nn.Module, args: Any) -> None:
        if self._hooks is None and torch.is_grad_enabled():
            self._hooks = torch.autograd.graph.saved_tensors_hooks(self._pack, lambda t: t)
            self._hooks.__enter__()

    def _stop(self, module: nn.Module, args: Any, output: Any) -> None:
        if self._hooks is None:
            return
        self._hooks.__exit__(None, None, None)
        self._hooks = None
        self._seen.clear()
        self.remove()
        self._on_measured(self.nbytes)

    def remove(self) -> None:
        self._pre.remove()
        self._post.remove()


def _measured(engine: Any, planned: MemoryPlan, nbytes: int) -> None:
    """``ActivationMeter``'s report for the model ``planned`` was made for: the plan gains the
    row (kept as ``engine.memory_plan`` while that is still this model's); one line, or a
    warning over budget."""
    plan = planned.with_activations(nbytes)
    if engine.memory_plan is planned:
        engine.memory_plan = plan
    line = (f"zeropp memory plan: activations of the first training micro-batch {nbytes / GiB:.2f} GiB (tensors "
            f"saved for backward, measured); this rank's host total is {plan.host_bytes / GiB:.2f} GiB of its "
            f"{plan.budget_bytes / GiB:.2f} GiB budget")
    if plan.host_bytes <= plan.budget_bytes:
        engine.info(line)
    elif engine.rank == 0:
        log.warning(line + ", over it: the run may be killed for memory. Fix: a smaller micro-batch, "
                    "ZeroConfig(activation_checkpointing=True), more ranks, or a larger host_memory_budget_bytes if "
                    "the machine has the memory")


def check_memory_plan(engine: Any, root: nn.Module) -> MemoryPlan | None:
    """For ``engine`` (a ``ZeroEngine``), with offload and a ``host_memory_budget_bytes``:
    the plan of what this rank's host memory and the swap drives must hold, logged once; a
    plan that does not fit is refused on every rank, through ``engine.agree``, before any
    shard is allocated ([Note: the memory plan])."""
    decided = engine.plan
    if decided.host_memory_budget_bytes is None or decided.stage != 3 or (
            decided.offload_param == "none" and decided.offload_optimizer == "none"):
        return None
    from zeropp_strategy.engine.wrap import frozen_leaves, select_blocks

    blocks = select_blocks(root, wrap_modules=decided.wrap_modules, wrap_min_params=decided.wrap_min_params)
    leaves = frozen_leaves(root, blocks, min_params=decided.wrap_min_params)
    gather_dtype = engine.precision.mp_policy(gather_16bit=decided.gather_16bit).param_dtype
    local_ranks = engine.world_size if engine.topology.simulated else engine.topology.ranks_per_node  # this machine
    plan = plan_memory(root, blocks, decided, ranks_per_node=local_ranks, device=engine.device,
                       gather_bytes=gather_dtype.itemsize if gather_dtype else 4, leaves=leaves)
    engine.info(plan.describe())

    def refuse() -> None:
        problems = plan.problems()
        if problems:
            raise ValueError("ZeroConfig.host_memory_budget_bytes: this run cannot fit, so it was refused before "
                             "allocating anything:\n  - " + "\n  - ".join(problems) + "\n" + plan.describe())

    engine.agree("checking the memory plan", refuse)
    if engine.device.type == "cpu":  # activations are host memory too: measured at the first step
        ActivationMeter(root, lambda nbytes: _measured(engine, plan, nbytes))
    return plan

"""Layer: engine. ``ZeroEngine``: the ZeRO machinery every front-end shares.

The Lightning strategy, the Fabric strategy and ``ZeroPPAccelerator`` differ in how a
user hands them a model and an optimizer and in their hooks; what they do to those
objects is the same and lives here, once:

- built by ``ZeroSession.start`` from the resolved ``Plan``, with the topology, meshes,
  ledger and bound precision policy it made (the engine never sees the ``ZeroConfig``);
- ``prepare_stage1`` + ``wrap_ddp``: stage 1 materializes the module and wraps it in DDP
  (all-reduce booked by a ledger hook); ``shard`` + ``module_to_device``: stages 2/3 apply
  FSDP2 with our comm objects (``engine.fsdp.shard_module``), plus NVMe parameter offload
  (``offload.params.ParamStore``) where configured;
- ``wrap_optimizer``: stage 1's ``ShardedOptimizer``, then ``OffloadOptimizer`` where
  configured, else at stages 2/3 ``LocalStepOptimizer`` (the step on the local shards,
  engine/local_step.py); ``remap_optimizer`` first re-points an optimizer built before
  sharding at the sharded parameters (by name);
- ``no_sync`` and ``reduce_replicated_grads`` around backward, ``agree`` for rank-local
  steps that may fail.
"""

from __future__ import annotations

import logging
import shutil
from collections.abc import Callable, Generator
from contextlib import contextmanager
from typing import Any

import torch
from torch import nn
from torch.nn.parallel import DistributedDataParallel
from torch.optim import Optimizer

from zeropp_strategy.comm.collectives import all_reduce
from zeropp_strategy.comm.comm_thread import BackwardDeferral, CommThread, ThreadGroups
from zeropp_strategy.comm.hierarchical import NodeGroups
from zeropp_strategy.comm.ledger import CommKind, CommLedger
from zeropp_strategy.engine.local_step import LocalStepOptimizer, steps_locally
from zeropp_strategy.engine.remap import remap_optimizer
from zeropp_strategy.engine.memory_plan import MemoryPlan, check_memory_plan
from zeropp_strategy.engine.fsdp import ShardedRoot, replicated_params, shard_module
from zeropp_strategy.engine.fsdp_groups import fsdp_modules
from zeropp_strategy.engine.materialize import materialize, to_empty_keeping_ties
from zeropp_strategy.engine.grad_reads import watch_reads
from zeropp_strategy.engine.meta_init import RANK0_VALUES_ATTR
from zeropp_strategy.engine.guards import agree, broadcast_module, unwrap
from zeropp_strategy.engine.precision import PrecisionPolicy
from zeropp_strategy.engine.stage1 import ShardedOptimizer
from zeropp_strategy.engine.stage1_reduce import PartitionedReduce, partitioned_reduce_hook
from zeropp_strategy.engine.watchdog import PeerWatchdog
from zeropp_strategy.plan import Plan
from zeropp_strategy.primitives import trim_heap
from zeropp_strategy.topology import Meshes, Topology

log = logging.getLogger(__name__)


class ZeroEngine:
    """Applies a ``Plan`` to modules and optimizers on this rank (see module docstring)."""

    def __init__(
        self,
        plan: Plan,
        *,
        topology: Topology,
        meshes: Meshes,
        ledger: CommLedger,
        precision: PrecisionPolicy,
        device: torch.device,
        info: Callable[[str], None] = log.info,
    ) -> None:
        # Every sentinel of the config, decided once for this job by the session (plan.resolve);
        # the plan's notes are said once each.
        self.plan = plan
        self._noted: set[str] = set()
        self.topology = topology
        self.meshes = meshes
        self.ledger = ledger
        self.precision = precision
        self.device = device
        self.info = info  # rank-zero logging of the front-end
        self.param_stores: list[Any] = []  # offload_param="nvme", one per sharded model
        self.memory_plan: MemoryPlan | None = None  # the last model's, when offloaded with a budget
        # Modules set up by prepare_module, for re-pointing optimizers built before it:
        self._names_before: dict[int, str] = {}  # id(param before) -> "<module index>.<name>"
        self._params_after: dict[str, nn.Parameter] = {}  # "<module index>.<name>" -> param now
        self._prepared = 0
        self.watchdog: PeerWatchdog | None = None  # set by ZeroSession.start; see [Note: peer watchdog]
        self.nodes = NodeGroups(topology, intra_group=meshes.intra_group, inter_group=meshes.inter_group)
        # Gradient reduces run on a thread with groups of its own ([Note: comm thread]), made by
        # the first model set up and shared by every model of this engine (one order of jobs).
        self._comm_thread: CommThread | None = None
        self._thread_groups: ThreadGroups | None = None
        self._deferral: BackwardDeferral | None = None

    @property
    def stage(self) -> int:
        return self.plan.stage

    @property
    def rank(self) -> int:
        return self.topology.rank

    @property
    def world_size(self) -> int:
        return self.topology.world_size

    # -- models -------------------------------------------------------------------------------

    @property
    def hpz_partition_size(self) -> int:
        """Effective hpZ group size: 1 when off or when it cannot help (one group = all ranks)."""
        return self.plan.hpz_group

    def _note(self, feature: str) -> None:
        """Say the plan's note about ``feature`` ("hpZ", "qwZ", "qgZ"), once per engine."""
        for note in self.plan.notes:
            if note.startswith(f"zeropp: {feature} ") and note not in self._noted:
                self._noted.add(note)
                self.info(note)

    def reshard_after_forward(self) -> bool | int:
        """Stage 2 keeps gathered params through backward; stage 3 frees them, or with hpZ
        keeps an intra-node secondary shard (FSDP2's integer reshard_after_forward)."""
        self._note("hpZ")
        return self.plan.reshard_after_forward

    def comm_factories(self) -> tuple[Any, Any]:
        """Factories for qwZ / qgZ comm objects (None: the plain ledger collectives), as the
        plan decided for this topology (asked for on one node, they log why they are off)."""
        from zeropp_strategy.comm.feedback import INTRA_FEEDBACK, ErrorFeedback
        from zeropp_strategy.comm.zeropp import (
            HierarchicalQuantReduceScatter,
            QuantizedAllGather,
            WeightDeltas,
        )

        plan, topo = self.plan, self.topology
        all_gather: Any = None
        reduce_scatter: Any = None
        self._note("qwZ")  # the plan has a note only for a feature asked for and off here
        if self.plan.quantized_weights:

            def quantized_gather() -> QuantizedAllGather:
                return QuantizedAllGather(
                    self.ledger, topo, block_elems=plan.weight_block_elems, min_elems=plan.quantize_min_elems,
                    nodes=self.nodes, bits=plan.weight_bits,
                    deltas=WeightDeltas(layout=(topo.num_nodes, topo.ranks_per_node)) if plan.weight_delta else None,
                    scale_bits=plan.cross_node_scale_bits,
                )

            all_gather = quantized_gather

        self._note("qgZ")
        if self.plan.quantized_gradients:

            def quantized_reduce_scatter() -> HierarchicalQuantReduceScatter:
                return HierarchicalQuantReduceScatter(
                    self.ledger,
                    topo,
                    intra_group=self.meshes.intra_group,
                    inter_group=self.meshes.inter_group,
                    bits=plan.gradient_bits,
                    block_elems=plan.gradient_block_elems,
                    min_elems=plan.quantize_min_elems,
                    nodes=self.nodes,
                    deferral=self.deferral(),
                    intra_bits=plan.gradient_bits_inside,
                    wire_dtype=self.reduce_dtype(),
                    feedback=ErrorFeedback(beta=plan.error_beta, reset_steps=plan.error_reset_steps,
                                           layout=(topo.num_nodes, topo.ranks_per_node))
                    if self.plan.error_feedback else None,
                    intra_feedback=ErrorFeedback(beta=plan.error_beta, reset_steps=plan.error_reset_steps,
                                                 layout=(topo.num_nodes, topo.ranks_per_node), stored_bits=8,
                                                 block_elems=plan.gradient_block_elems, name=INTRA_FEEDBACK)
                    if self.plan.error_feedback_intra else None,
                    scale_bits=plan.cross_node_scale_bits,
                )

            reduce_scatter = quantized_reduce_scatter

        return all_gather, reduce_scatter

    def comm_thread(self) -> tuple[CommThread, ThreadGroups]:
        """The comm thread and its process groups; created by the first call, which is
        collective: every rank sets up the same models in the same order."""
        if self._comm_thread is None or self._thread_groups is None:
            self._thread_groups = ThreadGroups.create(self.topology)
            self._comm_thread = CommThread()
        return self._comm_thread, self._thread_groups

    def stop_comm_thread(self) -> None:
        """Let the comm thread finish its queued jobs and stop; its groups stay (a later
        job starts the thread again; the groups go at exit: [Note: orderly exit])."""
        if self._comm_thread is not None:
            self._comm_thread.close()

    def deferral(self) -> BackwardDeferral | None:
        """Stages 2/3 on the host: reduce-scatters finish at the end of backward ([Note:
        deferred reduce-scatter]). None on accelerators, where FSDP2's streams overlap them."""
        if self.device.type != "cpu" or self.world_size == 1:
            return None
        if self._deferral is None:
            self._deferral = BackwardDeferral(*self.comm_thread())
        return self._deferral

    def reduce_dtype(self) -> torch.dtype | None:
        """The gradient reduce's dtype from ``ZeroConfig.reduce_dtype`` (None: the precision's own)."""
        return REDUCE_DTYPES[self.plan.reduce_dtype] if self.plan.reduce_dtype is not None else None

    def wrap_ddp(self, module: nn.Module, *, grad_read_advice: str | None = None) -> DistributedDataParallel:
        """Stage 1: DDP whose gradient buckets are reduce-scattered by rows ([Note: stage-1
        partitioned reduce]) and booked in the ledger. With ``grad_read_advice`` (the
        front-end's fix), user reads of ``p.grad`` after a sync backward warn once
        ([Note: stage-1 gradient reads])."""
        device_ids = None if self.device.type == "cpu" else [self.device.index]
        # gradient_as_bucket_view: grads live in DDP's buckets instead of beside them
        # (saves g*P bytes per rank); ShardedOptimizer's shard grads are views of those.
        ddp = DistributedDataParallel(
            module,
            device_ids=device_ids,
            bucket_cap_mb=self.plan.reduce_bucket_bytes / 2**20,
            process_group=self.meshes.world.get_group(),
            gradient_as_bucket_view=True,
        )
        # DDP broadcast rank 0's parameters and buffers at construction: book it.
        state_bytes = sum(t.numel() * t.element_size() for t in module.state_dict().values())
        self.ledger.record_broadcast(CommKind.OTHER, state_bytes, 0, list(range(self.world_size)))
        thread, groups = self.comm_thread()
        watch = watch_reads(module, grad_read_advice) if grad_read_advice else None
        state = PartitionedReduce(self.ledger, groups, rank=self.rank, world=self.world_size,
                                  wire_dtype=self.reduce_dtype(), thread=thread, watch=watch)
        ddp.register_comm_hook(state, partitioned_reduce_hook)
        return ddp

    def shard(self, root: nn.Module) -> list[nn.Module]:
        """Stages 2/3: FSDP2 on ``root`` (in place) with our comm objects; NVMe params mapped."""
        plan = self.check_memory_plan(root)
        all_gather, reduce_scatter = self.comm_factories()
        blocks = shard_module(
            root,
            self.plan,
            mesh=self.meshes.world,
            ledger=self.ledger,
            mp_policy=self.precision.mp_policy(gather_16bit=self.plan.gather_16bit),
            device=self.device,
            nodes=self.nodes,
            wire_dtype=self.reduce_dtype(),
            deferral=self.deferral(),
            reshard_after_forward=self.reshard_after_forward(),
            all_gather=all_gather,
            reduce_scatter=reduce_scatter,
        )
        model = root.module if isinstance(root, ShardedRoot) else root
        what = f"parameter shards and gradients of {type(model).__name__}"
        if self.plan.offload_param == "nvme":
            from zeropp_strategy.offload.params import ParamStore

            # Gradients follow the plan: on NVMe only when host memory has no room for them
            # ([Note: gradients on NVMe]); without a budget there is no plan, and they go too.
            grads_on_nvme = plan is None or plan.grads_on_nvme
            store = self.agree(
                "mapping parameter shards to NVMe",
                lambda: ParamStore(root, self.plan.offload_param_settings, rank=self.rank,
                                   grads_on_nvme=grads_on_nvme),
            )
            self.agree("initializing parameter shards on NVMe",
                       lambda: materialize(root, torch.device("cpu"), store=store))
            self.param_stores.append(store)
            if not grads_on_nvme:
                what = (f"parameter shards of {type(model).__name__} (their gradients stay in host memory: the memory "
                        "plan has room for them)")
            self.log_offload("offload_param", what, store.swap_dir)
        elif self.plan.offload_param == "cpu":
            self.log_offload("offload_param", what)
        return blocks

    def check_memory_plan(self, root: nn.Module) -> MemoryPlan | None:
        """``memory_plan.check_memory_plan`` for this engine ([Note: the memory plan]): ``root``'s
        plan, or None when no plan applies; the last plan made is kept in ``memory_plan``."""
        plan = check_memory_plan(self, root)
        self.memory_plan = plan or self.memory_plan
        return plan

    def log_offload(self, field: str, what: str, swap_dir: str | None = None) -> None:
        """One line at INFO on rank 0 (``self.info``, as the topology) per offloaded model or
        optimizer: ``what`` is offloaded and where; for NVMe, the swap directory (this
        rank's own subdirectory of ``nvme_path``, removed at the end of the run) and the
        free space on its drive."""
        offload = getattr(self.plan, f"{field}_settings")
        if offload.device == "nvme" and swap_dir is not None:
            free = shutil.disk_usage(swap_dir).free
            where = (f"NVMe swap files in {swap_dir} (one such subdirectory of nvme_path={offload.nvme_path!r} per "
                     f"rank; {free / 2**30:.1f} GiB free on that drive)")
        else:
            where = "host memory (CPU)"
        self.info(f"zeropp: {field}={offload.device!r}: {what} -> {where}")

    def module_to_device(self, module: nn.Module) -> None:
        """Move to the device, except parameter shards that offload keeps on the host."""
        if self.stage == 3 and self.plan.offload_param != "none" and fsdp_modules(module):
            for m in module.modules():  # FSDP2 keeps sharded params on the host; buffers go
                for name, buf in m._buffers.items():
                    if buf is not None:
                        m._buffers[name] = buf.to(self.device)
            return
        module.to(self.device)

    def prepare_module(self, module: nn.Module, *, train: bool = True, checkpoint: bool | None = None,
                       grad_read_advice: str | None = None) -> nn.Module:
        """A user's module set up for its stage, for the front-ends that hand over modules one
        at a time (Fabric, Accelerate). Stage 1: materialized, activation checkpointing if
        configured (``train``), DDP, except a module with nothing to train (or ``train=False``),
        which DDP would refuse: it gets rank 0's values instead. Stages 2/3: sharded in place
        and placed. The parameters' names are remembered for ``adopt_optimizer``.
        ``grad_read_advice``: see ``wrap_ddp``."""
        index = self._prepared
        self._prepared += 1
        self._names_before.update({id(p): f"{index}.{n}" for n, p in module.named_parameters(remove_duplicate=False)})
        if self.stage == 1:
            module = self.prepare_stage1(module, checkpoint=train if checkpoint is None else checkpoint)
            if train and any(p.requires_grad for p in module.parameters()):
                module = self.wrap_ddp(module, grad_read_advice=grad_read_advice)
            else:
                broadcast_module(module, ledger=self.ledger)
        else:
            module = self.precision.convert_module(module)
            self.shard(module)
            self.module_to_device(module)
        self._params_after.update(
            {f"{index}.{n}": p for n, p in unwrap(module).named_parameters(remove_duplicate=False)})
        return module

    def adopt_optimizer(self, optimizer: Optimizer, *, fix: str) -> Optimizer:
        """An optimizer over the parameters of modules set up by ``prepare_module`` (before or
        after that call): re-pointed at the parameters now, by name, then wrapped."""
        self.remap_optimizer(optimizer, self._names_before, self._params_after, fix=fix)
        return self.wrap_optimizer(optimizer)

    def forget_modules(self) -> None:
        """Drop the references ``prepare_module`` keeps (with ``free_memory``)."""
        self._names_before.clear()
        self._params_after.clear()

    def prepare_stage1(self, module: nn.Module, *, checkpoint: bool = False) -> nn.Module:
        """Stage 1 before DDP: meta tensors materialized, precision applied, on the device;
        with ``checkpoint``, activation checkpointing on the selected blocks when the
        config asks for it. A model read on rank 0 only ([Note: stage-1 load on rank 0] in
        engine/meta_init.py) is allocated empty here: the broadcast of rank 0's values that
        follows (DDP's construction, or ``broadcast_module``) fills it."""
        marked = [m for m in module.modules() if getattr(m, RANK0_VALUES_ATTR, False)]
        to_empty_keeping_ties(marked, self.device)  # one pass: a weight tied across them stays tied
        materialize(module, self.device)
        module = self.precision.convert_module(module)
        module.to(self.device)
        if checkpoint and self.plan.activation_checkpointing:
            from zeropp_strategy.engine.wrap import apply_activation_checkpointing, select_blocks

            apply_activation_checkpointing(select_blocks(
                module, wrap_modules=self.plan.wrap_modules, wrap_min_params=self.plan.wrap_min_params))
        return module

    # -- optimizers ---------------------------------------------------------------------------

    def wrap_optimizer(self, optimizer: Optimizer) -> Optimizer:
        """Stage 1's sharded state, then host offload, as the config asks; without offload at
        stages 2/3, the step on local shards ([Note: the step on local shards]). Idempotent."""
        if self.stage == 1 and not isinstance(optimizer, ShardedOptimizer):
            optimizer = ShardedOptimizer(
                optimizer, self.meshes.world, self.ledger, allgather_bucket_bytes=self.plan.allgather_bucket_bytes,
                nodes=self.nodes, overlap_param_gather=self.plan.overlap_param_gather,
            )
        release = self._release_params
        if self.plan.offload_optimizer != "none":
            return self.agree("building the offloaded optimizer", lambda: self._offload(optimizer))
        if isinstance(optimizer, LocalStepOptimizer):
            return optimizer
        if self.param_stores:
            # The user's optimizer steps the mapped shards in place; drop their pages after.
            params = [p for g in optimizer.param_groups for p in g["params"]]
            optimizer.register_step_post_hook(lambda *_, params=params: release(params))
        if self.plan.offload_param != "none":  # a memory plan can hold this run to a budget too
            optimizer.register_step_post_hook(lambda *_: self._after_offload_step())
        if self.stage >= 2 and steps_locally(optimizer):
            optimizer = LocalStepOptimizer(optimizer)
        return optimizer

    def _after_offload_step(self) -> None:
        """A run held to a host budget by the memory plan gives the heap's free pages back
        after each step: a step's freed temporaries otherwise stay resident in the fragmented
        heap, step after step ([Note: the memory plan] in memory_plan.py)."""
        if self.memory_plan is not None:
            trim_heap()

    def _release_params(self, params: list[torch.Tensor]) -> None:
        for store in self.param_stores:
            store.release(params)

    def _prefetch_params(self, params: list[torch.Tensor]) -> None:
        for store in self.param_stores:
            store.prefetch_params(params)

    def _offload(self, optimizer: Optimizer) -> Optimizer:
        from zeropp_strategy.offload import OffloadOptimizer

        stores = bool(self.param_stores)

        def offload(opt: Optimizer) -> OffloadOptimizer:
            wrapped = OffloadOptimizer(
                opt, self.plan.offload_optimizer_settings, rank=self.rank,
                on_stepped=self._release_params if stores else None,
                on_prefetch=self._prefetch_params if stores else None,
                after_step=self._after_offload_step,
            )
            self.log_offload("offload_optimizer", f"{type(opt).__name__} state (stepped on the host)", wrapped.swap_dir)
            return wrapped

        if isinstance(optimizer, ShardedOptimizer):  # stage 1: offload what the shard view steps
            if not isinstance(optimizer.optimizer, OffloadOptimizer):
                optimizer.optimizer = offload(optimizer.optimizer)
            return optimizer
        if isinstance(optimizer, OffloadOptimizer):
            return optimizer
        return offload(optimizer)

    remap_optimizer = staticmethod(remap_optimizer)  # engine/remap.py

    # -- backward -----------------------------------------------------------------------------

    @contextmanager
    def no_sync(self, model: nn.Module) -> Generator[None, None, None]:
        """No gradient communication in backward (gradient accumulation)."""
        if isinstance(model, DistributedDataParallel):
            with model.no_sync():
                yield
            return
        roots = fsdp_modules(model)[:1]  # the root; the setting applies to every group under it
        for r in roots:
            r.set_requires_gradient_sync(False)
        try:
            yield
        finally:
            for r in roots:
                r.set_requires_gradient_sync(True)

    @torch.no_grad()
    def reduce_replicated_grads(self, model: nn.Module) -> None:
        """Average the grads FSDP2 does not own (0-dim params), as DDP would: divide, then sum.

        One all-reduce of 8 bytes per such parameter (its grad and whether this rank has
        one), booked as GRAD_REDUCE. Every rank reduces the same list, so the collective
        matches even where a parameter was used on some ranks only (those without a grad
        send zeros); a parameter no rank produced a grad for keeps ``grad=None``, as
        without sharding (several models in one job: only the one that ran backward).
        """
        if isinstance(model, DistributedDataParallel):
            return
        params = [p for p in replicated_params(model) if p.requires_grad]
        if not params or not fsdp_modules(model):
            return
        values = [p.grad.float() if p.grad is not None else p.new_zeros((), dtype=torch.float32) for p in params]
        present = [p.new_ones((), dtype=torch.float32) if p.grad is not None else p.new_zeros((), dtype=torch.float32)
                   for p in params]
        flat = torch.stack(values + present)
        flat[: len(params)] /= self.world_size
        all_reduce(flat, ledger=self.ledger, kind=CommKind.GRAD_REDUCE, group=self.meshes.world.get_group())
        for p, v, n in zip(params, flat[: len(params)], flat[len(params) :]):
            if n.item() == 0:
                continue
            if p.grad is None:
                p.grad = v.to(p.dtype).clone()
            else:
                p.grad.copy_(v)

    # -- failure agreement ------------------------------------------------------------------

    def agree(self, what: str, fn: Callable[[], Any]) -> Any:
        """``agree(what, fn)`` with this rank's device (see there)."""
        return agree(what, fn, device=self.device, ledger=self.ledger)


REDUCE_DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}

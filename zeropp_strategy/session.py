"""Layer: session. ``ZeroSession``: the whole ZeRO lifecycle on one rank, with no training
framework imported.

    session = ZeroSession.start(config, rank=r, world_size=n, ranks_per_node=k, device=dev,
                                precision=PrecisionPolicy("bf16-mixed"), where="MyLoop", init=init_fn)
    model = session.prepare(model)                   # stage 1: DDP; stages 2/3: FSDP2 in place
    optimizer = session.adopt(optimizer, fix="...")  # re-pointed by name, then wrapped
    for batch in data:
        with session.phase(Phase.FORWARD):
            loss = model(batch)
        with session.phase(Phase.BACKWARD):
            loss.backward()
        session.after_backward([model])              # replicated 0-dim grads averaged
        session.clip_grad_norm(optimizer, 1.0)       # global norm over every rank's shard
        if not session.check_step(named_parameters([model]), loss):
            optimizer.step()
    session.save(path, {"model": model}, {"optimizer": optimizer}, {"step": n}, full=False)
    session.close()

The three front-ends are adapters over this object: the Lightning strategy
(``lightning/strategy.py``), the Fabric strategy (``fabric.py``) and ``ZeroPPAccelerator``
(``accelerate/``) translate their framework's hooks into these calls and hold no lifecycle
logic of their own. What is below it: ``engine.core.ZeroEngine`` applies the plan to
modules and optimizers (one ``prepare`` for every stage), ``engine.guards`` keeps the ranks
in step, ``checkpoint`` writes and reads, ``comm`` moves and books the bytes.

Order of ``start`` (every rank, the same): the checks that need the job size (config vs
world size, NVMe paths) before any collective, so a bad value raises on every rank instead
of hanging the others; then the process group (created through the front-end's ``init``,
or adopted); then topology, ledger, the config check across ranks (the first collective),
meshes, precision; then the plan (``plan.resolve``: the one place the config is read for
decisions) and the engine built from it, and the peer watchdog. Below the session only
``plan.resolve`` (and ``plan.policies``) take the ``ZeroConfig``: the engine,
``shard_module``, the memory plan and the offload classes take the ``Plan`` or the blocks
it carries.
"""

from __future__ import annotations

import logging
import math
import os
import warnings
from collections.abc import Callable, Generator, Iterable, Mapping
from contextlib import ExitStack, contextmanager
from datetime import timedelta
from enum import Enum
from pathlib import Path
from typing import Any

import torch
from torch import Tensor, nn
from torch.nn.parallel import DistributedDataParallel
from torch.optim import Optimizer

from zeropp_strategy.checkpoint.atomic import new_nonce
from zeropp_strategy.checkpoint.objects import load_objects, save_objects
from zeropp_strategy.comm import control
from zeropp_strategy.comm.ledger import CommLedger, Phase
from zeropp_strategy.config import ZeroConfig
from zeropp_strategy.cost import ByteModel, Cluster, ConfigEstimate, cost
from zeropp_strategy.engine.core import ZeroEngine
from zeropp_strategy.engine.memory import close_offload
from zeropp_strategy.engine.fsdp import ShardedRoot, model_shape
from zeropp_strategy.engine.fsdp_groups import fsdp_modules
from zeropp_strategy.engine.guards import check_nonfinite, check_nonfinite_policy, check_same_config, unwrap
from zeropp_strategy.engine.precision import (
    PrecisionPolicy,
    clip_grad_norm,
    clip_grad_norm_params,
    clip_grad_norm_rows,
    clip_grad_value,
)
from zeropp_strategy.engine.process_group import check_offload_paths, connect, destroy_at_exit
from zeropp_strategy.engine.state import full_gradients
from zeropp_strategy.fsdp_private import keep_unsharded_after_forward
from zeropp_strategy.engine.watchdog import PeerWatchdog
from zeropp_strategy.plan import Plan, resolve
from zeropp_strategy.plan import explain as explain_plan
from zeropp_strategy.topology import Meshes, Topology

__all__ = ["GradSync", "ZeroSession"]

log = logging.getLogger(__name__)


class GradSync(Enum):
    """Whether backward communicates gradients (``ZeroSession.no_sync`` turns it off for
    the micro-batches of an accumulation window)."""

    ON = "on"
    OFF = "off"


class ZeroSession:
    """ZeRO on this rank, from process group to close (see the module docstring).

    Args of ``start``:
        config: the validated ``ZeroConfig``.
        rank, world_size, ranks_per_node: this process's place in the job.
        device: this rank's device.
        precision: the dtype policy (``engine.precision.PrecisionPolicy``, or a front-end
            plugin built on it).
        where: the front-end's name, for error messages ("ZeroPPStrategy" ...).
        on_nonfinite: ``"ignore"``, ``"raise"`` or ``"skip"`` (``check_step``).
        init: ``init(backend, **kwargs)`` creates the default process group (None: it
            exists already, created by the framework).
        backend, timeout: of that process group (backend default: ``default_backend``).
        info: rank-zero logging of the front-end.
        gather_16bit_default: what ``gather_16bit=None`` means for this front-end
            (``plan.resolve``).
    """

    def __init__(self, engine: ZeroEngine, *, config: ZeroConfig, where: str, on_nonfinite: str = "ignore",
                 backend: str = "gloo") -> None:
        self.engine = engine
        self._config = config
        self.where = where
        self.on_nonfinite = check_nonfinite_policy(on_nonfinite, where)
        self.backend = backend
        self.grad_sync = GradSync.ON
        self.steps = 0  # optimizer steps checked by check_step
        self.skipped_steps = 0  # of those, dropped by on_nonfinite="skip"
        self._prepared: dict[int, nn.Module] = {}  # id(user's module) -> what prepare returned
        self._checkpointed: set[int] = set()  # stage 1: modules given activation checkpointing
        self._estimates: dict[str, ConfigEstimate] = {}  # what the plan costs each model prepared to train
        self._priced: set[int] = set()  # id() of the modules in _estimates
        self._byte_model: tuple[str, ByteModel] | None = None  # (precision, its bytes per element)
        control.set_default_ledger(engine.ledger)

    @classmethod
    def start(cls, config: ZeroConfig, *, rank: int, world_size: int, ranks_per_node: int, device: torch.device,
              precision: PrecisionPolicy, where: str, on_nonfinite: str = "ignore",
              init: Callable[..., None] | None = None, backend: str | None = None, timeout: timedelta | None = None,
              info: Callable[[str], None] = log.info, gather_16bit_default: bool = True) -> ZeroSession:
        check_nonfinite_policy(on_nonfinite, where)
        config.validate_for_world(world_size, ranks_per_node)
        check_offload_paths(config.offload_blocks)
        if init is not None:
            backend = connect(device, init, offload=config.offloads, backend=backend, timeout=timeout)
        # Topology and ledger are local; the config check is the first collective (a
        # mismatched config would otherwise build mismatched meshes and hang).
        topology = Topology.detect(world_size, rank, ranks_per_node=ranks_per_node,
                                   simulated_nodes=config.simulated_nodes)
        ledger = CommLedger(topology)
        check_same_config(config.comparable(), world_size, ledger=ledger)
        meshes = topology.build_meshes(device.type)
        precision.bind(device.type, ledger, meshes.world.get_group())
        # Every sentinel of the config decided once, here: the layers below read the plan.
        plan = resolve(config, topology, gather_16bit_default=gather_16bit_default)
        engine = ZeroEngine(plan, topology=topology, meshes=meshes, ledger=ledger, precision=precision,
                            device=device, info=info)
        engine.watchdog = PeerWatchdog.start(timeout=config.peer_timeout, rank=rank, world_size=world_size)
        log.debug("%s", plan.describe())
        destroy_at_exit()  # after whoever created the default group: [Note: orderly exit]
        return cls(engine, config=config, where=where, on_nonfinite=on_nonfinite, backend=backend or "gloo")

    # -- what the session holds -----------------------------------------------------------

    @property
    def config(self) -> ZeroConfig:
        """The config as given: what was asked (the plan, ``plan``, is what was decided)."""
        return self._config

    @property
    def stage(self) -> int:
        return self.engine.stage

    @property
    def ledger(self) -> CommLedger:
        return self.engine.ledger

    @property
    def topology(self) -> Topology:
        return self.engine.topology

    @property
    def meshes(self) -> Meshes:
        return self.engine.meshes

    @property
    def precision(self) -> PrecisionPolicy:
        return self.engine.precision

    @property
    def device(self) -> torch.device:
        return self.engine.device

    @property
    def rank(self) -> int:
        return self.engine.rank

    @property
    def world_size(self) -> int:
        return self.engine.world_size

    @property
    def is_global_zero(self) -> bool:
        return self.rank == 0

    @property
    def plan(self) -> Plan:
        """Every default of the config decided for this job (``plan.resolve``)."""
        return self.engine.plan

    @property
    def state_dict_type(self) -> str:
        return self.plan.state_dict_type

    # -- modules and optimizers -------------------------------------------------------------

    def prepare(self, module: nn.Module, *, train: bool = True, own_root: bool = False,
                grad_read_advice: str | None = None) -> nn.Module:
        """``module`` set up for its stage; returns what forward goes through. Idempotent.

        Stage 1 (in this order): meta tensors materialized, precision applied, moved to the
        device, activation checkpointing on the selected blocks when ``train`` (once per
        module), then DDP with the partitioned reduce, or, with ``train=False`` or nothing
        to train, rank 0's values broadcast instead. Stages 2/3: precision, then FSDP2 on
        the blocks and the root with our comm objects (``engine.fsdp.shard_module``'s
        order), NVMe parameter store, placement. ``own_root``: FSDP2's root is a
        ``ShardedRoot`` wrapping ``module`` (returned), for a framework that calls methods
        of ``module`` other than forward ([Note: why a separate root] in engine/fsdp.py).
        ``grad_read_advice`` (stage 1): the front-end's fix for a user reading ``p.grad``,
        which then warns once ([Note: stage-1 gradient reads] in engine/grad_reads.py).
        """
        done = self._prepared.get(id(module))
        if done is not None and (self.stage != 1 or isinstance(done, DistributedDataParallel) == train):
            if train:
                self._price(done)
            return done
        if self.stage == 1:
            checkpoint = train and id(module) not in self._checkpointed
            if checkpoint:
                self._checkpointed.add(id(module))
            prepared = self.engine.prepare_module(module, train=train, checkpoint=checkpoint,
                                                  grad_read_advice=grad_read_advice)
        elif own_root:
            prepared = self.engine.prepare_module(ShardedRoot(module), train=train)
        else:
            prepared = self.engine.prepare_module(module, train=train)
        self._prepared[id(module)] = prepared
        if train:
            self._price(prepared)
        return prepared

    def _price(self, prepared: nn.Module) -> None:
        """The plan's cost for a model prepared for training, once ([Note: the estimate] in
        cost.py): one line on rank 0 through the front-end's ``info``, every term at DEBUG and
        in ``explain``. An estimate must never stop a run: a model it cannot read is logged
        and left out."""
        module = unwrap(prepared)
        if id(module) in self._priced or not any(p.requires_grad for p in module.parameters()):
            return
        self._priced.add(id(module))
        config, topo = self.config, self.topology
        try:
            shape = model_shape(module, wrap_modules=config.wrap_modules, wrap_min_params=config.wrap_min_params)
            cluster = Cluster(nodes=topo.num_nodes, gpus_per_node=topo.ranks_per_node,
                              gpu_memory=_device_memory(self.device), host_memory=_host_memory(), link=math.inf,
                              intra_link=math.inf)
            estimate = cost(f"stage {self.stage}", self.plan, shape, cluster, None, b=self._bytes_per_element())
        except Exception as err:  # noqa: BLE001 - a diagnostic; the run goes on without it
            self.engine.info(f"zeropp plan: {type(module).__name__} not priced: {type(err).__name__}: {err}")
            return
        name, n = shape.name, 2
        while name in self._estimates:
            name, n = f"{shape.name} #{n}", n + 1
        self._estimates[name] = estimate
        self.engine.info(_one_line(name, shape.params, shape.trainable, topo, estimate))
        if log.isEnabledFor(logging.DEBUG):
            log.debug("%s", self.explain())

    def _bytes_per_element(self) -> ByteModel:
        """``ByteModel.of`` this run's precision and plan, made once per precision."""
        key = self.precision.precision
        if self._byte_model is None or self._byte_model[0] != key:
            self._byte_model = (key, ByteModel.of(key, self.plan))
        return self._byte_model[1]

    def estimates(self) -> dict[str, ConfigEstimate]:
        """What the plan costs each model prepared for training, by the model's class name:
        memory per rank by part (``gpu``: the device, ``host``), bytes per step per rank
        inside and across nodes ([Note: the estimate] in cost.py). No activations (no batch
        has been seen) and no link time (a run does not know its links: ``zeropp plan``)."""
        return dict(self._estimates)

    def explain(self, exception: BaseException | None = None) -> str:
        """The plan of this run, as text: every decision (``plan.resolve``) with the
        fallbacks and why, then what it costs each model prepared for training.
        (``explain(exception)``, the name of ``explain_failure`` before 2026-11-27, still
        forwards there, with a ``DeprecationWarning``.)"""
        if exception is not None:
            warnings.warn("ZeroSession.explain(exception) is now explain_failure(exception); explain() returns the "
                          "run's plan.", DeprecationWarning, stacklevel=2)
            self.explain_failure(exception)
            return ""
        lines = [self.plan.describe()] + [f"  - {line}" for line in explain_plan(self.plan)]
        b = self._bytes_per_element()
        lines.append(f"bytes per element: parameters {b.param:g}, gradients {b.grad:g}, optimizer {b.optim:g}, "
                     f"gathers {b.gather:g}, reduces {b.reduce:g}"
                     + (f", qwZ {b.qw:.4g} per gathered element" if self.plan.quantized_weights else "")
                     + (f", qgZ {b.qg_inside:.4g} inside / {b.qg_across:.4g} across nodes"
                        if self.plan.quantized_gradients else ""))
        for name, e in self._estimates.items():
            lines.append(f"{name}:")
            for where, parts in (("device", e.gpu), ("host", e.host)):
                kept = {k: v for k, v in parts.items() if k != "runtime" and v}
                if kept:
                    lines.append(f"  {where} memory per rank: " + ", ".join(f"{k} {_size(v)}" for k, v in kept.items())
                                 + f" (total {_size(sum(kept.values()))})")
            if e.disk:
                lines.append(f"  NVMe per node: {_size(e.disk)}")
            lines.append(f"  per step per rank: {_traffic(e.intra_bytes)} inside the node, "
                         f"{_traffic(e.inter_bytes)} across nodes")
        if not self._estimates:
            lines.append("(no model prepared for training yet)")
        return "\n".join(lines)

    def adopt(self, optimizer: Optimizer, *, fix: str | None = None) -> Optimizer:
        """An optimizer over parameters of prepared modules, wrapped as the config asks
        (stage 1's sharded state, offload). With ``fix`` (the front-end's advice), an
        optimizer built before ``prepare`` is first re-pointed at the sharded parameters by
        name, and one holding parameters of no prepared module is refused."""
        if fix is None:
            return self.engine.wrap_optimizer(optimizer)
        return self.engine.adopt_optimizer(optimizer, fix=fix)

    def module_to_device(self, module: nn.Module) -> None:
        self.engine.module_to_device(module)

    # -- one step ------------------------------------------------------------------------------

    def phase(self, phase: Phase) -> Any:
        """The ledger's phase for the block (gathers are booked as forward or backward)."""
        return self.ledger.phase(phase)

    @contextmanager
    def no_sync(self, module: nn.Module) -> Generator[None, None, None]:
        """No gradient communication in backward (the micro-batches of an accumulation
        window); ``after_backward`` then leaves the replicated grads alone too."""
        self.grad_sync = GradSync.OFF
        try:
            with self.engine.no_sync(module):
                yield
        finally:
            self.grad_sync = GradSync.ON

    def after_backward(self, modules: Iterable[nn.Module]) -> None:
        """Average the grads FSDP2 does not own (0-dim parameters), unless in ``no_sync``."""
        if self.grad_sync is GradSync.ON:
            for module in modules:
                self.engine.reduce_replicated_grads(unwrap(module))

    def clip_grad_norm(self, optimizer: Optimizer | None = None, max_norm: float = 1.0, *, norm_type: float = 2.0,
                       parameters: Iterable[Tensor] | None = None) -> Tensor:
        """Clip to the global norm over every rank's shard; returns the norm. Give the
        ``optimizer`` (its shards are what it steps) or the ``parameters``."""
        if optimizer is not None:
            return clip_grad_norm(optimizer, float(max_norm), norm_type=float(norm_type), ledger=self.ledger)
        clip = clip_grad_norm_rows if self.stage == 1 else clip_grad_norm_params
        return clip(parameters, float(max_norm), norm_type=float(norm_type), ledger=self.ledger)

    def clip_grad_value(self, optimizer: Optimizer, value: float) -> None:
        clip_grad_value(optimizer, float(value))

    def full_gradients(self, module: nn.Module) -> dict[str, Tensor]:
        """Collective: ``module``'s gradients as DDP leaves them in ``p.grad`` (engine/state.py)."""
        return full_gradients(unwrap(module), stage=self.stage, ledger=self.ledger)

    def check_step(self, named_params: list[tuple[str, Tensor]], loss: Any, *, scaled: bool = False) -> bool:
        """Before an optimizer step: the ``on_nonfinite`` policy (one flag all-reduce when
        not ``"ignore"``). Returns True when the step is to be skipped (its grads dropped).
        ``scaled``: fp16's loss scaler handles overflow itself; nothing is checked."""
        step = self.steps
        self.steps += 1
        if self.on_nonfinite == "ignore" or scaled:
            return False
        skip = check_nonfinite(named_params, loss, policy=self.on_nonfinite, step=step, where=self.where,
                               device=self.device, ledger=self.ledger)
        self.skipped_steps += int(skip)
        return skip

    def reshard(self, modules: Iterable[nn.Module]) -> None:
        """Free gathered parameters that only a backward would free (after a forward-only
        loop: the root always, every block at stage 2)."""
        for module in modules:
            for group in fsdp_modules(module):
                group.reshard()  # a no-op for a group that is already sharded

    @contextmanager
    def gather_for_generation(self, model: nn.Module, enabled: bool = True) -> Generator[None, None, None]:
        """ZeRO-3's gather-once rule: within the block, every FSDP block of ``model`` stays
        unsharded from its first forward until the block ends (one gather per block per
        ``generate`` call instead of one per token). No-op for unsharded models."""
        with ExitStack() as stack:
            for block in fsdp_modules(model) if enabled else []:
                stack.enter_context(keep_unsharded_after_forward(block))
            yield

    # -- state -----------------------------------------------------------------------------

    def barrier(self) -> None:
        control.barrier(ledger=self.ledger, device=self.device)

    def broadcast(self, obj: Any, src: int = 0) -> Any:
        return control.broadcast_object(obj, src, ledger=self.ledger)

    def save(self, path: str | Path, modules: Mapping[str, nn.Module], optimizers: Mapping[str, Optimizer],
             rest: Mapping[str, Any], *, front_end: str, full: bool | None = None) -> None:
        """Collective: named modules, optimizers and other entries, sharded (a directory
        every rank writes) or full (one file from rank 0), published atomically."""
        full = self.state_dict_type == "full" if full is None else full
        save_objects(
            Path(self.broadcast(str(path))), modules, optimizers, rest, full=full, rank_zero=self.is_global_zero,
            barrier=self.barrier, broadcast=self.broadcast, unwrap=unwrap, ledger=self.ledger,
            info={"stage": self.stage, "world_size": self.world_size, "config": self.config.to_dict(),
                  "front_end": front_end},
        )

    def load(self, path: str | Path, modules: Mapping[str, nn.Module], optimizers: Mapping[str, Optimizer], *,
             strict: bool = True, weights_only: bool | None = None) -> dict[str, Any]:
        """Collective: load what ``save`` wrote (either format, any stage and rank count)
        into ``modules`` and ``optimizers`` in place; returns the other entries."""
        return load_objects(Path(self.broadcast(str(path))), modules, optimizers, strict=strict,
                            weights_only=weights_only, unwrap=unwrap)

    def new_nonce(self) -> str:
        """A save's staging name, the same on every rank."""
        return self.broadcast(new_nonce())

    # -- the end ---------------------------------------------------------------------------

    def explain_failure(self, exception: BaseException) -> None:
        """A collective that failed because another rank died: name that rank (waits at
        most ``peer_timeout`` for the evidence). See [Note: peer watchdog]."""
        if self.engine.watchdog is not None and not isinstance(exception, KeyboardInterrupt):
            self.engine.watchdog.explain(exception)

    def quiesce(self) -> None:
        """Finish the comm thread's queued work and stop the thread (the next collective
        that needs it starts it again). Every front-end's teardown: no thread of ours is
        left inside a collective when the run is over ([Note: orderly exit])."""
        self.engine.stop_comm_thread()

    def close(self, optimizers: Iterable[Any] = ()) -> None:
        """Release what offload holds (swap files, mapped shards), stop the comm thread and
        forget the modules."""
        self.quiesce()
        for optimizer in optimizers:
            close_offload(optimizer)
        for store in self.engine.param_stores:
            store.close()
        self.engine.param_stores.clear()
        self.engine.forget_modules()
        self._prepared.clear()
        self._estimates.clear()
        self._priced.clear()


def _size(nbytes: float) -> str:
    """Memory, binary units."""
    for unit, scale in (("GiB", 2**30), ("MiB", 2**20)):
        if nbytes >= scale:
            return f"{nbytes / scale:.2f} {unit}" if unit == "GiB" else f"{nbytes / scale:.1f} {unit}"
    return f"{nbytes / 2**10:.1f} KiB"


def _traffic(nbytes: float) -> str:
    """Bytes on a link, decimal units (as the ledger and ``zeropp plan`` print them)."""
    return f"{nbytes / 1e6:,.2f} MB" if nbytes >= 1e6 else f"{nbytes / 1e3:,.1f} kB"


def _one_line(name: str, params: int, trainable: int, topo: Topology, e: ConfigEstimate) -> str:
    """The plan's cost for one model, for the log at the start of a run."""
    states = {k: v for k, v in e.gpu.items() if k in ("parameters", "gradients", "optimizer")}
    working = sum(v for k, v in e.gpu.items() if k not in states and k != "runtime")
    host = sum(v for k, v in e.host.items() if k != "runtime")
    device = (f"{_size(sum(states.values()))} of model states on the device ("
              + ", ".join(f"{k} {_size(v)}" for k, v in states.items()) + ") + ") if states else ""
    return (f"zeropp plan for {name} ({params:,} parameters, {trainable:,} trained, AdamW) on {topo.num_nodes} "
            f"node(s) x {topo.ranks_per_node} rank(s): per rank {device}{_size(working)} gathered and buckets"
            + (f", {_size(host)} on the host" if host else "")
            + (f", {_size(e.disk)} on NVMe per node" if e.disk else "")
            + f"; per step {_traffic(e.intra_bytes)} inside the node and "
            + (f"{_traffic(e.inter_bytes)} across nodes " if e.inter_bytes else "nothing across nodes ")
            + "(estimated, no activations; explain() has every term)")


def _device_memory(device: torch.device) -> int:
    """A CUDA device's memory; 0 (not checked) for a CPU rank, whose model states live in host memory."""
    return torch.cuda.get_device_properties(device).total_memory if device.type == "cuda" else 0


def _host_memory() -> int:
    """This machine's physical memory; 0 (not checked) where the OS does not say."""
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (AttributeError, ValueError, OSError):  # no sysconf (Windows), or the name unknown
        return 0

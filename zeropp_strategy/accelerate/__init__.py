"""Layer: front-end (Accelerate). HF Accelerate on the zeropp session: ``ZeroPPAccelerator``.

    from zeropp_strategy.accelerate import ZeroPPAccelerator as Accelerator

or, for an unchanged script, through the launch module (``zeropp_strategy.accelerate.launch``):

    ZEROPP_CONFIG=zero.yaml accelerate launch --config_file recipes/accelerate/zeropp.yaml \\
        -m zeropp_strategy.accelerate.launch train.py --lr 1e-4

[Note: Accelerate without a backend plug-in]
Accelerate 1.15 has no plug-in point for a new sharding backend: ``DistributedType`` is
closed and ``MULTI_CPU``/``MULTI_GPU`` wrap models in DDP. ``ZeroPPAccelerator`` keeps
that type (so Accelerate's own collectives, samplers, ``gather_for_metrics``, RNG
synchronization and ``save_state`` bookkeeping work unchanged) and overrides only what
sharding changes: ``prepare_model`` (our engine instead of DDP), ``prepare_optimizer``
(re-pointed at the sharded parameters by name, stage-1/offload wrappers), ``prepare``
(models first, so an optimizer can come before its model in the argument list),
``backward``, ``no_sync``, ``clip_grad_norm_``, ``get_state_dict``, ``save_state`` and
``load_state``, each by calling the ``ZeroSession`` (``zeropp_strategy/session.py``) that
the Lightning and Fabric strategies use too.
"""

from __future__ import annotations

import contextlib
import logging
import os
import re
import weakref
from collections.abc import Generator
from pathlib import Path
from types import MethodType
from typing import Any

import torch
from accelerate import Accelerator
from accelerate.optimizer import AcceleratedOptimizer
from accelerate.utils import DistributedType, convert_outputs_to_fp32
from torch.nn import Module
from torch.optim import Optimizer

from zeropp_strategy.comm.ledger import Phase
from zeropp_strategy.config import ZeroConfig
from zeropp_strategy.engine.core import ZeroEngine
from zeropp_strategy.engine.fsdp_groups import fsdp_modules
from zeropp_strategy.engine.guards import check_nonfinite_policy, named_parameters
from zeropp_strategy.engine.guards import unwrap as _unwrap
from zeropp_strategy.engine.precision import PrecisionPolicy, ShardedGradScaler
from zeropp_strategy.engine.process_group import check_offload_paths, connect, default_backend
from zeropp_strategy.engine.grad_reads import GradientReadWarning
from zeropp_strategy.engine.state import full_model_state
from zeropp_strategy.session import ZeroSession

__all__ = ["CONFIG_ENV", "GradientReadWarning", "ZeroPPAccelerator", "config_from_env", "torchrun_without_gpu"]

log = logging.getLogger(__name__)

#: Environment variable naming the plugin's YAML (``ZeroConfig`` schema) or DeepSpeed JSON.
CONFIG_ENV = "ZEROPP_CONFIG"
_PRECISION = {"no": "32-true", "bf16": "bf16-mixed", "fp16": "16-mixed"}
# What a user reading p.grad at stage 1 should call instead ([Note: stage-1 gradient reads]).
_GRAD_READ_ADVICE = ("accelerator.full_gradients(model) for the whole gradients, accelerator.clip_grad_norm_(...) to "
                     "clip by the global norm (docs/accelerate.md, 'Gradients: what p.grad holds')")
_STATE_DIR = "zeropp_state"


def torchrun_without_gpu() -> bool:
    """Under torchrun (``LOCAL_RANK`` set) on a machine without CUDA, and the CPU not asked
    for: Accelerate would fall back to ``DistributedType.NO`` and every process would train
    alone. Asking for the CPU makes it form the gloo group instead (``MULTI_CPU``).
    It lives here, not in ``launch``: importing that module from its package would make
    ``python -m zeropp_strategy.accelerate.launch`` warn (runpy) and execute it twice."""
    return "LOCAL_RANK" in os.environ and "ACCELERATE_USE_CPU" not in os.environ and not torch.cuda.is_available()


def config_from_env() -> ZeroConfig:
    """The config ``$ZEROPP_CONFIG`` names (YAML or DeepSpeed JSON), else stage 3."""
    path = os.environ.get(CONFIG_ENV)
    if not path:
        return ZeroConfig(stage=3)
    if not Path(path).is_file():
        raise FileNotFoundError(
            f"{CONFIG_ENV}={path!r} does not name a file. Fix: point it at a YAML file with ZeroConfig fields or a "
            "DeepSpeed JSON config, or unset it for the default (stage 3)."
        )
    return ZeroConfig.from_file(path)


def _with_offload_backend(config: ZeroConfig, kwargs: dict[str, Any]) -> dict[str, Any]:
    """With offload on CUDA, ask Accelerate for gloo beside NCCL (``engine.process_group.default_backend``):
    offloaded shards are host tensors, and c10d picks the backend by the tensor's device.
    A user's own ``InitProcessGroupKwargs`` keeps its settings; only its backend is set,
    and only when it is still Accelerate's default ("nccl")."""
    import dataclasses

    from accelerate.utils import InitProcessGroupKwargs

    if kwargs.get("cpu") or not torch.cuda.is_available():
        return kwargs
    backend = default_backend(torch.device("cuda"), offload=config.offloads)
    if backend == "nccl":
        return kwargs
    handlers = list(kwargs.get("kwargs_handlers") or [])
    for i, h in enumerate(handlers):
        if isinstance(h, InitProcessGroupKwargs):
            if h.backend == "nccl":
                handlers[i] = dataclasses.replace(h, backend=backend)
            break
    else:
        handlers.append(InitProcessGroupKwargs(backend=backend))
    return {**kwargs, "kwargs_handlers": handlers}


def _init_process_group_per_attempt(config: ZeroConfig, kwargs: dict[str, Any]) -> None:
    """Under torchrun, create the default process group here, on a store prefix per restart
    attempt (``engine.process_group.attempt_store``: without it every ``--max-restarts`` restart on
    gloo fails to connect), with the backend and timeout Accelerate would use. Accelerate
    then adopts the existing group. Elsewhere: nothing (Accelerate creates it as usual)."""
    import torch.distributed as dist
    from accelerate.utils import InitProcessGroupKwargs

    from zeropp_strategy.engine.process_group import restarted_under_torchrun

    if dist.is_initialized() or int(os.environ.get("WORLD_SIZE", "1")) <= 1 or not restarted_under_torchrun():
        return
    handler = next((h for h in kwargs.get("kwargs_handlers") or [] if isinstance(h, InitProcessGroupKwargs)), None)
    given = handler.to_kwargs() if handler is not None else {}  # only the fields the user changed
    cpu = bool(kwargs.get("cpu")) or not torch.cuda.is_available()
    device = torch.device("cpu") if cpu else torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0")))
    if not cpu:
        torch.cuda.set_device(device)
    connect(device,
            lambda backend, **kw: dist.init_process_group(backend, rank=int(os.environ["RANK"]),
                                                          world_size=int(os.environ["WORLD_SIZE"]), **kw),
            offload=config.offloads, backend=given.get("backend") or ("gloo" if cpu else "nccl"),
            timeout=given.get("timeout"))


class _CheckedOptimizer(AcceleratedOptimizer):
    """Accelerate's optimizer wrapper, plus ``ZeroPPAccelerator(on_nonfinite=...)``'s check
    before each real step (after the last accumulation micro-batch)."""

    def __init__(self, accelerator: ZeroPPAccelerator, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._accelerator = accelerator

    def step(self, closure: Any = None) -> None:
        acc = self._accelerator
        if self.gradient_state.sync_gradients:
            acc.session.check_step(named_parameters(acc._models), acc._last_loss, scaled=self.scaler is not None)
        return super().step(closure)


# id(accelerator) -> the accelerator, for unpickling in the same process (held weakly)
_LIVE: weakref.WeakValueDictionary[int, Any] = weakref.WeakValueDictionary()


class ZeroPPAccelerator(Accelerator):
    """``accelerate.Accelerator`` whose models and optimizers run on the zeropp engine.

    Args:
        *args, **kwargs: as for ``Accelerator`` (``mixed_precision``,
            ``gradient_accumulation_steps``, ``project_dir`` ...).
        zero_config: a ``ZeroConfig``, a dict of its fields or a YAML/DeepSpeed JSON path;
            default: ``$ZEROPP_CONFIG``, else ``ZeroConfig(stage=3)``.
        on_nonfinite: ``"ignore"`` (default), ``"raise"`` or ``"skip"``: what a NaN/inf loss
            (the last one given to ``accelerator.backward``) or gradient does at the
            optimizer step (not at accumulation micro-steps), on every rank alike, as
            ``ZeroPPStrategy``'s; fp16's loss scaler handles overflow itself.
            ``skipped_steps`` counts the dropped steps.
    """

    def __init__(self, *args: Any, zero_config: ZeroConfig | dict | str | Path | None = None,
                 on_nonfinite: str = "ignore", **kwargs: Any) -> None:
        self.on_nonfinite = check_nonfinite_policy(on_nonfinite, "ZeroPPAccelerator")
        self._last_loss: torch.Tensor | None = None
        # Config errors first, on every rank, before Accelerate creates the process group.
        if zero_config is None:
            config = config_from_env()
        else:
            config = ZeroConfig.coerce(zero_config, where="ZeroPPAccelerator(zero_config)")
        check_offload_paths(config.offload_blocks)
        if torchrun_without_gpu():
            kwargs.setdefault("cpu", True)
        kwargs = _with_offload_backend(config, kwargs)
        _init_process_group_per_attempt(config, kwargs)
        super().__init__(*args, **kwargs)
        if self.distributed_type not in (DistributedType.MULTI_CPU, DistributedType.MULTI_GPU, DistributedType.NO):
            raise ValueError(
                f"ZeroPPAccelerator runs on Accelerate's MULTI_GPU/MULTI_CPU type, got {self.distributed_type}. Fix: "
                "use an accelerate config with distributed_type MULTI_GPU or MULTI_CPU (no deepspeed_config/"
                "fsdp_config), e.g. recipes/accelerate/zeropp.yaml."
            )
        ranks_per_node = int(os.environ.get("LOCAL_WORLD_SIZE", self.num_processes))
        self.zero_config = config
        self.zero_session: ZeroSession | None = None
        if self.num_processes > 1:
            flag = _PRECISION.get(str(self.mixed_precision), "32-true")
            self.zero_session = ZeroSession.start(
                config,
                rank=self.process_index,
                world_size=self.num_processes,
                ranks_per_node=ranks_per_node,
                device=self.device,
                precision=PrecisionPolicy(flag, device=self.device.type),
                where="ZeroPPAccelerator",
                on_nonfinite=on_nonfinite,
                info=lambda msg: self.print(msg),
                # gather_16bit=None: Accelerate's mixed precision is autocast over fp32 weights
                gather_16bit_default=False,
            )
            self.print(f"zeropp: ZeroPPAccelerator stage {self.zero_session.stage}, {self.zero_session.topology.describe()}")
            if self.scaler is not None:  # fp16: the inf check must see every rank's shards
                self.scaler = ShardedGradScaler(
                    device=self.device.type, group=self.zero_session.meshes.world.get_group(),
                    ledger=self.zero_session.ledger,
                )
        else:
            config.validate_for_world(self.num_processes, ranks_per_node)

    # -- pickling: as Accelerate's own ----------------------------------------------------------

    def __getstate__(self) -> dict[str, Any]:
        """What ``pickle`` keeps: everything but the session, which holds process groups
        (no process can take those over). Unpickled in the process that made it, the
        accelerator finds that process's session again (``__setstate__``); elsewhere it
        has none (``session`` says so). ``copy.deepcopy`` returns the accelerator itself,
        as Accelerate's does."""
        state = self.__dict__.copy()
        state["zero_session"] = None
        state["_zero_session_pid"] = os.getpid() if self.zero_session is not None else None
        if isinstance(state.get("scaler"), ShardedGradScaler):  # its group goes with the session
            state["scaler"] = None
        _LIVE[id(self)] = self
        state["_zero_session_key"] = id(self)
        return state

    def __setstate__(self, state: dict[str, Any]) -> None:
        key, pid = state.pop("_zero_session_key", None), state.pop("_zero_session_pid", None)
        self.__dict__.update(state)
        original = _LIVE.get(key) if pid is not None and pid == os.getpid() else None
        if original is not None:
            self.zero_session, self.scaler = original.zero_session, original.scaler

    @property
    def session(self) -> ZeroSession:
        if self.zero_session is None:
            raise RuntimeError("ZeroPPAccelerator has no session: a single process (nothing to shard), or an "
                               "accelerator unpickled in another process than the one that made it (its process "
                               "groups cannot travel). Fix: create the ZeroPPAccelerator in this process.")
        return self.zero_session

    @property
    def zero_engine(self) -> ZeroEngine | None:
        return self.zero_session.engine if self.zero_session is not None else None

    @property
    def engine(self) -> ZeroEngine:
        return self.session.engine

    @property
    def skipped_steps(self) -> int:
        """Optimizer steps dropped by ``on_nonfinite="skip"``."""
        return self.zero_session.skipped_steps if self.zero_session is not None else 0

    # -- prepare ----------------------------------------------------------------------------

    def prepare(self, *args: Any, device_placement: list[bool] | None = None) -> Any:
        # Models first, whatever the argument order: optimizers are re-pointed at the
        # sharded parameters, which exist only once their model is prepared.
        if self.zero_engine is not None:
            args = tuple(self.prepare_model(a) if isinstance(a, Module) else a for a in args)
        return super().prepare(*args, device_placement=device_placement)

    def prepare_model(self, model: Module, device_placement: bool | None = None, evaluation_mode: bool = False) -> Module:
        if self.zero_engine is None:
            return super().prepare_model(model, device_placement=device_placement, evaluation_mode=evaluation_mode)
        if getattr(model, "_zeropp_prepared", False):
            if model not in self._models:
                self._models.append(model)
            return model
        model = self.session.prepare(model, train=not evaluation_mode, grad_read_advice=_GRAD_READ_ADVICE)
        if self.native_amp:  # autocast around forward, fp32 outputs: as Accelerate does for DDP
            inner = _unwrap(model)
            autocast = torch.autocast(device_type=self.device.type, dtype=self.session.precision.half_dtype)
            forward = inner.forward
            inner._original_forward = forward  # type: ignore[attr-defined]
            inner.forward = MethodType(convert_outputs_to_fp32(autocast(forward.__func__)), inner)
        model._zeropp_prepared = True  # type: ignore[attr-defined]
        model._is_accelerate_prepared = True  # type: ignore[attr-defined]
        self._models.append(model)
        return model

    def prepare_optimizer(self, optimizer: Optimizer, device_placement: bool | None = None) -> Optimizer:
        if self.zero_engine is None:
            return super().prepare_optimizer(optimizer, device_placement=device_placement)
        if getattr(optimizer, "_is_accelerate_prepared", False):
            if optimizer not in self._optimizers:
                self._optimizers.append(optimizer)
            return optimizer
        wrapped = self.session.adopt(
            optimizer,
            fix="pass its model to accelerator.prepare() in the same call as the optimizer or an earlier one.")
        # device_placement=False: our wrappers hold state where the config puts it.
        accelerated = _CheckedOptimizer(self, wrapped, device_placement=False, scaler=self.scaler)
        self._optimizers.append(accelerated)
        return accelerated

    # -- backward, accumulation, clipping ------------------------------------------------

    def backward(self, loss: torch.Tensor, **kwargs: Any) -> None:
        if self.zero_engine is None:
            return super().backward(loss, **kwargs)
        self._last_loss = loss.detach() if loss.numel() == 1 else None
        loss = loss / self.gradient_accumulation_steps
        with self.session.phase(Phase.BACKWARD):  # gathers in backward are booked as such
            if self.scaler is not None:
                self.scaler.scale(loss).backward(**kwargs)
            else:
                loss.backward(**kwargs)
        if self.sync_gradients:
            self.session.after_backward(self._models)

    @contextlib.contextmanager
    def no_sync(self, model: Module) -> Generator[None, None, None]:
        """No gradient communication in backward, at every stage (FSDP2 groups included)."""
        if self.zero_engine is None or not getattr(model, "_zeropp_prepared", False):
            with super().no_sync(model):
                yield
            return
        with self.session.no_sync(model):
            yield

    def clip_grad_norm_(self, parameters: Any, max_norm: float, norm_type: float = 2) -> torch.Tensor:
        """The global norm over every rank's shard (sharded grads), as DDP's at stage 1."""
        if self.zero_engine is None:
            return super().clip_grad_norm_(parameters, max_norm, norm_type=norm_type)
        self.unscale_gradients()
        return self.session.clip_grad_norm(parameters=parameters, max_norm=float(max_norm), norm_type=float(norm_type))

    def full_gradients(self, model: Module) -> dict[str, torch.Tensor]:
        """Collective (every process calls it, after ``backward`` and before
        ``zero_grad``). The gradients plain Accelerate's DDP leaves in ``p.grad``: whole
        tensors averaged over the processes, on every process, keyed by the unwrapped
        model's parameter names. Under zeropp ``p.grad`` is not that: at stage 1 only the
        rows this process owns are averaged, at stages 2/3 it is this process's shard (a
        DTensor); read gradients through here to log or check them, and clip with
        ``clip_grad_norm_``, which computes the full norm at every stage."""
        if self.zero_engine is None or not getattr(model, "_zeropp_prepared", False):
            return {n: p.grad.detach().clone() for n, p in self.unwrap_model(model).named_parameters()
                    if p.grad is not None}
        return self.session.full_gradients(model)

    # -- state --------------------------------------------------------------------------

    def get_state_dict(self, model: Module, unwrap: bool = True) -> dict[str, Any]:
        """Full state dict, gathered one tensor at a time to CPU; complete on the main
        process, ``{}`` elsewhere (every process must call it: it is a collective)."""
        if self.zero_engine is None or not getattr(model, "_zeropp_prepared", False):
            return super().get_state_dict(model, unwrap=unwrap)
        return full_model_state(_unwrap(model), keep=self.is_main_process, ledger=self.session.ledger)

    def _zero_objects(self) -> tuple[dict[str, Module], dict[str, Optimizer]]:
        modules = {f"model_{i}": _unwrap(m) for i, m in enumerate(self._models)}
        optimizers = {f"optimizer_{i}": o.optimizer for i, o in enumerate(self._optimizers)}
        return modules, optimizers

    @contextlib.contextmanager
    def _without_models(self) -> Generator[None, None, None]:
        """Accelerate's own save/load_state without our models and optimizers (we write
        those), and without its call of the state pre-hooks (we call them once, with the
        models)."""
        saved = (self._models, self._optimizers, self._save_model_state_pre_hook, self._load_model_state_pre_hook)
        self._models, self._optimizers = [], []
        self._save_model_state_pre_hook, self._load_model_state_pre_hook = {}, {}
        try:
            yield
        finally:
            (self._models, self._optimizers, self._save_model_state_pre_hook,
             self._load_model_state_pre_hook) = saved

    def save_state(self, output_dir: str | None = None, safe_serialization: bool = True, **kwargs: Any) -> str:
        """Accelerate's ``save_state`` (schedulers, samplers, RNG, scaler, custom objects)
        plus our models and optimizers: sharded (every rank writes) in
        ``<output_dir>/zeropp_state``, or one full file with ``state_dict_type="full"``."""
        if self.zero_engine is None:
            return super().save_state(output_dir, safe_serialization, **kwargs)
        with self._without_models():
            location = super().save_state(output_dir, safe_serialization, **kwargs)
        location = self._broadcast_str(location)
        for hook in self._save_model_state_pre_hook.values():
            hook(self._models, [], location)
        modules, optimizers = self._zero_objects()
        self.session.save(Path(location) / _STATE_DIR, modules, optimizers, {}, front_end="accelerate")
        return location

    def load_state(self, input_dir: str | None = None, load_kwargs: dict | None = None, **kwargs: Any) -> None:
        if self.zero_engine is None:
            return super().load_state(input_dir, load_kwargs=load_kwargs, **kwargs)
        with self._without_models():
            super().load_state(input_dir, load_kwargs=load_kwargs, **kwargs)
        location = input_dir if input_dir is not None else self._latest_checkpoint()
        for hook in self._load_model_state_pre_hook.values():
            hook(self._models, location)
        modules, optimizers = self._zero_objects()
        self.session.load(Path(location) / _STATE_DIR, modules, optimizers, strict=True)
        return None

    def _latest_checkpoint(self) -> str:
        root = os.path.join(self.project_dir, "checkpoints")
        folders = sorted(
            (os.path.join(root, f) for f in os.listdir(root)),
            key=lambda f: int(re.findall(r"[\/]?([0-9]+)(?=[^\/]*$)", f)[0]),
        )
        return folders[-1]

    def _broadcast_str(self, value: str) -> str:
        return str(self.session.broadcast(value))

    def free_memory(self, *objects: Any) -> Any:
        if self.zero_session is not None:
            self.zero_session.close(self._optimizers)
        return super().free_memory(*objects)

    @property
    def comm_ledger(self) -> Any:
        return self.engine.ledger

    def explain(self) -> str:
        """The plan of this run as text (``ZeroSession.explain``): every decision with its
        fallbacks, and what it costs each model prepared for training (memory per rank by part,
        bytes per step inside and across nodes). Rank 0 logs its one-line summary at INFO when
        the model is set up; this has every term."""
        return self.session.explain()

    def is_sharded(self, model: Module) -> bool:
        return bool(fsdp_modules(_unwrap(model)))

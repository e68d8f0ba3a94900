"""Layer: front-end (Fabric). ``ZeroPPFabricStrategy``: the same ZeRO session under
Lightning Fabric.

    fabric = Fabric(strategy="zeropp_stage_3", accelerator="cuda", devices=8)
    fabric.launch()
    with fabric.init_module(empty_init=True):        # meta device at stages 2/3
        model = build_model()
    optimizer = torch.optim.AdamW(model.parameters())  # before or after setup: both work
    model, optimizer = fabric.setup(model, optimizer)

An adapter: each hook is a ``ZeroSession`` call (``zeropp_strategy/session.py``):
``setup_module`` -> ``prepare`` (FSDP2 as root at stages 2/3, DDP at stage 1);
``setup_optimizer`` -> ``adopt`` (re-pointed by name at the sharded parameters, wrapped);
``backward`` -> ``after_backward``; ``no_backward_sync`` -> ``no_sync``;
``optimizer_step`` -> ``check_step``; ``clip_gradients_norm`` -> ``clip_grad_norm``;
``save_checkpoint``/``load_checkpoint`` -> ``save``/``load`` (the sharded directory every
rank writes, or one full file from rank 0 in the layout Fabric's DDP strategy writes).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from contextlib import AbstractContextManager, ExitStack, nullcontext
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch
from lightning.fabric.accelerators import Accelerator
from lightning.fabric.plugins import ClusterEnvironment, Precision
from lightning.fabric.plugins.collectives.torch_collective import default_pg_timeout
from lightning.fabric.strategies import ParallelStrategy
from lightning.fabric.strategies.launchers.subprocess_script import _SubprocessScriptLauncher
from lightning.fabric.strategies.strategy import _BackwardSyncControl
from lightning.fabric.utilities.rank_zero import rank_zero_info
from lightning.fabric.utilities.types import ReduceOp
from torch import Tensor
from torch.nn import Module
from torch.nn.parallel import DistributedDataParallel
from torch.optim import Optimizer

from zeropp_strategy._process import ProcessMixin
from zeropp_strategy.checkpoint.objects import split_state, stateful
from zeropp_strategy.comm.ledger import Phase
from zeropp_strategy.config import ZeroConfig
from zeropp_strategy.engine.core import ZeroEngine
from zeropp_strategy.engine.fsdp_groups import fsdp_modules
from zeropp_strategy.engine.guards import check_nonfinite_policy, named_parameters
from zeropp_strategy.engine.guards import unwrap as _unwrap  # noqa: F401 - tests import it from here
from zeropp_strategy.engine.meta_init import build_context, has_meta
from zeropp_strategy.engine.precision import PrecisionPolicy
from zeropp_strategy.session import ZeroSession

# the fix a stage-1 GradientReadWarning names ([Note: stage-1 gradient reads] in engine/grad_reads.py)
_GRAD_READ_ADVICE = ("fabric.strategy.full_gradients(model) for the whole gradients (a collective: every rank calls "
                     "it), fabric.clip_gradients(model, optimizer, max_norm=...) to clip by the global norm "
                     "(docs/fabric.md, 'What p.grad holds')")


def _flag_of(precision: Precision) -> str:
    flag = str(getattr(precision, "precision", "32-true"))
    return "32-true" if flag in ("32", "32-true") else flag


class ZeroPPFabricStrategy(ProcessMixin, ParallelStrategy):
    """ZeRO stages 1/2/3 (and ZeRO++, offload) for Lightning Fabric.

    Args:
        config: a ``ZeroConfig``, a dict of its fields, or a path to a YAML file or a
            DeepSpeed JSON config.
        state_dict_type: ``"sharded"`` (every rank writes a directory) or ``"full"`` (one
            file from rank 0); default from the config (sharded at stages 2/3).
        accelerator, parallel_devices, cluster_environment, precision: set by Fabric.
        process_group_backend, timeout: as for Fabric's DDP strategy.
        on_nonfinite: ``"ignore"`` (default), ``"raise"`` or ``"skip"``: what a NaN/inf loss
            (the last one given to ``fabric.backward``) or gradient does at
            ``optimizer.step()``, on every rank alike (as ``ZeroPPStrategy``'s; fp16's loss
            scaler handles overflow itself). ``skipped_steps`` counts the dropped steps.
        **config_fields: any ``ZeroConfig`` field, overriding ``config``.
    """

    _launcher_cls = _SubprocessScriptLauncher
    _registry_label = ", Fabric"

    def __init__(
        self,
        config: ZeroConfig | Mapping[str, Any] | str | Path | None = None,
        *,
        accelerator: Accelerator | None = None,
        parallel_devices: list[torch.device] | None = None,
        cluster_environment: ClusterEnvironment | None = None,
        precision: Precision | None = None,
        process_group_backend: str | None = None,
        timeout: timedelta | None = default_pg_timeout,
        on_nonfinite: str = "ignore",
        **config_fields: Any,
    ) -> None:
        self.on_nonfinite = check_nonfinite_policy(on_nonfinite, "ZeroPPFabricStrategy")
        self._last_loss: Tensor | None = None
        self.config = ZeroConfig.coerce(config, where="ZeroPPFabricStrategy(config)", overrides=config_fields)
        super().__init__(
            accelerator=accelerator,
            parallel_devices=parallel_devices,
            cluster_environment=cluster_environment,
            precision=precision,
        )
        self._num_nodes = 1
        self._process_group_backend = process_group_backend
        self._timeout = timeout
        self._session: ZeroSession | None = None
        self._backward_sync_control = _ZeroNoSync(self)
        self._optimizers: list[Optimizer] = []
        self._modules: list[Module] = []

    # -- sizes and identity -------------------------------------------------------------

    @property
    def session(self) -> ZeroSession:
        if self._session is None:
            raise RuntimeError("ZeroPPFabricStrategy.session is available after Fabric.launch() set up the processes.")
        return self._session

    @property
    def engine(self) -> ZeroEngine:
        return self.session.engine

    @property
    def skipped_steps(self) -> int:
        """Optimizer steps dropped by ``on_nonfinite="skip"``."""
        return self._session.skipped_steps if self._session is not None else 0

    @property
    def comm_ledger(self) -> Any:
        return self.engine.ledger

    def explain(self) -> str:
        """The plan of this run as text (``ZeroSession.explain``): every decision with its
        fallbacks, and what it costs each model prepared for training (memory per rank by part,
        bytes per step inside and across nodes). Rank 0 logs its one-line summary at INFO when
        the model is set up; this has every term."""
        return self.session.explain()

    # -- processes ----------------------------------------------------------------------

    def setup_environment(self) -> None:
        super().setup_environment()
        policy = PrecisionPolicy(_flag_of(self.precision), device=self.root_device.type)
        self._session = self._start_session(policy, "ZeroPPFabricStrategy", self.on_nonfinite)
        self._use_sharded_scaler()
        rank_zero_info(f"zeropp (Fabric): stage {self.stage}, {self.engine.topology.describe()}")

    def _use_sharded_scaler(self) -> None:
        """16-mixed: Fabric's GradScaler checks for inf only locally; ours all-reduces."""
        from zeropp_strategy.engine.precision import ShardedGradScaler

        scaler = getattr(self.precision, "scaler", None)
        if scaler is not None and not isinstance(scaler, ShardedGradScaler):
            self.precision.scaler = ShardedGradScaler(
                device=self.root_device.type, group=self.engine.meshes.world.get_group(), ledger=self.engine.ledger
            )

    # -- modules and optimizers ----------------------------------------------------------

    def setup_module_and_optimizers(
        self, module: Module, optimizers: list[Optimizer], scheduler: Any = None
    ) -> tuple[Module, list[Optimizer], Any]:
        module = self.setup_module(module)
        return module, [self.setup_optimizer(opt) for opt in optimizers], scheduler

    def setup_module(self, module: Module) -> Module:
        if fsdp_modules(module) or isinstance(module, DistributedDataParallel):
            return module  # already set up
        module = self.session.prepare(module, grad_read_advice=_GRAD_READ_ADVICE)
        self._modules.append(module)
        return module

    def setup_optimizer(self, optimizer: Optimizer) -> Optimizer:
        """Re-points an optimizer built over unsharded parameters (before ``setup_module``)
        at the sharded ones, by name, then wraps it (stage 1 state sharding, offload)."""
        wrapped = self.session.adopt(
            optimizer,
            fix="call fabric.setup(model, optimizer), or fabric.setup_module(model) before setup_optimizers.")
        self._optimizers.append(wrapped)
        return wrapped

    def module_to_device(self, module: Module) -> None:
        """Fabric calls this before ``setup_module``. Stages 2/3 place each shard while sharding
        (the full model never lands on the device); meta tensors are materialized there too."""
        if fsdp_modules(module):
            self.session.module_to_device(module)
        elif self.stage == 1 and not has_meta(module):
            module.to(self.root_device)

    def module_init_context(self, empty_init: bool | None = None) -> AbstractContextManager:
        stack = ExitStack()
        # stages 2/3: meta, materialized in setup_module; stage 1 with empty_init=True: rank 0 reads
        config = self.config
        stack.enter_context(build_context(config.stage, config.meta_init, empty_init, rank=self.global_rank,
                                          world_size=self.world_size))
        stack.enter_context(self.precision.module_init_context())
        return stack

    # -- backward and clipping -------------------------------------------------------------

    def backward(self, tensor: Tensor, module: Module | None, *args: Any, **kwargs: Any) -> None:
        self._last_loss = tensor.detach() if tensor.numel() == 1 else None
        with self.session.phase(Phase.BACKWARD):  # gathers in backward are booked as such
            super().backward(tensor, module, *args, **kwargs)
        self.session.after_backward([module] if module is not None else self._modules)

    def optimizer_step(self, optimizer: Any, **kwargs: Any) -> Any:
        self.session.check_step(named_parameters(self._modules), self._last_loss,
                                scaled=getattr(self.precision, "scaler", None) is not None)
        return super().optimizer_step(optimizer, **kwargs)

    def clip_gradients_norm(
        self,
        module: Module,
        optimizer: Optimizer,
        max_norm: float | int,
        norm_type: float | int = 2.0,
        error_if_nonfinite: bool = True,
    ) -> Tensor:
        """The global norm over every rank's shard (stage 2/3), as DDP computes it at stage 1."""
        self.precision.unscale_gradients(optimizer)
        total = self.session.clip_grad_norm(optimizer, float(max_norm), norm_type=float(norm_type))
        if error_if_nonfinite and not torch.isfinite(total):
            raise RuntimeError(
                f"The total norm of order {norm_type} of the gradients is non-finite ({total.item()}), so it cannot be "
                "clipped. Fix: find the source of the inf/NaN, or pass error_if_nonfinite=False."
            )
        return total

    def full_gradients(self, module: Module) -> dict[str, Tensor]:
        """Collective (every rank, after ``fabric.backward`` and before ``zero_grad``): the
        gradients ``strategy="ddp"`` leaves in ``p.grad``, whole tensors averaged over the
        ranks, on every rank, keyed by the model's parameter names. ``p.grad`` itself is not
        that here (at stage 1 only the rows a rank owns are averaged, at stages 2/3 it is the
        rank's shard); read gradients through here to log or check them. Only after a
        backward that reduced the gradients (outside ``fabric.no_backward_sync``): before
        one, each rank's gradients are its own and this mixes ranks' unreduced rows."""
        return self.session.full_gradients(module)

    def clip_gradients_value(self, module: Module, optimizer: Optimizer, clip_val: float | int) -> None:
        self.precision.unscale_gradients(optimizer)
        self.session.clip_grad_value(optimizer, float(clip_val))

    # -- collectives ------------------------------------------------------------------------

    def all_reduce(self, tensor: Tensor, group: Any = None, reduce_op: ReduceOp | str | None = "mean") -> Tensor:
        return self._reduce(tensor, group, reduce_op)

    # -- checkpoints ----------------------------------------------------------------------

    def save_checkpoint(
        self,
        path: Any,
        state: dict[str, Module | Optimizer | Any],
        storage_options: Any | None = None,
        filter: dict[str, Callable[[str, Any], bool]] | None = None,
    ) -> None:
        """Sharded: a directory every rank writes (DCP) plus ``zeropp_meta.pt``; full: one
        file from rank 0 holding what Fabric's DDP strategy would save."""
        if storage_options is not None:
            raise TypeError("ZeroPPFabricStrategy.save_checkpoint(storage_options=...) is not supported. Fix: drop it.")
        if filter is not None:
            raise NotImplementedError("ZeroPPFabricStrategy.save_checkpoint(filter=...) is not supported. Fix: drop it.")
        modules, optimizers, rest = split_state(state)
        rest = {k: (v.state_dict() if stateful(v) else v) for k, v in rest.items()}
        self.session.save(path, modules, optimizers, rest, front_end="fabric", full=self.state_dict_type == "full")

    def load_checkpoint(
        self,
        path: Any,
        state: Module | Optimizer | dict[str, Module | Optimizer | Any] | None = None,
        strict: bool = True,
        weights_only: bool | None = None,
    ) -> dict[str, Any]:
        """Restore modules, optimizers and stateful objects in ``state`` in place; returns
        the checkpoint's remaining entries (Fabric's contract)."""
        if isinstance(state, Optimizer):
            raise NotImplementedError("Loading a single optimizer is not supported. Fix: pass {'optimizer': opt, ...}.")
        if isinstance(state, Module):
            state = {"model": state}
        state = state if state is not None else {}
        modules, optimizers, others = split_state(state)
        rest = self.session.load(path, modules, optimizers, strict=strict, weights_only=weights_only)
        for key, obj in others.items():
            if key not in rest:
                if strict:
                    raise KeyError(f"checkpoint {path} has no entry {key!r}. Fix: save it, or pass strict=False.")
                continue
            if stateful(obj):
                obj.load_state_dict(rest.pop(key))
            else:
                state[key] = rest.pop(key)
        return rest

    # -- teardown ------------------------------------------------------------------------

    def teardown(self) -> None:
        if self._session is not None:
            self._session.close(self._optimizers)
        self._optimizers, self._modules = [], []
        super().teardown()


class _ZeroNoSync(_BackwardSyncControl):
    """``fabric.no_backward_sync(model)``: no gradient communication in backward."""

    def __init__(self, strategy: ZeroPPFabricStrategy) -> None:
        self.strategy = strategy

    def no_backward_sync(self, module: Module, enabled: bool) -> AbstractContextManager:
        if not enabled:
            return nullcontext()
        return self.strategy.session.no_sync(module)

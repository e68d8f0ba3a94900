"""Layer: front-end (Lightning). ``ZeroPPStrategy``: ZeRO stages 1/2/3 (and ZeRO++) as a
Lightning strategy.

    Trainer(strategy="zeropp_stage_3", accelerator="cpu", devices=2)
    Trainer(strategy=ZeroPPStrategy(stage=2, activation_checkpointing=True))
    Trainer(strategy=ZeroPPStrategy(config="ds_config.json"))  # DeepSpeed JSON

An adapter: every hook below translates Lightning's call into ``ZeroSession`` calls
(``zeropp_strategy/session.py``, where the lifecycle is written once for all front-ends).
What stays here is Lightning's own shape:
- ``setup_environment``: ranks from the cluster environment, then ``ZeroSession.start``
  (job-size checks on every rank before any collective, process group, engine).
- ``setup``: ``session.prepare`` (stage 1: DDP; stages 2/3: FSDP2 with the
  LightningModule inside a ``ShardedRoot``, see [Note: why a separate root]) before
  ``configure_optimizers`` runs, so optimizers are built over the sharded parameters.
- every ``*_step`` goes through the root module's ``__call__`` (Lightning's
  ``_ForwardRedirection``) so FSDP2's root hooks run, inside the ledger's phase.
- checkpoints: Lightning's dict in our two formats (``checkpoint_hooks.py``).
- evaluation at stage 3: uneven loaders evened ([Note: uneven evaluation]), gathered
  parameters freed at the end of each loop (``evaluation.py``).

Every hook is in ``StrategyMixin``, which names no Lightning package; ``ZeroPPStrategy`` at
the end is that mixin on ``lightning.pytorch``'s ``ParallelStrategy``, plus a short table of
that package's own names ([Note: two Lightning packages] in ``_pytorch_lightning.py``).
"""

from __future__ import annotations

from collections.abc import Callable, Generator, Mapping
from contextlib import contextmanager
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch
from lightning.fabric.plugins import CheckpointIO, ClusterEnvironment
from lightning.fabric.plugins.collectives.torch_collective import default_pg_timeout
from lightning.fabric.utilities.optimizer import _optimizers_to_device
from lightning.fabric.utilities.rank_zero import rank_zero_info
from lightning.fabric.utilities.types import ReduceOp
from lightning.pytorch.callbacks import ModelCheckpoint
from lightning.pytorch.overrides.distributed import prepare_for_backward
from lightning.pytorch.plugins.precision import Precision
from lightning.pytorch.strategies.ddp import _DDPForwardRedirection
from lightning.pytorch.strategies.parallel import ParallelStrategy
from lightning.pytorch.strategies.strategy import _ForwardRedirection
from lightning.pytorch.trainer.connectors.logger_connector.result import _ResultCollection
from lightning.pytorch.trainer.states import TrainerFn
from torch import Tensor
from torch.nn import Module
from torch.nn.parallel import DistributedDataParallel
from torch.optim import Optimizer

from zeropp_strategy._process import ProcessMixin
from zeropp_strategy.comm.ledger import CommLedger, Phase
from zeropp_strategy.config import ZeroConfig
from zeropp_strategy.engine.core import ZeroEngine
from zeropp_strategy.engine.fsdp import ShardedRoot
from zeropp_strategy.engine.fsdp_groups import fsdp_modules
from zeropp_strategy.engine.guards import check_nonfinite_policy
from zeropp_strategy.engine.memory import MemoryStats, memory_stats
from zeropp_strategy.engine.meta_init import build_context, has_meta
from zeropp_strategy.lightning.checkpoint_hooks import CheckpointMixin
from zeropp_strategy.lightning.evaluation import EvaluationMixin
from zeropp_strategy.lightning.precision import PrecisionMixin, ZeroPPPrecision
from zeropp_strategy.lightning.resume import ResumingLauncher, check_same_choice, resume_path
from zeropp_strategy.session import ZeroSession
from zeropp_strategy.topology import Meshes, Topology

# the fix a stage-1 GradientReadWarning names ([Note: stage-1 gradient reads] in engine/grad_reads.py)
_GRAD_READ_ADVICE = ("trainer.strategy.full_gradients() for the whole gradients (a collective: every rank calls it), "
                     "Trainer(gradient_clip_val=...) to clip by the global norm (docs/strategy.md, "
                     "'GradientReadWarning')")


class StrategyMixin(CheckpointMixin, EvaluationMixin, ProcessMixin):
    """Every hook of ``ZeroPPStrategy``, for either Lightning package; its arguments are
    documented there. A package's class lists this mixin before its ``ParallelStrategy`` and
    sets the names below ([Note: two Lightning packages] in ``_pytorch_lightning.py``)."""

    _precision_cls: type[PrecisionMixin]  # and _launcher_cls (ProcessMixin), _result_collection_cls
    _trainer_fn: Any  # TrainerFn
    _forward_redirection_cls: type  # _ForwardRedirection
    _ddp_forward_redirection_cls: type  # _DDPForwardRedirection
    _prepare_for_backward: Callable[[DistributedDataParallel, Any], None]
    _model_checkpoint_cls: type  # ModelCheckpoint, for resume="auto"

    strategy_name = "zeropp"
    _registry_label = ""

    def __init__(
        self,
        config: ZeroConfig | Mapping[str, Any] | str | Path | None = None,
        *,
        accelerator: Any = None,
        parallel_devices: list[torch.device] | None = None,
        cluster_environment: ClusterEnvironment | None = None,
        checkpoint_io: CheckpointIO | None = None,
        precision_plugin: Precision | None = None,
        process_group_backend: str | None = None,
        timeout: timedelta | None = default_pg_timeout,
        on_nonfinite: str = "ignore",
        resume: str | Path | None = None,
        **config_fields: Any,
    ) -> None:
        check_nonfinite_policy(on_nonfinite, "ZeroPPStrategy")
        if resume is not None and not isinstance(resume, (str, Path)):
            raise TypeError(f"ZeroPPStrategy(resume={resume!r}) is invalid: must be 'auto', a directory or None. "
                            "Fix: resume='auto' with ModelCheckpoint(dirpath=...), or resume='checkpoints/'.")
        self.config = ZeroConfig.coerce(config, where="ZeroPPStrategy(config)", overrides=config_fields)
        self.resume = resume
        self._resume_choice: list[str | None] = []  # set by the launcher for one fit, checked in setup_environment
        self.on_nonfinite = on_nonfinite
        super().__init__(
            accelerator=accelerator,
            parallel_devices=parallel_devices,
            cluster_environment=cluster_environment,
            checkpoint_io=checkpoint_io,
            precision_plugin=precision_plugin,
        )
        self._num_nodes = 1
        self._process_group_backend = process_group_backend
        self._timeout = timeout
        self._fsdp_redirection = self._forward_redirection_cls()
        self._ddp_redirection = self._ddp_forward_redirection_cls()
        self._sharded_path: Path | None = None  # the sharded checkpoint being loaded
        self._fsdp_root: ShardedRoot | None = None  # stages 2/3, see [Note: why a separate root]
        self._session: ZeroSession | None = None  # set in setup_environment

    # -- what the session holds, once processes are set up ------------------------------------

    @property
    def session(self) -> ZeroSession:
        if self._session is None:
            raise RuntimeError("ZeroPPStrategy.session is available once the Trainer has set up processes.")
        return self._session

    @property
    def engine(self) -> ZeroEngine:
        if self._session is None:
            raise RuntimeError("ZeroPPStrategy.engine is available once the Trainer has set up processes.")
        return self._session.engine

    @property
    def topology(self) -> Topology:
        if self._session is None:
            raise RuntimeError("ZeroPPStrategy.topology is available once the Trainer has set up processes.")
        return self._session.topology

    @property
    def meshes(self) -> Meshes:
        if self._session is None:
            raise RuntimeError("ZeroPPStrategy.meshes are available once the Trainer has set up processes.")
        return self._session.meshes

    @property
    def comm_ledger(self) -> CommLedger:
        if self._session is None:
            raise RuntimeError("ZeroPPStrategy.comm_ledger is available once the Trainer has set up processes.")
        return self._session.ledger

    @property
    def skipped_steps(self) -> int:
        """Optimizer steps dropped by ``on_nonfinite="skip"``."""
        return self._session.skipped_steps if self._session is not None else 0

    @property
    def hpz_partition_size(self) -> int:
        """Effective hpZ group size: 1 when off or when it cannot help (one group = all ranks)."""
        return self.engine.hpz_partition_size

    @property
    def _param_store(self) -> Any:
        """offload_param="nvme": the ParamStore of the sharded module (None otherwise)."""
        stores = self._session.engine.param_stores if self._session is not None else []
        return stores[-1] if stores else None

    def _fsdp_groups(self) -> list[Module]:
        """The modules FSDP2 shards as one group each (blocks, then the root)."""
        return list(fsdp_modules(self._fsdp_root)) if self._fsdp_root is not None else []

    @property
    def is_distributed(self) -> bool:
        # Lightning injects a DistributedSampler (and reduces sync_dist logs) only for
        # strategies it knows or that say so here.
        return True

    def comm_stats(self, reset: bool = False) -> dict[str, Any]:
        """This rank's CommLedger summary (bytes sent, intra/inter-node, by kind)."""
        stats = self.comm_ledger.summary()
        if reset:
            self.comm_ledger.reset()
        return stats

    def reset_comm_stats(self) -> None:
        self.comm_ledger.reset()

    def full_gradients(self, module: Module | None = None) -> dict[str, Tensor]:
        """Collective (every rank, after backward and before the gradients are cleared: in
        ``on_before_optimizer_step``, say): the gradients ``strategy="ddp"`` leaves in
        ``p.grad``, whole tensors averaged over the ranks, on every rank, keyed by parameter
        name, for ``module`` (default: the LightningModule). ``p.grad`` itself is not that
        here (at stage 1 only the rows a rank owns are averaged, at stages 2/3 it is the
        rank's shard); read gradients through here to log or check them. Only on a step
        that reduced the gradients (with ``accumulate_grad_batches``, the last micro-batch's:
        ``on_before_optimizer_step`` is one); before it each rank's gradients are its own."""
        module = self.lightning_module if module is None else module
        return self.session.full_gradients(module)

    def explain(self) -> str:
        """The plan of this run as text (``ZeroSession.explain``): every decision with its
        fallbacks, and what it costs each model prepared for training (memory per rank by part,
        bytes per step inside and across nodes). Rank 0 logs its one-line summary at INFO when
        the model is set up; this has every term."""
        if self._session is None:
            raise RuntimeError("ZeroPPStrategy.explain() is available once the Trainer has set up processes.")
        return self._session.explain()

    def memory_stats(self) -> MemoryStats:
        """Bytes this rank holds in params/grads/optimizer state, beside the stage's formula."""
        assert self.lightning_module is not None
        return memory_stats(
            self.lightning_module, list(self.optimizers), stage=self.stage, rank=self.global_rank, world_size=self.world_size
        )

    # -- precision ------------------------------------------------------------------------

    @property
    def precision_plugin(self) -> PrecisionMixin:
        plugin = self._precision_plugin
        if plugin is None:
            plugin = self._precision_plugin = self._precision_cls("32-true", device=self._device_type())
        return plugin  # type: ignore[return-value]

    @precision_plugin.setter
    def precision_plugin(self, plugin: Precision | None) -> None:
        if plugin is not None:
            plugin = self._precision_cls.from_lightning_plugin(plugin, self._device_type())
        self._precision_plugin = plugin

    def _device_type(self) -> str:
        devices = self.parallel_devices
        return devices[0].type if devices else "cpu"

    # -- processes ------------------------------------------------------------------------

    def _configure_launcher(self) -> None:
        # Always (as Lightning's DDP does): the launcher only starts processes when nobody
        # else did, and it is where fit's ckpt_path is seen (resume="auto").
        assert self.cluster_environment is not None
        self._launcher = self._launcher_cls(self.cluster_environment, self.num_processes, self.num_nodes)

    def resume_path(self, trainer: Any) -> str | None:
        """The checkpoint ``resume`` picks for ``trainer`` now (newest complete one), or None.
        Rank-local (no collective); raises ``ValueError`` when there is no directory to look in."""
        return resume_path(self.resume, trainer, self._model_checkpoint_cls)

    def setup_environment(self) -> None:
        super().setup_environment()
        if self._session is not None:
            # A later trainer.fit/validate/test on the same Trainer: the model is already
            # sharded and its comm objects book into this session's ledger, so keep both
            # (a new ledger would stay at zero; the ledger counts the Trainer's whole life).
            check_same_choice(self._resume_choice)
            return
        self._session = self._start_session(self.precision_plugin, "ZeroPPStrategy", self.on_nonfinite)
        check_same_choice(self._resume_choice)
        rank_zero_info(f"zeropp: stage {self.stage}, {self.topology.describe()}")

    # -- model and optimizers -------------------------------------------------------------

    def setup(self, trainer: Any) -> None:
        assert self.accelerator is not None and self.model is not None
        self.accelerator.setup(trainer)
        fitting = trainer.state.fn == self._trainer_fn.FITTING
        if self.stage == 1:
            # Meta-device init: materialized on every rank; DDP's construction (or, outside
            # fit, a broadcast) then gives every replica rank 0's values.
            self.model = self.session.prepare(self.model, train=fitting, grad_read_advice=_GRAD_READ_ADVICE)
        else:
            # Idempotent: a model set up by validate is returned as it is (and priced when fit follows).
            self._fsdp_root = self.session.prepare(self.model, own_root=True,  # type: ignore[assignment]
                                                   train=fitting)  # at stages 2/3: priced only to train
            self.session.module_to_device(self._fsdp_root)
            _evaluate_under_no_grad(trainer)
        if fitting:
            # Re-entering setup (fit after fit) must build optimizers over the current params.
            self._reset_optimizers_and_schedulers()
            super().setup_optimizers(trainer)
            self.optimizers = [self.session.adopt(opt) for opt in self.optimizers]
        self.setup_precision_plugin()
        if fitting:
            _optimizers_to_device(self.optimizers, self.root_device)

    def model_to_device(self) -> None:
        assert self.model is not None
        self.session.module_to_device(self._fsdp_root if self._fsdp_root is not None else self.model)

    @contextmanager
    def tensor_init_context(self, empty_init: bool | None = None) -> Generator[None, None, None]:
        # configure_model (empty_init=None) and init_module(): the meta device at stages 2/3,
        # materialized shard by shard in setup() (ZeroConfig.meta_init, engine/meta_init.py)
        with build_context(self.config.stage, self.config.meta_init, empty_init, rank=self.global_rank,
                           world_size=self.world_size), \
                self.precision_plugin.tensor_init_context():
            yield

    # -- steps ----------------------------------------------------------------------------

    def _redirect(self, method: str, *args: Any, **kwargs: Any) -> Any:
        assert self.lightning_module is not None and self.model is not None
        if isinstance(self.model, DistributedDataParallel):
            return self._ddp_redirection(self.model, self.lightning_module, method, *args, **kwargs)
        if self._fsdp_root is not None:
            if method == "training_step" and not self.lightning_module.automatic_optimization:
                with self._fsdp_root.routed_forward():
                    return getattr(self.lightning_module, method)(*args, **kwargs)
            return self._fsdp_redirection(self._fsdp_root, self.lightning_module, method, *args, **kwargs)
        return getattr(self.lightning_module, method)(*args, **kwargs)

    def training_step(self, *args: Any, **kwargs: Any) -> Any:
        with self.precision_plugin.train_step_context(), self.session.phase(Phase.FORWARD):
            return self._redirect("training_step", *args, **kwargs)

    # -- backward and the optimizer step ----------------------------------------------------

    def backward(self, closure_loss: Tensor, optimizer: Optimizer | None, *args: Any, **kwargs: Any) -> Tensor:
        with self.session.phase(Phase.BACKWARD):
            return super().backward(closure_loss, optimizer, *args, **kwargs)

    def pre_backward(self, closure_loss: Tensor) -> None:
        # Manual optimization under DDP (stage 1) must tell the reducer what to expect.
        if isinstance(self.model, DistributedDataParallel) and not self.lightning_module.automatic_optimization:
            self._prepare_for_backward(self.model, closure_loss)

    def post_backward(self, closure_loss: Tensor) -> None:
        self.session.after_backward([self._fsdp_root if self._fsdp_root is not None else self.model])

    @contextmanager
    def block_backward_sync(self) -> Generator[None, None, None]:
        """No gradient communication on non-boundary micro-batches (accumulation)."""
        model = self.model if isinstance(self.model, DistributedDataParallel) else self._fsdp_root
        if model is None:
            yield
            return
        with self.session.no_sync(model):
            yield

    def optimizer_step(self, optimizer: Optimizer, closure: Any, model: Any = None, **kwargs: Any) -> Any:
        scaled = getattr(self.precision_plugin, "scaler", None) is not None

        def checked() -> Any:  # after backward, before the step
            out = closure()
            assert self.lightning_module is not None
            self.session.check_step(list(self.lightning_module.named_parameters()), out, scaled=scaled)
            return out

        return super().optimizer_step(optimizer, checked, model, **kwargs)

    # -- collectives for Lightning (logging, barriers) --------------------------------------

    def reduce(self, tensor: Any, group: Any = None, reduce_op: ReduceOp | str | None = "mean") -> Any:
        return self._reduce(tensor, group, reduce_op)

    # -- teardown ------------------------------------------------------------------------

    def on_exception(self, exception: BaseException) -> None:
        if self._session is not None:
            self._session.explain_failure(exception)

    def teardown(self) -> None:
        # Offloaded optimizers keep their swap files past fit (trainer.save_checkpoint after
        # fit needs them); they are removed when the optimizer is freed or at exit.
        if self._session is not None:
            self._session.quiesce()  # no comm thread left in a collective: [Note: orderly exit]
        if isinstance(self.model, DistributedDataParallel):
            self.model = self.lightning_module
        if (module := self.lightning_module) is not None and has_meta(module):
            # set-up stopped before materializing (a refused memory plan): moving meta tensors would hide it
            self._lightning_module = None
        assert self.cluster_environment is not None
        self.cluster_environment.teardown()
        super().teardown()


def _evaluate_under_no_grad(trainer: Any) -> None:
    """Validation, test and predict loops of a sharded model run under ``torch.no_grad``, not
    ``torch.inference_mode``: FSDP2 writes its gathered parameters into buffers it reuses in
    training, and an inference-mode forward makes them inference tensors ("Inference tensors
    do not track version counter", seen on an H100 with NCCL in the main job's validate).
    Lightning decides this for its own FSDPStrategy (and for gloo, which is why CPU runs never
    met it); the same rule for ours."""
    epoch_loop = getattr(trainer.fit_loop, "epoch_loop", None)  # a user's own fit loop may have none
    loops = (getattr(epoch_loop, "val_loop", None), trainer.validate_loop, trainer.test_loop, trainer.predict_loop)
    for loop in loops:
        if loop is not None and hasattr(loop, "inference_mode"):
            loop.inference_mode = False


class ZeroPPStrategy(StrategyMixin, ParallelStrategy):
    """ZeRO data parallelism: stage 1 (sharded optimizer state), 2 (+ sharded gradients),
    3 (+ sharded parameters), with ZeRO++ collectives and offload as configured.

    Args:
        config: a ``ZeroConfig``, a dict of its fields, or a path to a YAML file or a
            DeepSpeed JSON config (its ``zero_optimization`` block is read).
        accelerator, parallel_devices, cluster_environment, checkpoint_io,
        precision_plugin: as for every Lightning strategy (usually set by the Trainer).
        process_group_backend: ``"gloo"``/``"nccl"``; default from the device.
        timeout: collective timeout.
        on_nonfinite: what a NaN/inf loss or gradient does (fp32/bf16; fp16's loss scaler
            handles overflow itself): ``"ignore"`` (default, no check), ``"raise"``
            (``FloatingPointError`` on every rank naming the step, the first non-finite
            parameter and its rank), ``"skip"`` (no update for that step on any rank). The
            check is one all-reduce of a flag per optimizer step.
        resume: ``"auto"``: when ``trainer.fit`` is called without ``ckpt_path``, resume
            from the newest complete checkpoint in the directories of the Trainer's
            ``ModelCheckpoint`` callbacks (their ``dirpath`` must be set: the default one
            changes with every run's version), or start from scratch when there is none.
            A directory path: the same, in that directory. Interrupted saves are never
            chosen. Made for restarts (torchrun ``--max-restarts``, a scheduler's requeue):
            the same command resumes where the job died. ``None`` (default): off.
        **config_fields: any ``ZeroConfig`` field, overriding ``config`` (e.g.
            ``stage=2``, ``wrap_modules=["GPT2Block"]``).
    """

    # lightning.pytorch's own names ([Note: two Lightning packages])
    _launcher_cls = ResumingLauncher
    _precision_cls = ZeroPPPrecision
    _result_collection_cls = _ResultCollection
    _trainer_fn = TrainerFn
    _forward_redirection_cls = _ForwardRedirection
    _ddp_forward_redirection_cls = _DDPForwardRedirection
    _prepare_for_backward = staticmethod(prepare_for_backward)
    _model_checkpoint_cls = ModelCheckpoint

"""``ZeroPPStrategy``: ZeRO stages 1/2/3 (and ZeRO++) as a Lightning strategy.

    Trainer(strategy="zeropp_stage_3", accelerator="cpu", devices=2)
    Trainer(strategy=ZeroPPStrategy(stage=2, activation_checkpointing=True))
    Trainer(strategy=ZeroPPStrategy(config="ds_config.json"))  # DeepSpeed JSON

Lifecycle (what happens where, and why there):
- ``__init__``: the ZeroConfig is built and validated; a bad value raises here, on
  every rank, before any process group exists.
- ``setup_environment``: job-size checks (``validate_for_world``), topology detection,
  process group, device meshes, CommLedger. Still no collective before the checks.
- ``setup``: stage 1 wraps the module in DDP (gradient all-reduce through a ledger
  hook) and each optimizer in ``ShardedOptimizer``; stages 2/3 apply FSDP2
  (``engine.fsdp.shard_module``) before ``configure_optimizers`` runs, so optimizers
  are built over the sharded parameters.
- every ``*_step`` goes through the root module's ``__call__`` (Lightning's
  ``_ForwardRedirection``) so FSDP2's root hooks run; backward runs inside the ledger's
  BACKWARD phase so parameter gathers are booked as forward or backward correctly.
"""

from __future__ import annotations

import inspect
import logging
from collections.abc import Generator, Mapping
from contextlib import contextmanager, nullcontext
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch
from lightning.fabric.plugins import CheckpointIO, ClusterEnvironment
from lightning.fabric.plugins.collectives.torch_collective import default_pg_timeout
from lightning.fabric.utilities.distributed import _sync_ddp_if_available
from lightning.fabric.utilities.optimizer import _optimizers_to_device
from lightning.fabric.utilities.types import ReduceOp
from lightning.pytorch.callbacks import ModelCheckpoint
from lightning.pytorch.overrides.distributed import _sync_module_states, prepare_for_backward
from lightning.pytorch.plugins.precision import Precision
from lightning.pytorch.strategies.ddp import _DDPForwardRedirection
from lightning.pytorch.strategies.launchers import _SubprocessScriptLauncher
from lightning.pytorch.strategies.parallel import ParallelStrategy
from lightning.pytorch.strategies.strategy import _ForwardRedirection
from lightning.pytorch.trainer.connectors.logger_connector.result import _ResultCollection
from lightning.pytorch.trainer.states import TrainerFn
from lightning.pytorch.utilities.rank_zero import rank_zero_info
from torch import Tensor
from torch.nn import Module
from torch.nn.parallel import DistributedDataParallel
from torch.optim import Optimizer

from zeropp_strategy._process import ProcessMixin
from zeropp_strategy.comm.ledger import CommLedger, Phase
from zeropp_strategy.config import ZeroConfig
from zeropp_strategy.engine.core import ZeroEngine, check_nonfinite, check_nonfinite_policy
from zeropp_strategy.engine.fsdp import ShardedRoot, fsdp_modules, materialize
from zeropp_strategy.engine.wrap import apply_activation_checkpointing, select_blocks
from zeropp_strategy.engine.memory import MemoryStats, memory_stats
from zeropp_strategy.engine.uneven import EvenBatches
from zeropp_strategy.checkpoint.integrity import rank_zero_writes
from zeropp_strategy.checkpoint.atomic import (
    META_FILE,
    atomic_torch_save,
    find_checkpoints,
    new_nonce,
    publish,
    remove_path,
    safe_load,
    staged_directory,
)
from zeropp_strategy.checkpoint.sharded import (
    CALLBACK_TENSORS,
    CALLBACK_TENSORS_ID,
    FORMAT,
    VERSION,
    hf_models,
    load_model,
    load_optimizer,
    model_tensors,
    optimizer_tensors_and_meta,
    save_tensors,
)
from zeropp_strategy.engine.state import (
    full_model_state,
    full_optimizer_state,
    load_full_model_state,
    load_full_optimizer_state,
)
from zeropp_strategy.precision import ZeroPPPrecision, from_lightning_plugin
from zeropp_strategy.presets import PRESETS as PRESETS  # re-export: zeropp_strategy.strategy.PRESETS
from zeropp_strategy.topology import Meshes, Topology

log = logging.getLogger(__name__)
_TENSORS = "__zeropp_tensors__"  # optimizer_state() -> save_checkpoint hand-off key


class _ResumingLauncher(_SubprocessScriptLauncher):
    """Lightning's script launcher; for ``ZeroPPStrategy(resume=...)`` it also fills in
    ``trainer.fit``'s ``ckpt_path`` when the caller gave none (the launcher is the one
    place a strategy sees that argument before the checkpoint is restored)."""

    def launch(self, function: Any, *args: Any, trainer: Any = None, **kwargs: Any) -> Any:
        strategy = getattr(trainer, "strategy", None)
        if isinstance(strategy, ZeroPPStrategy) and strategy.resume is not None \
                and getattr(function, "__name__", "") == "_fit_impl":
            bound = inspect.signature(function).bind(*args, **kwargs)
            if bound.arguments.get("ckpt_path") is None:
                bound.arguments["ckpt_path"] = choice = strategy.resume_path(trainer)
                strategy._resume_choice = [choice]
            args, kwargs = bound.args, bound.kwargs
        return super().launch(function, *args, trainer=trainer, **kwargs)


class ZeroPPStrategy(ProcessMixin, ParallelStrategy):
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

    strategy_name = "zeropp"
    _launcher_cls = _ResumingLauncher
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
        self.skipped_steps = 0  # optimizer steps dropped by on_nonfinite="skip"
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
        self._topology: Topology | None = None
        self._meshes: Meshes | None = None
        self._ledger: CommLedger | None = None
        self._fsdp_redirection = _ForwardRedirection()
        self._ddp_redirection = _DDPForwardRedirection()
        self._grad_sync = True  # False inside block_backward_sync (accumulation)
        self._checkpointed = False
        self._sharded_path: Path | None = None
        self._fsdp_root: ShardedRoot | None = None  # stages 2/3, see [Note: why a separate root]
        self._engine: ZeroEngine | None = None  # set in setup_environment

    # -- identity and sizes ---------------------------------------------------------------

    @property
    def stage(self) -> int:
        return self.config.stage

    @property
    def is_distributed(self) -> bool:
        # Lightning injects a DistributedSampler (and reduces sync_dist logs) only for
        # strategies it knows or that say so here.
        return True

    @property
    def restore_checkpoint_after_setup(self) -> bool:
        # Sharded parameters exist only after setup; load into them, not before.
        return True

    @property
    def topology(self) -> Topology:
        if self._topology is None:
            raise RuntimeError("ZeroPPStrategy.topology is available once the Trainer has set up processes.")
        return self._topology

    @property
    def meshes(self) -> Meshes:
        if self._meshes is None:
            raise RuntimeError("ZeroPPStrategy.meshes are available once the Trainer has set up processes.")
        return self._meshes

    @property
    def comm_ledger(self) -> CommLedger:
        if self._ledger is None:
            raise RuntimeError("ZeroPPStrategy.comm_ledger is available once the Trainer has set up processes.")
        return self._ledger

    def comm_stats(self, reset: bool = False) -> dict[str, Any]:
        """This rank's CommLedger summary (bytes sent, intra/inter-node, by kind)."""
        stats = self.comm_ledger.summary()
        if reset:
            self.comm_ledger.reset()
        return stats

    def reset_comm_stats(self) -> None:
        self.comm_ledger.reset()

    def _fsdp_groups(self) -> list[Module]:
        """The modules FSDP2 shards as one group each (blocks, then the root)."""
        return list(fsdp_modules(self._fsdp_root)) if self._fsdp_root is not None else []

    def memory_stats(self) -> MemoryStats:
        """Bytes this rank holds in params/grads/optimizer state, beside the stage's formula."""
        assert self.lightning_module is not None
        return memory_stats(
            self.lightning_module, list(self.optimizers), stage=self.stage, rank=self.global_rank, world_size=self.world_size
        )

    # -- precision ------------------------------------------------------------------------

    @property
    def precision_plugin(self) -> ZeroPPPrecision:
        plugin = self._precision_plugin
        if plugin is None:
            plugin = self._precision_plugin = ZeroPPPrecision("32-true", device=self._device_type())
        return plugin  # type: ignore[return-value]

    @precision_plugin.setter
    def precision_plugin(self, plugin: Precision | None) -> None:
        self._precision_plugin = None if plugin is None else from_lightning_plugin(plugin, self._device_type())

    def _device_type(self) -> str:
        devices = self.parallel_devices
        return devices[0].type if devices else "cpu"

    # -- process group --------------------------------------------------------------------

    def _configure_launcher(self) -> None:
        # Always (as Lightning's DDP does): the launcher only starts processes when nobody
        # else did, and it is where fit's ckpt_path is seen (resume="auto").
        assert self.cluster_environment is not None
        self._launcher = self._launcher_cls(self.cluster_environment, self.num_processes, self.num_nodes)

    def resume_path(self, trainer: Any) -> str | None:
        """The checkpoint ``resume`` picks for ``trainer`` now (newest complete one), or None.
        Rank-local (no collective); raises ``ValueError`` when there is no directory to look in."""
        if self.resume is None:
            return None
        if str(self.resume) == "auto":
            dirs = sorted({str(cb.dirpath) for cb in trainer.checkpoint_callbacks
                           if isinstance(cb, ModelCheckpoint) and cb.dirpath is not None})
            if not dirs:
                raise ValueError(
                    "ZeroPPStrategy(resume='auto') needs a ModelCheckpoint with a fixed directory, and this "
                    "Trainer has none (the default directory, lightning_logs/version_N/checkpoints, changes with "
                    "every run, so a restarted job would not find its checkpoints). Fix: pass "
                    "callbacks=[ModelCheckpoint(dirpath='checkpoints/', ...)], or resume='checkpoints/'."
                )
        else:
            dirs = [str(self.resume)]
        found = [p for d in dirs if Path(d).is_dir() for p in find_checkpoints(Path(d))]
        if not found:
            rank_zero_info(f"zeropp: resume={str(self.resume)!r}: no complete checkpoint in {', '.join(dirs)}; "
                           "starting from scratch")
            return None
        newest = max(found, key=lambda p: (p.stat().st_mtime, str(p)))
        rank_zero_info(f"zeropp: resume={str(self.resume)!r}: resuming from {newest}")
        return str(newest)

    def _check_resume_choice(self) -> None:
        """Every rank must resume from the same checkpoint (or none): ranks of one job that
        see the file system differently would otherwise load different states, or some
        would wait in a load the others never start."""
        if not self._resume_choice:
            return
        mine = self._resume_choice.pop()
        everyone: list[Any] = [None] * self.world_size
        torch.distributed.all_gather_object(everyone, mine)
        if any(c != everyone[0] for c in everyone):
            shown = "; ".join(f"rank {r}: {c}" for r, c in enumerate(everyone))
            raise ValueError(f"ZeroPPStrategy(resume=...) chose different checkpoints on different ranks ({shown}). "
                             "Fix: keep the checkpoint directory on a file system every node sees the same way, or "
                             "pass ckpt_path explicitly.")

    def setup_environment(self) -> None:
        super().setup_environment()
        self._connect()
        self._check_resume_choice()
        if self._engine is not None:
            # A later trainer.fit/validate/test on the same Trainer: the model is already
            # sharded and its comm objects book into this engine's ledger, so keep both
            # (a new ledger would stay at zero; the ledger counts the Trainer's whole life).
            return
        self._engine = self._start_engine(self.precision_plugin)
        self._topology, self._meshes, self._ledger = self._engine.topology, self._engine.meshes, self._engine.ledger
        rank_zero_info(f"zeropp: stage {self.stage}, {self._topology.describe()}")

    # -- model and optimizers -------------------------------------------------------------

    def setup(self, trainer: Any) -> None:
        assert self.accelerator is not None and self.model is not None
        self.accelerator.setup(trainer)
        fitting = trainer.state.fn == TrainerFn.FITTING
        if self.stage == 1:
            # Meta-device init: materialize the full module; DDP's construction then
            # broadcasts rank 0's values, so every replica starts identical.
            materialize(self.model, self.root_device)
            self.model = self.precision_plugin.convert_module(self.model)
            self.model_to_device()
            if fitting and self.config.activation_checkpointing and not self._checkpointed:
                blocks = select_blocks(
                    self.model, wrap_modules=self.config.wrap_modules, wrap_min_params=self.config.wrap_min_params
                )
                apply_activation_checkpointing(blocks)
                self._checkpointed = True
            if fitting:
                self.model = self.engine.wrap_ddp(self.model)
                self.setup_optimizers(trainer)
            else:
                _sync_module_states(self.model)
        else:
            if self._fsdp_root is None or self._fsdp_root.module is not self.model:
                self.model = self.precision_plugin.convert_module(self.model)
                # See [Note: why a separate root]: FSDP2's root owns the LightningModule.
                self._fsdp_root = ShardedRoot(self.model)
                self.engine.shard(self._fsdp_root)
            self.model_to_device()
            if fitting:
                self.setup_optimizers(trainer)
        self.setup_precision_plugin()
        if fitting:
            _optimizers_to_device(self.optimizers, self.root_device)

    @property
    def engine(self) -> ZeroEngine:
        if self._engine is None:
            raise RuntimeError("ZeroPPStrategy.engine is available once the Trainer has set up processes.")
        return self._engine

    @property
    def hpz_partition_size(self) -> int:
        """Effective hpZ group size: 1 when off or when it cannot help (one group = all ranks)."""
        return self.engine.hpz_partition_size

    @property
    def _param_store(self) -> Any:
        """offload_param="nvme": the ParamStore of the sharded module (None otherwise)."""
        stores = self._engine.param_stores if self._engine is not None else []
        return stores[-1] if stores else None

    def setup_optimizers(self, trainer: Any) -> None:
        # Re-entering setup (fit after fit) must build optimizers over the current params.
        self._reset_optimizers_and_schedulers()
        super().setup_optimizers(trainer)
        self.optimizers = [self.engine.wrap_optimizer(opt) for opt in self.optimizers]

    def model_to_device(self) -> None:
        assert self.model is not None
        self.engine.module_to_device(self._fsdp_root if self._fsdp_root is not None else self.model)

    @contextmanager
    def tensor_init_context(self, empty_init: bool | None = None) -> Generator[None, None, None]:
        # Stage 2/3 materialize meta tensors shard by shard in setup(); stage 1 needs
        # real full tensors on every rank, so it ignores empty_init.
        meta = torch.device("meta") if empty_init and self.stage in (2, 3) else nullcontext()
        with meta, self.precision_plugin.tensor_init_context():
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
        with self.precision_plugin.train_step_context(), self.comm_ledger.phase(Phase.FORWARD):
            return self._redirect("training_step", *args, **kwargs)

    def validation_step(self, *args: Any, **kwargs: Any) -> Any:
        with self.precision_plugin.val_step_context(), self.comm_ledger.phase(Phase.FORWARD):
            return self._evaluation_step("validation_step", *args, **kwargs)

    def test_step(self, *args: Any, **kwargs: Any) -> Any:
        with self.precision_plugin.test_step_context(), self.comm_ledger.phase(Phase.FORWARD):
            return self._evaluation_step("test_step", *args, **kwargs)

    # -- uneven evaluation inputs: see [Note: uneven evaluation] ---------------------------

    def process_dataloader(self, dataloader: Any) -> Any:
        trainer = self.lightning_module._trainer if self.lightning_module is not None else None
        if (self.stage == 3 and self.world_size > 1 and trainer is not None
                and (trainer.sanity_checking or trainer.validating or trainer.testing)):
            device = self.root_device if self.process_group_backend == "nccl" else None
            return EvenBatches(dataloader, device=device)
        return dataloader

    def _evaluation_step(self, method: str, *args: Any, **kwargs: Any) -> Any:
        trainer = self.lightning_module._trainer if self.lightning_module is not None else None
        loop = trainer._evaluation_loop if trainer is not None else None
        combined = getattr(loop, "_combined_loader", None)
        if combined is None:
            return self._redirect(method, *args, **kwargs)
        index = loop._results.dataloader_idx or 0
        loaders = combined.flattened
        wrapper = loaders[index] if index < len(loaders) else None
        if not isinstance(wrapper, EvenBatches) or not wrapper.take_padding_flag() or wrapper.real_batches == 0:
            return self._redirect(method, *args, **kwargs)
        # A padding batch: run the step (its forwards are collectives the other ranks are in)
        # but throw away what it logs and returns.
        kept = loop._results
        scratch = _ResultCollection(training=False)
        scratch.batch, scratch.batch_size, scratch.dataloader_idx = kept.batch, kept.batch_size, kept.dataloader_idx
        loop._results = scratch
        try:
            self._redirect(method, *args, **kwargs)
        finally:
            loop._results = kept
        return None

    def predict_step(self, *args: Any, **kwargs: Any) -> Any:
        with self.precision_plugin.predict_step_context(), self.comm_ledger.phase(Phase.FORWARD):
            return self._redirect("predict_step", *args, **kwargs)

    def backward(self, closure_loss: Tensor, optimizer: Optimizer | None, *args: Any, **kwargs: Any) -> Tensor:
        with self.comm_ledger.phase(Phase.BACKWARD):
            return super().backward(closure_loss, optimizer, *args, **kwargs)

    def optimizer_step(self, optimizer: Optimizer, closure: Any, model: Any = None, **kwargs: Any) -> Any:
        if self.on_nonfinite == "ignore" or getattr(self.precision_plugin, "scaler", None) is not None:
            return super().optimizer_step(optimizer, closure, model, **kwargs)

        def checked() -> Any:
            out = closure()
            self._check_nonfinite(out)
            return out

        return super().optimizer_step(optimizer, checked, model, **kwargs)

    def _check_nonfinite(self, loss: Any) -> None:
        assert self.lightning_module is not None
        trainer = self.lightning_module._trainer
        if check_nonfinite(list(self.lightning_module.named_parameters()), loss, policy=self.on_nonfinite,
                           step=trainer.global_step if trainer is not None else -1, where="ZeroPPStrategy",
                           device=self.root_device):
            self.skipped_steps += 1

    def pre_backward(self, closure_loss: Tensor) -> None:
        # Manual optimization under DDP (stage 1) must tell the reducer what to expect.
        if isinstance(self.model, DistributedDataParallel) and not self.lightning_module.automatic_optimization:
            prepare_for_backward(self.model, closure_loss)

    def post_backward(self, closure_loss: Tensor) -> None:
        if self._grad_sync and self._fsdp_root is not None:
            self.engine.reduce_replicated_grads(self._fsdp_root)

    @contextmanager
    def block_backward_sync(self) -> Generator[None, None, None]:
        """No gradient communication on non-boundary micro-batches (accumulation)."""
        self._grad_sync = False
        try:
            if isinstance(self.model, DistributedDataParallel):
                with self.model.no_sync():
                    yield
            elif self._fsdp_root is not None:
                self._fsdp_root.set_requires_gradient_sync(False)
                try:
                    yield
                finally:
                    self._fsdp_root.set_requires_gradient_sync(True)
            else:
                yield
        finally:
            self._grad_sync = True

    # -- collectives for Lightning (logging, barriers) --------------------------------------

    def reduce(self, tensor: Any, group: Any = None, reduce_op: ReduceOp | str | None = "mean") -> Any:
        if isinstance(tensor, Tensor):
            return _sync_ddp_if_available(tensor, group, reduce_op=reduce_op)
        return tensor

    # -- checkpoints ----------------------------------------------------------------------
    # Two formats (see docs/checkpointing.md): "sharded", a directory every rank writes in
    # parallel ([Note: sharded checkpoint format v1]); "full", one file rank 0 writes,
    # identical in layout to what strategy="ddp" saves. Both are published atomically
    # ([Note: atomic saves]). Loading detects the format from the path.

    @property
    def state_dict_type(self) -> str:
        return self.config.resolved_state_dict_type()

    def lightning_module_state_dict(self) -> dict[str, Any]:
        assert self.lightning_module is not None
        if self.state_dict_type == "sharded":
            return model_tensors(self.lightning_module)
        return full_model_state(self.lightning_module, keep=self.is_global_zero, ledger=self._ledger)

    def optimizer_state(self, optimizer: Optimizer) -> dict[str, Any]:
        if self.state_dict_type == "sharded":
            assert self.lightning_module is not None
            tensors, meta = optimizer_tensors_and_meta(self.lightning_module, optimizer)
            return {_TENSORS: tensors, **meta}
        return full_optimizer_state(optimizer, keep=self.is_global_zero, ledger=self._ledger)

    def save_checkpoint(self, checkpoint: dict[str, Any], filepath: Any, storage_options: Any = None) -> None:
        if storage_options is not None:
            raise TypeError(
                "ZeroPPStrategy.save_checkpoint(storage_options=...) is not supported: checkpoints are "
                "written by the strategy, not a CheckpointIO plugin. Fix: drop storage_options."
            )
        path = Path(self.broadcast(str(filepath)))
        nonce = self.broadcast(new_nonce())
        if self.state_dict_type == "full" or not isinstance(checkpoint.get("state_dict"), dict):
            # The zeropp block lets `zeropp consolidate --hf` export full files too;
            # strategy="ddp" ignores unknown top-level keys.
            info = {**self._checkpoint_info(), "format": "zeropp-full", "tokenizer_dir": None}
            # A failed write (a full disk) raises on every rank, none waits for rank 0.
            rank_zero_writes(f"writing {path}", lambda: atomic_torch_save({**checkpoint, "zeropp": info}, path))
            self.barrier()
            return
        checkpoint = dict(checkpoint)
        tensors: dict[str, Any] = {"model": checkpoint.pop("state_dict")}
        optimizer_states = checkpoint.pop("optimizer_states", None)
        if optimizer_states is not None:
            tensors["optim"] = {str(i): dict(s)[_TENSORS] for i, s in enumerate(optimizer_states)}
            checkpoint["optimizer_states"] = [{k: v for k, v in s.items() if k != _TENSORS} for s in optimizer_states]
        callback_states = checkpoint.get("callbacks")
        if isinstance(callback_states, dict):
            moved: dict[str, Any] = {}
            for i, (key, state) in enumerate(list(callback_states.items())):
                if isinstance(state, dict) and CALLBACK_TENSORS in state:
                    moved[str(i)] = state[CALLBACK_TENSORS]
                    callback_states[key] = {**{k: v for k, v in state.items() if k != CALLBACK_TENSORS},
                                            CALLBACK_TENSORS_ID: str(i)}
            if moved:
                tensors["callbacks"] = moved
        checkpoint["zeropp"] = self._checkpoint_info()
        with staged_directory(path, nonce, is_writer=self.is_global_zero) as tmp:
            self.barrier()  # the directory exists before anyone writes
            save_tensors(tensors, tmp)  # raises on every rank if any rank's write failed
            tokenizer = getattr(self.lightning_module, "tokenizer", None)

            def finish() -> None:  # rank 0, once every shard is on disk
                torch.save(checkpoint, tmp / META_FILE)
                if callable(getattr(tokenizer, "save_pretrained", None)):
                    tokenizer.save_pretrained(str(tmp / "tokenizer"))
                publish(tmp, path, nonce)

            self.barrier()  # every shard is on disk
            rank_zero_writes(f"writing {tmp / META_FILE}", finish)
        self.barrier()

    def _checkpoint_info(self) -> dict[str, Any]:
        assert self.lightning_module is not None
        has_tokenizer = callable(getattr(getattr(self.lightning_module, "tokenizer", None), "save_pretrained", None))
        return {
            "format": FORMAT,
            "version": VERSION,
            "stage": self.stage,
            "world_size": self.world_size,
            "config": self.config.to_dict(),
            "hf": hf_models(self.lightning_module),
            "tokenizer_dir": "tokenizer" if has_tokenizer else None,
        }

    def load_checkpoint(self, checkpoint_path: Any, weights_only: bool | None = None) -> dict[str, Any]:
        path = Path(self.broadcast(str(checkpoint_path)))
        self._sharded_path = None
        if path.is_dir():
            if not (path / META_FILE).is_file():
                raise FileNotFoundError(
                    f"{path} is a directory without {META_FILE}, so it is not a complete zeropp sharded "
                    "checkpoint (an interrupted save leaves a '.tmp-' sibling, never this name). Fix: pass a "
                    "complete checkpoint; zeropp_strategy.checkpoint.find_checkpoints(dir) lists them."
                )
            self._sharded_path = path
            return safe_load(path / META_FILE, weights_only)
        if not path.is_file():
            raise FileNotFoundError(f"checkpoint {path} does not exist. Fix: check ckpt_path.")
        return safe_load(path, weights_only)

    def load_callback_tensors(self, state: Mapping[str, Any], targets: dict[str, Tensor]) -> bool:
        """For callbacks whose ``state_dict()`` put DTensor shards under ``CALLBACK_TENSORS``:
        in a sharded checkpoint those were saved with the model; read them into ``targets``
        (DTensors laid out as now, filled in place). Returns False when ``state`` holds no
        such reference (a full checkpoint: the callback's state has the tensors itself)."""
        if CALLBACK_TENSORS_ID not in state:
            return False
        if self._sharded_path is None:
            raise RuntimeError("a callback's sharded tensors are referenced, but no sharded checkpoint is being "
                               "loaded. Fix: resume from the checkpoint directory the state came from.")
        import torch.distributed.checkpoint as dcp

        dcp.load({"callbacks": {state[CALLBACK_TENSORS_ID]: targets}}, checkpoint_id=str(self._sharded_path))
        return True

    def load_model_state_dict(self, checkpoint: Mapping[str, Any], strict: bool = True) -> None:
        assert self.lightning_module is not None
        if self._sharded_path is not None:
            load_model(self.lightning_module, self._sharded_path, strict=strict)
        else:
            load_full_model_state(self.lightning_module, checkpoint["state_dict"], strict=strict)

    def load_optimizer_state_dict(self, checkpoint: Mapping[str, Any]) -> None:
        states = checkpoint.get("optimizer_states")
        if not states:
            return
        if len(states) != len(self.optimizers):
            raise ValueError(
                f"checkpoint has {len(states)} optimizer states, this run configures {len(self.optimizers)}. "
                "Fix: return the same optimizers from configure_optimizers."
            )
        for index, (optimizer, state) in enumerate(zip(self.optimizers, states)):
            if self._sharded_path is not None:
                assert self.lightning_module is not None
                load_optimizer(self.lightning_module, optimizer, self._sharded_path, index, state)
            else:
                load_full_optimizer_state(optimizer, state)

    def remove_checkpoint(self, filepath: Any) -> None:
        """ModelCheckpoint's top-k removal: files and sharded directories alike."""
        if self.is_global_zero:
            remove_path(Path(filepath))

    # -- end of an evaluation loop --------------------------------------------------------
    # A forward without backward leaves gathered what only backward reshards: the root
    # (FSDP2 never reshards it after forward) and, at stage 2, every block. Training
    # reshards them in its next backward; after validate / test / predict nothing would,
    # and the gathered parameters stayed held (issue 19, item 8).

    def on_validation_end(self) -> None:
        super().on_validation_end()
        self._reshard()

    def on_test_end(self) -> None:
        super().on_test_end()
        self._reshard()

    def on_predict_end(self) -> None:
        super().on_predict_end()
        self._reshard()

    def _reshard(self) -> None:
        for group in self._fsdp_groups():
            group.reshard()  # a no-op for a group that is already sharded

    # -- teardown ------------------------------------------------------------------------

    def on_exception(self, exception: BaseException) -> None:
        # A collective that failed because another rank died: name that rank (waits at
        # most peer_timeout for the evidence). See [Note: peer watchdog].
        watchdog = self._engine.watchdog if self._engine is not None else None
        if watchdog is not None and not isinstance(exception, KeyboardInterrupt):
            watchdog.explain(exception)

    def teardown(self) -> None:
        # Offloaded optimizers keep their swap files past fit (trainer.save_checkpoint after
        # fit needs them); they are removed when the optimizer is freed or at exit.
        if isinstance(self.model, DistributedDataParallel):
            self.model = self.lightning_module
        assert self.cluster_environment is not None
        self.cluster_environment.teardown()
        super().teardown()


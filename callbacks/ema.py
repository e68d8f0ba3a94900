"""Layer: recipes (callbacks). ``ShardedEMA``: an exponential moving average of the weights, one shard per rank.

    trainer = Trainer(strategy="zeropp", callbacks=[ShardedEMA(decay=0.999)])

After every optimizer step, for each trainable floating-point parameter ``p``:
``ema = decay * ema + (1 - decay) * p``, on the part of ``p`` this rank holds. Under
``zeropp`` stages 2 and 3 that is the rank's shard (memory P/N per rank, in fp32); under
stage 1, DDP or one process it is the whole parameter. No communication: each rank
updates what it owns.

- Validation runs on the EMA weights (``validate_with_ema=True``): they are copied into the
  parameters at the start of each validation epoch and the trained weights put back at its
  end (one shard-sized copy of the weights is kept meanwhile).
- Checkpoints hold the EMA in both formats: in the sharded format the shards go to the
  DCP files beside the model's (``callbacks.<i>.<name>``); in the full format they are
  gathered to whole tensors on rank 0. Resuming restores them in the run's current layout,
  so a run can resume on another stage or number of ranks from a full checkpoint.
- ``zeropp consolidate CKPT OUT --ema`` writes the EMA weights in place of the trained ones.

Lightning's ``WeightAveraging`` keeps a full copy of the model on every rank and cannot
average DTensor shards; this is the sharded counterpart.
"""

from __future__ import annotations

from typing import Any

import torch
from lightning.pytorch import Callback, LightningModule, Trainer
from torch import Tensor

from zeropp_strategy.toolkit import is_dtensor as _is_dtensor
from zeropp_strategy.toolkit import local as _local
from zeropp_strategy.toolkit import wait_for_parameters

__all__ = ["ShardedEMA"]




class ShardedEMA(Callback):
    """Exponential moving average of the trainable weights, sharded like them.

    Args:
        decay: weight of the old average (0.999 averages over about 1000 steps).
        every_n_steps: update after every n-th optimizer step.
        start_step: no update before this optimizer step (the average starts from the
            weights at that step).
        validate_with_ema: run validation on the EMA weights.
    """

    def __init__(self, decay: float = 0.999, *, every_n_steps: int = 1, start_step: int = 0,
                 validate_with_ema: bool = True) -> None:
        if not 0.0 < decay < 1.0:
            raise ValueError(f"ShardedEMA(decay={decay}) is invalid: it must be in (0, 1). Fix: e.g. decay=0.999.")
        if every_n_steps < 1:
            raise ValueError(f"ShardedEMA(every_n_steps={every_n_steps}) is invalid. Fix: use 1 or more.")
        self.decay, self.every_n_steps, self.start_step = decay, every_n_steps, start_step
        self.validate_with_ema = validate_with_ema
        self.ema: dict[str, Tensor] = {}  # name -> this rank's part, fp32
        self.num_updates = 0
        self._last_step = -1
        self._params: dict[str, Tensor] = {}
        self._backup: dict[str, Tensor] = {}
        self._trainer: Trainer | None = None
        self._pending: dict[str, Any] | None = None  # state loaded before the EMA existed

    @property
    def state_key(self) -> str:
        return self._generate_state_key(decay=self.decay)

    # -- building and updating --------------------------------------------------------------

    def _bind(self, trainer: Trainer, pl_module: LightningModule) -> None:
        """Point at the parameters as they are now (after the strategy sharded them)."""
        self._trainer = trainer
        self._params = {n: p for n, p in pl_module.named_parameters() if p.requires_grad and p.is_floating_point()}
        if not self.ema:
            with torch.no_grad():
                self.ema = {n: _local(p).detach().float().clone() for n, p in self._params.items()}
        if self._pending is not None:
            pending, self._pending = self._pending, None
            self.load_state_dict(pending)

    def on_fit_start(self, trainer: Trainer, pl_module: LightningModule) -> None:
        self._bind(trainer, pl_module)

    def on_validation_start(self, trainer: Trainer, pl_module: LightningModule) -> None:
        if not self._params:
            self._bind(trainer, pl_module)

    @torch.no_grad()
    def update(self) -> None:
        """One EMA step from the current weights (no communication)."""
        weight = 1.0 - self.decay
        for name, p in self._params.items():
            self.ema[name].lerp_(_local(p).float(), weight)
        self.num_updates += 1

    def on_train_batch_end(self, trainer: Trainer, pl_module: LightningModule, outputs: Any, batch: Any,
                           batch_idx: int) -> None:
        step = trainer.global_step
        if step == self._last_step:  # gradient accumulation: no optimizer step in this batch
            return
        self._last_step = step
        if step < self.start_step or step % self.every_n_steps:
            return
        wait_for_parameters(trainer.optimizers)  # stage 1 gathers the updated rows after the step
        if self.num_updates == 0 and step > 0 and self.start_step > 0:
            with torch.no_grad():  # the average starts from the weights at start_step
                for name, p in self._params.items():
                    self.ema[name].copy_(_local(p).float())
        self.update()

    # -- validation on the EMA weights ---------------------------------------------------------

    @torch.no_grad()
    def swap_in(self) -> None:
        """Copy the EMA into the parameters, keeping the trained weights aside."""
        if self._trainer is not None:  # a stage-1 gather finishing later would overwrite the copy
            wait_for_parameters(self._trainer.optimizers)
        self._backup = {n: _local(p).detach().clone() for n, p in self._params.items()}
        for name, p in self._params.items():
            _local(p).copy_(self.ema[name])

    @torch.no_grad()
    def swap_out(self) -> None:
        """Put the trained weights back."""
        for name, p in self._params.items():
            _local(p).copy_(self._backup[name])
        self._backup = {}

    def on_validation_epoch_start(self, trainer: Trainer, pl_module: LightningModule) -> None:
        if self.validate_with_ema and self.ema and not trainer.sanity_checking:
            self.swap_in()

    def on_validation_epoch_end(self, trainer: Trainer, pl_module: LightningModule) -> None:
        if self._backup:
            self.swap_out()

    # -- checkpoints --------------------------------------------------------------------------

    def _as_dtensor(self, name: str) -> Tensor:
        """This rank's average as a DTensor laid out like its parameter (the plain tensor
        for a parameter that is not sharded, e.g. a 0-dim one FSDP2 leaves replicated)."""
        from torch.distributed.tensor import DTensor

        p = self._params[name]
        if not _is_dtensor(p):
            return self.ema[name]
        return DTensor.from_local(self.ema[name], p.device_mesh, p.placements, shape=p.shape, stride=p.stride(),
                                  run_check=False)

    def state_dict(self) -> dict[str, Any]:
        """Called on every rank when a checkpoint is written (a collective in the full format)."""
        state: dict[str, Any] = {"decay": self.decay, "num_updates": self.num_updates}
        if not self.ema:
            return state
        sharded = any(_is_dtensor(p) for p in self._params.values())
        strategy = self._trainer.strategy if self._trainer is not None else None
        if sharded and getattr(strategy, "state_dict_type", "full") == "sharded":
            from zeropp_strategy.toolkit import CALLBACK_TENSORS

            state[CALLBACK_TENSORS] = {n: self._as_dtensor(n) for n in self.ema}
        elif sharded:
            rank0 = self._trainer is None or self._trainer.global_rank == 0
            full = {}
            for n in self.ema:  # one gathered tensor at a time; kept on rank 0 only
                t = self._as_dtensor(n)
                t = t.full_tensor() if _is_dtensor(t) else t
                if rank0:
                    full[n] = t.cpu()
            state["ema"] = full
        else:
            state["ema"] = {n: t.detach().cpu().clone() for n, t in self.ema.items()}
        return state

    @torch.no_grad()
    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.num_updates = int(state.get("num_updates", 0))
        if not self._params:  # restored before fit started: apply once the parameters exist
            self._pending = dict(state)
            return
        from zeropp_strategy.toolkit import CALLBACK_TENSORS_ID

        if CALLBACK_TENSORS_ID in state:
            targets = {n: self._as_dtensor(n) for n in self.ema}
            self._trainer.strategy.load_callback_tensors(state, targets)  # fills self.ema in place
            return
        saved = state.get("ema", {})
        missing = sorted(set(self.ema) - set(saved))
        if missing:
            raise KeyError(f"ShardedEMA: the checkpoint has no average for {missing[:5]}. Fix: resume from a "
                           "checkpoint of this model written with ShardedEMA, or drop the callback's state.")
        for name, p in self._params.items():
            full = saved[name].float()
            if _is_dtensor(p):
                from torch.distributed.tensor import distribute_tensor

                full = distribute_tensor(full.to(p.device), p.device_mesh, p.placements, src_data_rank=None).to_local()
            self.ema[name].copy_(full)

    def on_load_checkpoint(self, trainer: Trainer, pl_module: LightningModule, checkpoint: dict[str, Any]) -> None:
        self._bind(trainer, pl_module)  # load_state_dict, called next, fills the averages in place

    def full_average(self) -> dict[str, Tensor]:
        """Collective: the whole averaged weights (CPU) on every rank, for inspection/tests."""
        out = {}
        for name in self.ema:
            t = self._as_dtensor(name)
            t = t.full_tensor() if _is_dtensor(t) else t
            out[name] = t.detach().cpu().clone()
        return out

"""Layer: front-end (Lightning). Checkpoint hooks of ``ZeroPPStrategy``: Lightning's checkpoint
dict saved and loaded in our two formats (``state_dict_type``: one sharded directory, or one
full file written by rank 0), through ``zeropp_strategy/checkpoint/lightning.py``. A mixin of the strategy
(listed before ``ParallelStrategy``), kept apart so that strategy.py reads as the adapter it
is; it names no Lightning package, so both flavours' strategies share it.

Loading happens after ``setup`` (``restore_checkpoint_after_setup``): the sharded parameters
the state is read into exist only then.
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import Any

from torch import Tensor
from torch.optim import Optimizer

from zeropp_strategy.checkpoint import lightning as layout
from zeropp_strategy.checkpoint.atomic import remove_path
from zeropp_strategy.checkpoint.protocol import load_callback_tensors

__all__ = ["CheckpointMixin"]


class CheckpointMixin:
    """Checkpoint hooks of ``ZeroPPStrategy`` (see the module docstring)."""

    _sharded_path: Path | None  # the sharded checkpoint being loaded, set by load_checkpoint
    state_dict_type: str  # ProcessMixin's: the session's plan once it has started

    @property
    def restore_checkpoint_after_setup(self) -> bool:
        # Sharded parameters exist only after setup; load into them, not before.
        return True

    def lightning_module_state_dict(self) -> dict[str, Any]:
        assert self.lightning_module is not None
        return layout.model_state(self.lightning_module, sharded=self.state_dict_type == "sharded",
                                  keep=self.is_global_zero, ledger=self.comm_ledger)

    def optimizer_state(self, optimizer: Optimizer) -> dict[str, Any]:
        assert self.lightning_module is not None
        return layout.optimizer_state(self.lightning_module, optimizer, sharded=self.state_dict_type == "sharded",
                                      keep=self.is_global_zero, ledger=self.comm_ledger)

    def save_checkpoint(self, checkpoint: dict[str, Any], filepath: Any, storage_options: Any = None) -> None:
        if storage_options is not None:
            raise TypeError(
                "ZeroPPStrategy.save_checkpoint(storage_options=...) is not supported: checkpoints are "
                "written by the strategy, not a CheckpointIO plugin. Fix: drop storage_options."
            )
        assert self.lightning_module is not None
        path = Path(self.broadcast(str(filepath)))
        zeropp = layout.info(self.lightning_module, stage=self.stage, world_size=self.world_size,
                             config=self.config.to_dict())
        layout.save(path, checkpoint, self.lightning_module, nonce=self.session.new_nonce(),
                    full=self.state_dict_type == "full", zeropp=zeropp, rank_zero=self.is_global_zero,
                    barrier=self.barrier)

    def load_checkpoint(self, checkpoint_path: Any, weights_only: bool | None = None) -> dict[str, Any]:
        checkpoint, self._sharded_path = layout.open_checkpoint(Path(self.broadcast(str(checkpoint_path))),
                                                                weights_only)
        return checkpoint

    def load_callback_tensors(self, state: Mapping[str, Any], targets: dict[str, Tensor]) -> bool:
        """For callbacks whose ``state_dict()`` put DTensor shards under ``CALLBACK_TENSORS``:
        in a sharded checkpoint those were saved with the model; read them into ``targets``
        (DTensors laid out as now, filled in place). Returns False when ``state`` holds no
        such reference (a full checkpoint: the callback's state has the tensors itself)."""
        return load_callback_tensors(self._sharded_path, state, targets)

    def load_model_state_dict(self, checkpoint: Mapping[str, Any], strict: bool = True) -> None:
        assert self.lightning_module is not None
        layout.load_model_state(self.lightning_module, checkpoint, self._sharded_path, strict=strict)

    def load_optimizer_state_dict(self, checkpoint: Mapping[str, Any]) -> None:
        assert self.lightning_module is not None
        layout.load_optimizer_states(self.lightning_module, list(self.optimizers), checkpoint, self._sharded_path)

    def remove_checkpoint(self, filepath: Any) -> None:
        """ModelCheckpoint's top-k removal: files and sharded directories alike."""
        if self.is_global_zero:
            remove_path(Path(filepath))

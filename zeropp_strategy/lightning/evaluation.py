"""Layer: front-end (Lightning). Evaluation under ``ZeroPPStrategy``: validation, test and
predict steps, uneven evaluation loaders at stage 3, and freeing what a forward-only loop
left gathered. A mixin of the strategy (listed before ``ParallelStrategy``), kept apart so
that strategy.py reads as the adapter it is.

Uneven loaders: see [Note: uneven evaluation] in zeropp_strategy/engine/uneven.py.

No Lightning package is named here, so both flavours' strategies share the mixin; the one
class it builds, the loop's ``_ResultCollection``, is the host's ``_result_collection_cls``.
"""

from __future__ import annotations

from typing import Any

from zeropp_strategy.comm.ledger import Phase
from zeropp_strategy.engine.uneven import EvenBatches

__all__ = ["EvaluationMixin"]


class EvaluationMixin:
    """Evaluation hooks of ``ZeroPPStrategy`` (see the module docstring)."""

    _result_collection_cls: Any  # the flavour's _ResultCollection, set by the strategy class

    def validation_step(self, *args: Any, **kwargs: Any) -> Any:
        with self.precision_plugin.val_step_context(), self.session.phase(Phase.FORWARD):
            return self._evaluation_step("validation_step", *args, **kwargs)

    def test_step(self, *args: Any, **kwargs: Any) -> Any:
        with self.precision_plugin.test_step_context(), self.session.phase(Phase.FORWARD):
            return self._evaluation_step("test_step", *args, **kwargs)

    def predict_step(self, *args: Any, **kwargs: Any) -> Any:
        with self.precision_plugin.predict_step_context(), self.session.phase(Phase.FORWARD):
            return self._redirect("predict_step", *args, **kwargs)

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
        scratch = self._result_collection_cls(training=False)
        scratch.batch, scratch.batch_size, scratch.dataloader_idx = kept.batch, kept.batch_size, kept.dataloader_idx
        loop._results = scratch
        try:
            self._redirect(method, *args, **kwargs)
        finally:
            loop._results = kept
        return None

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
        if self._fsdp_root is not None and self._session is not None:
            self._session.reshard([self._fsdp_root])

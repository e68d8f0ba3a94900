"""Layer: recipes (callbacks). What sharding and ZeRO++ do, per training step, for any Lightning logger.

    trainer = Trainer(strategy="zeropp", callbacks=[CommVolumeMonitor(), MemoryMonitor(), ThroughputMonitor()])

Each callback logs with ``LightningModule.log`` on step (CSV, TensorBoard, W&B...), the
values of *this* rank (Lightning's loggers write rank 0's). ``CommVolumeMonitor`` and
``MemoryMonitor`` need ``strategy="zeropp"`` (its comm ledger and memory accounting); under
any other strategy they warn once and log nothing. ``ThroughputMonitor`` works everywhere.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

import torch
from lightning.pytorch import Callback, LightningModule, Trainer
from lightning.pytorch.utilities import rank_zero_warn

__all__ = ["CommVolumeMonitor", "MemoryMonitor", "ThroughputMonitor", "count_tokens"]

_FIELDS = ("intra_bytes", "inter_bytes", "calls", "baseline_intra_bytes", "baseline_inter_bytes")


def _zeropp(trainer: Trainer, who: str) -> Any:
    strategy = trainer.strategy
    if not hasattr(strategy, "comm_ledger") or not hasattr(strategy, "memory_stats"):
        rank_zero_warn(f"{who} reports what strategy='zeropp' does; {type(strategy).__name__} has no comm ledger "
                       "or memory accounting, so it logs nothing. Fix: use strategy='zeropp' (any stage).")
        return None
    return strategy


class CommVolumeMonitor(Callback):
    """Bytes this rank sent during each training step, from the strategy's ``CommLedger``.

    Logged per step (prefix ``comm/``): ``total_bytes``, ``intra_bytes``, ``inter_bytes``
    (to ranks on the same / another node), ``<kind>_bytes`` for each collective kind
    (``param_allgather_fwd``, ``param_allgather_bwd``, ``param_update_allgather``,
    ``grad_reduce``, ``other``), and ``vs_unquantized``: the step's bytes over what the
    same collectives would have sent unquantized (the ledger's baseline counts), i.e. the
    saving of qwZ/qgZ (1.0 without them). ``inter_vs_unquantized`` is the same for
    inter-node bytes, the ones ZeRO++ targets.

    Args:
        prog_bar: show ``comm/total_bytes`` (as MB) in the progress bar.
        by_kind: also log one value per collective kind.
    """

    def __init__(self, *, prog_bar: bool = False, by_kind: bool = True) -> None:
        self.prog_bar, self.by_kind = prog_bar, by_kind
        self._strategy: Any = None
        self._before: dict[str, tuple[int, ...]] = {}
        self.last: dict[str, float] = {}  # the values logged at the last step

    def setup(self, trainer: Trainer, pl_module: LightningModule, stage: str) -> None:
        self._strategy = _zeropp(trainer, "CommVolumeMonitor")

    def _snapshot(self) -> dict[str, tuple[int, ...]]:
        from zeropp_strategy import CommKind

        ledger = self._strategy.comm_ledger
        return {k.value: tuple(getattr(ledger.totals(k), f) for f in _FIELDS) for k in CommKind}

    def on_train_batch_start(self, trainer: Trainer, pl_module: LightningModule, batch: Any, batch_idx: int) -> None:
        if self._strategy is not None:
            self._before = self._snapshot()

    def on_train_batch_end(self, trainer: Trainer, pl_module: LightningModule, outputs: Any, batch: Any,
                           batch_idx: int) -> None:
        if self._strategy is None or not self._before:
            return
        after = self._snapshot()
        step = {k: [a - b for a, b in zip(after[k], self._before[k])] for k in after}
        total = [sum(v[i] for v in step.values()) for i in range(len(_FIELDS))]
        intra, inter, _, base_intra, base_inter = total
        values = {
            "comm/total_bytes": float(intra + inter),
            "comm/intra_bytes": float(intra),
            "comm/inter_bytes": float(inter),
            "comm/vs_unquantized": (intra + inter) / (base_intra + base_inter) if base_intra + base_inter else 1.0,
            "comm/inter_vs_unquantized": inter / base_inter if base_inter else 1.0,
        }
        if self.by_kind:
            values.update({f"comm/{k}_bytes": float(v[0] + v[1]) for k, v in step.items()})
        self.last = values
        pl_module.log_dict(values, on_step=True, on_epoch=False, sync_dist=False, rank_zero_only=False)
        if self.prog_bar:
            pl_module.log("comm_MB", values["comm/total_bytes"] / 1e6, prog_bar=True, on_step=True, on_epoch=False)


class MemoryMonitor(Callback):
    """Per-rank bytes in parameters, gradients and optimizer state, beside the stage's formula.

    Logged every ``every_n_steps`` (prefix ``memory/``): ``param_bytes``, ``grad_bytes``,
    ``optimizer_bytes``, ``total_bytes``, the formula's ``predicted_*`` for each, the
    optimizer state offloaded to ``offloaded_cpu_bytes`` / ``offloaded_nvme_bytes``,
    ``peak_rss_bytes`` (this process) and ``cuda_max_allocated_bytes`` (with CUDA). The
    numbers are ``strategy.memory_stats()`` (``zeropp_strategy.engine.memory``).

    Warns once when the next stage would free at least ``raise_stage_fraction`` of what the
    rank holds (stage 1 -> 2 shards the gradients, 2 -> 3 the parameters): the room a
    larger batch could use.
    """

    def __init__(self, *, every_n_steps: int = 1, raise_stage_fraction: float = 0.25) -> None:
        if every_n_steps < 1:
            raise ValueError(f"MemoryMonitor(every_n_steps={every_n_steps}) is invalid. Fix: use 1 or more.")
        self.every_n_steps, self.raise_stage_fraction = every_n_steps, raise_stage_fraction
        self._strategy: Any = None
        self._warned = False
        self.last: dict[str, float] = {}

    def setup(self, trainer: Trainer, pl_module: LightningModule, stage: str) -> None:
        self._strategy = _zeropp(trainer, "MemoryMonitor")

    @staticmethod
    def next_stage_saving(stats: Any) -> int:
        """Bytes per rank the next stage's formula would free (0 at stage 3)."""
        n = stats.world_size
        if stats.stage == 1:
            return stats.predicted_grad_bytes * (n - 1) // n
        if stats.stage == 2:
            return stats.predicted_param_bytes * (n - 1) // n
        return 0

    def on_train_batch_end(self, trainer: Trainer, pl_module: LightningModule, outputs: Any, batch: Any,
                           batch_idx: int) -> None:
        if self._strategy is None or trainer.global_step % self.every_n_steps:
            return
        stats = self._strategy.memory_stats()
        d = stats.as_dict()
        keys = ("param_bytes", "grad_bytes", "optimizer_bytes", "total_bytes", "predicted_param_bytes",
                "predicted_grad_bytes", "predicted_optimizer_bytes", "predicted_total_bytes", "offloaded_cpu_bytes",
                "offloaded_nvme_bytes", "peak_rss_bytes")
        values = {f"memory/{k}": float(d[k]) for k in keys}
        if torch.cuda.is_available() and pl_module.device.type == "cuda":
            values["memory/cuda_max_allocated_bytes"] = float(torch.cuda.max_memory_allocated(pl_module.device))
        self.last = values
        pl_module.log_dict(values, on_step=True, on_epoch=False, sync_dist=False, rank_zero_only=False)
        saving = self.next_stage_saving(stats)
        if not self._warned and stats.total_bytes and saving and saving >= self.raise_stage_fraction * stats.total_bytes:
            self._warned = True
            rank_zero_warn(
                f"MemoryMonitor: stage {stats.stage + 1} would free {saving / 2**20:.1f} MiB per rank "
                f"({saving / stats.total_bytes:.0%} of the {stats.total_bytes / 2**20:.1f} MiB held) at the cost of "
                "more communication; room for a larger batch. Fix (if memory bounds your batch): "
                f"strategy='zeropp_stage_{stats.stage + 1}'."
            )


def count_tokens(batch: Any) -> tuple[int, int]:
    """(samples, tokens) of a batch: a dict with ``attention_mask`` (its sum) or ``input_ids``
    (its size), or a tensor / tuple whose first tensor is ``[samples, tokens, ...]``."""
    if isinstance(batch, dict):
        if "attention_mask" in batch:
            mask = batch["attention_mask"]
            return int(mask.shape[0]), int(mask.sum())
        if "input_ids" in batch:
            ids = batch["input_ids"]
            return int(ids.shape[0]), int(ids.numel())
        batch = next(v for v in batch.values() if isinstance(v, torch.Tensor))
    if isinstance(batch, (list, tuple)):
        batch = next(v for v in batch if isinstance(v, torch.Tensor))
    if isinstance(batch, torch.Tensor):
        samples = int(batch.shape[0]) if batch.dim() else 1
        tokens = int(batch.shape[0] * batch.shape[1]) if batch.dim() > 1 else samples
        return samples, tokens
    raise ValueError(f"ThroughputMonitor cannot count the samples of a {type(batch).__name__} batch. Fix: pass "
                     "ThroughputMonitor(count_fn=lambda batch: (samples, tokens)).")


class ThroughputMonitor(Callback):
    """Samples/s, tokens/s and model TFLOP/s of each training step.

    Logged per step (prefix ``throughput/``), for this rank and for the job (times the world
    size, assuming equal batches): ``samples_per_sec``, ``tokens_per_sec``, ``tflops`` =
    ``6 x P x tokens / step time / 1e12`` (P: the model's parameters, unsharded; the
    6 counts a forward and a backward of a dense transformer, attention excluded: the usual
    "model FLOPs" estimate), and ``step_seconds``. ``count_fn(batch) -> (samples, tokens)``
    overrides ``count_tokens``.
    """

    def __init__(self, *, count_fn: Callable[[Any], tuple[int, int]] | None = None) -> None:
        self.count_fn = count_fn or count_tokens
        self._start = 0.0
        self._params = 0
        self.last: dict[str, float] = {}

    def on_train_start(self, trainer: Trainer, pl_module: LightningModule) -> None:
        # DTensor.numel() is the global size: P is the same under every stage.
        self._params = sum(p.numel() for p in pl_module.parameters())

    def on_train_batch_start(self, trainer: Trainer, pl_module: LightningModule, batch: Any, batch_idx: int) -> None:
        self._start = time.perf_counter()

    def on_train_batch_end(self, trainer: Trainer, pl_module: LightningModule, outputs: Any, batch: Any,
                           batch_idx: int) -> None:
        seconds = max(time.perf_counter() - self._start, 1e-9)
        samples, tokens = self.count_fn(batch)
        world = trainer.world_size
        values = {
            "throughput/step_seconds": seconds,
            "throughput/samples_per_sec": samples / seconds,
            "throughput/tokens_per_sec": tokens / seconds,
            "throughput/tflops": 6.0 * self._params * tokens / seconds / 1e12,
            "throughput/job_samples_per_sec": world * samples / seconds,
            "throughput/job_tokens_per_sec": world * tokens / seconds,
        }
        self.last = values
        pl_module.log_dict(values, on_step=True, on_epoch=False, sync_dist=False, rank_zero_only=False)

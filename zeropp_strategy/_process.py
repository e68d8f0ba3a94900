"""Process plumbing shared by the Lightning (``strategy.py``) and Fabric (``fabric.py``)
strategies: world sizes, the process group, the object collectives.

Both front-ends' ``ParallelStrategy`` base classes ask for the same members; this mixin,
listed first among the bases, supplies them once. A host class sets ``config``,
``_num_nodes``, ``_process_group_backend`` and ``_timeout`` in its ``__init__``, and names
its front-end's script launcher (``_launcher_cls``) and registry label (``_registry_label``).
"""

from __future__ import annotations

import atexit
from typing import Any, TypeVar

import torch
import torch.distributed as dist
from lightning.fabric.utilities.distributed import _distributed_is_initialized, _init_dist_connection
from lightning.fabric.utilities.distributed import group as _group
from lightning.fabric.utilities.rank_zero import rank_zero_info, rank_zero_only
from lightning.fabric.utilities.seed import reset_seed
from lightning_utilities.core.rank_zero import rank_zero_only as utils_rank_zero_only

from zeropp_strategy.engine.core import ZeroEngine, attempt_store, check_offload_paths, default_backend
from zeropp_strategy.presets import PRESETS

T = TypeVar("T")

_EXIT_HOOK_INSTALLED = False


def _destroy_process_groups_at_exit() -> None:
    """Destroy the process groups when the interpreter exits, once per process.

    A gloo process group still alive when the interpreter tears down can abort the process
    ("terminate called without an active exception") after training finished, which torchrun
    then reports as a failed job; seen on one rank in about one run in ten with qgZ's
    intra/inter-node subgroups. Destroying them first, while Python is still whole, joins
    gloo's threads cleanly. Local only (no collective): by exit every collective is done.
    """
    global _EXIT_HOOK_INSTALLED
    if _EXIT_HOOK_INSTALLED:
        return
    _EXIT_HOOK_INSTALLED = True

    def destroy() -> None:
        if dist.is_available() and dist.is_initialized():
            try:
                dist.destroy_process_group()
            except Exception:  # noqa: BLE001 - best effort at exit; never mask the real exit status
                pass

    atexit.register(destroy)


class ProcessMixin:
    """World sizes, process-group set-up and object collectives for a ``ParallelStrategy``."""

    config: Any
    _num_nodes: int
    _process_group_backend: str | None
    _timeout: Any
    _launcher_cls: Any  # the front-end's _SubprocessScriptLauncher
    _registry_label: str  # how the registered names describe themselves

    def _configure_launcher(self) -> None:
        assert self.cluster_environment is not None  # type: ignore[attr-defined]
        if not self.cluster_environment.creates_processes_externally:  # type: ignore[attr-defined]
            self._launcher = self._launcher_cls(self.cluster_environment, self.num_processes, self.num_nodes)

    def _start_engine(self, precision: Any) -> ZeroEngine:
        """The engine of this process, once the process group exists (every rank)."""
        return ZeroEngine.start(
            self.config,
            rank=self.global_rank,  # type: ignore[attr-defined]
            world_size=self.world_size,  # type: ignore[attr-defined]
            ranks_per_node=self.num_processes,
            device=self.root_device,
            precision=precision,
            info=rank_zero_info,
        )

    @classmethod
    def register_strategies(cls, strategy_registry: Any) -> None:
        for name, fields in PRESETS.items():
            if name in strategy_registry:
                continue
            strategy_registry.register(name, cls, description=f"ZeRO via zeropp-strategy{cls._registry_label} ({fields})",
                                       **fields)

    @property
    def root_device(self) -> torch.device:
        assert self.parallel_devices is not None  # type: ignore[attr-defined]
        return self.parallel_devices[self.local_rank]  # type: ignore[attr-defined]

    @property
    def num_nodes(self) -> int:
        return self._num_nodes

    @num_nodes.setter
    def num_nodes(self, num_nodes: int) -> None:
        self._num_nodes = num_nodes

    @property
    def num_processes(self) -> int:
        devices = self.parallel_devices  # type: ignore[attr-defined]
        return len(devices) if devices is not None else 0

    @property
    def distributed_sampler_kwargs(self) -> dict[str, Any]:
        return {"num_replicas": self.num_nodes * self.num_processes, "rank": self.global_rank}  # type: ignore[attr-defined]

    @property
    def process_group_backend(self) -> str | None:
        return self._process_group_backend

    def set_world_ranks(self) -> None:
        env = self.cluster_environment  # type: ignore[attr-defined]
        if env is not None:
            env.set_global_rank(self.node_rank * self.num_processes + self.local_rank)  # type: ignore[attr-defined]
            env.set_world_size(self.num_nodes * self.num_processes)
        rank_zero_only.rank = utils_rank_zero_only.rank = self.global_rank  # type: ignore[attr-defined]

    def _connect(self) -> None:
        """Ranks, then the checks that need the job size (on every rank BEFORE the first
        collective: an error inside a collective on one rank would hang the others), then
        the process group."""
        self.set_world_ranks()
        self.config.validate_for_world(self.world_size, self.num_processes)  # type: ignore[attr-defined]
        check_offload_paths(self.config)
        reset_seed()
        self._process_group_backend = self._process_group_backend or default_backend(self.config, self.root_device)
        assert self.cluster_environment is not None  # type: ignore[attr-defined]
        kwargs: dict[str, Any] = {"timeout": self._timeout}
        if self.root_device.type != "cpu":
            kwargs["device_id"] = self.root_device
        store = attempt_store(self._timeout)
        if store is not None:
            kwargs["store"] = store
        _init_dist_connection(self.cluster_environment, self._process_group_backend, **kwargs)  # type: ignore[attr-defined]
        _destroy_process_groups_at_exit()

    def barrier(self, *args: Any, **kwargs: Any) -> None:
        if not _distributed_is_initialized():
            return
        if dist.get_backend() == "nccl":
            dist.barrier(device_ids=[self.root_device.index])
        else:
            dist.barrier()

    def broadcast(self, obj: T, src: int = 0) -> T:
        if not _distributed_is_initialized():
            return obj
        box = [obj]
        dist.broadcast_object_list(box, src, group=_group.WORLD)
        return box[0]

"""Layer: front-end (Lightning and Fabric). Process plumbing shared by the Lightning
(``lightning/strategy.py``) and Fabric (``fabric.py``) strategies: world sizes, starting the
session (``ZeroSession.start`` creates the process group through Lightning's cluster
environment), barriers, object broadcasts and the front-ends' ``all_gather`` (booked in the
session's ledger). It sits beside the ``lightning/`` package, not in it, because Fabric's
strategy inherits it too (the front-ends import nothing from each other).

Both front-ends' ``ParallelStrategy`` base classes ask for the same members; this mixin,
listed first among the bases, supplies them once. A host class sets ``config``,
``_num_nodes``, ``_process_group_backend`` and ``_timeout`` in its ``__init__``, and names
its front-end's script launcher (``_launcher_cls``) and registry label (``_registry_label``).
"""

from __future__ import annotations

from typing import Any, TypeVar

import torch
from lightning.fabric.utilities.distributed import (
    _distributed_is_initialized,
    _init_dist_connection,
    _sync_ddp_if_available,
)
from lightning.fabric.utilities.rank_zero import rank_zero_info, rank_zero_only
from lightning.fabric.utilities.seed import reset_seed
from lightning_utilities.core.rank_zero import rank_zero_only as utils_rank_zero_only
from torch.distributed import ReduceOp

from zeropp_strategy.comm import control
from zeropp_strategy.presets import PRESETS
from zeropp_strategy.session import ZeroSession

T = TypeVar("T")

class ProcessMixin:
    """World sizes, process-group set-up and object collectives for a ``ParallelStrategy``."""

    config: Any
    _num_nodes: int
    _process_group_backend: str | None
    _timeout: Any
    _launcher_cls: Any  # the front-end's _SubprocessScriptLauncher
    _registry_label: str  # how the registered names describe themselves

    # Decisions: the session's plan once it has started (the one place they are made), the
    # config's own before (the same values: the plan resolves them from it).
    @property
    def stage(self) -> int:
        session = getattr(self, "_session", None)
        return session.stage if session is not None else self.config.stage

    @property
    def state_dict_type(self) -> str:
        session = getattr(self, "_session", None)
        return session.state_dict_type if session is not None else self.config.resolved_state_dict_type()

    def _configure_launcher(self) -> None:
        assert self.cluster_environment is not None  # type: ignore[attr-defined]
        if not self.cluster_environment.creates_processes_externally:  # type: ignore[attr-defined]
            self._launcher = self._launcher_cls(self.cluster_environment, self.num_processes, self.num_nodes)

    def _start_session(self, precision: Any, where: str, on_nonfinite: str) -> ZeroSession:
        """Ranks from the cluster environment, then ``ZeroSession.start`` (every rank): the
        job-size checks, the process group through Lightning's cluster environment, the
        engine."""
        self.set_world_ranks()
        reset_seed()
        session = ZeroSession.start(
            self.config,
            rank=self.global_rank,  # type: ignore[attr-defined]
            world_size=self.world_size,  # type: ignore[attr-defined]
            ranks_per_node=self.num_processes,
            device=self.root_device,
            precision=precision,
            where=where,
            on_nonfinite=on_nonfinite,
            init=lambda backend, **kw: _init_dist_connection(self.cluster_environment, backend, **kw),  # type: ignore[attr-defined]
            backend=self._process_group_backend,
            timeout=self._timeout,
            info=rank_zero_info,
        )
        self._process_group_backend = session.backend
        return session

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

    def barrier(self, *args: Any, **kwargs: Any) -> None:
        if _distributed_is_initialized():
            control.barrier(device=self.root_device)

    def broadcast(self, obj: T, src: int = 0) -> T:
        if not _distributed_is_initialized():
            return obj
        return control.broadcast_object(obj, src)

    def _reduce(self, tensor: Any, group: Any = None, reduce_op: Any = "mean") -> Any:
        """Lightning's ``reduce`` / Fabric's ``all_reduce``, booked in the ledger; the mean of
        an integer tensor is computed in float64 and returned as such. Lightning divides
        it in place in the integer tensor, truncating: the count of records behind an
        epoch-level ``self.log(..., sync_dist=True)`` mean (16 and 15 on two ranks gave 15,
        so every such metric of an uneven evaluation came out 31/30 too large)."""
        if not isinstance(tensor, torch.Tensor):
            return tensor
        control.book_control_all_reduce(tensor, group=group)  # the framework's own reduce, booked as ours
        mean = reduce_op.lower() in ("mean", "avg") if isinstance(reduce_op, str) else reduce_op == ReduceOp.AVG
        if mean and not (tensor.is_floating_point() or tensor.is_complex()):
            tensor = tensor.to(torch.float64)
        return _sync_ddp_if_available(tensor, group, reduce_op=reduce_op)

    def all_gather(self, tensor: torch.Tensor, group: Any = None, sync_grads: bool = False) -> torch.Tensor:
        # Lightning's own goes through torch.distributed.nn, deprecated in torch 2.13 (it warns)
        if sync_grads:
            return super().all_gather(tensor, group, sync_grads)  # type: ignore[misc]
        return control.all_gather_tensor(tensor, group=group)

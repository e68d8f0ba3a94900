"""Layer: engine. The optimizer step on each rank's local shards instead of on DTensors.

[Note: the step on local shards]
At stages 2 and 3 (FSDP2) and in stage 1's ``ShardedOptimizer`` the optimizer holds DTensor
parameters, and every tensor operation of its step goes through DTensor's dispatcher:
sharding propagation in Python, then the same local kernel. For an elementwise optimizer
the result is the local kernel's on the local shard, so that detour buys nothing. It is
not small: AdamW's default (for-loop) step over GPT-2 4 x 256's 52 parameters sharded
over 4 ranks on 2 cores took 58.6 ms per rank on DTensors against 9.0 ms on their local
tensors, with the same bits (``python benchmarks/optimizer_step.py``), and the
``zeropp`` step of ``benchmarks/bench_train.py`` on those ranks fell from 0.89-0.93 s to
0.67-0.72 s with the same loss to the last bit.

``local_shards(optimizer)`` runs the step on plain tensors: for its duration the param
groups list each DTensor parameter's local tensor (its ``.grad`` the local tensor of the
DTensor gradient), and ``optimizer.state`` is keyed by those local tensors, with every
DTensor state entry replaced by its local tensor. The kernels then update the same
storage the DTensors view. Afterwards the groups and the state come back, and any state
entry the step created or replaced (the first step's ``exp_avg``, SGD's first momentum
buffer) is wrapped back into a DTensor laid out like its parameter
(``primitives.follows_param``: ``step`` stays a plain scalar, as torch keeps it), so
``state_dict()``, checkpoints and resharding see exactly what a DTensor step leaves.

Only optimizers whose update is elementwise and whose per-element state is laid out like
the parameter are stepped this way: the classes in ``ELEMENTWISE`` exactly (a subclass
may add a norm, LAMB-style, which on a shard would be the shard's). Anything else steps
on DTensors, as before. A parameter whose gradient is not laid out like it (another mesh
or placement) makes the whole step fall back too. Hooks registered on the optimizer's
``step`` run inside it, so they see the local tensors in ``param_groups``.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import torch
from torch.distributed.tensor import DTensor
from torch.optim import Optimizer

from zeropp_strategy.primitives import WrappingOptimizer, follows_param

__all__ = ["ELEMENTWISE", "LocalStepOptimizer", "local_shards", "steps_locally"]

ELEMENTWISE: tuple[type[Optimizer], ...] = (
    torch.optim.Adam,
    torch.optim.AdamW,
    torch.optim.SGD,
    torch.optim.Adagrad,
    torch.optim.Adamax,
    torch.optim.RMSprop,
    torch.optim.RAdam,
)
"""Optimizer classes (exactly these, not subclasses) stepped on local shards: elementwise
updates whose non-``step`` state entries all have the parameter's shape."""


def steps_locally(optimizer: Optimizer) -> bool:
    """Whether ``local_shards`` applies to ``optimizer`` (its class is in ``ELEMENTWISE``)."""
    return type(optimizer) in ELEMENTWISE


def _same_layout(p: DTensor, grad: Any) -> bool:
    return isinstance(grad, DTensor) and grad.placements == p.placements and grad.device_mesh == p.device_mesh


@contextmanager
def local_shards(optimizer: Optimizer) -> Iterator[bool]:
    """Within the block, ``optimizer`` steps the local tensors of its DTensor parameters
    ([Note: the step on local shards]). Yields whether it does; it does not (and changes
    nothing) for an optimizer outside ``ELEMENTWISE``, one without DTensor parameters, or
    a step with a gradient laid out unlike its parameter."""
    params = [p for g in optimizer.param_groups for p in g["params"]]
    dtensors = [p for p in params if isinstance(p, DTensor)]
    if not steps_locally(optimizer) or not dtensors or any(
            p.grad is not None and not _same_layout(p, p.grad) for p in dtensors):
        yield False
        return
    saved_params = [g["params"] for g in optimizer.param_groups]
    saved_state = optimizer.state
    local_of = {id(p): p._local_tensor for p in dtensors}
    local_state: defaultdict[torch.Tensor, dict[str, Any]] = defaultdict(dict)
    for p in params:
        lp = local_of.get(id(p), p)
        if p in saved_state:
            local_state[lp] = {k: v._local_tensor if isinstance(v, DTensor) else v for k, v in saved_state[p].items()}
        if lp is not p:
            lp.grad = None if p.grad is None else p.grad._local_tensor
    for g in optimizer.param_groups:
        g["params"] = [local_of.get(id(p), p) for p in g["params"]]
    optimizer.state = local_state
    try:
        yield True
    finally:
        for g, ps in zip(optimizer.param_groups, saved_params):
            g["params"] = ps
        optimizer.state = saved_state
        for p in params:
            lp = local_of.get(id(p), p)
            entries = local_state.get(lp)
            if entries:
                _sync_state(p, saved_state[p], entries)
            if lp is not p:
                lp.grad = None


def _sync_state(p: torch.Tensor, state: dict[str, Any], local: dict[str, Any]) -> None:
    """Bring what the local step left in ``local`` into ``p``'s DTensor ``state``: entries
    updated in place are there already; new or replaced ones are wrapped like ``p``."""
    for key, value in local.items():
        old = state.get(key)
        if isinstance(old, DTensor) and old._local_tensor is value:
            continue
        if isinstance(p, DTensor) and follows_param(key, value, p._local_tensor):
            value = DTensor.from_local(value, p.device_mesh, p.placements, run_check=False, shape=p.shape,
                                       stride=p.stride())
        state[key] = value


class LocalStepOptimizer(WrappingOptimizer):
    """The user's optimizer at stages 2/3 without optimizer offload, stepped on local
    shards ([Note: the step on local shards]); everything else is the user's optimizer's:
    ``param_groups``, ``state``, ``state_dict()``, ``zero_grad()``, LR schedulers."""

    def __init__(self, optimizer: Optimizer) -> None:
        # No Optimizer.__init__: param_groups, defaults and state are the user's.
        self.optimizer = optimizer

    @property
    def state(self) -> defaultdict[Any, dict[str, Any]]:  # type: ignore[override]
        return self.optimizer.state

    def __repr__(self) -> str:
        return f"LocalStepOptimizer({self.optimizer!r})"

    def state_dict(self) -> dict[str, Any]:
        return self.optimizer.state_dict()

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self.optimizer.load_state_dict(state_dict)

    def zero_grad(self, set_to_none: bool = True) -> None:
        self.optimizer.zero_grad(set_to_none=set_to_none)

    def add_param_group(self, param_group: dict[str, Any]) -> None:
        self.optimizer.add_param_group(param_group)

    def step(self, closure: Callable[[], Any] | None = None) -> Any:
        loss = self._evaluate(closure)  # forward and backward, on the DTensor parameters
        with local_shards(self.optimizer):
            self.optimizer.step()
        return loss

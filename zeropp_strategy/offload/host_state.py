"""Layer: offload. The host-side pieces of ``OffloadOptimizer`` (optimizer.py): how one
parameter's shard is laid out (``_Piece``), batches of the NVMe state stream and their
mapped staging buffers (``_Batch``, ``_Stream``), probing and building the inner optimizer
on the host, the ``state`` view users read, and releasing swap files and heap pages.
Split from optimizer.py so that each file reads as one concept; see [Note: how offload
steps] there.
"""

from __future__ import annotations

import inspect
from collections.abc import Iterator, Mapping
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import Tensor
from torch.distributed.tensor import DTensor
from torch.optim import Optimizer

from zeropp_strategy.offload.swap import SwapDir, SwapFile
from zeropp_strategy.primitives import local as _local

#: Keys of the user's param groups that choose an implementation, not the math.
_IMPL_KEYS = ("foreach", "fused", "capturable", "differentiable")
#: Optimizer classes whose fused CPU kernel we use when the user did not pick one.
_FUSED_CPU = (torch.optim.Adam, torch.optim.AdamW, torch.optim.SGD, torch.optim.Adagrad)
_REFUSED = (torch.optim.LBFGS,)




def _like_param(flat: Tensor, param: Tensor) -> Tensor:
    """A flat host tensor shown in ``param``'s layout (a DTensor shard if ``param`` is one)."""
    local = _local(param)
    value = flat.view(local.shape)
    if isinstance(param, DTensor):
        return DTensor.from_local(
            value, param.device_mesh, param.placements, run_check=False, shape=param.shape, stride=param.stride()
        )
    return value


@dataclass
class _Piece:
    """Elements [start, stop) of one parameter's local (flattened) tensor."""

    param: Tensor  # the user's parameter (DTensor or tensor) the optimizer holds
    index: int  # position of ``param`` in the flattened param groups
    group: int
    start: int
    stop: int
    host: Tensor  # what the host optimizer steps (CPU, flat)
    aliased: bool  # ``host`` is a view of the parameter itself (it lives on the host)
    offset: int = 0  # NVMe: element offset of this piece in its stream
    swapped: bool = False  # NVMe: state lives in swap files (else in host_optimizer.state)
    initialized: bool = False  # NVMe: state exists (on disk)

    @property
    def numel(self) -> int:
        return self.stop - self.start


@dataclass
class _Batch:
    """NVMe: elements [start, stop) of a stream and the pieces inside them."""

    start: int
    stop: int
    pieces: list[_Piece] = field(default_factory=list)


def _probe(cls: type[Optimizer], defaults: Mapping[str, Any]) -> tuple[list[str], list[str]]:
    """(elementwise state keys, scalar state keys) the optimizer creates, or an error."""
    p = torch.zeros(2, 3, requires_grad=True)
    p.grad = torch.ones(2, 3)
    opt = _build(cls, [{"params": [p]}], defaults)
    opt.step()
    elementwise, scalar = [], []
    for key, value in opt.state[p].items():
        if not isinstance(value, Tensor):
            continue
        if key != "step" and value.shape == p.shape:
            elementwise.append(key)
        elif value.numel() == 1:
            scalar.append(key)
        else:
            raise TypeError(
                f"offload_optimizer cannot run {cls.__name__}: its state {key!r} has shape {tuple(value.shape)} for a "
                f"parameter of shape {tuple(p.shape)}, so its update is not elementwise and would be computed per "
                "shard on the host. Fix: use an elementwise optimizer (Adam, AdamW, SGD, Adagrad, RMSprop, ...) or "
                "set offload_optimizer='none'."
            )
    return elementwise, scalar


def _build(cls: type[Optimizer], groups: list[dict[str, Any]], defaults: Mapping[str, Any]) -> Optimizer:
    accepted = inspect.signature(cls.__init__).parameters
    kwargs = {k: v for k, v in defaults.items() if k in accepted and k != "params"}
    return cls(groups, **kwargs)



def _release(streams: dict[torch.dtype, _Stream], pool: ThreadPoolExecutor | None, swap_dir: SwapDir | None) -> None:
    for stream in streams.values():
        stream._maps = {}
        for f in stream.files.values():
            f.close()
        stream.buffers = []
    if pool is not None:
        pool.shutdown(wait=True)
    if swap_dir is not None:
        swap_dir.close()


class _Stream:
    """NVMe: all parameters of one dtype, as one flat array per state key."""

    def __init__(self, dtype: torch.dtype, esize: int, batch: int, total: int, staging: int) -> None:
        self.dtype = dtype
        self.staging = staging  # 2: buffers also stage values and grads of accelerator params
        self.esize = esize
        self.batch = batch
        self.total = total
        self.batches = [_Batch(s, min(total, s + batch)) for s in range(0, total, batch)]
        self.files: dict[str, SwapFile] = {}
        self.buffers: list[Tensor] = []
        self.scalars: dict[int, dict[str, Any]] = {}
        self._maps: dict[str, Tensor] = {}

    def batch_of(self, offset: int) -> _Batch:
        return self.batches[offset // self.batch]

    def mapped(self, key: str) -> Tensor:
        if key not in self._maps:
            self._maps[key] = self.files[key].mapped(self.dtype, self.total)
        return self._maps[key]

    def drop_maps(self) -> None:
        if self._maps:
            self._maps = {}
            for f in self.files.values():
                f.sync()


class _StateView(Mapping):
    """``optimizer.state`` for code that reads it by parameter (checkpoints, tools)."""

    def __init__(self, owner: Any) -> None:
        self._owner = owner

    def _params(self) -> list[Tensor]:
        return [p for g in self._owner.optimizer.param_groups for p in g["params"]]

    def __getitem__(self, p: Tensor) -> dict[str, Any]:
        state = self._owner._param_state(p)
        if not state:
            raise KeyError(p)
        return state

    def get(self, p: Tensor, default: Any = None) -> Any:  # type: ignore[override]
        state = self._owner._param_state(p)
        return state if state else default

    def __iter__(self) -> Iterator[Tensor]:
        return (p for p in self._params() if self._owner._param_state(p))

    def __len__(self) -> int:
        return sum(1 for _ in self)

"""Layer: offload. Optimizer offload: the optimizer step runs on the host, its state in RAM or on NVMe.

[Note: how offload steps]
``OffloadOptimizer`` wraps the user's optimizer (the object ``configure_optimizers``
returned: LR schedulers and ``self.optimizers()`` keep acting on it) and never calls its
``step``. Instead it builds a second optimizer of the same class, the *host optimizer*,
over host tensors ("pieces") that mirror this rank's parameter shards, element for
element: a stage 2/3 FSDP2 shard, a stage-1 row shard, or a whole parameter. Per step:

1. each piece's value and gradient are copied device -> host (``non_blocking`` into
   pinned memory, all issued before one synchronize; in NVMe mode batch by batch, while
   the next batch's state is read from disk); a parameter that already lives on the host
   (CPU training, or ``offload_param="cpu"``) is stepped in place, without a copy;
2. the host optimizer steps the batch; hyper-parameters (lr, betas, weight decay...) are
   copied from the user's param groups first, so schedulers work as usual;
3. the updated values are copied host -> device, non-blocking.

The fp32 master is the parameter shard itself: FSDP2 keeps sharded parameters in
their own dtype (fp32 under "32-true" and "bf16-mixed") and casts only for compute, so a
second fp32 copy would hold the same numbers. See docs/offload.md for what this means
for accelerator memory.

Why a second optimizer of the same class rather than our own Adam: the user's
semantics (every hyper-parameter, ``amsgrad``, ``maximize``, parameters skipped when their
grad is None, per-parameter step counts) come for free, for any optimizer whose update is
elementwise. For Adam, AdamW, SGD and Adagrad the host optimizer uses PyTorch's fused CPU
kernel unless the user chose ``foreach``/``fused`` explicitly: on a 2-core VM
``benchmarks/offload.py --part adam`` measured AdamW over 16M params at 1253 Mparams/s
fused vs 147 foreach and 97 for-loop (8-13x), and this optimizer at 1172 (0.94x fused).

An optimizer whose update is not elementwise (Adafactor's row/column statistics, LBFGS)
would compute those statistics per shard here, so it is refused with an error;
``_probe`` finds out by stepping a 2x3 dummy once.

NVMe (``device="nvme"``): each elementwise state key (``exp_avg``...) lives in its own
swap file per dtype, as one flat array laid out parameter after parameter. The step walks
that array in batches (a multiple of 4 KiB / element size elements, so every batch
starts on a 4 KiB boundary; a parameter may span batches): read batch b's state into one
of ``buffer_count`` host buffers while batch b-1 steps, write it back asynchronously.
Host memory for optimizer state is therefore ``buffer_count x buffer_bytes`` whatever the
model size; scalar state (``step``) stays in RAM (a few bytes per parameter).
"""

from __future__ import annotations

import logging
import weakref
from collections.abc import Callable, Mapping
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import torch
from torch import Tensor
from torch.optim import Optimizer

from zeropp_strategy.config import OffloadConfig
from zeropp_strategy.offload.host_state import (
    _FUSED_CPU,
    _IMPL_KEYS,
    _REFUSED,
    _build,
    _like_param,
    _Piece,
    _probe,
    _release,
    _StateView,
    _Stream,
)
from zeropp_strategy.offload.nvme_stream import NvmeStream
from zeropp_strategy.offload.swap import SwapDir
from zeropp_strategy.primitives import WrappingOptimizer
from zeropp_strategy.primitives import local as _local

log = logging.getLogger(__name__)


class OffloadOptimizer(NvmeStream, WrappingOptimizer):
    """Runs ``optimizer``'s update on the host, with state in host RAM or NVMe swap files.

    Args:
        optimizer: the user's optimizer over this rank's parameters (plain tensors or
            DTensor shards, on any device). Its param groups stay the source of truth for
            hyper-parameters.
        config: ``ZeroConfig.offload_optimizer`` (device ``"cpu"`` or ``"nvme"``).
        rank: this process's global rank (names its swap directory).
        io_threads: NVMe: parallel read/write requests in flight.
        direct_io: NVMe: open swap files ``O_DIRECT`` where the filesystem allows it.
        on_stepped: called with the parameters of each batch once they are updated (NVMe
            parameter offload drops their pages then, see ``offload.params``).
        on_prefetch: called with the parameters of a batch before it steps, as early as
            its state read starts (NVMe parameter offload starts reading them then).
        after_step: called at the end of each completed ``step`` (the engine trims the
            host heap there when a memory plan holds the run to a budget).
    """

    def __init__(
        self,
        optimizer: Optimizer,
        config: OffloadConfig,
        *,
        rank: int = 0,
        io_threads: int = 4,
        io_block_bytes: int = 8 * 2**20,
        direct_io: bool = True,
        on_stepped: Callable[[list[Tensor]], None] | None = None,
        on_prefetch: Callable[[list[Tensor]], None] | None = None,
        after_step: Callable[[], None] | None = None,
    ) -> None:
        # No Optimizer.__init__: param_groups are the user's (see the property below).
        if config.device not in ("cpu", "nvme"):
            raise ValueError(f"OffloadOptimizer needs offload_optimizer.device 'cpu' or 'nvme', got {config.device!r}")
        cls = type(optimizer)
        if isinstance(optimizer, _REFUSED):
            raise TypeError(
                f"offload_optimizer cannot run {cls.__name__}: it re-evaluates the loss and flattens all parameters "
                "into one vector. Fix: use an elementwise optimizer (Adam, AdamW, SGD...) or "
                "offload_optimizer='none'."
            )
        self.optimizer = optimizer
        self.config = config
        self._on_stepped = on_stepped
        self._on_prefetch = on_prefetch
        self._after_step = after_step
        self.nvme = config.device == "nvme"
        self._pin = bool(config.pin_memory and torch.cuda.is_available())
        defaults = dict(optimizer.defaults)
        user_chose = any(defaults.get(k) is not None for k in ("foreach", "fused"))
        self._impl: dict[str, Any] = {}
        if not user_chose and issubclass(cls, _FUSED_CPU):
            self._impl = {"fused": True, "foreach": False}
        for k in ("capturable", "differentiable"):
            if k in defaults:
                self._impl.setdefault(k, False)
        self._elementwise, self._scalar = _probe(cls, {**defaults, **self._impl})

        # Pieces: one per parameter in RAM mode; NVMe splits them at batch boundaries.
        self._pieces: list[_Piece] = []
        self._by_param: dict[int, list[_Piece]] = {}
        params = [(gi, p) for gi, g in enumerate(optimizer.param_groups) for p in g["params"]]
        if len({id(p) for _, p in params}) != len(params):
            raise ValueError(
                "configure_optimizers: a parameter appears twice in the optimizer's param_groups. Fix: pass each "
                "parameter to exactly one group."
            )
        self._streams: dict[torch.dtype, _Stream] = {}
        self._ram_pieces: list[_Piece] = []  # stepped with state in host_optimizer.state
        if self.nvme:
            assert config.nvme_path is not None
            self._swap_dir: SwapDir | None = SwapDir(config.nvme_path, rank)
            self._pool: ThreadPoolExecutor | None = ThreadPoolExecutor(io_threads, thread_name_prefix="zeropp-swap")
            try:
                self._layout_nvme(params, direct_io=direct_io, io_block_bytes=io_block_bytes)
            except BaseException:
                _release(self._streams, self._pool, self._swap_dir)
                raise
        else:
            self._swap_dir, self._pool = None, None
            for index, (gi, p) in enumerate(params):
                self._ram_pieces.append(self._add_piece(p, index, gi, 0, _local(p).numel()))
        self._finalizer = weakref.finalize(self, _release, self._streams, self._pool, self._swap_dir)
        groups = []
        for gi, g in enumerate(optimizer.param_groups):
            hosts = [pc.host for pc in self._pieces if pc.group == gi]
            groups.append({**self._hyper(g), "params": hosts})
        self.host_optimizer = _build(cls, groups, {**defaults, **self._impl})
        self._host_groups = [list(g["params"]) for g in self.host_optimizer.param_groups]
        for pc in self._pieces:  # eager init (Adagrad) over NVMe placeholders: not the real state
            if pc.swapped:
                self.host_optimizer.state.pop(pc.host, None)
        if len(optimizer.state):
            # State the user's optimizer already has (Adagrad creates it in __init__, a reused
            # optimizer has trained state) moves to the host; the device copy is dropped.
            existing = optimizer.state_dict()
            optimizer.state.clear()
            self.load_state_dict(existing)

    # -- layout ----------------------------------------------------------------------------

    def _add_piece(
        self, p: Tensor, index: int, group: int, start: int, stop: int, offset: int = 0, swapped: bool = False
    ) -> _Piece:
        local = _local(p).detach()
        if not local.is_contiguous():
            raise ValueError("offload_optimizer needs contiguous parameter shards; got a strided one")
        flat = local.reshape(-1)[start:stop]
        aliased = flat.device.type == "cpu"
        if aliased:
            host = flat
        elif swapped:  # staged through the swap buffers at each step: no memory of its own
            host = torch.empty(0, dtype=flat.dtype)
        else:
            host = torch.empty(stop - start, dtype=flat.dtype, pin_memory=self._pin)
        piece = _Piece(p, index, group, start, stop, host, aliased, offset, swapped)
        self._pieces.append(piece)
        self._by_param.setdefault(id(p), []).append(piece)
        return piece

    # -- Optimizer surface ----------------------------------------------------------------

    @property
    def state(self) -> Mapping[Tensor, dict[str, Any]]:  # type: ignore[override]
        """The state of each parameter, in the parameter's own layout (read-only view)."""
        return _StateView(self)

    def __repr__(self) -> str:
        return f"OffloadOptimizer(device={self.config.device!r}, {self.optimizer!r})"

    def zero_grad(self, set_to_none: bool = True) -> None:
        self.optimizer.zero_grad(set_to_none=set_to_none)

    def add_param_group(self, param_group: dict[str, Any]) -> None:
        raise NotImplementedError(
            "add_param_group after setup is not supported with offload_optimizer: the new parameters would have no "
            "host state. Fix: create every param group in configure_optimizers."
        )

    @staticmethod
    def _hyper(group: Mapping[str, Any]) -> dict[str, Any]:
        return {k: v for k, v in group.items() if k != "params" and k not in _IMPL_KEYS}

    def _sync_hyper(self) -> None:
        for user, host in zip(self.optimizer.param_groups, self.host_optimizer.param_groups):
            host.update(self._hyper(user))

    # -- step ---------------------------------------------------------------------------------

    @torch.no_grad()
    def step(self, closure: Callable[[], Any] | None = None) -> Any:
        loss = self._evaluate(closure)
        self._sync_hyper()
        for stream in self._streams.values():  # checkpoint maps never outlive a step
            stream.drop_maps()
        try:
            for stream in self._streams.values():
                self._step_stream(stream)
            self._step_pieces(self._ram_pieces)
        finally:
            for g, hosts in zip(self.host_optimizer.param_groups, self._host_groups):
                g["params"] = hosts
        # The user's optimizer never steps itself; tell its LR schedulers that a step happened.
        self.optimizer._opt_called = True  # type: ignore[attr-defined]
        if self._after_step is not None:
            self._after_step()
        return loss

    def _bind(self, pieces: list[_Piece], values: Tensor | None = None, grads: Tensor | None = None) -> list[_Piece]:
        """Point each piece's host tensor at its value and grad; returns the pieces with a grad.

        ``values``/``grads``: NVMe staging areas (flat, one slot per element of the batch)
        for pieces whose parameter is not on the host.
        """
        active = []
        pos = 0
        for pc in pieces:
            g = pc.param.grad
            if g is None:
                pc.host.grad = None
                pos += pc.numel
                continue
            gflat = _local(g).detach().reshape(-1)[pc.start : pc.stop]
            if not pc.aliased:
                if values is not None:
                    pc.host = values[pos : pos + pc.numel]
                pc.host.copy_(_local(pc.param).detach().view(-1)[pc.start : pc.stop], non_blocking=True)
                if grads is not None:
                    gh = grads[pos : pos + pc.numel]
                else:
                    gh = torch.empty(pc.numel, dtype=gflat.dtype, pin_memory=self._pin)
                gflat = gh.copy_(gflat, non_blocking=True)
            pc.host.grad = gflat if gflat.dtype == pc.host.dtype else gflat.to(pc.host.dtype)
            active.append(pc)
            pos += pc.numel
        return active

    def _run_host_step(self, active: list[_Piece]) -> None:
        for g in self.host_optimizer.param_groups:
            g["params"] = []
        for pc in active:
            self.host_optimizer.param_groups[pc.group]["params"].append(pc.host)
        if any(not pc.aliased for pc in active) and torch.cuda.is_available():
            torch.cuda.current_stream().synchronize()  # device -> host copies have landed
        self.host_optimizer.step()
        for pc in active:
            if not pc.aliased:
                _local(pc.param).detach().view(-1)[pc.start : pc.stop].copy_(pc.host, non_blocking=True)
            pc.host.grad = None
        if self._on_stepped is not None:
            self._on_stepped(list({id(pc.param): pc.param for pc in active}.values()))

    def _step_pieces(self, pieces: list[_Piece]) -> None:
        if self._on_prefetch is not None:
            self._on_prefetch([pc.param for pc in pieces])
        active = self._bind(pieces)
        if active:
            self._run_host_step(active)

    # -- state in the parameters' layout (checkpoints) ---------------------------------------

    def _param_state(self, p: Tensor) -> dict[str, Any]:
        pieces = self._by_param.get(id(p), [])
        if not pieces:
            return {}
        if not pieces[0].swapped:
            pc = pieces[0]
            state = self.host_optimizer.state.get(pc.host, {})
            return {k: (_like_param(v, p) if k in self._elementwise else v) for k, v in state.items()}
        if not pieces[0].initialized:
            return {}
        stream = self._streams[p.dtype]
        out: dict[str, Any] = dict(stream.scalars[id(pieces[0])])
        lo = pieces[0].offset
        n = _local(p).numel()
        for key in self._elementwise:
            mapped = stream.mapped(key)
            out[key] = _like_param(mapped[lo : lo + n], p)
        return out

    def checkpoint_target(self, p: Tensor, key: str) -> Tensor | None:
        """Where a checkpoint reader may write ``key``'s state of ``p`` in place, or None.

        NVMe mode: a view of the swap file in ``p``'s layout (page cache, no host copy), so a
        resume reads the state straight into the files instead of holding this rank's whole
        optimizer state (8 bytes per parameter for Adam) in memory first; ``load_state_dict``
        then finds it already in place. Host mode: None (the reader allocates)."""
        pieces = self._by_param.get(id(p), [])
        if not pieces or not pieces[0].swapped or key not in self._elementwise:
            return None
        lo = pieces[0].offset
        return _like_param(self._streams[p.dtype].mapped(key)[lo : lo + _local(p).numel()], p)

    def state_dict(self) -> dict[str, Any]:
        params = [p for g in self.optimizer.param_groups for p in g["params"]]
        state = {i: s for i, p in enumerate(params) if (s := self._param_state(p))}
        groups = []
        start = 0
        for g in self.optimizer.param_groups:
            n = len(g["params"])
            groups.append({**{k: v for k, v in g.items() if k != "params"}, "params": list(range(start, start + n))})
            start += n
        return {"state": state, "param_groups": groups}

    @torch.no_grad()
    def load_state_dict(self, state_dict: Mapping[str, Any]) -> None:
        """Standard ``Optimizer.state_dict()`` layout; tensors like the parameters (or full
        tensors already cut to this rank's shard by the caller)."""
        groups = state_dict["param_groups"]
        if len(groups) != len(self.optimizer.param_groups):
            raise ValueError(
                f"optimizer state has {len(groups)} param groups, this optimizer {len(self.optimizer.param_groups)}. "
                "Fix: build the same param groups in configure_optimizers."
            )
        for saved, current in zip(groups, self.optimizer.param_groups):
            if len(saved["params"]) != len(current["params"]):
                raise ValueError("optimizer state: a param group has a different number of parameters")
            current.update({k: v for k, v in saved.items() if k != "params"})
        params = [p for g in self.optimizer.param_groups for p in g["params"]]
        index_of = [i for g in groups for i in g["params"]]
        for position, saved_index in enumerate(index_of):
            entry = state_dict["state"].get(saved_index)
            if entry is None:
                entry = state_dict["state"].get(str(saved_index))
            if entry:
                self._load_param(params[position], entry)
        for stream in self._streams.values():
            stream.drop_maps()

    def _load_param(self, p: Tensor, entry: Mapping[str, Any]) -> None:
        pieces = self._by_param[id(p)]
        local_n = _local(p).numel()
        flat: dict[str, Tensor] = {}
        scalars: dict[str, Any] = {}
        for key, value in entry.items():
            if key in self._elementwise:
                v = _local(value) if isinstance(value, Tensor) else value
                if v.numel() != local_n:
                    raise ValueError(
                        f"optimizer state {key!r} has {v.numel()} elements, this rank's shard {local_n}. Fix: load "
                        "the state through the strategy, which cuts full tensors to each rank's shard."
                    )
                flat[key] = v.detach().reshape(-1).to(device="cpu", dtype=p.dtype)
            elif isinstance(value, Tensor):
                scalars[key] = value.detach().to("cpu", dtype=torch.float32 if key == "step" else value.dtype).clone()
            else:
                scalars[key] = value
        if not pieces[0].swapped:
            pc = pieces[0]
            self.host_optimizer.state[pc.host] = {
                **scalars, **{k: (v.clone().pin_memory() if self._pin else v.clone()) for k, v in flat.items()}
            }
            return
        stream = self._streams[p.dtype]
        lo = pieces[0].offset
        for key, v in flat.items():
            dest = stream.mapped(key)[lo : lo + local_n]
            if dest.data_ptr() != v.data_ptr():  # read in place through checkpoint_target: already there
                dest.copy_(v)
        for pc in pieces:
            pc.initialized = True
            stream.scalars[id(pc)] = {k: (v.clone() if isinstance(v, Tensor) else v) for k, v in scalars.items()}

    # -- accounting and lifetime ------------------------------------------------------------

    def offloaded_bytes(self) -> dict[str, int]:
        """Bytes of optimizer state this rank holds off the accelerator: ``{"cpu": .., "nvme": ..}``.

        ``cpu`` counts host state tensors (RAM mode) or the swap buffers (NVMe mode);
        ``nvme`` the swap files' sizes.
        """
        seen: set[int] = set()
        cpu = 0
        for state in self.host_optimizer.state.values():
            for v in state.values():
                if isinstance(v, Tensor) and v.untyped_storage().data_ptr() not in seen:
                    seen.add(v.untyped_storage().data_ptr())
                    cpu += v.untyped_storage().nbytes()
        cpu += sum(b.numel() for s in self._streams.values() for b in s.buffers)
        disk = sum(f.nbytes for s in self._streams.values() for f in s.files.values())
        return {"cpu": cpu, "nvme": disk}

    @property
    def swap_dir(self) -> str | None:
        return None if self._swap_dir is None else str(self._swap_dir.path)

    def close(self) -> None:
        """Release swap files, buffers and threads; the swap directory is removed.

        Also runs when this optimizer is garbage collected and at interpreter exit (not
        ``__del__``: Lightning's LightningOptimizer shares this object's ``__dict__``).
        """
        self._finalizer()

    @property
    def closed(self) -> bool:
        return not self._finalizer.alive

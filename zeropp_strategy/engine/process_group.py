"""Layer: engine (runtime). The process group: which backend, the per-attempt store of
torchrun restarts, the checks that must pass on every rank before the first collective,
and a clean teardown at exit. ``ZeroSession.start`` calls ``connect``; every front-end
reaches the process group through it (Lightning and Fabric hand it their cluster
environment's init function; Accelerate creates its group itself and we adopt it).
"""

from __future__ import annotations

import atexit
import os
from collections.abc import Callable
from datetime import timedelta
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist
from torch.distributed.constants import default_pg_timeout

if TYPE_CHECKING:
    from zeropp_strategy.config import OffloadConfig

__all__ = ["attempt_store", "check_offload_paths", "connect", "default_backend", "destroy_at_exit",
           "restarted_under_torchrun"]


def default_backend(device: torch.device, *, offload: bool = False) -> str:
    """NCCL for accelerator tensors; with ``offload`` (``ZeroConfig.offloads``), also gloo
    for the host tensors that offloaded shards produce (full-format saves gather
    host-resident DTensors, clipping reduces norms of host grads): c10d picks the backend by
    each tensor's device."""
    if device.type == "cpu":
        return "gloo"
    backend = "nccl" if device.type == "cuda" else dist.Backend.default_device_backend_map.get(device.type, "gloo")
    if backend == "nccl" and offload:
        return "cpu:gloo,cuda:nccl"
    return backend


def restarted_under_torchrun() -> bool:
    """Whether this process runs under a torchrun agent whose store survives restarts (the
    case ``attempt_store`` exists for)."""
    return (os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True"
            and os.environ.get("TORCHELASTIC_RESTART_COUNT") is not None)


def attempt_store(timeout: timedelta | None) -> dist.Store | None:
    """Under torchrun, the agent's store with a key prefix per restart attempt; None elsewhere.

    torchrun ``--max-restarts`` keeps its agent's store across attempts, and (torch 2.13)
    the default process group of a restarted attempt reads the rendezvous keys the failed
    attempt left there: gloo then connects to the dead workers' addresses and every restart
    fails with "Gloo connectFullMesh failed ... Connection refused". A prefix per attempt
    (``TORCHELASTIC_RESTART_COUNT``) gives each attempt clean keys.
    """
    if not restarted_under_torchrun():
        return None
    attempt = os.environ["TORCHELASTIC_RESTART_COUNT"]
    store = dist.TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), is_master=False,
                          timeout=timeout or default_pg_timeout)
    return dist.PrefixStore(f"zeropp/attempt_{attempt}", store)


def check_offload_paths(blocks: dict[str, OffloadConfig]) -> None:
    """A missing or read-only nvme_path fails here, on every rank, before any collective.
    ``blocks``: the offload blocks by field name (``offload_optimizer``, ``offload_param``)."""
    from zeropp_strategy.offload.swap import check_swap_root

    for name, block in blocks.items():
        if block.device == "nvme":
            check_swap_root(block.nvme_path, name)


_EXIT_HOOK_INSTALLED = False


def destroy_at_exit() -> None:
    """At interpreter exit, take the communication down in an order that cannot abort,
    once per process, whoever created the default group (us, Lightning, Accelerate, the
    launcher).

    [Note: orderly exit]
    A rank can abort after training finished ("terminate called without an active
    exception"), which torchrun then reports as a failed job; seen on one rank in about one
    run in ten on the simulated 2x2 cluster. The mechanism (reproduced deterministically by
    tests/test_exit.py): once the interpreter has begun to finalize, a thread that takes
    the GIL is ended with ``pthread_exit``; torch retakes the GIL in a C++ destructor (the
    guard that releases it around an op or a collective), and unwinding through that
    destructor calls ``std::terminate``. So no thread may be inside torch when the
    interpreter finalizes: not our comm threads or watchdog (Python threads), and, by
    upstream's account (pytorch/pytorch PR #179291; not reproduced here), not a gloo
    group's worker threads, which need the GIL when the last reference to a Python tensor
    of a finished work goes with them. At exit, while Python is still whole, in this order:
    1. every comm thread is stopped after its queued jobs (``close_all``), so none is
       inside a collective of the groups about to go; at most 10 s each: one stuck in a
       collective whose peer is gone means the run failed, and then nothing below is
       attempted, since destroying a group with work in flight can block;
    2. the peer watchdog marks this rank ended and stops (it uses the store);
    3. ``destroy_process_group()``: every group, ours (the comm thread's, hpZ's, the
       meshes') and the default one, shut down in torch's own order (reverse creation).
       After an uncaught exception under NCCL this is skipped: its shutdown may wait
       for peers that are gone (the trap torchtitan met); gloo's is local;
    4. ``release_destroyed_groups`` (not after an uncaught exception): destroyed groups
       whose C++ objects only torch still references (DTensor's sharding cache holds
       meshes, a mesh holds its groups) are let go, and a garbage collection frees them
       now, joining their gloo threads; before this step one gloo group's threads were
       still running after the hook at the end of every stage-3 fit whose Trainer was
       gone (FSDP2's own runs under Lightning keep two). A Trainer still referenced at
       exit (a module-level ``trainer``) keeps its groups, and their idle threads, until
       the interpreter frees it.
    Local only: by exit every collective is done. Registered by ``ZeroSession.start``,
    which runs after whatever created the default group, so it runs before the exit
    hooks of the code that started the session (atexit runs the last registered first).
    """
    global _EXIT_HOOK_INSTALLED
    if _EXIT_HOOK_INSTALLED:
        return
    _EXIT_HOOK_INSTALLED = True
    atexit.register(_orderly_exit)


def _orderly_exit() -> None:
    import gc
    import sys

    from zeropp_strategy.comm.comm_thread import close_all
    from zeropp_strategy.engine.watchdog import current

    try:
        if not close_all(timeout=10.0):
            return
        watchdog = current()
        if watchdog is not None:
            watchdog.stop()
        failed = getattr(sys, "last_value", None) is not None
        if dist.is_available() and dist.is_initialized():
            if not (failed and dist.get_backend() == "nccl"):
                dist.destroy_process_group()
        # ours, or the launcher's own destroy; not after a failure, where freeing a group joins
        # its gloo workers, and one waiting on a dead peer would hold the exit until its timeout
        if dist.is_available() and not dist.is_initialized() and not failed:
            release_destroyed_groups()
        gc.collect()
    except Exception:  # noqa: BLE001 - best effort at exit; never mask the real exit status
        pass


def release_destroyed_groups() -> None:
    """After ``destroy_process_group()``: drop torch's references that keep the destroyed
    groups' C++ objects, and with them their gloo worker and transport threads, alive.
    DTensor's sharding-propagation cache holds ``DTensorSpec``s, each holding its
    ``DeviceMesh``, which holds its groups (``_pg_registry``): after a stage-2/3 fit that
    kept a gloo group's threads running into interpreter finalization although every
    group had been destroyed (found at stop 47: in ``benchmarks/bench_train.py`` runs,
    FSDP2's and ours alike). Private torch names, each looked up and skipped if absent."""
    import gc

    try:
        from torch.distributed.tensor import DTensor

        propagator = DTensor._op_dispatcher.sharding_propagator
        for name in ("propagate_op_sharding", "_propagate_tensor_meta_cached"):
            clear = getattr(getattr(propagator, name, None), "cache_clear", None)
            if callable(clear):
                clear()
        from torch.distributed.device_mesh import DeviceMesh
    except Exception:  # noqa: BLE001 - another torch: nothing known to release
        return
    for obj in gc.get_objects():
        if type(obj) is DeviceMesh:  # not isinstance: its metaclass check touches every object (warnings)
            registry = getattr(obj, "_pg_registry", None)
            if isinstance(registry, dict):
                registry.clear()


def connect(
    device: torch.device,
    init: Callable[..., None],
    *,
    offload: bool = False,
    backend: str | None = None,
    timeout: timedelta | None = None,
) -> str:
    """Create the default process group through the front-end's ``init(backend, **kwargs)``
    and return the backend used (``backend`` or ``default_backend(device, offload=...)``).
    kwargs: ``timeout``, ``device_id`` on accelerators, and under torchrun the per-attempt
    ``store``. An existing group is adopted as it is."""
    backend = backend or default_backend(device, offload=offload)
    if dist.is_available() and dist.is_initialized():
        return backend
    kwargs: dict[str, Any] = {"timeout": timeout}
    if device.type != "cpu":
        kwargs["device_id"] = device
    store = attempt_store(timeout)
    if store is not None:
        kwargs["store"] = store
    init(backend, **kwargs)
    return backend

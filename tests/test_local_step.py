"""The optimizer step on local shards ([Note: the step on local shards], engine/local_step.py).

Reference: the same optimizer stepping the DTensor parameters, as torch runs it. On 2
gloo ranks, for every class of ``ELEMENTWISE`` and the options that change its state
(momentum, nesterov, amsgrad, maximize, foreach, fused), parameters and state must be
equal bit for bit after several steps, including an unevenly sharded parameter, a 0-dim
replicated one and a parameter whose gradient is None on some steps; the state must
keep the DTensor layout a DTensor step gives it (``step`` a plain scalar). The local
step must not go through DTensor's dispatcher at all, a subclass must be left to
DTensor stepping, and an error inside the step must leave the optimizer as it was.
"""

from __future__ import annotations

import copy

import pytest
import torch

from tests._dist import run_ranks

pytestmark = pytest.mark.timeout(360)  # its longest run_ranks timeout + 60 s (pyproject's 300 s would cut it)

CASES = [  # (class name, keyword arguments)
    ("AdamW", {"lr": 1e-2, "weight_decay": 0.1}),
    ("AdamW", {"lr": 1e-2, "amsgrad": True, "foreach": True}),
    ("AdamW", {"lr": 1e-2, "fused": True}),
    ("Adam", {"lr": 1e-2, "maximize": True}),
    ("SGD", {"lr": 1e-2, "momentum": 0.9, "nesterov": True, "weight_decay": 1e-3}),
    ("SGD", {"lr": 1e-2}),
    ("Adagrad", {"lr": 1e-2}),
    ("Adamax", {"lr": 1e-2}),
    ("RMSprop", {"lr": 1e-3, "momentum": 0.5, "centered": True}),
    ("RAdam", {"lr": 1e-2, "decoupled_weight_decay": True, "weight_decay": 0.1}),
]
SHAPES = [(5, 3), (4,), (), (6, 2)]  # 5 rows: uneven over 2 ranks; (): a replicated scalar


def _params(mesh, seed: int):
    from torch.distributed.tensor import Replicate, Shard, distribute_tensor

    g = torch.Generator().manual_seed(seed)
    return [torch.nn.Parameter(distribute_tensor(torch.randn(s, generator=g), mesh,
                                                 [Replicate()] if not s else [Shard(0)])) for s in SHAPES]


def _set_grads(params, step: int, mesh) -> None:
    from torch.distributed.tensor import distribute_tensor

    g = torch.Generator().manual_seed(1000 + step)
    for i, p in enumerate(params):
        full = torch.randn(p.shape, generator=g)
        # The last parameter has no gradient on odd steps: skipped, as the optimizer skips it.
        p.grad = None if (i == len(params) - 1 and step % 2) else distribute_tensor(full, mesh, p.placements)


def _state_signature(optimizer) -> dict:
    """Every state entry: its type (DTensor or not), layout and local bits."""
    from torch.distributed.tensor import DTensor

    out = {}
    for i, p in enumerate(p for g in optimizer.param_groups for p in g["params"]):
        for k, v in optimizer.state.get(p, {}).items():
            if isinstance(v, DTensor):
                out[(i, k)] = ("dtensor", tuple(v.placements), tuple(v.shape), v._local_tensor.clone())
            elif torch.is_tensor(v):
                out[(i, k)] = ("tensor", v.clone())
            else:
                out[(i, k)] = ("value", v)
    return out


def _equal(a, b) -> bool:
    if torch.is_tensor(a):
        return torch.equal(a, b)
    if isinstance(a, tuple):
        return len(a) == len(b) and all(_equal(x, y) for x, y in zip(a, b))
    return a == b


def _worker(rank: int, world: int) -> dict:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor
    from torch.utils._python_dispatch import TorchDispatchMode

    from zeropp_strategy.engine.local_step import LocalStepOptimizer, local_shards, steps_locally

    mesh = init_device_mesh("cpu", (world,))
    out: dict = {"cases": {}}

    class CountDTensorOps(TorchDispatchMode):
        """Counts the operators that reach the dispatcher with a DTensor argument."""

        def __init__(self) -> None:
            super().__init__()
            self.count = 0

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # noqa: ANN001, ANN204
            self.count += any(issubclass(t, DTensor) for t in types)
            return func(*args, **(kwargs or {}))

    for name, kw in CASES:
        cls = getattr(torch.optim, name)
        ref_params, params = _params(mesh, 0), _params(mesh, 0)
        ref, opt = cls(ref_params, **kw), LocalStepOptimizer(cls(params, **kw))
        local_dispatches = 0
        for step in range(4):
            _set_grads(ref_params, step, mesh)
            _set_grads(params, step, mesh)
            with CountDTensorOps() as counter:
                ref.step()
            out.setdefault("reference_dispatches", counter.count)  # the check can see DTensor steps
            with CountDTensorOps() as counter:
                opt.step()
            local_dispatches += counter.count
        a, b = _state_signature(ref), _state_signature(opt.optimizer)
        out["cases"][f"{name} {kw}"] = {
            "params_equal": all(torch.equal(x._local_tensor, y._local_tensor) for x, y in zip(ref_params, params)),
            "state_keys_equal": a.keys() == b.keys(),
            "state_equal": a.keys() == b.keys() and all(_equal(a[k], b[k]) for k in a),
            "dtensor_state": sorted(str(k) for k, v in b.items() if v[0] == "dtensor"),
            "dispatches": local_dispatches,
            "groups_restored": all(isinstance(p, torch.distributed.tensor.DTensor)
                                   for g in opt.param_groups for p in g["params"]),
        }

    # A resumed optimizer (state loaded from a DTensor step's state_dict) continues alike.
    ref_params, params = _params(mesh, 1), _params(mesh, 1)
    ref, other = torch.optim.AdamW(ref_params, lr=1e-2), torch.optim.AdamW(params, lr=1e-2)
    _set_grads(ref_params, 0, mesh)
    ref.step()
    other.load_state_dict(copy.deepcopy(ref.state_dict()))  # its own tensors, as from a checkpoint
    with torch.no_grad():
        for x, y in zip(ref_params, params):
            y.copy_(x)
    opt = LocalStepOptimizer(other)
    for step in (1, 2):
        _set_grads(ref_params, step, mesh)
        _set_grads(params, step, mesh)
        ref.step()
        opt.step()
    out["resumed_equal"] = all(torch.equal(x._local_tensor, y._local_tensor) for x, y in zip(ref_params, params))

    # Outside ELEMENTWISE (a subclass too): nothing changes, the step runs on DTensors.
    class MyAdamW(torch.optim.AdamW):
        pass

    sub = MyAdamW(_params(mesh, 2), lr=1e-2)
    with local_shards(sub) as used:
        out["subclass_used"] = used
        out["subclass_groups_dtensor"] = all(isinstance(p, torch.distributed.tensor.DTensor)
                                             for g in sub.param_groups for p in g["params"])
    out["steps_locally"] = (steps_locally(torch.optim.AdamW(_params(mesh, 3))), steps_locally(sub))

    # An error inside the step (here from a step pre-hook, after the swap) leaves the
    # optimizer's groups and DTensor state as they were.
    params = _params(mesh, 4)
    inner = torch.optim.Adam(params, lr=1e-2)
    opt = LocalStepOptimizer(inner)
    _set_grads(params, 0, mesh)
    opt.step()
    before = _state_signature(inner)

    def fail(*_):  # noqa: ANN002, ANN202
        raise RuntimeError("boom")

    handle = inner.register_step_pre_hook(fail)
    try:
        opt.step()
        out["raised"] = False
    except RuntimeError:
        out["raised"] = True
    handle.remove()
    after = _state_signature(inner)
    out["after_error_groups"] = [isinstance(p, torch.distributed.tensor.DTensor) for g in inner.param_groups
                                 for p in g["params"]]
    out["after_error_state_equal"] = before.keys() == after.keys() and all(_equal(before[k], after[k]) for k in before)
    out["after_error_local_grads"] = [p._local_tensor.grad is None for p in params]
    return out


@pytest.fixture(scope="module")
def results():
    return run_ranks(_worker, 2, (), timeout_s=300, init_process_group=True)


def test_local_step_equals_the_dtensor_step_bit_for_bit(results):
    for rank, out in enumerate(results):
        assert len(out["cases"]) == len(CASES), out["cases"].keys()
        for case, r in out["cases"].items():
            assert r["params_equal"] and r["state_equal"], (rank, case, r)
            assert r["groups_restored"], (rank, case)
            # Per-element state stays a DTensor laid out like its parameter (state_equal
            # compares the layouts too); step stays plain. Plain SGD keeps no state.
            assert bool(r["dtensor_state"]) == (case != "SGD {'lr': 0.01}"), (rank, case, r)
            assert not any("'step'" in k for k in r["dtensor_state"]), (rank, case, r)
        assert out["resumed_equal"], rank


def test_local_step_skips_the_dtensor_dispatcher(results):
    for out in results:
        assert out["reference_dispatches"] > 0  # the counter sees a DTensor step's operators
        assert {case: r["dispatches"] for case, r in out["cases"].items()} == dict.fromkeys(out["cases"], 0)


def test_only_the_listed_classes_step_locally(results):
    for out in results:
        assert out["steps_locally"] == (True, False)
        assert out["subclass_used"] is False and out["subclass_groups_dtensor"]


def test_an_error_in_the_step_leaves_the_optimizer_intact(results):
    for out in results:
        assert out["raised"]
        assert out["after_error_groups"] == [True] * len(SHAPES)
        assert out["after_error_state_equal"] and all(out["after_error_local_grads"])

"""FSDP2's private APIs live only in ``zeropp_strategy/fsdp_private.py``.

    pytest tests/test_fsdp_private.py -q

- a source scan (``ast``) of the package, callbacks and recipes: no other module imports
  a private module of ``torch.distributed.fsdp`` or uses a private name the adapter wraps
  (import-linter cannot say this: it sees external packages by their top-level name);
- the version check: a missing name raises ``UnsupportedTorchError`` naming the torch
  version, the name, the supported and checked versions and the fix;
- the adapter's functions on a real FSDP2 model (2 gloo ranks, one spawned group),
  checked against the same model run unsharded in one process.
"""

from __future__ import annotations

import ast
import copy
import math
from pathlib import Path

import pytest
import torch
from torch import nn

from tests._dist import run_ranks
from zeropp_strategy import fsdp_private
from zeropp_strategy.fsdp_private import UnsupportedTorchError

pytestmark = pytest.mark.compat  # the whole file: the adapter is what changes between torch releases

REPO = Path(__file__).resolve().parents[1]
ADAPTER = REPO / "zeropp_strategy" / "fsdp_private.py"
SOURCES = ("zeropp_strategy", "callbacks", "recipes")
FSDP = "torch.distributed.fsdp"

# Names the adapter reads that are not FSDP2 private, so others may use them: FSDPModule's
# public ``unshard``, and DTensor's ``_local_tensor`` (engine/frozen.py unwraps int8 shards).
NOT_FSDP2_PRIVATE = frozenset({"unshard", "_local_tensor"})


def wrapped_names() -> frozenset[str]:
    """The attribute names the adapter looks up on FSDP2's objects: the string given to
    its ``_attr`` / ``_set`` / ``getattr`` (read from its source, so a name added there is
    guarded here too), less those that are not FSDP2 private."""
    names = set()
    for node in ast.walk(ast.parse(ADAPTER.read_text())):
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and len(node.args) >= 2:
            arg = node.args[1]
            if node.func.id in ("_attr", "_set", "getattr") and isinstance(arg, ast.Constant):
                names.add(arg.value)
    return frozenset(names - NOT_FSDP2_PRIVATE)


def _dotted(node: ast.AST) -> str:
    parts = []
    while isinstance(node, ast.Attribute):
        parts.append(node.attr)
        node = node.value
    if isinstance(node, ast.Name):
        parts.append(node.id)
    return ".".join(reversed(parts))


def _private_fsdp_module(name: str) -> bool:
    return name.startswith(FSDP + ".") and name[len(FSDP) + 1 :].startswith("_")


def private_uses(source: str, names: frozenset[str]) -> list[tuple[int, str]]:
    """(line, what) for each private FSDP2 use in ``source``: an import of a private
    module of torch.distributed.fsdp (``import``, ``from ... import``, or a module path
    handed to a call such as ``importlib.import_module``), an attribute in ``names``
    (read or written), or ``getattr``/``hasattr``/``setattr`` given one of them."""
    found = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            found += [(node.lineno, f"import {a.name}") for a in node.names if _private_fsdp_module(a.name)]
        elif isinstance(node, ast.ImportFrom) and node.module:
            if _private_fsdp_module(node.module):
                found.append((node.lineno, f"from {node.module} import ..."))
            elif node.module == FSDP:
                found += [(node.lineno, f"from {FSDP} import {a.name}") for a in node.names if a.name.startswith("_")]
        elif isinstance(node, ast.Attribute):
            if node.attr in names:
                found.append((node.lineno, f".{node.attr}"))
            elif _private_fsdp_module(_dotted(node)):
                found.append((node.lineno, _dotted(node)))
        elif isinstance(node, ast.Call):
            for arg in node.args:
                if isinstance(arg, ast.Constant) and isinstance(arg.value, str) and (
                    arg.value in names or _private_fsdp_module(arg.value)
                ):
                    found.append((node.lineno, f"{_dotted(node.func)}(..., {arg.value!r})"))
    return found


# -- the policy ---------------------------------------------------------------------------------


def test_the_adapter_names_are_read_from_its_source() -> None:
    names = wrapped_names()
    core = {"_get_fsdp_state", "_fsdp_param_groups", "_fsdp_param_group", "_auto_reshard_after_forward",
            "post_forward_mesh_info",
            "fsdp_params", "_sharded_param_data", "padded_sharded_param_size", "_all_gather_result",
            "is_unsharded", "_set_unshard_async_op", "sharded_param"}
    assert core <= names, sorted(core - names)


def test_only_the_adapter_touches_fsdp2_private_apis() -> None:
    names = wrapped_names()
    files = sorted(p for top in SOURCES for p in (REPO / top).rglob("*.py"))
    assert ADAPTER in files and len(files) > 50, files
    offenders = [
        f"{path.relative_to(REPO)}:{line}: {what}"
        for path in files if path != ADAPTER
        for line, what in private_uses(path.read_text(), names)
    ]
    assert not offenders, (
        "FSDP2 private APIs used outside zeropp_strategy/fsdp_private.py (add a function there and call it):\n"
        + "\n".join(offenders)
    )


def test_the_scan_finds_every_kind_of_private_use() -> None:
    names = wrapped_names()
    bad = {
        "import torch.distributed.fsdp._fully_shard._fsdp_api as api": "import torch.distributed.fsdp._fully_shard",
        "from torch.distributed.fsdp._fully_shard._fsdp_api import AllGather": "from torch.distributed.fsdp._fully",
        "from torch.distributed.fsdp import _fully_shard": "from torch.distributed.fsdp import _fully_shard",
        "x = torch.distributed.fsdp._fully_shard.FSDPModule": "torch.distributed.fsdp._fully_shard",
        "importlib.import_module('torch.distributed.fsdp._fully_shard')": "import_module(",
        "state = m._get_fsdp_state()": "._get_fsdp_state",
        "groups = state._fsdp_param_groups": "._fsdp_param_groups",
        "fp._sharded_param_data = region": "._sharded_param_data",
        "if g._all_gather_result is not None or g.is_unsharded: pass": "._all_gather_result",
        "ok = hasattr(root, '_set_unshard_async_op')": "hasattr(..., '_set_unshard_async_op')",
        "for fp in g.fsdp_params: pass": ".fsdp_params",
    }
    for source, expected in bad.items():
        found = private_uses(source, names)
        assert found and any(expected in what for _, what in found), (source, found)
    clean = ("from torch.distributed.fsdp import FSDPModule, fully_shard\n"
             "block.set_reshard_after_forward(False)\nblock.unshard()\nx = t._local_tensor\n"
             '"""docs may name torch.distributed.fsdp._fully_shard and _fsdp_param_groups"""\n')
    assert private_uses(clean, names) == []


# -- the version check --------------------------------------------------------------------------


def _assert_clear(error: UnsupportedTorchError, name: str) -> None:
    text = str(error)
    newest = fsdp_private.CHECKED_TORCH[-1]
    for part in (name, f"torch {torch.__version__}", "torch>=2.11", "checked on torch 2.11, 2.12, 2.13, 2.14",
                 f"Fix: install a checked torch (pip install 'torch=={newest}.*')", "zeropp_strategy/fsdp_private.py"):
        assert part in text, (part, text)


def test_installed_torch_passes_the_check() -> None:
    fsdp_private.check_torch()
    assert fsdp_private.SUPPORTED_TORCH == ">=2.11"
    assert fsdp_private.CHECKED_TORCH == ("2.11", "2.12", "2.13", "2.14")
    # The installed torch is one the names were read from (the suite on 2.13, CI's compatibility runs on 2.11 and
    # 2.14): a run on another torch fails here first, naming it, instead of somewhere deep in FSDP2.
    installed = ".".join(torch.__version__.split("+")[0].split(".")[:2])
    assert installed in fsdp_private.CHECKED_TORCH, (torch.__version__, fsdp_private.CHECKED_TORCH)
    pins = [line for line in (REPO / "pyproject.toml").read_text().splitlines() if line.strip().startswith('"torch')]
    assert pins == [f'    "torch{fsdp_private.SUPPORTED_TORCH}",'], pins  # the range the error names is the real one


def test_a_missing_private_name_raises_a_clear_error(monkeypatch: pytest.MonkeyPatch) -> None:
    from torch.distributed.fsdp import FSDPModule

    monkeypatch.setattr(torch, "__version__", "9.9.0")
    monkeypatch.delattr(FSDPModule, "_get_fsdp_state")
    with pytest.raises(UnsupportedTorchError) as info:
        fsdp_private.check_torch()
    _assert_clear(info.value, "FSDPModule._get_fsdp_state")
    assert "torch 9.9.0 does not have" in str(info.value)


def test_missing_comm_bases_raise_a_clear_error(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(fsdp_private, "_API_MODULE", "torch.distributed.fsdp._no_such_module")
    with pytest.raises(UnsupportedTorchError) as info:
        fsdp_private.check_torch()
    _assert_clear(info.value, "torch.distributed.fsdp._no_such_module.AllGather / ReduceScatter")


def _block(state: object) -> object:
    class Block:
        def _get_fsdp_state(self) -> object:
            return state

    return Block()


def test_groups_are_read_from_either_torch_layout() -> None:
    """torch 2.12+ keep a list of groups; torch 2.11 one optional group. The suite runs
    one torch at a time, so both layouts are checked here on stand-ins (and for real on
    each torch by test_the_adapter_on_a_real_fsdp2_model in CI's compatibility runs)."""
    group, other = object(), object()

    class State211:
        def __init__(self, group: object) -> None:
            self._fsdp_param_group = group

    class State213:
        def __init__(self, groups: list) -> None:
            self._fsdp_param_groups = groups

        @property
        def _fsdp_param_group(self) -> object:  # 2.12+: refuses more than one group
            raise AssertionError("the singular property must not be read where the list exists")

    assert fsdp_private.param_groups(_block(State211(group))) == [group]  # type: ignore[arg-type]
    assert fsdp_private.param_groups(_block(State211(None))) == []  # type: ignore[arg-type]
    assert fsdp_private.param_groups(_block(State213([group, other]))) == [group, other]  # type: ignore[arg-type]
    assert fsdp_private.param_groups(_block(State213([]))) == []  # type: ignore[arg-type]


def test_a_missing_instance_name_raises_on_first_use() -> None:
    class State:  # what a torch that renamed both the groups list and the single group would hand back
        _param_groups: list = []

    with pytest.raises(UnsupportedTorchError) as info:
        fsdp_private.param_groups(_block(State()))  # type: ignore[arg-type]
    _assert_clear(info.value, "State._fsdp_param_groups (torch 2.12+) or _fsdp_param_group (torch 2.11)")

    class Group:
        fsdp_params: list = []
        is_unsharded = False

    with pytest.raises(UnsupportedTorchError) as info:
        fsdp_private.unshard_is_noop(Group())
    _assert_clear(info.value, "Group._all_gather_result")


def test_set_unshard_async_is_optional() -> None:
    assert fsdp_private.set_unshard_async(nn.Linear(2, 2)) is False  # type: ignore[arg-type]


# -- the functions on a real FSDP2 model --------------------------------------------------------


def _forward_backward(model: nn.Module, x: torch.Tensor) -> tuple[torch.Tensor, list[torch.Tensor]]:
    model.zero_grad(set_to_none=True)
    out = model(x)
    out.square().sum().backward()
    grads = [p.grad.full_tensor() if hasattr(p.grad, "full_tensor") else p.grad for p in model.parameters()]
    return out.detach(), [g.detach() for g in grads]


def _real_fsdp2_worker(rank: int, world_size: int) -> dict:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    from zeropp_strategy.fsdp_private import (
        group_params,
        keep_unsharded_after_forward,
        padded_shard_size,
        param_groups,
        set_sharded_data,
        set_unshard_async,
        sharded_data,
        sharded_param,
        unshard_is_noop,
        wrap_unshard,
    )

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 6), nn.Tanh(), nn.Linear(6, 3))  # 3 rows on 2 ranks: padded shards
    reference = copy.deepcopy(model)
    x = torch.randn(5, 4)  # the same on every rank, so FSDP2's averaged grads equal one process's
    first, last = model[0], model[2]
    # a CPU mesh named explicitly: on a machine with a GPU, fully_shard's default mesh is a
    # CUDA one and rank 1 asks for a device the machine may not have
    mesh = init_device_mesh("cpu", (world_size,))
    for block in (first, last):
        fully_shard(block, mesh=mesh)
    fully_shard(model, mesh=mesh)

    # Groups and parameters.
    assert param_groups(model) == []  # the root holds no parameters of its own
    (group,) = param_groups(first)
    fps = group_params(group)
    assert [sharded_param(fp) for fp in fps] == [first.weight, first.bias]
    (last_group,) = param_groups(last)
    w = group_params(last_group)[0]
    assert padded_shard_size(w) == torch.Size([math.ceil(3 / world_size), 6])
    assert sharded_data(w).dim() == 1 and sharded_data(w).numel() == math.prod(padded_shard_size(w))
    assert sharded_param(w).to_local().data_ptr() == sharded_data(w).data_ptr()

    # Every gather goes through wrap_unshard; noop tells a real gather from FSDP2's no-op.
    gathers: dict[str, int] = {"first": 0, "last": 0}
    for name, g in (("first", group), ("last", last_group)):
        def count(unshard, async_op, name=name, g=g):  # noqa: ANN001, ANN202
            if not unshard_is_noop(g):
                gathers[name] += 1
            return unshard(async_op)
        wrap_unshard(g, count)
    assert not unshard_is_noop(group)
    out, grads = _forward_backward(model, x)
    ref_out, ref_grads = _forward_backward(reference, x)
    torch.testing.assert_close(out, ref_out)
    for got, want in zip(grads, ref_grads):
        torch.testing.assert_close(got, want)
    assert gathers == {"first": 2, "last": 2}, gathers  # forward, then again in backward
    first.unshard()
    assert unshard_is_noop(group)
    first.reshard()
    assert not unshard_is_noop(group)

    # set_sharded_data: FSDP2 gathers from the new storage, the DTensor views it.
    new = sharded_data(w).clone()
    set_sharded_data(w, new)
    assert sharded_data(w) is new and sharded_param(w).to_local().data_ptr() == new.data_ptr()
    with torch.no_grad():
        new.mul_(2)
        reference[2].weight.mul_(2)
        torch.testing.assert_close(model(x), reference(x))
    try:
        set_sharded_data(w, torch.zeros(3))
        raise AssertionError("set_sharded_data took a tensor of the wrong size")
    except ValueError as e:
        assert "set_sharded_data: data must be 1-D" in str(e) and "Fix:" in str(e)

    # keep_unsharded_after_forward: one gather for many forwards, then the settings come back.
    state = first._get_fsdp_state()
    before = (state._auto_reshard_after_forward, group.post_forward_mesh_info)
    assert before[0] is True and before[1] is not None  # fully_shard's default: FSDP2 chose to reshard
    gathers["first"] = 0
    with torch.no_grad():
        with keep_unsharded_after_forward(first):
            for _ in range(3):
                torch.testing.assert_close(model(x), reference(x))
            assert unshard_is_noop(group) and gathers["first"] == 1
        assert not unshard_is_noop(group)
        assert (state._auto_reshard_after_forward, group.post_forward_mesh_info) == before
        model(x)
        model(x)
    assert gathers["first"] == 3, gathers  # resharding after forward again

    # Asynchronous unshards: same numbers.
    assert set_unshard_async(model) is True
    assert all(g.unshard_async_op for g in (group, last_group))
    out, grads = _forward_backward(model, x)
    ref_out, ref_grads = _forward_backward(reference, x)
    torch.testing.assert_close(out, ref_out)
    for got, want in zip(grads, ref_grads):
        torch.testing.assert_close(got, want)
    return {"rank": rank, "gathers": dict(gathers)}


def test_the_adapter_on_a_real_fsdp2_model() -> None:
    results = run_ranks(_real_fsdp2_worker, 2, timeout_s=180, init_process_group=True)
    assert [r["rank"] for r in results] == [0, 1]

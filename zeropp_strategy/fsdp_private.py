"""Layer: primitives, the bottom one beside kernels. The one place in the package that
touches PyTorch FSDP2's private modules and attributes.

[Note: FSDP2 private APIs]
FSDP2's public surface (``fully_shard``, ``FSDPModule``, the policies) covers almost all
we need. Where it does not, we reach inside, and only here:

- the comm-object bases ``AllGather`` / ``ReduceScatter``: public API (what
  ``set_custom_all_gather`` / ``set_custom_reduce_scatter`` take), but torch 2.11-2.14
  export them only from the private ``torch.distributed.fsdp._fully_shard._fsdp_api``;
- a module's parameter groups and their parameters (``param_groups``, ``group_params``):
  FSDP2 has no public handle on them; the NVMe ``ParamStore`` needs them to re-home each
  shard into a swap file (``sharded_data``, ``set_sharded_data``) and to learn the
  order in which groups are gathered (``wrap_unshard``, ``unshard_is_noop``);
- ``keep_unsharded_after_forward``: the public ``set_reshard_after_forward`` cannot
  be undone (it forgets whether FSDP2 chose the setting itself and any hpZ secondary
  shard), so generation's gather-once rule saves and restores the private state;
- ``set_unshard_async``: asynchronous unshards on the host ([Note: prefetch] in
  engine/fsdp.py), a private method in torch 2.11-2.14.

Policy: no other module of the package imports a private module of
``torch.distributed.fsdp`` or reads the private names used here; tests/test_fsdp_private.py
scans the source for them. So a torch release that renames one breaks here, in one place.

Per version. The names were read from FSDP2's source of torch 2.11, 2.12, 2.13 and 2.14
(``CHECKED_TORCH``) and are exercised by the suite on 2.13 and by CI's compatibility runs
on 2.11 and 2.14 (``.ci/compat``). One name differs between them:

==========================  =============================================================
FSDPState's groups          torch 2.11: ``_fsdp_param_group``, one group or None;
                            torch 2.12+: ``_fsdp_param_groups``, a list (grouped
                            ``fully_shard([a, b])`` puts several in one state; the
                            singular became a property that refuses more than one)
==========================  =============================================================

every other name is the same in all four. ``_state_groups`` reads whichever the installed
torch has, so the callers see a list on every version.

Version check. At import, the names that can be seen without a sharded module (the
comm-object bases, ``FSDPModule._get_fsdp_state``) are looked up; the others FSDP2 sets on
each instance, so each function looks them up on the object it is given. Either way a
missing name raises ``UnsupportedTorchError``, naming the installed torch, the missing
name, the versions this module was checked against and the fix. ``set_unshard_async`` is
the one optional name: without it gathers stay inline (slower on the host, not wrong).
"""

from __future__ import annotations

import importlib
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import torch
from torch import Tensor, nn
from torch.distributed.fsdp import FSDPModule

from zeropp_strategy.errors import UsageError

__all__ = [
    "CHECKED_TORCH",
    "SUPPORTED_TORCH",
    "AllGather",
    "ReduceScatter",
    "UnsupportedTorchError",
    "check_torch",
    "group_params",
    "keep_unsharded_after_forward",
    "padded_shard_size",
    "param_groups",
    "reset_sharded_param",
    "set_sharded_data",
    "set_unshard_async",
    "sharded_data",
    "sharded_param",
    "unshard_is_noop",
    "wrap_unshard",
]

SUPPORTED_TORCH = ">=2.11"
"""The torch versions pyproject.toml allows."""
CHECKED_TORCH = ("2.11", "2.12", "2.13", "2.14")
"""The torch versions whose FSDP2 source these private names were read from and tested on."""

_API_MODULE = "torch.distributed.fsdp._fully_shard._fsdp_api"
_ABSENT = object()
_WHY_STATE = "a module's FSDP state, which holds its parameter groups"
_WHY_GROUPS = "the parameter groups of an FSDP module"


class UnsupportedTorchError(UsageError):
    """The installed torch lacks an FSDP2 private name that zeropp_strategy uses."""


def _missing(name: str, why: str) -> UnsupportedTorchError:
    return UnsupportedTorchError(
        f"zeropp_strategy uses FSDP2's private {name} ({why}), which the installed torch {torch.__version__} "
        f"does not have. zeropp_strategy supports torch{SUPPORTED_TORCH}; its FSDP2 private names were checked "
        f"on torch {', '.join(CHECKED_TORCH)}",
        f"install a checked torch (pip install 'torch=={CHECKED_TORCH[-1]}.*'), or port "
        "zeropp_strategy/fsdp_private.py, the only module that uses FSDP2's private names, to this torch",
    )


def _attr(obj: Any, name: str, why: str) -> Any:
    """``obj.name``, or ``UnsupportedTorchError`` naming ``type(obj).name`` when absent."""
    value = getattr(obj, name, _ABSENT)
    if value is _ABSENT:
        owner = obj if isinstance(obj, type) else type(obj)
        raise _missing(f"{owner.__name__}.{name}", why)
    return value


def _set(obj: Any, name: str, value: Any, why: str) -> None:
    """Assign an existing attribute: a renamed one must not be created silently."""
    _attr(obj, name, why)
    setattr(obj, name, value)


def _comm_bases() -> tuple[type, type]:
    """FSDP2's comm-object base classes: from ``torch.distributed.fsdp`` once a torch
    exports them there, else from the private module that defines them."""
    for where in ("torch.distributed.fsdp", _API_MODULE):
        try:
            module = importlib.import_module(where)
        except ImportError:
            continue
        if hasattr(module, "AllGather") and hasattr(module, "ReduceScatter"):
            return module.AllGather, module.ReduceScatter
    raise _missing(f"{_API_MODULE}.AllGather / ReduceScatter",
                   "the base classes of the comm objects given to set_custom_all_gather / set_custom_reduce_scatter")


def check_torch() -> None:
    """Raise ``UnsupportedTorchError`` unless the installed torch has the FSDP2 private
    names visible without a sharded module. Runs at import; the names FSDP2 sets per
    instance are checked by each function on first use."""
    _comm_bases()
    _attr(FSDPModule, "_get_fsdp_state", _WHY_STATE)


check_torch()
AllGather, ReduceScatter = _comm_bases()


# -- groups and their parameters ---------------------------------------------------------


def param_groups(module: FSDPModule) -> list[Any]:
    """The parameter groups (FSDP2's ``FSDPParamGroup``) that ``fully_shard(module)``
    created: the unit FSDP2 all-gathers and reduce-scatters. Empty for a module that
    was given no parameters of its own (its children's belong to their own groups)."""
    state = _attr(module, "_get_fsdp_state", _WHY_STATE)()
    return _state_groups(state)


def _state_groups(state: Any) -> list[Any]:
    """The groups of one FSDP state as a list, on every checked torch: 2.12+ keep a list
    (``_fsdp_param_groups``); 2.11 keeps one optional group (``_fsdp_param_group``)."""
    groups = getattr(state, "_fsdp_param_groups", _ABSENT)
    if groups is not _ABSENT:
        return list(groups)
    group = getattr(state, "_fsdp_param_group", _ABSENT)  # torch 2.11
    if group is _ABSENT:
        raise _missing(f"{type(state).__name__}._fsdp_param_groups (torch 2.12+) or _fsdp_param_group (torch 2.11)",
                       _WHY_GROUPS)
    return [] if group is None else [group]


def group_params(group: Any) -> list[Any]:
    """The parameters (FSDP2's ``FSDPParam``) of one group, in FSDP2's order."""
    return list(_attr(group, "fsdp_params", "the parameters of an FSDP parameter group"))


def sharded_param(fsdp_param: Any) -> nn.Parameter:
    """The DTensor parameter the module holds for ``fsdp_param`` (this rank's shard
    inside): what optimizers, ``state_dict`` and user code see."""
    return _attr(fsdp_param, "sharded_param", "the module's DTensor for an FSDP parameter")


def sharded_data(fsdp_param: Any) -> Tensor:
    """This rank's shard as FSDP2's flat, padded 1-D tensor (``_sharded_param_data``):
    what the all-gather copies in. ``sharded_param(fsdp_param)``'s local tensor is a view
    of its first rows (without the padding)."""
    return _attr(fsdp_param, "_sharded_param_data", "the flat storage of a parameter's shard")


def padded_shard_size(fsdp_param: Any) -> torch.Size:
    """The shape of this rank's shard with FSDP2's padding: dim 0 is the same on every
    rank (ceil(rows / world)); ``sharded_data`` holds that many elements."""
    return _attr(fsdp_param, "padded_sharded_param_size", "the padded shape of a parameter's shard")


@torch.no_grad()
def set_sharded_data(fsdp_param: Any, data: Tensor) -> None:
    """Make ``data`` (1-D, the dtype and number of elements of ``sharded_data``, values
    already copied in) the storage of this rank's shard: FSDP2's flat copy becomes
    ``data`` and the DTensor's local tensor a view of it, so both read and write
    ``data`` (the NVMe ``ParamStore`` passes a view of a memory-mapped swap file)."""
    old = sharded_data(fsdp_param)
    if data.dim() != 1 or data.numel() != old.numel() or data.dtype != old.dtype:
        raise ValueError(
            f"set_sharded_data: data must be 1-D with {old.numel()} elements of {old.dtype} (the shard's padded "
            f"storage), got shape {tuple(data.shape)} of {data.dtype}. Fix: pass a tensor shaped like "
            "sharded_data(fsdp_param)"
        )
    dtensor = sharded_param(fsdp_param)
    local = _attr(dtensor, "_local_tensor", "the local tensor of a DTensor")
    rows = local.size(0) if local.numel() > 0 else 0  # an empty shard (more ranks than rows) stays empty
    padded = data.view(padded_shard_size(fsdp_param))
    _set(fsdp_param, "_sharded_param_data", data, "the flat storage of a parameter's shard")
    _set(dtensor, "_local_tensor", padded.narrow(0, 0, rows), "the local tensor of a DTensor")


def reset_sharded_param(fsdp_param: Any) -> None:
    """Let FSDP2 pick up a sharded parameter that ``nn.Module._apply`` replaced (``to_empty``
    of one submodule at a time, for example): FSDP2 does this for a whole ``fully_shard``
    module after its own ``_apply``; a group materialized submodule by submodule needs it
    once its parameters are real."""
    _attr(fsdp_param, "reset_sharded_param", "re-reading a parameter that _apply replaced")()


# -- unsharding ---------------------------------------------------------------------------


def unshard_is_noop(group: Any) -> bool:
    """True when FSDP2's ``unshard`` of ``group`` would do nothing: its all-gather was
    issued already (a prefetch, still to be waited on) or its parameters are unsharded."""
    pending = _attr(group, "_all_gather_result", "whether a group's all-gather is in flight")
    return pending is not None or bool(_attr(group, "is_unsharded", "whether a group is unsharded"))


def wrap_unshard(group: Any, wrapper: Callable[..., Any]) -> None:
    """Route every unshard of ``group`` (FSDP2's hooks and prefetches call the group's
    ``unshard(async_op)``) through ``wrapper(unshard, async_op)``, where ``unshard`` is
    the original; ``wrapper`` must call it and return its result."""
    unshard = _attr(group, "unshard", "the all-gather of a parameter group")

    def unshard_wrapped(async_op: bool = False) -> Any:
        return wrapper(unshard, async_op)

    group.unshard = unshard_wrapped  # an instance attribute: wins over the method


@contextmanager
def keep_unsharded_after_forward(block: FSDPModule) -> Iterator[None]:
    """Within the context ``block``'s own groups stay unsharded after its forward (one
    all-gather however many forwards run); on exit they are resharded and FSDP2's
    reshard-after-forward state is restored as it was, including whether FSDP2 chose it
    itself (the root) and an hpZ secondary shard, which ``set_reshard_after_forward``
    alone would lose."""
    state = _attr(block, "_get_fsdp_state", _WHY_STATE)()
    auto = _attr(state, "_auto_reshard_after_forward", "whether FSDP2 chose reshard_after_forward itself")
    groups = _state_groups(state)
    mesh_infos = [_attr(g, "post_forward_mesh_info", "a group's mesh after forward (hpZ)") for g in groups]
    block.set_reshard_after_forward(False, recurse=False)
    try:
        yield
    finally:
        block.reshard()
        state._auto_reshard_after_forward = auto
        for group, info in zip(groups, mesh_infos):
            group.post_forward_mesh_info = info


def set_unshard_async(module: FSDPModule) -> bool:
    """Make the unshards of ``module`` and the FSDP modules inside it asynchronous (FSDP2
    waits on the comm object's work right before the parameters are needed; see
    [Note: prefetch] in engine/fsdp.py). Returns False, changing nothing, where the
    installed torch lacks the private switch: gathers then stay inline."""
    switch = getattr(module, "_set_unshard_async_op", None)
    if switch is None:
        return False
    switch(True)
    return True

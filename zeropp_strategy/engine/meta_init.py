"""Layer: engine. Building a model on the meta device as if it were built for real.

    with meta_build():                    # what the front-ends enter for configure_model / init_module
        model = MyTransformer()           # no memory: every tensor is on the meta device
    ...
    materialize(model, device)            # engine/materialize.py: shard by shard, from the build's random state

[Note: the build's random state]
At stages 2 and 3 the front-ends build the user's model on the meta device by default
(``ZeroConfig.meta_init``), so that no rank ever holds it whole; ``materialize`` allocates
and initializes each shard after sharding. A model built for real draws its initial values
while it is built (``nn.Linear.__init__`` calls ``reset_parameters``, which draws from the
CPU generator); on the meta device those draws are no-ops. ``meta_build`` keeps the CPU
generator's state at the end of the build with the modules that registered a meta tensor
in it, and ``replayed_rng`` restores it while their root is initialized, module by module in
registration order. For modules that draw their values in ``reset_parameters`` and are
registered in the order they were built (the usual ``self.a = A(); self.b = B()``), the
draws are the same as the real build's, so the model starts from the values it would have
had without the meta device, bit for bit, and the generator is left where a real build
would have left it (what a ``seed_everything`` before ``configure_model`` promises under
DDP). A Hugging Face model's real build draws twice (each layer's own init, then
``_init_weights``); on meta only ``_init_weights`` runs (a parent's redraw of its children's
tensors after their own init, as in Hugging Face: [Note: inits that reach into submodules]
in engine/parent_init.py), so
its values are drawn from the same distributions but are not the real build's. Only the CPU generator is replayed: on a
GPU mesh DTensor's own RNG tracker draws each shard at its offset.
"""

from __future__ import annotations

import weakref
from collections.abc import Iterator
from contextlib import AbstractContextManager, contextmanager, nullcontext
from contextvars import ContextVar

import torch
from torch import nn
from torch.nn.modules.module import (
    register_module_buffer_registration_hook,
    register_module_parameter_registration_hook,
)

from zeropp_strategy.errors import UsageError

__all__ = ["build_context", "build_rng_state", "has_meta", "meta_build", "replayed_rng"]

# module -> the CPU generator's state when the meta build that created it ended
_BUILD_STATE: weakref.WeakKeyDictionary[nn.Module, torch.Tensor] = weakref.WeakKeyDictionary()


@contextmanager
def meta_build() -> Iterator[None]:
    """``torch.device("meta")``, and the CPU generator's state at the end, kept with every
    module that registered a meta parameter or buffer inside ([Note: the build's random state])."""
    built: list[nn.Module] = []

    def seen(module: nn.Module, name: str, tensor: torch.Tensor | None) -> None:
        if tensor is not None and tensor.is_meta:
            built.append(module)

    hooks = [register_module_parameter_registration_hook(seen), register_module_buffer_registration_hook(seen)]
    try:
        with torch.device("meta"):
            yield
    except RuntimeError as e:
        if "from_pretrained" in str(e) and "meta device" in str(e):  # transformers refuses to load into meta
            raise UsageError(
                "from_pretrained was called where the zeropp strategy builds the model on the meta device "
                "(configure_model, or init_module, at stages 2/3: ZeroConfig.meta_init), and transformers "
                "cannot load weights into meta tensors",
                "load it with zeropp_strategy.from_pretrained(path) (a local save_pretrained folder of safetensors: "
                "each rank reads only its shard), or build it for real with ZeroPPStrategy(meta_init=False) (or "
                "init_module(empty_init=False)), every rank then loading the whole model") from e
        raise
    finally:
        for hook in hooks:
            hook.remove()
    state = torch.get_rng_state()  # only after a build that finished: an exception skips this
    for module in built:
        _BUILD_STATE.setdefault(module, state)


def has_meta(module: nn.Module) -> bool:
    """Whether any parameter or buffer of ``module`` (or its children) is on the meta device."""
    return any(t.is_meta for t in (*module.parameters(), *module.buffers()))


def build_rng_state(root: nn.Module) -> torch.Tensor | None:
    """The state kept by the ``meta_build`` that built ``root`` (its first module that has one)."""
    for module in root.modules():
        state = _BUILD_STATE.get(module)
        if state is not None:
            return state
    return None


@contextmanager
def replayed_rng(root: nn.Module) -> Iterator[None]:
    """While ``root`` is initialized: the CPU generator as its build left it. Afterwards the
    generator stays where the draws left it, as after a real build; the modules forget the
    state, so a second materialization draws anew."""
    state = build_rng_state(root)
    if state is not None:
        torch.set_rng_state(state)
        for module in root.modules():
            _BUILD_STATE.pop(module, None)
    yield


def build_context(stage: int, meta_init: bool, empty_init: bool | None, *, rank: int = 0,
                  world_size: int = 1) -> AbstractContextManager:
    """Where a front-end builds the user's model (Lightning's ``configure_model`` and
    ``init_module``, Fabric's ``init_module``): ``meta_build()`` at stages 2/3 unless
    ``empty_init=False`` or ``meta_init`` (``ZeroConfig.meta_init``) is False; at stage 1, which keeps full
    parameters on every rank, a real build, where with ``empty_init=True`` (Lightning's and
    Fabric's ``init_module(empty_init=True)``: values come later) a published model is read
    by rank 0 only (``rank0_values``). ``rank``/``world_size``: the front-end's, known
    before the process group exists (Lightning's ``init_module`` runs before ``fit``)."""
    if stage in (2, 3) and meta_init and empty_init is not False:
        return meta_build()
    if stage == 1 and empty_init is True and world_size > 1:
        return rank0_values(rank)
    return nullcontext()


# [Note: stage-1 load on rank 0]
# At stage 1 every rank holds the whole model, and the front-end gives every rank rank 0's
# values before training: DDP's construction broadcasts rank 0's parameters and buffers,
# and a module with nothing to train gets ``broadcast_module``. A published folder read on
# every rank is therefore read and converted (bf16 files to fp32 parameters, say) N - 1
# times in vain. Inside ``rank0_values`` (the stage-1 build with ``empty_init=True``),
# ``from_pretrained`` of a local safetensors folder on the other ranks builds the model's
# skeleton on the meta device (checked against the folder, so bad input fails there too,
# in eval mode with the folder's generation config, as transformers returns it on rank 0)
# and marks it; ``prepare_stage1`` allocates the marked modules' tensors empty, and the
# broadcast that follows fills them. It is opt-in (``empty_init=True``), not the default of
# ``configure_model``: code that computes with the model inside the build (resizing the
# embeddings for added tokens, a reference model run before training) would fail on the
# other ranks only, where the tensors are meta; ``real_values()`` switches it off for such
# code.
# A hub name or a folder of ``.bin`` files is read by every rank, as before.
_RANK0_VALUES: ContextVar[int | None] = ContextVar("zeropp_rank0_values", default=None)  # this rank, when on
RANK0_VALUES_ATTR = "_zeropp_values_from_rank0"


@contextmanager
def rank0_values(rank: int | None) -> Iterator[None]:
    """While active (``rank`` not None: this process's global rank), ``from_pretrained``
    reads the folder on rank 0 only ([Note: stage-1 load on rank 0])."""
    token = _RANK0_VALUES.set(rank)
    try:
        yield
    finally:
        _RANK0_VALUES.reset(token)


def real_values() -> AbstractContextManager:
    """Every rank reads its own values, also inside a stage-1 build."""
    return rank0_values(None)


def values_come_from_rank0() -> bool:
    """True on a rank other than 0 inside ``rank0_values``."""
    rank = _RANK0_VALUES.get()
    return rank is not None and rank != 0

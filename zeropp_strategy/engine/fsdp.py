"""Layer: engine. Stages 2 and 3 on PyTorch FSDP2: one ``fully_shard`` per block, then the root.

Applied in this fixed order (torchtitan's rule: each step assumes the previous ones):
1. choose blocks (``engine.wrap``);
2. activation checkpointing on the blocks, if asked (must precede ``fully_shard``);
3. frozen weights to int8/int4 storage, if asked (``quantize_frozen_weights``: FSDP2 must
   shard the quantized form, see [Note: frozen weight storage] in engine/frozen.py);
4. ``fully_shard`` each block, bottom-up, then the root;
5. install our comm objects on every FSDP group, so that the CommLedger sees every
   byte and ZeRO++ can replace the collectives;
6. prefetch: asynchronous gathers, each block's forward gathering the next block
   ([Note: prefetch]);
7. materialize meta-device parameters, now that they are sharded (each rank allocates
   and initializes only its shard: engine/materialize.py).

``reshard_after_forward``: stage 2 keeps gathered parameters from forward to backward
(False: one gather per step); stage 3 frees them after each block's forward and gathers
again in backward (True), or to an intra-node secondary shard (an int, hpZ).
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor
from torch.distributed.utils import _apply_to_tensors
from torch.utils._pytree import tree_leaves
from torch.distributed.fsdp import CPUOffloadPolicy, FSDPModule, MixedPrecisionPolicy, OffloadPolicy, fully_shard

from zeropp_strategy.comm.collectives import LedgerAllGather, LedgerReduceScatter
from zeropp_strategy.comm.comm_thread import BackwardDeferral
from zeropp_strategy.comm.hierarchical import NodeGroups
from zeropp_strategy.comm.ledger import CommLedger
from zeropp_strategy.config import OffloadConfig
from zeropp_strategy.cost import ModelShape, leaf_counts
from zeropp_strategy.engine.frozen import int8_weights, quantize_frozen
from zeropp_strategy.engine.fsdp_groups import fsdp_modules
from zeropp_strategy.engine.materialize import materialize
from zeropp_strategy.engine.wrap import (apply_activation_checkpointing, frozen_leaves, gathered_in_backward,
                                        select_blocks)
from zeropp_strategy.fsdp_private import set_unshard_async
from zeropp_strategy.plan import Plan

log = logging.getLogger(__name__)


class ShardedRoot(nn.Module):
    """The module FSDP2 treats as root: a thin owner of the LightningModule.

    [Note: why a separate root]
    The strategy must run ``training_step`` through the FSDP root's ``__call__`` so the
    root hooks fire (lazy init, backward finalization). If the LightningModule itself
    were the root, the usual ``self(x)`` inside ``training_step`` would call the root
    again, nested; FSDP2's inner post-forward sets the group IDLE and the outer one then
    reshards the root even with ``reshard_after_forward=False``, so every step
    re-gathered the root's parameters (embeddings, head) in backward. With this owner as
    the root, ``self(x)`` is a plain call and the root group is gathered once per step.
    """

    def __init__(self, module: nn.Module) -> None:
        super().__init__()
        self.module = module
        self._inner_forward: Callable | None = None  # set by routed_forward()

    def forward(self, *args, **kwargs):  # noqa: ANN002, ANN003, ANN201
        if self._inner_forward is not None:
            return self._inner_forward(*args, **kwargs)
        return self.module(*args, **kwargs)

    @contextmanager
    def routed_forward(self) -> Iterator[None]:
        """While active, ``module(x)`` runs as ``self(x)``: FSDP2's root hooks wrap each
        call of the LightningModule's own forward.

        For manual optimization: there ``training_step`` itself calls ``manual_backward``
        and steps the optimizers, so it cannot run inside the root's forward (FSDP2
        registers its backward hooks on the root's outputs when that forward returns).
        """
        module = self.module
        had_attr = "forward" in module.__dict__
        previous = module.__dict__.get("forward")
        self._inner_forward = module.forward
        # object.__setattr__: nn.Module.__setattr__ would register the root as a
        # submodule named "forward" (a cycle) and leave the class method in charge.
        object.__setattr__(module, "forward", self)  # module(x) -> self(x) -> FSDP root
        try:
            yield
        finally:
            if had_attr:
                module.__dict__["forward"] = previous
            else:
                del module.__dict__["forward"]
            self._inner_forward = None


def without_views(output: Any) -> Any:
    """``output`` with every grad-requiring tensor that is a view replaced by a copy.

    [Note: root outputs are not views]
    FSDP2 registers its pre-backward hook (``register_hook``) on each grad-requiring
    output of an FSDP module's forward. On a view that hook hangs on the view's own
    autograd node, which an in-place op on the view (``values *= mask``) takes out of the
    graph: the hook never fires, and when no other hooked output of the same forward
    reaches the loss, FSDP2 never queues its end-of-backward callback, so the root's
    gradients are never reduce-scattered and the optimizer steps on stale or missing
    gradients (tests/test_rlhf_ppo.py measures it against DDP). The root's forward is
    whatever the LightningModule returns (``ScalarHeadModel`` values, a slice of logits),
    so the root copies views: the copy's node stays in the graph under in-place ops.
    Only views are copied (their size, not their base's); an output without views is
    returned as it is (the same object). ``shard_module`` applies it to the output of every
    module it shards, the root first among them: the ``ShardedRoot`` of the Lightning
    strategy, but also a Fabric or Accelerate user's own model, which is the root there
    and may return a view (``logits[:, -1]``, a ``squeeze``)."""
    if not torch.is_grad_enabled():
        return output

    def is_view(t: Any) -> bool:
        return isinstance(t, torch.Tensor) and t.requires_grad and t._base is not None

    if isinstance(output, torch.Tensor):
        return output.clone() if is_view(output) else output
    if not any(is_view(t) for t in tree_leaves(output)):
        return output
    return _apply_to_tensors(lambda t: t.clone() if is_view(t) else t, output)


def _copy_views(module: nn.Module, args: Any, output: Any) -> Any:
    """Forward hook: ``without_views`` of the output ([Note: root outputs are not views])."""
    return without_views(output)


def model_shape(root: nn.Module, *, wrap_modules: tuple[str, ...], wrap_min_params: int) -> ModelShape:
    """What the plan's cost needs of a prepared module ([Note: the estimate] in cost.py): global
    element counts (a sharded parameter counts whole), the parameters outside the blocks and
    the largest block. The blocks are the FSDP groups below ``root`` at stages 2/3 (each
    parameter in its innermost group), the ones ``select_blocks`` would choose at stage 1."""
    params = {id(p): p for p in root.parameters()}
    groups = fsdp_modules(root)
    if groups:
        owner: dict[int, int] = {}
        for index, group in enumerate(groups):  # pre-order: a nested group comes after its parent
            for p in group.parameters():  # type: ignore[attr-defined]
                owner[id(p)] = index
        sizes = [0] * len(groups)
        for key, index in owner.items():
            sizes[index] += params[key].numel() if key in params else 0
        # The root's own group is not a block; a frozen leaf's group ([Note: frozen leaves] in
        # wrap.py) counts in the root's parameters and is priced as a leaf.
        blocks = [size for group, size in zip(groups, sizes)
                  if group is not root and not getattr(group, "zeropp_frozen_leaf", False)]
        leaves = [(size, gathered_in_backward(group)) for group, size in zip(groups, sizes)
                  if getattr(group, "zeropp_frozen_leaf", False)]
    else:  # stage 1: the blocks activation checkpointing would choose
        try:
            chosen = select_blocks(root, wrap_modules=wrap_modules, wrap_min_params=wrap_min_params)
        except ValueError:  # wrap_modules naming classes this model lacks: stage 1 runs without blocks
            chosen = select_blocks(root, wrap_modules=(), wrap_min_params=wrap_min_params)
        blocks = [sum(p.numel() for p in b.parameters()) for b in chosen]
        leaves = []
    total = sum(p.numel() for p in params.values())
    user = root.module if isinstance(root, ShardedRoot) else root
    config = getattr(user, "config", None)
    cls = next(c for c in type(user).__mro__ if not issubclass(c, FSDPModule))  # FSDP2's FSDP<Name>: <Name>
    return ModelShape(name=cls.__name__, params=total,
                      trainable=sum(p.numel() for p in params.values() if p.requires_grad),
                      root_params=total - sum(blocks), largest_block=max(blocks, default=0), blocks=len(blocks),
                      hidden=int(getattr(config, "hidden_size", 0) or 0),
                      layers=int(getattr(config, "num_hidden_layers", 0) or len(blocks)),
                      vocab=int(getattr(config, "vocab_size", 0) or 0), **leaf_counts(leaves))


def reshard_when_training_resumes(root: nn.Module) -> None:
    """``root.train()`` after evaluation frees what only a backward would have freed.

    [Note: the root after evaluation]
    FSDP2 keeps the root (and, at stage 2, every block) gathered after a forward, for the
    backward that follows. After a forward-only evaluation no backward comes, so the whole
    root stays gathered on every rank until the next training step: the Lightning
    strategy reshards at the end of its evaluation loops (lightning/evaluation.py), but a Fabric or
    Accelerate user's own loop has no such end. Their loops end the way PyTorch's idiom
    does, with ``model.train()``: ``train(True)`` reshards every group (a no-op for one
    already sharded, and for FSDP2's backward, which gathers again what it needs). Nothing changes inside the loop, so an
    evaluation still gathers the root once, not once per batch."""
    switch = root.train

    def train(mode: bool = True) -> nn.Module:
        out = switch(mode)
        # Not only on a change of mode: a wrapper's own train() (Fabric's module) may have
        # set the root's flag already before it reaches the root.
        if mode:
            for group in fsdp_modules(root):
                group.reshard()
        return out

    root.train = train  # type: ignore[method-assign]


def shard_module(
    root: nn.Module,
    plan: Plan,
    *,
    mesh: DeviceMesh,
    ledger: CommLedger,
    mp_policy: MixedPrecisionPolicy,
    device: torch.device,
    reshard_after_forward: bool | int | None = None,
    all_gather: Callable[[], object] | None = None,
    reduce_scatter: Callable[[], object] | None = None,
    nodes: NodeGroups | None = None,
    wire_dtype: torch.dtype | None = None,
    deferral: BackwardDeferral | None = None,
) -> list[nn.Module]:
    """Shard ``root`` in place for stage 2/3, as ``plan`` decided; returns the blocks that
    became groups."""
    if plan.stage not in (2, 3):
        raise ValueError(f"shard_module is for stages 2/3, got ZeroConfig.stage={plan.stage}")
    if reshard_after_forward is None:
        reshard_after_forward = plan.stage == 3
    blocks = select_blocks(root, wrap_modules=plan.wrap_modules, wrap_min_params=plan.wrap_min_params)
    if plan.activation_checkpointing:
        if not blocks:
            raise ValueError(
                "ZeroConfig.activation_checkpointing=True but no block was found to checkpoint. "
                "Fix: name the block classes in ZeroConfig.wrap_modules."
            )
        apply_activation_checkpointing(blocks)
    # FSDP2 cannot shard 0-dim parameters; they stay replicated and the strategy
    # all-reduces their gradients (see replicated_params).
    ignored = set(replicated_params(root))
    if plan.frozen_weight_bits:
        bits = plan.frozen_weight_bits
        quantized, dense = quantize_frozen(
            root, shard_world_size=mesh.size(), block_elems=plan.weight_block_elems,
            min_elems=plan.quantize_min_elems, bits=bits,
        )
        log.info("zeropp: %d frozen weights stored as int%d shards", len(quantized), bits)
        if dense:
            log.info("zeropp: frozen weights kept dense (FSDP2 cannot pad int%d shards): %s", bits, "; ".join(dense))
    offload = offload_policy(plan.offload_param_settings)
    # Stage 3 only: stage 2 keeps every group gathered until its backward, where a group of
    # its own would save nothing ([Note: frozen leaves] in wrap.py).
    leaves = frozen_leaves(root, blocks, min_params=plan.wrap_min_params) if reshard_after_forward else []
    for leaf in leaves:
        leaf.zeropp_frozen_leaf = True  # for model_shape and kept_comm_states: not a block
    hpz_off: list[str] = []
    for block in (*blocks, *leaves):
        block_raf = reshard_after_forward
        if not isinstance(block_raf, bool) and int8_weights(block.parameters()):
            # FSDP2 keeps no secondary shard of extension tensors: see [Note: frozen weight storage].
            block_raf = True
            hpz_off.append(type(block).__name__)
        fully_shard(block, mesh=mesh, reshard_after_forward=block_raf, mp_policy=mp_policy, ignored_params=ignored,
                    offload_policy=offload)
    for leaf in leaves:
        if not gathered_in_backward(leaf):  # frozen: its backward reads no weight ([Note: frozen leaves])
            leaf.set_unshard_in_backward(False)  # type: ignore[operator]
    if hpz_off:
        log.warning(
            "zeropp: hpZ is off for %d groups holding int8-stored frozen weights (%s): FSDP2 keeps no "
            "secondary shard of them, so their backward gather sends int8 codes across nodes again. "
            "Set quantize_frozen_weights=False to keep hpZ for them.", len(hpz_off), hpz_off[0],
        )
    # The root's parameters (embeddings, head) are needed first in backward anyway;
    # FSDP2's own advice is not to reshard the root after forward.
    fully_shard(root, mesh=mesh, reshard_after_forward=False, mp_policy=mp_policy, ignored_params=ignored,
                offload_policy=offload)
    for group in (*blocks, *leaves, root):  # prepend: before FSDP2's post-forward hook hangs its hooks on the outputs
        group.register_forward_hook(_copy_views, prepend=True)
    reshard_when_training_resumes(root)
    install_comms(root, ledger, all_gather=all_gather, reduce_scatter=reduce_scatter, nodes=nodes,
                  wire_dtype=wire_dtype, deferral=deferral)
    set_prefetch(root, blocks)
    # Offloaded shards are initialized where they rest; buffers go to the device later. On
    # NVMe the engine does it group by group once the swap files exist ([Note: streaming
    # initialization] in engine/materialize.py).
    if plan.offload_param != "nvme":
        materialize(root, torch.device("cpu") if isinstance(offload, CPUOffloadPolicy) else device)
    log.info("zeropp: stage %d sharded %d blocks%s + root over %d ranks", plan.stage, len(blocks),
             f" + {len(leaves)} frozen leaves" if leaves else "", mesh.size())
    return blocks


FORWARD_PREFETCH_BLOCKS = 2
"""Blocks whose forward gathers are in flight ahead of the one computing. 2, measured: on the
simulated cluster at 200 Mbit/s (benchmarks/overlap_timeline.py) a block's forward computes
in about a third of its gather's time, so one block of lead left every forward gather
waiting; a second block of lead costs one more gathered block of memory."""


def set_prefetch(root: nn.Module, blocks: list[nn.Module]) -> None:
    """Gather the next block while this one computes, in forward and in backward.

    [Note: prefetch]
    FSDP2 issues a block's all-gather from its pre-forward hook. On CUDA its own streams
    overlap that gather with the previous block's compute; on the host there are no
    streams, so by default every gather runs inline and nothing overlaps. With
    ``async_op`` unshards (``fsdp_private.set_unshard_async``) the comm object returns
    a pending work ([Note: pending work] in comm/hierarchical.py) that FSDP2 waits on right
    before the block needs its parameters, and gloo moves the bytes on its own threads
    meanwhile. The explicit forward prefetch (block k of a chain of sibling blocks,
    ``sibling_blocks``, prefetches the ``FORWARD_PREFETCH_BLOCKS`` after it; with a single
    chain, the root prefetches its first ones) puts the next gathers in flight before this
    block computes; in backward FSDP2 already prefetches the previous
    block (reverse post-forward order) from each block's pre-backward hook. Up to two
    blocks' parameters beyond the computing one are gathered at a time in forward. The reduce-scatter stays synchronous on
    the host: FSDP2 reads its output right after the call (``foreach_reduce``).
    """
    if not isinstance(root, FSDPModule):
        return
    set_unshard_async(root)  # without it (a torch lacking the private switch) gathers stay inline
    chains = sibling_blocks(root, blocks)
    if len(chains) == 1:  # one model: its first blocks can be gathered while the root's part computes
        root.set_modules_to_forward_prefetch(chains[0][:FORWARD_PREFETCH_BLOCKS])
    for siblings in chains:
        for k, block in enumerate(siblings):
            block.set_modules_to_forward_prefetch(siblings[k + 1 : k + 1 + FORWARD_PREFETCH_BLOCKS])


def sibling_blocks(root: nn.Module, blocks: list[nn.Module]) -> list[list[FSDPModule]]:
    """The sharded blocks grouped by the module that holds them, in registration order.

    Forward prefetch follows these chains only: the layers of one ``ModuleList`` (a
    transformer's ``h`` or ``layers``) run one after the other, while blocks of different
    parents may belong to different models of one job (PPO's actor, critic, reference and
    reward), of which a forward runs one; prefetching across them gathered parameters that
    no forward would use.
    """
    ids = {id(b) for b in blocks if isinstance(b, FSDPModule)}
    chains: dict[int, list[FSDPModule]] = {}
    for parent in root.modules():
        for child in parent.children():
            if id(child) in ids:
                chains.setdefault(id(parent), []).append(child)  # type: ignore[arg-type]
    return [chain for chain in chains.values() if len(chain) > 1]


def offload_policy(settings: OffloadConfig) -> OffloadPolicy:
    """``offload_param="cpu"`` (and ``"nvme"``, see [Note: parameters on NVMe]): FSDP2 keeps sharded parameters (and their grads) in host
    memory and copies each group to the device ahead of its all-gather (FSDP2 issues the
    next group's copy-in and gather while the current group computes). Pinned only when
    CUDA exists: pinning needs a CUDA context."""
    if settings.device == "cpu":
        return CPUOffloadPolicy(pin_memory=settings.pin_memory and torch.cuda.is_available())
    if settings.device == "nvme":  # host shards first; offload.params maps them to NVMe
        return CPUOffloadPolicy(pin_memory=False)  # pinning would copy them out of the mapping
    return OffloadPolicy()


def replicated_params(root: nn.Module) -> list[nn.Parameter]:
    """Trainable parameters FSDP2 leaves replicated (0-dim): their grads need an all-reduce."""
    return [p for p in root.parameters() if p.dim() == 0 and not isinstance(p, DTensor)]


def install_comms(
    root: nn.Module,
    ledger: CommLedger,
    *,
    all_gather: Callable[[], object] | None = None,
    reduce_scatter: Callable[[], object] | None = None,
    nodes: NodeGroups | None = None,
    wire_dtype: torch.dtype | None = None,
    deferral: BackwardDeferral | None = None,
) -> None:
    """Give every FSDP group its own ledger-recording (or ZeRO++) comm objects; the plain
    ones go in two hops across nodes when ``nodes`` is given, reduce gradients in
    ``wire_dtype`` (``ZeroConfig.reduce_dtype``) and finish at the end of backward through
    ``deferral`` where they may. Each reduce-scatter learns its group's sharded parameters,
    which decide whether it may be deferred ([Note: deferred reduce-scatter])."""
    for m in fsdp_modules(root):
        ag = all_gather() if all_gather else LedgerAllGather(ledger, nodes)
        m.set_custom_all_gather(ag)
        rs = reduce_scatter() if reduce_scatter else LedgerReduceScatter(ledger, nodes, wire_dtype=wire_dtype,
                                                                         deferral=deferral)
        nested = {id(p) for sub in m.modules() if sub is not m and isinstance(sub, FSDPModule)
                  for p in sub.parameters()}
        rs.params = [p for p in m.parameters() if id(p) not in nested and isinstance(p, DTensor)]
        m.set_custom_reduce_scatter(rs)
        # Kept where kept_comm_states(user's module) finds them: the root is our wrapper of that module.
        holder = m.module if isinstance(m, ShardedRoot) else m
        holder.__dict__.setdefault(_REDUCE_SCATTERS_ATTR, {})[id(m)] = rs
        holder.__dict__.setdefault(_ALL_GATHERS_ATTR, {})[id(m)] = ag


_REDUCE_SCATTERS_ATTR = "_zeropp_reduce_scatters"
_ALL_GATHERS_ATTR = "_zeropp_all_gathers"


def kept_comm_states(module: nn.Module) -> list[Any]:
    """What the collectives of ``module``'s FSDP groups keep from step to step, in module
    order, the same on every rank and in every run of the same model: per group, qgZ's
    error feedback across nodes, then inside the node, then qwZ's weight deltas, where on
    ([Note: qgZ error feedback], [Note: qwZ weight deltas]). Each has ``name``, ``layout``,
    ``kept`` (a tensor or None), ``count`` and ``part`` / ``sources`` / ``restore`` (what a
    rank saves, whose parts it reads back, how it takes them); checkpoint/comm_state.py saves
    them."""
    found = []
    for m in module.modules():
        if getattr(m, "zeropp_frozen_leaf", False):  # reduces nothing; its gathered codes never change
            continue
        for rs in m.__dict__.get(_REDUCE_SCATTERS_ATTR, {}).values():
            found += [f for f in (getattr(rs, "feedback", None), getattr(rs, "intra_feedback", None)) if f is not None]
        for ag in m.__dict__.get(_ALL_GATHERS_ATTR, {}).values():
            if getattr(ag, "deltas", None) is not None:
                found.append(ag.deltas)
    return found


def error_feedbacks(module: nn.Module) -> list[Any]:
    """The qgZ error-feedback states among ``kept_comm_states(module)``."""
    from zeropp_strategy.comm.feedback import ErrorFeedback

    return [state for state in kept_comm_states(module) if isinstance(state, ErrorFeedback)]

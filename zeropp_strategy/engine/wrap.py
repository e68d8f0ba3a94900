"""Layer: engine. Which submodules become one FSDP2 group each (the "wrap policy").

One group = one all-gather before its forward (and backward, at stage 3) and one
reduce-scatter after its backward. Groups that are too small waste collective latency;
groups that are too big raise the peak of gathered parameters. The policy, in order:

1. ``ZeroConfig.wrap_modules``: class names the user names (e.g. ``["GPT2Block"]``);
2. otherwise the Hugging Face convention: every ``PreTrainedModel`` inside the module
   lists its transformer-block classes in ``_no_split_modules``;
3. otherwise size-based: bottom-up, a module whose not-yet-grouped parameters reach
   ``wrap_min_params`` becomes a group.
The root module is always its own group last (it picks up embeddings, heads, norms).
At stage 3, a Hugging Face model's frozen, untied input and output embeddings (a LoRA
run's ``embed_tokens`` and ``lm_head``) are groups of their own too (``frozen_leaves``).
"""

from __future__ import annotations

from torch import nn


def _class_names(module: nn.Module) -> set[str]:
    return {cls.__name__ for cls in type(module).__mro__}


def hf_block_names(root: nn.Module) -> set[str]:
    """Union of ``_no_split_modules`` over every Hugging Face model inside ``root``."""
    names: set[str] = set()
    for m in root.modules():
        declared = getattr(m, "_no_split_modules", None)
        if declared:
            names.update(declared)
    return names


def select_blocks(root: nn.Module, *, wrap_modules: tuple[str, ...], wrap_min_params: int) -> list[nn.Module]:
    """Submodules of ``root`` (root excluded) to shard as groups, in post-order.

    Post-order matters: FSDP2 groups are assigned bottom-up, a parameter belongs to the
    innermost group that contains it.
    """
    names = set(wrap_modules) or hf_block_names(root)
    if names:
        blocks = [m for m in _post_order(root) if m is not root and _class_names(m) & names]
        if wrap_modules and not blocks:
            candidates = _block_candidates(root)[:8]
            fix = (f"name the model's block class (usually the repeated layer), e.g. one of {candidates}"
                   if candidates else "the model has no composite submodule to group; leave wrap_modules "
                   "empty for size-based groups (wrap_min_params)")
            raise ValueError(f"ZeroConfig.wrap_modules={list(wrap_modules)!r} matched no submodule. Fix: {fix}.")
        # Nested matches (a block inside a block) would make tiny inner groups; keep
        # the outermost match only.
        return [b for b in blocks if not any(b is not o and _contains(o, b) for o in blocks)]
    return _size_based(root, wrap_min_params)


_CONTAINERS = (nn.ModuleList, nn.ModuleDict, nn.Sequential, nn.ParameterList, nn.ParameterDict)


def _block_candidates(root: nn.Module) -> list[str]:
    """Class names worth suggesting for ``wrap_modules``: user-facing composite modules
    with parameters (not leaves such as ``Linear``, not containers, not the root, not
    this package's wrappers or a LightningModule); the Hugging Face block classes first,
    then the most repeated classes."""
    declared = hf_block_names(root)
    counts: dict[str, int] = {}
    for m in root.modules():
        cls = type(m)
        if (m is root or isinstance(m, _CONTAINERS) or cls.__module__.startswith("zeropp_strategy.")
                or "LightningModule" in _class_names(m)
                or next(m.children(), None) is None or next(m.parameters(), None) is None):
            continue
        counts[cls.__name__] = counts.get(cls.__name__, 0) + 1
    return sorted(counts, key=lambda name: (name not in declared, -counts[name], name))


def _contains(outer: nn.Module, inner: nn.Module) -> bool:
    return any(m is inner for m in outer.modules())


def _post_order(module: nn.Module) -> list[nn.Module]:
    out: list[nn.Module] = []
    for child in module.children():
        out.extend(_post_order(child))
    out.append(module)
    return out


def _size_based(root: nn.Module, min_params: int) -> list[nn.Module]:
    grouped: set[int] = set()
    blocks: list[nn.Module] = []
    for m in _post_order(root):
        if m is root:
            continue
        fresh = [p for p in m.parameters() if id(p) not in grouped]
        if sum(p.numel() for p in fresh) >= min_params:
            blocks.append(m)
            grouped.update(id(p) for p in fresh)
    return blocks


def frozen_leaves(root: nn.Module, blocks: list[nn.Module], *, min_params: int) -> list[nn.Module]:
    """The input and output embeddings of the Hugging Face models inside ``root`` that are
    frozen, untied and at least ``min_params`` in number: at stage 3 each becomes an FSDP2
    group of its own.

    [Note: frozen leaves]
    The root group stays gathered from its forward to the end of its backward (FSDP2's
    advice for the root). For full training that is what the embedding and head need
    anyway; with a frozen base (LoRA) they are the largest tensors of the model and
    nothing of theirs is reduced: a Llama-3-8B's fp32 embedding and ``lm_head`` are 2.1 GB
    each, gathered for the whole step on every rank beside the blocks. As groups of their
    own they are gathered around their own forward, and in backward only the head again
    (for the gradient of its input; the embedding's backward needs no weight, so its group
    is told not to gather, ``set_unshard_in_backward(False)``), one at a time.

    Only modules a model calls as modules qualify, since a group of its own is a shard
    again outside its forward: what ``get_input_embeddings()`` / ``get_output_embeddings()``
    return, a plain ``nn.Embedding`` or ``nn.Linear`` (not a peft wrapper, whose DoRA or
    trainable tokens read ``base_layer.weight`` directly), in a model whose config says
    ``tie_word_embeddings=False`` (a tied pair is one parameter in two modules, which FSDP2
    shards inside one group only, and some heads read the embedding's weight directly).
    Other frozen modules (an audio encoder's position table read as ``.weight``) stay in
    the root's group, as do trainable ones, so a full fine-tune's groups do not change."""
    in_blocks = {id(p) for b in blocks for p in b.parameters()}
    owners: dict[int, int] = {}  # a weight tied by hand despite the config has two
    for m in root.modules():
        for _, p in m.named_parameters(recurse=False, remove_duplicate=False):
            owners[id(p)] = owners.get(id(p), 0) + 1
    leaves: list[nn.Module] = []
    for model in root.modules():
        config = getattr(model, "config", None)
        if (not callable(getattr(model, "get_input_embeddings", None)) or config is None
                or getattr(config, "tie_word_embeddings", True) is not False):
            continue
        for get in ("get_input_embeddings", "get_output_embeddings"):
            try:
                leaf = getattr(model, get)()
            except (NotImplementedError, AttributeError):
                continue
            own = list(leaf.parameters()) if type(leaf) in (nn.Embedding, nn.Linear) else []
            if (own and all(not p.requires_grad and id(p) not in in_blocks and owners.get(id(p)) == 1 for p in own)
                    and sum(p.numel() for p in own) >= min_params and all(leaf is not m for m in leaves)):
                leaves.append(leaf)
    return leaves


def gathered_in_backward(leaf: nn.Module) -> bool:
    """Whether a frozen leaf's group ([Note: frozen leaves]) is gathered again in backward:
    a head is (for the gradient of its input), an embedding is not (its backward reads no
    weight)."""
    return not isinstance(leaf, nn.Embedding)


def apply_activation_checkpointing(blocks: list[nn.Module]) -> None:
    """Recompute each block's activations in backward instead of storing them.

    Uses PyTorch's composable ``checkpoint``, which hooks the module in place, so
    parameter names (and therefore checkpoints) are unchanged. Applied before
    ``fully_shard``, as FSDP2 expects.
    """
    from torch.distributed._composable import checkpoint

    for block in blocks:
        checkpoint(block)

"""Layer: engine. Re-pointing an optimizer built before sharding at the sharded parameters.

Fabric and Accelerate let a user build the optimizer before the model is prepared; its
param groups then hold the unsharded parameters, which the sharded model never reads.
``ZeroEngine.adopt_optimizer`` maps them to the sharded ones by name with this function.
"""

from __future__ import annotations

from torch import nn
from torch.optim import Optimizer

__all__ = ["remap_optimizer"]


def remap_optimizer(
    optimizer: Optimizer, before: dict[int, str], after: dict[str, nn.Parameter], *, fix: str
) -> int:
    """Point an optimizer built before sharding at the sharded parameters, by name.

    ``before``: id(original parameter) -> name; ``after``: name -> parameter now.
    Returns how many parameters were re-pointed. State must be empty (it is keyed by
    the old parameters), and every parameter must end up one of ``after``'s: one that
    belongs to no set-up model would be updated where the sharded model never reads
    it (``fix`` says how to avoid that, in the front-end's words).
    """
    moved = 0
    for group in optimizer.param_groups:
        new = []
        for p in group["params"]:
            name = before.get(id(p))
            if name is not None and after.get(name) is not None and after[name] is not p:
                new.append(after[name])
                moved += 1
            else:
                new.append(p)
        group["params"] = new
    if moved and len(optimizer.state):
        raise ValueError(
            "an optimizer with state was created before the model was sharded, so its state belongs to the "
            "unsharded parameters. Fix: prepare the model (and the optimizer) before the first step, or load "
            "the optimizer state after prepare."
        )
    known = {id(p) for p in after.values()}
    stray = [p for g in optimizer.param_groups for p in g["params"] if id(p) not in known]
    if stray:
        raise ValueError(
            f"an optimizer holds {len(stray)} parameters of no model set up for sharding, so it would update "
            f"copies the sharded model never reads. Fix: {fix}"
        )
    return moved

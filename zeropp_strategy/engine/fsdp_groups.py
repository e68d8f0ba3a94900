"""Layer: engine. The FSDP2 groups of a module: ``fsdp_modules`` lists those below a root
(every module ``fully_shard`` made a group, the root's own included), ``is_sharded`` tells one."""

from __future__ import annotations

from torch import nn
from torch.distributed.fsdp import FSDPModule


def is_sharded(module: nn.Module) -> bool:
    return isinstance(module, FSDPModule)


def fsdp_modules(root: nn.Module) -> list[FSDPModule]:
    return [m for m in root.modules() if isinstance(m, FSDPModule)]

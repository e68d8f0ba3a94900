"""Layer: offload. CPU and NVMe offload of optimizer state (ZeRO-Offload / ZeRO-Infinity style).

``OffloadOptimizer`` runs the optimizer step on the host with its state in RAM or in
NVMe swap files; ``swap`` has the swap files, buffers and directory lifecycle. Parameter
offload to CPU is FSDP2's ``CPUOffloadPolicy`` (see ``engine.fsdp``); to NVMe,
``ParamStore`` maps the host shards into swap files (``offload.params``).
"""

from zeropp_strategy.offload.optimizer import OffloadOptimizer
from zeropp_strategy.offload.params import ParamStore

__all__ = ["OffloadOptimizer", "ParamStore"]

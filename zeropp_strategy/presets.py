"""Layer: plan (beside ``config``). The registered strategy names and the ZeroConfig
fields each one sets; standard library only.

The Lightning and Fabric front-ends register these names (``_process``); the mapping is
exported as ``zeropp_strategy.PRESETS`` (``zeropp_strategy.strategy.PRESETS`` was removed on
2026-11-27: docs/changes.md).
"""

from __future__ import annotations

from typing import Any

__all__ = ["PRESETS"]

#: Registry names -> ZeroConfig fields they set. ``zeropp`` is stage 3 plus ZeRO++.
PRESETS: dict[str, dict[str, Any]] = {
    # hpz_partition_size=0: ranks per node, resolved at setup.
    "zeropp": {"stage": 3, "quantized_weights": True, "hpz_partition_size": 0, "quantized_gradients": True},
    # Beyond ZeRO++: the cross-node weight gathers in int4 (blocks of 64) instead of int8.
    "zeropp_4bit": {"stage": 3, "quantized_weights": True, "weight_quant_bits": 4, "weight_quant_block_elems": 64,
                    "hpz_partition_size": 0, "quantized_gradients": True},
    # Beyond ZeRO++: the cross-node weight gathers as 2-bit codes of each shard's change since
    # the last gather, the sender's rounding fed back (docs/zeropp.md, "Weight deltas"), and
    # every cross-node block scale in bf16 ("bf16 block scales").
    "zeropp_delta": {"stage": 3, "quantized_weights": True, "weight_delta_coding": True, "weight_quant_bits": 2,
                     "weight_quant_block_elems": 256, "hpz_partition_size": 0, "quantized_gradients": True,
                     "cross_node_scale_bits": 16},
    # Offload presets: ZeRO++ with the optimizer step on the host (ZeRO-Offload) and
    # parameter shards resting in host memory; the nvme one keeps optimizer state and
    # parameter shards on NVMe (ZeRO-Infinity), under $ZEROPP_NVME_PATH.
    "zeropp_offload": {
        "stage": 3, "quantized_weights": True, "hpz_partition_size": 0, "quantized_gradients": True,
        "offload_optimizer": {"device": "cpu"}, "offload_param": {"device": "cpu"},
    },
    "zeropp_offload_nvme": {
        "stage": 3, "quantized_weights": True, "hpz_partition_size": 0, "quantized_gradients": True,
        "offload_optimizer": {"device": "nvme"}, "offload_param": {"device": "nvme"},
    },
    "zeropp_stage_1": {"stage": 1},
    "zeropp_stage_2": {"stage": 2},
    "zeropp_stage_3": {"stage": 3},
}

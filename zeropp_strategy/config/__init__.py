"""Layer: plan (config). ZeroConfig: the one typed, validated configuration of a ZeRO / ZeRO++ run.

    from zeropp_strategy.config import ZeroConfig
    cfg = ZeroConfig(stage=3, quantized_weights=True, hpz_partition_size=8, quantized_gradients=True)
    cfg = ZeroConfig.from_file("ds_config.json")  # a DeepSpeed JSON, or our own YAML / JSON

Every value is checked once, here, in ``__post_init__``: a bad value then fails on every rank
before the first collective (an error on one rank alone would hang the others). Errors name the
field, the value, why it is wrong and the fix; wrong types raise TypeError, bad values ValueError:

    ZeroConfig.stage=4 is invalid: must be 1, 2 or 3. Fix: use stage=3 for full sharding, ...

Checks that need the job size live in ``validate_for_world``. Stdlib + yaml only: no torch, no
Lightning. Tests: python -m pytest tests/test_config.py -q

Files: ``zero.py`` (``ZeroConfig``: the fields and their checks), ``offload.py``
(``OffloadConfig``, the offload blocks, and ``NVME_PATH_ENV``), ``checks.py`` (the small
validators every field uses), ``deepspeed.py`` (DeepSpeed JSON to ``ZeroConfig``). The
policies per concern and the per-job decisions are in ``zeropp_strategy.plan``.
"""

from zeropp_strategy.config.checks import REDUCE_DTYPE_NAMES, ZeroConfigWarning
from zeropp_strategy.config.offload import NVME_PATH_ENV, OffloadConfig
from zeropp_strategy.config.zero import ZeroConfig

__all__ = ["NVME_PATH_ENV", "REDUCE_DTYPE_NAMES", "OffloadConfig", "ZeroConfig", "ZeroConfigWarning"]

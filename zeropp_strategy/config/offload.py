"""Layer: plan (config). ``OffloadConfig``: where optimizer state or parameter shards live
(device memory, CPU or NVMe), its checks, ``NVME_PATH_ENV``, and the forms a ``ZeroConfig``
offload field accepts (``_offload_from``)."""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Mapping
from dataclasses import dataclass

__all__ = ["NVME_PATH_ENV", "OffloadConfig"]

from zeropp_strategy.config.checks import _at_least, _bool, _check_keys, _invalid


NVME_PATH_ENV = "ZEROPP_NVME_PATH"


@dataclass(frozen=True, kw_only=True)
class OffloadConfig:
    """Where optimizer state (``offload_optimizer``) or parameter shards (``offload_param``) live."""

    device: str = "none"
    """One of "none" (accelerator memory), "cpu" (host memory), "nvme" (swap files in ``nvme_path``)."""
    nvme_path: str | None = None
    """Directory for the swap files; required when ``device == "nvme"`` (default: the
    environment variable ``ZEROPP_NVME_PATH``), unused otherwise."""
    pin_memory: bool = True
    """Page-lock host buffers, so host <-> device copies are asynchronous and faster."""
    buffer_count: int = 4
    """Swap buffers in the pipeline; >= 2, so one is read while another is in use."""
    buffer_bytes: int = 64 * 2**20
    """Bytes per swap buffer (>= 4096)."""

    def __post_init__(self) -> None:
        w, dev, path = "OffloadConfig", self.device, self.nvme_path
        put = lambda name, value: object.__setattr__(self, name, value)  # noqa: E731 (frozen: normalise once)
        if not isinstance(dev, str):
            _invalid(f"{w}.device", dev, f"must be a str, not {type(dev).__name__}", "use 'none', 'cpu' or 'nvme'",
                     TypeError)
        if dev not in ("none", "cpu", "nvme"):
            _invalid(f"{w}.device", dev, "must be 'none', 'cpu' or 'nvme'",
                     "use 'cpu' for host memory, 'nvme' with an nvme_path, or 'none'")
        if path is not None and not isinstance(path, (str, os.PathLike)):
            _invalid(f"{w}.nvme_path", path, f"must be a str path or None, not {type(path).__name__}",
                     "give a directory such as '/local_nvme'", TypeError)
        if dev == "nvme" and not path and os.environ.get(NVME_PATH_ENV):
            path = os.environ[NVME_PATH_ENV]  # the cluster's local NVMe, set once per job
        put("nvme_path", None if path is None else os.fspath(path))
        if dev == "nvme" and not path:
            _invalid(f"{w}.nvme_path", path, "device='nvme' needs a directory for its swap files",
                     f"set nvme_path to a directory on a local NVMe drive, e.g. '/local_nvme', or export "
                     f"{NVME_PATH_ENV}=/local_nvme")
        _bool(f"{w}.pin_memory", self.pin_memory, "use True (faster copies) or False (if pinned memory is scarce)")
        fix = "use buffer_count=4 (at least 2, to overlap swapping with compute)"
        put("buffer_count", _at_least(f"{w}.buffer_count", self.buffer_count, 2, fix))
        put("buffer_bytes", _at_least(f"{w}.buffer_bytes", self.buffer_bytes, 4096, "use 64 * 2**20 (at least 4096)"))


_OFFLOAD_FIELDS = tuple(f.name for f in dataclasses.fields(OffloadConfig))


def _offload_from(value: object, where: str) -> OffloadConfig:
    """An OffloadConfig, a dict of its fields, or a bare device string such as "cpu"."""
    if isinstance(value, OffloadConfig):
        return value
    if isinstance(value, str):
        value = {"device": value}
    if not isinstance(value, Mapping):
        _invalid(where, value, f"must be an OffloadConfig, a dict or a device string, not {type(value).__name__}",
                 "use e.g. 'cpu' or {'device': 'nvme', 'nvme_path': '/local_nvme'}", TypeError)
    _check_keys(value, _OFFLOAD_FIELDS, where)
    try:
        return OffloadConfig(**value)
    except (ValueError, TypeError) as e:  # name the nested field: ZeroConfig.offload_param.device
        raise type(e)(str(e).replace("OffloadConfig", where, 1)) from None

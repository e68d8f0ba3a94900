"""Layer: engine. The DTensor helpers, re-exported from ``zeropp_strategy.primitives``
(their home, below both the engine and offload): ``is_dtensor`` tells a DTensor (a
sharded parameter, gradient or state) from a plain tensor, ``local`` gives the part of
it this rank holds. Engine modules and the layers above import them from here."""

from __future__ import annotations

from zeropp_strategy.primitives import is_dtensor, local

__all__ = ["is_dtensor", "local"]

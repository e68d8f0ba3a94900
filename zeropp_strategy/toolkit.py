"""Layer: front-end (helpers for recipes and callbacks). What a LightningModule or a callback
needs from the layers below, under ``strategy="zeropp"`` or any other strategy: the recipes
(``recipes/``) and callbacks (``callbacks/``) import these names from here and nothing from
the engine, comm, offload, kernels or checkpoint packages (a contract in pyproject.toml).
Each name is defined where it works (the module named beside it) and documented in
docs/architecture.md.

- ``local(t)``, ``is_dtensor(t)`` (``primitives``): the part of a DTensor this rank holds;
  whether a tensor is one.
- ``fsdp_modules(root)`` (``engine.fsdp_groups``): the FSDP2 groups below ``root``, outermost first.
- ``wait_for_parameters(optimizers)`` (``engine.stage1``): finish stage 1's post-step
  gathers before reading parameters directly after a step.
- ``copy_on_materialize(module)`` (``engine.pretrained``): a deep copy that stays equal to
  ``module`` when both are built on the meta device and materialized shard by shard.
- ``all_gather_object(obj)`` (``comm.control``): every rank's object, booked in the ledger.
- ``weights_dtype(value, field)`` (``checkpoint.consolidate``): a weights dtype from a name.
- ``CALLBACK_TENSORS``, ``CALLBACK_TENSORS_ID`` (``checkpoint.sharded``): the keys under which
  a callback's ``state_dict`` hands sharded tensors to the sharded checkpoint, and finds
  them again on load.
"""

from __future__ import annotations

from zeropp_strategy.checkpoint.consolidate import weights_dtype
from zeropp_strategy.checkpoint.sharded import CALLBACK_TENSORS, CALLBACK_TENSORS_ID
from zeropp_strategy.comm.control import all_gather_object
from zeropp_strategy.engine.fsdp_groups import fsdp_modules
from zeropp_strategy.engine.pretrained import copy_on_materialize
from zeropp_strategy.engine.stage1 import wait_for_parameters
from zeropp_strategy.primitives import is_dtensor, local

__all__ = ["CALLBACK_TENSORS", "CALLBACK_TENSORS_ID", "all_gather_object", "copy_on_materialize", "fsdp_modules",
           "is_dtensor", "local", "wait_for_parameters", "weights_dtype"]

"""Layer: front-end (Lightning). ``ZeroPPPrecision``, the Lightning precision plugin of
``ZeroPPStrategy``: the engine's ``PrecisionPolicy`` (what each precision flag means under
ZeRO: the table in zeropp_strategy/engine/precision.py) plus Lightning's hooks (init and
forward contexts, loss scaling around the optimizer step, gradient clipping, scaler state).

The framework-free pieces live in the engine and are imported from there:
``ShardedGradScaler`` ([Note: global inf check]), ``clip_grad_norm`` and its stage variants,
``clip_grad_value``, ``local_grads`` (``zeropp_strategy.engine.precision``).

The hooks are ``PrecisionMixin``, which names no Lightning package; ``ZeroPPPrecision`` is
that mixin on ``lightning.pytorch``'s ``Precision``, and ``_pytorch_lightning.py`` puts it on
the standalone ``pytorch_lightning``'s ([Note: two Lightning packages] there).
"""

from __future__ import annotations

from collections.abc import Callable, Generator, Iterable
from contextlib import contextmanager
from typing import Any

from lightning.pytorch.plugins.precision import Precision
from torch import Tensor
from torch.optim import LBFGS, Optimizer

from zeropp_strategy.engine.precision import PrecisionPolicy, clip_grad_norm, clip_grad_value
from zeropp_strategy.engine.stage1 import ShardedOptimizer

__all__ = ["PrecisionMixin", "ZeroPPPrecision"]


class PrecisionMixin(PrecisionPolicy):
    """Lightning's precision hooks over ``PrecisionPolicy``, for either Lightning package. A
    package's plugin lists this class, then that package's ``Precision``: the policy comes
    first in the MRO, so its ``convert_module`` is the one Lightning calls."""

    @contextmanager
    def tensor_init_context(self) -> Generator[None, None, None]:
        with self._default_dtype():
            yield

    @contextmanager
    def module_init_context(self) -> Generator[None, None, None]:
        with self._default_dtype():
            yield

    @contextmanager
    def forward_context(self) -> Generator[None, None, None]:
        with self._autocast(), self._default_dtype():
            yield

    # -- scaling and clipping ------------------------------------------------------------

    def pre_backward(self, tensor: Tensor, module: Any) -> Tensor:  # type: ignore[override]
        if self.scaler is not None:
            tensor = self.scaler.scale(tensor)
        return super().pre_backward(tensor, module)

    def optimizer_step(  # type: ignore[override]
        self, optimizer: Any, model: Any, closure: Callable[[], Any], **kwargs: Any
    ) -> Any:
        if self.scaler is None:
            return super().optimizer_step(optimizer, model=model, closure=closure, **kwargs)
        if isinstance(optimizer, LBFGS):
            raise TypeError("precision='16-mixed' cannot be used with LBFGS. Fix: use precision='bf16-mixed'.")
        closure_result = closure()
        skip = closure_result is None and getattr(model, "automatic_optimization", True)
        if not skip:
            self.scaler.unscale_(optimizer)
        self._after_closure(model, optimizer)
        if skip:
            return closure_result
        out = self.scaler.step(optimizer, **kwargs)
        self.scaler.update()
        return out

    def clip_gradients(
        self,
        optimizer: Optimizer,
        clip_val: int | float = 0.0,
        gradient_clip_algorithm: str = "norm",  # either flavour's GradClipAlgorithmType: a str enum
    ) -> None:
        if clip_val <= 0:
            return
        if gradient_clip_algorithm == "value":
            clip_grad_value(optimizer, clip_val)
        else:
            clip_grad_norm(optimizer, clip_val, ledger=self.ledger)

    def main_params(self, optimizer: Optimizer) -> Iterable[Tensor]:  # type: ignore[override]
        inner = getattr(optimizer, "_optimizer", optimizer)
        if isinstance(inner, ShardedOptimizer):
            return inner.full_params
        return super().main_params(optimizer)

    def state_dict(self) -> dict[str, Any]:
        return self.scaler.state_dict() if self.scaler is not None else {}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        if self.scaler is not None and state_dict:
            self.scaler.load_state_dict(state_dict)


    @classmethod
    def from_lightning_plugin(cls, plugin: Any, device: str) -> PrecisionMixin:
        """Translate the plugin Lightning's connector chose for a ``precision=`` flag."""
        if isinstance(plugin, cls):
            return plugin
        flag = str(getattr(plugin, "precision", "32-true"))
        if flag in ("32", "32-true"):
            flag = "32-true"
        # Lightning's MixedPrecision knows the accelerator ("cuda"/"cpu"); ours is rebound in
        # setup_environment anyway (see PrecisionPolicy.bind).
        return cls(flag, device=getattr(plugin, "device", device))  # type: ignore[arg-type]


class ZeroPPPrecision(PrecisionMixin, Precision):
    """Lightning precision plugin for ``ZeroPPStrategy`` (any of the flags in the table of
    engine/precision.py): ``PrecisionMixin`` on ``lightning.pytorch``'s ``Precision``."""


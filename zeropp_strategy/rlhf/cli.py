"""``zeropp fit``: LightningCLI over the RLHF modules.

    zeropp fit --config recipes/sft.yaml
    zeropp fit --config recipes/reward.yaml --model.model runs/sft/hf --trainer.max_steps 200

Every ``__init__`` argument of the module (``--model.*``) and of ``Trainer``
(``--trainer.*``) is a field of the recipe and can be overridden on the command line; the
module is chosen by ``model.class_path`` in the recipe (``SFTModule``, ``RewardModule``,
``DPOModule``, ``PPOModule``). Importing ``zeropp_strategy`` first registers ``strategy: zeropp``.
"""

from __future__ import annotations

__all__ = ["fit"]


def fit(argv: list[str]) -> int:
    from lightning.pytorch import LightningModule
    from lightning.pytorch.cli import LightningCLI

    import zeropp_strategy  # noqa: F401 - registers the strategy names
    import zeropp_strategy.rlhf.modules  # noqa: F401 - makes the short class names resolvable
    import zeropp_strategy.rlhf.ppo  # noqa: F401

    LightningCLI(
        LightningModule,
        subclass_mode_model=True,
        args=["fit", *argv],
        save_config_kwargs={"overwrite": True},
        auto_configure_optimizers=False,
    )
    return 0

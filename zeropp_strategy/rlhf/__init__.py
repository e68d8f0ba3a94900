"""Layer: recipes (rlhf). RLHF building blocks (the InstructGPT / DeepSpeed-Chat pipeline, and the GRPO family on
verifiable rewards): formulas in ``ops`` and ``grpo_ops``; records and collators in
``data``; networks in ``models``; sampling in ``generation``; the Hugging Face export in
``export``; reward functions and the embedded task in ``rewards`` and ``task``; the
``zeropp fit`` and ``zeropp pipeline`` commands in ``cli`` and ``pipeline``.

The LightningModules built on them live in ``zeropp_strategy.recipes`` (the repository's
``recipes/`` folder, beside their YAML); their old import paths here (``modules``, ``ppo``,
``grpo``) were removed on 2026-11-27 (docs/changes.md)."""

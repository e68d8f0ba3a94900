"""RLHF building blocks (the InstructGPT / DeepSpeed-Chat pipeline, and the GRPO family on
verifiable rewards): formulas in ``ops`` and ``grpo_ops``."""

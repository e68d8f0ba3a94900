"""RLHF building blocks (the InstructGPT / DeepSpeed-Chat pipeline): formulas in ``ops``."""

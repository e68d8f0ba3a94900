"""Layer: checkpoint. Sharded and full checkpoints (see docs/checkpointing.md)."""

from zeropp_strategy.checkpoint.atomic import META_FILE, find_checkpoints, is_complete, remove_path, safe_load
from zeropp_strategy.checkpoint.integrity import CheckpointError

__all__ = ["META_FILE", "CheckpointError", "find_checkpoints", "is_complete", "remove_path", "safe_load"]

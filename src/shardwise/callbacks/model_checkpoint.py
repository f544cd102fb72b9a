"""`from lightning.pytorch.callbacks.model_checkpoint import ModelCheckpoint` ports by the rename to this path.

ModelCheckpoint lives in checkpoint.py; this module is Lightning's path to it.
"""

from shardwise.callbacks.checkpoint import ModelCheckpoint

__all__ = ["ModelCheckpoint"]

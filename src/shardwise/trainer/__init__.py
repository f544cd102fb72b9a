"""The Trainer: `from shardwise.trainer import Trainer` (also `shardwise.Trainer`).

loop.py is the Trainer and its loop, read top to bottom.
"""

from shardwise.trainer.loop import Trainer

__all__ = ["Trainer"]

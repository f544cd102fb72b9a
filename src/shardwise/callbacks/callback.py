"""`from lightning.pytorch.callbacks.callback import Callback` ports by the rename to this path.

Callback lives in base.py; this module is Lightning's path to it.
"""

from shardwise.callbacks.base import Callback

__all__ = ["Callback"]

# Built-in callbacks. Callbacks are duck-typed: the Trainer calls
# `getattr(cb, hook)(trainer, module, ...)` for every callback that defines the hook,
# so a user callback is any object with some of the hook methods; subclassing
# `Callback` (Lightning's hook names and signatures, all no-ops) is optional.
# trainer/lightning_hooks.py lists every hook, where it is called or why it is refused.
from shardwise.callbacks.base import Callback
from shardwise.callbacks.checkpoint import ModelCheckpoint
from shardwise.callbacks.device_stats import DeviceStatsMonitor
from shardwise.callbacks.early_stopping import EarlyStopping
from shardwise.callbacks.lr_monitor import LearningRateMonitor
from shardwise.callbacks.progress import RichProgressBar
from shardwise.callbacks.throughput import ThroughputMonitor

__all__ = [
    "Callback",
    "DeviceStatsMonitor",
    "EarlyStopping",
    "LearningRateMonitor",
    "ModelCheckpoint",
    "RichProgressBar",
    "ThroughputMonitor",
]

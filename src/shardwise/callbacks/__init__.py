# Built-in callbacks. Callbacks are duck-typed: the Trainer calls
# `getattr(cb, hook)(trainer, module, ...)` for every callback that defines the hook,
# so these classes share no base class and a user callback is any object with some
# of the hook methods (setup, on_train_start, on_train_batch_end, ...; see
# trainer/loop.py for the full list and order).
from shardwise.callbacks.checkpoint import ModelCheckpoint
from shardwise.callbacks.device_stats import DeviceStatsMonitor
from shardwise.callbacks.lr_monitor import LearningRateMonitor
from shardwise.callbacks.progress import RichProgressBar

__all__ = ["DeviceStatsMonitor", "LearningRateMonitor", "ModelCheckpoint", "RichProgressBar"]

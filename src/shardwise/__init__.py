"""shardwise: one TrainModule, one Trainer argument from one device to DDP, FSDP2 and DeepSpeed ZeRO."""
from shardwise._version import __version__
from shardwise.distributed.device import move_to_device
from shardwise.distributed.launch import launch
from shardwise.memory import max_memory_allocated, reset_peak_memory_stats, track_memory
from shardwise.module import DataModule, TrainModule
from shardwise import plan  # the planner package, callable: shardwise.plan(model, ...) (see plan/__init__.py)
from shardwise.precision import PRECISIONS
from shardwise.seed import seed_everything
from shardwise.strategies import (STRATEGY_NAMES, DDPStrategy, FSDPStrategy, SingleDeviceStrategy, Strategy,
                                  build_strategy, wrap)
# Registers the reader of DeepSpeed's checkpoint directories with checkpoint/reader.py, so
# `shardwise convert` / `inspect` read them; the module does not import deepspeed itself.
from shardwise.strategies import deepspeed_checkpoint as _deepspeed_checkpoint  # noqa: F401
from shardwise.trainer import Trainer


def __getattr__(name: str):
    # DeepSpeed is an optional extra: import it only when asked for.
    if name in ("DeepSpeedStrategy", "DeepSpeedPlugin"):  # DeepSpeedPlugin: Lightning 1.x's name
        from shardwise.strategies.deepspeed import DeepSpeedStrategy

        return DeepSpeedStrategy
    raise AttributeError(f"module 'shardwise' has no attribute {name!r}")


__all__ = [
    "Trainer", "TrainModule", "DataModule", "seed_everything", "launch", "wrap", "move_to_device",
    "Strategy", "SingleDeviceStrategy", "DDPStrategy", "FSDPStrategy", "DeepSpeedStrategy", "build_strategy",
    "STRATEGY_NAMES", "PRECISIONS", "max_memory_allocated", "reset_peak_memory_stats", "track_memory", "plan",
    "__version__",
]

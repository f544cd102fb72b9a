"""shardwise: one TrainModule, one Trainer argument from one device to DDP, FSDP2 and DeepSpeed ZeRO."""

import importlib
import sys
from typing import Any

from shardwise import plan  # the planner package, callable: shardwise.plan(model, ...) (see plan/__init__.py)
from shardwise._version import __version__
from shardwise.callbacks import Callback, EarlyStopping, ModelCheckpoint
from shardwise.distributed.device import move_to_device
from shardwise.distributed.launch import launch
from shardwise.memory import max_memory_allocated, reset_peak_memory_stats, track_memory
from shardwise.module import DataModule, TrainModule
from shardwise.precision import PRECISIONS
from shardwise.scaling import check
from shardwise.seed import seed_everything
from shardwise.strategies import (
    STRATEGY_NAMES,
    DDPStrategy,
    DeepSpeedStrategy,
    FSDPStrategy,
    SingleDeviceStrategy,
    Strategy,
    build_strategy,
    wrap,
)
from shardwise.trainer import Trainer
from shardwise.utilities.refusal import build_refused_class

DeepSpeedPlugin = DeepSpeedStrategy  # Lightning 1.x's name
# `import lightning as L` ports as `import shardwise as L`: the same classes under Lightning's names.
LightningModule = TrainModule
LightningDataModule = DataModule
Fabric = build_refused_class(
    "Fabric",
    "shardwise",
    "the Trainer is the one entry point; move the Fabric loop's body into a LightningModule's training_step "
    "and call Trainer(...).fit(module) with the same strategy and devices.",
)
# Lightning 2.x code writes `L.pytorch.callbacks.ModelCheckpoint(...)` in its body, not only in imports:
# after `import shardwise as L`, L.pytorch is this package.
pytorch = sys.modules[__name__]


def cli_lightning_logo() -> None:
    """Lightning's examples print its logo when run as scripts: here, the package's name and version."""
    print(f"shardwise {__version__}")


_LAZY_SUBMODULES = ("demos", "cli", "plugins", "tuner")  # loaded on first use: `L.pytorch.demos.Transformer`


def __getattr__(name: str) -> Any:
    if name in _LAZY_SUBMODULES:
        return importlib.import_module(f"{__name__}.{name}")
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


__all__ = [
    "Trainer",
    "TrainModule",
    "DataModule",
    "LightningModule",
    "LightningDataModule",
    "Callback",
    "EarlyStopping",
    "ModelCheckpoint",
    "seed_everything",
    "cli_lightning_logo",
    "launch",
    "wrap",
    "move_to_device",
    "Strategy",
    "SingleDeviceStrategy",
    "DDPStrategy",
    "FSDPStrategy",
    "DeepSpeedStrategy",
    "build_strategy",
    "STRATEGY_NAMES",
    "PRECISIONS",
    "max_memory_allocated",
    "reset_peak_memory_stats",
    "track_memory",
    "plan",
    "check",
    "__version__",
]

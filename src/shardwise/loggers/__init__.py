# Experiment loggers. The Trainer talks to a logger through three calls made on global
# rank 0: log_hyperparams(dict), log_metrics(dict, step) and
# finalize(status); anything with those methods (plus log_dir, name, version) works,
# so wrapping another tracking service needs no base class. The default is Lightning's:
# TensorBoardLogger when tensorboard is installed, else CSVLogger, which needs nothing
# installed; TensorBoardLogger, WandbLogger and MLflowLogger need
# their extras (tensorboard, wandb, mlflow) but are importable without them (the error,
# naming the pip command, comes when one is constructed). The two trackers share their
# run and resume handling (tracker.py).
from __future__ import annotations

import importlib.util
from typing import Any, Mapping, Protocol, runtime_checkable

from shardwise.loggers.csv import CSVLogger
from shardwise.loggers.mlflow import MLflowLogger
from shardwise.loggers.tensorboard import TensorBoardLogger
from shardwise.loggers.wandb import WandbLogger

__all__ = ["CSVLogger", "Logger", "MLflowLogger", "TensorBoardLogger", "WandbLogger", "build_default_logger"]


@runtime_checkable
class Logger(Protocol):
    """What the Trainer expects of a logger (for type checkers; not a base class)."""

    @property
    def log_dir(self) -> str | None: ...

    def log_hyperparams(self, params: Any) -> None: ...

    def log_metrics(self, metrics: Mapping[str, Any], step: int | None = None) -> None: ...

    def finalize(self, status: str) -> None: ...


def build_default_logger(save_dir: str) -> Any:
    """`Trainer(logger=True)`'s logger, as Lightning picks it: TensorBoard when installed, else CSV."""
    if importlib.util.find_spec("tensorboard") is not None:
        return TensorBoardLogger(save_dir)
    return CSVLogger(save_dir)

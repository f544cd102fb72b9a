# Experiment loggers. The Trainer talks to a logger through three calls made on global
# rank 0: log_hyperparams(dict), log_metrics(dict, step) and
# finalize(status); anything with those methods (plus log_dir, name, version) works,
# so wrapping another tracking service needs no base class. CSVLogger is the default
# because it needs nothing installed; TensorBoardLogger needs the tensorboard extra
# but is importable without it (the error comes when one is constructed).
from __future__ import annotations

from typing import Any, Mapping, Protocol, runtime_checkable

from shardwise.loggers.csv import CSVLogger
from shardwise.loggers.tensorboard import TensorBoardLogger

__all__ = ["CSVLogger", "Logger", "TensorBoardLogger"]


@runtime_checkable
class Logger(Protocol):
    """What the Trainer expects of a logger (for type checkers; not a base class)."""

    @property
    def log_dir(self) -> str | None: ...

    def log_hyperparams(self, params: Any) -> None: ...

    def log_metrics(self, metrics: Mapping[str, Any], step: int | None = None) -> None: ...

    def finalize(self, status: str) -> None: ...

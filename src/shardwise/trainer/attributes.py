"""The Trainer's read-only attributes: views of its state, strategy, metrics and loggers.

Lightning code and callbacks read these names (`trainer.global_step`,
`trainer.is_global_zero`, `trainer.callback_metrics`, `trainer.lightning_module`,
`trainer.fit_loop.total_batch_idx`, ...); each one only looks up what the
Trainer holds, so the loop (loop.py) never updates them: it updates its
TrainState, its strategy and its MetricStore, and these follow.
"""

from __future__ import annotations

import math
import types
from typing import Any, Dict, List, Optional

import torch

from shardwise.callbacks import EarlyStopping, ModelCheckpoint
from shardwise.distributed import env
from shardwise.module import TrainModule, hyperparameters_to_log


class TrainerAttributes:
    """Read-only views; the Trainer sets `state`, `strategy`, `metrics`, `loggers`, `module` and the rest."""

    @property
    def lightning_module(self) -> Optional[TrainModule]:
        """Lightning's name for `module`, kept so Lightning code and callbacks run unchanged."""
        return self.module

    @property
    def global_step(self) -> int:
        return self.state.global_step

    @property
    def fit_loop(self) -> Any:
        """Lightning's `trainer.fit_loop.total_batch_idx` (batches over the whole run), which LR warm-up code reads."""
        per_epoch = self.num_training_batches if math.isfinite(self.num_training_batches) else 0
        return types.SimpleNamespace(total_batch_idx=int(self.state.epoch * per_epoch + self.state.batch_idx))

    @property
    def current_epoch(self) -> int:
        return self.state.epoch

    @property
    def batch_idx(self) -> int:
        return self.state.batch_idx

    @property
    def world_size(self) -> int:
        return self.strategy.world_size

    @property
    def global_rank(self) -> int:
        return self.strategy.global_rank

    @property
    def local_rank(self) -> int:
        return self.strategy.local_rank

    @property
    def node_rank(self) -> int:
        return self.strategy.node_rank

    @property
    def is_global_zero(self) -> bool:
        # Before set-up the strategy has no rank yet and answers True in every process (the demo's header
        # printed once per rank): the process's own answer holds from the start, and agrees once it is set up.
        return self.strategy.is_global_zero and env.is_global_zero()

    @property
    def step_weight(self) -> Optional[torch.Tensor]:
        """The current optimizer step's global weight: `module.loss_weight(batch)` summed over every
        micro-batch of the step on every rank (a tensor on the device), known from the step's first
        micro-batch on; None for a module without loss_weight (see trainer/weighting.py)."""
        return self.weighting.total if self.weighting is not None else None

    @property
    def callback_metrics(self) -> Dict[str, float]:
        return self.metrics.callback_metrics

    @property
    def progress_bar_metrics(self) -> Dict[str, float]:
        return self.metrics.progress_bar_metrics

    @property
    def logged_metrics(self) -> Dict[str, float]:
        return self.metrics.logged_metrics

    @property
    def logger(self) -> Any:
        return self.loggers[0] if self.loggers else None

    @property
    def log_dir(self) -> Optional[str]:
        return getattr(self.logger, "log_dir", None) or self.default_root_dir

    @property
    def optimizers(self) -> List[torch.optim.Optimizer]:
        return self.strategy.optimizers

    @property
    def logged_hyperparameters(self) -> Dict[str, Any]:
        """What the loggers receive as hyperparameters: the module's and the datamodule's, merged (none
        without a logger, so a clash between the two matters only where something would show it)."""
        if not self.loggers or not getattr(self, "enable_autolog_hparams", True):  # Trainer(enable_autolog_hparams=)
            return {}
        return hyperparameters_to_log(self.module, self.datamodule)

    @property
    def num_devices(self) -> int:
        """Devices per node (Lightning's name for the resolved `devices`)."""
        return self.devices

    @property
    def checkpoint_callbacks(self) -> List[Any]:
        """Every ModelCheckpoint, in order."""
        return [c for c in self.callbacks if isinstance(c, ModelCheckpoint)]

    @property
    def checkpoint_callback(self) -> Any:
        """The first checkpoint callback, or None (`trainer.checkpoint_callback.best_model_path`)."""
        found = self.checkpoint_callbacks
        return found[0] if found else None

    @property
    def early_stopping_callbacks(self) -> List[Any]:
        return [c for c in self.callbacks if isinstance(c, EarlyStopping)]

    @property
    def early_stopping_callback(self) -> Any:
        """The first EarlyStopping callback, or None."""
        found = self.early_stopping_callbacks
        return found[0] if found else None

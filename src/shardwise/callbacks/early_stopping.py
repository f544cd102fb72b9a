"""EarlyStopping: stop training when a monitored metric stops improving, with Lightning's arguments.

The check runs after each validation pass, or at the end of each training
epoch when validation runs once per epoch (or never) -- Lightning's rule for
`check_on_train_epoch_end=None`. Each check either improves the best score
(by more than `min_delta`), or counts one more check without improvement;
`patience` of those stop the run. A non-finite value (`check_finite`), a
value past `stopping_threshold` (good enough) or past
`divergence_threshold` (hopeless) stops it at once. The decision is agreed
across ranks (any rank's stop stops every rank, in one all-reduce), so no
rank waits in a collective for a rank that left the loop. Its counters are
saved in checkpoints, so a resumed run keeps its patience.
"""

from __future__ import annotations

import logging
import math
import warnings
from typing import Any, Dict, Optional, Tuple

import torch

from shardwise.callbacks.base import Callback

log = logging.getLogger(__name__)

_MODES = {"min": (lambda a, b: a < b, "<"), "max": (lambda a, b: a > b, ">")}


class EarlyStopping(Callback):
    """Stop when `monitor` has not improved for `patience` checks (see the module docstring)."""

    def __init__(
        self,
        monitor: str,
        min_delta: float = 0.0,
        patience: int = 3,
        verbose: bool = False,
        mode: str = "min",
        strict: bool = True,
        check_finite: bool = True,
        stopping_threshold: Optional[float] = None,
        divergence_threshold: Optional[float] = None,
        check_on_train_epoch_end: Optional[bool] = None,
        log_rank_zero_only: bool = False,
    ) -> None:
        if mode not in _MODES:
            raise ValueError(f"EarlyStopping(mode={mode!r}): use 'min' (lower is better) or 'max'.")
        if not isinstance(patience, int) or patience < 0:
            raise ValueError(f"EarlyStopping(patience={patience!r}): use a whole number of checks, 0 or more.")
        self.monitor = monitor
        self.min_delta = abs(float(min_delta))
        self.patience = patience
        self.verbose = verbose
        self.mode = mode
        self.strict = strict
        self.check_finite = check_finite
        self.stopping_threshold = stopping_threshold
        self.divergence_threshold = divergence_threshold
        self.log_rank_zero_only = log_rank_zero_only
        self._check_on_train_epoch_end = check_on_train_epoch_end
        self.wait_count = 0
        self.stopped_epoch = 0
        self.best_score = math.inf if mode == "min" else -math.inf
        self.stopping_reason_message: Optional[str] = None

    @property
    def state_key(self) -> str:
        return self.generate_state_key(monitor=self.monitor, mode=self.mode)

    def _better(self, a: float, b: float) -> bool:
        return _MODES[self.mode][0](a, b)

    # ---------------------------------------------------------------- hooks
    def setup(self, trainer: Any, module: Any, stage: str) -> None:
        if self._check_on_train_epoch_end is None:
            # Validation once per epoch (or never): check when the epoch ends. More or less often:
            # check after each validation pass instead.
            once_per_epoch = getattr(trainer, "val_check_interval", None) in (None, 1.0)
            self._check_on_train_epoch_end = once_per_epoch and getattr(trainer, "check_val_every_n_epoch", 1) == 1

    def on_train_epoch_end(self, trainer: Any, module: Any) -> None:
        if self._check_on_train_epoch_end and self._fitting(trainer):
            self._check(trainer)

    def on_validation_end(self, trainer: Any, module: Any) -> None:
        if not self._check_on_train_epoch_end and self._fitting(trainer):
            self._check(trainer)

    @staticmethod
    def _fitting(trainer: Any) -> bool:
        """Checks run during fit only: not in validate() / test(), not in the sanity check before training."""
        return getattr(trainer, "stage", "fit") == "fit" and not getattr(trainer, "sanity_checking", False)

    # --------------------------------------------------------------- the check
    def _check(self, trainer: Any) -> None:
        logged = trainer.callback_metrics
        if self.monitor not in logged:
            message = (
                f"EarlyStopping monitors {self.monitor!r}, which is not among the logged metrics "
                f"{sorted(logged)}. Log it with self.log({self.monitor!r}, ...) or monitor one of those."
            )
            if self.strict:
                raise RuntimeError(message + " (strict=False skips checks without it.)")
            if self.verbose:
                warnings.warn(message, RuntimeWarning, stacklevel=2)
            return
        stop, reason = self.evaluate(float(logged[self.monitor]))
        # Every rank stops together: any rank's stop is every rank's (one all-reduce of a flag).
        stop = bool(trainer.strategy.reduce(torch.tensor(float(stop)), "max").item() > 0)
        trainer.should_stop = trainer.should_stop or stop
        if stop:
            self.stopped_epoch = trainer.current_epoch
            self.stopping_reason_message = reason
        if reason and self.verbose:
            rank = getattr(trainer, "global_rank", 0)
            if rank == 0 or not self.log_rank_zero_only:
                prefix = f"[rank {rank}] " if getattr(trainer, "world_size", 1) > 1 else ""
                log.info(prefix + reason)

    def evaluate(self, current: float) -> Tuple[bool, Optional[str]]:
        """One check of the monitored value: (stop, the reason to report or None); updates the counters."""
        sign = _MODES[self.mode][1]
        if self.check_finite and not math.isfinite(current):
            return True, (f"{self.monitor} = {current} is not finite (best was {self.best_score:.4g}): stopping.")
        if self.stopping_threshold is not None and self._better(current, self.stopping_threshold):
            return (
                True,
                f"{self.monitor} = {current:.4g} {sign} stopping_threshold={self.stopping_threshold}: stopping.",
            )
        if self.divergence_threshold is not None and self._better(self.divergence_threshold, current):
            opposite = ">" if sign == "<" else "<"
            return True, (
                f"{self.monitor} = {current:.4g} {opposite} divergence_threshold={self.divergence_threshold}: stopping."
            )
        shifted = current + self.min_delta if self.mode == "min" else current - self.min_delta
        if self._better(shifted, self.best_score):
            previous, self.best_score, self.wait_count = self.best_score, current, 0
            if math.isfinite(previous):
                return False, f"{self.monitor} improved by {abs(previous - current):.4g} to {current:.4g}."
            return False, f"{self.monitor} improved to {current:.4g}."
        self.wait_count += 1
        if self.wait_count >= self.patience:
            return True, (
                f"{self.monitor} did not improve in the last {self.wait_count} checks "
                f"(best {self.best_score:.4g}): stopping."
            )
        return False, None

    # -------------------------------------------------------------- checkpoints
    def state_dict(self) -> Dict[str, Any]:
        return {
            "wait_count": self.wait_count,
            "stopped_epoch": self.stopped_epoch,
            "best_score": float(self.best_score),
            "patience": self.patience,
            "stopping_reason_message": self.stopping_reason_message,
        }

    def load_state_dict(self, state: Dict[str, Any]) -> None:
        self.wait_count = int(state["wait_count"])
        self.stopped_epoch = int(state["stopped_epoch"])
        self.best_score = float(state["best_score"])
        self.patience = int(state["patience"])
        self.stopping_reason_message = state.get("stopping_reason_message")

# What the W&B and MLflow loggers share: one tracker run per job, opened on global rank 0
# only and lazily (constructing a logger touches nothing, so it can be built in every
# worker); hyper-parameters and the resolved parallel plan written once; metrics at the
# Trainer's step numbers; and a resume that continues the same run. The run id travels
# in the checkpoint (state_dict), and the checkpoint's step comes back with it. A tracker
# may already hold points of that run after that step, written by the interrupted job
# before it died: unlike the CSV file they cannot be deleted (MLflow keeps every point,
# W&B's history is append-only), so the resumed run asks the tracker which (metric, step)
# points it holds from the checkpoint's step on and does not log those again. Each step
# then appears once; shardwise resumes to the same numbers, so the kept points are the
# ones the resumed run would have logged.
from __future__ import annotations

import warnings
from typing import Any, Dict, Mapping, Optional, Set

from shardwise.loggers.csv import flatten_dict, hparams_to_dict, plain_value, rank_zero, to_scalar

__all__ = ["TrackerLogger"]

_MISSING = object()


class TrackerLogger:
    """The run handling the tracker loggers share (base of WandbLogger and MLflowLogger).

    A subclass opens or continues the run (`_open(run_id)` returns the id), reports what
    the tracker holds (`_points_since(step)`), writes (`_write_params`, `_write_metrics`)
    and closes it (`_close(status)`). Everything here runs on global rank 0 only.
    """

    def __init__(self, run_id: Optional[str], prefix: str = "") -> None:
        self._asked_run_id = run_id  # the user's run_id/id argument, if any
        self._run_id: Optional[str] = run_id
        self._open_run = False
        self._prefix = prefix
        self._resume_step: Optional[int] = None  # the checkpoint's step, when resumed from one
        self._held: Dict[int, Set[str]] = {}  # points the tracker holds from that step on
        self._params: Dict[str, Any] = {}  # what this run holds as hyper-parameters
        self.last_step = -1

    # ------------------------------------------------------------ to implement
    def _open(self, run_id: Optional[str]) -> str:
        raise NotImplementedError

    def _points_since(self, step: int) -> Dict[int, Set[str]]:
        raise NotImplementedError

    def _write_params(self, params: Dict[str, Any]) -> None:
        raise NotImplementedError

    def _write_metrics(self, metrics: Dict[str, float], step: Optional[int]) -> None:
        raise NotImplementedError

    def _close(self, status: str) -> None:
        raise NotImplementedError

    # ------------------------------------------------------------ the run
    @property
    def run_id(self) -> Optional[str]:
        """The tracker's run id (on rank 0, opening the run if none was chosen yet; a closed run stays closed)."""
        if self._run_id is None:
            self.ensure_open()
        return self._run_id

    # The Trainer hands rank 0's `version` to the other ranks (trainer/setup.setup_loggers),
    # so every rank can read the run id; only rank 0 ever opens the run.
    @property
    def version(self) -> Optional[str]:
        return self.run_id

    @version.setter
    def version(self, value: Optional[str]) -> None:
        if not rank_zero():
            self._run_id = value

    def ensure_open(self) -> bool:
        """Open (or continue) the run if it is not open; True on global rank 0, the only rank that has one."""
        if not rank_zero():
            return False
        if not self._open_run:
            self._run_id = self._open(self._run_id)
            self._open_run = True
            if self._resume_step is not None:
                self._held = self._points_since(self._resume_step)
        return True

    # ------------------------------------------------------------ logging
    def log_hyperparams(self, params: Any) -> None:
        """Write the hyper-parameters this run does not hold yet (nested dicts as "a/b")."""
        flat = {k: plain_value(v) for k, v in flatten_dict(hparams_to_dict(params)).items()}
        new = {k: v for k, v in flat.items() if self._params.get(k, _MISSING) != v}
        if not new or not self.ensure_open():
            return
        self._write_params(new)
        self._params.update(new)

    def log_run_config(self, config: Mapping[str, Any]) -> None:
        """The resolved strategy and parallel plan (trainer/setup.py), as hyper-parameters under "shardwise/"."""
        self.log_hyperparams({"shardwise": dict(config)})

    def log_metrics(self, metrics: Mapping[str, Any], step: Optional[int] = None) -> None:
        if not self.ensure_open():
            return
        held = self._held.get(int(step), ()) if step is not None else ()
        out: Dict[str, float] = {}
        for key, value in flatten_dict(metrics).items():
            value = to_scalar(value)
            if isinstance(value, bool) or not isinstance(value, (int, float)):
                continue  # trackers chart numbers; the Trainer logs only numbers
            name = f"{self._prefix}{key}"
            if name not in held:
                out[name] = float(value)
        if step is not None:
            self.last_step = max(self.last_step, int(step))
        if out:
            self._write_metrics(out, step)

    def finalize(self, status: str = "success") -> None:
        """Close the run ("success" -> finished, anything else -> failed); a later log call reopens it."""
        if self._open_run and rank_zero():
            self._close(status)
            self._open_run = False
            self._resume_step, self._held = None, {}  # reopened by this job: nothing to skip

    # ------------------------------------------------------------ checkpoints
    def state_dict(self) -> Dict[str, Any]:
        # Never opens a run: a restore calls state_dict() before load_state_dict() to match keys.
        return {"run_id": self._run_id, "last_step": self.last_step}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        saved = state.get("run_id")
        if saved and self._asked_run_id and saved != self._asked_run_id:
            raise ValueError(
                f"{type(self).__name__}: the checkpoint continues tracker run {saved!r}, but this logger was "
                f"given run {self._asked_run_id!r}. Leave the run id unset to continue the checkpoint's run, "
                f"or pass {saved!r}."
            )
        if saved and self._open_run and saved != self._run_id and rank_zero():
            self._close("success")  # opened before the restore (validate() first): switch to the saved run
            self._open_run = False
        if saved:
            self._run_id = str(saved)
        self.last_step = int(state.get("last_step", -1))
        # checkpoint/training.py adds the checkpoint's step; older checkpoints only know the last step logged.
        step = state.get("checkpoint_step", self.last_step)
        self._resume_step = int(step) if step is not None and step >= 0 else None
        if self._open_run and rank_zero() and self._resume_step is not None:
            self._held = self._points_since(self._resume_step)

    def __repr__(self) -> str:
        return f"{type(self).__name__}(run_id={self._run_id!r})"  # never opens a run


def warn_changed(logger: str, key: str, old: Any, new: Any, kept: str) -> None:
    warnings.warn(
        f"{logger}: hyper-parameter {key!r} is {new!r} now but the run holds {old!r}; {kept}",
        UserWarning,
        stacklevel=4,
    )

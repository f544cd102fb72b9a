"""ModelCheckpoint: when to save, what to keep, and where `last` points.

Lightning's semantics, on by default: a checkpoint every epoch (or every
`every_n_train_steps` optimizer steps), the `save_top_k` best by `monitor`
(or the newest ones without a monitor), and `last.ckpt` pointing at the
newest. Files go to `dirpath`, by default `<default_root_dir>/checkpoints`.

What differs, and why: `last.ckpt` is a relative symlink to the newest
checkpoint instead of a second copy of it (saving a 70B model twice per
interval is not free), moved only after that checkpoint is committed; and
deleting checkpoints that fell out of the top k happens only after the new
one is committed, so a run killed at any moment leaves a complete,
resumable `last.ckpt` (layout.py explains the atomic writes). All decisions
are taken on rank 0 and broadcast, because a monitored value logged without
sync_dist can differ between ranks. The run owns its resolved directory
while it trains (a lock, see lock.py): it only ever deletes checkpoints it
or the run it resumed wrote inside that directory, and a run that ends for
any reason but a crash (max_steps, max_epochs, a stop request) saves its
final step, as Lightning does. With FSDPStrategy(async_save=True) the
write continues in the background and is committed (then `last` moved,
old ones pruned) at the first step after every rank's write has ended
(one small all-reduce per step while a write is outstanding), at the
latest at the next save or at the end of training.
"""

from __future__ import annotations

import math
import os
import re
import warnings
from typing import Any, Callable, Dict, List, Optional

from shardwise.checkpoint import layout
from shardwise.checkpoint.errors import CheckpointWriteError
from shardwise.checkpoint.integrity import check_writable, write_error
from shardwise.checkpoint.lock import CheckpointDirectoryBusyError, DirectoryLock

_FIELD = re.compile(r"\{([^{}:!]+)([^{}]*)\}")


class ModelCheckpoint:
    """Save checkpoints during fit().

    Args:
        dirpath: directory for checkpoints; default `<default_root_dir>/checkpoints`.
        filename: a format string over "epoch", "step" and logged metrics,
            e.g. "{epoch}-{val_loss:.3f}" (names are inserted: "epoch=3-val_loss=0.412").
            Default "epoch={epoch}-step={step}". ".ckpt" is appended.
        monitor: logged metric that ranks checkpoints for save_top_k; None keeps the newest.
        mode: "min" or "max" for monitor.
        save_top_k: how many to keep (-1: all, 0: none but `last`).
        save_last: keep `last.ckpt` pointing at the newest checkpoint (fit(ckpt_path="last") resumes from it).
        every_n_train_steps: save after every n optimizer steps.
        every_n_epochs: save at the end of every n epochs; default 1 unless every_n_train_steps is set.
    """

    FILE_EXTENSION = layout.SUFFIX

    def __init__(
        self,
        dirpath: Optional[str] = None,
        filename: Optional[str] = None,
        monitor: Optional[str] = None,
        mode: str = "min",
        save_top_k: int = 1,
        save_last: bool = True,
        every_n_train_steps: Optional[int] = None,
        every_n_epochs: Optional[int] = None,
        auto_insert_metric_name: bool = True,
        verbose: bool = False,
    ) -> None:
        if mode not in ("min", "max"):
            raise ValueError(f"ModelCheckpoint(mode={mode!r}): use 'min' or 'max'.")
        if save_top_k < -1:
            raise ValueError(f"ModelCheckpoint(save_top_k={save_top_k}): use -1 (all), 0, or a positive count.")
        for name, value in (("every_n_train_steps", every_n_train_steps), ("every_n_epochs", every_n_epochs)):
            if value is not None and (not isinstance(value, int) or value < 0):
                raise ValueError(f"ModelCheckpoint({name}={value!r}): use a non-negative integer.")
        self.dirpath = os.fspath(dirpath) if dirpath is not None else None
        self.filename = filename
        self.monitor = monitor
        self.mode = mode
        self.save_top_k = save_top_k
        self.save_last = save_last
        self.every_n_train_steps = every_n_train_steps or 0
        self.every_n_epochs = every_n_epochs if every_n_epochs is not None else (0 if every_n_train_steps else 1)
        self.auto_insert_metric_name = auto_insert_metric_name
        self.verbose = verbose
        self.best_k_models: Dict[str, float] = {}
        self.best_model_path = ""
        self.best_model_score: Optional[float] = None
        self.last_model_path = ""
        self._saved: List[str] = []  # kept checkpoints, oldest first (ranking without a monitor)
        self._last_global_step_saved = -1
        self._pending: Optional[Any] = None
        self._after_commit: Optional[Callable[[], None]] = None
        self._warned_missing = False
        self._warned_nonfinite = False
        self._directory: Optional[str] = None  # resolved at setup; the only place this run deletes in
        self._lock: Optional[DirectoryLock] = None

    @property
    def state_key(self) -> str:
        return (
            f"ModelCheckpoint[monitor={self.monitor},mode={self.mode},every_n_train_steps="
            f"{self.every_n_train_steps},every_n_epochs={self.every_n_epochs}]"
        )

    def resolve_dirpath(self, trainer: Any) -> str:
        return os.path.realpath(self.dirpath or os.path.join(trainer.default_root_dir, "checkpoints"))

    # ------------------------------------------------------------------ hooks
    def setup(self, trainer: Any, module: Any, stage: str = "fit") -> None:
        """Before any checkpoint is restored: take the directory, then clear what a killed run left."""
        if stage != "fit" or self._lock is not None:
            return
        self._directory = self.resolve_dirpath(trainer)
        error: Optional[str] = None
        kind = CheckpointDirectoryBusyError
        if trainer.is_global_zero:
            lock = DirectoryLock(self._directory)
            try:
                # A read-only mount, a missing permission or a full disk stops the run
                # now (naming EROFS / EACCES / ENOSPC and the path), not at its first save.
                check_writable(self._directory)
                lock.acquire()
                self._lock = lock
                # Hidden temporaries of a killed run: with the lock held, no live
                # run can own them any more.
                layout.remove_leftovers(self._directory)
            except (CheckpointDirectoryBusyError, OSError) as exc:
                error = str(exc)
                if not isinstance(exc, CheckpointDirectoryBusyError):
                    lock.release()
                    self._lock = None
                    kind = CheckpointWriteError
        error, kind_name = trainer.strategy.broadcast((error, kind.__name__))
        if error is not None:
            raise (CheckpointWriteError if kind_name == "CheckpointWriteError" else CheckpointDirectoryBusyError)(error)

    def teardown(self, trainer: Any, module: Any, stage: str = "fit") -> None:
        if self._lock is not None:
            self._lock.release()
            self._lock = None

    def on_train_batch_end(self, trainer: Any, module: Any, *args: Any) -> None:
        if not getattr(trainer, "is_last_microbatch", True):
            return
        # An async save is committed (`last` moved, old ones pruned) at the first step after every rank's
        # write has ended, so a write that failed stops the run then, not a whole interval later.
        if self._pending is not None and self._pending.is_async and self._pending.written_everywhere():
            self._finish_pending()
        n = self.every_n_train_steps
        if n and trainer.global_step % n == 0:
            self._save(trainer)

    def on_train_epoch_end(self, trainer: Any, module: Any) -> None:
        n = self.every_n_epochs
        if n and (trainer.current_epoch + 1) % n == 0:
            self._save(trainer)

    def on_train_end(self, trainer: Any, module: Any) -> None:
        # The run ended without a crash (max_steps mid-epoch, max_epochs, a stop
        # request): its last step must be resumable, whatever the interval.
        if trainer.global_step > 0 and trainer.global_step != self._last_global_step_saved:
            self._save(trainer)
        self._finish_pending()

    def on_exception(self, trainer: Any, module: Any, exc: BaseException) -> None:
        # Never commit a write that may be incomplete; the previous `last` stays.
        self._pending, self._after_commit = None, None

    # ---------------------------------------------------------------- saving
    def format_checkpoint_name(self, metrics: Dict[str, Any]) -> str:
        template = self.filename or "epoch={epoch}-step={step}"
        if self.filename and self.auto_insert_metric_name:
            template = _FIELD.sub(lambda m: f"{m.group(1)}={{{m.group(1)}{m.group(2)}}}", template)
        values = {}
        for match in _FIELD.finditer(template):
            key = match.group(1)
            if key not in metrics:
                if not self._warned_missing:
                    warnings.warn(
                        f"ModelCheckpoint filename uses {key!r}, which was not logged; using 0.", stacklevel=3
                    )
                    self._warned_missing = True
                metrics = {**metrics, key: 0}
            values[key] = metrics[key]
        # str.format cannot take names with '/' or '.'; substitute positionally.
        keys = list(values)
        positional = _FIELD.sub(lambda m: "{" + str(keys.index(m.group(1))) + m.group(2) + "}", template)
        name = positional.format(*values.values()).replace("/", "_")
        return name + self.FILE_EXTENSION

    def _score(self, trainer: Any) -> Optional[float]:
        if self.monitor is None:
            return None
        value = trainer.callback_metrics.get(self.monitor)
        if value is None:
            return None
        value = float(value)
        if math.isnan(value):  # never better than anything
            value = math.inf if self.mode == "min" else -math.inf
        return value

    def _better(self, a: float, b: float) -> bool:
        return a < b if self.mode == "min" else a > b

    def _decide(self, trainer: Any) -> Optional[Dict[str, Any]]:
        """Rank 0: what to write and what becomes obsolete once it is committed."""
        score = self._score(trainer)
        if self.monitor is not None and score is None:
            if not self._warned_missing:
                warnings.warn(
                    f"ModelCheckpoint(monitor={self.monitor!r}) found no such metric (logged: "
                    f"{sorted(trainer.callback_metrics)}); saving for `last` only.",
                    stacklevel=3,
                )
                self._warned_missing = True
        k = self.save_top_k
        if k == 0 or (self.monitor is not None and score is None):
            in_top = False
        elif k == -1 or self.monitor is None or len(self.best_k_models) < k:
            in_top = True
        else:
            worst = (
                max(self.best_k_models, key=self.best_k_models.get)
                if self.mode == "min"
                else min(self.best_k_models, key=self.best_k_models.get)
            )
            in_top = self._better(score, self.best_k_models[worst])
        if not (in_top or self.save_last):
            return None
        directory = self.resolve_dirpath(trainer)
        metrics = {"epoch": trainer.current_epoch, "step": trainer.global_step, **trainer.callback_metrics}
        name = self.format_checkpoint_name(metrics)
        path = os.path.join(directory, name)
        version = 1
        while os.path.lexists(path):  # never overwrite a checkpoint of another run
            stem = name[: -len(self.FILE_EXTENSION)]
            path = os.path.join(directory, f"{stem}-v{version}{self.FILE_EXTENSION}")
            version += 1
        return {"path": path, "score": score, "in_top": in_top}

    def _save(self, trainer: Any) -> None:
        if trainer.global_step == self._last_global_step_saved:
            return  # this step is saved already (e.g. a step interval ending with the epoch)
        if getattr(trainer, "health", None) is not None:  # a health verdict not yet read: first, so that a
            trainer.health.resolve(trainer)  # non-finite step stops the run (or sets nonfinite_step) unsaved
        bad = getattr(trainer, "nonfinite_step", None)
        if bad is not None and getattr(trainer, "non_finite", "error") == "warn":
            # Trainer(non_finite='warn') took a step with NaN/inf: the weights may be
            # poisoned, and `last` must keep pointing at a state that was sound.
            if not self._warned_nonfinite:
                warnings.warn(
                    f"ModelCheckpoint: not saving step {trainer.global_step} or later: non-finite values "
                    f"were seen at step {bad}. `last` stays at the last sound checkpoint.",
                    stacklevel=3,
                )
                self._warned_nonfinite = True
            return
        self._finish_pending()
        decision = trainer.strategy.broadcast(self._decide(trainer) if trainer.is_global_zero else None)
        self._last_global_step_saved = trainer.global_step
        if decision is None:
            return
        path = decision["path"]
        obsolete = self._update_bookkeeping(path, decision["score"], decision["in_top"])
        # The bookkeeping above is already part of the saved callback state, so
        # a run resumed from this checkpoint knows the checkpoint itself.
        self._pending = trainer.save_checkpoint(path, wait=False)
        is_zero = trainer.is_global_zero

        def after_commit() -> None:
            if not is_zero:
                return
            directory = os.path.dirname(path)
            if self.save_last:
                layout.point_last(directory, path)
            for old in obsolete:
                if self._owns(old):
                    layout.remove_checkpoint(old)
            if self.verbose:
                print(
                    f"[shardwise] saved {path}"
                    + (f" ({self.monitor}={decision['score']:.6g})" if decision["score"] is not None else "")
                )

        self._after_commit = after_commit
        if not self._pending.is_async:
            self._finish_pending()

    def _update_bookkeeping(self, path: str, score: Optional[float], in_top: bool) -> List[str]:
        """Record the new checkpoint; return those to delete after it is committed."""
        obsolete: List[str] = []
        previous_last = self.last_model_path
        kept = set(self._saved)
        if in_top:
            self._saved.append(path)
            kept.add(path)
            if self.monitor is not None:
                self.best_k_models[path] = score
                if self.save_top_k != -1 and len(self.best_k_models) > self.save_top_k:
                    pick = max if self.mode == "min" else min
                    worst = pick(self.best_k_models, key=self.best_k_models.get)
                    del self.best_k_models[worst]
                    kept.discard(worst)
                    self._saved.remove(worst)
                    obsolete.append(worst)
                best = (min if self.mode == "min" else max)(self.best_k_models, key=self.best_k_models.get)
                self.best_model_path, self.best_model_score = best, self.best_k_models[best]
            else:
                self.best_model_path = path
                if self.save_top_k != -1:
                    while len(self._saved) > self.save_top_k:
                        old = self._saved.pop(0)
                        kept.discard(old)
                        obsolete.append(old)
        self.last_model_path = path
        # The previous `last` target may have been kept only for `last`.
        if previous_last and previous_last not in kept and previous_last != path and previous_last not in obsolete:
            obsolete.append(previous_last)
        return obsolete

    def _finish_pending(self) -> None:
        """Commit an outstanding (async) save, then move `last` and prune; collective."""
        pending, after = self._pending, self._after_commit
        self._pending, self._after_commit = None, None
        if pending is None:
            return
        final = pending.commit()
        if after is None:
            return
        # Rank 0 moves `last` and prunes; a failure there (the disk turned read-only) stops every rank.
        problem = None
        try:
            after()
        except OSError as exc:
            error = write_error(exc, final)
            problem = (str(error), error.errno)
        problem = pending.strategy.broadcast(problem)
        if problem is not None:
            raise CheckpointWriteError(
                f"{final} is saved, but moving last.ckpt to it or removing older checkpoints failed on rank 0: "
                f"{problem[0]}",
                problem[1],
                final,
            )

    def _owns(self, path: str) -> bool:
        """Only checkpoints directly inside this run's resolved directory are ever deleted."""
        return (
            self._directory is not None
            and os.path.dirname(os.path.realpath(os.path.abspath(path))) == self._directory
            and os.path.basename(path) != layout.LAST_NAME
        )

    # ------------------------------------------------------------------ state
    def state_dict(self) -> Dict[str, Any]:
        return {
            "dirpath": self.dirpath,
            "directory": self._directory,
            "monitor": self.monitor,
            "mode": self.mode,
            "best_k_models": dict(self.best_k_models),
            "best_model_path": self.best_model_path,
            "best_model_score": self.best_model_score,
            "last_model_path": self.last_model_path,
            "saved": list(self._saved),
            "last_global_step_saved": self._last_global_step_saved,
        }

    def load_state_dict(self, state: Dict[str, Any]) -> None:
        # Compared by the resolved directory: two runs with the default dirpath
        # (None) in different root directories are different places, and
        # adopting the other's ranking would prune the other run's checkpoints.
        same_place = (
            self._directory is not None
            and state.get("directory") == self._directory
            and state.get("monitor") == self.monitor
        )
        self._last_global_step_saved = state.get("last_global_step_saved", -1)
        if not same_place:
            return  # another directory or metric: start a fresh ranking
        exists = os.path.exists
        self.best_k_models = {p: s for p, s in state.get("best_k_models", {}).items() if exists(p) and self._owns(p)}
        self._saved = [p for p in state.get("saved", []) if exists(p) and self._owns(p)]
        self.best_model_path = state.get("best_model_path", "")
        self.best_model_score = state.get("best_model_score")
        self.last_model_path = state.get("last_model_path", "")

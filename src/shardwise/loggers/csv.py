# CSVLogger, the default logger without tensorboard installed: metrics.csv and hparams.yaml under
# <save_dir>/<name>/version_<n>/, readable with any spreadsheet or pandas and with no
# dependency beyond the standard library. Rows are buffered and flushed every
# `flush_every_n_steps` log calls and on save()/finalize(); when a metric appears that
# the file has no column for, the whole file is rewritten with the wider header
# (atomically: write a temporary file, then rename) so every row lines up. Only
# global rank 0 touches the filesystem. This file also holds the small helpers the
# TensorBoard logger shares: version numbering, rank detection, hparams.yaml, and the
# no-op `experiment` other ranks get.
from __future__ import annotations

import csv
import dataclasses
import json
import os
import re
from argparse import Namespace
from typing import Any, Mapping

from shardwise.distributed.env import is_global_zero

__all__ = ["CSVLogger"]

METRICS_FILE = "metrics.csv"
HPARAMS_FILE = "hparams.yaml"


def rank_zero() -> bool:
    """True on global rank 0 (or when not distributed): the only rank that writes logs."""
    return is_global_zero()


def next_version(root: str) -> int:
    """One more than the highest existing version_<n> under root (0 if none)."""
    try:
        names = os.listdir(root)
    except FileNotFoundError:
        return 0
    found = [int(m.group(1)) for n in names if (m := re.fullmatch(r"version_(\d+)", n))]
    return max(found) + 1 if found else 0


def to_scalar(value: Any) -> Any:
    """Tensors and numpy scalars become Python numbers; other values pass through."""
    if hasattr(value, "item") and getattr(value, "ndim", 0) == 0:
        return value.item()
    return value


def add_prefix(metrics: Mapping[str, Any], prefix: str) -> Mapping[str, Any]:
    """Lightning's logger `prefix`: every name becomes `<prefix>-<name>`."""
    return {f"{prefix}-{k}": v for k, v in metrics.items()} if prefix else metrics


def flatten_dict(d: Mapping, prefix: str = "", sep: str = "/") -> dict[str, Any]:
    out: dict[str, Any] = {}
    for key, value in d.items():
        name = f"{prefix}{sep}{key}" if prefix else str(key)
        if isinstance(value, Mapping):
            out.update(flatten_dict(value, name, sep))
        else:
            out[name] = value
    return out


def hparams_to_dict(params: Any) -> dict[str, Any]:
    if params is None:
        return {}
    if isinstance(params, Namespace):
        return dict(vars(params))
    if dataclasses.is_dataclass(params) and not isinstance(params, type):
        return dataclasses.asdict(params)
    return dict(params)


def plain_value(value: Any) -> Any:
    # YAML/JSON-safe copy: containers recurse, numbers stay, everything else is repr'd
    # (a torch.dtype or a class should not make logging crash).
    value = to_scalar(value)
    if isinstance(value, Mapping):
        return {str(k): plain_value(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [plain_value(v) for v in value]
    if value is None or isinstance(value, (bool, int, float, str)):
        return value
    return repr(value)


class NoOpExperiment:
    """`logger.experiment` on ranks other than 0, as Lightning's: every call does nothing and returns None.

    User code written for rank 0 (`self.logger.experiment.add_image(...)`) runs on every rank in a
    multi-process job; a None there would raise on the other ranks.
    """

    def nop(self, *args: Any, **kwargs: Any) -> None:
        return None

    def __getattr__(self, name: str) -> Any:
        if name.startswith("__"):  # copy / pickle probes: answer as a plain object
            raise AttributeError(name)
        return self.nop

    def __getitem__(self, index: Any) -> "NoOpExperiment":
        return self

    def __setitem__(self, index: Any, value: Any) -> None:
        pass


class CSVExperiment:
    """`CSVLogger.experiment` on rank 0, in the shape of Lightning's CSV ExperimentWriter; writes through the logger."""

    def __init__(self, logger: "CSVLogger") -> None:
        self._logger = logger

    @property
    def log_dir(self) -> str:
        return self._logger.log_dir

    @property
    def metrics_file_path(self) -> str:
        return self._logger.metrics_file

    @property
    def hparams(self) -> dict[str, Any]:
        return self._logger._hparams

    @property
    def metrics(self) -> list[dict[str, Any]]:
        """The rows logged but not yet written to metrics.csv (save() writes them)."""
        return self._logger._pending

    def log_metrics(self, metrics_dict: Mapping[str, Any], step: int | None = None) -> None:
        self._logger.log_metrics(metrics_dict, step)

    def log_hparams(self, params: Mapping[str, Any]) -> None:
        self._logger.log_hyperparams(params)

    def save(self) -> None:
        self._logger.save()


def write_hparams(path: str, hparams: Mapping[str, Any]) -> None:
    """Write hparams as YAML (PyYAML if installed, else JSON, which is valid YAML)."""
    data = plain_value(dict(hparams))
    try:
        import yaml

        text = yaml.safe_dump(data, sort_keys=False)
    except ImportError:
        text = json.dumps(data, indent=2) + "\n"
    _atomic_write(path, text)


def _atomic_write(path: str, text: str) -> None:
    tmp = f"{path}.tmp"
    with open(tmp, "w", newline="") as f:
        f.write(text)
    os.replace(tmp, path)


class VersionedLogDir:
    """`<save_dir>/<name>/version_<n>`: the folder layout both loggers share.

    The version is resolved lazily so constructing a logger touches nothing;
    in multi-process runs the Trainer gives every rank rank 0's choice.
    """

    _save_dir: str
    _name: str
    _chosen_version: int | str | None

    @property
    def name(self) -> str:
        return self._name

    @property
    def save_dir(self) -> str:
        return self._save_dir

    @property
    def root_dir(self) -> str:
        return os.path.join(self._save_dir, self._name)

    @property
    def version(self) -> int | str:
        # Resolved lazily so constructing a logger touches nothing. In multi-process
        # runs the Trainer sets rank 0's version on the other ranks (the setter below).
        if self._chosen_version is None:
            self._chosen_version = next_version(self.root_dir)
        return self._chosen_version

    @version.setter
    def version(self, value: int | str) -> None:
        self._chosen_version = value

    @property
    def log_dir(self) -> str:
        version = self.version
        return os.path.join(self.root_dir, version if isinstance(version, str) else f"version_{version}")

    # A checkpoint records the version and the last step logged before it; the
    # run resumed from it writes into the same version and drops what the
    # interrupted run logged after the checkpoint, which is about to be replayed.
    # A logger built on this class calls note_step(step) from its log_metrics.
    last_step: int = -1

    def state_dict(self) -> dict[str, Any]:
        self.save()  # what the checkpoint covers is on disk before it is committed
        return {"version": self.version, "last_step": self.last_step}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        self._chosen_version = state.get("version", self._chosen_version)
        # A save inside step k comes before step k's values are logged (ModelCheckpoint runs in
        # on_train_batch_end), and the resumed run starts after step k: keep what the interrupted
        # run logged up to the checkpoint's step (checkpoint/training.py adds it), not only up to
        # the last step logged before the save.
        self.last_step = max(int(state.get("last_step", -1)), int(state.get("checkpoint_step", -1)))
        if rank_zero():
            self._forget_after(self.last_step)

    def _forget_after(self, step: int) -> None:
        """Drop records of steps after `step` (the interrupted run's, replayed from here)."""

    def note_step(self, step: int | None) -> None:
        if step is not None:
            self.last_step = max(self.last_step, int(step))


class CSVLogger(VersionedLogDir):
    """Log metrics to ``<save_dir>/<name>/version_<n>/metrics.csv``.

    ``version=None`` picks the next free number; a string version is used as the
    directory name as is. ``prefix`` is put before every metric name (``prefix-name``),
    and rows are written every ``flush_logs_every_n_steps`` log calls (Lightning's
    arguments; ``flush_every_n_steps`` is the same). Call pattern (from the Trainer):
    log_hyperparams(dict), log_metrics(dict, step), save(), finalize(status).
    """

    def __init__(
        self,
        save_dir: str,
        name: str = "shardwise_logs",
        version: int | str | None = None,
        prefix: str = "",
        flush_logs_every_n_steps: int = 100,
        flush_every_n_steps: int | None = None,
    ):
        self._save_dir = os.fspath(save_dir)
        self._name = name or ""
        self._chosen_version = version
        self._prefix = prefix
        self._flush_every = max(1, flush_logs_every_n_steps if flush_every_n_steps is None else flush_every_n_steps)
        self._columns: list[str] = []  # the header currently on disk
        self._pending: list[dict[str, Any]] = []
        self._hparams: dict[str, Any] = {}

    @property
    def metrics_file(self) -> str:
        return os.path.join(self.log_dir, METRICS_FILE)

    @property
    def experiment(self) -> CSVExperiment | NoOpExperiment:
        """Lightning's CSV experiment writer (log_metrics, log_hparams, save) on rank 0; a no-op elsewhere."""
        return CSVExperiment(self) if rank_zero() else NoOpExperiment()

    def log_hyperparams(self, params: Any) -> None:
        self._hparams.update(hparams_to_dict(params))
        if rank_zero():
            os.makedirs(self.log_dir, exist_ok=True)
            write_hparams(os.path.join(self.log_dir, HPARAMS_FILE), self._hparams)

    def log_metrics(self, metrics: Mapping[str, Any], step: int | None = None) -> None:
        if not rank_zero():
            return
        row = {k: to_scalar(v) for k, v in flatten_dict(add_prefix(metrics, self._prefix)).items()}
        if step is not None:
            row["step"] = int(step)
        self.note_step(step)
        self._pending.append(row)
        if len(self._pending) >= self._flush_every:
            self.save()

    def save(self) -> None:
        if not self._pending or not rank_zero():
            return
        os.makedirs(self.log_dir, exist_ok=True)
        path = self.metrics_file
        if not self._columns and os.path.exists(path):
            self._columns = self._read(path)[0]  # appending to an existing run's file
        new_keys = [k for row in self._pending for k in row if k not in self._columns]
        if new_keys or not os.path.exists(path):
            # New columns: rewrite everything under the wider header. "step" leads;
            # other columns keep the order they first appeared in.
            old_rows = self._read(path)[1]
            columns = list(self._columns)
            for key in new_keys:
                if key not in columns:
                    columns.append(key)
            columns.sort(key=lambda c: c != "step")
            tmp = f"{path}.tmp"
            with open(tmp, "w", newline="") as f:
                writer = csv.DictWriter(f, fieldnames=columns, restval="")
                writer.writeheader()
                writer.writerows(old_rows + self._pending)
            os.replace(tmp, path)
            self._columns = columns
        else:
            with open(path, "a", newline="") as f:
                csv.DictWriter(f, fieldnames=self._columns, restval="").writerows(self._pending)
        self._pending = []

    @staticmethod
    def _read(path: str) -> tuple[list[str], list[dict[str, Any]]]:
        if not os.path.exists(path):
            return [], []
        with open(path, newline="") as f:
            reader = csv.DictReader(f)
            rows = list(reader)
            return list(reader.fieldnames or []), rows

    def finalize(self, status: str = "success") -> None:
        self.save()

    def _forget_after(self, step: int) -> None:
        path = self.metrics_file
        self._pending = []
        columns, rows = self._read(path)
        kept = [r for r in rows if not r.get("step") or int(float(r["step"])) <= step]
        if len(kept) == len(rows):
            self._columns = columns
            return
        tmp = f"{path}.tmp"
        with open(tmp, "w", newline="") as f:
            writer = csv.DictWriter(f, fieldnames=columns, restval="")
            writer.writeheader()
            writer.writerows(kept)
        os.replace(tmp, path)
        self._columns = columns

    def __repr__(self) -> str:
        return f"CSVLogger(log_dir={self.log_dir!r})"

# TensorBoardLogger: scalars to a TensorBoard event file under
# <save_dir>/<name>/version_<n>/ via torch.utils.tensorboard.SummaryWriter, plus the
# same hparams.yaml the CSV logger writes. tensorboard is an optional extra, so it is
# imported only when the writer is first needed and a missing install names the pip
# command. Only global rank 0 creates a writer; other ranks make every call a no-op. It is
# the default logger when tensorboard is installed, as in Lightning.
from __future__ import annotations

import os
from typing import Any, Mapping

from shardwise.loggers.csv import (
    HPARAMS_FILE,
    NoOpExperiment,
    VersionedLogDir,
    add_prefix,
    flatten_dict,
    hparams_to_dict,
    rank_zero,
    to_scalar,
    write_hparams,
)

__all__ = ["TensorBoardLogger"]


def _summary_writer_class():
    try:
        from torch.utils.tensorboard import SummaryWriter
    except ImportError as err:  # torch raises ImportError when tensorboard is missing
        raise ImportError(
            'TensorBoardLogger needs the tensorboard package: pip install "shardwise[tensorboard]" '
            "(or pip install tensorboard). CSVLogger, the default without it, has no extra dependency."
        ) from err
    return SummaryWriter


class TensorBoardLogger(VersionedLogDir):
    """Log scalars to TensorBoard: ``tensorboard --logdir <save_dir>/<name>``.

    Lightning's arguments: ``prefix`` is put before every metric name (``prefix-name``); ``sub_dir``
    groups the run's files in ``<save_dir>/<name>/version_<n>/<sub_dir>``; ``default_hp_metric`` is
    accepted and changes nothing, since the hyper-parameters go to a text table and hparams.yaml rather
    than TensorBoard's HPARAMS tab and its placeholder metric; ``log_graph=True`` is refused (write the
    graph with ``logger.experiment.add_graph(model, example_input)``). Other keywords go to the
    SummaryWriter.
    """

    def __init__(
        self,
        save_dir: str,
        name: str = "shardwise_logs",
        version: int | str | None = None,
        log_graph: bool = False,
        default_hp_metric: bool = True,
        prefix: str = "",
        sub_dir: str | None = None,
        **writer_kwargs: Any,
    ):
        if log_graph:
            raise ValueError(
                "TensorBoardLogger(log_graph=True) is not supported: the Trainer does not trace the model with "
                "an example input. Write the graph yourself, e.g. in on_fit_start: "
                "self.logger.experiment.add_graph(model, example_input)."
            )
        del default_hp_metric  # no HPARAMS tab, so no placeholder metric for it (class docstring)
        self._save_dir = os.fspath(save_dir)
        self._name = name or ""
        self._chosen_version = version
        self._prefix = prefix
        self._sub_dir = None if sub_dir is None else os.fspath(sub_dir)
        self._writer_kwargs = writer_kwargs
        self._writer = None
        self._hparams: dict[str, Any] = {}
        if rank_zero():
            _summary_writer_class()  # fail at construction, not at the first logged step

    @property
    def sub_dir(self) -> str | None:
        return self._sub_dir

    @property
    def log_dir(self) -> str:
        log_dir = super().log_dir
        return os.path.join(log_dir, self._sub_dir) if self._sub_dir else log_dir

    @property
    def experiment(self) -> Any:
        """The SummaryWriter on rank 0, for images, histograms, ...; elsewhere an object whose every call does
        nothing (Lightning's rank-zero experiment), so code written for rank 0 runs on all ranks."""
        writer = self._open_writer()
        return writer if writer is not None else NoOpExperiment()

    def _open_writer(self) -> Any:
        """The SummaryWriter, opened on first use; None on ranks other than 0."""
        if self._writer is None and rank_zero():
            os.makedirs(self.log_dir, exist_ok=True)
            kwargs = dict(self._writer_kwargs)
            if self.last_step >= 0:  # resumed: hide the interrupted run's events after the checkpoint
                kwargs.setdefault("purge_step", self.last_step + 1)
            self._writer = _summary_writer_class()(log_dir=self.log_dir, **kwargs)
        return self._writer

    def log_hyperparams(self, params: Any) -> None:
        self._hparams.update(hparams_to_dict(params))
        writer = self._open_writer()
        if writer is None:
            return
        write_hparams(os.path.join(self.log_dir, HPARAMS_FILE), self._hparams)
        # A markdown table under the TEXT tab; add_hparams() would start a separate run.
        rows = "\n".join(f"| {k} | {v} |" for k, v in flatten_dict(self._hparams).items())
        writer.add_text("hparams", "| name | value |\n|---|---|\n" + rows)

    def log_metrics(self, metrics: Mapping[str, Any], step: int | None = None) -> None:
        writer = self._open_writer()
        if writer is None:
            return
        self.note_step(step)
        for key, value in flatten_dict(add_prefix(metrics, self._prefix)).items():
            value = to_scalar(value)
            if isinstance(value, (int, float)) and not isinstance(value, bool):
                writer.add_scalar(key, value, global_step=step)

    def save(self) -> None:
        if self._writer is not None:
            self._writer.flush()

    def finalize(self, status: str = "success") -> None:
        if self._writer is not None:
            self._writer.flush()
            self._writer.close()
            self._writer = None

    def __repr__(self) -> str:
        return f"TensorBoardLogger(log_dir={self.log_dir!r})"

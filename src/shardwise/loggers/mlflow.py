# MLflowLogger: one MLflow run per job, written from global rank 0 through an MlflowClient
# (no fluent API: a library should not change the process's active run). mlflow-skinny is
# an optional extra, imported when the logger is constructed on rank 0, so a missing
# install fails before training starts and names the pip command. MLflow keeps every point
# it is given, a second point at the same step included, and parameters cannot change once
# logged: a resumed run therefore reads the run's metric history from the checkpoint's step
# on and skips the points it holds (tracker.py), and a parameter whose value changed is
# reported, not silently dropped.
from __future__ import annotations

import os
import socket
import time
from typing import Any, Dict, List, Optional, Set
from urllib.parse import urlparse

from shardwise.loggers.csv import NoOpExperiment, rank_zero
from shardwise.loggers.tracker import TrackerLogger, warn_changed

__all__ = ["MLflowLogger"]

# MLflow's limits for one log_batch call and one parameter value.
_BATCH_METRICS, _BATCH_PARAMS, _PARAM_CHARS = 1000, 100, 6000


# How long the logger waits for an http(s) tracking server to accept a connection before refusing the run.
# MLflow's own client retries an unreachable server for minutes (262 s measured) before its first error.
CONNECT_TIMEOUT_S = 10.0


def check_reachable(tracking_uri: Optional[str], timeout_s: float = CONNECT_TIMEOUT_S) -> None:
    """Refuse, within `timeout_s`, an http(s) tracking server that does not accept a connection."""
    uri = tracking_uri or os.environ.get("MLFLOW_TRACKING_URI", "")
    parsed = urlparse(uri)
    if parsed.scheme not in ("http", "https") or not parsed.hostname:
        return  # a file store, databricks, or MLflow's local default: nothing to reach over the network
    port = parsed.port or (443 if parsed.scheme == "https" else 80)
    try:
        socket.create_connection((parsed.hostname, port), timeout=timeout_s).close()
    except OSError as err:
        raise ConnectionError(
            f"MLflowLogger: the tracking server {uri} cannot be reached ({err}; waited at most {timeout_s:g} s). "
            "Start the server or fix tracking_uri / MLFLOW_TRACKING_URI; to train without it, pass "
            "logger=CSVLogger(...) (the metrics can be imported into MLflow later)."
        ) from None


def _mlflow():
    try:
        import mlflow.entities
        from mlflow import MlflowClient
    except ImportError as err:
        raise ImportError(
            'MLflowLogger needs MLflow: pip install "shardwise[mlflow]" (or pip install mlflow-skinny). '
            "The default CSVLogger has no extra dependency."
        ) from err
    return MlflowClient, mlflow.entities


class MLflowLogger(TrackerLogger):
    """Log to an MLflow run: ``MLflowLogger(experiment_name="llama-ft", tracking_uri="http://mlflow:5000")``.

    tracking_uri: None means MLflow's own default (``MLFLOW_TRACKING_URI``, else its
        built-in default); a local store is ``"file:./mlruns"`` (mlflow-skinny has no
        SQLite; MLflow 3 also wants ``MLFLOW_ALLOW_FILE_STORE=true`` for a file store).
    run_id: continue this existing run (a resumed checkpoint continues its own run
        without it). run_name, tags: for a new run.
    prefix: put before every metric name ("train/" -> "train/loss").
    """

    def __init__(
        self,
        experiment_name: str = "shardwise",
        tracking_uri: Optional[str] = None,
        run_name: Optional[str] = None,
        tags: Optional[Dict[str, Any]] = None,
        run_id: Optional[str] = None,
        prefix: str = "",
    ) -> None:
        super().__init__(run_id, prefix)
        self.experiment_name = experiment_name
        self.tracking_uri = tracking_uri
        self.run_name = run_name
        self.tags = {str(k): str(v) for k, v in (tags or {}).items()}
        self._client: Any = None
        if rank_zero():
            _mlflow()  # fail at construction, not at the first logged step
            check_reachable(tracking_uri)

    @property
    def log_dir(self) -> Optional[str]:
        return None  # MLflow stores runs where its tracking URI says; the Trainer falls back to its root

    @property
    def experiment(self) -> Any:
        """The MlflowClient on rank 0 (elsewhere an object whose every call does nothing):
        `logger.experiment.log_artifact(logger.run_id, path)`."""
        return self._client if self.ensure_open() else NoOpExperiment()

    def _open(self, run_id: Optional[str]) -> str:
        client_class, _ = _mlflow()
        self._client = client = client_class(tracking_uri=self.tracking_uri)
        if run_id is not None:
            run = client.get_run(run_id)  # MlflowException names a run that does not exist
            client.update_run(run_id, status="RUNNING")
            self._params = dict(run.data.params)  # MLflow keeps parameters as strings
            return run_id
        experiment = client.get_experiment_by_name(self.experiment_name)
        experiment_id = (
            experiment.experiment_id if experiment is not None else client.create_experiment(self.experiment_name)
        )
        return client.create_run(experiment_id, run_name=self.run_name, tags=self.tags).info.run_id

    def _points_since(self, step: int) -> Dict[int, Set[str]]:
        held: Dict[int, Set[str]] = {}
        for key in self._client.get_run(self.run_id).data.metrics:
            for point in self._client.get_metric_history(self.run_id, key):
                if point.step >= step:
                    held.setdefault(point.step, set()).add(key)
        return held

    def _write_params(self, params: Dict[str, Any]) -> None:
        _, entities = _mlflow()
        new: List[Any] = []
        for key, value in params.items():
            text = str(value)[:_PARAM_CHARS]
            old = self._params.get(key)
            if old is None:
                new.append(entities.Param(key, text))
            elif str(old) != text:  # MLflow refuses to change a parameter; say so instead of failing the run
                warn_changed("MLflowLogger", key, old, value, "MLflow keeps a parameter's first value.")
        for i in range(0, len(new), _BATCH_PARAMS):
            self._client.log_batch(self.run_id, params=new[i : i + _BATCH_PARAMS])

    def _write_metrics(self, metrics: Dict[str, float], step: Optional[int]) -> None:
        _, entities = _mlflow()
        now = int(time.time() * 1000)
        points = [entities.Metric(key, value, now, int(step or 0)) for key, value in metrics.items()]
        for i in range(0, len(points), _BATCH_METRICS):
            self._client.log_batch(self.run_id, metrics=points[i : i + _BATCH_METRICS])

    def _close(self, status: str) -> None:
        self._client.set_terminated(self.run_id, "FINISHED" if status == "success" else "FAILED")

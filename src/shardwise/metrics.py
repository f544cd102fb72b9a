"""What `self.log` recorded -> the numbers loggers, progress bar and callbacks see.

Step values are forwarded as they are (after an optional cross-rank
reduction); epoch values are accumulated -- a mean weighted by the batch
size, given or read from the batch as Lightning does -- and reduced once at
the end of the epoch, so `sync_dist=True` costs one collective per metric
per epoch, not per step. The names are Lightning's: a value logged both per
step and per epoch is `name_step` / `name_epoch` to the loggers, all three
spellings to callbacks, and `name` to the progress bar; `logger=False` keeps
a value from the loggers only.

A torchmetrics `Metric` logged as the value (`self.log("acc", self.acc)`)
works as in Lightning: per step the batch value its last forward returned
(`self.acc(preds, target)`; none if only `update` was called), per epoch its
own `compute()` -- the metric's own cross-rank sync, so `sync_dist` and
`reduce_fx` do not apply. Every Metric logged in an epoch, per step or per
epoch, is `reset()` once the epoch's end hooks have run (reset_metric_objects),
as Lightning does: `on_train_epoch_end` still sees the whole epoch's state.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass
from typing import Any, Dict, Iterable, Iterator, List, Mapping, Optional

import torch

from shardwise.distributed import ops

# The logged values are module.LoggedValue; module.py imports this file (self.log's metric objects), so
# the annotations below name it as Any rather than import it back.
LoggedValue = Any


def _reduce(value: torch.Tensor, fx: str) -> torch.Tensor:
    op = {"mean": "mean", "sum": "sum", "max": "max", "min": "min"}[fx]
    return ops.reduce(value, op)


def settle(values: Dict[str, Any]) -> Dict[str, Any]:
    """Replace tensor values by Python floats in place: one host read per device, not per value."""
    by_device: Dict[torch.device, List[str]] = {}
    for name, value in values.items():
        if isinstance(value, torch.Tensor):
            by_device.setdefault(value.device, []).append(name)
    for names in by_device.values():
        numbers = torch.stack([values[n].detach().float().reshape(()) for n in names]).tolist()
        values.update(zip(names, numbers))
    return values


def is_metric(value: Any) -> bool:
    """A torchmetrics Metric or MetricCollection (duck-typed: torchmetrics stays an optional package)."""
    return isinstance(value, torch.nn.Module) and all(
        callable(getattr(value, name, None)) for name in ("update", "compute", "reset")
    )


def metric_step_value(name: str, metric: Any) -> Optional[torch.Tensor]:
    """The batch value of a Metric logged with self.log: what its last forward returned, None before one."""
    if isinstance(metric, torch.nn.ModuleDict):
        raise TypeError(
            f"self.log({name!r}, <{type(metric).__name__}>): a collection of metrics is logged with "
            "self.log_dict(collection), one name per metric, as in Lightning."
        )
    value = getattr(metric, "_forward_cache", None)
    if value is not None and not isinstance(value, torch.Tensor):
        raise TypeError(
            f"self.log({name!r}, <{type(metric).__name__}>): its forward returned {type(value).__name__}, not a "
            "scalar tensor; log the numbers it returned one by one (self.log_dict)."
        )
    return value


def batch_size_of(batch: Any) -> Optional[int]:
    """The batch size Lightning infers for an epoch mean: the first dimension of the first tensor in the batch."""
    if isinstance(batch, torch.Tensor):
        return int(batch.shape[0]) if batch.dim() > 0 else 1
    if isinstance(batch, Mapping):
        batch = list(batch.values())
    if isinstance(batch, (list, tuple)):
        for item in batch:
            size = batch_size_of(item)
            if size is not None:
                return size
    return None


@dataclass
class _EpochValue:
    """One metric's accumulator over an epoch."""

    total: torch.Tensor  # weighted sum (mean), sum, max or min so far
    weight: float  # the samples the mean is over
    reduce_fx: str
    sync_dist: bool
    prog_bar: bool
    logger: bool
    forked: bool  # also logged per step: the epoch value is `name_epoch`
    metric: Any = None  # a torchmetrics Metric: the epoch value is its compute()


class MetricStore:
    """Logged values, kept as tensors where they were computed until something reads them.

    Turning a device tensor into a float waits for the device to finish everything queued,
    which every step would cost FSDP its overlap of communication and compute. So a step's
    values stay on the device; they become floats when a logger is due (log_every_n_steps),
    when `callback_metrics` / `progress_bar_metrics` / `logged_metrics` are read, and at
    the end of an epoch.
    """

    def __init__(self) -> None:
        self._callback: Dict[str, Any] = {}
        self._progress: Dict[str, Any] = {}
        self._logged: Dict[str, Any] = {}
        self._epoch: Dict[str, _EpochValue] = {}
        self._to_reset: Dict[int, Any] = {}  # Metric objects logged this epoch: reset after its end hooks
        self._evaluating = False  # validation / test: step values reach loggers only, as in Lightning

    def clear(self) -> None:
        """Forget every value: trainer.validate() / test() start afresh, as Lightning's do."""
        self._callback.clear()
        self._progress.clear()
        self._logged.clear()

    @property
    def callback_metrics(self) -> Dict[str, float]:
        return settle(self._callback)

    @property
    def progress_bar_metrics(self) -> Dict[str, float]:
        return settle(self._progress)

    @property
    def logged_metrics(self) -> Dict[str, float]:
        return settle(self._logged)

    @contextlib.contextmanager
    def separate_epoch(self) -> Iterator[None]:
        """Accumulate epoch values apart from the current epoch's, which are back on exit (validation, test)."""
        outer, self._epoch = self._epoch, {}
        outer_metrics, self._to_reset = self._to_reset, {}
        outer_evaluating, self._evaluating = self._evaluating, True
        try:
            yield
        finally:
            self._epoch, self._to_reset = outer, outer_metrics
            self._evaluating = outer_evaluating

    def record(self, logs: Iterable[LoggedValue], suffix_epoch: bool = True, batch: Any = None) -> Dict[str, Any]:
        """Take one step's logs; return the step values for the loggers (tensors: `settle` them to log them).

        batch: the batch the values were computed on; an epoch mean without an explicit
        batch_size is weighted by its size, as in Lightning (a shorter last batch counts less).
        """
        step_values: Dict[str, Any] = {}
        inferred: List[Optional[int]] = []  # read from the batch at most once, and only when needed
        for item in logs:
            forked = item.on_step and item.on_epoch and suffix_epoch
            if item.on_step and item.value is not None:  # None: a Metric whose forward did not run
                value = _reduce(item.value, item.reduce_fx) if item.sync_dist else item.value
                key = f"{item.name}_step" if forked else item.name
                if item.logger:
                    step_values[key] = value
                if not self._evaluating:  # Lightning's callback_metrics hold no evaluation step values
                    self._callback[item.name] = value
                    self._callback[key] = value
                if item.prog_bar:
                    self._progress[item.name] = value  # one entry per metric (Lightning shows name_step)
            if item.metric is not None:
                self._to_reset[id(item.metric)] = item.metric
                if item.on_epoch:
                    self._accumulate_metric(item, forked)
                continue
            if item.on_epoch:
                weight = item.batch_size
                if weight is None and item.reduce_fx == "mean":
                    if not inferred:
                        inferred.append(batch_size_of(batch))
                    weight = inferred[0]
                self._accumulate(item, float(weight or 1), forked)
        self._logged.update(step_values)
        return step_values

    def _accumulate_metric(self, item: LoggedValue, forked: bool) -> None:
        entry = self._epoch.get(item.name)
        if entry is None or entry.metric is None:
            entry = _EpochValue(torch.zeros(()), 0.0, "mean", False, item.prog_bar, item.logger, forked, item.metric)
            self._epoch[item.name] = entry
        entry.metric = item.metric
        entry.forked = entry.forked or forked

    def _accumulate(self, item: LoggedValue, weight: float, forked: bool) -> None:
        v = item.value
        entry = self._epoch.get(item.name)
        if entry is None:
            total = v * weight if item.reduce_fx == "mean" else v
            self._epoch[item.name] = _EpochValue(
                total, weight, item.reduce_fx, item.sync_dist, item.prog_bar, item.logger, forked
            )
            return
        if entry.reduce_fx == "mean":
            entry.total = entry.total + v * weight
        elif entry.reduce_fx == "sum":
            entry.total = entry.total + v
        elif entry.reduce_fx == "max":
            entry.total = torch.maximum(entry.total, v)
        else:
            entry.total = torch.minimum(entry.total, v)
        entry.weight += weight
        entry.forked = entry.forked or forked

    def finish_epoch(self, suffix: bool = True) -> Dict[str, float]:
        """Close the epoch accumulators (reducing across ranks where asked); return what goes to the loggers."""
        out: Dict[str, float] = {}
        totals = settle({name: entry.total for name, entry in self._epoch.items() if entry.metric is None})
        for name, entry in self._epoch.items():
            total, weight = totals.get(name), entry.weight
            if entry.metric is not None:  # every rank reaches this point: the metric's own sync pairs up
                value = _computed(name, entry.metric)
            elif entry.reduce_fx == "mean":
                if entry.sync_dist:  # exact global mean: reduce numerator and denominator
                    pair = ops.reduce(torch.tensor([total, weight], dtype=torch.float64), "sum")
                    total, weight = float(pair[0]), float(pair[1])
                value = total / max(weight, 1e-12)
            else:
                value = float(_reduce(torch.tensor(total), entry.reduce_fx)) if entry.sync_dist else total
            key = f"{name}_epoch" if suffix and entry.forked else name
            if entry.logger:
                out[key] = value
            self._callback[name] = value
            self._callback[key] = value
            if entry.prog_bar:
                self._progress[name] = value
        self._epoch.clear()
        self._logged.update(out)
        return out

    def reset_metric_objects(self) -> None:
        """Reset every torchmetrics Metric logged this epoch: after the epoch's end hooks, as Lightning does."""
        for metric in self._to_reset.values():
            metric.reset()
        self._to_reset.clear()


def _computed(name: str, metric: Any) -> float:
    value = metric.compute()
    if not isinstance(value, torch.Tensor) or value.numel() != 1:
        raise ValueError(
            f"self.log({name!r}, <{type(metric).__name__}>): its compute() returned "
            f"{tuple(value.shape) if isinstance(value, torch.Tensor) else type(value).__name__}, not a scalar; "
            "log a metric that reduces to one number (e.g. average='macro'), or its parts with self.log_dict."
        )
    return float(value.detach())

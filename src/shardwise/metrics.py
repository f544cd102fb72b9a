"""What `self.log` recorded -> the numbers loggers, progress bar and callbacks see.

Step values are forwarded as they are (after an optional cross-rank
reduction); epoch values are accumulated -- a mean weighted by the batch
size, given or read from the batch as Lightning does -- and reduced once at
the end of the epoch, so `sync_dist=True` costs one collective per metric
per epoch, not per step. The names are Lightning's: a value logged both per
step and per epoch is `name_step` / `name_epoch` to the loggers, all three
spellings to callbacks, and `name` to the progress bar; `logger=False` keeps
a value from the loggers only.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass
from typing import Any, Dict, Iterable, Iterator, List, Mapping, Optional

import torch

from shardwise.distributed import ops
from shardwise.module import LoggedValue


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
        """Accumulate epoch values apart from the current epoch's, which are back on exit (validation)."""
        outer, self._epoch = self._epoch, {}
        try:
            yield
        finally:
            self._epoch = outer

    def record(self, logs: Iterable[LoggedValue], suffix_epoch: bool = True, batch: Any = None) -> Dict[str, Any]:
        """Take one step's logs; return the step values for the loggers (tensors: `settle` them to log them).

        batch: the batch the values were computed on; an epoch mean without an explicit
        batch_size is weighted by its size, as in Lightning (a shorter last batch counts less).
        """
        step_values: Dict[str, Any] = {}
        inferred: List[Optional[int]] = []  # read from the batch at most once, and only when needed
        for item in logs:
            forked = item.on_step and item.on_epoch and suffix_epoch
            if item.on_step:
                value = _reduce(item.value, item.reduce_fx) if item.sync_dist else item.value
                key = f"{item.name}_step" if forked else item.name
                if item.logger:
                    step_values[key] = value
                self._callback[item.name] = value
                self._callback[key] = value
                if item.prog_bar:
                    self._progress[item.name] = value  # one entry per metric (Lightning shows name_step)
            if item.on_epoch:
                weight = item.batch_size
                if weight is None and item.reduce_fx == "mean":
                    if not inferred:
                        inferred.append(batch_size_of(batch))
                    weight = inferred[0]
                self._accumulate(item, float(weight or 1), forked)
        self._logged.update(step_values)
        return step_values

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
        totals = settle({name: entry.total for name, entry in self._epoch.items()})
        for name, entry in self._epoch.items():
            total, weight = totals[name], entry.weight
            if entry.reduce_fx == "mean":
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

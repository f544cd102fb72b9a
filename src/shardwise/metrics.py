"""What `self.log` recorded -> the numbers loggers, progress bar and callbacks see.

Step values are forwarded as they are (after an optional cross-rank
reduction); epoch values are accumulated -- weighted by batch size when
given -- and reduced once at the end of the epoch, so `sync_dist=True`
costs one collective per metric per epoch, not per step.
"""

from __future__ import annotations

import contextlib
from typing import Any, Dict, Iterable, Iterator, List

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
        # name -> [weighted sum, weight, reduce_fx, sync_dist, prog_bar]
        self._epoch: Dict[str, List] = {}

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

    def record(self, logs: Iterable[LoggedValue], suffix_epoch: bool = True) -> Dict[str, Any]:
        """Take one step's logs; return the step values (tensors: `settle` them to log them)."""
        step_values: Dict[str, Any] = {}
        for item in logs:
            value = item.value
            if item.on_step:
                if item.sync_dist:
                    value = _reduce(value, item.reduce_fx)
                key = f"{item.name}_step" if (item.on_epoch and suffix_epoch) else item.name
                step_values[key] = value
                self._callback[item.name] = value
                if item.prog_bar:
                    self._progress[item.name] = value
            if item.on_epoch:
                weight = float(item.batch_size or 1)
                entry = self._epoch.get(item.name)
                v = item.value
                if entry is None:
                    self._epoch[item.name] = [
                        v * weight if item.reduce_fx == "mean" else v,
                        weight,
                        item.reduce_fx,
                        item.sync_dist,
                        item.prog_bar,
                    ]
                else:
                    fx = entry[2]
                    if fx == "mean":
                        entry[0] = entry[0] + v * weight
                    elif fx == "sum":
                        entry[0] = entry[0] + v
                    elif fx == "max":
                        entry[0] = torch.maximum(entry[0], v)
                    else:
                        entry[0] = torch.minimum(entry[0], v)
                    entry[1] += weight
        self._logged.update(step_values)
        return step_values

    def finish_epoch(self, suffix: bool = True) -> Dict[str, float]:
        """Close the epoch accumulators (reducing across ranks where asked) and return them."""
        out: Dict[str, float] = {}
        totals = settle({name: entry[0] for name, entry in self._epoch.items()})
        for name, (_, weight, fx, sync, prog_bar) in self._epoch.items():
            total = totals[name]
            if fx == "mean":
                if sync:  # exact global mean: reduce numerator and denominator
                    pair = ops.reduce(torch.tensor([total, weight], dtype=torch.float64), "sum")
                    total, weight = float(pair[0]), float(pair[1])
                value = total / max(weight, 1e-12)
            else:
                value = float(_reduce(torch.tensor(total), fx)) if sync else total
            key = f"{name}_epoch" if suffix and self._had_step(name) else name
            out[key] = value
            self._callback[name] = value
            if prog_bar:
                self._progress[name] = value
        self._epoch.clear()
        self._logged.update(out)
        return out

    def _had_step(self, name: str) -> bool:
        return f"{name}_step" in self._logged

"""What `self.log` recorded -> the numbers loggers, progress bar and callbacks see.

Step values are forwarded as they are (after an optional cross-rank
reduction); epoch values are accumulated -- weighted by batch size when
given -- and reduced once at the end of the epoch, so `sync_dist=True`
costs one collective per metric per epoch, not per step.
"""
from __future__ import annotations

from typing import Dict, Iterable, List, Optional, Tuple

import torch

from shardwise.distributed import ops
from shardwise.module import LoggedValue


def _reduce(value: torch.Tensor, fx: str) -> torch.Tensor:
    op = {"mean": "mean", "sum": "sum", "max": "max", "min": "min"}[fx]
    return ops.reduce(value, op)


class MetricStore:
    def __init__(self) -> None:
        self.callback_metrics: Dict[str, float] = {}
        self.progress_bar_metrics: Dict[str, float] = {}
        self.logged_metrics: Dict[str, float] = {}
        # name -> (weighted sum, weight, reduce_fx, sync_dist, prog_bar, running value)
        self._epoch: Dict[str, List] = {}

    def record(self, logs: Iterable[LoggedValue], suffix_epoch: bool = True) -> Dict[str, float]:
        """Take one step's logs; return the step values to send to loggers now."""
        step_values: Dict[str, float] = {}
        for item in logs:
            value = item.value
            if item.on_step:
                if item.sync_dist:
                    value = _reduce(value, item.reduce_fx)
                number = float(value)
                key = f"{item.name}_step" if (item.on_epoch and suffix_epoch) else item.name
                step_values[key] = number
                self.callback_metrics[item.name] = number
                if item.prog_bar:
                    self.progress_bar_metrics[item.name] = number
            if item.on_epoch:
                weight = float(item.batch_size or 1)
                entry = self._epoch.get(item.name)
                v = float(item.value)
                if entry is None:
                    self._epoch[item.name] = [v * weight if item.reduce_fx == "mean" else v, weight,
                                              item.reduce_fx, item.sync_dist, item.prog_bar]
                else:
                    fx = entry[2]
                    if fx == "mean":
                        entry[0] += v * weight
                    elif fx == "sum":
                        entry[0] += v
                    elif fx == "max":
                        entry[0] = max(entry[0], v)
                    else:
                        entry[0] = min(entry[0], v)
                    entry[1] += weight
        self.logged_metrics.update(step_values)
        return step_values

    def finish_epoch(self, suffix: bool = True) -> Dict[str, float]:
        """Close the epoch accumulators (reducing across ranks where asked) and return them."""
        out: Dict[str, float] = {}
        for name, (total, weight, fx, sync, prog_bar) in self._epoch.items():
            if fx == "mean":
                if sync:  # exact global mean: reduce numerator and denominator
                    pair = ops.reduce(torch.tensor([total, weight], dtype=torch.float64), "sum")
                    total, weight = float(pair[0]), float(pair[1])
                value = total / max(weight, 1e-12)
            else:
                value = float(_reduce(torch.tensor(total), fx)) if sync else total
            key = f"{name}_epoch" if suffix and self._had_step(name) else name
            out[key] = value
            self.callback_metrics[name] = value
            if prog_bar:
                self.progress_bar_metrics[name] = value
        self._epoch.clear()
        self.logged_metrics.update(out)
        return out

    def _had_step(self, name: str) -> bool:
        return f"{name}_step" in self.logged_metrics

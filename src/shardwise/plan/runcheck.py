"""The plan checked against the run it planned: measured peak memory (and step time on a GPU) vs the prediction.

The first real steps are the best check a memory prediction can get. When
`Trainer.fit` planned the run (`device_memory` given: the planner chose the
strategy or checked the user's), the prediction for the configuration that
runs travels with the fit decision (and, for workers the launcher starts,
in the launch context's plan choice), and `PlanCheck` is added to the
callbacks. It measures the first `steps` optimizer steps -- on the CPU the
tracked tensor memory (shardwise.memory, per category), on CUDA
`max_memory_allocated` / `max_memory_reserved` -- then compares, once, on
global rank 0 (whose rank the planner predicts): both go to the loggers
(`plan/...` metrics) and one line is printed; a difference over `tolerance`
(10%) is a warning that names the term that differs most (parameters,
gradients, optimizer state or activations; on a GPU, which has no
breakdown, the predicted largest term). On CUDA the step time of those
steps is compared with the planner's modelled step time the same way (one
synchronisation, at the end of the measured window). Nothing runs on the
step path afterwards: the tracker stops, the callback goes quiet. A user
may add `PlanCheck(Prediction.from_estimate(...))` by hand to check any plan.
"""

from __future__ import annotations

import time
import warnings
from dataclasses import asdict, dataclass, field
from typing import Any, Dict, Optional

import torch

from shardwise.memory import active_tracker, format_bytes, start_tracking, stop_tracking

TERMS = ("parameters", "gradients", "optimizer", "activations")


@dataclass
class Prediction:
    """What the planner predicted for the configuration that runs (bytes per device; seconds per step)."""

    label: str
    allocated: float
    reserved: float
    breakdown: Dict[str, float] = field(default_factory=dict)
    step_seconds: float = 0.0
    accelerator: str = "cpu"

    @classmethod
    def from_estimate(cls, estimate: Any, accelerator: str) -> "Prediction":
        return cls(
            label=estimate.label,
            allocated=float(estimate.allocated),
            reserved=float(estimate.reserved),
            breakdown={k: float(v) for k, v in estimate.breakdown.items()},
            step_seconds=float(estimate.step_seconds),
            accelerator=accelerator,
        )

    def to_dict(self) -> Dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_dict(cls, d: Dict[str, Any]) -> "Prediction":
        return cls(**d)


def compare(pred: Prediction, measured: float, breakdown: Optional[Dict[str, float]], tolerance: float) -> tuple:
    """(relative difference, the term that differs most, its predicted bytes, its measured bytes or None)."""
    diff = (measured - pred.allocated) / max(pred.allocated, 1.0)
    if breakdown:
        got = dict(breakdown)
        got["parameters"] = got.get("parameters", 0) + got.get("buffers", 0)
        got["activations"] = got.get("activations", 0) + got.get("other", 0)
        want = dict(pred.breakdown)
        want["activations"] = want.get("activations", 0) + want.get("temporary", 0)
        term = max(TERMS, key=lambda t: abs(got.get(t, 0) - want.get(t, 0)))
        return diff, term, want.get(term, 0.0), float(got.get(term, 0))
    term = max(TERMS, key=lambda t: pred.breakdown.get(t, 0.0))
    return diff, term, pred.breakdown.get(term, 0.0), None


class PlanCheck:
    """Callback: compare the first `steps` optimizer steps with the plan's prediction, once, on global rank 0."""

    def __init__(self, prediction: Prediction, steps: int = 2, tolerance: float = 0.10) -> None:
        if steps < 1:
            raise ValueError(f"PlanCheck(steps={steps}): measure at least one optimizer step.")
        self.prediction, self.steps, self.tolerance = prediction, steps, tolerance
        self.result: Optional[Dict[str, float]] = None
        self._tracking = False
        self._done = False
        self._t0: Optional[float] = None

    def _cuda(self, trainer: Any) -> bool:
        device = getattr(trainer.strategy, "root_device", None)
        return getattr(device, "type", "cpu") == "cuda"

    def on_train_start(self, trainer: Any, module: Any) -> None:
        if not trainer.is_global_zero or self._done:
            self._done = True
            return
        if self._cuda(trainer):
            torch.cuda.reset_peak_memory_stats()
        elif active_tracker() is None:  # a DeviceStatsMonitor's tracker is read, not restarted
            start_tracking(trainer.strategy.module, trainer.strategy.optimizers)
            self._tracking = True

    def on_train_batch_end(self, trainer: Any, module: Any, outputs: Any, batch: Any, batch_idx: int) -> None:
        if self._done or not trainer.is_last_microbatch:
            return
        step = trainer.global_step
        if step == 1 and self._cuda(trainer) and self.steps > 1:
            torch.cuda.synchronize()  # once: the timed window starts after the first (warm-up) step
            self._t0 = time.perf_counter()
        if step >= self.steps:
            self._done = True
            self._check(trainer, step)

    def on_train_end(self, trainer: Any, module: Any) -> None:
        if self._tracking:
            stop_tracking()
            self._tracking = False
        self._done = True

    def _check(self, trainer: Any, step: int) -> None:
        pred = self.prediction
        metrics: Dict[str, float] = {"plan/predicted_peak_bytes": pred.allocated}
        seconds = None
        if self._cuda(trainer):
            torch.cuda.synchronize()
            if self._t0 is not None:
                seconds = (time.perf_counter() - self._t0) / (self.steps - 1)
            measured, breakdown = float(torch.cuda.max_memory_allocated()), None
            metrics["plan/measured_reserved_bytes"] = float(torch.cuda.max_memory_reserved())
            metrics["plan/predicted_reserved_bytes"] = pred.reserved
        else:
            tracker = active_tracker()
            measured = float(tracker.peak_bytes) if tracker is not None else 0.0
            breakdown = tracker.peak_breakdown if tracker is not None else None
            if self._tracking:
                stop_tracking()
                self._tracking = False
        metrics["plan/measured_peak_bytes"] = measured
        diff, term, want, got = compare(pred, measured, breakdown, self.tolerance)
        metrics["plan/peak_difference"] = diff
        line = (
            f"shardwise plan check ({pred.label}): predicted peak {format_bytes(pred.allocated)} per device, "
            f"measured {format_bytes(measured)} over the first {step} steps ({diff:+.1%})"
        )
        if seconds is not None and pred.step_seconds > 0:
            metrics.update({"plan/predicted_step_seconds": pred.step_seconds, "plan/measured_step_seconds": seconds})
            line += f"; step {seconds:.3g} s vs {pred.step_seconds:.3g} s modelled"
        self.result = metrics
        trainer.log_metrics(metrics, step=step)
        print(line)
        if abs(diff) > self.tolerance:
            detail = (
                f"{term} differ most: predicted {format_bytes(want)}, measured {format_bytes(got)}"
                if got is not None
                else f"the largest predicted term is {term} ({format_bytes(want)}; the GPU gives no breakdown)"
            )
            warnings.warn(
                f"The memory planner's prediction is off by {diff:+.0%} for this run ({pred.label}): predicted "
                f"{format_bytes(pred.allocated)} per device, measured {format_bytes(measured)} after {step} "
                f"steps; {detail}. Advice from this plan may not be safe to follow.",
                stacklevel=2,
            )
        if seconds is not None and pred.step_seconds > 0:
            ratio = seconds / pred.step_seconds - 1
            if abs(ratio) > self.tolerance:
                warnings.warn(
                    f"Step time differs from the planner's model by {ratio:+.0%} ({seconds:.3g} s measured, "
                    f"{pred.step_seconds:.3g} s modelled for {pred.label}); the model is relative (plan/cost.py).",
                    stacklevel=2,
                )


__all__ = ["Prediction", "PlanCheck", "compare"]

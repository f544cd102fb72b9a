# DeviceStatsMonitor: logs memory while training so a run's footprint is on record
# next to its loss. On CUDA it logs the caching allocator's essentials (allocated and
# reserved bytes, their peaks, allocation retries, which signal fragmentation). On
# CPU there are no allocator statistics, so it turns on the process-wide
# MemoryTracker at on_train_start (registering the set-up model and optimizers so
# parameters, gradients and optimizer state are named), logs tracked bytes by
# category, their peak split and RSS every `log_every_n_steps` optimizer steps, and
# stops the tracker at on_train_end. The stopped tracker's peak stays readable
# through shardwise.memory.max_memory_allocated() until reset_peak_memory_stats(),
# so a script can report it after fit returns. If the user already runs a tracker,
# it is reused and left running.
from __future__ import annotations

from typing import Any

import torch

from shardwise import memory

__all__ = ["DeviceStatsMonitor"]

_CUDA_KEYS = {
    "allocated_bytes.all.current": "allocated",
    "allocated_bytes.all.peak": "peak",
    "reserved_bytes.all.current": "reserved",
    "reserved_bytes.all.peak": "reserved_peak",
    "num_alloc_retries": "alloc_retries",
    "num_ooms": "ooms",
}


class DeviceStatsMonitor:
    """Log memory statistics every ``log_every_n_steps`` optimizer steps.

    Keys (bytes): ``memory/current``, ``memory/peak``; on CPU also
    ``memory/current/<category>``, ``memory/peak/<category>`` (the split at the
    peak moment), ``memory/rss`` and ``memory/rss_peak``; on CUDA ``memory/reserved``,
    ``memory/reserved_peak``, ``memory/alloc_retries``, ``memory/ooms``.
    """

    def __init__(self, log_every_n_steps: int = 50, prefix: str = "memory", verbose: bool = True):
        self.log_every_n_steps = max(1, log_every_n_steps)
        self.prefix = prefix
        self.verbose = verbose  # print the peak summary at the end of training (rank 0)
        self._device: torch.device | None = None
        self._tracker: memory.MemoryTracker | None = None
        self._owns_tracker = False
        self._last_step = -1

    def on_train_start(self, trainer: Any, module: Any) -> None:
        strategy = trainer.strategy
        self._device = torch.device(strategy.root_device)
        self._last_step = -1
        if self._device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(self._device)
            return
        self._owns_tracker = memory.active_tracker() is None
        self._tracker = memory.start_tracking(getattr(strategy, "module", None), list(strategy.optimizers or ()))
        memory.reset_peak_rss()

    def stats(self) -> dict[str, int]:
        """The current statistics (what would be logged now)."""
        p = self.prefix
        if self._device is not None and self._device.type == "cuda":
            raw = torch.cuda.memory_stats(self._device)
            return {f"{p}/{short}": int(raw.get(key, 0)) for key, short in _CUDA_KEYS.items()}
        tracker = self._tracker or memory.last_tracker()
        out: dict[str, int] = {}
        if tracker is not None:
            out[f"{p}/current"] = tracker.current_bytes
            out[f"{p}/peak"] = tracker.peak_bytes
            out.update({f"{p}/current/{k}": v for k, v in tracker.current_breakdown.items()})
            out.update({f"{p}/peak/{k}": v for k, v in tracker.peak_breakdown.items()})
        out[f"{p}/rss"] = memory.current_rss_bytes()
        out[f"{p}/rss_peak"] = memory.peak_rss_bytes()
        return out

    def _log(self, trainer: Any) -> None:
        self._last_step = trainer.global_step
        trainer.log_metrics(self.stats(), step=trainer.global_step)

    def on_train_batch_end(self, trainer: Any, module: Any, outputs: Any, batch: Any, batch_idx: int) -> None:
        if not getattr(trainer, "is_last_microbatch", True):
            return  # between optimizer steps nothing new is logged
        step = trainer.global_step
        if step != self._last_step and step % self.log_every_n_steps == 0:
            self._log(trainer)

    def on_train_end(self, trainer: Any, module: Any) -> None:
        if trainer.global_step != self._last_step:
            self._log(trainer)
        if self.verbose and self._tracker is not None:
            trainer.print(f"[rank 0] {self._tracker.summary()}")
        self._stop()

    def on_exception(self, trainer: Any, module: Any, exc: BaseException) -> None:
        self._stop()

    def teardown(self, trainer: Any, module: Any, stage: str | None = None) -> None:
        self._stop()

    def _stop(self) -> None:
        # Stop only a tracker we started; the stopped tracker stays readable via
        # shardwise.memory.max_memory_allocated() / last_tracker().
        if self._owns_tracker and self._tracker is not None and self._tracker.active:
            self._tracker.stop()
        self._owns_tracker = False

    def state_dict(self) -> dict:
        return {}

    def load_state_dict(self, state: dict) -> None:
        pass

# ThroughputMonitor: tokens/s, samples/s, achieved TFLOP/s and MFU of a run, at the log steps. The
# Trainer adds one unless Trainer(throughput=False). FLOPs are counted once, over the first
# micro-batch's forward and backward (shardwise.flops: torch's FLOP formulas), as FLOPs per token
# (per sample for inputs without token ids) of that micro-batch's padded shape; the run's FLOPs are
# that times the tokens it trained. Tokens come from the module's `count_tokens(batch)` when it has one
# (the fine-tuning recipe's counts the attention mask: padding is not trained on), else from the batch:
# an "attention_mask" entry's sum, else the element count of the token ids (the "input_ids" entry, or
# the first integer tensor with a sequence dimension); a batch without either has samples only.
# Nothing is read back to the host between log steps: per step the counts are host integers from
# shapes, or a device sum added on the device. At a log step the device is synchronised (the interval
# then ends with its work done), one all-reduce sums every rank's counts, and the rates over the time
# since the previous log step (validation excluded) go to the loggers; the first log step (step 1, with
# the FLOP counting and any warm-up in it) only starts the clock. Per-device rates are the mean over
# the ranks; MFU is per-device TFLOP/s over the device's dense peak for the run's precision.
from __future__ import annotations

import time
from typing import Any, Dict, Mapping, Optional

import torch

from shardwise import flops
from shardwise.metrics import batch_size_of

__all__ = ["ThroughputMonitor", "count_tokens", "token_ids"]


def token_ids(batch: Any) -> Optional[torch.Tensor]:
    """The batch's token ids: its "input_ids" entry, else its first integer tensor of 2 or more dimensions."""
    if isinstance(batch, Mapping):
        ids = batch.get("input_ids")
        if isinstance(ids, torch.Tensor):
            return ids
        batch = list(batch.values())
    if isinstance(batch, torch.Tensor):
        return batch if batch.dim() >= 2 and not batch.is_floating_point() and not batch.is_complex() else None
    if isinstance(batch, (list, tuple)):
        for item in batch:
            found = token_ids(item)
            if found is not None:
                return found
    return None


def count_tokens(module: Any, batch: Any) -> Any:
    """Trained tokens in a batch (an int, a device tensor, or None when it has no tokens); padding excluded
    where the batch says which positions are padding (an attention mask)."""
    return _count(getattr(module, "count_tokens", None), batch)


def _count(own: Any, batch: Any) -> Any:
    """count_tokens with the module's own method (or None) already looked up."""
    if callable(own):
        return own(batch)
    if isinstance(batch, Mapping) and isinstance(batch.get("attention_mask"), torch.Tensor):
        return batch["attention_mask"].sum()
    ids = token_ids(batch)
    return None if ids is None else ids.numel()


def _short(value: float) -> str:
    for scale, suffix in ((1e9, "G"), (1e6, "M"), (1e3, "k")):
        if abs(value) >= scale:
            return f"{value / scale:.3g}{suffix}"
    return f"{value:.3g}"


class ThroughputMonitor:
    """Log tokens/s, samples/s, TFLOP/s and MFU at the Trainer's log steps (see the file's comment).

    Args:
        peak_tflops: the device's dense peak TFLOP/s for MFU; None uses the table in shardwise.flops
            (CUDA devices it lists), else no MFU.
        prefix: the metric names' prefix.

    Keys: ``<prefix>/tokens_per_sec`` and ``samples_per_sec`` (all ranks), ``..._per_device`` (their
    mean per rank), ``tflops_per_device``, ``mfu`` (0..1, with a peak), ``flops_per_token`` (or
    ``flops_per_sample``), and the run's totals so far ``tokens`` / ``samples``.
    """

    def __init__(self, peak_tflops: Optional[float] = None, prefix: str = "throughput") -> None:
        self.peak_tflops = flops.check_peak(peak_tflops)
        self.prefix = prefix
        self.peak: Optional[float] = None
        self.peak_source = ""
        self.flops_per_unit: Optional[float] = None  # per token, or per sample when `unit` is "sample"
        self.unit = "token"
        self.last: Dict[str, float] = {}  # the latest values logged (the progress bar shows them)
        self.totals = {"tokens": 0.0, "samples": 0.0}
        self._counter = flops.FlopCounter()
        self._count_units = 0
        self._reset_interval()
        self._clock: Optional[float] = None  # perf_counter at the last log point; None before step 1's
        self._paused_at: Optional[float] = None
        self._last_point = -1
        self._own_count: Any = None  # the module's count_tokens, if it has one (on_train_start)

    def _reset_interval(self) -> None:
        self._host_tokens = 0
        self._device_tokens: Optional[torch.Tensor] = None
        self._samples = 0
        self._has_tokens = False
        self._paused = 0.0

    # ------------------------------------------------------------------- hooks
    def on_train_start(self, trainer: Any, module: Any) -> None:
        strategy = trainer.strategy
        self.peak, self.peak_source = flops.device_peak(
            torch.device(strategy.root_device), strategy.precision.name, self.peak_tflops
        )
        self._clock, self._last_point = None, trainer.global_step
        self._reset_interval()
        # Looked up once per fit: on an nn.Module a missing attribute costs a raised AttributeError each time.
        self._own_count = getattr(module, "count_tokens", None)

    def on_train_batch_start(self, trainer: Any, module: Any, batch: Any, batch_idx: int) -> None:
        tokens = _count(self._own_count, batch)
        if tokens is not None:
            self._has_tokens = True
            if isinstance(tokens, torch.Tensor):
                tokens = tokens.detach()
                self._device_tokens = tokens if self._device_tokens is None else self._device_tokens + tokens
            else:
                self._host_tokens += int(tokens)
        self._samples += batch_size_of(batch) or 0
        if self.flops_per_unit is None and not self._counter.running and self._counter.total is None:
            # The first micro-batch of the run is counted: its forward, backward and (FLOP-free) update.
            ids = token_ids(batch)
            if tokens is None:
                self.unit, self._count_units = "sample", batch_size_of(batch) or 1
            else:  # every position of the padded shape is computed: FLOPs per position
                self.unit = "token"
                self._count_units = ids.numel() if ids is not None else int(tokens)
            self._counter.start()

    def on_train_batch_end(self, trainer: Any, module: Any, outputs: Any, batch: Any, batch_idx: int) -> None:
        if self._counter.running:
            total = self._counter.stop()
            if total and self._count_units:
                # Under sp/tp each rank of a group computes its share of the same sample's FLOPs.
                share = trainer.strategy.world_size / trainer.strategy.data_parallel_size
                self.flops_per_unit = total * share / self._count_units
        if not getattr(trainer, "is_last_microbatch", True):
            return
        step = trainer.global_step
        if step % trainer.log_every_n_steps == 0 or step == 1:
            self._point(trainer)

    def on_validation_start(self, trainer: Any, module: Any) -> None:
        if self._clock is not None and self._paused_at is None:
            self._paused_at = time.perf_counter()  # validation's time is not training's

    def on_validation_end(self, trainer: Any, module: Any) -> None:
        if self._paused_at is not None:
            self._paused += time.perf_counter() - self._paused_at
            self._paused_at = None

    def on_train_end(self, trainer: Any, module: Any) -> None:
        if trainer.global_step != self._last_point:
            self._point(trainer)  # the steps since the last log step (a run shorter than log_every_n_steps)

    def on_exception(self, trainer: Any, module: Any, exc: BaseException) -> None:
        self._counter.stop()

    def teardown(self, trainer: Any, module: Any, stage: Optional[str] = None) -> None:
        self._counter.stop()

    # ------------------------------------------------------------ measuring
    def _point(self, trainer: Any) -> None:
        """A log point, on every rank: the interval's counts summed over the ranks, its rates logged."""
        strategy = trainer.strategy
        device = torch.device(strategy.root_device)
        if device.type == "cuda":
            torch.cuda.synchronize(device)  # the interval ends when its queued work has run
        now = time.perf_counter()
        counts = torch.tensor([float(self._host_tokens), float(self._samples)], dtype=torch.float64, device=device)
        if self._device_tokens is not None:
            counts[0] += self._device_tokens.to(device=device, dtype=torch.float64)
        if strategy.world_size > 1:
            # The ranks of a sequence/tensor-parallel group count the same samples: count them once.
            counts = strategy.reduce(counts, "sum") * (strategy.data_parallel_size / strategy.world_size)
        tokens, samples = counts.tolist()  # the log step's read-back
        has_tokens = self._has_tokens
        seconds = None if self._clock is None else now - self._clock - self._paused
        self._clock, self._last_point = now, trainer.global_step
        self._reset_interval()
        self.totals["tokens"] += tokens
        self.totals["samples"] += samples
        p = self.prefix
        values: Dict[str, float] = {f"{p}/samples": self.totals["samples"]}
        if has_tokens:
            values[f"{p}/tokens"] = self.totals["tokens"]
        if self.flops_per_unit is not None:
            values[f"{p}/flops_per_{self.unit}"] = self.flops_per_unit
        if seconds is not None and seconds > 0:
            values.update(self.rates(tokens if has_tokens else None, samples, seconds, strategy.world_size))
            self.last = values
        trainer.log_metrics(values, step=trainer.global_step)

    def rates(self, tokens: Optional[float], samples: float, seconds: float, world: int) -> Dict[str, float]:
        """The rates of an interval: `tokens` / `samples` summed over `world` ranks in `seconds`."""
        p = self.prefix
        out = {f"{p}/samples_per_sec": samples / seconds, f"{p}/samples_per_sec_per_device": samples / seconds / world}
        if tokens is not None:
            out[f"{p}/tokens_per_sec"] = tokens / seconds
            out[f"{p}/tokens_per_sec_per_device"] = tokens / seconds / world
        units = tokens if self.unit == "token" else samples
        if self.flops_per_unit is not None and units is not None:
            tflops = self.flops_per_unit * units / seconds / world / 1e12
            out[f"{p}/tflops_per_device"] = tflops
            utilisation = flops.mfu(tflops, self.peak)
            if utilisation is not None:
                out[f"{p}/mfu"] = utilisation
        return out

    def progress_text(self) -> str:
        """What the progress bar shows: '12.3k tok/s/dev | 45.6 TFLOP/s/dev | MFU 38.1%' (latest log step)."""
        p, last = self.prefix, self.last
        parts = []
        if f"{p}/tokens_per_sec_per_device" in last:
            parts.append(f"{_short(last[f'{p}/tokens_per_sec_per_device'])} tok/s/dev")
        elif f"{p}/samples_per_sec_per_device" in last:
            parts.append(f"{_short(last[f'{p}/samples_per_sec_per_device'])} samples/s/dev")
        if f"{p}/tflops_per_device" in last:
            parts.append(f"{last[f'{p}/tflops_per_device']:.3g} TFLOP/s/dev")
        if f"{p}/mfu" in last:
            parts.append(f"MFU {100 * last[f'{p}/mfu']:.1f}%")
        return " | ".join(parts)

# RichProgressBar: what a user watches during fit. On a terminal it draws a live rich
# bar (epoch, steps, it/s, tokens/s / TFLOP/s / MFU from the ThroughputMonitor, the metrics
# logged with prog_bar=True, and memory); when stdout is not a terminal (CI, a pipe, a spawned
# rank, a log file) redrawing would spew control codes and one line per refresh, so it prints one plain line every N
# optimizer steps instead, plus one at the end of each epoch and validation run.
# Only global rank 0 renders. Memory is the device's peak allocated bytes on CUDA;
# on CPU it is the tracked tensor peak when a MemoryTracker runs (DeviceStatsMonitor
# or shardwise.track_memory), otherwise current RSS, labelled so the two are not
# confused. The Trainer adds this callback when enable_progress_bar=True.
from __future__ import annotations

import collections
import math
import sys
import time
from typing import Any, TextIO

from shardwise import memory

__all__ = ["RichProgressBar", "TQDMProgressBar"]


def _fmt(value: Any) -> str:
    if hasattr(value, "item"):
        value = value.item()
    if isinstance(value, float):
        return f"{value:.4g}"
    return str(value)


def memory_text(trainer: Any, finished: bool = False) -> str:
    """Short memory label for the bar, e.g. 'mem 1.2 GiB' or 'rss 812.0 MiB'."""
    device = getattr(getattr(trainer, "strategy", None), "root_device", None)
    if device is not None and device.type == "cuda":
        return f"mem {memory.format_bytes(memory.max_memory_allocated(device))}"
    # At the end a DeviceStatsMonitor may already have stopped its tracker; its peak
    # is still the run's. During the run only a live tracker's numbers are current.
    tracker = memory.last_tracker() if finished else memory.active_tracker()
    if tracker is not None:
        return f"mem {memory.format_bytes(tracker.peak_bytes)} (tracked peak)"
    return f"rss {memory.format_bytes(memory.current_rss_bytes())}"


def throughput_text(trainer: Any) -> str:
    """The latest tokens/s, TFLOP/s and MFU a ThroughputMonitor measured ('' before its second log step)."""
    for callback in getattr(trainer, "callbacks", ()):
        text = getattr(callback, "progress_text", None)
        if callable(text):
            return text()
    return ""


class RichProgressBar:
    """Progress display for Trainer.fit (and a line per validation run).

    Args:
        refresh_rate: redraw the live bar every this many batches (terminal only).
        print_every_n_steps: in non-terminal mode, print a line every this many
            optimizer steps; None picks about 20 lines per run (or every 50 steps
            when the run length is unknown).
        leave: keep finished bars on screen (terminal only).
        file: stream to write to; default sys.stdout at the time of writing.
    """

    is_progress_bar = True  # the Trainer adds its default bar only if no callback says this

    def __init__(
        self,
        refresh_rate: int = 1,
        print_every_n_steps: int | None = None,
        leave: bool = False,
        file: TextIO | None = None,
    ):
        self.refresh_rate = max(1, refresh_rate)
        self.print_every_n_steps = print_every_n_steps
        self.leave = leave
        self._file = file
        self._enabled = False
        self._live = None  # rich Progress when drawing on a terminal
        self._train_task = self._val_task = None
        self._batch_times: collections.deque = collections.deque(maxlen=30)
        self._batches_seen = 0
        self._batches_in_epoch = 0
        self._last_printed_step = -1
        self._every = 50
        self._t0 = 0.0
        self._start_step = 0

    # ----------------------------------------------------------------- helpers
    @property
    def file(self) -> TextIO:
        return self._file if self._file is not None else sys.stdout

    @property
    def is_terminal(self) -> bool:
        # rich is imported where a bar is drawn, not at the top: it costs ~50 ms, which every
        # `import shardwise` (this module comes with the Trainer) would otherwise pay.
        from rich.console import Console

        console = Console(file=self.file)
        return console.is_terminal and not console.is_dumb_terminal

    def _rate(self) -> float:
        times = self._batch_times
        if len(times) < 2 or times[-1] <= times[0]:
            return 0.0
        return (len(times) - 1) / (times[-1] - times[0])

    @staticmethod
    def _epoch_text(trainer: Any) -> str:
        epoch = getattr(trainer, "current_epoch", 0) + 1
        max_epochs = getattr(trainer, "max_epochs", None)
        return f"epoch {epoch}/{max_epochs}" if max_epochs and max_epochs > 0 else f"epoch {epoch}"

    def _step_text(self, trainer: Any) -> str:
        step = trainer.global_step
        max_steps = getattr(trainer, "max_steps", -1)
        if max_steps is not None and max_steps > 0:
            return f"step {step}/{max_steps}"
        total = getattr(trainer, "num_training_batches", math.inf)
        total = "?" if total is None or total == math.inf else int(total)
        return f"step {step} | batch {self._batches_in_epoch}/{total}"

    @staticmethod
    def _metrics_text(metrics: dict) -> str:
        return " ".join(f"{k}={_fmt(v)}" for k, v in metrics.items())

    def _line(self, trainer: Any, *parts: str) -> None:
        print(" | ".join(p for p in parts if p), file=self.file, flush=True)

    def _train_fields(self, trainer: Any) -> dict[str, str]:
        return {
            "rate": " | ".join(filter(None, (f"{self._rate():.2f} it/s", throughput_text(trainer)))),
            "metrics": self._metrics_text(getattr(trainer, "progress_bar_metrics", {}) or {}),
            "memory": memory_text(trainer),
        }

    def _train_total(self, trainer: Any) -> tuple[float | None, int]:
        max_steps = getattr(trainer, "max_steps", -1)
        if max_steps is not None and max_steps > 0:
            return max_steps, trainer.global_step
        total = getattr(trainer, "num_training_batches", math.inf)
        return (None if total is None or total == math.inf else total), 0

    # ------------------------------------------------------------------- hooks
    def on_train_start(self, trainer: Any, module: Any) -> None:
        self._enabled = bool(getattr(trainer, "is_global_zero", True))
        if not self._enabled:
            return
        self._t0 = time.perf_counter()
        self._start_step = trainer.global_step
        self._batch_times.clear()
        self._every = self.print_every_n_steps or self._auto_every(trainer)
        if self.is_terminal:
            from rich.console import Console
            from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

            self._live = Progress(
                TextColumn("{task.description}"),
                BarColumn(),
                MofNCompleteColumn(),
                TimeElapsedColumn(),
                TextColumn("{task.fields[rate]}", markup=False),
                TextColumn("{task.fields[metrics]}", markup=False),
                TextColumn("{task.fields[memory]}", markup=False),
                console=Console(file=self.file),
                transient=not self.leave,
            )
            self._live.start()

    @staticmethod
    def _auto_every(trainer: Any) -> int:
        max_steps = getattr(trainer, "max_steps", -1)
        if max_steps is not None and max_steps > 0:
            return max(1, max_steps // 20)
        batches = getattr(trainer, "num_training_batches", math.inf)
        max_epochs = getattr(trainer, "max_epochs", None)
        accumulate = max(1, getattr(trainer, "accumulate_grad_batches", 1) or 1)
        if batches and batches != math.inf and max_epochs and max_epochs > 0:
            return max(1, int(batches * max_epochs / accumulate) // 20)
        return 50

    def on_train_epoch_start(self, trainer: Any, module: Any) -> None:
        # A resumed run starts mid-epoch: count from the batch it resumes at.
        self._batches_in_epoch = getattr(trainer, "batch_idx", 0) or 0
        if not self._enabled or self._live is None:
            return
        total, completed = self._train_total(trainer)
        if self._train_task is not None and not self.leave:
            self._live.remove_task(self._train_task)
        self._train_task = self._live.add_task(
            self._epoch_text(trainer), total=total, completed=completed, **self._train_fields(trainer)
        )

    def on_train_batch_end(self, trainer: Any, module: Any, outputs: Any, batch: Any, batch_idx: int) -> None:
        if not self._enabled:
            return
        self._batch_times.append(time.perf_counter())
        self._batches_seen += 1
        self._batches_in_epoch = batch_idx + 1
        if self._live is not None:
            if self._train_task is not None and self._batches_seen % self.refresh_rate == 0:
                max_steps = getattr(trainer, "max_steps", -1)
                completed = trainer.global_step if max_steps is not None and max_steps > 0 else batch_idx + 1
                self._live.update(self._train_task, completed=completed, **self._train_fields(trainer))
            return
        step = trainer.global_step
        if (
            getattr(trainer, "is_last_microbatch", True)
            and step != self._last_printed_step
            and step > 0
            and step % self._every == 0
        ):
            self._print_train_line(trainer)

    def _print_train_line(self, trainer: Any) -> None:
        self._last_printed_step = trainer.global_step
        fields = self._train_fields(trainer)
        self._line(
            trainer,
            self._epoch_text(trainer),
            self._step_text(trainer),
            fields["rate"],
            fields["metrics"],
            fields["memory"],
        )

    def on_train_epoch_end(self, trainer: Any, module: Any) -> None:
        if self._enabled and self._live is None and trainer.global_step != self._last_printed_step:
            self._print_train_line(trainer)

    def on_validation_start(self, trainer: Any, module: Any) -> None:
        if not self._enabled or self._live is None:
            return
        total = getattr(trainer, "num_val_batches", None)
        if isinstance(total, (list, tuple)):
            total = sum(total)
        total = None if total is None or total == math.inf else total
        self._val_task = self._live.add_task("validation", total=total, rate="", metrics="", memory="")

    def on_validation_batch_end(
        self, trainer: Any, module: Any, outputs: Any, batch: Any, batch_idx: int, *args: Any
    ) -> None:
        if self._enabled and self._live is not None and self._val_task is not None:
            self._live.advance(self._val_task)

    def on_validation_end(self, trainer: Any, module: Any) -> None:
        # Also reached from Trainer.validate(), without on_train_start.
        if not getattr(trainer, "is_global_zero", True):
            return
        if self._live is not None:
            if self._val_task is not None:
                self._live.remove_task(self._val_task)
                self._val_task = None
            return
        val = {k: v for k, v in (getattr(trainer, "callback_metrics", {}) or {}).items() if "val" in k}
        if val:
            self._line(
                trainer, "validation", self._epoch_text(trainer), f"step {trainer.global_step}", self._metrics_text(val)
            )

    def on_train_end(self, trainer: Any, module: Any) -> None:
        if not self._enabled:
            return
        self._stop()
        steps = trainer.global_step - self._start_step
        seconds = time.perf_counter() - self._t0
        done = f"done: {steps} steps in {seconds:.1f} s"
        self._line(trainer, done, throughput_text(trainer), memory_text(trainer, finished=True))

    def on_exception(self, trainer: Any, module: Any, exc: BaseException) -> None:
        self._stop()

    def teardown(self, trainer: Any, module: Any, stage: str | None = None) -> None:
        self._stop()

    def _stop(self) -> None:
        if self._live is not None:
            self._live.stop()
            self._live = None
            self._train_task = self._val_task = None

    def state_dict(self) -> dict:
        return {}

    def load_state_dict(self, state: dict) -> None:
        pass


class TQDMProgressBar(RichProgressBar):
    """Lightning's tqdm bar: the progress bar here is RichProgressBar, drawn every `refresh_rate` batches."""

    def __init__(self, refresh_rate: int = 1, process_position: int = 0, leave: bool = False) -> None:
        super().__init__(refresh_rate=refresh_rate, leave=leave)
        self.process_position = process_position

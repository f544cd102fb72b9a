# Profiles on demand, and what a CUDA out-of-memory error had in memory.
#
# ProfileSteps (Trainer(profile_steps=(start, end))) runs torch.profiler over optimizer steps start..end
# (numbered as trainer.global_step reads after each step, from 1) and writes one Chrome / Perfetto trace
# per rank, with operator shapes and memory, into <default_root_dir>/profiles/; on CUDA it also records
# the caching allocator's history over those steps and dumps a memory snapshot per rank (open it at
# https://pytorch.org/memory_viz). Global rank 0 says where they are, once. A run that ends before
# `end` writes what it recorded. The snapshot's allocations carry Python stacks; C++ frames too only
# on request (ProfileSteps(memory_stacks="all")): symbolising them can take minutes at the dump.
#
# OutOfMemoryReport (always on): when a step fails with torch.OutOfMemoryError, the rank that hit it
# prints, once, what it held (parameters, gradients and optimizer state on this rank, the allocator's
# counters on CUDA, a MemoryTracker's peak split when one ran) and what the memory planner would change,
# then the Trainer re-raises the error as it was.
from __future__ import annotations

import os
import sys
from typing import Any, Dict, Optional, Sequence

import torch

from shardwise import memory
from shardwise.sysmem import format_bytes

__all__ = ["OutOfMemoryReport", "ProfileSteps", "check_profile_steps"]


def check_profile_steps(value: Any) -> Optional[tuple]:
    """profile_steps=(start, end): optimizer steps 1 <= start <= end, both included; None for no profile."""
    if value is None:
        return None
    ok = (
        isinstance(value, Sequence)
        and not isinstance(value, str)
        and len(value) == 2
        and all(isinstance(v, int) and not isinstance(v, bool) for v in value)
        and 1 <= value[0] <= value[1]
    )
    if not ok:
        raise ValueError(
            f"profile_steps={value!r}: give (start, end), the first and last optimizer step to profile, "
            "1 <= start <= end (step N is the one after which trainer.global_step reads N), e.g. (5, 7)."
        )
    return int(value[0]), int(value[1])


MEMORY_STACKS = ("python", "all")


class ProfileSteps:
    """Profile optimizer steps `start`..`end` (both included) into `dirpath` (default <root>/profiles).

    memory_stacks: what each allocation of the CUDA memory snapshot records, "python" (the default)
    or "all" (C++ frames as well: slower to record, and minutes to dump on a large run).
    """

    def __init__(self, start: int, end: int, dirpath: Optional[str] = None, memory_stacks: str = "python") -> None:
        self.start, self.end = check_profile_steps((start, end))
        if memory_stacks not in MEMORY_STACKS:
            raise ValueError(
                f"ProfileSteps(memory_stacks={memory_stacks!r}): use 'python' (Python stacks, the default) or "
                "'all' (C++ frames too, slow to dump)."
            )
        self.memory_stacks = memory_stacks
        self.dirpath = dirpath
        self.files: Dict[str, str] = {}  # "trace" / "memory" -> this rank's file, once written
        self._profiler: Any = None
        self._span: Any = None
        self._cuda = False
        self._done = False

    def on_train_batch_start(self, trainer: Any, module: Any, batch: Any, batch_idx: int) -> None:
        step = trainer.global_step + 1  # the optimizer step this batch belongs to
        window_start = batch_idx % max(1, trainer.accumulate_grad_batches) == 0
        if self._profiler is None and not self._done and window_start and self.start <= step <= self.end:
            self._begin(trainer)
        if self._profiler is not None and window_start:
            # A span per optimizer step, named as torch.profiler's own step marks are (trace viewers group by it).
            self._span = torch.profiler.record_function(f"ProfilerStep#{step}")
            self._span.__enter__()

    def on_train_batch_end(self, trainer: Any, module: Any, outputs: Any, batch: Any, batch_idx: int) -> None:
        if self._profiler is None or not getattr(trainer, "is_last_microbatch", True):
            return
        self._end_span()
        if trainer.global_step >= self.end:
            self._finish(trainer)

    def on_train_end(self, trainer: Any, module: Any) -> None:
        if self._profiler is not None:
            self._finish(trainer)  # the run ended before `end`: what was recorded

    def on_exception(self, trainer: Any, module: Any, exc: BaseException) -> None:
        self._discard()

    def teardown(self, trainer: Any, module: Any, stage: Optional[str] = None) -> None:
        self._discard()

    def _folder(self, trainer: Any) -> str:
        return self.dirpath or os.path.join(trainer.default_root_dir, "profiles")

    def _begin(self, trainer: Any) -> None:
        from torch.profiler import ProfilerActivity, profile

        self._cuda = torch.device(trainer.strategy.root_device).type == "cuda"
        activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if self._cuda else [])
        self._profiler = profile(activities=activities, record_shapes=True, profile_memory=True)
        self._profiler.start()
        if self._cuda:
            torch.cuda.memory._record_memory_history(max_entries=200_000, stacks=self.memory_stacks)

    def _end_span(self) -> None:
        span, self._span = self._span, None
        if span is not None:
            span.__exit__(None, None, None)

    def _finish(self, trainer: Any) -> None:
        self._end_span()
        profiler, self._profiler, self._done = self._profiler, None, True
        profiler.stop()
        folder = self._folder(trainer)
        os.makedirs(folder, exist_ok=True)
        last = min(self.end, trainer.global_step)
        stem = f"rank{trainer.global_rank}_steps{self.start}-{last}"
        self.files["trace"] = os.path.join(folder, f"trace_{stem}.json")
        profiler.export_chrome_trace(self.files["trace"])
        if self._cuda:
            self.files["memory"] = os.path.join(folder, f"memory_{stem}.pickle")
            torch.cuda.memory._dump_snapshot(self.files["memory"])
            torch.cuda.memory._record_memory_history(enabled=None)
        if trainer.is_global_zero:
            snapshot = "; memory snapshots (memory_*.pickle): https://pytorch.org/memory_viz" if self._cuda else ""
            print(
                f"Profiled steps {self.start}-{last}: one trace per rank (trace_*.json, open in "
                f"https://ui.perfetto.dev or chrome://tracing) in {folder}{snapshot}",
                flush=True,
            )

    def _discard(self) -> None:
        self._end_span()
        profiler, self._profiler = self._profiler, None
        if profiler is not None:
            profiler.stop()
            if self._cuda:
                torch.cuda.memory._record_memory_history(enabled=None)


# ------------------------------------------------------------------------------ out of memory
def _local_bytes(tensor: Any) -> int:
    local = tensor.to_local() if hasattr(tensor, "to_local") else tensor
    return local.numel() * local.element_size() if isinstance(local, torch.Tensor) else 0


def held_bytes(module: Any, optimizers: Sequence[Any]) -> Dict[str, int]:
    """Bytes this rank holds in parameters, gradients and optimizer state (its shards, where sharded)."""
    params = list(module.parameters()) if module is not None else []
    out = {
        "parameters": sum(_local_bytes(p) for p in params),
        "gradients": sum(_local_bytes(p.grad) for p in params if p.grad is not None),
        "optimizer state": 0,
    }
    for optimizer in optimizers:
        for state in getattr(optimizer, "state", {}).values():
            values = state.values() if isinstance(state, dict) else ()
            out["optimizer state"] += sum(_local_bytes(v) for v in values if isinstance(v, torch.Tensor))
    return out


def memory_report(trainer: Any, exc: BaseException) -> str:
    """The text OutOfMemoryReport prints: what this rank held, then what to change."""
    strategy = trainer.strategy
    device = torch.device(strategy.root_device)
    states = held_bytes(trainer.module, list(strategy.optimizers or ()))
    where = f"step {trainer.global_step + 1}, batch_idx {trainer.batch_idx}"
    lines = [f"[rank {trainer.global_rank}] Out of memory during {where} on {device}. What this rank held:"]
    lines.append("  " + ", ".join(f"{name} {format_bytes(n)}" for name, n in states.items()))
    if device.type == "cuda":
        stats = torch.cuda.memory_stats(device)
        total = torch.cuda.get_device_properties(device).total_memory
        lines.append(
            f"  allocator: allocated {format_bytes(stats.get('allocated_bytes.all.current', 0))}, reserved "
            f"{format_bytes(stats.get('reserved_bytes.all.current', 0))}, peak allocated "
            f"{format_bytes(stats.get('allocated_bytes.all.peak', 0))} of {format_bytes(total)} on the device"
        )
        peak = int(stats.get("allocated_bytes.all.peak", 0))
    else:
        peak = 0
    tracker = memory.active_tracker() or memory.last_tracker()
    if tracker is not None:
        lines.append(f"  {tracker.summary()}")
        peak = max(peak, tracker.peak_bytes)
    held = sum(states.values())
    lines.append("The memory planner's advice:")
    if peak > 2 * held:  # what the step adds (activations, temporaries) outweighs what the model keeps
        lines.append(
            "  - the step's activations dominate: a smaller micro-batch with accumulate_grad_batches keeps the "
            "same optimizer step, and activation checkpointing of the repeated blocks "
            "(FSDPStrategy(activation_checkpointing_policy={Block}) or an '_ac' strategy name) trades compute "
            "for their memory"
        )
    if strategy.is_sharded:
        lines.append("  - the model states are sharded already: more devices, or CPU offload, lower them further")
    else:
        lines.append(
            "  - the model states are replicated on every device: strategy='fsdp' or 'deepspeed_stage_3' "
            "shards parameters, gradients and optimizer state across the devices"
        )
    lines.append(
        "  - Trainer(device_memory='auto') plans the run before it starts and picks a strategy and micro-batch "
        "that fit; `shardwise plan` compares every configuration"
    )
    return "\n".join(lines)


class OutOfMemoryReport:
    """On torch.OutOfMemoryError: print what this rank held and what to change, once; the error goes on."""

    def __init__(self) -> None:
        self.reported = False

    def on_exception(self, trainer: Any, module: Any, exc: BaseException) -> None:
        if self.reported or not isinstance(exc, torch.OutOfMemoryError):
            return
        self.reported = True
        try:
            text = memory_report(trainer, exc)
        except Exception as failure:  # the report must never hide the error it reports
            text = f"[rank {trainer.global_rank}] Out of memory; no breakdown ({type(failure).__name__}: {failure})"
        print(text, file=sys.stderr, flush=True)

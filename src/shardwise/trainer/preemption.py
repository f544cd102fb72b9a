"""Preemption in the loop: a stop signal becomes one decision every rank takes at the same step.

The signal handler (distributed/preempt.py) only sets a flag on the rank that
received it. Between optimizer steps the ranks agree whether any of them was
signalled -- in the step's health check all-reduce (under non_finite='off'
a vector of the vote alone, on the same schedule: nonfinite.StepCheck), else,
where no step was checked, in their own -- so they all finish the same step,
save it (ModelCheckpoint, in on_train_end) and leave with exit code 75.
"""

from __future__ import annotations

import signal
import threading
from typing import Any, Dict, List, Optional

from shardwise.distributed import preempt


class PreemptionWatch:
    """The run's preemption signals, turned into a flag the loop reads between optimizer steps."""

    def __init__(self, signals: List[int]) -> None:
        self.signals = signals
        self.flag: Optional[preempt.PreemptFlag] = None
        self.agreed: Optional[bool] = None  # set by this step's health check, which carries the vote
        self.preempted: Optional[str] = None  # the signal's name once the run stopped for it

    @property
    def signalled(self) -> bool:
        """Whether this rank received a signal (what it votes)."""
        return self.flag is not None and self.flag.requested

    def install(self) -> Dict[int, Any]:
        """Handle the signals; return the handlers they replace (fit() puts them back)."""
        if not self.signals or threading.current_thread() is not threading.main_thread():
            return {}
        previous = {sig: signal.getsignal(sig) for sig in self.signals}
        self.flag = preempt.install(self.signals)
        self.flag.signal = None  # a flag left from an earlier fit in this process
        self.flag.count = 0
        return previous

    def requested(self, strategy: Any) -> bool:
        """Whether any rank was signalled; all ranks agree, so they stop after the same step."""
        if self.flag is None:
            return False
        requested, self.agreed = self.agreed, None
        if requested is None:  # no health check this step (non_finite="off"): agree here
            requested = self.flag.requested
            if strategy.world_size > 1:
                requested = bool(strategy.reduce(float(requested), "max").item())
        if requested and self.preempted is None:
            self.preempted = self.flag.signal_name or "a preemption signal (on another rank)"
        return requested

    def exit_if_preempted(self, global_step: int, callbacks: List[Any]) -> None:
        """After a run stopped for a signal: say what was saved and exit with PREEMPTED_EXIT_CODE (75)."""
        if self.preempted is None:
            return
        saved = [getattr(cb, "last_model_path", "") for cb in callbacks if hasattr(cb, "last_model_path")]
        where = f"saved {saved[0]}" if saved and saved[0] else "no checkpoint (checkpointing is off)"
        preempt.exit_preempted(f"{self.preempted} after step {global_step}: {where}")

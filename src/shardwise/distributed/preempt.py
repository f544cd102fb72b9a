"""Preemption, worker side: turn a stop signal into a flag the loop checks.

Clusters announce preemption with a signal: SIGTERM (Kubernetes, `scancel`),
SIGINT (Ctrl-C), or SLURM's `--signal=USR1@120` some time before the kill.
Every shardwise launcher forwards these to each worker and waits
(SHARDWISE_PREEMPT_GRACE_S, default 120 s) instead of killing them. A worker
that installed `install()` keeps running: the loop finishes the current
step, saves a checkpoint, and calls `exit_preempted()`, which leaves with
PREEMPTED_EXIT_CODE (75, EX_TEMPFAIL). The launcher then exits with 75 too,
which tells a job script "saved, resubmit me". A SIGTERM that arrives after
another rank recorded a failure is the launcher tearing the job down, not a
preemption: the worker then dies by the signal at once.
"""

from __future__ import annotations

import os
import signal
import sys
from typing import Iterable, Optional

from shardwise.distributed import faults, progress
from shardwise.distributed.env import PREEMPTED_EXIT_CODE, global_rank

DEFAULT_SIGNALS = (signal.SIGTERM, signal.SIGINT, signal.SIGUSR1)


class PreemptFlag:
    """Set by the signal handler; read by the loop between steps."""

    def __init__(self) -> None:
        self.signal: Optional[int] = None
        self.count = 0

    @property
    def requested(self) -> bool:
        return self.signal is not None

    @property
    def signal_name(self) -> str:
        return signal.Signals(self.signal).name if self.signal is not None else ""

    def _handle(self, signum: int, _frame) -> None:
        if signum != signal.SIGUSR1 and _peer_failed():
            # Not a preemption: a rank failed and the launcher is stopping the
            # others. Saving now would wait on a dead peer; leave at once, by the signal.
            faults.die_by_signal(signum, _frame)
            return
        self.count += 1
        if self.count >= 3 and signum == signal.SIGINT:
            raise KeyboardInterrupt  # Ctrl-C three times: the user really wants out now
        if self.signal is None:
            self.signal = signum
            sys.stderr.write(
                f"[shardwise] rank {global_rank()} received "
                f"{signal.Signals(signum).name}: finishing this step, saving, then exiting "
                f"with {PREEMPTED_EXIT_CODE}.\n"
            )
            sys.stderr.flush()


_FLAG: Optional[PreemptFlag] = None


def _peer_failed() -> bool:
    """Whether another rank of this job has recorded a failure (faults.record_exception)."""
    directory = progress.run_dir()
    try:
        return bool(directory) and any(name.startswith("error.") for name in os.listdir(directory))
    except OSError:
        return False


def install(signals: Iterable[int] = DEFAULT_SIGNALS) -> PreemptFlag:
    """Handle `signals` by setting a flag (returned; the same one on every call). Main thread only."""
    global _FLAG
    if _FLAG is None:
        _FLAG = PreemptFlag()
    for sig in signals:
        signal.signal(sig, _FLAG._handle)
    return _FLAG


def flag() -> Optional[PreemptFlag]:
    """The installed flag, or None when install() was never called."""
    return _FLAG


def exit_preempted(message: str = "") -> None:
    """Leave with PREEMPTED_EXIT_CODE after the checkpoint is saved, telling the launcher why."""
    directory = progress.run_dir()
    if directory and os.path.isdir(directory):
        try:
            with open(os.path.join(directory, f"preempted.{global_rank()}"), "w") as fh:
                fh.write(message)
        except OSError:
            pass
    sys.stdout.flush()
    sys.stderr.flush()
    raise SystemExit(PREEMPTED_EXIT_CODE)

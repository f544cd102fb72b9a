"""The launcher's verdict on a failed multi-rank run, from what the workers left behind.

faults.py is the worker side (each rank's error record, its stacks on request); this is the launcher
side. When ranks fail, the root cause is the earliest failure that is not a consequence of another: a
peer's "Connection closed by peer" or a collective timeout comes after the failure that caused it, and
int-second timestamps (torch's) cannot order failures a millisecond apart. A rank killed by a signal is
named with the signal (SIGKILL: likely the kernel's OOM killer). A collective timeout names the rank
that stopped making progress, from the progress records (progress.py) and the ranks' flight records
(flight.py: the first collective they disagree on), and shows its stack.
"""

from __future__ import annotations

import json
import os
import re
import signal
from dataclasses import dataclass
from typing import Dict, List, Optional, Tuple

from shardwise.distributed import flight, progress
from shardwise.distributed.env import PREEMPTED_EXIT_CODE
from shardwise.distributed.faults import main_block, read_stack


@dataclass
class Outcome:
    """What the launcher knows about one rank when the run ends."""

    rank: int
    exitcode: Optional[int]  # None: still running when the launcher stopped it
    seen_at: float = 0.0  # when the launcher saw it exit
    stopped_by_launcher: bool = False
    record: Optional[Dict] = None  # error.<rank>.json
    stack: str = ""

    @property
    def time(self) -> float:
        if self.record:
            return float(self.record["shardwise"]["time"])
        return self.seen_at or float("inf")

    @property
    def kind(self) -> str:
        if self.record:
            return self.record["shardwise"]["kind"]
        if self.exitcode is None or self.stopped_by_launcher:
            return "stopped"
        if self.exitcode == PREEMPTED_EXIT_CODE:
            return "preempted"
        return "signal" if self.exitcode < 0 else "exit"


def read_records(directory: Optional[str]) -> Dict[int, Dict]:
    out: Dict[int, Dict] = {}
    if not directory or not os.path.isdir(directory):
        return out
    for name in os.listdir(directory):
        if name.startswith("error.") and name.endswith(".json"):
            try:
                with open(os.path.join(directory, name)) as fh:
                    data = json.load(fh)
                out[int(data["shardwise"]["rank"])] = data
            except (OSError, ValueError, KeyError):
                continue
    return out


def signal_name(signum: int) -> str:
    try:
        return signal.Signals(signum).name
    except ValueError:
        return f"signal {signum}"


def root_cause(outcomes: List[Outcome]) -> Optional[Outcome]:
    """The first failure that is not a consequence of another."""
    failed = [o for o in outcomes if o.kind not in ("stopped", "preempted") and (o.record or o.exitcode)]
    for kinds in (("primary", "signal", "exit"), ("timeout",), ("secondary",)):
        group = [o for o in failed if o.kind in kinds]
        if group:
            return min(group, key=lambda o: o.time)
    return None


def every_traceback(outcomes: List[Outcome]) -> str:
    """Each recorded rank's traceback, in the order they failed: kept in the agent log the verdict names,
    since the workers no longer print theirs and the verdict shows only the first (or none, when brief)."""
    recorded = sorted((o for o in outcomes if o.record), key=lambda o: o.time)
    return "".join(
        f"[shardwise] rank {o.rank}'s traceback ({o.record['shardwise']['summary'].splitlines()[0][:160]}):\n"
        f"{o.record['message']['extraInfo']['py_callstack'].rstrip()}\n"
        for o in recorded
    )


def collective_finding(outcomes: List[Outcome], run_dir: Optional[str]) -> Optional[flight.Finding]:
    """The first collective the ranks' flight records disagree on (flight.py), ranks that left none
    named by how they ended."""
    dumps = flight.read_dumps(run_dir)
    if not dumps:
        return None
    absent = {}
    for o in outcomes:
        if o.rank not in dumps and o.kind == "signal":
            absent[o.rank] = f"was killed by {signal_name(-o.exitcode)}"
        elif o.rank not in dumps and o.kind in ("exit", "primary"):
            absent[o.rank] = f"exited with code {o.exitcode}"
    errors = {o.rank: o.record["shardwise"]["summary"] for o in outcomes if o.record}
    sites = {}
    for o in outcomes:
        frames = _frames_of(o.rank, outcomes, run_dir)[1]
        if frames:
            sites[o.rank] = (frames[0][1], frames[0][2])
    return flight.describe(dumps, [o.rank for o in outcomes], absent, errors, sites)


def _frames_of(rank: int, outcomes: List[Outcome], run_dir: Optional[str]) -> Tuple[str, List[tuple]]:
    """(when, frames innermost first) of `rank`'s Python stack: as it died of a fatal signal, else where
    its exception was raised, else as a peer asked while it waited; frames empty when none was recorded."""
    found = re.findall(r'File "([^"]+)", line (\d+) in (\S+)', main_block(read_stack(run_dir, rank, crash=True)))
    when = "as it died (faulthandler)"
    record = next((o.record for o in outcomes if o.rank == rank and o.record), None)
    if not found and record is not None:
        tb = record["message"]["extraInfo"]["py_callstack"]
        found = list(reversed(re.findall(r'File "([^"]+)", line (\d+), in (\S+)', tb)))
        when = "where it failed"
    if not found:
        asked = {
            int(r): st for o in outcomes if o.record for r, st in (o.record["shardwise"].get("stacks") or {}).items()
        }
        asked.update({o.rank: o.stack for o in outcomes if o.stack})
        block = main_block(asked.get(rank) or read_stack(run_dir, rank))
        found = re.findall(r'File "([^"]+)", line (\d+) in (\S+)', block)
        when = "while the others waited"
    return when, flight.user_frames([(name, file, int(line)) for file, line, name in found])


def _stack_of(rank: int, outcomes: List[Outcome], run_dir: Optional[str], note: str = "") -> str:
    """`rank`'s Python stack for the verdict, a heading (`note` after it) then its frames; '' when none."""
    when, frames = _frames_of(rank, outcomes, run_dir)
    return f"{when}{note}:\n{flight.format_frames(frames, lines=8)}" if frames else ""


def diagnose(
    outcomes: List[Outcome],
    run_dir: Optional[str] = None,
    timeout_s: Optional[float] = None,
    with_traceback: bool = True,
) -> str:
    """The launcher's verdict, ready for stderr: the root cause first, then the collective the ranks
    disagree on (flight records), then the root cause's consequences."""
    root = root_cause(outcomes)
    others = len(outcomes) - 1
    if root is None:
        return ""
    finding = collective_finding(outcomes, run_dir)
    named = list(finding.named) if finding else []
    shown: set = set()  # ranks whose stack (or traceback) the verdict already shows
    if root.kind == "signal":
        sig = signal_name(-root.exitcode)
        if finding is not None and root.rank not in named and root.rank in finding.entries:
            # NCCL's watchdog aborts the rank whose collective timed out: it waited, it is not the cause.
            text = (
                f"[shardwise] rank {root.rank} was killed by {sig} while it waited in collective "
                f"#{finding.seq} of {flight.group_name(finding.group)} (a watchdog's abort after the "
                "collective timed out); the rank(s) out of step are named below."
            )
        else:
            text = (
                f"[shardwise] rank {root.rank} was killed by {sig} (exit code {root.exitcode}); it left no traceback."
            )
        if -root.exitcode == signal.SIGKILL:
            text += (
                " SIGKILL from nobody in this job usually means the kernel's out-of-memory killer: check "
                "`dmesg | grep -i -E 'killed process|out of memory'` (or the job's memory limit) and lower "
                "the memory per rank (batch size, activation checkpointing, sharding, CPU offload)."
            )
        elif -root.exitcode == signal.SIGSEGV:
            text += " A segmentation fault is a crash in native code (an extension, a driver)."
    elif root.kind == "exit":
        text = (
            f"[shardwise] rank {root.rank} exited with code {root.exitcode} and left no error record (it "
            "failed before its strategy set up the process group, called sys.exit, or crashed in native "
            "code); its own output is above."
        )
    elif root.kind == "timeout":
        waiting = sorted(o.rank for o in outcomes if o.kind == "timeout")
        timeout_s = timeout_s or root.record["shardwise"].get("timeout_s")
        records = progress.read_all(run_dir)
        stall = progress.describe_stall(waiting, records=records, timeout_s=timeout_s)
        summary = root.record["shardwise"]["summary"]
        text = f"[shardwise] rank {root.rank} exited with code {root.exitcode}: a collective timed out ({summary})."
        suspects = sorted((p for r, p in records.items() if r not in waiting), key=lambda p: (p.step, p.time))
        if stall and (finding is None or (suspects and suspects[0].rank in named)):
            text += f"\n[shardwise] {stall}."  # progress agrees with the flight records (or is all there is)
        if finding is None:
            for rank in [r for r in sorted(o.rank for o in outcomes) if r not in waiting][:2]:
                stack = _stack_of(rank, outcomes, run_dir)
                text += f"\n[shardwise] rank {rank}'s Python stack {stack}" if stack else ""
        if not stall and finding is None:
            text += (
                "\n[shardwise] No progress records to name the rank it waited for: a rank that stopped "
                "responding (or called a collective the others did not) is the usual cause."
            )
    else:
        rec = root.record["shardwise"]
        where = f" in {rec['hook']} after step {rec['step']}" if rec.get("hook") else ""
        if root.exitcode is not None and root.exitcode > 0:
            text = f"[shardwise] rank {root.rank} exited with code {root.exitcode}{where}: {rec['summary']}"
        else:
            # Recorded, then stopped by a signal while it was still on its way out (its clean-up outlasted
            # a peer's failure): its own exception is the story, the signal only how it ended.
            ended = f"; {signal_name(-root.exitcode)} stopped it during its clean-up" if root.exitcode else ""
            text = f"[shardwise] rank {root.rank} failed{where}: {rec['summary']}{ended}"
        if with_traceback and not rec.get("brief"):
            tb = root.record["message"]["extraInfo"]["py_callstack"].rstrip()
            text += f"\n[shardwise] rank {root.rank}'s traceback (the first failure):\n{tb}"
            shown.add(root.rank)
    if finding is not None:
        hooks = {r: f"in {p.hook} after step {p.step}" for r, p in progress.read_all(run_dir).items() if p.hook}
        stacks = {}
        for r in named:
            later = finding.last.get(r, finding.seq)
            # Its stack is from later on when it went past the collective (the dump keeps no stacks).
            note = f", at collective #{later} (it went on past #{finding.seq})" if later > finding.seq else ""
            stacks[r] = "is in its traceback above." if r in shown else _stack_of(r, outcomes, run_dir, note)
        text += "\n" + flight.report(finding, hooks, {r: st for r, st in stacks.items() if st})
    if root.kind == "signal" and root.rank not in named:
        stack = _stack_of(root.rank, outcomes, run_dir)
        text += f"\n[shardwise] rank {root.rank}'s Python stack {stack}" if stack else ""
    consequences = [
        o for o in outcomes if o is not root and o.kind in ("secondary", "timeout", "primary", "signal", "exit")
    ]
    if consequences:
        text += "\n[shardwise] after it: " + "; ".join(
            f"rank {o.rank}: "
            + (
                o.record["shardwise"]["summary"].splitlines()[0][:160]
                if o.record
                else (signal_name(-o.exitcode) if o.exitcode and o.exitcode < 0 else f"exit {o.exitcode}")
            )
            for o in sorted(consequences, key=lambda o: o.time)
        )
    stopped = [o.rank for o in outcomes if o.kind == "stopped"]
    if stopped:
        text += (
            f"\n[shardwise] stopped the other {len(stopped)} rank(s) ({', '.join(map(str, stopped))}) of {others + 1}."
        )
    return text + "\n"

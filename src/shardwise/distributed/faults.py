"""Why a multi-rank run died: each worker's own record, and the launcher's verdict.

Worker side (`install_worker`, called when a strategy joins the process
group, and by `shardwise.launch`'s worker entry): an uncaught exception is
written, with a sub-second timestamp, to `error.<rank>.json` in the run
directory and to TORCHELASTIC_ERROR_FILE when torch's elastic agent (torchrun,
`shardwise launch`) asked for one -- the same JSON torch's `@record` writes,
so the agent's "Root Cause" shows the traceback -- and a rank's Python stacks
can be dumped on request (faulthandler on SIGUSR2, into `stack.<rank>.txt`).
Under a shardwise launcher a worker prints nothing of its own failure once it
is recorded: an error raised on every rank would otherwise reach the user's
terminal once per rank and again in the verdict. Under torchrun (or with no
record written) it prints its traceback as before: nobody else will.
The Trainer notes where and when a rank failed as it fails (`note_failure`),
so that the record does not name the clean-up hooks (teardown) it ran after.

Launcher side (`diagnose`): when ranks fail, the root cause is the earliest
failure that is not a consequence of another: a peer's "Connection closed by
peer" or a collective timeout comes after the failure that caused it, and
int-second timestamps (torch's) cannot order failures a millisecond apart.
A rank killed by a signal is named with the signal (SIGKILL: likely the
kernel's OOM killer). A collective timeout names the rank that stopped making
progress, from the progress records (progress.py), and shows its stack.
"""

from __future__ import annotations

import datetime
import faulthandler
import json
import os
import re
import signal
import sys
import time
import traceback
import warnings
from dataclasses import dataclass
from typing import Dict, List, Optional, Tuple

import torch.distributed as dist
from torch.distributed import distributed_c10d

from shardwise.distributed import flight, progress
from shardwise.distributed.context import current as launch_context
from shardwise.distributed.env import PREEMPTED_EXIT_CODE, global_rank

STACK_SIGNAL = signal.SIGUSR2

# A peer's socket closing under us, or the backend giving up on a dead peer:
# these follow another rank's failure, they do not cause it.
_SECONDARY = re.compile(
    r"Connection closed by peer|Connection reset by peer|Broken pipe|ECONNRESET|EPIPE|Connection refused|"
    r"failed to (recv|send)|recvBytes|sendBytes|Socket closed|communicator was aborted|"
    r"ProcessGroup.*(aborted|shut ?down)|Read error|remote worker crashing",
    re.IGNORECASE,
)
_TIMEOUT = re.compile(
    r"Timed out waiting|timed out after|Watchdog caught collective operation timeout|"
    r"DistTimeoutError|collective operation timeout|Timed out",
    re.IGNORECASE,
)

_INSTALLED = False
_stack_file = None
_crash_file = None
# Where and when an exception was first caught, kept on the exception itself (see note_failure).
_FAILURE_ATTR = "_shardwise_failed_at"
_collective_timeout_s: Optional[float] = None
CHECK_COLLECTIVES_ENV = "SHARDWISE_CHECK_COLLECTIVES"


def classify(message: str) -> str:
    """'timeout', 'secondary' or 'primary' for an exception's text."""
    if _TIMEOUT.search(message):
        return "timeout"
    if _SECONDARY.search(message):
        return "secondary"
    return "primary"


def note_failure(exc: BaseException) -> None:
    """Remember this rank's hook, step and the time as `exc` is first caught (the Trainer calls it).

    Between that moment and the record, the rank runs its clean-up hooks
    (on_exception, teardown), which move its progress record, and a launcher
    may stop it only then: a ValueError from configure_model was reported as
    a failure "in teardown", timed by when the rank was stopped.
    """
    if getattr(exc, _FAILURE_ATTR, None) is not None:
        return  # caught again further out: the first catch is the closest to where it was raised
    where = progress.read_all().get(global_rank())
    noted = {"time": time.time(), "hook": where.hook if where else None, "step": where.step if where else None}
    try:  # on the exception, not in a global: a caught and retried failure must not keep its frames alive
        setattr(exc, _FAILURE_ATTR, noted)
    except (AttributeError, TypeError):  # an exception class with __slots__: the record says less
        pass


def record_exception(
    exc: BaseException, tb: Optional[str] = None, brief: bool = False, exitcode: Optional[int] = None
) -> Dict:
    """Write this rank's failure (torch's error-file JSON plus our fields); return the record.

    brief: the message is the whole story (the command line's one-line errors); the launcher's
    verdict then leaves the traceback in the record and the agent log. exitcode: the status this
    rank is about to exit with (the command line's 2 for a usage mistake), which the launcher exits
    with also when it stopped the rank (SIGTERM) during its clean-up, after a peer exited first.
    """
    tb = tb if tb is not None else "".join(traceback.format_exception(type(exc), exc, exc.__traceback__))
    noted = getattr(exc, _FAILURE_ATTR, None)
    now = noted["time"] if noted else time.time()
    summary = f"{type(exc).__name__}: {exc}"
    kind = classify(f"{summary}\n{tb}" if not isinstance(exc, (KeyboardInterrupt, SystemExit)) else summary)
    rank = global_rank()
    records = progress.read_all()
    where = records.get(rank)
    hook, step = (noted["hook"], noted["step"]) if noted else (where.hook, where.step) if where else (None, None)
    stall, stacks = None, {}
    directory = progress.run_dir()
    # This rank's flight records, which the launcher compares to name the collective the ranks
    # disagree on. After a timeout also every live peer's (its dump thread answers even inside a
    # collective): the rank it waited for fails no collective of its own and records nothing. Any
    # other failure does not wait: its peers record theirs as they fail, and a rank that lingers
    # here is stopped by the launcher as if it had failed second.
    flight.write_dump(directory, rank)
    peers = {r: p.pid for r, p in records.items() if r != rank and _alive(p.pid)} if kind == "timeout" else {}
    asked = flight.request_dumps(directory) if peers else 0.0
    if kind == "timeout":
        # Name the rank this one waited for while it is still alive, and ask the live ranks
        # (same node: their pids are in their records) for their Python stacks.
        stall = progress.describe_stall([rank], records=records, timeout_s=_collective_timeout_s, now=now)
        stacks = dump_stacks(peers, directory)
        if stall:  # also in torch's error file, so torchrun's "Root Cause" shows it
            tb += f"\n[shardwise] {stall}\n" + "".join(
                f"[shardwise] rank {r}'s Python stack:\n{_trim_stack(st)}\n" for r, st in stacks.items()
            )
    data = {
        "message": {"message": summary, "extraInfo": {"py_callstack": tb, "timestamp": str(int(now))}},
        "shardwise": {
            "rank": rank,
            "time": now,
            "kind": kind,
            "summary": summary,
            "timeout_s": _collective_timeout_s,
            "stall": stall,
            "stacks": stacks,
            "hook": hook,
            "step": step,
            "types": [cls.__name__ for cls in type(exc).__mro__],
            "brief": brief,
            "exitcode": exitcode,
        },
    }
    flight.wait_for_dumps(directory, peers, asked)
    targets = []
    if directory and os.path.isdir(directory):
        targets.append(os.path.join(directory, f"error.{rank}.json"))
    if os.environ.get("TORCHELASTIC_ERROR_FILE"):
        targets.append(os.environ["TORCHELASTIC_ERROR_FILE"])
    for path in targets:
        try:
            with open(path, "w") as fh:
                json.dump(data, fh)
        except OSError:
            pass
    return data


def shown_by_launcher() -> bool:
    """Whether a shardwise launcher started this rank and holds its error record: its verdict shows it."""
    directory = launch_context().run_dir
    return (
        launch_context().launched_by_shardwise
        and bool(directory)
        and os.path.exists(os.path.join(directory, f"error.{global_rank()}.json"))
    )


def print_worker_exception(exc: BaseException, text: Optional[str] = None) -> None:
    """A worker's dying words: none under a shardwise launcher that has its record (the verdict shows
    it, once for the run); else the whole traceback, unless it only lost a peer that failed first.

    A peer's closed connection is a consequence; its traceback printed in full
    before the launcher's verdict buried the first failure's own (a user saw
    only rank 1's "Connection closed by peer"). The record keeps it whole.
    """
    if shown_by_launcher():
        return
    text = text or "".join(traceback.format_exception(type(exc), exc, exc.__traceback__))
    if classify(f"{type(exc).__name__}: {exc}") == "secondary":
        first = (str(exc).strip().splitlines() or [type(exc).__name__])[0][:200]
        sys.stderr.write(
            f"[shardwise] rank {global_rank()} lost a peer ({first}); the launcher names the rank that failed first.\n"
        )
    else:
        sys.stderr.write(text)
    sys.stderr.flush()


def _excepthook(previous):
    def hook(exc_type, exc, tb):
        text = "".join(traceback.format_exception(exc_type, exc, tb))
        data = None
        try:
            data = record_exception(exc, text)
        except Exception:  # the diagnosis must never hide the original error
            pass
        if data is not None and shown_by_launcher():
            return  # the launcher's verdict shows it, stall included, once for the run
        if classify(f"{exc_type.__name__}: {exc}") == "secondary":
            print_worker_exception(exc, text)
        else:
            previous(exc_type, exc, tb)
        if data is not None and data["shardwise"].get("stall"):
            sys.stderr.write(
                f"[shardwise] rank {global_rank()}: a collective timed out: {data['shardwise']['stall']}\n"
            )

    return hook


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
        return pid != os.getpid()
    except (ProcessLookupError, PermissionError):
        return False


def die_by_signal(signum: int, _frame: object = None) -> None:
    """Die by `signum` as if unhandled -- but first record the exception this rank is unwinding, if any.

    A launcher stops the surviving ranks with SIGTERM once one failed. A rank
    that is itself failing but still in clean-up (finally blocks, context
    managers that close the process group) would otherwise vanish without
    its traceback, though it may be the root cause.
    """
    unwinding = sys.exc_info()[1]
    if unwinding is not None:
        try:
            record_exception(unwinding)
        except Exception:
            pass
    signal.signal(signum, signal.SIG_DFL)
    os.kill(os.getpid(), signum)


def install_worker(collective_timeout_s: Optional[float] = None) -> None:
    """Record this rank's uncaught exception and allow stack dumps; idempotent, cheap."""
    global _INSTALLED, _stack_file, _crash_file, _collective_timeout_s
    if collective_timeout_s is not None:
        _collective_timeout_s = collective_timeout_s
    if _INSTALLED:
        return
    _INSTALLED = True
    sys.excepthook = _excepthook(sys.excepthook)
    try:
        if signal.getsignal(signal.SIGTERM) == signal.SIG_DFL:  # the Trainer's preemption handler may replace it
            signal.signal(signal.SIGTERM, die_by_signal)
    except ValueError:  # not the main thread
        pass
    progress.mark("start-up", 0)
    directory = progress.run_dir()
    flight.apply_recorder_env(directory)  # before the process group exists: torch reads it then
    if directory and os.path.isdir(directory) and hasattr(faulthandler, "register"):
        try:
            _stack_file = open(os.path.join(directory, f"stack.{global_rank()}.txt"), "w")
            faulthandler.register(STACK_SIGNAL, file=_stack_file, all_threads=True, chain=False)
            # A rank aborted in native code (NCCL's watchdog, gloo's size check: SIGABRT) leaves its
            # Python stack here; the process still dies of the signal.
            # (torch's elastic worker enabled it for stderr: the verdict shows this file instead.)
            _crash_file = open(os.path.join(directory, f"crash.{global_rank()}.txt"), "w")
            faulthandler.enable(file=_crash_file, all_threads=True)
        except (OSError, ValueError, RuntimeError):
            pass
        flight.start_dump_thread(directory, global_rank())


def apply_collective_timeout(timeout_s: float) -> None:
    """Make `timeout_s` the timeout of every process group created from now on, not only the world's.

    `dist.new_group()` without a timeout takes torch's module default (30
    minutes for gloo, 10 for NCCL), not the world group's: DeepSpeed's ZeRO
    groups, FSDP's hybrid-shard mesh and any group a user creates would hang
    for that long on a rank that stopped responding (measured: a ZeRO-2 run
    with timeout_s=10 was still blocked after 280 s). torch reads these
    module globals each time it creates a group.
    """
    value = datetime.timedelta(seconds=timeout_s)
    distributed_c10d.default_pg_timeout = value
    if hasattr(distributed_c10d, "default_pg_nccl_timeout"):
        distributed_c10d.default_pg_nccl_timeout = value


def maybe_check_collectives(strategy_name: str = "") -> bool:
    """SHARDWISE_CHECK_COLLECTIVES=1: have torch check that every rank calls the same collective.

    torch's DETAIL debug level wraps each process group so that, before every
    collective, the ranks compare its kind and tensor shapes (over a second
    gloo group) and fail naming the mismatch instead of hanging or reducing
    the wrong tensors. It costs an extra small collective per collective (below
    the noise on a CPU machine, not measured on GPUs), so it is a debugging switch.
    Must run before the process group is created. True if enabled.
    Not under DDP: on torch 2.13 (CPU, gloo) building DistributedDataParallel
    at the DETAIL level crashes the process (SIGSEGV, measured).
    """
    if os.environ.get(CHECK_COLLECTIVES_ENV, "0") in ("", "0"):
        return False
    if strategy_name == "ddp":
        warnings.warn(
            f"{CHECK_COLLECTIVES_ENV}=1 is ignored under DDP: torch's collective checks "
            "(TORCH_DISTRIBUTED_DEBUG=DETAIL) crash DistributedDataParallel on torch 2.13. "
            "Use strategy='fsdp' (or DeepSpeed) to check a mismatched collective.",
            stacklevel=2,
        )
        return False
    os.environ["TORCH_DISTRIBUTED_DEBUG"] = "DETAIL"
    dist.set_debug_level_from_env()
    return True


# ----------------------------------------------------------------- launcher side
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


def _size(path: str) -> int:
    try:
        return os.path.getsize(path)
    except OSError:
        return -1


def dump_stacks(pids: Dict[int, int], directory: Optional[str], wait_s: float = 1.0) -> Dict[int, str]:
    """Ask ranks (rank -> pid) for their Python stacks (SIGUSR2 -> faulthandler); return what they wrote.

    Waits until each stack file has grown (faulthandler writes from the signal handler, at once), at
    most `wait_s`: a fixed wait cost every failure a second."""
    if not directory or not pids:
        return {}
    paths = {rank: os.path.join(directory, f"stack.{rank}.txt") for rank in pids}
    before = {rank: _size(path) for rank, path in paths.items()}
    for pid in pids.values():
        try:
            os.kill(pid, STACK_SIGNAL)
        except (ProcessLookupError, PermissionError):
            pass
    deadline = time.monotonic() + wait_s
    while time.monotonic() < deadline and any(_size(p) <= before[r] for r, p in paths.items()):
        time.sleep(0.02)
    time.sleep(0.02)  # the rest of a dump still being written
    return {r: s for r, s in ((r, read_stack(directory, r)) for r in pids) if s}


def read_stack(directory: Optional[str], rank: int, crash: bool = False) -> str:
    """The Python stacks `rank` wrote: on request (SIGUSR2), or as it died of a fatal signal (`crash`)."""
    if not directory:
        return ""
    try:
        with open(os.path.join(directory, f"{'crash' if crash else 'stack'}.{rank}.txt")) as fh:
            text = fh.read().strip()
    except OSError:
        return ""
    return text  # one dump per request, appended: any of them shows where the rank was stuck


def root_cause(outcomes: List[Outcome]) -> Optional[Outcome]:
    """The first failure that is not a consequence of another."""
    failed = [o for o in outcomes if o.kind not in ("stopped", "preempted") and (o.record or o.exitcode)]
    for kinds in (("primary", "signal", "exit"), ("timeout",), ("secondary",)):
        group = [o for o in failed if o.kind in kinds]
        if group:
            return min(group, key=lambda o: o.time)
    return None


def _trim_stack(stack: str, lines: int = 14) -> str:
    return "\n".join("    " + line for line in _main_block(stack).splitlines()[:lines])


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


def _main_block(stack: str) -> str:
    # faulthandler lists the threads newest first, innermost frame first; keep the main thread's: the
    # first running Python that a thread did not start (torch 2.11's CUDA build adds a thread with a
    # Python state but no frame; shardwise's own dump and launcher-watch threads run Python).
    blocks = [b.strip("\n") for b in stack.split("\n\n") if "thread 0x" in b.strip().split("\n")[0].lower()]
    python = [b for b in blocks if "<no Python frame>" not in b] or blocks or [""]
    return next((b for b in python if "in _bootstrap" not in (b.splitlines() or [""])[-1]), python[0])


def _frames_of(rank: int, outcomes: List[Outcome], run_dir: Optional[str]) -> Tuple[str, List[tuple]]:
    """(when, frames innermost first) of `rank`'s Python stack: as it died of a fatal signal, else where
    its exception was raised, else as a peer asked while it waited; frames empty when none was recorded."""
    found = re.findall(r'File "([^"]+)", line (\d+) in (\S+)', _main_block(read_stack(run_dir, rank, crash=True)))
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
        block = _main_block(asked.get(rank) or read_stack(run_dir, rank))
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

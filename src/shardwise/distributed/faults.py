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

The launcher side, the verdict built from these records and stacks, is verdict.py.
"""

from __future__ import annotations

import datetime
import faulthandler
import json
import os
import re
import signal
import sys
import threading
import time
import traceback
import warnings
from typing import Dict, Optional

import torch.distributed as dist
from torch.distributed import distributed_c10d

from shardwise.distributed import flight, progress
from shardwise.distributed.context import current as launch_context
from shardwise.distributed.env import global_rank

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
                f"[shardwise] rank {r}'s Python stack:\n{trim_stack(st)}\n" for r, st in stacks.items()
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
        start_stall_check(directory, global_rank(), int(os.environ.get("WORLD_SIZE", "1")))


# ----------------------------------------------------------------- the stall check (worker side)
STALL_ENV = "SHARDWISE_STALL_CHECK_S"
DEFAULT_STALL_S = 20.0


class CollectiveMismatchError(RuntimeError):
    """The ranks ran different collectives and wait for each other: one was reached by only some ranks."""


class DisconnectedGroupError(RuntimeError):
    """Every rank waits in the same barrier of a group that does not connect them."""


def stall_seconds(environ=os.environ) -> float:
    """How long every rank must stand still before the stall check compares their collectives (0: never)."""
    raw = environ.get(STALL_ENV, "")
    try:
        value = float(raw) if raw else DEFAULT_STALL_S
    except ValueError:
        raise ValueError(f"{STALL_ENV}={raw!r}: use a number of seconds (0 turns the stall check off)") from None
    return max(value, 0.0)


def start_stall_check(directory: Optional[str], rank: int, world: int) -> None:
    """Rank 0's daemon thread: when no rank of this node has moved for `stall_seconds()`, compare their
    flight records; if they ran different collectives, fail now naming where, instead of after the
    collective timeout (30 minutes by default). Costs a file read a second; the comparison runs only
    while every rank stands still, and a slow step (the ranks agree) only delays the next look."""
    stall_s = stall_seconds()
    if rank != 0 or world < 2 or not stall_s or not directory:
        return

    def watch() -> None:
        looked = 0.0
        while True:
            time.sleep(1.0)
            now = time.time()
            records = progress.read_all(directory)
            if len(records) < world or any(p.age(now) < stall_s for p in records.values()):
                continue  # someone is still moving (or on another node): nothing to compare yet
            if now - looked < stall_s:
                continue
            looked = now
            try:
                error = _mismatch(directory, rank, world, stall_s)
            except Exception:  # a diagnostic: never the reason a run fails
                continue
            if error is not None:
                record_exception(error)
                os._exit(1)

    threading.Thread(target=watch, name="shardwise-stall-check", daemon=True).start()


def _mismatch(directory: str, rank: int, world: int, stall_s: float) -> Optional[RuntimeError]:
    peers = [r for r in range(world) if r != rank]
    asked = flight.request_dumps(directory)
    flight.write_dump(directory, rank)
    flight.wait_for_dumps(directory, peers, asked, timeout_s=5.0)
    dumps = flight.read_dumps(directory)
    finding = flight.describe(dumps, range(world))
    if finding is None or len({e.signature for e in finding.entries.values()}) < 2:
        apart = flight.two_groups_in_one(dumps, range(world))
        if apart is not None:
            return DisconnectedGroupError(
                f"The ranks' process groups do not connect them to each other: {apart}. Seen when the "
                "default group is created again in the same processes with dist.init_process_group after "
                "destroy_process_group: torch names it as it named the first, on the launcher's store, and "
                "a rank reads the first group's peer addresses. Let the Trainer create and destroy the "
                "group, or give each init_process_group a store of its own (torch.distributed.PrefixStore "
                f"with a new prefix each time). (No rank moved for {stall_s:.0f} s; {STALL_ENV} sets how "
                "long, 0 turns this check off.)"
            )
        return None  # the ranks agree so far: a slow step, not a wrong one
    # They disagree: look again with each collective's Python stack (slower), to say where it began.
    asked = flight.request_dumps(directory, stacks=True)
    flight.write_dump(directory, rank, stacks=True)
    flight.wait_for_dumps(directory, peers, asked, timeout_s=45.0)  # symbolising takes 5-6 s a rank, more under load
    where = flight.first_divergence(flight.read_dumps(directory))
    if where is None:  # stacks not back in time (seen on a loaded 2-core machine): what differs, without where
        where = f"{finding.text} (where it began is not known: the ranks' Python stacks were not read in time)"
    return CollectiveMismatchError(
        f"The ranks ran different collectives and are waiting for each other: {where}. A collective that "
        "only some ranks reach (a forward of a sharded model, a sync_dist log, a barrier or all_gather "
        "under `if trainer.is_global_zero:` / `global_rank == 0`) waits for ranks that never come. Run it "
        "on every rank (use its result on one). (No rank moved for "
        f"{stall_s:.0f} s; {STALL_ENV} sets how long, 0 turns this check off.)"
    )


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


# ----------------------------------------------------------------- stacks (both sides)
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


def trim_stack(stack: str, lines: int = 14) -> str:
    return "\n".join("    " + line for line in main_block(stack).splitlines()[:lines])


def main_block(stack: str) -> str:
    # faulthandler lists the threads newest first, innermost frame first; keep the main thread's: the
    # first running Python that a thread did not start (torch 2.11's CUDA build adds a thread with a
    # Python state but no frame; shardwise's own dump and launcher-watch threads run Python).
    blocks = [b.strip("\n") for b in stack.split("\n\n") if "thread 0x" in b.strip().split("\n")[0].lower()]
    python = [b for b in blocks if "<no Python frame>" not in b] or blocks or [""]
    return next((b for b in python if "in _bootstrap" not in (b.splitlines() or [""])[-1]), python[0])

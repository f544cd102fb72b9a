"""Run this node's workers under torch's elastic agent and say why they failed.

Every shardwise launcher comes here: `shardwise launch` (one per node), the
Trainer's `python train.py` with devices=N, and `shardwise.launch(fn)`
(launch.py). torch's `elastic_launch` starts the workers, gives them
RANK / LOCAL_RANK / WORLD_SIZE / MASTER_ADDR, and stops them all when one
fails. shardwise adds three things around it: a run directory where each
worker keeps its progress and error records (progress.py, faults.py), so the
verdict names the first failing rank with its own traceback instead of
torch's second-resolution guess; preemption (SIGTERM / SIGINT / SIGUSR1
forwarded to every worker, which get SHARDWISE_PREEMPT_GRACE_S to save and
exit 75, as the launcher then does); and workers that die with a SIGKILLed
launcher. What the workers need to know from the launching process (that
directory, the grace period, the seed, the planner's choice) reaches them as
one LaunchContext (context.py), exported here.
"""

from __future__ import annotations

import contextlib
import ctypes
import logging
import multiprocessing
import os
import shutil
import signal
import sys
import tempfile
import threading
from dataclasses import dataclass
from typing import Any, Callable, Dict, Iterator, List, Optional, Sequence, Tuple, Union

from torch.distributed.elastic.multiprocessing import DefaultLogsSpecs, Std
from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
from torch.distributed.launcher.api import LaunchConfig, elastic_launch

from shardwise.distributed import context as launch_context
from shardwise.distributed import faults, flight, forkserver, progress, verdict
from shardwise.distributed.context import LaunchContext
from shardwise.distributed.env import PREEMPT_GRACE_ENV, PREEMPTED_EXIT_CODE, preempt_grace_s

_PR_SET_PDEATHSIG = 1
# What torch logs while it starts and stops the workers goes to this file of the run directory.
AGENT_LOG = "agent.log"
_TORCH_LOGGERS = ("torch.distributed.elastic", "torch.distributed.launcher", "torch.multiprocessing")
# torch's agent handles these itself (it stops the workers); the preemption signals are ours.
_AGENT_SIGNALS = ("SIGHUP", "SIGQUIT")

# A command worker is started through this prelude, which asks the kernel to SIGKILL it when
# the launcher dies and then becomes the command (exec keeps the pid torch's agent watches).
# torch's agent has no pre-exec hook and leaves its workers running when it is SIGKILLed (a
# node's OOM killer, a scheduler's kill): they would wait in a collective until the timeout.
_DIE_WITH_LAUNCHER = (
    "import ctypes, os, signal, sys\n"
    "if sys.platform.startswith('linux'):\n"
    f"    ctypes.CDLL(None).prctl({_PR_SET_PDEATHSIG}, signal.SIGKILL)\n"
    "    if os.getppid() != int(sys.argv[1]): os._exit(1)\n"
    "os.execv(sys.argv[2], sys.argv[2:])\n"
)


def die_with_launcher(launcher_pid: int) -> None:
    """In a function worker (no exec prelude): the same request, for the same reason. A worker forked from
    the fork server is not the launcher's child (and keeps the server alive itself): it watches the launcher
    instead (forkserver.watch_launcher)."""
    if not sys.platform.startswith("linux"):
        return
    if os.getppid() != launcher_pid:
        forkserver.watch_launcher(launcher_pid)
        return
    ctypes.CDLL(None).prctl(_PR_SET_PDEATHSIG, signal.SIGKILL)
    if os.getppid() != launcher_pid:  # the launcher died before the request was made
        os._exit(1)


@dataclass
class Result:
    """How a launch ended. `exitcode`: 0; 75 (preempted); 128+signal (killed after the grace period);
    else the root cause's (1 for an exception). `message`: for stderr, '' on success; with
    `verdict`, the root cause (verdict.diagnose). `signalled`: a preemption signal was forwarded.
    `summary`: the verdict without the traceback; `error_types`: the root cause's exception class and
    its bases by name (empty without a record), for a caller that shows some errors in one line."""

    exitcode: int
    message: str = ""
    rank: Optional[int] = None
    return_values: Optional[Dict[int, Any]] = None
    verdict: bool = False
    signalled: bool = False
    summary: str = ""
    error_types: Tuple[str, ...] = ()


def run(
    entrypoint: Union[str, Callable],
    args: Sequence[Any],
    nproc: int,
    *,
    nnodes: int = 1,
    node_rank: int = 0,
    addr: str = "127.0.0.1",
    port: int,
    rdzv_backend: str = "static",
    run_id: str = "shardwise",
    max_restarts: int = 0,
    log_dir: Optional[str] = None,
    who: str = "[shardwise]",
    context: Optional[LaunchContext] = None,
) -> Result:
    """Run `entrypoint(*args)` -- a command, or a function importable by reference -- on this node's
    `nproc` workers, torchrun's "static" rendezvous (fixed node ranks) unless told otherwise.

    The workers get `context` (default: this process's, context.current()) with this launch's run
    directory, grace period and launched_by_shardwise filled in."""
    context = context if context is not None else launch_context.current()
    grace = context.preempt_grace_s if context.preempt_grace_s is not None else preempt_grace_s()
    if isinstance(entrypoint, str):
        pids = _new_sessions()
        entrypoint, args = sys.executable, ["-S", "-c", _DIE_WITH_LAUNCHER, str(os.getpid()), entrypoint, *args]
        start_method = "spawn"  # not used: a command runs as a subprocess
    else:
        pids = _new_spawned()
        start_method = forkserver.start_method()  # function workers: forked from a warm server on Linux
    run_dir = tempfile.mkdtemp(prefix="shardwise-run-")
    # Without a log_dir the agent's own files (error files) go in the run directory, not a new /tmp folder.
    logs_specs = DefaultLogsSpecs(
        log_dir=log_dir or os.path.join(run_dir, "agent"),
        **(dict(redirects=Std.ALL, tee=Std.ALL) if log_dir else {}),
    )
    config = LaunchConfig(
        min_nodes=nnodes,
        max_nodes=nnodes,
        nproc_per_node=nproc,
        rdzv_backend=rdzv_backend,
        rdzv_endpoint=f"{addr}:{port}",
        rdzv_configs={"rank": node_rank} if rdzv_backend == "static" else {},
        run_id=run_id,
        max_restarts=max_restarts,
        monitor_interval=0.1,
        logs_specs=logs_specs,
        start_method=start_method,
        local_addr=addr if nnodes == 1 else None,
        signals_to_handle=",".join(_AGENT_SIGNALS),
    )
    ranks = range(node_rank * nproc, (node_rank + 1) * nproc)
    agent_log = os.path.join(run_dir, AGENT_LOG)
    kept = False
    try:
        with _workers_see(context.replace(preempt_grace_s=grace, run_dir=run_dir)), _torch_logs_to(agent_log):
            with _Forwarder(pids, who, grace) as forwarder, _WatchdogDumps(run_dir):
                try:
                    # A forked worker gets this process's environment as it is now, in the block (forkserver.py).
                    target, target_args = forkserver.wrap(entrypoint, args, start_method)
                    result = Result(0, return_values=elastic_launch(config, target)(*target_args))
                except ChildFailedError as exc:
                    result = _verdict(exc, ranks, run_dir, forwarder, who)
        result.signalled = forwarder.received is not None
        if result.exitcode not in (0, PREEMPTED_EXIT_CODE) and os.path.exists(agent_log):
            kept = True  # the run directory with it: the verdict names the file
            where = f"\n{who} torch's elastic agent logged to {agent_log}"
            result.message = result.message.rstrip("\n") + where
            result.summary = result.summary and result.summary.rstrip("\n") + where
    except BaseException as exc:
        if os.path.exists(agent_log) and hasattr(exc, "add_note"):
            kept = True
            exc.add_note(f"{who} torch's elastic agent logged to {agent_log}")
        raise
    finally:
        if not kept:
            shutil.rmtree(run_dir, ignore_errors=True)
    return result


@contextlib.contextmanager
def _workers_see(context: LaunchContext) -> Iterator[None]:
    """`context` exported for the workers started inside the block (restored after)."""
    # torch's agent sets this for its workers and leaves it in our environment.
    signals_before = os.environ.get("TORCHELASTIC_SIGNALS_TO_HANDLE")
    try:
        with launch_context.exported(context.replace(launched_by_shardwise=True)):
            yield
    finally:
        if signals_before is None:
            os.environ.pop("TORCHELASTIC_SIGNALS_TO_HANDLE", None)
        else:
            os.environ["TORCHELASTIC_SIGNALS_TO_HANDLE"] = signals_before


@contextlib.contextmanager
def _torch_logs_to(path: str) -> Iterator[None]:
    """torch's agent and process-starting loggers write to `path` (created on their first record) inside the block.

    torch logs each failure it handles as multi-line records on stderr ("E1124 ... failed (exitcode: 1)",
    a ProcessExitedException traceback, "Sending process ... closing signal"), interleaved with the
    workers' output, while the verdict already says the same in one line per failure. The records
    stay, in the run directory, which the verdict then names.
    """
    handler = logging.FileHandler(path, delay=True)
    handler.setFormatter(logging.Formatter("%(asctime)s %(levelname)s %(process)d %(name)s: %(message)s"))
    loggers = [logging.getLogger(name) for name in _TORCH_LOGGERS]
    before = [logger.propagate for logger in loggers]
    for logger in loggers:
        logger.addHandler(handler)
        logger.propagate = False  # not up to torch's stderr handler
    try:
        yield
    finally:
        for logger, propagate in zip(loggers, before):
            logger.removeHandler(handler)
            logger.propagate = propagate
        handler.close()


def _verdict(exc: ChildFailedError, ranks: Sequence[int], run_dir: str, forwarder: "_Forwarder", who: str) -> Result:
    """The root cause from the workers' own records, and the exit code that goes with it."""
    codes = {rank: failure.exitcode for rank, failure in exc.failures.items()}
    if forwarder.killed:
        return Result(
            128 + forwarder.received,
            message=(
                f"{who} worker(s) did not exit within the {forwarder.grace_s:.0f} s grace period after "
                f"{verdict.signal_name(forwarder.received)}; killed them (raise {PREEMPT_GRACE_ENV} if saving takes "
                "longer)."
            ),
        )
    # Preempted: a worker saved and left with 75; the agent then stops any peer still on its way out.
    stopping = (PREEMPTED_EXIT_CODE, -signal.SIGTERM, -signal.SIGKILL)
    if PREEMPTED_EXIT_CODE in codes.values() and all(code in stopping for code in codes.values()):
        return Result(
            PREEMPTED_EXIT_CODE,
            message=(
                f"{who} the workers saved and exited with {PREEMPTED_EXIT_CODE} (preempted): resubmit the job "
                "to resume."
            ),
        )
    records = verdict.read_records(run_dir)
    # Once one worker failed, the agent stops the others: SIGTERM, and SIGKILL 30 s later. Such a
    # rank without a record is a consequence -- unless every failure is of that kind (a user's
    # `kill`), or, for SIGKILL, no recorded failure caused it (then it is likely the OOM killer).
    caused = any(r["shardwise"]["kind"] in ("primary", "timeout") for r in records.values())
    other = any(code != -signal.SIGTERM or rank in records for rank, code in codes.items())
    outcomes = []
    for rank in ranks:
        record = records.get(rank)
        if rank in codes:
            code = codes[rank]
            stopped = (
                record is None
                and forwarder.received is None
                and ((code == -signal.SIGTERM and other) or (code == -signal.SIGKILL and caused))
            )
            outcomes.append(
                verdict.Outcome(
                    rank=rank,
                    exitcode=code,
                    seen_at=float(exc.failures[rank].timestamp),
                    stopped_by_launcher=stopped,
                    record=record,
                )
            )
        else:
            # torch reports only the first failed function worker; the others were stopped (SIGTERM).
            outcomes.append(
                verdict.Outcome(
                    rank=rank,
                    exitcode=-signal.SIGTERM if record else None,
                    record=record,
                    stopped_by_launcher=record is None,
                )
            )
    root = verdict.root_cause(outcomes)
    message = verdict.diagnose(outcomes, run_dir).rstrip()
    summary = verdict.diagnose(outcomes, run_dir, with_traceback=False).rstrip()
    if not message:  # no rank left a record or a code we can read: torch's own summary
        message = summary = exc.format_msg()
    tracebacks = verdict.every_traceback(outcomes)
    if tracebacks:  # the workers printed none of them: the verdict names this file
        try:
            with open(os.path.join(run_dir, AGENT_LOG), "a") as fh:
                fh.write(tracebacks)
        except OSError:
            pass
    meant = root.record["shardwise"].get("exitcode") if root is not None and root.record is not None else None
    if root is not None and root.record is not None and root.exitcode is not None and root.exitcode > 0:
        exitcode = root.exitcode  # its own exit status (the command line's 2 for a usage mistake)
    elif meant:
        # Recorded, then stopped (SIGTERM) in its clean-up because a peer exited first, as on a busy
        # machine: the status it was exiting with, not one that depends on which rank left first.
        exitcode = int(meant)
    elif root is None or not root.exitcode or root.record is not None:
        exitcode = 1  # an uncaught exception, even if the agent stopped the rank while it unwound
    else:
        exitcode = root.exitcode if root.exitcode > 0 else 128 - root.exitcode
    return Result(
        exitcode,
        message=message,
        rank=root.rank if root is not None else None,
        verdict=True,
        summary=summary,
        error_types=tuple(root.record["shardwise"].get("types") or ()) if root and root.record else (),
    )


def _new_spawned() -> Callable[[], List[int]]:
    """A function listing the multiprocessing children started from now on: the agent's function workers."""
    before = {p.pid for p in multiprocessing.active_children()}
    return lambda: [p.pid for p in multiprocessing.active_children() if p.pid not in before]


def _new_sessions() -> Callable[[], List[int]]:
    """A function listing the session-leading children started from now on: the agent's command workers."""
    me = str(os.getpid())

    def children() -> set:
        pids = set()
        for name in os.listdir("/proc") if os.path.isdir("/proc") else ():
            try:
                with open(f"/proc/{name}/stat") as fh:
                    _, ppid, _, session = fh.read().rsplit(")", 1)[1].split()[:4]
            except (OSError, IndexError, ValueError):
                continue
            if ppid == me and session == name:
                pids.add(int(name))
        return pids

    before = children()
    return lambda: sorted(children() - before)


class _WatchdogDumps:
    """When NCCL's watchdog writes its flight-recorder dumps into the run directory (a collective timed
    out; it aborts that rank next, SIGABRT, with no Python exception and so no record), ask every
    worker for its flight records, then for its Python stack (faulthandler), while the rank that
    stopped responding is still alive: the verdict names it with them. A thread polling the directory."""

    POLL_S = 0.2
    # Long enough for a dump thread on a busy machine; a rank that cannot answer (its GIL held) costs this.
    RECORDS_WAIT_S = 2.0

    def __init__(self, run_dir: str) -> None:
        self.run_dir = run_dir
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._watch, name="shardwise-watchdog-dumps", daemon=True)

    def __enter__(self) -> "_WatchdogDumps":
        self._thread.start()
        return self

    def __exit__(self, *exc: Any) -> None:
        self._stop.set()
        self._thread.join(timeout=1.0)

    def _watch(self) -> None:
        while not self._stop.wait(self.POLL_S):
            try:
                names = os.listdir(self.run_dir)
            except OSError:
                return
            if any(name.startswith(flight.NCCL_DUMP_PREFIX) for name in names):
                asked = flight.request_dumps(self.run_dir)
                pids = {r: p.pid for r, p in progress.read_all(self.run_dir).items()}
                # The records first: a dump thread answers at its next poll, faulthandler at once, and the
                # aborting rank may go as soon as it sees the stacks asked for; the agent then stops the
                # others, and a rank stopped before it wrote its records is missing from the verdict.
                flight.wait_for_dumps(self.run_dir, pids, asked, timeout_s=self.RECORDS_WAIT_S)
                faults.dump_stacks(pids, self.run_dir, wait_s=0.0)
                return


class _Forwarder:
    """SIGTERM / SIGINT / SIGUSR1: forward to every worker, SIGKILL them after the grace period."""

    SIGNALS = (signal.SIGTERM, signal.SIGINT, signal.SIGUSR1)

    def __init__(self, pids: Callable[[], List[int]], who: str, grace_s: float) -> None:
        self.pids, self.who, self.grace_s = pids, who, grace_s
        self.received: Optional[int] = None
        self.killed = False
        self._timer: Optional[threading.Timer] = None
        self._previous: dict = {}

    def __enter__(self) -> "_Forwarder":
        if threading.current_thread() is threading.main_thread():
            # torch's agent installs its handlers and leaves them: restore those too.
            self._previous = {s: signal.getsignal(s) for s in (*self.SIGNALS, signal.SIGHUP, signal.SIGQUIT)}
            for s in self.SIGNALS:
                signal.signal(s, self._forward)
        return self

    def __exit__(self, *exc: Any) -> None:
        if self._timer is not None:
            self._timer.cancel()
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)

    def _send(self, signum: int) -> None:
        for pid in self.pids():
            try:
                # A command worker leads its own session (its DataLoader workers are in it); a spawned one does not.
                os.killpg(pid, signum) if os.getpgid(pid) == pid else os.kill(pid, signum)
            except (ProcessLookupError, PermissionError):
                pass

    def _forward(self, signum: int, _frame: Any) -> None:
        if self.received is None:
            self.received = signum
            print(
                f"{self.who} received {verdict.signal_name(signum)}: forwarded to every worker; waiting up to "
                f"{self.grace_s:.0f} s ({PREEMPT_GRACE_ENV}) for them to save and exit.",
                file=sys.stderr,
                flush=True,
            )
            self._timer = threading.Timer(self.grace_s, self._kill)
            self._timer.daemon = True
            self._timer.start()
        self._send(signum)

    def _kill(self) -> None:
        self.killed = True
        self._send(signal.SIGKILL)

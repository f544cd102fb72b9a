"""Start N local worker processes, stop all of them when one fails, and say why.

Two entry points:
- `launch_script(...)`: `python train.py` with `Trainer(devices=2)`. The
  process the user started becomes a supervisor (it never joins a
  collective): it re-runs the same command line N times as workers, watches
  them, and the moment one exits non-zero it stops the others and exits with
  that code. Ranks blocked in a collective with a dead peer would otherwise
  hang until the backend's timeout; the supervisor turns that into a prompt
  failure.
- `launch(fn, *args, devices=N)`: the same for a function (notebooks,
  tests, the hand-written-loop layer), on torch.multiprocessing's spawn,
  returning every rank's return value.
Both create a run directory (env SHARDWISE_RUN_DIR) where each worker keeps
its progress record and, if it fails, its error record (progress.py,
faults.py). On failure the verdict names the FIRST failing rank with its own
traceback -- never a peer's "Connection closed by peer" -- or the signal that
killed it, or, for a collective timeout, the rank that stopped responding and
its stack. SIGTERM / SIGINT / SIGUSR1 sent to the launcher (preemption) are
forwarded to every worker, which get SHARDWISE_PREEMPT_GRACE_S (120 s) to save
and exit; if they exit with 75 (preempted), so does the launcher.
Under torchrun / srun neither is used: those launchers already started the
workers, and env.detect_env reads their variables (`shardwise launch` wraps
torchrun's agent, see launch_cli.py).
"""
from __future__ import annotations

import os
import pickle
import signal
import subprocess
import sys
import tempfile
import time
import traceback
from typing import Any, Callable, Dict, List, Optional, Tuple

from shardwise.distributed import faults, progress
from shardwise.distributed.env import PREEMPT_GRACE_ENV, PREEMPTED_EXIT_CODE, find_free_port, preempt_grace_s

# How long a failed run may take to bring the others down before SIGKILL.
_TERMINATE_GRACE_S = 5.0
# After the first failure, how long the others may take to fail on their own
# (and write their records) before the root cause is chosen.
_SETTLE_S = 2.0
_SETTLE_SECONDARY_S = 10.0
_PORT_RETRIES = 3


def worker_env(rank: int, world_size: int, port: int, *, node_rank: int = 0, nproc: Optional[int] = None,
               master_addr: str = "127.0.0.1") -> Dict[str, str]:
    nproc = nproc or world_size
    return {
        "MASTER_ADDR": master_addr,
        "MASTER_PORT": str(port),
        "WORLD_SIZE": str(world_size),
        "RANK": str(rank),
        "LOCAL_RANK": str(rank % nproc),
        "LOCAL_WORLD_SIZE": str(nproc),
        "GROUP_RANK": str(node_rank),
        "SHARDWISE_LAUNCHED": "1",
    }


def _script_command() -> List[str]:
    """The command line that started this process, re-runnable by a worker."""
    main = sys.modules.get("__main__")
    spec = getattr(main, "__spec__", None)
    if spec is not None and spec.name not in ("__main__", None):
        # `python -m package.module args`: re-run as a module so relative imports work.
        name = spec.name[: -len(".__main__")] if spec.name.endswith(".__main__") else spec.name
        return [sys.executable, "-m", name, *sys.argv[1:]]
    script = sys.argv[0] if sys.argv else ""
    if not script or script == "-c" or not os.path.exists(script):
        raise RuntimeError(
            "Trainer(devices>1) needs to re-run this program in each worker, but it was not started "
            "as `python script.py` (interactive session or `python -c`). Use "
            "`shardwise.launch(fn, devices=N)` to run a function on N processes, or start the script "
            "with `torchrun --nproc-per-node N script.py`."
        )
    return [sys.executable, *sys.argv]


def _die_with_parent() -> None:
    """Runs in the child before exec: if the supervisor dies, so does the worker."""
    os.setsid()
    try:
        import ctypes

        libc = ctypes.CDLL("libc.so.6", use_errno=True)
        libc.prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
    except OSError:
        pass


def _signal(pid: int, signum: int, group: bool) -> None:
    try:
        (os.killpg if group else os.kill)(pid, signum)
    except (ProcessLookupError, PermissionError):
        pass


class _Workers:
    """The launcher's view of its local workers, whether Popen'd commands or spawned functions."""

    def __init__(self, procs: List[Any], ranks: List[int], group: bool) -> None:
        self.procs, self.ranks, self.group = procs, ranks, group
        self.seen_at: Dict[int, float] = {}
        self.stopped: set = set()

    def codes(self) -> List[Optional[int]]:
        out = []
        for i, proc in enumerate(self.procs):
            code = proc.poll() if hasattr(proc, "poll") else proc.exitcode
            if code is not None and i not in self.seen_at:
                self.seen_at[i] = time.time()
            out.append(code)
        return out

    def alive(self) -> List[int]:
        return [i for i, code in enumerate(self.codes()) if code is None]

    def send(self, signum: int, which: Optional[List[int]] = None) -> None:
        for i in (self.alive() if which is None else which):
            _signal(self.procs[i].pid, signum, self.group)

    def wait(self, seconds: float, which: Optional[List[int]] = None) -> bool:
        """Wait until the workers (all, or `which`) have exited; True if they did within `seconds`."""
        deadline = time.monotonic() + seconds
        while True:
            codes = self.codes()
            if all(codes[i] is not None for i in (range(len(codes)) if which is None else which)):
                return True
            if time.monotonic() >= deadline:
                return False
            time.sleep(0.05)

    def stop(self, grace_s: float = _TERMINATE_GRACE_S) -> None:
        """SIGTERM the rest, SIGKILL whatever is left after `grace_s`; remember who was stopped."""
        alive = self.alive()
        self.stopped.update(alive)
        self.send(signal.SIGTERM, alive)
        if not self.wait(grace_s, alive):
            self.send(signal.SIGKILL, self.alive())
            self.wait(30.0)

    def outcomes(self, run_dir: Optional[str]) -> List[faults.Outcome]:
        records = faults.read_records(run_dir)
        codes = self.codes()
        return [faults.Outcome(rank=rank, exitcode=codes[i], seen_at=self.seen_at.get(i, 0.0),
                               stopped_by_launcher=i in self.stopped, record=records.get(rank))
                for i, rank in enumerate(self.ranks)]


class _SignalForwarder:
    """While installed, SIGTERM / SIGINT / SIGUSR1 to the launcher go to every worker (preemption)."""

    SIGNALS = (signal.SIGINT, signal.SIGTERM, signal.SIGUSR1)

    def __init__(self, workers: _Workers) -> None:
        self.workers = workers
        self.received: Optional[int] = None
        self.deadline = 0.0
        self.previous: Dict[int, Any] = {}

    def __enter__(self) -> "_SignalForwarder":
        self.previous = {s: signal.signal(s, self._forward) for s in self.SIGNALS}
        return self

    def __exit__(self, *exc: Any) -> None:
        for sig, handler in self.previous.items():
            signal.signal(sig, handler)

    def _forward(self, signum: int, _frame: Any) -> None:
        if self.received is None:
            self.received = signum
            self.deadline = time.monotonic() + preempt_grace_s()
            sys.stderr.write(f"[shardwise] received {faults.signal_name(signum)}: forwarded to every worker; "
                             f"waiting up to {preempt_grace_s():.0f} s ({PREEMPT_GRACE_ENV}) for them to save "
                             f"and exit.\n")
            sys.stderr.flush()
        self.workers.send(signum)


def _preempted_exit(workers: _Workers, forwarder: _SignalForwarder) -> int:
    """The launcher's exit code once a forwarded signal has been handled (or the grace period ran out)."""
    if not workers.wait(max(0.0, forwarder.deadline - time.monotonic())):
        late = workers.alive()
        workers.send(signal.SIGKILL, late)
        workers.wait(30.0)
        sys.stderr.write(f"[shardwise] rank(s) {', '.join(str(workers.ranks[i]) for i in late)} did not exit within "
                         f"the {preempt_grace_s():.0f} s grace period after {faults.signal_name(forwarder.received)}; "
                         f"killed them (raise {PREEMPT_GRACE_ENV} if saving takes longer).\n")
        return 128 + forwarder.received
    codes = workers.codes()
    if all(code in (0, PREEMPTED_EXIT_CODE) for code in codes):
        if PREEMPTED_EXIT_CODE in codes:
            sys.stderr.write(f"[shardwise] the workers saved and exited with {PREEMPTED_EXIT_CODE} "
                             "(preempted): resubmit the job to resume.\n")
            return PREEMPTED_EXIT_CODE
        return 0
    code = next(c for c in codes if c not in (0, PREEMPTED_EXIT_CODE))
    return code if code > 0 else 128 - code


def _settle_and_stop(workers: _Workers, run_dir: Optional[str]) -> List[faults.Outcome]:
    """After a first failure: let its consequences land, name a stalled rank's stack, stop the rest."""
    # Failures a few milliseconds apart (a rank raises, its peers see the socket close) must all be
    # on record before the root cause is chosen.
    workers.wait(_SETTLE_S)
    outcomes = workers.outcomes(run_dir)
    if all(o.kind in ("secondary", "stopped") for o in outcomes):
        # Only peers' "connection closed" so far: the rank that caused it is
        # still unwinding (cleanup, finally blocks); give it time to report.
        workers.wait(_SETTLE_SECONDARY_S)
        outcomes = workers.outcomes(run_dir)
    root = faults.root_cause(outcomes)
    if root is not None and root.kind == "timeout" and not (root.record or {}).get("shardwise", {}).get("stacks"):
        live = {workers.ranks[i]: workers.procs[i].pid for i in workers.alive()}
        stacks = faults.dump_stacks(live, run_dir)
        for o in outcomes:
            o.stack = stacks.get(o.rank, "")
    workers.stop()
    stacks = {o.rank: o.stack for o in outcomes}
    outcomes = workers.outcomes(run_dir)
    for o in outcomes:
        o.stack = stacks.get(o.rank, "")
    return outcomes


def _run(workers: _Workers, run_dir: Optional[str], forwarder: _SignalForwarder) -> Tuple[int, List[faults.Outcome]]:
    while True:
        if forwarder.received is not None:
            return _preempted_exit(workers, forwarder), []
        codes = workers.codes()
        # 75: a worker signalled directly (e.g. `scancel --signal=USR1 --full`) saved and left; not a failure.
        failed = [i for i, code in enumerate(codes) if code not in (None, 0, PREEMPTED_EXIT_CODE)]
        if failed:
            outcomes = _settle_and_stop(workers, run_dir)
            root = faults.root_cause(outcomes)
            code = root.exitcode if root is not None and root.exitcode else codes[failed[0]]
            return (code if code > 0 else 128 - code), outcomes
        if all(code is not None for code in codes):
            return (PREEMPTED_EXIT_CODE if PREEMPTED_EXIT_CODE in codes else 0), []
        time.sleep(0.05)


def supervise(commands: List[List[str]], envs: List[Dict[str, str]], run_dir: Optional[str] = None) -> int:
    """Run one command per rank; return 0, the first failing rank's exit code, or 75 if preempted."""
    preexec = _die_with_parent if sys.platform == "linux" else None
    with tempfile.TemporaryDirectory(prefix="shardwise-run-") as own_dir:
        run_dir = run_dir or own_dir
        procs = [subprocess.Popen(cmd, env={**os.environ, **env, progress.RUN_DIR_ENV: run_dir}, preexec_fn=preexec)
                 for cmd, env in zip(commands, envs)]
        workers = _Workers(procs, [int(env.get("RANK", i)) for i, env in enumerate(envs)], group=preexec is not None)
        try:
            with _SignalForwarder(workers) as forwarder:
                code, outcomes = _run(workers, run_dir, forwarder)
        finally:
            if workers.alive():  # the launcher itself is failing: leave no worker behind
                workers.stop()
        if outcomes:
            sys.stderr.write(faults.diagnose(outcomes, run_dir))
        return code


def launch_script(nproc: int) -> None:
    """Become the supervisor of `nproc` copies of this script; exits the process."""
    command = _script_command()
    port = find_free_port()
    envs = [worker_env(rank, nproc, port) for rank in range(nproc)]
    code = supervise([command] * nproc, envs)
    # The workers ran the whole script, including what follows fit(); the
    # supervisor must not run it a second time without a trained model.
    sys.exit(code)


class WorkerFailedError(RuntimeError):
    """A rank of `launch(fn)` failed; the message is the launcher's verdict with the root cause's traceback."""

    def __init__(self, message: str, exitcode: int, rank: Optional[int]) -> None:
        super().__init__(message)
        self.exitcode = exitcode
        self.rank = rank


def _spawn_entry(index: int, fn: Callable, args: tuple, env: List[Dict[str, str]], out_dir: str) -> None:
    os.environ.update(env[index])
    faults.install_worker()
    try:
        result = fn(*args)
        with open(os.path.join(out_dir, f"rank{index}.pkl"), "wb") as fh:
            pickle.dump(result, fh)
        _shutdown_process_group()
        code = 0
    except SystemExit as exc:  # e.g. preempted: saved, exiting with 75
        code = exc.code if isinstance(exc.code, int) else (0 if exc.code is None else 1)
    except BaseException as exc:
        faults.record_exception(exc)
        faults.print_worker_exception(exc)
        code = 1
    # The result is on disk and the group is gone (or the error is on record):
    # leave without running the interpreter's and C++ runtime's exit-time
    # destructors. Those tear down communication objects (store server,
    # transport threads) in no defined order, and on a loaded machine that has
    # aborted a finished worker ("terminate called without an active
    # exception") after its work was done.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


def _shutdown_process_group() -> None:
    """Tear the process group down together: no rank closes its sockets while another still uses them."""
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        dist.barrier()
        dist.destroy_process_group()


def launch(fn: Callable[..., Any], *args: Any, devices: int = 2, num_nodes: int = 1,
           node_rank: int = 0, master_addr: str = "127.0.0.1", master_port: Optional[int] = None) -> List[Any]:
    """Run `fn(*args)` on `devices` local processes; return each rank's return value.

    A failure in any rank stops the rest and raises WorkerFailedError naming
    the first failing rank, with its traceback (not a peer's "connection
    closed"). SIGTERM / SIGINT / SIGUSR1 are forwarded to the workers, which
    get SHARDWISE_PREEMPT_GRACE_S to save; if they exit with 75 (preempted),
    so does this process (SystemExit(75)). `fn` must be importable (defined at
    module level), because the workers are started with the spawn method.
    """
    import torch.multiprocessing as mp

    world = devices * num_nodes
    # A free port found here can be taken by another program before rank 0
    # binds it; with a port of our choosing, retry that race a few times.
    for attempt in range(1 if master_port else _PORT_RETRIES):
        port = master_port or find_free_port()
        with tempfile.TemporaryDirectory(prefix="shardwise-launch-") as out_dir:
            envs = [
                {**worker_env(node_rank * devices + i, world, port, node_rank=node_rank, nproc=devices,
                              master_addr=master_addr), progress.RUN_DIR_ENV: out_dir}
                for i in range(devices)
            ]
            context = mp.start_processes(_spawn_entry, args=(fn, args, envs, out_dir), nprocs=devices,
                                         join=False, start_method="spawn")
            workers = _Workers(context.processes, [int(e["RANK"]) for e in envs], group=False)
            try:
                with _SignalForwarder(workers) as forwarder:
                    code, outcomes = _run(workers, out_dir, forwarder)
            finally:
                if workers.alive():
                    workers.stop()
                for proc in context.processes:
                    proc.join(1.0)
            if forwarder.received is not None or code == PREEMPTED_EXIT_CODE:
                if code == 0:
                    return _results(out_dir, devices)
                raise SystemExit(code)
            if code != 0:
                root = faults.root_cause(outcomes)
                summary = root.record["shardwise"]["summary"] if root is not None and root.record else ""
                if ("EADDRINUSE" in summary or "address already in use" in summary.lower()) and \
                        attempt + 1 < _PORT_RETRIES and not master_port:
                    continue
                message = faults.diagnose(outcomes, out_dir) or f"a worker exited with code {code}"
                raise WorkerFailedError(message.rstrip(), code, root.rank if root is not None else None)
            return _results(out_dir, devices)
    raise RuntimeError("unreachable")  # pragma: no cover


def _results(out_dir: str, devices: int) -> List[Any]:
    results = []
    for i in range(devices):
        path = os.path.join(out_dir, f"rank{i}.pkl")
        if not os.path.exists(path):
            raise RuntimeError(f"rank {i} exited with code 0 without returning a result (sys.exit(0) in fn?).")
        with open(path, "rb") as fh:
            results.append(pickle.load(fh))
    return results

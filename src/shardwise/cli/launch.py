"""`shardwise launch`: start this node's workers under torchrun's elastic agent.

Multi-node jobs need one launcher per node. Each one is told the same
`--nnodes`, `--master-addr` and `--master-port` and its own `--node-rank`;
the agents meet at the master address (torchrun's "static" rendezvous, the
behaviour of `torchrun --node-rank`), start `--nproc-per-node` workers each
with RANK / LOCAL_RANK / WORLD_SIZE / GROUP_RANK set, and tear every worker
on every node down when one fails; the verdict printed then is ours
(faults.py: the first failing rank's traceback, the signal that killed a
rank, the rank a timed-out collective waited for), and SIGTERM / SIGINT /
SIGUSR1 are forwarded to the workers with a grace period to save and exit 75
(preemption), which this launcher then exits with. We use PyTorch's agent
(`torch.distributed.launcher.api.elastic_launch`) rather than our own
supervisor for this because it already solves the cross-node part:
rendezvous, a shared store the workers reuse, restarts, and failure
propagation. What shardwise adds is the command line: the thing to run can
be a script (`train.py args`), a module (`-m pkg.mod args`), or a command
(`shardwise finetune --config run.yaml`, which then runs in this same
interpreter), and a mismatch between `--nproc-per-node` and the devices on
this node is reported before any rendezvous. Under SLURM, run one
`shardwise launch` per node with `srun` (examples/slurm/).
"""
from __future__ import annotations

import argparse
import os
import shutil
import signal
import sys
import tempfile
import threading
import uuid
from typing import Any, List, Optional, Sequence, Tuple

from jsonargparse import ArgumentParser

from shardwise.distributed import faults
from shardwise.distributed.env import PREEMPT_GRACE_ENV, PREEMPTED_EXIT_CODE, preempt_grace_s
from shardwise.distributed.progress import RUN_DIR_ENV


PASSTHROUGH = True  # the program's own arguments are passed on as given


def parser() -> ArgumentParser:
    p = ArgumentParser(
        description="Start this node's workers (torchrun's elastic agent). Run once per node.",
        epilog="examples:\n"
               "  shardwise launch --nproc-per-node 8 train.py --lr 1e-4\n"
               "  shardwise launch --nnodes 2 --node-rank $NODE_RANK --master-addr node0 --master-port 29500 \\\n"
               "      --nproc-per-node 8 shardwise finetune --config llama70b.yaml",
        formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--nnodes", type=int, default=1, help="number of nodes (launchers) in the job")
    p.add_argument("--node_rank", type=Optional[int], default=None,
                   help="this node's index in [0, nnodes); default $NODE_RANK / $SLURM_NODEID / 0")
    p.add_argument("--master_addr", type=Optional[str], default=None,
                   help="address of node 0 (default $MASTER_ADDR or 127.0.0.1)")
    p.add_argument("--master_port", type=Optional[int], default=None,
                   help="free TCP port on node 0 (default $MASTER_PORT, or a free port for one node)")
    p.add_argument("--nproc_per_node", type=str, default="auto",
                   help="workers on this node: a number, or 'auto' (one per GPU, else 1)")
    p.add_argument("--rdzv_backend", type=str, default="static", choices=("static", "c10d"),
                   help="static (fixed node ranks, like torchrun --node-rank) or c10d (elastic)")
    p.add_argument("--run_id", type=Optional[str], default=None,
                   help="rendezvous id for c10d (default: $SLURM_JOB_ID or random)")
    p.add_argument("--max_restarts", type=int, default=0, help="restart the workers this many times on failure")
    p.add_argument("--log_dir", type=Optional[str], default=None,
                   help="keep each worker's stdout/stderr in this folder")
    p.add_argument("-m", dest="module", action="store_true", help="run the program as a module (python -m)")
    p.add_argument("program", help="script.py, module name (with -m), or a command such as `shardwise`")
    p.add_argument("args", nargs=argparse.REMAINDER, help="arguments passed to the program")
    return p


def resolve_nproc(value: str) -> int:
    import torch

    if str(value) == "auto":
        return torch.cuda.device_count() if torch.cuda.is_available() else 1
    if not str(value).isdigit() or int(value) < 1:
        raise ValueError(f"--nproc-per-node={value!r}: use a positive number or 'auto'.")
    n = int(value)
    if torch.cuda.is_available() and n > torch.cuda.device_count():
        raise ValueError(f"--nproc-per-node={n} but this node has {torch.cuda.device_count()} GPU(s).")
    return n


def resolve_command(program: str, args: Sequence[str], as_module: bool) -> Tuple[str, List[str]]:
    """(executable, arguments) for each worker."""
    if as_module:
        return sys.executable, ["-u", "-m", program, *args]
    if program.endswith(".py") or (os.path.isfile(program) and not os.access(program, os.X_OK)):
        if not os.path.exists(program):
            raise FileNotFoundError(f"script {program!r} does not exist.")
        return sys.executable, ["-u", program, *args]
    if program == "shardwise":
        # Our own CLI runs in this interpreter: no dependence on PATH or on
        # which environment the `shardwise` console script belongs to.
        return sys.executable, ["-u", "-m", "shardwise.cli", *args]
    found = shutil.which(program)
    if found is None:
        raise FileNotFoundError(f"{program!r} is neither a script nor a command on PATH.")
    return found, list(args)


def _env_int(*names: str) -> Optional[int]:
    for name in names:
        value = os.environ.get(name)
        if value not in (None, ""):
            return int(value)
    return None


def run(ns: Any) -> int:
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.launcher.api import LaunchConfig, elastic_launch

    from shardwise.distributed.env import find_free_port

    if ns.nnodes < 1:
        raise ValueError(f"--nnodes={ns.nnodes}: use 1 or more.")
    node_rank = ns.node_rank if ns.node_rank is not None else (_env_int("NODE_RANK", "SLURM_NODEID") or 0)
    if not 0 <= node_rank < ns.nnodes:
        raise ValueError(f"--node-rank={node_rank} is outside [0, {ns.nnodes}).")
    addr = ns.master_addr or os.environ.get("MASTER_ADDR") or "127.0.0.1"
    port = ns.master_port or _env_int("MASTER_PORT")
    if port is None:
        if ns.nnodes > 1:
            raise ValueError("--master-port is required with --nnodes > 1 (every node must name the same port).")
        port = find_free_port()
    nproc = resolve_nproc(ns.nproc_per_node)
    entrypoint, args = resolve_command(ns.program, ns.args, ns.module)
    rdzv_configs = {"rank": node_rank} if ns.rdzv_backend == "static" else {}
    run_id = ns.run_id or os.environ.get("SLURM_JOB_ID") or ("shardwise" if ns.rdzv_backend == "static"
                                                               else uuid.uuid4().hex[:8])
    logs_specs = None
    if ns.log_dir:
        from torch.distributed.elastic.multiprocessing import DefaultLogsSpecs, Std

        logs_specs = DefaultLogsSpecs(log_dir=ns.log_dir, redirects=Std.ALL, tee=Std.ALL)
    # The workers keep their progress and error records here (faults.py), so
    # the verdict below can name the first failing rank and a stalled one.
    run_dir = tempfile.mkdtemp(prefix="shardwise-run-")
    os.environ[RUN_DIR_ENV] = run_dir
    # SIGTERM / SIGINT / SIGUSR1 are preemption: forwarded to the workers, which
    # get a grace period to save (ours, below); the agent keeps the others.
    config = LaunchConfig(min_nodes=ns.nnodes, max_nodes=ns.nnodes, nproc_per_node=nproc,
                          rdzv_backend=ns.rdzv_backend, rdzv_endpoint=f"{addr}:{port}", rdzv_configs=rdzv_configs,
                          run_id=run_id, max_restarts=ns.max_restarts, monitor_interval=0.1,
                          logs_specs=logs_specs, start_method="spawn",
                          local_addr=addr if ns.nnodes == 1 else None, signals_to_handle="SIGHUP,SIGQUIT")
    forwarder = _PreemptForwarder(entrypoint)
    try:
        with forwarder:
            elastic_launch(config, entrypoint)(*args)
    except ChildFailedError as exc:
        return _report_failure(exc, node_rank, run_dir, forwarder)
    finally:
        shutil.rmtree(run_dir, ignore_errors=True)
    return 0


def _report_failure(exc: Any, node_rank: int, run_dir: str, forwarder: "_PreemptForwarder") -> int:
    """Print the root cause (not torch's second-resolution guess) and choose the exit code."""
    codes = {rank: failure.exitcode for rank, failure in exc.failures.items()}
    if codes and all(code == PREEMPTED_EXIT_CODE for code in codes.values()):
        print(f"[shardwise launch] node {node_rank}: the workers saved and exited with {PREEMPTED_EXIT_CODE} "
              "(preempted): resubmit the job to resume.", file=sys.stderr)
        return PREEMPTED_EXIT_CODE
    if forwarder.killed:
        print(f"[shardwise launch] node {node_rank}: worker(s) did not exit within the {preempt_grace_s():.0f} s "
              f"grace period after {faults.signal_name(forwarder.received)}; killed them (raise "
              f"{PREEMPT_GRACE_ENV} if saving takes longer).", file=sys.stderr)
        return 128 + forwarder.received
    records = faults.read_records(run_dir)
    # Once one worker failed, the agent stops the others (SIGTERM, SIGKILL 30 s
    # later) and lists them as failures too, with second-resolution times. A
    # rank that died that way without a record is a consequence, unless the
    # recorded failures are themselves only consequences (a peer's closed
    # connection: then the signal death came first, e.g. the OOM killer).
    caused = any(r["shardwise"]["kind"] in ("primary", "timeout") for r in records.values())
    outcomes = []
    for rank, failure in sorted(exc.failures.items()):
        record = records.get(rank)
        stopped = (caused and record is None and forwarder.received is None
                   and failure.exitcode in (-signal.SIGTERM, -signal.SIGKILL))
        outcomes.append(faults.Outcome(rank=rank, exitcode=failure.exitcode, seen_at=float(failure.timestamp),
                                       stopped_by_launcher=stopped, record=record))
    verdict = faults.diagnose(outcomes, run_dir)
    if not verdict:
        verdict = exc.format_msg() if hasattr(exc, "format_msg") else str(exc)
    print(f"[shardwise launch] node {node_rank}:\n{verdict.rstrip()}", file=sys.stderr)
    return 1


def _worker_pids(entrypoint: str) -> List[int]:
    """This process's children that run `entrypoint`: the agent's workers (each leads its own session)."""
    me, pids = str(os.getpid()), []
    for name in os.listdir("/proc"):
        if not name.isdigit():
            continue
        try:
            with open(f"/proc/{name}/stat") as fh:
                ppid = fh.read().rsplit(")", 1)[1].split()[1]
            with open(f"/proc/{name}/cmdline", "rb") as fh:
                argv0 = fh.read().split(b"\0", 1)[0].decode(errors="replace")
        except (OSError, IndexError):
            continue
        if ppid == me and argv0 == entrypoint:
            pids.append(int(name))
    return pids


class _PreemptForwarder:
    """SIGTERM / SIGINT / SIGUSR1: forward to every worker, SIGKILL them after the grace period."""

    SIGNALS = (signal.SIGTERM, signal.SIGINT, signal.SIGUSR1)

    def __init__(self, entrypoint: str) -> None:
        self.entrypoint = entrypoint
        self.received: Optional[int] = None
        self.killed = False
        self._timer: Optional[threading.Timer] = None
        self._previous: dict = {}

    def __enter__(self) -> "_PreemptForwarder":
        self._previous = {s: signal.signal(s, self._forward) for s in self.SIGNALS}
        return self

    def __exit__(self, *exc: Any) -> None:
        if self._timer is not None:
            self._timer.cancel()
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)

    def _send(self, signum: int) -> None:
        for pid in _worker_pids(self.entrypoint):
            try:
                os.killpg(pid, signum)
            except (ProcessLookupError, PermissionError):
                pass

    def _forward(self, signum: int, _frame: Any) -> None:
        if self.received is None:
            self.received = signum
            grace = preempt_grace_s()
            print(f"[shardwise launch] received {faults.signal_name(signum)}: forwarded to every worker; waiting "
                  f"up to {grace:.0f} s ({PREEMPT_GRACE_ENV}) for them to save and exit.", file=sys.stderr, flush=True)
            self._timer = threading.Timer(grace, self._kill)
            self._timer.daemon = True
            self._timer.start()
        self._send(signum)

    def _kill(self) -> None:
        self.killed = True
        self._send(signal.SIGKILL)


"""Start N local worker processes, and stop all of them when one fails.

Two entry points:
- `launch_script(...)`: `python train.py` with `Trainer(devices=2)`. The
  process the user started becomes a supervisor (it never joins a
  collective): it re-runs the same command line N times as workers, watches
  them, and the moment one exits non-zero it stops the others and exits with
  that code. Ranks blocked in a collective with a dead peer would otherwise
  hang until the backend's timeout; the supervisor turns that into a prompt
  failure with the original traceback on stderr.
- `launch(fn, *args, devices=N)`: the same for a function (notebooks,
  tests, the hand-written-loop layer), on torch.multiprocessing's spawn,
  returning every rank's return value.
Under torchrun / srun neither is used: those launchers already started the
workers, and env.detect_env reads their variables.
"""
from __future__ import annotations

import os
import pickle
import signal
import subprocess
import sys
import tempfile
import time
from typing import Any, Callable, Dict, List, Optional

from shardwise.distributed.env import find_free_port

# How long a failed run may take to bring the others down before SIGKILL.
_TERMINATE_GRACE_S = 5.0
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


def _stop(procs: List[subprocess.Popen]) -> None:
    for proc in procs:
        if proc.poll() is None:
            try:
                os.killpg(proc.pid, signal.SIGTERM)
            except ProcessLookupError:
                pass
    deadline = time.monotonic() + _TERMINATE_GRACE_S
    for proc in procs:
        try:
            proc.wait(timeout=max(0.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            try:
                os.killpg(proc.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
            proc.wait()


def supervise(commands: List[List[str]], envs: List[Dict[str, str]]) -> int:
    """Run one command per rank; return 0, or the first failing rank's exit code."""
    if sys.platform != "linux":  # pragma: no cover - the supervisor needs POSIX sessions
        preexec = None
    else:
        preexec = _die_with_parent
    procs = [
        subprocess.Popen(cmd, env={**os.environ, **env}, preexec_fn=preexec)
        for cmd, env in zip(commands, envs)
    ]

    def forward(signum, _frame):  # Ctrl-C / scancel reach every worker
        for proc in procs:
            if proc.poll() is None:
                try:
                    os.killpg(proc.pid, signum)
                except ProcessLookupError:
                    pass

    previous = {s: signal.signal(s, forward) for s in (signal.SIGINT, signal.SIGTERM)}
    try:
        while True:
            codes = [proc.poll() for proc in procs]
            failed = [(rank, code) for rank, code in enumerate(codes) if code not in (None, 0)]
            if failed:
                rank, code = failed[0]
                _stop(procs)
                sys.stderr.write(
                    f"[shardwise] rank {rank} exited with code {code}; stopped the other "
                    f"{len(procs) - 1} rank(s). Its traceback is printed above.\n"
                )
                return code if code > 0 else 128 - code
            if all(code == 0 for code in codes):
                return 0
            time.sleep(0.05)
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)


def launch_script(nproc: int) -> None:
    """Become the supervisor of `nproc` copies of this script; exits the process."""
    command = _script_command()
    port = find_free_port()
    envs = [worker_env(rank, nproc, port) for rank in range(nproc)]
    code = supervise([command] * nproc, envs)
    # The workers ran the whole script, including what follows fit(); the
    # supervisor must not run it a second time without a trained model.
    sys.exit(code)


def _spawn_entry(index: int, fn: Callable, args: tuple, env: List[Dict[str, str]], out_dir: str) -> None:
    os.environ.update(env[index])
    result = fn(*args)
    with open(os.path.join(out_dir, f"rank{index}.pkl"), "wb") as fh:
        pickle.dump(result, fh)
    _shutdown_process_group()
    # The result is on disk and the group is gone: leave without running the
    # interpreter's and C++ runtime's exit-time destructors. Those tear down
    # communication objects (store server, transport threads) in no defined
    # order, and on a loaded machine that has aborted a finished worker
    # ("terminate called without an active exception") after its work was done.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


def _shutdown_process_group() -> None:
    """Tear the process group down together: no rank closes its sockets while another still uses them."""
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        dist.barrier()
        dist.destroy_process_group()


def launch(fn: Callable[..., Any], *args: Any, devices: int = 2, num_nodes: int = 1,
           node_rank: int = 0, master_addr: str = "127.0.0.1", master_port: Optional[int] = None) -> List[Any]:
    """Run `fn(*args)` on `devices` local processes; return each rank's return value.

    A failure in any rank stops the rest and re-raises with that rank's
    traceback. `fn` must be importable (defined at module level), because the
    workers are started with the spawn method.
    """
    import torch.multiprocessing as mp

    world = devices * num_nodes
    # A free port found here can be taken by another program before rank 0
    # binds it; with a port of our choosing, retry that race a few times.
    for attempt in range(1 if master_port else _PORT_RETRIES):
        port = master_port or find_free_port()
        envs = [
            worker_env(node_rank * devices + i, world, port, node_rank=node_rank, nproc=devices,
                       master_addr=master_addr)
            for i in range(devices)
        ]
        with tempfile.TemporaryDirectory(prefix="shardwise-launch-") as out_dir:
            try:
                mp.start_processes(_spawn_entry, args=(fn, args, envs, out_dir), nprocs=devices,
                                   join=True, start_method="spawn")
            except mp.ProcessRaisedException as exc:
                if "EADDRINUSE" in str(exc) or "address already in use" in str(exc).lower():
                    if attempt + 1 < _PORT_RETRIES and not master_port:
                        continue
                raise
            results = []
            for i in range(devices):
                with open(os.path.join(out_dir, f"rank{i}.pkl"), "rb") as fh:
                    results.append(pickle.load(fh))
        return results
    raise RuntimeError("unreachable")  # pragma: no cover

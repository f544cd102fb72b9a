"""Start N local workers without torchrun: for `python train.py` and for a function.

- `launch_script(nproc)`: `python train.py` with `Trainer(devices=2)`. The
  process the user started becomes the launcher (it never joins a
  collective): it re-runs the same command line as N workers and exits with
  their verdict, so nothing after fit() runs a second time without a model.
- `launch(fn, *args, devices=N)`: `fn(*args)` on N processes (notebooks,
  tests, the loop written by hand), returning each rank's return value.
Both run under torch's elastic agent through agent.py, like `shardwise
launch`: a failing rank stops the rest and is named with its own traceback,
and preemption signals are forwarded with a grace period (exit 75). Both
take `context=`, the LaunchContext the workers get (context.py; default:
this process's own).
Under torchrun / srun neither is used: env.detect_env reads their variables.
"""

from __future__ import annotations

import atexit
import os
import sys
import time
from multiprocessing.reduction import ForkingPickler
from typing import Any, Callable, List, Optional, Tuple

from shardwise.distributed import agent, faults
from shardwise.distributed.context import LaunchContext
from shardwise.distributed.env import PREEMPTED_EXIT_CODE, find_free_port

# A rank that only lost a peer ("connection closed") waits this long before it exits, so that
# the peer that failed first (still unwinding: finally blocks, clean-up) is the failure the
# agent sees first and reports with its own exit code.
_SECONDARY_WAIT_S = 10.0


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


def launch_script(nproc: int, context: Optional[LaunchContext] = None) -> None:
    """Become the launcher of `nproc` copies of this script, which get `context` (default: this
    process's, context.current()); exits the process."""
    command = _script_command()
    result = agent.run(command[0], command[1:], nproc, port=find_free_port(), context=context)
    if result.message:
        sys.stderr.write(result.message + "\n")
    sys.exit(result.exitcode)


class WorkerFailedError(RuntimeError):
    """A rank of `launch(fn)` failed; the message is the launcher's verdict with the root cause's traceback.

    `summary`: the same verdict without the traceback (one line per failing rank); `error_types`: the
    root cause's exception class and its bases, by name (empty when it left no record). The workers
    print nothing of their own failure: this is the one place it is shown.
    """

    def __init__(
        self,
        message: str,
        exitcode: int,
        rank: Optional[int],
        summary: str = "",
        error_types: Tuple[str, ...] = (),
    ) -> None:
        super().__init__(message)
        self.exitcode = exitcode
        self.rank = rank
        self.summary = summary or message
        self.error_types = tuple(error_types)


def _worker(fn: Callable, args: tuple, launcher_pid: int) -> Any:
    """One rank of `launch(fn)`: record a failure our way, tear the process group down after success."""
    agent.die_with_launcher(launcher_pid)
    faults.install_worker()
    try:
        try:
            result = fn(*args)
        except SystemExit as exc:
            code = exc.code if isinstance(exc.code, int) else (0 if exc.code is None else 1)
            if code != 0:
                _leave(code)  # e.g. preempted: saved, exiting with 75
            result = None  # the agent waits for a value from every rank that exits 0
        result = host_result(result)
        ForkingPickler.dumps(result)  # as the agent's queue will: an unpicklable result fails this rank, named
        _shutdown_process_group()
    except BaseException as exc:
        faults.record_exception(exc)
        faults.print_worker_exception(exc)
        if faults.classify(f"{type(exc).__name__}: {exc}") == "secondary":
            time.sleep(_SECONDARY_WAIT_S)  # the agent stops this rank once the first failure exits
        _leave(1)
    # The agent has the result once this returns; then skip the interpreter's teardown.
    atexit.register(os._exit, 0)
    return result


def host_result(result: Any) -> Any:
    """`result` with every tensor on an accelerator copied to the host, in the same containers.

    The agent's queue pickles a CUDA tensor as a CUDA IPC handle into this worker's memory, and the
    worker exits as soon as it has returned: the launcher would map freed memory (or fail to).
    Containers are walked as torch's pytree knows them (dict, list, tuple, namedtuple, ...);
    CPU and meta tensors and everything else are returned as they are.
    """
    import torch
    from torch.utils import _pytree as pytree

    def on_host(value: Any) -> Any:
        if isinstance(value, torch.Tensor) and value.device.type not in ("cpu", "meta"):
            return value.detach().cpu().requires_grad_(value.requires_grad)
        return value

    leaves = pytree.tree_leaves(result)
    if not any(isinstance(v, torch.Tensor) and v.device.type not in ("cpu", "meta") for v in leaves):
        return result
    return pytree.tree_map(on_host, result)


def _leave(code: int) -> None:
    """Exit now, without the interpreter's teardown of torch (2-3 s per worker on a busy machine,
    measured) or the exit-time destructors of communication objects, which have aborted workers."""
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


def _shutdown_process_group() -> None:
    """Tear the process group down together: no rank closes its sockets while another still uses them."""
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        dist.barrier()
        dist.destroy_process_group()


def launch(
    fn: Callable[..., Any],
    *args: Any,
    devices: int = 2,
    num_nodes: int = 1,
    node_rank: int = 0,
    master_addr: str = "127.0.0.1",
    master_port: Optional[int] = None,
    context: Optional[LaunchContext] = None,
) -> List[Any]:
    """Run `fn(*args)` on `devices` local processes; return each rank's return value.

    A failure in any rank stops the rest and raises WorkerFailedError naming
    the first failing rank, with its traceback (not a peer's "connection
    closed"). SIGTERM / SIGINT / SIGUSR1 are forwarded to the workers, which
    get SHARDWISE_PREEMPT_GRACE_S to save; if they exit with 75 (preempted),
    so does this process (SystemExit(75)). `fn` must be importable (defined at
    module level): the workers are started with the spawn method. The workers
    get `context` (default: this process's, context.current()).
    """
    if num_nodes > 1 and master_port is None:
        raise ValueError("launch(num_nodes>1) needs master_port: every node must name the same one.")
    result = agent.run(
        _worker,
        (fn, args, os.getpid()),
        devices,
        nnodes=num_nodes,
        node_rank=node_rank,
        addr=master_addr,
        port=master_port or find_free_port(),
        context=context,
    )
    if result.exitcode == PREEMPTED_EXIT_CODE or (result.signalled and result.exitcode != 0):
        if result.message:
            sys.stderr.write(result.message + "\n")
        raise SystemExit(result.exitcode)
    if result.exitcode != 0:
        raise WorkerFailedError(result.message, result.exitcode, result.rank, result.summary, result.error_types)
    return [result.return_values[node_rank * devices + i] for i in range(devices)]

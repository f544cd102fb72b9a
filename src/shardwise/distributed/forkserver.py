"""Function workers forked from a server that has already imported torch and shardwise.

`shardwise.launch(fn)` (and the Trainer's function launches) used to start
each worker with the spawn method: a new interpreter that imports torch and
shardwise again, about 1.5 s per launch on two cores before `fn` starts,
every time. On Linux the workers are forked instead from multiprocessing's
fork server, started once per launching process with torch and shardwise
imported (and nothing run: no thread, no process group, no CUDA context),
so a worker starts in milliseconds and in a clean state, as a spawned one
does. The fork server's children are not the launcher's, which changes four
things a spawned worker had for free; `enter` puts them back before `fn` runs:

- the environment: a forked worker has the server's, as it was when the
  server started. It gets the launcher's environment at the launch (the
  LaunchContext included), with torch's per-worker variables (RANK,
  LOCAL_RANK, MASTER_PORT, TORCHELASTIC_*) kept as the agent set them.
- standard output and error: the server's are the ones the launcher had when
  the server started (a test's capture file, for instance). The worker writes
  to the launcher's current ones, reopened through /proc.
- the thread count: libgomp read OMP_NUM_THREADS once, when the server imported
  torch, so the worker would run with the server's (all cores, in every one of
  N ranks). It sets torch's thread count from the OMP_NUM_THREADS it gets.
- its parent is the fork server, not the launcher, and the server lives as
  long as any process it forked (each holds its liveness pipe): a worker
  watches the launcher itself (`watch_launcher`, a thread blocked on a pidfd)
  and is killed with it, as a spawned worker is by its parent-death signal.

SHARDWISE_START_METHOD=spawn goes back to spawning (and is what other systems get).
"""

from __future__ import annotations

import multiprocessing
import os
import select
import signal
import sys
import threading
import time
from typing import Any, Callable, Dict, Sequence

START_METHOD_ENV = "SHARDWISE_START_METHOD"
# What the server imports once: everything a worker of shardwise needs before fn's own imports.
PRELOAD = ("torch", "torch.distributed", "shardwise", "shardwise.distributed.launch", "shardwise.trainer")
# The variables torch's elastic agent sets for each worker (local_elastic_agent.py, api.py): its values win.
_AGENT_SET = {
    "RANK",
    "LOCAL_RANK",
    "GROUP_RANK",
    "ROLE_RANK",
    "ROLE_NAME",
    "LOCAL_WORLD_SIZE",
    "WORLD_SIZE",
    "GROUP_WORLD_SIZE",
    "ROLE_WORLD_SIZE",
    "MASTER_ADDR",
    "MASTER_PORT",
    "TORCH_NCCL_ASYNC_ERROR_HANDLING",
    "OMP_NUM_THREADS",
    "CUDA_VISIBLE_DEVICES",
}


def start_method() -> str:
    """'forkserver' on Linux unless SHARDWISE_START_METHOD says 'spawn'; 'spawn' elsewhere."""
    asked = os.environ.get(START_METHOD_ENV, "").strip().lower()
    if asked and asked not in ("spawn", "forkserver"):
        raise ValueError(f"{START_METHOD_ENV}={asked!r}: use 'forkserver' (the default on Linux) or 'spawn'.")
    if asked == "spawn" or not sys.platform.startswith("linux"):
        return "spawn"
    # Takes effect when the server starts (the first launch of this process); later calls change nothing.
    multiprocessing.set_forkserver_preload(list(PRELOAD))
    return "forkserver"


def launcher_view() -> Dict[str, Any]:
    """What a forked worker needs of the launcher at this launch (pickled with its arguments)."""
    return {"environ": dict(os.environ), "pid": os.getpid()}


def enter(fn: Callable[..., Any], view: Dict[str, Any], *args: Any) -> Any:
    """In a forked worker: the launcher's environment and standard streams, then `fn(*args)`."""
    agent_set = {k: v for k, v in os.environ.items() if k in _AGENT_SET or k.startswith("TORCHELASTIC_")}
    os.environ.clear()
    os.environ.update(view["environ"])
    os.environ.update(agent_set)
    _write_where(view["pid"])
    _apply_thread_count()
    return fn(*args)


def _apply_thread_count() -> None:
    """torch's intra-op threads as this worker's OMP_NUM_THREADS says (the server's libgomp read its own)."""
    value = os.environ.get("OMP_NUM_THREADS", "").strip()
    if value.isdigit() and int(value) > 0:
        import torch  # preloaded by the server: no import cost

        torch.set_num_threads(int(value))


def watch_launcher(launcher_pid: int) -> None:
    """SIGKILL this process when `launcher_pid` exits (now, if it already has): a daemon thread blocked on the
    launcher's pidfd (Linux 5.3+; else it checks every half second), so a SIGKILLed launcher (the OOM
    killer, a scheduler) leaves no worker waiting in a collective until the timeout."""
    try:
        fd = os.pidfd_open(launcher_pid)
    except ProcessLookupError:
        os._exit(1)
    except (AttributeError, OSError):  # no pidfd here: poll
        fd = None

    def wait() -> None:
        if fd is not None:
            select.select([fd], [], [])
        else:
            while _alive(launcher_pid):
                time.sleep(0.5)
        os.kill(os.getpid(), signal.SIGKILL)

    threading.Thread(target=wait, name="shardwise-launcher-watch", daemon=True).start()


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        pass
    return True


def _write_where(launcher_pid: int) -> None:
    """Standard output and error to the launcher's current ones, where they are not already the same file."""
    for fd, stream in ((1, sys.stdout), (2, sys.stderr)):
        path = f"/proc/{launcher_pid}/fd/{fd}"
        try:
            theirs, mine = os.stat(path), os.fstat(fd)
            if (theirs.st_dev, theirs.st_ino) == (mine.st_dev, mine.st_ino):
                continue
            target = os.open(path, os.O_WRONLY | os.O_APPEND)
        except OSError:  # a socket, or gone: keep what the server had
            continue
        if stream is not None:
            stream.flush()
        os.dup2(target, fd)
        os.close(target)


def wrap(entrypoint: Callable[..., Any], args: Sequence[Any], method: str) -> tuple:
    """The entry point and arguments the agent starts: `enter` around `entrypoint` for a forked worker."""
    if method != "forkserver":
        return entrypoint, tuple(args)
    return enter, (entrypoint, launcher_view(), *args)

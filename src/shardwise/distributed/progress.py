"""Where each rank is: a tiny per-rank record, read when something hangs or dies.

A rank blocked in a collective cannot tell which peer it is waiting for; the
backend only says "timed out". So every worker keeps one fixed-size record
(rank, pid, global step, the hook it entered, when) in a memory-mapped file
of the run directory its launcher created (the launch context's run_dir;
under a bare torchrun or srun, a directory named after the job in the temp
folder, visible to the ranks of this node). `mark(hook, step)` is a memory write into that
mapping, no system call, so the Trainer calls it at every hook boundary.
When a collective times out, the launcher (or the timed-out rank itself)
reads every record and names the rank that stopped making progress, the
hook it was in and for how long (`describe_stall`).
"""

from __future__ import annotations

import getpass
import hashlib
import mmap
import os
import struct
import tempfile
import time
from dataclasses import dataclass
from typing import Dict, List, Optional

from shardwise.distributed.context import current as launch_context
from shardwise.distributed.env import detect_env, global_rank

# step, time of the mark, time of the first mark, pid, hook (utf-8, NUL padded)
_FORMAT = "<qddi44s"
_SIZE = struct.calcsize(_FORMAT)  # 72 bytes
_HOOK_BYTES = 44

_buffer: Optional[object] = None  # mmap (or bytearray when there is no run directory)
_pack = struct.Struct(_FORMAT).pack_into
_started = 0.0
_pid = 0


@dataclass(frozen=True)
class Progress:
    rank: int
    step: int
    hook: str
    time: float  # wall-clock time (time.time()) of the last mark
    started: float  # wall-clock time of this process's first mark
    pid: int

    def age(self, now: Optional[float] = None) -> float:
        return (time.time() if now is None else now) - self.time


def run_dir(create: bool = False) -> Optional[str]:
    """This job's run directory: the launcher's, else one derived from torchrun's variables."""
    path = launch_context().run_dir
    if not path:
        env = _worker_env()
        if env is None:
            return None
        # The ranks of one node agree on it without talking: same launcher
        # (parent process: torchrun's agent, srun's step daemon) and job;
        # the parent's pid keeps a later job with the same port apart.
        key = "|".join(
            [str(os.getppid()), env.master_addr, str(env.master_port)]
            + [os.environ.get(k, "") for k in ("TORCHELASTIC_RUN_ID", "SLURM_JOB_ID", "SLURM_STEP_ID")]
        )
        try:
            user = getpass.getuser()
        except Exception:  # no passwd entry (containers)
            user = str(os.getuid())
        path = os.path.join(
            tempfile.gettempdir(), f"shardwise-{user}-run-{hashlib.sha1(key.encode()).hexdigest()[:12]}"
        )
    if create:
        os.makedirs(path, exist_ok=True)
    return path


def _worker_env():
    """torchrun's or srun's description of this rank, None for a process no launcher started."""
    try:
        return detect_env()
    except ValueError:  # an unreadable RANK: progress is a diagnostic, never a failure
        return None


def _record_path(directory: str, rank: int) -> str:
    return os.path.join(directory, f"progress.{rank}")


def _open() -> object:
    global _started, _pid
    _started, _pid = time.time(), os.getpid()
    directory = run_dir(create=True) if _worker_env() is not None else None
    if directory is None:
        return bytearray(_SIZE)
    try:
        path = _record_path(directory, global_rank())
        with open(path, "wb") as fh:
            fh.write(b"\0" * _SIZE)
        with open(path, "r+b") as fh:
            return mmap.mmap(fh.fileno(), _SIZE)
    except (OSError, ValueError):  # read-only temp, odd RANK: progress is a diagnostic, never a failure
        return bytearray(_SIZE)


def mark(hook: str, step: int) -> None:
    """Record that this rank entered `hook` at `step` (a memory write; call it at every hook boundary)."""
    global _buffer
    if _buffer is None:
        _buffer = _open()
    _pack(_buffer, 0, step, time.time(), _started, _pid, hook.encode()[:_HOOK_BYTES])


def read_all(directory: Optional[str] = None) -> Dict[int, Progress]:
    """Every rank's last record in `directory` (default: this job's run directory)."""
    directory = directory or run_dir()
    records: Dict[int, Progress] = {}
    if not directory or not os.path.isdir(directory):
        return records
    for name in os.listdir(directory):
        prefix, _, rank = name.partition(".")
        if prefix != "progress" or not rank.isdigit():
            continue
        try:
            with open(os.path.join(directory, name), "rb") as fh:
                raw = fh.read(_SIZE)
            step, at, started, pid, hook = struct.unpack(_FORMAT, raw)
        except (OSError, struct.error):
            continue
        if at == 0.0:
            continue  # created, never marked
        records[int(rank)] = Progress(int(rank), step, hook.rstrip(b"\0").decode(errors="replace"), at, started, pid)
    return records


def describe_stall(
    waiting: List[int],
    records: Optional[Dict[int, Progress]] = None,
    timeout_s: Optional[float] = None,
    now: Optional[float] = None,
) -> Optional[str]:
    """Name the rank(s) the `waiting` ranks (the ones whose collective timed out) were waiting for.

    The suspects are the ranks that did not time out themselves; among them the
    one furthest behind (lowest step, then oldest mark) comes first. None when
    nothing is known (no records).
    """
    records = read_all() if records is None else records
    now = time.time() if now is None else now
    suspects = [p for r, p in records.items() if r not in waiting]
    if not suspects:
        return None
    suspects.sort(key=lambda p: (p.step, p.time))
    culprit = suspects[0]
    lines = [
        f"rank {culprit.rank} stopped responding in {culprit.hook or 'start-up'} after step {culprit.step} "
        f"(no progress for {culprit.age(now):.0f} s)"
    ]
    for other in suspects[1:]:
        lines.append(f"rank {other.rank} last seen in {other.hook} after step {other.step}, {other.age(now):.0f} s ago")
    if waiting:
        who = ", ".join(str(r) for r in sorted(waiting))
        after = f" after {timeout_s:.0f} s" if timeout_s else ""
        waited = [records[r] for r in waiting if r in records]
        where = f" (in {waited[0].hook} after step {waited[0].step})" if waited else ""
        lines.append(
            f"rank{'s' if len(waiting) > 1 else ''} {who} waited for it in a collective{where} and timed out{after}"
        )
    return "; ".join(lines)

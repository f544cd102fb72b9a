"""Running many fake-tensor traces quickly: one fake world per process, two processes on two cores.

A trace costs about half a millisecond per dispatched op whatever the
tensor sizes (fake tensors carry no data), and a full plan needs a few dozen
traces, so wall time is what matters. Traces are independent, so they are
spread over worker processes (`python -m shardwise.plan.jobs`), each of which
joins its own fake process group once and then traces job after job sent
over a pipe. Plain subprocesses rather than multiprocessing: a spawned
multiprocessing child re-imports the caller's main script, which breaks
every unguarded script that calls plan(). Results come back as pickled
`Trace` records. With one worker (or when the model cannot be sent to
another process, e.g. a TrainModule defined in a notebook) everything runs
in the planning process.
"""
from __future__ import annotations

import os
import pickle
import queue
import struct
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass
from typing import Any, Dict, Optional, Sequence, Tuple, Union

from shardwise.plan.candidates import Candidate
from shardwise.plan.presets import ModelSpec
from shardwise.plan.trace import Trace, TraceFailed, View, fake_world, trace


@dataclass(frozen=True)
class TraceJob:
    traced: Candidate  # the DDP / FSDP configuration actually run
    precision: str
    micro_batch: int
    accumulation: int
    depth: Optional[int]
    scales: Tuple[float, ...]
    views: Tuple[Tuple[str, View], ...]


@dataclass(frozen=True)
class Setting:
    """What every job of one plan shares."""

    world_size: int
    num_nodes: int
    seq_len: int
    foreach: Optional[bool]
    optimizer: str


def _run(spec: ModelSpec, setting: Setting, job: TraceJob) -> Union[Trace, TraceFailed]:
    try:
        return trace(spec, job.traced, world_size=setting.world_size, num_nodes=setting.num_nodes,
                     precision=job.precision, seq_len=setting.seq_len, micro_batch=job.micro_batch,
                     accumulation=job.accumulation, depth=job.depth, scales=job.scales, views=dict(job.views),
                     foreach=setting.foreach, optimizer=setting.optimizer)
    except TraceFailed as exc:
        return exc


def default_workers(n_jobs: int) -> int:
    return 2 if (os.cpu_count() or 1) >= 2 and n_jobs >= 4 else 1


def run_jobs(spec: ModelSpec, setting: Setting, jobs: Sequence[TraceJob],
             workers: Optional[int] = None) -> Dict[TraceJob, Union[Trace, TraceFailed]]:
    """Every job's Trace (or the TraceFailed it raised), in worker processes when it pays off."""
    import torch.distributed as dist

    jobs = list(dict.fromkeys(jobs))
    workers = default_workers(len(jobs)) if workers is None else workers
    # A process group already exists here (e.g. a one-process FSDP fit before): the fake one
    # cannot be created next to it, so even a single worker must be another process.
    busy = dist.is_available() and dist.is_initialized()
    spec_bytes = _picklable(spec) if workers > 1 or busy else None
    if spec_bytes is None or (workers <= 1 and not busy):
        with fake_world(setting.world_size):
            return {job: _run(spec, setting, job) for job in jobs}
    # Longest first (checkpointed, sharded, deep): keeps both workers busy to the end.
    order = sorted(jobs, key=lambda j: (j.traced.activation_checkpointing, j.traced.kind == "fsdp",
                                        j.depth or 0, j.accumulation), reverse=True)
    pending: "queue.Queue[TraceJob]" = queue.Queue()
    for job in order:
        pending.put(job)
    results: Dict[TraceJob, Union[Trace, TraceFailed]] = {}
    errors: list = []
    header = pickle.dumps((spec_bytes, setting))
    threads = [threading.Thread(target=_drive, args=(header, pending, results, errors), daemon=True)
               for _ in range(max(1, min(workers, len(order))))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    if errors:
        raise errors[0]
    return results


def _drive(header: bytes, pending: "queue.Queue[TraceJob]", results: Dict[TraceJob, Any], errors: list) -> None:
    """Feed one worker process jobs until none are left (runs in a thread of the planning process)."""
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(p for p in sys.path if p))
    with tempfile.TemporaryFile() as log:
        proc = subprocess.Popen([sys.executable, "-m", "shardwise.plan.jobs"], stdin=subprocess.PIPE,
                                stdout=subprocess.PIPE, env=env,
                                stderr=None if os.environ.get("SHARDWISE_PLAN_DEBUG") else log)
        try:
            _send(proc.stdin, header)
            while not errors:
                try:
                    job = pending.get_nowait()
                except queue.Empty:
                    break
                _send(proc.stdin, pickle.dumps(job))
                reply = _receive(proc.stdout)
                if reply is None:
                    log.seek(0)
                    tail = log.read().decode(errors="replace")[-2000:]
                    raise RuntimeError(f"A planner worker process died while tracing {job.traced.label}:\n{tail}")
                results[job] = pickle.loads(reply)
        except BaseException as exc:  # surface in the planning thread
            errors.append(exc)
        finally:
            proc.stdin.close()
            proc.wait()


def _send(stream: Any, data: bytes) -> None:
    stream.write(struct.pack("<Q", len(data)) + data)
    stream.flush()


def _receive(stream: Any) -> Optional[bytes]:
    head = stream.read(8)
    if len(head) < 8:
        return None
    (size,) = struct.unpack("<Q", head)
    return stream.read(size)


def _serve() -> None:
    """Worker process: read (spec, setting), then trace jobs one by one until stdin closes."""
    import torch

    torch.set_num_threads(1)
    results = os.fdopen(os.dup(1), "wb")
    os.dup2(2, 1)  # anything printed goes to the log, not into the result stream
    commands = sys.stdin.buffer
    header = _receive(commands)
    if header is None:
        return
    spec_bytes, setting = pickle.loads(header)
    spec = pickle.loads(spec_bytes)
    with fake_world(setting.world_size):
        while True:
            data = _receive(commands)
            if data is None:
                break
            job = pickle.loads(data)
            start = time.perf_counter()
            result = _run(spec, setting, job)
            if os.environ.get("SHARDWISE_PLAN_DEBUG"):
                print(f"[plan worker] {job.traced.label} depth {job.depth}: {time.perf_counter() - start:.2f}s",
                      file=sys.stderr)
            _send(results, pickle.dumps(result))


def _picklable(spec: ModelSpec) -> Optional[bytes]:
    try:
        return pickle.dumps(spec)
    except Exception:  # a class defined in __main__ / a notebook: trace in this process
        return None


__all__ = ["TraceJob", "Setting", "run_jobs", "default_workers"]


if __name__ == "__main__":
    _serve()

"""Running many fake-tensor traces quickly: one fake world per process, two processes on two cores.

A trace costs about half a millisecond per dispatched op whatever the
tensor sizes (fake tensors carry no data), and a full plan needs a few dozen
traces, so wall time is what matters. Traces are independent, so they are
spread over worker processes (`python -m shardwise.plan.jobs`), each of which
joins its own fake process group once and then traces job after job sent
over a pipe. Plain subprocesses rather than multiprocessing: a spawned
multiprocessing child re-imports the caller's main script, which breaks
every unguarded script that calls plan(). Results come back as pickled
`Trace` records. A model whose classes live in the user's script or a
notebook cannot be pickled by module path: it is traced in forked children
(which inherit the classes) or, with one worker, in the planning process.
"""

from __future__ import annotations

import copy
import gc
import io
import os
import pickle
import queue
import struct
import subprocess
import sys
import tempfile
import threading
import time
from collections import OrderedDict
from dataclasses import dataclass, fields
from typing import Any, Dict, Optional, Sequence, Tuple, Union

import torch
import torch.distributed as dist

from shardwise.memory import active_tracker
from shardwise.plan.candidates import Candidate
from shardwise.plan.errors import PlanError
from shardwise.plan.presets import ModelSpec
from shardwise.plan.trace import Trace, TraceFailed, fake_world, trace
from shardwise.strategies.accounting import View, accounting_for


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
    optimizer: Any  # an OptimizerChoice (plan/optim.py) or a name
    target: str = "cpu"  # "cuda": attention and optimizer defaults of the GPU (plan/kernels.py)


def _run(spec: ModelSpec, setting: Setting, job: TraceJob) -> Union[Trace, TraceFailed]:
    try:
        return trace(
            spec,
            job.traced,
            world_size=setting.world_size,
            num_nodes=setting.num_nodes,
            precision=job.precision,
            seq_len=setting.seq_len,
            micro_batch=job.micro_batch,
            accumulation=job.accumulation,
            depth=job.depth,
            scales=job.scales,
            views=dict(job.views),
            foreach=setting.foreach,
            optimizer=setting.optimizer,
            target=setting.target,
        )
    except TraceFailed as exc:
        return exc


# Traces already made in this process, by everything that decides them: a bundled model's definition
# (GPT / Transformer: every field of its spec), the setting and the job. Planning the same model again
# -- at another device memory or batch size, in a notebook, or the Trainer's check after a plan --
# traces only what is new; the rows are the same (a trace has no randomness: fake tensors carry no
# data). Models given as a TrainModule or a Hugging Face config, and the user's own strategy objects,
# are always traced afresh (their definition is not all in fields this can compare).
_CACHE: "OrderedDict[Any, Trace]" = OrderedDict()
_CACHE_SIZE = 512


def _cache_key(spec: ModelSpec, setting: Setting, job: TraceJob) -> Any:
    if spec.kind not in ("gpt", "transformer") or spec.module is not None or job.traced.strategy is not None:
        return None
    definition = repr([(f.name, getattr(spec, f.name)) for f in fields(spec) if f.name != "notes"])
    key = (definition, setting, job)
    try:
        hash(key)
    except TypeError:
        return None
    return key


def default_workers(n_jobs: int) -> int:
    return 2 if (os.cpu_count() or 1) >= 2 and n_jobs >= 4 else 1


def run_jobs(
    spec: ModelSpec, setting: Setting, jobs: Sequence[TraceJob], workers: Optional[int] = None
) -> Dict[TraceJob, Union[Trace, TraceFailed]]:
    """Every job's Trace (or the TraceFailed it raised), in worker processes when it pays off.

    Where the traces run:
    - here, when one worker is asked for and this process is free (no process group, no
      running MemoryTracker);
    - otherwise in forked workers (Linux): they start with everything imported and with the
      user's classes (a TrainModule defined in a script or notebook needs no pickling), and
      a fork stops its copy of a running MemoryTracker, so the user's tracker neither sees
      the planner's fake tensors nor blinds the planner's own tracker;
    - in `python -m shardwise.plan.jobs` workers when this process already has a process
      group (a fork would inherit it) or cannot fork; the model must then pickle by
      reference to modules a fresh interpreter can import.
    """

    jobs = list(dict.fromkeys(jobs))
    keys = {job: _cache_key(spec, setting, job) for job in jobs}
    known = {job: _CACHE[k] for job, k in keys.items() if k is not None and k in _CACHE}
    for k in (keys[job] for job in known):
        _CACHE.move_to_end(k)
    todo = [job for job in jobs if job not in known]
    results = _run_jobs(spec, setting, todo, workers) if todo else {}
    for job, result in results.items():
        if keys[job] is not None and isinstance(result, Trace):
            _CACHE[keys[job]] = copy.deepcopy(result)  # the caller may change the one it gets
            while len(_CACHE) > _CACHE_SIZE:
                _CACHE.popitem(last=False)
    return {job: copy.deepcopy(known[job]) if job in known else results[job] for job in jobs}


def _run_jobs(
    spec: ModelSpec, setting: Setting, jobs: Sequence[TraceJob], workers: Optional[int]
) -> Dict[TraceJob, Union[Trace, TraceFailed]]:
    workers = default_workers(len(jobs)) if workers is None else workers
    # A process group already exists here (e.g. a one-process FSDP fit before): the fake one
    # cannot be created next to it, so even a single worker must be another process.
    busy = dist.is_available() and dist.is_initialized()
    tracking = active_tracker() is not None
    if workers <= 1 and not busy and not tracking:
        with fake_world(setting.world_size):
            return {job: _run(spec, setting, job) for job in jobs}
    if not busy and _can_fork():
        # Forked workers start with everything imported and the user's classes defined: about
        # a third faster than fresh interpreters, and nothing is pickled by module path.
        return _run_forked(spec, setting, jobs, max(1, workers))
    spec_bytes = _portable(spec)
    if spec_bytes is not None and any(j.traced.strategy is not None for j in jobs) and _portable(jobs) is None:
        spec_bytes = None  # a strategy object naming classes from __main__
    if spec_bytes is None:
        raise PlanError(
            "This model's classes are defined in __main__ (a script or notebook), so they cannot be sent "
            "to a planner worker process, and this process cannot trace them itself (a process group is "
            "initialised, or a MemoryTracker runs, and it cannot fork). Plan before the strategy sets up, "
            "or move the classes to a module."
        )
    # Longest first (checkpointed, sharded, deep): keeps both workers busy to the end.
    order = _longest_first(jobs)
    pending: "queue.Queue[TraceJob]" = queue.Queue()
    for job in order:
        pending.put(job)
    results: Dict[TraceJob, Union[Trace, TraceFailed]] = {}
    errors: list = []
    header = pickle.dumps((spec_bytes, setting))
    threads = [
        threading.Thread(target=_drive, args=(header, pending, results, errors), daemon=True)
        for _ in range(max(1, min(workers, len(order))))
    ]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    if errors:
        raise errors[0]
    return results


def _can_fork() -> bool:
    # Linux only (fork is unsafe with macOS system frameworks); SHARDWISE_PLAN_FORK=0 turns it off.
    return hasattr(os, "fork") and sys.platform.startswith("linux") and os.environ.get("SHARDWISE_PLAN_FORK") != "0"


def _longest_first(jobs: Sequence[TraceJob]) -> list:
    return sorted(
        jobs,
        key=lambda j: (j.traced.plan.uses_ac, _sharded(j), j.depth or 0, j.accumulation),
        reverse=True,
    )


def _sharded(job: TraceJob) -> bool:
    return accounting_for(job.traced.plan).shards_on_meta


def _cost(job: TraceJob) -> float:
    # Rough relative CPU cost of one trace: dispatched ops grow with depth; FSDP adds DTensor dispatch.
    return float(job.depth or 1) * accounting_for(job.traced.plan).trace_cost


def _shares(jobs: Sequence[TraceJob], workers: int) -> list:
    """Split the jobs over `workers` processes, keeping jobs that share a parameter layout together.

    A fresh process pays for every new op signature once: FakeTensor's dispatch cache and, for
    FSDP, DTensor's sharding propagation (about a quarter of a cold plan's time, mostly the
    optimizer's foreach ops over the sharded parameter lists, which differ by depth). FSDP
    configurations traced at the same depth have the same sharded parameters, so they go to the
    same worker and pay once (6% less CPU than round-robin over the 12 presets, same results).
    DDP jobs use no DTensor and fill in to balance. A group larger than a fair share is split,
    so one-depth models still use every worker.
    """
    groups: Dict[Any, list] = {}
    for job in _longest_first(jobs):
        key = ("sharded", job.depth) if _sharded(job) else ("alone", id(job))
        groups.setdefault(key, []).append(job)
    fair = sum(_cost(j) for j in jobs) / max(1, workers)
    pieces, todo = [], list(groups.values())
    while todo:
        group = todo.pop()
        if len(group) > 1 and sum(_cost(j) for j in group) > fair:
            todo += [group[0::2], group[1::2]]
        else:
            pieces.append(group)
    loads, shares = [0.0] * workers, [[] for _ in range(workers)]
    for group in sorted(pieces, key=lambda g: -sum(_cost(j) for j in g)):
        i = min(range(workers), key=loads.__getitem__)
        shares[i] += group
        loads[i] += sum(_cost(j) for j in group)
    return [share for share in shares if share]


def _run_forked(
    spec: ModelSpec, setting: Setting, jobs: Sequence[TraceJob], workers: int
) -> Dict[TraceJob, Union[Trace, TraceFailed]]:
    """Trace in forked children: they inherit the user's classes, so nothing is pickled by module path."""

    shares = _shares(jobs, workers)
    # Garbage that holds native objects with threads (an earlier run's ProcessGroupGloo) must be
    # freed here, where its threads exist: a child that collected it would wait forever for them
    # (seen in the suite). Then freeze: the children never collect what they inherited.
    gc.collect()
    gc.freeze()
    try:
        children = _fork_children(spec, setting, shares)
    finally:
        gc.unfreeze()
    results: Dict[TraceJob, Union[Trace, TraceFailed]] = {}
    failure = None
    for pid, read_fd, share in children:
        with os.fdopen(read_fd, "rb") as stream:
            data = stream.read()
        _, status = os.waitpid(pid, 0)
        if not data or status != 0:
            failure = failure or RuntimeError(
                f"A forked planner worker died while tracing {share[0].traced.label} (exit status {status}); "
                "SHARDWISE_PLAN_DEBUG=1 shows its output."
            )
            continue
        results.update(zip(share, pickle.loads(data)))
    if failure is not None:
        raise failure
    return results


def _fork_children(spec: ModelSpec, setting: Setting, shares: list) -> list:
    children = []
    for share in shares:
        read_fd, write_fd = os.pipe()
        pid = os.fork()
        if pid == 0:  # the child: trace its share, send the results, leave without cleanup handlers
            code = 0
            try:
                os.close(read_fd)
                _child(spec, setting, share, write_fd)
            except BaseException:
                import traceback

                traceback.print_exc()
                code = 1
            finally:
                os._exit(code)
        os.close(write_fd)
        children.append((pid, read_fd, share))
    return children


def _child(spec: ModelSpec, setting: Setting, share: Sequence[TraceJob], fd: int) -> None:
    torch.set_num_threads(1)
    if not os.environ.get("SHARDWISE_PLAN_DEBUG"):
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, 1)
        os.dup2(devnull, 2)
    tracker = active_tracker()
    if tracker is not None:
        tracker.stop()  # this copy of the user's tracker only: the parent's keeps running
    with fake_world(setting.world_size):
        out = [_run(spec, setting, job) for job in share]
    data = pickle.dumps(out)
    with os.fdopen(fd, "wb") as stream:
        stream.write(data)


def _drive(header: bytes, pending: "queue.Queue[TraceJob]", results: Dict[TraceJob, Any], errors: list) -> None:
    """Feed one worker process jobs until none are left (runs in a thread of the planning process)."""
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(p for p in sys.path if p))
    with tempfile.TemporaryFile() as log:
        proc = subprocess.Popen(
            [sys.executable, "-m", "shardwise.plan.jobs"],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            env=env,
            stderr=None if os.environ.get("SHARDWISE_PLAN_DEBUG") else log,
        )
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
                print(
                    f"[plan worker] {job.traced.label} depth {job.depth}: {time.perf_counter() - start:.2f}s",
                    file=sys.stderr,
                )
            _send(results, pickle.dumps(result))


def _portable(spec: Any) -> Optional[bytes]:
    """The pickled object, if a fresh interpreter can load it (every class it names is importable there)."""
    modules: set = set()

    class _Recorder(pickle.Pickler):
        def reducer_override(self, obj: Any) -> Any:
            if isinstance(obj, type) or callable(obj) and hasattr(obj, "__qualname__"):
                modules.add(getattr(obj, "__module__", None) or "__main__")
            return NotImplemented

    buffer = io.BytesIO()
    try:
        _Recorder(buffer, protocol=pickle.HIGHEST_PROTOCOL).dump(spec)
    except Exception:
        return None
    for name in modules:
        module = sys.modules.get(name)
        if name in ("__main__", "__mp_main__") or module is None or getattr(module, "__spec__", None) is None:
            return None  # defined in a script, a notebook or exec'd code: no module path to import
    return buffer.getvalue()


__all__ = ["TraceJob", "Setting", "run_jobs", "default_workers"]


if __name__ == "__main__":
    _serve()

"""What a shardwise launcher tells its workers (distributed/context.py), and what it keeps off the terminal.

The LaunchContext is one JSON value in one environment variable, written by the launcher and read
once by each worker: the in-process tests check its round trip and its refusals (another version,
a field it does not know, a value JSON cannot carry); a real 2-rank `shardwise.launch` checks that
the workers see the launching process's seed and added fields, the launcher's run directory, and
their own rank through the one rank question (env.global_rank). The failure tests start workers
that fail and check that torch's elastic-agent log records do not reach stderr, and that the
verdict names the file where they went instead.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import tempfile

import pytest

import shardwise
from shardwise.distributed import context, progress
from shardwise.distributed.context import CONTEXT_ENV, LaunchContext, LaunchContextError
from shardwise.distributed.env import detect_env, global_rank, is_global_zero
from shardwise.distributed.launch import WorkerFailedError

HERE = os.path.dirname(os.path.abspath(__file__))
SRC = os.path.abspath(os.path.join(HERE, "..", "..", "src"))
# A log record in torch's format (glog-like: level letter, date, time, pid, file:line]), as the elastic
# agent printed them: "E1124 07:04:52.674000 8055 .../elastic/multiprocessing/api.py:836] failed ...".
TORCH_RECORD = re.compile(r"^[EWIDC]\d{4} \d\d:\d\d:\d\d", re.M)
LOG_NAMED = re.compile(r"torch's elastic agent logged to (\S+)$", re.M)


def _env(**extra: str) -> dict:
    env = {k: v for k, v in os.environ.items() if k not in (CONTEXT_ENV, "RANK", "WORLD_SIZE")}
    env["PYTHONPATH"] = os.pathsep.join([SRC, env.get("PYTHONPATH", "")])
    env.update(extra)
    return env


# ------------------------------------------------------------------ the value
def test_round_trip_and_defaults():
    assert LaunchContext() == LaunchContext.from_json(LaunchContext().to_json())
    assert LaunchContext().launched_by_shardwise is False and LaunchContext().run_dir is None
    full = LaunchContext(
        launched_by_shardwise=True, run_dir="/r", seed=7, preempt_grace_s=3.0, plan_choice={"name": "fsdp", "m": 2}
    )
    assert LaunchContext.from_json(full.to_json()) == full
    assert full.replace(seed=8).seed == 8 and full.seed == 7
    with pytest.raises(TypeError):
        full.replace(no_such_field=1)
    with pytest.raises(TypeError, match="JSON values only"):
        LaunchContext(plan_choice={"blocks": {object()}})
    with pytest.raises(TypeError, match="plan_choice must be a dict"):
        LaunchContext(plan_choice="fsdp:Block:1x2")


def test_another_version_or_field_is_a_clear_error(monkeypatch):
    other = json.dumps({**json.loads(LaunchContext().to_json()), "version": context.VERSION + 1})
    with pytest.raises(LaunchContextError, match=r"version .* different shardwise installations"):
        LaunchContext.from_json(other)
    extra = json.dumps({**json.loads(LaunchContext().to_json()), "tensor_parallel": 2})
    with pytest.raises(LaunchContextError, match="tensor_parallel"):
        LaunchContext.from_json(extra)
    with pytest.raises(LaunchContextError, match="not valid JSON"):
        LaunchContext.from_json("fsdp:Block:1x2")
    # In a worker: the first read stops it, naming the variable. (In this process, as a fresh one: nothing read
    # yet; a `python -c` of this cost an interpreter and shardwise's imports.)
    monkeypatch.setattr(context, "_current", None)
    monkeypatch.setenv(CONTEXT_ENV, other)
    with pytest.raises(LaunchContextError, match=CONTEXT_ENV):
        context.current()


def test_a_process_no_launcher_started_gets_the_defaults_and_reads_once(monkeypatch):
    monkeypatch.setattr(context, "_current", None)  # as in a fresh process: nothing read yet
    monkeypatch.delenv(CONTEXT_ENV, raising=False)
    read = context.current()
    monkeypatch.setenv(CONTEXT_ENV, "changed later")
    assert context.current() is read
    assert LaunchContext.from_json(read.to_json()) == LaunchContext()


def test_exported_is_for_the_workers_only(monkeypatch):
    monkeypatch.delenv(CONTEXT_ENV, raising=False)
    with context.using(LaunchContext(seed=1)):
        with context.exported(LaunchContext(run_dir="/x", launched_by_shardwise=True)):
            assert LaunchContext.from_json(os.environ[CONTEXT_ENV]).run_dir == "/x"
            assert context.current() == LaunchContext(seed=1)  # the launcher keeps its own
        assert CONTEXT_ENV not in os.environ


def test_the_rank_question_outside_a_launch(monkeypatch):
    for name in ("RANK", "WORLD_SIZE", "SLURM_NTASKS"):
        monkeypatch.delenv(name, raising=False)
    assert global_rank() == 0 and is_global_zero()
    monkeypatch.setenv("RANK", "3")
    monkeypatch.setenv("WORLD_SIZE", "4")
    assert global_rank() == 3 and not is_global_zero()
    monkeypatch.setenv("RANK", "three")
    assert global_rank() == 0  # never raises: it names files and decides who prints


# ------------------------------------------------------------ through a launch
def _what_the_worker_sees():
    seen = context.current()
    return {
        "rank": global_rank(),
        "env_rank": int(os.environ["RANK"]),
        "zero": is_global_zero(),
        "launcher": detect_env().launcher,
        "context": seen.to_json(),
        "progress_dir": progress.run_dir(),
    }


def test_workers_get_the_launching_processs_context():
    shardwise.seed_everything(4321)
    assert context.current().seed == 4321
    choice = {"name": "fsdp", "blocks": ["Block"], "micro_batch": 2, "accumulation": 3}
    seen = shardwise.launch(_what_the_worker_sees, devices=2, context=context.current().replace(plan_choice=choice))
    assert [s["rank"] for s in seen] == [s["env_rank"] for s in seen] == [0, 1]
    assert [s["zero"] for s in seen] == [True, False]
    contexts = [LaunchContext.from_json(s["context"]) for s in seen]
    assert contexts[0] == contexts[1]
    ctx = contexts[0]
    assert ctx.launched_by_shardwise and all(s["launcher"] == "shardwise" for s in seen)
    assert ctx.seed == 4321 and ctx.plan_choice == choice
    assert ctx.run_dir and all(s["progress_dir"] == ctx.run_dir for s in seen)
    assert ctx.preempt_grace_s == 120.0  # resolved by the launcher (SHARDWISE_PREEMPT_GRACE_S unset)
    assert not os.path.exists(ctx.run_dir)  # removed after a run that succeeded
    assert context.current().plan_choice is None  # given to these workers, not this process's


# ------------------------------------------------------- the agent's log records
FAILING_SCRIPT = """
import os, sys, time
if os.environ["RANK"] == "0":
    raise ValueError("rank 0 fails on purpose")
time.sleep(60)  # rank 1 is stopped by the launcher
"""


def _fail_on_rank_0():
    if os.environ["RANK"] == "0":
        raise ValueError("rank 0 fails on purpose")
    import time

    time.sleep(60)


def _check_the_log(err: str, message: str) -> None:
    assert not TORCH_RECORD.search(err), err[-3000:]
    assert "torch.distributed.elastic" not in err and "ProcessExitedException" not in err, err[-3000:]
    named = LOG_NAMED.search(message)
    assert named, message
    with open(named.group(1)) as fh:
        log = fh.read()
    assert "torch.distributed.elastic" in log and "failed (exitcode: 1)" in log, log


def test_shardwise_launch_keeps_torchs_records_off_stderr(tmp_path):
    script = tmp_path / "fail.py"
    script.write_text(FAILING_SCRIPT)
    proc = subprocess.run(
        [sys.executable, "-m", "shardwise.cli", "launch", "--nproc-per-node", "2", str(script)],
        env=_env(TMPDIR=str(tmp_path)),  # the kept run directory lands here
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 1, proc.stderr[-3000:]
    assert "[shardwise] rank 0 exited with code 1" in proc.stderr and "ValueError: rank 0 fails" in proc.stderr
    _check_the_log(proc.stderr, proc.stderr)


def test_launch_fn_keeps_torchs_records_off_stderr(tmp_path, monkeypatch, capfd):
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))  # the kept run directory lands here
    capfd.readouterr()
    with pytest.raises(WorkerFailedError) as info:
        shardwise.launch(_fail_on_rank_0, devices=2)
    err = capfd.readouterr().err
    assert info.value.rank == 0 and str(info.value).startswith("[shardwise] rank 0 exited with code 1")
    _check_the_log(err, str(info.value))

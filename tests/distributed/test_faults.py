"""Faults during training (issue 11): no 30-minute hang, the guilty rank named.

Each multi-process scenario starts a real 2-rank run (fault_script.py) that goes
wrong on purpose, through one of the launchers users have: the Trainer's own
supervisor (`python script.py`), `shardwise launch` (torch's elastic agent),
and `shardwise.launch(fn)`. They assert the exit code, what the verdict on
stderr names, and a wall-time bound that is generous for a shared, slow
machine (collective timeout 10 s; bound = timeout + start-up + 60 s or more).

The scenarios run as subprocesses, two at a time, started by one module fixture
when the first of their tests asks: a hung rank spends most of its run waiting
for the collective timeout, and another scenario's start-up uses that time. The
error-on-every-rank runs under the script launcher, `shardwise fit` and torchrun
are scenarios too (their slow teardown / exit waits overlap another's start-up).
Each test then checks its own scenario's outcome. The in-process tests (the verdict
logic, `shardwise.launch(fn)` failures) run after them, alone.
"""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import textwrap
import time
from concurrent.futures import ThreadPoolExecutor

import pytest

import shardwise
from shardwise.distributed import context, faults, progress
from shardwise.distributed import verdict as launcher_verdict
from shardwise.distributed.launch import WorkerFailedError

HERE = os.path.dirname(os.path.abspath(__file__))
SCRIPT = os.path.join(HERE, "fault_script.py")
SRC = os.path.abspath(os.path.join(HERE, "..", "..", "src"))
TIMEOUT_S = 10
# Start-up of two ranks (imports, process group) plus teardown, on a loaded 2-core machine.
SLACK_S = 90
# Scenarios at once: one waiting out a timeout while another starts; more would slow the start-ups
# (CPU-bound) toward the collective timeout.
LANES = 2


def _env(**extra: str) -> dict:
    # Nothing the pytest process set for its own runs (rank, run directory, collective checks) leaks in.
    dropped = (context.CONTEXT_ENV, "RANK", "WORLD_SIZE", faults.CHECK_COLLECTIVES_ENV, "TORCH_DISTRIBUTED_DEBUG")
    env = {k: v for k, v in os.environ.items() if k not in dropped}
    env["PYTHONPATH"] = os.pathsep.join([SRC, HERE, env.get("PYTHONPATH", "")])
    env.update(extra)
    return env


def _command(launcher: str, mode: str, strategy: str, out_dir) -> list:
    args = [SCRIPT, mode, strategy, str(TIMEOUT_S), str(out_dir)]
    if launcher == "script":
        return [sys.executable, *args]
    return [sys.executable, "-m", "shardwise.cli", "launch", "--nproc-per-node", "2", *args]


def _run(launcher: str, mode: str, strategy: str, out_dir):
    start = time.monotonic()
    proc = subprocess.run(
        _command(launcher, mode, strategy, out_dir),
        env=_env(),
        capture_output=True,
        text=True,
        timeout=TIMEOUT_S + SLACK_S + 120,
    )
    return proc, time.monotonic() - start


def _start_and_wait_ready(command, out_dir, **env):
    proc = subprocess.Popen(command, env=_env(**env), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    deadline = time.monotonic() + 120
    while not all(os.path.exists(os.path.join(out_dir, f"ready.{r}")) for r in (0, 1)):
        assert proc.poll() is None, proc.communicate()[1][-3000:]
        assert time.monotonic() < deadline, "workers never became ready"
        time.sleep(0.1)
    return proc


def _signal_when_ready(launcher: str, mode: str, signum: int, out_dir, **env):
    """Start a preemption scenario, signal the launcher once both workers are up; (returncode, stderr, seconds
    from the signal to the exit)."""
    proc = _start_and_wait_ready(_command(launcher, mode, "ddp", out_dir), out_dir, **env)
    start = time.monotonic()
    proc.send_signal(signum)
    _, err = proc.communicate(timeout=120)
    return proc.returncode, err, time.monotonic() - start


@pytest.fixture(scope="module")
def scenarios(request, tmp_path_factory):
    """Every subprocess scenario the selected tests need, submitted at once to LANES threads: name -> future."""
    wanted = {
        item.callspec.params.get("scenario") if hasattr(item, "callspec") else None
        for item in request.session.items
        if item.module is request.module
    }
    jobs = {
        "hang-script-ddp": lambda d: _run("script", "hang", "ddp", d),
        "hang-shardwise-launch-fsdp": lambda d: _run("shardwise-launch", "hang", "fsdp", d),
        "hang-script-deepspeed": lambda d: _run("script", "hang", "deepspeed", d),
        "kill": lambda d: _run("script", "kill", "fsdp", d),
        "raise0": lambda d: _run("shardwise-launch", "raise0", "fsdp", d),
        "preempt-script-SIGTERM": lambda d: _signal_when_ready("script", "preempt", signal.SIGTERM, d),
        "preempt-shardwise-launch-SIGUSR1": lambda d: _signal_when_ready(
            "shardwise-launch", "preempt", signal.SIGUSR1, d
        ),
        "ignore": lambda d: _signal_when_ready("script", "ignore", signal.SIGTERM, d, SHARDWISE_PREEMPT_GRACE_S="3"),
        "every-rank-script": lambda d: _every_rank_by_script(d),
        "every-rank-fit": lambda d: _every_rank_by_fit(d),
        "every-rank-torchrun": lambda d: _every_rank_by_torchrun(d),
    }
    pool = ThreadPoolExecutor(max_workers=LANES)
    dirs = {name: tmp_path_factory.mktemp(name) for name in jobs if name in wanted}
    # A hang beside a scenario that is starting up: the hang's waiting is what the other's start-up fills.
    order = [
        "hang-script-ddp",
        "kill",
        "hang-shardwise-launch-fsdp",
        "raise0",
        "hang-script-deepspeed",
        "every-rank-script",
        "preempt-script-SIGTERM",
        "every-rank-fit",
        "preempt-shardwise-launch-SIGUSR1",
        "every-rank-torchrun",
        "ignore",
    ]
    futures = {name: pool.submit(jobs[name], dirs[name]) for name in order if name in dirs}
    yield {name: (future, dirs[name]) for name, future in futures.items()}
    pool.shutdown(wait=True, cancel_futures=True)


# ------------------------------------------------------------------ hangs
@pytest.mark.parametrize(
    "scenario",
    [
        "hang-script-ddp",
        "hang-shardwise-launch-fsdp",
        # ZeRO's own process groups used to keep torch's 30-minute default timeout.
        pytest.param("hang-script-deepspeed", marks=pytest.mark.slow),
    ],
)
def test_hung_rank_is_named_with_its_hook_step_and_stack(scenarios, scenario):
    proc, elapsed = scenarios[scenario][0].result()
    err = proc.stderr
    assert proc.returncode != 0, err[-3000:]
    assert "UNREACHABLE" not in proc.stdout
    # The rank that stopped responding, where, and the one that waited for it.
    assert "rank 1 stopped responding in training_step after step 3" in err, err[-3000:]
    assert "rank 0 waited for it in a collective" in err and f"timed out after {TIMEOUT_S} s" in err
    assert "rank 1's Python stack" in err and "in training_step" in err.split("rank 1's Python stack")[1]
    # Every rank is gone soon after the timeout, not after torch's 30-minute default.
    assert elapsed < TIMEOUT_S + SLACK_S, elapsed


# ---------------------------------------------------------------- killed
@pytest.mark.parametrize("scenario", ["kill"])
def test_killed_rank_names_the_signal_and_the_oom_killer(scenarios, scenario):
    proc, elapsed = scenarios[scenario][0].result()
    err = proc.stderr
    assert proc.returncode == 128 + signal.SIGKILL, err[-3000:]
    assert "rank 1 was killed by SIGKILL" in err, err[-3000:]
    assert "dmesg" in err and "out-of-memory" in err
    assert "traceback is printed above" not in err
    # rank 0's "Connection closed by peer" is reported as a consequence, not as the cause.
    verdict = err[err.index("rank 1 was killed by SIGKILL") :]
    assert "Connection closed" not in verdict.split("\n")[0]
    assert elapsed < SLACK_S, elapsed


# ------------------------------------------------------ first failure wins
@pytest.mark.parametrize("scenario", ["raise0"])
def test_first_failure_wins_over_a_peers_closed_connection_under_shardwise_launch(scenarios, scenario):
    proc, elapsed = scenarios[scenario][0].result()
    err = proc.stderr
    assert proc.returncode == 1, err[-3000:]
    verdict = err[err.index("[shardwise launch] node 0:") :]
    assert "rank 0 exited with code" in verdict and "ValueError: config error" in verdict, verdict[-3000:]
    assert "rank 0's traceback (the first failure)" in verdict
    assert 'raise ValueError("config error' in verdict  # rank 0's own traceback, in the verdict
    assert elapsed < SLACK_S, elapsed


# ------------------------------------------------------------- preemption
@pytest.mark.parametrize("scenario", ["preempt-script-SIGTERM", "preempt-shardwise-launch-SIGUSR1"])
def test_launcher_forwards_preemption_waits_and_exits_75(scenarios, scenario):
    future, out_dir = scenarios[scenario]
    returncode, err, _ = future.result()
    assert returncode == 75, err[-3000:]
    # Every worker got the signal itself (and had the second it takes to "save").
    signum = signal.SIGTERM if scenario.endswith("SIGTERM") else signal.SIGUSR1
    for rank in (0, 1):
        assert (out_dir / f"signal.{rank}").read_text() == signal.Signals(signum).name
    assert "exited with 75" in err


@pytest.mark.parametrize("scenario", ["ignore"])
def test_worker_ignoring_preemption_is_killed_after_the_grace_period(scenarios, scenario):
    returncode, err, after_signal = scenarios[scenario][0].result()
    assert returncode == 128 + signal.SIGTERM, err[-3000:]
    assert "did not exit within the 3 s grace period" in err
    assert 3 <= after_signal < 60


# --------------------------------------------- shardwise.launch(fn), in-process
def _raise_on_rank0_after_peer_sees_closed_connection() -> None:
    import datetime

    import torch
    import torch.distributed as dist

    faults.install_worker()
    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=60))
    rank = dist.get_rank()
    dist.all_reduce(torch.ones(2))
    progress.mark("training_step", 1)
    if rank == 0:
        try:
            raise ValueError("config error: lr must be positive (rank 0)")
        finally:  # clean-up that closes the connection long before the exception reaches the top
            dist.destroy_process_group()
            # ... and lasts until rank 1 has recorded its failure, however slow the machine.
            deadline = time.monotonic() + 60
            while not os.path.exists(os.path.join(progress.run_dir(), "error.1.json")) and time.monotonic() < deadline:
                time.sleep(0.05)
    dist.all_reduce(torch.ones(2))  # rank 1: "Connection closed by peer", recorded before rank 0 exits


def test_first_failure_wins_over_a_peers_closed_connection_in_launch_fn():
    start = time.monotonic()
    with pytest.raises(WorkerFailedError) as err:
        shardwise.launch(_raise_on_rank0_after_peer_sees_closed_connection, devices=2)
    message = str(err.value)
    first_line = message.splitlines()[0]
    assert "rank 0 exited with code 1 in training_step after step 1: ValueError: config error" in first_line, message
    assert "rank 0's traceback (the first failure)" in message and "destroy_process_group" not in first_line
    assert err.value.rank == 0
    assert "after it: rank 1" in message  # the consequence is still mentioned, after the cause
    assert time.monotonic() - start < SLACK_S


# ---------------------------------------------------------- in-process parts
def _outcome(rank, kind, at, code=1):
    record = {
        "message": {
            "message": kind,
            "extraInfo": {"py_callstack": f"Traceback of rank {rank}\n", "timestamp": str(int(at))},
        },
        "shardwise": {
            "rank": rank,
            "time": at,
            "kind": kind,
            "summary": f"Error: {kind} on {rank}",
            "hook": "training_step",
            "step": 7,
        },
    }
    return launcher_verdict.Outcome(rank=rank, exitcode=code, seen_at=at, record=record)


def test_root_cause_ignores_consequences_and_orders_by_sub_second_time():
    # A peer's closed connection recorded first (clocks, exit order) is still not the cause.
    outcomes = [_outcome(0, "secondary", 100.1), _outcome(1, "primary", 100.4), _outcome(2, "primary", 100.7)]
    assert launcher_verdict.root_cause(outcomes).rank == 1
    verdict = launcher_verdict.diagnose(outcomes)
    assert verdict.startswith(
        "[shardwise] rank 1 exited with code 1 in training_step after step 7: Error: primary on 1"
    )
    assert "Traceback of rank 1" in verdict and "Traceback of rank 0" not in verdict
    killed = launcher_verdict.Outcome(rank=3, exitcode=-signal.SIGKILL, seen_at=100.2)
    assert launcher_verdict.root_cause([_outcome(0, "secondary", 100.1), killed]).rank == 3
    assert faults.classify("RuntimeError: [pair.cc:553] Connection closed by peer [127.0.0.1]:4531") == "secondary"
    assert faults.classify("RuntimeError: Timed out waiting 5000ms for recv operation to complete") == "timeout"
    assert faults.classify("ValueError: warmup_steps must be < max_steps") == "primary"


def test_the_record_names_where_a_rank_failed_not_the_clean_up_after_it(tmp_path, monkeypatch):
    monkeypatch.setenv("RANK", "0")
    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.delenv("TORCHELASTIC_ERROR_FILE", raising=False)
    monkeypatch.setattr(progress, "_buffer", None)
    with context.using(context.LaunchContext(run_dir=str(tmp_path), launched_by_shardwise=True)):
        progress.mark("configure_model", 0)
        try:
            raise ValueError("bad width 7: use a multiple of 8")
        except ValueError as exc:
            faults.note_failure(exc)  # as the Trainer does when fit() catches it
            error = exc
        progress.mark("teardown", 0)  # the clean-up hooks run before the exception reaches the top
        record = faults.record_exception(error)
        assert faults.shown_by_launcher()  # so the worker prints nothing of it: the verdict will
    assert (record["shardwise"]["hook"], record["shardwise"]["step"]) == ("configure_model", 0)
    assert record["shardwise"]["types"][:2] == ["ValueError", "Exception"]
    # The launcher stopped it (SIGTERM) during that clean-up, after a peer failed the same way.
    stopped = launcher_verdict.Outcome(rank=0, exitcode=-signal.SIGTERM, record=record)
    later = _outcome(1, "primary", record["shardwise"]["time"] + 0.5)
    verdict = launcher_verdict.diagnose([stopped, later])
    assert verdict.startswith(
        "[shardwise] rank 0 failed in configure_model after step 0: ValueError: bad width 7: use a multiple of 8; "
        "SIGTERM stopped it during its clean-up\n"
    ), verdict
    assert "code -15" not in verdict and "after it: rank 1: Error: primary on 1" in verdict


def test_progress_records_name_the_rank_that_fell_behind(tmp_path, monkeypatch):
    monkeypatch.setenv("RANK", "1")
    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.setattr(progress, "_buffer", None)
    with context.using(context.LaunchContext(run_dir=str(tmp_path))):
        for step in range(5):
            progress.mark("training_step", step)
    mine = progress.read_all(str(tmp_path))[1]
    assert (mine.rank, mine.step, mine.hook, mine.pid) == (1, 4, "training_step", os.getpid())
    records = {1: mine, 0: progress.Progress(0, 5, "backward", mine.time + 3, mine.started, 1)}
    text = progress.describe_stall([0], records=records, timeout_s=20, now=mine.time + 24)
    assert text.startswith("rank 1 stopped responding in training_step after step 4 (no progress for 24 s)")
    assert "rank 0 waited for it in a collective (in backward after step 5) and timed out after 20 s" in text


def test_timeout_reaches_every_strategy_from_the_trainer_side():
    from shardwise.strategies import build_strategy

    for name in ("single", "ddp", "fsdp"):
        strategy = build_strategy(name)
        strategy.connect("cpu", timeout_s=42)
        assert strategy.timeout_s == 42.0
    with pytest.raises(ValueError, match="positive number of seconds"):
        build_strategy("ddp").connect("cpu", timeout_s=0)


# ------------------------------------------------- mismatched collectives
def _collective_on_rank0_only() -> None:
    from shardwise.strategies import FSDPStrategy

    strategy = FSDPStrategy(timeout_s=150)
    strategy.connect("cpu")
    strategy.setup_environment()
    progress.mark("training_step", 2)
    if strategy.global_rank == 0:
        strategy.reduce(1.0)  # a collective only rank 0 calls
    strategy.barrier()


def test_check_collectives_names_a_collective_called_from_one_rank(monkeypatch):
    monkeypatch.setenv(faults.CHECK_COLLECTIVES_ENV, "1")
    start = time.monotonic()
    with pytest.raises(WorkerFailedError) as err:
        shardwise.launch(_collective_on_rank0_only, devices=2)
    message = str(err.value)
    # Named at once (no 150 s timeout): which rank ran which collective.
    assert "Detected mismatch between collectives" in message and "in training_step after step 2" in message, message
    assert "ALLREDUCE" in message and "BARRIER" in message
    assert time.monotonic() - start < 120


# ------------------------------------------ an error raised on every rank, shown once
# configure_model raises on every rank. With SLOW_TEARDOWN set, rank 0's teardown lasts long enough that,
# on most runs, the launcher stops it (SIGTERM) while it is still cleaning up: the verdict must still name the hook the
# error came from (not "teardown") and the error, not the signal. Which rank fails first, and whether
# rank 0 records before it is stopped, is up to the machine's load: nothing below depends on it.
# With SLOW_EXIT set, rank 0 lingers after its record and its process group's exit barrier, and rank 1
# fails a second later: rank 0 is then the first failure and is stopped (SIGTERM) after rank 1 exited,
# what a busy machine does to the slower rank's interpreter shutdown.
EVERY_RANK_MODULE = textwrap.dedent("""
    import os, time
    import torch, shardwise

    if os.environ.get("RANK") == "0" and os.environ.get("SLOW_EXIT"):
        import atexit
        atexit.register(time.sleep, 20)  # registered first, so it runs after the process group's exit barrier

    class WidthModule(shardwise.TrainModule):
        def __init__(self, width: int = 7):
            super().__init__()
            self.width = width

        def configure_model(self):
            if os.environ.get("RANK") == "1" and os.environ.get("SLOW_EXIT"):
                time.sleep(1)
            raise ValueError(f"bad width {self.width}: use a multiple of 8")

        def teardown(self, stage):
            if os.environ.get("RANK") == "0" and os.environ.get("SLOW_TEARDOWN"):
                time.sleep(20)

        def training_step(self, batch, batch_idx):
            return self.net(batch[0]).mean()

        def configure_optimizers(self):
            return torch.optim.SGD(self.parameters(), lr=0.1)

    class Rows(torch.utils.data.Dataset):
        def __len__(self):
            return 16

        def __getitem__(self, i):
            return (torch.ones(8) * i,)

    def train():
        trainer = shardwise.Trainer(accelerator="cpu", devices=2, strategy="ddp", max_steps=2, logger=False,
                                    enable_progress_bar=False, enable_checkpointing=False)
        trainer.fit(WidthModule(), torch.utils.data.DataLoader(Rows(), batch_size=4))

    if __name__ == "__main__":
        train()
        print("UNREACHABLE: the run finished")
""")
FIRST_LINE = re.compile(
    r"^\[shardwise\] rank ([01]) (?:exited with code (\d+)|failed) in configure_model after step 0: "
    r"ValueError: bad width 7: use a multiple of 8",
    re.M,
)


def _every_rank_script(tmp_path):
    (tmp_path / "every_rank.py").write_text(EVERY_RANK_MODULE)
    return str(tmp_path / "every_rank.py")


def _agent_log(text: str) -> str:
    match = re.search(r"torch's elastic agent logged to (\S+)", text)
    assert match, text[-3000:]
    with open(match.group(1)) as fh:
        return fh.read()


def _assert_shown_once(text: str) -> None:
    """The verdict names configure_model and shows one traceback; every rank's is kept in the agent log."""
    assert text.count("Traceback (most recent call last)") == 1, text[-4000:]
    assert text.count('raise ValueError(f"bad width') == 1, text[-4000:]
    assert "[rank0]" not in text and "[rank1]" not in text, text[-4000:]
    first = FIRST_LINE.search(text)
    assert first, text[-4000:]
    assert "teardown" not in text and "code -15" not in text, text[-4000:]
    other = 1 - int(first.group(1))
    assert f"after it: rank {other}: " in text or f"stopped the other 1 rank(s) ({other})" in text, text[-4000:]
    log = _agent_log(text)
    assert f"rank {first.group(1)}'s traceback (ValueError: bad width 7" in log, log[-3000:]
    assert 'raise ValueError(f"bad width' in log


def _every_rank_by_script(out_dir):
    command = [sys.executable, _every_rank_script(out_dir)]
    return subprocess.run(command, env=_env(SLOW_TEARDOWN="1"), capture_output=True, text=True, timeout=400)


@pytest.mark.parametrize("scenario", ["every-rank-script"])
def test_error_on_every_rank_is_shown_once_by_the_script_launcher(scenarios, scenario):
    proc = scenarios[scenario][0].result()
    assert proc.returncode == 1, proc.stderr[-3000:]
    assert "UNREACHABLE" not in proc.stdout
    assert proc.stderr.startswith("[shardwise] rank "), proc.stderr[-3000:]  # nothing from the workers before it
    _assert_shown_once(proc.stderr)


def test_error_on_every_rank_is_shown_once_by_launch_fn(tmp_path, capfd, monkeypatch):
    _every_rank_script(tmp_path)
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join([str(tmp_path), os.environ.get("PYTHONPATH", "")]))
    monkeypatch.setenv("SLOW_TEARDOWN", "1")
    import every_rank

    capfd.readouterr()
    with pytest.raises(WorkerFailedError) as err:
        shardwise.launch(every_rank.train, devices=2)
    workers = capfd.readouterr().err
    assert "Traceback" not in workers and "bad width" not in workers, workers[-3000:]  # the workers printed nothing
    assert err.value.exitcode == 1 and err.value.error_types[:2] == ("ValueError", "Exception")
    _assert_shown_once(str(err.value))
    # The summary is the same verdict, one line per failing rank, no traceback (the command line prints it).
    assert "Traceback" not in err.value.summary and FIRST_LINE.search(err.value.summary)


def _every_rank_by_fit(out_dir):
    _every_rank_script(out_dir)
    command = [sys.executable, "-m", "shardwise.cli", "fit", "--model", "every_rank.WidthModule"]
    command += ["--data", "every_rank.Rows", "--trainer.devices", "2", "--trainer.strategy", "ddp"]
    command += ["--trainer.max_steps", "2", "--trainer.logger", "false", "--trainer.enable_checkpointing", "false"]
    env = _env(PYTHONPATH=os.pathsep.join([SRC, str(out_dir)]), SLOW_EXIT="1")
    return subprocess.run(command, env=env, capture_output=True, text=True, timeout=400, cwd=out_dir)


@pytest.mark.parametrize("scenario", ["every-rank-fit"])
def test_error_on_every_rank_is_one_line_each_under_shardwise_fit(scenarios, scenario):
    proc = scenarios[scenario][0].result()
    err = proc.stderr
    # A usage mistake's status, as with one device, also when the launcher stopped the first failing rank on
    # its way out because the other exited first.
    assert proc.returncode == 2, err[-3000:]
    assert "Traceback" not in err and "shardwise fit: error" not in err, err[-3000:]  # no worker printed its own
    lines = [line for line in err.splitlines() if "bad width 7" in line]
    assert len(lines) == 2 and FIRST_LINE.match(lines[0]) and "after it: rank" in lines[1], err[-3000:]
    assert 'raise ValueError(f"bad width' in _agent_log(err)  # the traceback is kept


def _every_rank_by_torchrun(out_dir):
    command = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", _every_rank_script(out_dir)]
    return subprocess.run(command, env=_env(), capture_output=True, text=True, timeout=400)


@pytest.mark.parametrize("scenario", ["every-rank-torchrun"])
def test_torchrun_workers_still_print_their_own_traceback(scenarios, scenario):
    # Under torchrun shardwise is not the launcher: nobody else would show the user the traceback.
    proc = scenarios[scenario][0].result()
    assert proc.returncode != 0
    assert 'raise ValueError(f"bad width' in proc.stderr and "ValueError: bad width 7" in proc.stderr
    assert "[shardwise] rank" not in proc.stderr  # no verdict of ours: torchrun reports

"""`shardwise.launch(fn)` forks its workers from a warm fork server on Linux (distributed/forkserver.py).

A forked worker must be indistinguishable from a spawned one where a user could tell: it sees the
launching process's environment and working directory as they are at this launch (not as they were
when the server started, at an earlier launch), writes to the launcher's current standard output
(here a capture that did not exist when the server started), gets its own rank from torch's agent,
runs with the thread count its OMP_NUM_THREADS says, and is still a child the launcher can signal.
A SIGKILLed launcher takes its forked workers with it (the fork server outlives it while they run, so
they watch the launcher themselves).
SHARDWISE_START_METHOD=spawn goes back to spawning, and a value it does not know is refused by name.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import time

import pytest

import shardwise
from shardwise.distributed import forkserver

LINUX = sys.platform.startswith("linux")


def _report(tag: str) -> dict:
    print(f"worker says {tag} from rank {os.environ['RANK']}", flush=True)
    return {
        "late": os.environ.get("SHARDWISE_TEST_LATE"),
        "gone": os.environ.get("SHARDWISE_TEST_GONE"),
        "cwd": os.getcwd(),
        "rank": os.environ["RANK"],
        "parent": os.getppid(),
        "torch_imported_before_fn": "torch" in sys.modules,
        "threads": __import__("torch").get_num_threads(),
    }


def test_a_later_launch_sees_the_launchers_environment_directory_and_output_as_they_are_now(
    tmp_path, monkeypatch, capfd
):
    monkeypatch.delenv(forkserver.START_METHOD_ENV, raising=False)
    monkeypatch.setenv("SHARDWISE_TEST_GONE", "set before the first launch")
    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    first = shardwise.launch(_report, "first", devices=2)  # starts the fork server if no test did
    assert [r["gone"] for r in first] == ["set before the first launch"] * 2
    assert [r["threads"] for r in first] == [1, 1]  # the launch's OMP_NUM_THREADS, not the server's

    # Changed after the server started: a forked worker must see the launcher's values of now.
    monkeypatch.delenv("SHARDWISE_TEST_GONE")
    monkeypatch.setenv("SHARDWISE_TEST_LATE", "set between the launches")
    monkeypatch.setenv("OMP_NUM_THREADS", "3")  # libgomp read the server's once: the worker must set it
    monkeypatch.chdir(tmp_path)
    capfd.readouterr()
    second = shardwise.launch(_report, "second", devices=2)
    out = capfd.readouterr().out

    assert [r["late"] for r in second] == ["set between the launches"] * 2
    assert [r["gone"] for r in second] == [None, None]
    assert [r["cwd"] for r in second] == [str(tmp_path)] * 2
    assert [r["threads"] for r in second] == [3, 3]
    assert sorted(r["rank"] for r in second) == ["0", "1"]  # torch's agent's variables win
    for rank in (0, 1):
        assert f"worker says second from rank {rank}" in out, out
    if LINUX:  # forked from the server (which already imported torch), not from this process
        assert all(r["parent"] != os.getpid() and r["torch_imported_before_fn"] for r in second)


def test_spawn_on_request_and_an_unknown_method_refused(monkeypatch):
    monkeypatch.setenv(forkserver.START_METHOD_ENV, "spawn")
    results = shardwise.launch(_report, "spawned", devices=2)
    assert all(r["parent"] == os.getpid() for r in results)
    monkeypatch.setenv(forkserver.START_METHOD_ENV, "fork")
    with pytest.raises(ValueError, match="SHARDWISE_START_METHOD='fork'.*'forkserver'.*'spawn'"):
        shardwise.launch(_report, "never", devices=2)


_SLEEPER = textwrap.dedent(
    """
    import os, sys, time
    import shardwise

    def sleep(folder):
        open(os.path.join(folder, "pid." + os.environ["RANK"]), "w").write(str(os.getpid()))
        time.sleep(300)

    if __name__ == "__main__":
        shardwise.launch(sleep, sys.argv[1], devices=2)
    """
)


def _running(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/status") as fh:
            return "\nState:\tZ" not in fh.read()  # a zombie has exited; its parent has yet to reap it
    except FileNotFoundError:
        return False


@pytest.mark.skipif(not LINUX, reason="the fork server and /proc are Linux's")
def test_a_sigkilled_launcher_takes_its_forked_workers_with_it(tmp_path):
    script = tmp_path / "sleeper.py"
    script.write_text(_SLEEPER)
    launcher = subprocess.Popen([sys.executable, str(script), str(tmp_path)], stderr=subprocess.DEVNULL)
    pids = [tmp_path / f"pid.{rank}" for rank in (0, 1)]
    deadline = time.monotonic() + 120
    while not all(p.exists() and p.read_text() for p in pids):
        assert launcher.poll() is None and time.monotonic() < deadline, "the workers never started"
        time.sleep(0.1)
    workers = [int(p.read_text()) for p in pids]
    launcher.send_signal(signal.SIGKILL)
    launcher.wait()
    deadline = time.monotonic() + 20
    while any(_running(pid) for pid in workers) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not any(_running(pid) for pid in workers), "a worker outlived its SIGKILLed launcher"

# `shardwise launch`: the per-node launcher over torchrun's elastic agent.
# Command resolution and argument errors are checked in-process; one real
# launch checks the environment every worker gets, and that a failing worker
# makes the launcher fail instead of hang.
from __future__ import annotations

import os
import subprocess
import sys

import pytest

from shardwise.cli import launch as launch_cli
from shardwise.cli import main as shardwise_main

SRC = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..", "src")

SCRIPT = """
import os, sys
keys = ("RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "GROUP_RANK", "MASTER_ADDR", "MASTER_PORT")
with open(os.path.join(sys.argv[1], "rank" + os.environ["RANK"]), "w") as fh:
    fh.write(" ".join(os.environ[k] for k in keys[:5]))
if len(sys.argv) > 2 and os.environ["RANK"] == sys.argv[2]:
    sys.exit(3)
"""


def test_resolve_command(tmp_path):
    script = tmp_path / "train.py"
    script.write_text("pass\n")
    assert launch_cli.resolve_command(str(script), ["--lr", "1"], False) == (
        sys.executable,
        ["-u", str(script), "--lr", "1"],
    )
    assert launch_cli.resolve_command("pkg.mod", ["x"], True) == (sys.executable, ["-u", "-m", "pkg.mod", "x"])
    exe, args = launch_cli.resolve_command("shardwise", ["finetune", "--config", "c.yaml"], False)
    assert exe == sys.executable and args == ["-u", "-m", "shardwise.cli", "finetune", "--config", "c.yaml"]
    with pytest.raises(FileNotFoundError):
        launch_cli.resolve_command(str(tmp_path / "missing.py"), [], False)
    with pytest.raises(FileNotFoundError, match="neither a script nor a command"):
        launch_cli.resolve_command("no-such-command-xyz", [], False)


def test_argument_errors_are_one_line_with_exit_status_2(capsys):
    assert shardwise_main(["launch", "--nnodes", "2", "--node-rank", "2", "--master-port", "1234", "x.py"]) == 2
    err = capsys.readouterr().err
    assert "outside [0, 2)" in err and "Traceback" not in err and len(err.strip().splitlines()) == 1
    assert shardwise_main(["launch", "--nnodes", "2", "--node_rank", "0", sys.executable]) == 2
    assert "--master-port is required" in capsys.readouterr().err
    assert shardwise_main(["launch", "--nproc-per-node", "zero", "x.py"]) == 2
    assert "zero" in capsys.readouterr().err


def _run(tmp_path, *extra):
    script = tmp_path / "worker.py"
    script.write_text(SCRIPT)
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([os.path.abspath(SRC), os.environ.get("PYTHONPATH", "")]))
    return subprocess.run(
        [sys.executable, "-m", "shardwise.cli", "launch", "--nproc-per-node", "2", str(script), str(tmp_path), *extra],
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )


def test_workers_get_the_torchrun_environment_and_failures_propagate(tmp_path):
    done = _run(tmp_path)
    assert done.returncode == 0, done.stderr[-3000:]
    assert sorted(os.listdir(tmp_path)) == ["rank0", "rank1", "worker.py"]
    assert (tmp_path / "rank1").read_text() == "1 1 2 2 0"
    failed = _run(tmp_path, "1")
    assert failed.returncode == 1
    assert "node 0" in failed.stderr

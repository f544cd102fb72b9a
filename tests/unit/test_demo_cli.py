"""`shardwise demo` runs where the machine can: accelerator "auto", not a hard-coded CPU (issue 15).

Here (no CUDA) "auto" resolves to CPU processes over gloo and the table
still prints; on a GPU machine the same command now trains on the GPUs.
A first run reads cleanly (issue 26): each line once, no warning from shardwise.
"""

import inspect
import os
import re
import subprocess
import sys

import pytest
import torch

import shardwise
from shardwise.cli.demo import demo


def test_demo_defaults_to_auto_and_prints_its_table(tmp_path, capsys):
    assert inspect.signature(demo).parameters["accelerator"].default == "auto"
    rows = demo(
        devices=2,
        steps=3,
        compare_steps=3,
        nlayers=1,
        nhid=32,
        ninp=16,
        nhead=2,
        batch_size=2,
        block_size=8,
        strategies=["fsdp", "ddp"],
        root_dir=str(tmp_path),
    )
    expected = "cuda" if torch.cuda.is_available() else "cpu"
    assert [r["device"] for r in rows] == [expected, expected]
    out = capsys.readouterr().out
    assert "FSDP FULL_SHARD" in out and "DDP" in out
    assert ("GPU" if expected == "cuda" else "2 CPU processes") in out


def test_demo_refuses_an_unknown_accelerator_before_starting_processes(tmp_path):
    with pytest.raises(ValueError, match="accelerator"):
        demo(devices=2, accelerator="tpu", root_dir=str(tmp_path))


def test_demo_prints_each_line_once_and_no_warning_of_ours(tmp_path):
    # The command a new user types, on the default strategies, with a model small enough to be quick;
    # every warning shown (PYTHONWARNINGS=default: first occurrence per place, in the workers too).
    command = [sys.executable, "-m", "shardwise.cli", "demo", "--steps", "3", "--compare_steps", "3"]
    command += ["--nlayers", "1", "--nhid", "32", "--ninp", "16", "--nhead", "2", "--root_dir", str(tmp_path / "d")]
    env = {**os.environ, "PYTHONWARNINGS": "default", "PYTHONPATH": os.pathsep.join(sys.path)}
    proc = subprocess.run(command, capture_output=True, text=True, timeout=600, env=env, cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr[-3000:]
    lines = [line for line in proc.stdout.splitlines() if line.strip()]
    assert sum(line.startswith("Training a Transformer") for line in lines) == 1, proc.stdout
    repeated = sorted({line for line in lines if lines.count(line) > 1})
    assert not repeated, proc.stdout
    package = os.path.dirname(shardwise.__file__)
    warned = re.findall(r"^(.+?):\d+: (\w*Warning): ", proc.stderr, re.M)
    ours = [(path, kind) for path, kind in warned if os.path.abspath(path).startswith(package)]
    assert not ours, proc.stderr[-3000:]
    assert "FULL_SHARD + act. ckpt" in proc.stdout  # the whole default comparison ran

"""The documented examples run as a user would run them."""

import os
import re
import subprocess
import sys

import pytest
from strategy_without_trainer import train

import shardwise

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _fsdp_then_ddp(steps):
    # One launch for both loops (the second joins the process group the first set up): ranks start once.
    return train("fsdp", steps), train("ddp", steps)


def test_hand_written_loop_fsdp_equals_ddp():
    fsdp, ddp = shardwise.launch(_fsdp_then_ddp, 6, devices=2)[0]
    assert len(fsdp) == 6
    assert max(abs(a - b) / b for a, b in zip(fsdp, ddp)) < 1e-5


@pytest.mark.parametrize("recipe", ["manual", pytest.param("ac", marks=pytest.mark.slow)])
def test_fsdp_guide_script_self_launches(tmp_path, recipe):
    """`python examples/fsdp_guide.py` with devices=2 starts its own workers and prints per-rank memory."""
    proc = subprocess.run(
        [sys.executable, os.path.join(ROOT, "examples", "fsdp_guide.py"), "--recipe", recipe, "--max-steps", "3"],
        capture_output=True,
        text=True,
        timeout=300,
        cwd=tmp_path,
        env={**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)},
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    match = re.search(r"Memory used: ([0-9.]+) MB per rank", proc.stdout)
    assert match and float(match.group(1)) > 0, proc.stdout[-2000:]
    assert proc.stdout.count("Memory used") == 1  # printed by rank 0 only

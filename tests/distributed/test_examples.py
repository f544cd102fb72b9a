"""The documented examples run as a user would run them (the guide's two recipes as two processes at once)."""

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


@pytest.fixture(scope="module")
def guide_runs(request, tmp_path_factory):
    """`python examples/fsdp_guide.py` for every recipe the selected tests name, started at once (one's start-up
    leaves a core idle that the other's uses): recipe -> Popen."""
    wanted = [
        item.callspec.params["recipe"]
        for item in request.session.items
        if item.module is request.module and hasattr(item, "callspec") and "recipe" in item.callspec.params
    ]
    procs = {
        recipe: subprocess.Popen(
            [sys.executable, os.path.join(ROOT, "examples", "fsdp_guide.py"), "--recipe", recipe, "--max-steps", "3"],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            cwd=tmp_path_factory.mktemp(recipe),
            env={**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)},
        )
        for recipe in wanted
    }
    yield procs
    for proc in procs.values():
        if proc.poll() is None:
            proc.kill()
            proc.communicate()


@pytest.mark.parametrize("recipe", ["manual", pytest.param("ac", marks=pytest.mark.slow)])
def test_fsdp_guide_script_self_launches(guide_runs, recipe):
    """`python examples/fsdp_guide.py` with devices=2 starts its own workers and prints per-rank memory."""
    proc = guide_runs[recipe]
    stdout, stderr = proc.communicate(timeout=300)
    assert proc.returncode == 0, stderr[-3000:]
    match = re.search(r"Memory used: ([0-9.]+) MB per rank", stdout)
    assert match and float(match.group(1)) > 0, stdout[-2000:]
    assert stdout.count("Memory used") == 1  # printed by rank 0 only

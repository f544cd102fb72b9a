"""Kill-and-resume: a run SIGKILLed at a random step, mid-epoch, resumes to the same losses bitwise.

Each case runs checkpoint_kill_script.py twice as a real subprocess (the
Trainer self-launches 2 workers for ddp / fsdp): once killed with SIGKILL --
between saves, or in the middle of a save with a half-written temporary
checkpoint on disk -- and once resuming from `last.ckpt` and then running an
uninterrupted reference in the same processes. The losses of the killed
run up to its last committed checkpoint, followed by the resumed run's, must
equal the reference's exactly (CPU, fp32, dropout on, shuffled data, a
per-step LR schedule).
"""

from __future__ import annotations

import json
import os
import random
import subprocess
import sys

import pytest

from shardwise.checkpoint import layout

SCRIPT = os.path.join(os.path.dirname(__file__), "checkpoint_kill_script.py")
MAX_STEPS = 20
SAVE_EVERY = 3


def _run(root: str, *args: str, expect_ok: bool = True) -> subprocess.CompletedProcess:
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONWARNINGS": "ignore"}
    proc = subprocess.run(
        [sys.executable, SCRIPT, "--root", root, "--max-steps", str(MAX_STEPS), *args],
        capture_output=True,
        text=True,
        timeout=240,
        env=env,
    )
    if expect_ok and proc.returncode != 0:
        raise AssertionError(f"script failed ({proc.returncode}):\n{proc.stderr[-4000:]}")
    return proc


def _losses(root: str, run: str):
    with open(os.path.join(root, "losses.jsonl")) as fh:
        rows = [json.loads(line) for line in fh if line.strip()]
    return {r["step"]: r["loss"] for r in rows if r["run"] == run}


@pytest.mark.parametrize(
    "strategy,mode",
    [
        ("single", "step"),
        pytest.param("ddp", "save", marks=pytest.mark.slow),
        pytest.param("fsdp", "save", marks=pytest.mark.slow),
    ],
)
def test_sigkill_then_resume_matches_uninterrupted_run(tmp_path, strategy, mode):
    rng = random.Random()
    kill_at = (
        rng.choice([k for k in range(4, MAX_STEPS - 2) if k % SAVE_EVERY != 0])
        if mode == "step"
        else rng.choice([k for k in range(6, MAX_STEPS - 2) if k % SAVE_EVERY == 0])
    )
    print(f"strategy={strategy} mode={mode} kill_at={kill_at}")
    root = str(tmp_path)
    killed = _run(root, "--strategy", strategy, "--kill-at", str(kill_at), "--kill-mode", mode, expect_ok=False)
    assert killed.returncode != 0, "the run was supposed to be killed"

    ckpt_dir = os.path.join(root, "run", "checkpoints")
    last_committed = (kill_at // SAVE_EVERY) * SAVE_EVERY if mode == "step" else kill_at - SAVE_EVERY
    last = layout.latest_checkpoint(ckpt_dir)
    assert last is not None and layout.read_manifest(last)["global_step"] == last_committed
    leftovers = [n for n in os.listdir(ckpt_dir) if layout.is_hidden_leftover(n)]
    if mode == "save":
        # The interrupted save is visible only as a hidden temporary entry.
        assert leftovers, os.listdir(ckpt_dir)
        assert not any(f"step={kill_at}" in n for n in os.listdir(ckpt_dir) if not n.startswith("."))

    _run(root, "--strategy", strategy, "--resume")
    assert not [n for n in os.listdir(ckpt_dir) if layout.is_hidden_leftover(n)], "leftovers not cleaned"
    reference = _losses(root, "reference")
    killed_losses = _losses(root, "killed")
    resumed = _losses(root, "resumed")
    assert sorted(reference) == list(range(1, MAX_STEPS + 1))
    assert sorted(resumed) == list(range(last_committed + 1, MAX_STEPS + 1))
    # Steps the killed run did after its last checkpoint are replayed identically too.
    assert all(killed_losses[s] == reference[s] for s in killed_losses), (killed_losses, reference)
    combined = {**{s: v for s, v in killed_losses.items() if s <= last_committed}, **resumed}
    assert combined == reference

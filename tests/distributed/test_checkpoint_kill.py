"""Kill-and-resume: a run SIGKILLed at a random step, mid-epoch, resumes to the same losses bitwise.

Each case runs checkpoint_kill_script.py twice as a real subprocess (the
Trainer self-launches 2 workers for ddp / fsdp): once killed with SIGKILL --
between saves, or in the middle of a save with a half-written temporary
checkpoint on disk -- and once resuming from `last.ckpt` and then running an
uninterrupted reference in the same processes. The losses of the killed
run up to its last committed checkpoint, followed by the resumed run's, must
equal the reference's exactly (CPU, fp32, dropout on, shuffled data, a
per-step LR schedule). The cases run two at a time (one module fixture: one
case's kills and process start-ups leave a core idle that the other uses);
each test checks its own.
"""

from __future__ import annotations

import json
import os
import random
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor

import pytest

from shardwise.checkpoint import layout

SCRIPT = os.path.join(os.path.dirname(__file__), "checkpoint_kill_script.py")
MAX_STEPS = 20
SAVE_EVERY = 3
CASES = [("single", "step"), ("ddp", "save"), ("fsdp", "save")]
LANES = 2


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


def _kill_at(mode: str) -> int:
    rng = random.Random()
    if mode == "step":
        return rng.choice([k for k in range(4, MAX_STEPS - 2) if k % SAVE_EVERY != 0])
    return rng.choice([k for k in range(6, MAX_STEPS - 2) if k % SAVE_EVERY == 0])


def _kill_then_resume(root: str, strategy: str, mode: str, kill_at: int) -> dict:
    """The killed run, what its checkpoint folder held then, and the resume (with the reference after it)."""
    killed = _run(root, "--strategy", strategy, "--kill-at", str(kill_at), "--kill-mode", mode, expect_ok=False)
    ckpt_dir = os.path.join(root, "run", "checkpoints")
    last = layout.latest_checkpoint(ckpt_dir)
    out = {
        "killed": killed,
        "last_step": layout.read_manifest(last)["global_step"] if last is not None else None,
        "entries": sorted(os.listdir(ckpt_dir)) if os.path.isdir(ckpt_dir) else [],
    }
    if killed.returncode != 0:
        _run(root, "--strategy", strategy, "--resume")
        out["entries_after_resume"] = sorted(os.listdir(ckpt_dir))
    return out


@pytest.fixture(scope="module")
def runs(request, tmp_path_factory):
    """Every case the selected tests name, submitted at once to LANES threads: (strategy, mode) -> (kill_at,
    root, future)."""
    wanted = {
        (item.callspec.params["strategy"], item.callspec.params["mode"])
        for item in request.session.items
        if item.module is request.module and hasattr(item, "callspec")
    }
    pool = ThreadPoolExecutor(max_workers=LANES)
    out = {}
    for strategy, mode in reversed(CASES):  # the 2-process cases first, the one-process case last
        if (strategy, mode) in wanted:
            kill_at, root = _kill_at(mode), str(tmp_path_factory.mktemp(f"{strategy}-{mode}"))
            out[strategy, mode] = (kill_at, root, pool.submit(_kill_then_resume, root, strategy, mode, kill_at))
    yield out
    pool.shutdown(wait=True, cancel_futures=True)


@pytest.mark.parametrize(
    "strategy,mode",
    [
        ("single", "step"),
        pytest.param("ddp", "save", marks=pytest.mark.slow),
        pytest.param("fsdp", "save", marks=pytest.mark.slow),
    ],
)
def test_sigkill_then_resume_matches_uninterrupted_run(runs, strategy, mode):
    kill_at, root, future = runs[strategy, mode]
    print(f"strategy={strategy} mode={mode} kill_at={kill_at}")
    result = future.result()
    assert result["killed"].returncode != 0, "the run was supposed to be killed"

    last_committed = (kill_at // SAVE_EVERY) * SAVE_EVERY if mode == "step" else kill_at - SAVE_EVERY
    assert result["last_step"] == last_committed, result["killed"].stderr[-3000:]
    leftovers = [n for n in result["entries"] if layout.is_hidden_leftover(n)]
    if mode == "save":
        # The interrupted save is visible only as a hidden temporary entry.
        assert leftovers, result["entries"]
        assert not any(f"step={kill_at}" in n for n in result["entries"] if not n.startswith("."))

    assert not [n for n in result["entries_after_resume"] if layout.is_hidden_leftover(n)], "leftovers not cleaned"
    reference = _losses(root, "reference")
    killed_losses = _losses(root, "killed")
    resumed = _losses(root, "resumed")
    assert sorted(reference) == list(range(1, MAX_STEPS + 1))
    assert sorted(resumed) == list(range(last_committed + 1, MAX_STEPS + 1))
    # Steps the killed run did after its last checkpoint are replayed identically too.
    assert all(killed_losses[s] == reference[s] for s in killed_losses), (killed_losses, reference)
    combined = {**{s: v for s, v in killed_losses.items() if s <= last_committed}, **resumed}
    assert combined == reference

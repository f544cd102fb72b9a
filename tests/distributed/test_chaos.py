"""Chaos: seeded kill / resume schedules resume to the uninterrupted run's losses.

A fixed handful of schedules from chaos_script.generate (see that file for
what a schedule is and everything checked). Each is printed, so a failure
is reproduced with `python benchmarks/chaos.py --schedules 1 --seed <seed>`
-- with the same overrides, which the printed schedule spells out -- and
benchmarks/chaos.py runs many random ones. The schedules run two at a time
(one module fixture); each test checks its own.

SIGTERM schedules check the preemption contract (finish the step, save,
exit with PREEMPTED_EXIT_CODE, lose no completed step). Until the Trainer
implements it, such a schedule whose only failures are those SIGTERM checks
is reported as an expected failure, with the failures in the reason and a
warning in the summary; any other failure in it fails the test.
"""

from __future__ import annotations

import inspect
import warnings
from concurrent.futures import ThreadPoolExecutor

import chaos_script as chaos
import pytest

# name -> (seed, overrides). Together: single / DDP / FSDP / DeepSpeed, SIGKILL and SIGTERM, kills after a step,
# between micro-batches, inside a save (written, committed-not-`last`), in validation and at epoch end, aimed at
# rank 0, rank 1 and the launcher, 1-2 resumes, and one world-size change (2 -> 1 -> 2). The one-process schedule
# is killed once, in validation (no other schedule is): test_checkpoint_kill.py kills and resumes one process
# after a step, and the multi-process schedules resume more than once.
SCHEDULES = {
    "single-validation": (
        101,
        dict(
            strategy="single",
            resumes=1,
            signals=["SIGKILL"],
            val=3,
            accumulate=1,
            save_every=3,
            top_k=2,
            max_steps=16,
            kills=[{"point": "validation", "after": 3}],
        ),
    ),
    "ddp-2-resumes": (
        202,
        dict(
            strategy="ddp",
            resumes=2,
            worlds=[2, 2, 2],
            signals=["SIGKILL"],
            accumulate=2,
            val="none",
            save_every=2,
            top_k=2,
            max_steps=14,
            kills=[
                {"point": "save_commit", "after": 3, "target": "launcher"},
                {"point": "micro", "after": 2, "target": "rank1"},
            ],
        ),
    ),
    "fsdp-sigterm-reshard": (
        303,
        dict(
            strategy="fsdp",
            resumes=2,
            worlds=[2, 1, 2],
            accumulate=1,
            val="epoch",
            save_every=4,
            top_k=1,
            max_steps=14,
            kills=[
                {"point": "step", "after": 5, "target": "launcher", "signal": "SIGTERM"},
                {"point": "epoch_end", "after": 1, "target": "rank0", "signal": "SIGKILL"},
            ],
        ),
    ),
    "deepspeed2-sigkill": (
        404,
        dict(
            strategy="deepspeed_stage_2",
            resumes=1,
            worlds=[2, 2],
            signals=["SIGKILL"],
            accumulate=1,
            val="none",
            save_every=3,
            top_k=2,
            max_steps=12,
            kills=[{"point": "save_write", "after": 4, "target": "rank1"}],
        ),
    ),
}


def sigterm_supported() -> bool:
    """The Trainer turns SIGTERM into finish-step / save / exit 75 (shardwise.distributed.preempt in its loop)."""
    import shardwise.trainer.loop

    return chaos.preempted_exit_code() is not None and "preempt" in inspect.getsource(shardwise.trainer.loop)


# Schedules at once: one's kills, resumes and process start-ups leave a core idle that the other's use.
LANES = 2


@pytest.fixture(scope="module")
def runs(request, tmp_path_factory):
    """Every schedule the selected tests name, submitted at once to LANES threads: name -> (spec, future)."""
    wanted = [
        item.callspec.params["name"]
        for item in request.session.items
        if item.module is request.module and hasattr(item, "callspec") and "name" in item.callspec.params
    ]
    pool = ThreadPoolExecutor(max_workers=LANES)
    out = {}
    # The multi-process schedules first, the one-process one last (it fills the end of the other lane).
    for name in sorted(SCHEDULES, key=lambda n: SCHEDULES[n][1]["strategy"] == "single"):
        if name in wanted:
            seed, override = SCHEDULES[name]
            spec = chaos.generate(seed, **override)
            workdir = str(tmp_path_factory.mktemp(name))
            out[name] = (spec, pool.submit(chaos.run_schedule, spec, workdir, timeout=240))
    yield out
    pool.shutdown(wait=True, cancel_futures=True)


@pytest.mark.slow
@pytest.mark.parametrize(
    "name", [pytest.param(n, marks=[pytest.mark.deepspeed] if "deepspeed" in n else []) for n in SCHEDULES]
)
def test_chaos_schedule_resumes_to_uninterrupted_losses(runs, name):
    spec, future = runs[name]
    print(f"chaos schedule {name}: {chaos.describe(spec)}")
    result = future.result()
    print(
        f"  {'PASS' if result['ok'] else 'FAIL'} in {result['seconds']} s; legs: "
        + ", ".join(f"{leg['leg']}: w{leg['devices']} from {leg['start']} exit {leg['code']}" for leg in result["legs"])
    )
    for w in result["warnings"]:
        print(f"  warning: {w}")
    if result["ok"]:
        return
    report = f"{chaos.describe(spec)}\n" + "\n".join(f"  - {f}" for f in result["failures"])
    only_sigterm = all(f.startswith("[SIGTERM]") for f in result["failures"])
    if result["sigterm"] and only_sigterm and not sigterm_supported():
        message = (
            "SIGTERM preemption (finish the step, save, exit PREEMPTED_EXIT_CODE) is not in the Trainer "
            f"yet, so this schedule fails its SIGTERM checks:\n{report}"
        )
        warnings.warn(message)
        pytest.xfail(message)
    raise AssertionError(report)


def test_schedules_are_reproducible_and_well_formed():
    """No processes: a seed names one schedule, and every schedule is one the harness can run."""
    for seed in range(200):
        spec = chaos.generate(seed)
        assert spec == chaos.generate(seed), seed
        legs = spec["legs"]
        assert 2 <= len(legs) <= 5 and legs[-1]["kill"] is None and all(leg["kill"] for leg in legs[:-1])
        assert spec["strategy"] != "single" or all(leg["devices"] == 1 for leg in legs)
        assert (spec["dropout"] == "keyed") == (len({leg["devices"] for leg in legs}) > 1)
        for leg in legs[:-1]:
            kill = leg["kill"]
            assert kill["point"] != "micro" or spec["accumulate"] > 1
            assert kill["point"] != "validation" or spec["val"] != "none"
            assert kill["target"] in (("rank0",) if leg["devices"] == 1 else ("rank0", "rank1", "launcher"))
        steps_per_epoch = -(-spec["batches_per_epoch"] // spec["accumulate"])
        assert 5 <= steps_per_epoch <= 7 and spec["max_steps"] > steps_per_epoch  # spans more than one epoch

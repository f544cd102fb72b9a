"""Resume after resume: random chains of interrupted runs equal the uninterrupted one, bitwise.

The single-resume tests in test_checkpoint.py passed while a second resume
skipped the rest of its epoch (the sampler kept the first resume's start
index). Here seeded random chains of 1-4 stops, at random steps, with random
save intervals, validation and accumulation, must reproduce the reference
losses exactly and name their checkpoints with the reference's epochs. Also
the neighbours of a resume: resuming from another run's checkpoint, two runs
in one directory, and the run ending by max_steps / max_epochs / a stop
request, which must leave a checkpoint of its last step.
"""

from __future__ import annotations

import os
import random
import subprocess
import sys

import pytest
import torch.distributed as dist
from test_checkpoint import Net, fit  # noqa: E402  (same directory: the shared one-process fixtures)

from shardwise.callbacks import ModelCheckpoint
from shardwise.checkpoint import layout
from shardwise.checkpoint.lock import CheckpointDirectoryBusyError, DirectoryLock

TOTAL = 23  # 10 batches per epoch: the chains cross two epoch boundaries


@pytest.fixture(autouse=True)
def _no_leftover_process_group():
    yield
    if dist.is_initialized():
        dist.destroy_process_group()


def _epoch_of(root, step):
    path = layout.latest_checkpoint(os.path.join(root, "checkpoints"))
    manifest = layout.read_manifest(path)
    assert manifest["global_step"] == step, (path, manifest)
    return manifest["epoch"], os.path.basename(path)


def _chain(seed: int):
    rng = random.Random(seed)
    stops = sorted(rng.sample(range(1, TOTAL), rng.randint(1, 4))) + [TOTAL]
    kw = dict(val_check_interval=rng.choice([None, 3, 7]), accumulate_grad_batches=rng.choice([1, 1, 2]))
    every = rng.choice([2, 3, 5, None])
    return stops, every, kw


def _checkpoint(every):
    return ModelCheckpoint(every_n_train_steps=every) if every else ModelCheckpoint(every_n_epochs=1)


@pytest.mark.parametrize("strategy,seed", [("single", 11), ("single", 12), ("single", 13), ("fsdp", 21), ("fsdp", 22)])
def test_random_resume_chains_equal_the_uninterrupted_run(tmp_path, strategy, seed):
    stops, every, kw = _chain(seed)
    print(f"strategy={strategy} stops={stops} every={every} {kw}")
    ref_trainer, reference = fit(tmp_path / "ref", TOTAL, strategy, checkpoint=_checkpoint(every), **kw)
    ref_epochs = {}
    combined = {}
    for i, stop in enumerate(stops):
        trainer, losses = fit(
            tmp_path / "run",
            stop,
            strategy,
            ckpt_path="last" if i else None,
            seed=100 + i if i else 3,
            checkpoint=_checkpoint(every),
            **kw,
        )
        combined.update(losses)
        # The run ended by max_steps: its last step is saved, whatever the interval.
        epoch, name = _epoch_of(tmp_path / "run", stop)
        ref_epochs[stop] = epoch
        assert f"step={stop}" in name
    assert sorted(combined) == list(range(1, TOTAL + 1))
    assert combined == reference
    assert trainer.current_epoch == ref_trainer.current_epoch
    assert _epoch_of(tmp_path / "ref", TOTAL)[0] == ref_epochs[TOTAL]


@pytest.mark.parametrize("strategy", ["single", "fsdp"])
def test_the_reported_chain_4_6_8(tmp_path, strategy):
    _, reference = fit(tmp_path / "ref", 8, strategy, checkpoint=ModelCheckpoint(every_n_train_steps=2))
    combined = {}
    for i, stop in enumerate((4, 6, 8)):
        _, losses = fit(
            tmp_path / "run",
            stop,
            strategy,
            ckpt_path="last" if i else None,
            checkpoint=ModelCheckpoint(every_n_train_steps=2),
        )
        combined.update(losses)
    assert combined == reference
    assert os.path.basename(os.path.realpath(tmp_path / "run" / "checkpoints" / "last.ckpt")) == "epoch=0-step=8.ckpt"


def test_max_steps_mid_epoch_saves_and_last_continues(tmp_path):
    # The seeds' pattern: max_steps plus ckpt_path="last", run again and again.
    _, reference = fit(tmp_path / "ref", 12, checkpoint=ModelCheckpoint())
    combined = {}
    for stop in (5, 9, 12):
        _, losses = fit(tmp_path / "run", stop, ckpt_path="last", checkpoint=ModelCheckpoint())
        combined.update(losses)
        assert _epoch_of(tmp_path / "run", stop)[1] == f"epoch={stop // 10}-step={stop}.ckpt"
    assert combined == reference


def test_a_stop_request_and_max_epochs_save_the_last_step(tmp_path):
    class StopAt7(Net):
        def on_train_batch_start(self, batch, batch_idx):
            return -1 if self.trainer.global_step == 7 else None

    trainer, _ = fit(tmp_path / "stop", 100, module=StopAt7(), checkpoint=ModelCheckpoint(every_n_train_steps=5))
    assert trainer.global_step == 7
    _epoch_of(tmp_path / "stop", 7)
    trainer, _ = fit(tmp_path / "epochs", -1, max_epochs=2, checkpoint=ModelCheckpoint(every_n_train_steps=3))
    assert _epoch_of(tmp_path / "epochs", 20)[0] == 2  # resumes at the start of epoch 2


def test_resuming_from_another_runs_checkpoint_leaves_it_alone(tmp_path):
    fit(tmp_path / "a", 6, checkpoint=ModelCheckpoint(every_n_train_steps=3))
    a_dir = tmp_path / "a" / "checkpoints"
    before = sorted(os.listdir(a_dir))
    source = os.path.realpath(a_dir / "last.ckpt")
    fit(tmp_path / "b", 12, ckpt_path=source, checkpoint=ModelCheckpoint(every_n_train_steps=3))
    assert sorted(os.listdir(a_dir)) == before
    assert os.path.exists(a_dir / "last.ckpt") and os.path.realpath(a_dir / "last.ckpt") == source
    # The new run keeps its own top-1 and last in its own directory.
    assert sorted(os.listdir(tmp_path / "b" / "checkpoints")) == ["epoch=1-step=12.ckpt", "last.ckpt"]


def test_a_second_run_in_the_same_directory_fails_at_once_and_touches_nothing(tmp_path):
    directory = tmp_path / "checkpoints"
    directory.mkdir()
    in_flight = directory / ".epoch=0-step=3.ckpt.tmp-1-2-abc"  # the live run's save in progress
    in_flight.write_bytes(b"partial")
    other = DirectoryLock(str(directory))
    other.acquire()
    try:
        with pytest.raises(
            CheckpointDirectoryBusyError,
            match=r"Another run \(host .* pid \d+ since [^)]+\) is saving "
            r"checkpoints into .*own default_root_dir",
        ):
            fit(tmp_path, 3, checkpoint=ModelCheckpoint())
        assert in_flight.exists()
    finally:
        other.release()
    assert not (directory / ".shardwise.lock").exists()


def test_the_lock_of_a_killed_run_is_taken_over(tmp_path):
    directory = tmp_path / "checkpoints"
    code = (
        "import os, signal, sys; from shardwise.checkpoint.lock import DirectoryLock; "
        "DirectoryLock(sys.argv[1]).acquire(); os.kill(os.getpid(), signal.SIGKILL)"
    )
    proc = subprocess.run([sys.executable, "-c", code, str(directory)])
    assert proc.returncode == -9 and (directory / ".shardwise.lock").exists()  # left behind, but unlocked
    (directory / ".x.ckpt.tmp-1-2-abc").write_bytes(b"left by the killed run")
    fit(tmp_path, 3, checkpoint=ModelCheckpoint())
    assert sorted(os.listdir(directory)) == ["epoch=0-step=3.ckpt", "last.ckpt"]


class SignalAt:
    """Send this process `sig` in the middle of optimizer step `step` (as a scheduler would, any time)."""

    def __init__(self, step: int, sig) -> None:
        self.step, self.sig = step, sig

    def on_before_optimizer_step(self, trainer, module, optimizer):
        if trainer.global_step + 1 == self.step:
            os.kill(os.getpid(), self.sig)


@pytest.mark.parametrize("sig", ["SIGTERM", "SIGUSR1", "SIGINT"])
def test_a_preemption_signal_finishes_the_step_saves_and_exits_75(tmp_path, sig):
    import signal

    from shardwise.distributed.env import PREEMPTED_EXIT_CODE

    _, reference = fit(tmp_path / "ref", 14, checkpoint=ModelCheckpoint(every_n_train_steps=4))
    before = signal.getsignal(getattr(signal, sig))
    with pytest.raises(SystemExit) as exit_info:
        fit(
            tmp_path / "run",
            14,
            checkpoint=ModelCheckpoint(every_n_train_steps=4),
            callbacks_extra=[SignalAt(6, getattr(signal, sig))],
        )
    assert exit_info.value.code == PREEMPTED_EXIT_CODE
    assert signal.getsignal(getattr(signal, sig)) == before  # the handler is the user's again
    _epoch_of(tmp_path / "run", 6)  # step 6 finished and was saved: nothing lost
    _, resumed = fit(tmp_path / "run", 14, ckpt_path="last", seed=7, checkpoint=ModelCheckpoint(every_n_train_steps=4))
    assert sorted(resumed) == list(range(7, 15))
    assert all(resumed[s] == reference[s] for s in resumed)


def test_metrics_resume_in_the_same_file_without_duplicates(tmp_path):
    import csv

    from shardwise.loggers import CSVLogger

    def run(max_steps, ckpt_path=None):
        logger = CSVLogger(str(tmp_path), flush_every_n_steps=1000)  # nothing flushed by the logger itself
        fit(
            tmp_path,
            max_steps,
            ckpt_path=ckpt_path,
            checkpoint=ModelCheckpoint(every_n_train_steps=3),
            logger=logger,
            log_every_n_steps=1,
        )
        return logger

    first = run(5)
    second = run(11, ckpt_path="last")
    assert second.log_dir == first.log_dir  # the same version folder
    with open(second.metrics_file) as fh:
        steps = [int(r["step"]) for r in csv.DictReader(fh) if r.get("epoch")]  # the per-step rows
    assert steps == list(range(1, 12))


def test_an_unwritable_checkpoint_directory_stops_the_run_before_the_first_step(tmp_path):
    from shardwise.checkpoint import CheckpointWriteError

    ro = tmp_path / "ro"
    ro.mkdir()
    mounted = subprocess.run(["mount", "-t", "tmpfs", "-o", "ro,size=64k", "tmpfs", str(ro)], capture_output=True)
    if mounted.returncode:
        pytest.skip(f"cannot mount a read-only tmpfs here: {mounted.stderr.decode().strip()}")
    try:
        steps = []
        step_counter = type("Steps", (), {"on_train_batch_end": lambda self, t, *a: steps.append(t.global_step)})()
        with pytest.raises(CheckpointWriteError, match=rf"EROFS.*{ro}|{ro}.*EROFS"):
            fit(tmp_path, 5, checkpoint=ModelCheckpoint(dirpath=str(ro)), callbacks_extra=[step_counter])
        assert steps == []
    finally:
        subprocess.run(["umount", "-l", str(ro)])


def test_a_checkpoint_committed_before_last_moved_is_the_resume_point(tmp_path):
    # Killed between the commit of step 6 and the move of `last` (chaos harness, seed 202):
    # resume from step 6, not from `last`'s step 4, and keep no orphan or "-v1" twin.
    _, reference = fit(tmp_path / "ref", 10, checkpoint=ModelCheckpoint(every_n_train_steps=2, save_top_k=2))
    _, first = fit(tmp_path / "run", 6, checkpoint=ModelCheckpoint(every_n_train_steps=2, save_top_k=2))
    directory = tmp_path / "run" / "checkpoints"
    layout.point_last(str(directory), str(directory / "epoch=0-step=4.ckpt"))
    other = tmp_path / "run" / "checkpoints" / "epoch=9-step=99.ckpt"  # a different run's, newer: never adopted
    with pytest.warns(UserWarning, match=r"step=6.ckpt \(step 6\) was committed after last.ckpt"):
        _, second = fit(
            tmp_path / "run",
            10,
            ckpt_path="last",
            seed=9,
            checkpoint=ModelCheckpoint(every_n_train_steps=2, save_top_k=2),
        )
    assert sorted(second) == [7, 8, 9, 10] and {**first, **second} == reference
    assert sorted(os.listdir(directory)) == ["epoch=0-step=10.ckpt", "epoch=0-step=8.ckpt", "last.ckpt"]
    assert not other.exists()


def test_another_runs_newer_checkpoint_in_the_directory_is_not_adopted(tmp_path):
    fit(tmp_path / "old", 8, checkpoint=ModelCheckpoint(every_n_train_steps=4, save_top_k=-1))
    old = tmp_path / "old" / "checkpoints" / "epoch=0-step=8.ckpt"
    directory = tmp_path / "run" / "checkpoints"
    fit(tmp_path / "run", 3, checkpoint=ModelCheckpoint(every_n_train_steps=3))
    os.replace(old, directory / "epoch=0-step=8.ckpt")  # an unrelated run's checkpoint, at a higher step
    trainer, losses = fit(tmp_path / "run", 5, ckpt_path="last", checkpoint=ModelCheckpoint(every_n_train_steps=3))
    assert sorted(losses) == [4, 5]

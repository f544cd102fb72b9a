"""A disk that fills up or turns read-only in the middle of a run: every rank stops at once, nothing is lost.

On 2 processes, for each checkpoint flavour (DDP's one file, FSDP's sharded directory written synchronously
and asynchronously, DeepSpeed ZeRO-2's engine directory), one launch runs four fits in the same workers:

1. training with a checkpoint every 2 steps on a small tmpfs; after step 4 rank 0 fills the disk, so the
   step-4 save runs out of space while writing (the pre-save size check is told the checkpoint is empty,
   so the write really starts);
2. a resume from `last` (step 2), which saves step 4; after step 6 rank 0 bind-mounts the checkpoint directory read-only, so the
   step-6 save cannot create its files;
3. a resume from `last` to the end, with the disk writable again;
4. the same run uninterrupted, elsewhere.

Both faults must reach every rank as one CheckpointWriteError (an OSError with ENOSPC / EROFS), naming the
failing rank, the path and the fix, within 30 s of the fault; `last` must still point at the checkpoint
before the fault, no partial or hidden checkpoint may remain, and the losses of fits 1-3 must equal the
uninterrupted run's. A real filesystem is used (a tmpfs, a read-only bind mount): the writes fail in
torch's C++ zip writer, DCP's threads and DeepSpeed's engine exactly as on a full disk; where mounting is
not allowed the test is skipped, and the in-process tests of test_checkpoint_safety.py cover the errors.
"""

from __future__ import annotations

import errno
import json
import os
import subprocess
import time

import pytest

SAVE_EVERY = 2
MAX_STEPS = 8
FAULT_BOUND_S = 30
HANG_S = 60


def _mount(args) -> bool:
    return subprocess.run(["mount", *args], capture_output=True).returncode == 0


@pytest.fixture
def small_disk(tmp_path):
    path = str(tmp_path / "disk")
    os.makedirs(path)
    if os.geteuid() != 0 or not _mount(["-t", "tmpfs", "-o", "size=16m", "tmpfs", path]):
        pytest.skip("cannot mount a tmpfs here; test_checkpoint_safety.py covers the errors in one process")
    yield path
    subprocess.run(["umount", "-R", "-l", path], capture_output=True)


class Recorder:
    def __init__(self, path: str, tag: str) -> None:
        self.path, self.tag = path, tag

    def on_train_batch_end(self, trainer, module, outputs, batch, batch_idx) -> None:
        if trainer.is_global_zero:
            with open(self.path, "a") as fh:
                fh.write(json.dumps({"run": self.tag, "step": trainer.global_step, "loss": repr(float(outputs.detach()))}))
                fh.write("\n")


class Fault:
    """At `step`, before that step's save: fill the disk (ENOSPC) or make the directory read-only (EROFS)."""

    def __init__(self, step: int, kind: str, disk: str, directory: str) -> None:
        self.step, self.kind, self.disk, self.directory = step, kind, disk, directory
        self.at = None

    def on_train_batch_end(self, trainer, module, *args) -> None:
        if trainer.global_step != self.step:
            return
        if trainer.is_global_zero:
            if self.kind == "ENOSPC":
                _fill(os.path.join(self.disk, "filler"), leave=8192)
            else:
                assert _mount(["--bind", self.directory, self.directory])
                assert _mount(["-o", "remount,bind,ro", self.directory])
        trainer.strategy.barrier("fault-injected")
        self.at = time.time()


def _fill(path: str, leave: int) -> None:
    fd = os.open(path, os.O_WRONLY | os.O_CREAT, 0o644)
    try:
        while os.write(fd, b"\0" * 65536):
            pass
    except OSError as exc:
        assert exc.errno == errno.ENOSPC
    finally:
        os.close(fd)
    os.truncate(path, max(0, os.path.getsize(path) - leave))


def _strategy(name: str):
    import shardwise

    if name == "fsdp":
        return shardwise.FSDPStrategy()
    if name == "fsdp_async":
        return shardwise.FSDPStrategy(async_save=True)
    return {"ddp": "ddp", "zero2": "deepspeed_stage_2"}[name]


def _faulted_runs(strategy: str, disk: str, out: str):
    """Runs on each rank: the four fits of the module docstring; returns what the test checks."""
    import faulthandler

    import shardwise
    from shardwise import Trainer
    from shardwise.callbacks import ModelCheckpoint
    from shardwise.checkpoint import CheckpointWriteError, layout, training

    from helpers.checkpoints import Net, loader

    faulthandler.dump_traceback_later(HANG_S, exit=True)  # a hang fails the rank, with its stack
    directory = os.path.join(disk, "checkpoints")
    losses = os.path.join(out, "losses.jsonl")
    report = {}

    def fit(tag, root, ckpt_path=None, fault=None, checkpoint=True):
        shardwise.seed_everything(7)
        callbacks = [Recorder(losses, tag)] + ([fault] if fault else [])
        if checkpoint:
            callbacks.append(ModelCheckpoint(dirpath=directory, every_n_train_steps=SAVE_EVERY, save_top_k=1))
        trainer = Trainer(
            accelerator="cpu",
            devices=2,
            strategy=_strategy(strategy),
            max_steps=MAX_STEPS,
            logger=False,
            enable_progress_bar=False,
            enable_checkpointing=checkpoint,
            default_root_dir=root,
            callbacks=callbacks,
        )
        try:
            trainer.fit(Net(scheduler=True), loader(), ckpt_path=ckpt_path)
        except CheckpointWriteError as exc:
            report[tag] = {"errno": exc.errno, "message": str(exc), "after_s": time.time() - fault.at}
        finally:
            trainer.strategy.teardown()

    # The pre-save check would refuse the step-4 save before it starts (the disk is full); the fault to
    # test here is the one a write meets on its way.
    estimate = training.estimated_checkpoint_bytes
    training.estimated_checkpoint_bytes = lambda *a, **k: (0, "told it is empty")
    fit("enospc", os.path.join(out, "run"), fault=Fault(4, "ENOSPC", disk, directory))
    training.estimated_checkpoint_bytes = estimate
    rank = int(os.environ["RANK"])
    if rank == 0:
        os.unlink(os.path.join(disk, "filler"))
        report["after_enospc"] = sorted(os.listdir(directory))
    fit("erofs", os.path.join(out, "run"), "last", fault=Fault(6, "EROFS", disk, directory))
    if rank == 0:
        report["after_erofs"] = sorted(os.listdir(directory))
        report["last_step"] = layout.read_manifest(layout.latest_checkpoint(directory))["global_step"]
        subprocess.run(["umount", directory], check=True)
    fit("resumed", os.path.join(out, "run"), "last")
    fit("reference", os.path.join(out, "reference"), checkpoint=False)
    faulthandler.cancel_dump_traceback_later()
    return report


@pytest.mark.parametrize("strategy", ["ddp", "fsdp", "fsdp_async", "zero2"])
def test_full_and_read_only_disk_stop_every_rank_and_lose_nothing(tmp_path, small_disk, strategy):
    import shardwise

    if strategy == "zero2":
        pytest.importorskip("deepspeed")
    reports = shardwise.launch(_faulted_runs, strategy, small_disk, str(tmp_path), devices=2)
    for rank, report in enumerate(reports):
        for tag, code, word in (("enospc", errno.ENOSPC, "no space left"), ("erofs", errno.EROFS, "read-only")):
            assert tag in report, (rank, f"the {tag} fault did not stop rank {rank}", report)
            got = report[tag]
            assert got["errno"] == code, (rank, got)
            message = got["message"]
            assert errno.errorcode[code] in message and word in message.lower(), message
            assert "rank 0" in message and small_disk in message, message
            assert "unexpected pos" not in message, message
            assert got["after_s"] < FAULT_BOUND_S, (rank, tag, got["after_s"])
    # After each fault: the checkpoint before it and `last` only (no partial step-4 / step-6 checkpoint,
    # no hidden temporary); the lock file of the read-only run stays behind, unlocked and harmless.
    assert reports[0]["after_enospc"] == ["epoch=0-step=2.ckpt", "last.ckpt"], reports[0]
    after_erofs = [n for n in reports[0]["after_erofs"] if n != ".shardwise.lock"]
    assert after_erofs == ["epoch=0-step=4.ckpt", "last.ckpt"], reports[0]
    assert reports[0]["last_step"] == 4

    rows = [json.loads(line) for line in open(tmp_path / "losses.jsonl")]
    runs = {}
    for row in rows:
        runs.setdefault(row["run"], {})[row["step"]] = row["loss"]
    reference = runs["reference"]
    assert sorted(reference) == list(range(1, MAX_STEPS + 1))
    assert sorted(runs["erofs"]) == list(range(3, 7)) and sorted(runs["resumed"]) == list(range(5, MAX_STEPS + 1))
    # Every fit replays the uninterrupted run exactly, the faulted ones up to the step that failed to save.
    for tag in ("enospc", "erofs", "resumed"):
        assert all(reference[step] == loss for step, loss in runs[tag].items()), (tag, runs[tag], reference)

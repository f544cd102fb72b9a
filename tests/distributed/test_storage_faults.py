"""A disk that fills up or turns read-only in the middle of a run: every rank stops at once, nothing is lost.

On 2 processes, for each checkpoint flavour (DDP's one file, FSDP's sharded directory written synchronously
and asynchronously, DeepSpeed ZeRO-2's engine directory), three fits run in the same workers (one launch
for all four flavours, to keep the suite's time):

1. training with a checkpoint every 2 steps on a small tmpfs; after step 4 rank 0 fills the disk, so the
   step-4 save runs out of space while writing (the pre-save size check is told the checkpoint is empty,
   so the write really starts);
2. a resume from `last` (step 2), which saves step 4; after step 6 rank 0 bind-mounts the checkpoint
   directory read-only, so the step-6 save cannot create its files;
3. a resume from `last` to the end, with the disk writable again.

Both faults must reach every rank as one CheckpointWriteError (an OSError with ENOSPC / EROFS), naming the
failing rank, the path and the fix, within 30 s of the fault; `last` must still point at the checkpoint
before the fault, no partial or hidden checkpoint may remain, and each resumed fit must repeat the steps
the fit before it trained after that checkpoint, bit for bit (so it equals the uninterrupted run). An
async save's failure stops the run at the first step after the write ended, at the latest at the next
save. A real filesystem is used (a tmpfs, a read-only bind mount): the writes fail in
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
    result = subprocess.run(["mount", *args], capture_output=True, text=True)
    if result.returncode:
        print(f"mount {' '.join(args)}: {result.stderr.strip()}")
    return result.returncode == 0


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
                fh.write(
                    json.dumps({"run": self.tag, "step": trainer.global_step, "loss": repr(float(outputs.detach()))})
                )
                fh.write("\n")


class Fault:
    """At `step`, before that step's save: fill the disk (ENOSPC) or make the directory read-only (EROFS)."""

    def __init__(self, step: int, kind: str, disk: str, directory: str) -> None:
        self.step, self.kind, self.disk, self.directory = step, kind, disk, directory
        self.at = None

    def on_train_batch_end(self, trainer, module, *args) -> None:
        if trainer.global_step != self.step:
            return
        # An async save still writing in the background would meet the fault meant for this step's save:
        # let it finish and commit first (collective: every rank is here at this step).
        for callback in trainer.callbacks:
            if getattr(callback, "_pending", None) is not None:
                callback._finish_pending()
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


def _faulted_runs(strategies, disk: str, out: str):
    """Runs on each rank: the three fits of the module docstring per strategy; returns what the test checks."""
    return {name: _faulted_run(name, os.path.join(disk, name), os.path.join(out, name)) for name in strategies}


def _faulted_run(strategy: str, disk: str, out: str):
    import faulthandler

    import shardwise
    from shardwise import Trainer
    from shardwise.callbacks import ModelCheckpoint
    from shardwise.checkpoint import CheckpointWriteError, layout, training

    from helpers.checkpoints import Net, loader

    faulthandler.dump_traceback_later(HANG_S, exit=True)  # a hang fails the rank, with its stack
    if int(os.environ["RANK"]) == 0:
        os.makedirs(out, exist_ok=True)
    directory = os.path.join(disk, "checkpoints")
    losses = os.path.join(out, "losses.jsonl")
    report = {}

    def fit(tag, root, ckpt_path=None, fault=None):
        shardwise.seed_everything(7)
        callbacks = [Recorder(losses, tag)] + ([fault] if fault else [])
        callbacks.append(ModelCheckpoint(dirpath=directory, every_n_train_steps=SAVE_EVERY, save_top_k=1))
        trainer = Trainer(
            accelerator="cpu",
            devices=2,
            strategy=_strategy(strategy),
            max_steps=MAX_STEPS,
            logger=False,
            enable_progress_bar=False,
            default_root_dir=root,
            callbacks=callbacks,
        )
        try:
            trainer.fit(Net(scheduler=True), loader(), ckpt_path=ckpt_path)
        except CheckpointWriteError as exc:
            report[tag] = {
                "errno": exc.errno,
                "message": str(exc),
                "after_s": time.time() - fault.at,
                "step": trainer.global_step,
            }
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
    if rank == 0:
        report["after_resume"] = sorted(os.listdir(directory))
    faulthandler.cancel_dump_traceback_later()
    return report


def test_full_and_read_only_disk_stop_every_rank_and_lose_nothing(tmp_path, small_disk):
    import shardwise

    strategies = ["ddp", "fsdp", "fsdp_async"]
    try:
        import deepspeed  # noqa: F401
    except ImportError:
        pass
    else:
        strategies.append("zero2")
    reports = shardwise.launch(_faulted_runs, strategies, small_disk, str(tmp_path), devices=2)
    for strategy in strategies:
        _check(strategy, [r[strategy] for r in reports], os.path.join(small_disk, strategy), tmp_path / strategy)


def _check(strategy, reports, disk, out):
    for rank, report in enumerate(reports):
        for tag, code, word in (("enospc", errno.ENOSPC, "no space left"), ("erofs", errno.EROFS, "read-only")):
            assert tag in report, (strategy, f"the {tag} fault did not stop rank {rank}", report)
            got = report[tag]
            assert got["errno"] == code, (strategy, rank, got)
            message = got["message"]
            assert errno.errorcode[code] in message and word in message.lower(), (strategy, message)
            assert "rank 0" in message and disk in message, (strategy, message)
            assert "unexpected pos" not in message, (strategy, message)
            assert got["after_s"] < FAULT_BOUND_S, (strategy, rank, tag, got["after_s"])
    # After each fault: the checkpoint before it and `last` only (no partial step-4 / step-6 checkpoint,
    # no hidden temporary); the lock file of the read-only run stays behind, unlocked and harmless.
    assert reports[0]["after_enospc"] == ["epoch=0-step=2.ckpt", "last.ckpt"], (strategy, reports[0])
    last = 4
    after_erofs = [n for n in reports[0]["after_erofs"] if not n.startswith(".")]
    assert after_erofs == [f"epoch=0-step={last}.ckpt", "last.ckpt"], (strategy, reports[0])
    assert reports[0]["last_step"] == last, strategy
    assert not [n for n in reports[0]["after_resume"] if n.startswith(".")], (strategy, reports[0])

    rows = [json.loads(line) for line in open(os.path.join(out, "losses.jsonl"))]
    runs = {}
    for row in rows:
        runs.setdefault(row["run"], {})[row["step"]] = row["loss"]
    # A synchronous save fails in its own step; an async one at a later step, no later than the next save.
    stops = (4, 6) if strategy != "fsdp_async" else (reports[0]["enospc"]["step"], reports[0]["erofs"]["step"])
    assert 4 <= stops[0] <= 6 and 6 <= stops[1] <= 8, (strategy, stops)
    assert sorted(runs["enospc"]) == list(range(1, stops[0] + 1)), strategy
    assert sorted(runs["erofs"]) == list(range(3, stops[1] + 1)), strategy
    assert sorted(runs["resumed"]) == list(range(last + 1, MAX_STEPS + 1)), strategy
    # Each run trained on, uninterrupted, up to its fault; the run resumed after it repeats those steps
    # (the ones after the checkpoint it resumed) bit for bit.
    for before, after in (("enospc", "erofs"), ("erofs", "resumed")):
        shared = sorted(set(runs[before]) & set(runs[after]))
        assert shared and all(runs[before][k] == runs[after][k] for k in shared), (strategy, before, after, runs)


def test_a_save_the_disk_cannot_hold_is_refused_before_writing(tmp_path, monkeypatch):
    import collections

    from shardwise import Trainer
    from shardwise.checkpoint import CheckpointWriteError, layout, training

    from helpers.checkpoints import Net, loader

    trainer = Trainer(
        accelerator="cpu", devices=1, max_steps=2, logger=False, enable_progress_bar=False, default_root_dir=tmp_path
    )
    trainer.fit(Net(), loader())
    directory = tmp_path / "checkpoints"
    before = sorted(os.listdir(directory))
    size = os.path.getsize(os.path.realpath(directory / "last.ckpt"))
    usage = collections.namedtuple("usage", "total used free")
    # Beside the run's checkpoints the estimate is the last one's size; in a new folder, the model's and
    # optimizer's state in memory (smaller than the file, never larger: a save is refused only when sure).
    for target, basis, free in (
        (directory / "next.ckpt", "last checkpoint", size - 1),
        (tmp_path / "new" / "a.ckpt", "state", 100),
    ):
        monkeypatch.setattr(training.shutil, "disk_usage", lambda path, free=free: usage(2**30, 2**30 - free, free))
        with pytest.raises(CheckpointWriteError) as err:
            trainer.save_checkpoint(str(target))
        message = str(err.value)
        assert err.value.errno == errno.ENOSPC and "ENOSPC" in message and str(target) in message, message
        assert basis in message and "free" in message and "nothing was written" in message, message
        assert not os.path.exists(target) and not [n for n in os.listdir(target.parent) if n.startswith(".")]
    assert sorted(os.listdir(directory)) == before
    assert layout.read_manifest(layout.latest_checkpoint(str(directory)))["global_step"] == 2


_KILLED_CONVERT = """
import os, signal, sys
from shardwise.recipes import convert as command

real = command.write_weights

def then_killed(*args, **kwargs):  # every byte written, killed before the folder is renamed into place
    result = real(*args, **kwargs)
    os.kill(os.getpid(), signal.SIGKILL)
    return result

command.write_weights = then_killed
command.convert(sys.argv[1], sys.argv[2], quiet=True)
"""


def test_convert_killed_before_it_finishes_leaves_no_output(tmp_path, monkeypatch):
    import sys

    from shardwise import Trainer
    from shardwise.recipes.convert import convert

    from helpers.checkpoints import Net, loader

    trainer = Trainer(
        accelerator="cpu", devices=1, max_steps=1, logger=False, enable_progress_bar=False, default_root_dir=tmp_path
    )
    trainer.fit(Net(), loader())
    ckpt = os.path.join(tmp_path, "checkpoints", "last.ckpt")
    out = tmp_path / "weights"
    proc = subprocess.run([sys.executable, "-c", _KILLED_CONVERT, ckpt, str(out)], capture_output=True, text=True)
    assert proc.returncode == -9, proc.stderr[-2000:]
    # Only a hidden temporary folder, never a folder at OUT that looks complete.
    assert not out.exists() and [n for n in os.listdir(tmp_path) if n.startswith(".weights.tmp-")]
    written = convert(ckpt, str(out), quiet=True)
    assert written and all(p.startswith(str(out) + os.sep) and os.path.exists(p) for p in written), written
    assert "model.safetensors" in os.listdir(out)
    # A disk that fills up: ENOSPC named with the output's path and the fix, nothing left behind.
    from shardwise.checkpoint import CheckpointWriteError, hf_shards

    def full(tensors, path, metadata=None):
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), path)

    monkeypatch.setitem(hf_shards.SAVERS, "safetensors", full)
    before = sorted(os.listdir(tmp_path))
    with pytest.raises(CheckpointWriteError) as err:
        convert(ckpt, str(tmp_path / "again"), quiet=True)
    assert err.value.errno == errno.ENOSPC and "free space" in str(err.value), str(err.value)
    assert sorted(os.listdir(tmp_path)) == before


def test_lora_export_on_a_full_disk_leaves_nothing_and_names_enospc(tmp_path, monkeypatch):
    pytest.importorskip("peft")
    import safetensors.torch
    from peft import LoraConfig
    from torch import nn

    from shardwise.adapters.lora import apply_lora
    from shardwise.checkpoint import CheckpointWriteError
    from shardwise.recipes import lora_export

    model = apply_lora(
        nn.Sequential(nn.Linear(8, 8), nn.ReLU(), nn.Linear(8, 8)), LoraConfig(r=2, target_modules=["0"])
    )
    real = safetensors.torch.save_file

    def half_then_full(tensors, path, metadata=None):  # the disk fills up halfway through the weights
        real(tensors, path, metadata=metadata)
        os.truncate(path, os.path.getsize(path) // 2)
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), path)

    monkeypatch.setattr(safetensors.torch, "save_file", half_then_full)
    folder = tmp_path / "adapter"
    with pytest.raises(CheckpointWriteError) as err:
        lora_export.export_adapter(model, str(folder))
    assert err.value.errno == errno.ENOSPC and "ENOSPC" in str(err.value) and str(folder) in str(err.value)
    assert os.listdir(folder) == []  # no cut weights file, no config that would promise them

"""Any checkpoint under any strategy and world size, with identical model and optimizer values.

Written by 2 processes (FSDP sharded, FSDP full, DDP full, FSDP with
async_save), then resumed with fit(ckpt_path=...) on 1 process (single
device and FSDP), on 4 (FSDP: DCP reshards 2 -> 4, including a tensor whose
first dimension, 3, does not divide by 4) and on 2 under the other strategy
(FSDP sharded -> DDP, DDP -> FSDP). Values are compared as full tensors,
exactly.
"""

from __future__ import annotations

import os

import pytest
import torch.distributed as dist

import shardwise
from shardwise import FSDPStrategy, Trainer
from shardwise.callbacks import ModelCheckpoint
from shardwise.checkpoint import layout

from helpers.checkpoints import Net, assert_same_state, full_state, loader

STEPS = 3


def _strategy(name):
    return {"fsdp": FSDPStrategy(), "fsdp_async": FSDPStrategy(async_save=True)}.get(name, name)


def _trainer(name, root, devices, max_steps=STEPS, callbacks=(), checkpointing=False):
    return Trainer(
        accelerator="cpu",
        devices=devices,
        strategy=_strategy(name),
        max_steps=max_steps,
        logger=False,
        enable_progress_bar=False,
        enable_checkpointing=checkpointing,
        default_root_dir=root,
        callbacks=list(callbacks),
    )


def write_checkpoints(root):
    """2 processes: train 3 steps under FSDP and DDP, save in every format."""
    out = {}
    shardwise.seed_everything(0)
    trainer = _trainer("fsdp", root, 2)
    trainer.fit(Net(scheduler=True), loader())
    trainer.save_checkpoint(os.path.join(root, "fsdp-sharded.ckpt"))
    trainer.strategy.state_dict_type = "full"  # the same run, written the other way
    trainer.save_checkpoint(os.path.join(root, "fsdp-full.ckpt"))
    out["fsdp"] = full_state(trainer)
    shardwise.seed_everything(0)
    trainer = _trainer("ddp", root, 2)
    trainer.fit(Net(scheduler=True), loader())
    trainer.save_checkpoint(os.path.join(root, "ddp.ckpt"))
    out["ddp"] = full_state(trainer)
    # Async: the write overlaps training and is committed at the next save / at the end.
    shardwise.seed_everything(0)
    ckpt = ModelCheckpoint(dirpath=os.path.join(root, "async"), every_n_train_steps=2, save_top_k=1)
    trainer = _trainer("fsdp_async", root, 2, max_steps=4, callbacks=[ckpt], checkpointing=True)
    trainer.fit(Net(scheduler=True), loader())
    out["async"] = full_state(trainer)
    out["async_files"] = sorted(os.listdir(os.path.join(root, "async")))
    # Across strategies, in the same processes: FSDP sharded -> DDP, DDP full -> FSDP.
    out["cross"] = load_checkpoints(root, [("ddp", "fsdp-sharded.ckpt"), ("fsdp", "ddp.ckpt")])
    return out


def load_checkpoints(root, jobs):
    """Resume each (strategy, checkpoint) with fit(ckpt_path=...) and report the values loaded."""
    out = {}
    for name, path in jobs:
        shardwise.seed_everything(123)  # nothing may come from the seed
        step = layout.read_manifest(os.path.join(root, path))["global_step"]
        trainer = _trainer(name, root, int(os.environ.get("WORLD_SIZE", 1)), max_steps=step)
        trainer.fit(Net(scheduler=True), loader(), ckpt_path=os.path.join(root, path))
        out[(name, path)] = full_state(trainer)
    return out


@pytest.fixture(scope="module")
def written(tmp_path_factory):
    root = str(tmp_path_factory.mktemp("reshard"))
    return root, shardwise.launch(write_checkpoints, root, devices=2)[0]


@pytest.fixture(autouse=True)
def _no_leftover_process_group():
    yield
    if dist.is_initialized():  # FSDP on one process creates its own group
        dist.destroy_process_group()


def test_written_formats_and_async_commit(written):
    root, ref = written
    assert sorted(os.listdir(os.path.join(root, "fsdp-sharded.ckpt"))) == [
        ".metadata",
        "__0_0.distcp",
        "__1_0.distcp",
        "shardwise.json",
        "trainer_state.pt",
    ]
    assert os.path.isfile(os.path.join(root, "fsdp-full.ckpt")) and os.path.isfile(os.path.join(root, "ddp.ckpt"))
    # save_top_k=1 + last: only step 4 remains, committed, `last` pointing at it.
    assert ref["async_files"] == ["epoch=0-step=4.ckpt", "last.ckpt"]
    last = os.path.join(root, "async", "last.ckpt")
    assert layout.read_manifest(last)["global_step"] == 4


def test_two_to_one_process(written):
    root, ref = written
    jobs = [
        ("single", "fsdp-sharded.ckpt"),
        ("single", "fsdp-full.ckpt"),
        ("fsdp", "fsdp-sharded.ckpt"),
        ("single", "async/last.ckpt"),
    ]
    got = load_checkpoints(root, jobs)  # in this process: a world of one
    for name, path in jobs:
        assert_same_state(ref["async" if path.startswith("async") else "fsdp"], got[(name, path)], (name, path))


@pytest.mark.slow
def test_two_to_four_processes(written):
    root, ref = written
    jobs = [("fsdp", "fsdp-sharded.ckpt"), ("fsdp", "fsdp-full.ckpt"), ("fsdp", "ddp.ckpt")]
    got = shardwise.launch(load_checkpoints, root, jobs, devices=4)[0]
    for name, path in jobs:
        assert_same_state(ref["ddp" if path == "ddp.ckpt" else "fsdp"], got[(name, path)], (name, path))


def test_fsdp_to_ddp_and_back(written):
    root, ref = written
    got = ref["cross"]
    assert_same_state(ref["fsdp"], got[("ddp", "fsdp-sharded.ckpt")], "fsdp -> ddp")
    assert_same_state(ref["ddp"], got[("fsdp", "ddp.ckpt")], "ddp -> fsdp")

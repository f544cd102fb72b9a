"""Checkpoints move between 2 GPUs, 1 GPU and the CPU with identical model and optimizer values.

Written on min(2, GPUs) ranks (FSDP sharded, DDP full), then resumed with
fit(ckpt_path=...) and no further steps on 1 GPU (FSDP and single device)
and on the CPU (single device); and the other way: written on the CPU,
resumed on the GPUs. Values are compared as full CPU tensors, exactly.
"""

import os

import pytest
from gpu_common import DEVICE_TYPE, skip_without_gpu, world

import shardwise
from shardwise import FSDPStrategy, Trainer
from shardwise.checkpoint import layout

from helpers.checkpoints import Net, assert_same_state, full_state, loader

skip_without_gpu()
pytestmark = pytest.mark.gpu

STEPS = 3


def _trainer(accelerator, strategy, root, devices, max_steps=STEPS):
    strategy = FSDPStrategy() if strategy == "fsdp" else strategy
    return Trainer(
        accelerator=accelerator,
        devices=devices,
        strategy=strategy,
        max_steps=max_steps,
        logger=False,
        enable_progress_bar=False,
        enable_checkpointing=False,
        default_root_dir=root,
    )


def write(accelerator, root, strategies):
    out = {}
    for name in strategies:
        shardwise.seed_everything(0)
        trainer = _trainer(accelerator, name, root, int(os.environ.get("WORLD_SIZE", 1)))
        trainer.fit(Net(), loader())
        trainer.save_checkpoint(os.path.join(root, f"{accelerator}-{name}.ckpt"))
        out[name] = full_state(trainer)
    return out


def load(accelerator, root, jobs):
    out = {}
    for strategy, path in jobs:
        shardwise.seed_everything(123)  # nothing may come from the seed
        step = layout.read_manifest(os.path.join(root, path))["global_step"]
        trainer = _trainer(accelerator, strategy, root, int(os.environ.get("WORLD_SIZE", 1)), max_steps=step)
        trainer.fit(Net(), loader(), ckpt_path=os.path.join(root, path))
        out[(strategy, path)] = full_state(trainer)
    return out


def test_checkpoints_move_between_gpus_one_gpu_and_cpu(tmp_path):
    root = str(tmp_path)
    gpu = shardwise.launch(write, DEVICE_TYPE, root, ["fsdp", "ddp"], devices=world())[0]
    one_gpu = shardwise.launch(
        load,
        DEVICE_TYPE,
        root,
        [
            ("fsdp", f"{DEVICE_TYPE}-fsdp.ckpt"),
            ("single", f"{DEVICE_TYPE}-fsdp.ckpt"),
            ("single", f"{DEVICE_TYPE}-ddp.ckpt"),
        ],
        devices=1,
    )[0]
    cpu = shardwise.launch(
        load, "cpu", root, [("single", f"{DEVICE_TYPE}-fsdp.ckpt"), ("single", f"{DEVICE_TYPE}-ddp.ckpt")], devices=1
    )[0]
    for (strategy, path), got in {**one_gpu}.items():
        assert_same_state(gpu[path.split("-", 1)[1][:-5]], got, ("1 GPU", strategy, path))
    for (strategy, path), got in cpu.items():
        assert_same_state(gpu[path.split("-", 1)[1][:-5]], got, ("CPU", strategy, path))

    written_on_cpu = shardwise.launch(write, "cpu", root, ["fsdp"], devices=world())[0]
    back = shardwise.launch(load, DEVICE_TYPE, root, [("fsdp", "cpu-fsdp.ckpt")], devices=world())[0]
    assert_same_state(written_on_cpu["fsdp"], back[("fsdp", "cpu-fsdp.ckpt")], ("CPU -> GPUs", "fsdp"))

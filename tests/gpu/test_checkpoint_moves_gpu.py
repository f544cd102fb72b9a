"""Checkpoints move between 2 GPUs, 1 GPU and the CPU with identical model and optimizer values.

Written on min(2, GPUs) ranks (FSDP sharded, DDP full), then resumed with
fit(ckpt_path=...) and no further steps on 1 GPU (FSDP and single device)
and on the CPU (single device); and the other way: written on the CPU,
resumed on the GPUs. Values are compared as full CPU tensors, exactly.
"""
import os

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict, get_optimizer_state_dict
from torch.utils.data import DataLoader, TensorDataset

import shardwise
from gpu_common import DEVICE_TYPE, skip_without_gpu, world
from shardwise import FSDPStrategy, Trainer, TrainModule
from shardwise.checkpoint import layout

skip_without_gpu()
pytestmark = pytest.mark.gpu

STEPS = 3


class Net(TrainModule):
    def configure_model(self):
        self.net = nn.Sequential(nn.Linear(8, 16), nn.LayerNorm(16), nn.GELU(), nn.Linear(16, 3))

    def training_step(self, batch, batch_idx):
        x, y = batch
        return F.cross_entropy(self.net(x), y)

    def configure_optimizers(self):
        return torch.optim.AdamW(self.parameters(), lr=1e-2)


def _loader():
    g = torch.Generator().manual_seed(0)
    return DataLoader(TensorDataset(torch.randn(40, 8, generator=g), torch.randint(0, 3, (40,), generator=g)),
                      batch_size=4, shuffle=True)


def _trainer(accelerator, strategy, root, devices, max_steps=STEPS):
    strategy = FSDPStrategy() if strategy == "fsdp" else strategy
    return Trainer(accelerator=accelerator, devices=devices, strategy=strategy, max_steps=max_steps, logger=False,
                   enable_progress_bar=False, enable_checkpointing=False, default_root_dir=root)


def _values(trainer):
    options = StateDictOptions(full_state_dict=True)
    model = {k: v.detach().cpu().clone() for k, v in get_model_state_dict(trainer.model, options=options).items()}
    osd = get_optimizer_state_dict(trainer.model, trainer.optimizers[0], options=options)
    optim = {f"{fqn}/{k}": v.detach().cpu().clone() for fqn, s in osd["state"].items() for k, v in s.items()}
    return {"model": model, "optim": optim, "step": trainer.global_step}


def write(accelerator, root, strategies):
    out = {}
    for name in strategies:
        shardwise.seed_everything(0)
        trainer = _trainer(accelerator, name, root, int(os.environ.get("WORLD_SIZE", 1)))
        trainer.fit(Net(), _loader())
        trainer.save_checkpoint(os.path.join(root, f"{accelerator}-{name}.ckpt"))
        out[name] = _values(trainer)
    return out


def load(accelerator, root, jobs):
    out = {}
    for strategy, path in jobs:
        shardwise.seed_everything(123)  # nothing may come from the seed
        step = layout.read_manifest(os.path.join(root, path))["global_step"]
        trainer = _trainer(accelerator, strategy, root, int(os.environ.get("WORLD_SIZE", 1)), max_steps=step)
        trainer.fit(Net(), _loader(), ckpt_path=os.path.join(root, path))
        out[(strategy, path)] = _values(trainer)
    return out


def _same(expected, got, what):
    assert got["step"] == expected["step"], what
    assert expected["model"].keys() == got["model"].keys(), what
    for key in expected["model"]:
        assert torch.equal(expected["model"][key], got["model"][key]), (what, key)
    assert expected["optim"].keys() == got["optim"].keys(), what
    for key in expected["optim"]:
        assert torch.equal(expected["optim"][key], got["optim"][key]), (what, key)


def test_checkpoints_move_between_gpus_one_gpu_and_cpu(tmp_path):
    root = str(tmp_path)
    gpu = shardwise.launch(write, DEVICE_TYPE, root, ["fsdp", "ddp"], devices=world())[0]
    one_gpu = shardwise.launch(load, DEVICE_TYPE, root, [("fsdp", f"{DEVICE_TYPE}-fsdp.ckpt"),
                                                         ("single", f"{DEVICE_TYPE}-fsdp.ckpt"),
                                                         ("single", f"{DEVICE_TYPE}-ddp.ckpt")], devices=1)[0]
    cpu = shardwise.launch(load, "cpu", root, [("single", f"{DEVICE_TYPE}-fsdp.ckpt"),
                                               ("single", f"{DEVICE_TYPE}-ddp.ckpt")], devices=1)[0]
    for (strategy, path), got in {**one_gpu}.items():
        _same(gpu[path.split("-", 1)[1][:-5]], got, ("1 GPU", strategy, path))
    for (strategy, path), got in cpu.items():
        _same(gpu[path.split("-", 1)[1][:-5]], got, ("CPU", strategy, path))

    written_on_cpu = shardwise.launch(write, "cpu", root, ["fsdp"], devices=world())[0]
    back = shardwise.launch(load, DEVICE_TYPE, root, [("fsdp", "cpu-fsdp.ckpt")], devices=world())[0]
    _same(written_on_cpu["fsdp"], back[("fsdp", "cpu-fsdp.ckpt")], ("CPU -> GPUs", "fsdp"))

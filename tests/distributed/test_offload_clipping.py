"""Gradient clipping under FSDP reduces the sharded norms on the collective device (issue 15).

Under `cpu_offload=True` the gradients (and so their per-shard norms) are CPU
DTensors on an NCCL mesh; `total.full_tensor()` then hands NCCL a CPU
tensor. Clipping now stages the partial norm on `ops.collective_device()`
(`ops.full_tensor`). On 2 gloo processes tests/helpers/strict_device.py makes
`DTensor.full_tensor()` refuse shards not on "cuda:0", as NCCL would; every
gradient here is a CPU tensor, as under offload on a GPU. The clipped step
must equal a plain single-process clip of the same gradients.
"""

import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

import shardwise
from shardwise import FSDPStrategy, Trainer, TrainModule

from helpers.strict_device import strict_cuda_collectives


class Net(TrainModule):
    def configure_model(self):
        self.net = nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 1))

    def training_step(self, batch):
        return (self.net(batch[0]) - batch[1]).pow(2).mean() * 100  # large gradients: clipping bites

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1)


def clipped_norms(tmp):
    torch.manual_seed(0)
    data = TensorDataset(torch.randn(8, 4), torch.randn(8, 1))
    with strict_cuda_collectives() as calls:
        trainer = Trainer(
            accelerator="cpu",
            devices=2,
            strategy=FSDPStrategy(cpu_offload=True),
            max_steps=2,
            gradient_clip_val=0.5,
            logger=False,
            enable_progress_bar=False,
            enable_checkpointing=False,
            default_root_dir=tmp,
        )
        trainer.fit(Net(), DataLoader(data, batch_size=2))
    return dict(calls)


def test_offload_clipping_reduces_norms_on_the_collective_device(tmp_path):
    ranks = shardwise.launch(clipped_norms, str(tmp_path), devices=2)
    for calls in ranks:
        assert calls.get("full_tensor", 0) >= 2, calls  # one global norm per optimizer step, via (fake) cuda:0

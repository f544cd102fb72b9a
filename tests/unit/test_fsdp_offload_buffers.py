"""FSDP cpu_offload=True keeps buffers on the compute device (issue 15).

FSDP2's CPUOffloadPolicy offloads parameters; buffers are not FSDP's, and it
never moves them. shardwise materialises an offloaded model on the host, so
without the fix RoPE frequencies / norm statistics stayed on the CPU and the
first forward on a GPU mixed devices. On this CPU-only machine the rank's
compute device is patched to cuda:0 after the (CPU) mesh is built, so the
offload policy really applies, and tests/helpers/strict_device.py turns copies to
cuda:0 into fake CUDA tensors holding CPU data.
"""

import warnings

import torch
from torch import nn
from torch.distributed.tensor import DTensor

from shardwise import FSDPStrategy

from helpers.strict_device import FAKE_CUDA, fake_cuda_copies


class Block(nn.Module):
    def __init__(self):
        super().__init__()
        self.linear = nn.Linear(8, 8)
        self.norm = nn.BatchNorm1d(8)  # running statistics: persistent buffers
        self.register_buffer("inv_freq", torch.ones(4), persistent=False)  # RoPE-like, recomputed

    def reset_parameters(self):
        with torch.no_grad():
            self.inv_freq.copy_(1.0 / 10000 ** (torch.arange(4.0) / 4))


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.blocks = nn.Sequential(Block(), Block())
        self.head = nn.Linear(8, 2)


def test_cpu_offload_places_buffers_on_the_compute_device_and_parameters_on_the_host():
    strategy = FSDPStrategy(auto_wrap_policy={Block}, cpu_offload=True)
    strategy.connect("cpu")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # "cpu_offload does nothing on CPU": true here, patched below
        strategy.setup_environment()
    try:
        strategy.root_device = FAKE_CUDA  # this rank's GPU; the mesh stays on the CPU
        assert "offload_policy" in strategy._fsdp_kwargs()
        with fake_cuda_copies():
            with strategy.module_init_context():
                model = Net()
            model = strategy.setup_module(model)
        buffers = dict(model.named_buffers())
        assert {n.rsplit(".", 1)[-1] for n in buffers} >= {"running_mean", "running_var", "inv_freq"}
        assert {n: b.device for n, b in buffers.items()} == {n: FAKE_CUDA for n in buffers}
        params = list(model.parameters())
        assert params and all(isinstance(p, DTensor) and p.to_local().device.type == "cpu" for p in params)
    finally:
        strategy.teardown()

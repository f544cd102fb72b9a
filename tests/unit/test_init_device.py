"""Meta-device initialisation draws from the CPU generator whatever the device (issue 15).

CUDA's generator (Philox) gives other numbers than the CPU's from the same
seed. FSDP with `cpu_offload` initialises on the host, FSDP / DDP / ZeRO-3
without it on the GPU, so "every strategy starts from the same weights"
broke on GPUs. `reset_parameters()` now runs on CPU temporaries (the GPU
keeps a copy); here a parameter on cuda:0 is simulated by
tests/helpers/strict_device.py's fake CUDA tensor (CPU data that says cuda:0).
"""

import torch
from torch import nn

from shardwise.seed import rng_devices
from shardwise.strategies.materialize import reset_own

from helpers.strict_device import FAKE_CUDA, FakeCudaTensor, fake_cuda_copies


class Recorded(nn.Linear):
    """nn.Linear that notes the device its own init sees."""

    seen = []

    def reset_parameters(self):
        Recorded.seen.append(self.weight.device)
        super().reset_parameters()


def test_reset_parameters_runs_on_cpu_copies_of_gpu_parameters():
    reference = Recorded(6, 4)
    torch.manual_seed(7)
    reference.reset_parameters()

    layer = Recorded(6, 4)
    with fake_cuda_copies():
        for name in ("weight", "bias"):
            # (a plain fake in the dict: nn.Parameter cannot wrap this test double)
            layer._parameters[name] = FakeCudaTensor(torch.full_like(getattr(layer, name).detach(), float("nan")))
        Recorded.seen.clear()
        torch.manual_seed(7)
        reset_own(layer, layer.reset_parameters)
        assert layer.weight.device == FAKE_CUDA  # still where the model lives
        weight, bias = layer.weight.to("cpu"), layer.bias.to("cpu")
    assert Recorded.seen == [torch.device("cpu")]  # before the fix: cuda:0, i.e. CUDA's generator
    assert torch.equal(weight, reference.weight.detach()) and torch.equal(bias, reference.bias.detach())


def test_buffers_assigned_by_the_init_are_copied_back():
    class Rope(nn.Module):
        def __init__(self):
            super().__init__()
            self.register_buffer("inv_freq", torch.empty(4), persistent=False)

        def reset_parameters(self):
            self.inv_freq = 1.0 / 10000 ** (torch.arange(4.0) / 4)  # a new tensor, as HF's rotary init does

    rope = Rope()
    with fake_cuda_copies():
        rope._buffers["inv_freq"] = FakeCudaTensor(torch.zeros(4))
        reset_own(rope, rope.reset_parameters)
        assert rope.inv_freq.device == FAKE_CUDA
        values = rope.inv_freq.to("cpu")
    assert torch.equal(values, 1.0 / 10000 ** (torch.arange(4.0) / 4))


def test_rng_fork_covers_the_gpu_generator_when_one_is_in_use(monkeypatch):
    assert rng_devices(torch.device("cuda", 1)) == [torch.device("cuda", 1)]
    assert rng_devices(torch.device("cpu")) == []  # no CUDA here
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "is_initialized", lambda: True)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    assert rng_devices() == [torch.device("cuda", 0)]  # ZeRO-3's forks restore CUDA's stream too

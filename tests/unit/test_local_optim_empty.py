"""A local-shard optimizer step skips shards with no elements (issue 36, item 6).

Under FSDP2 a rank may hold none of a small parameter: LoRA's A with r=1 over
a shard group of 2 leaves rank 1 an empty shard. bitsandbytes' CUDA kernels
fail on an empty tensor and call exit(1) with no Python traceback, so the step
on local shards hands such a shard over without a gradient, which every
optimizer skips. On CPU bitsandbytes steps the empty tensor (and keeps state
for it), so the skip is observable here as "no state for it"; the other
parameters must step exactly as without it. Rank 1 of a 2-rank mesh is played
on a fake process group (no collective runs in a local step).
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor, Shard

from shardwise.strategies.local_optim import apply_local_shard_step

bnb = pytest.importorskip("bitsandbytes")


@pytest.fixture
def rank_one_of_two():
    from torch.testing._internal.distributed.fake_pg import FakeStore

    dist.init_process_group("fake", store=FakeStore(), rank=1, world_size=2)
    try:
        yield init_device_mesh("cpu", (2,))
    finally:
        dist.destroy_process_group()


def sharded(mesh, local: torch.Tensor, shape) -> torch.nn.Parameter:
    stride = torch.empty(shape).stride()
    return torch.nn.Parameter(DTensor.from_local(local, mesh, [Shard(0)], run_check=False, shape=shape, stride=stride))


def local_grad(mesh, local: torch.Tensor, shape) -> DTensor:
    return DTensor.from_local(local, mesh, [Shard(0)], run_check=False, shape=shape, stride=torch.empty(shape).stride())


@pytest.mark.parametrize("make", [bnb.optim.AdamW32bit, bnb.optim.PagedAdamW32bit, bnb.optim.AdamW8bit])
def test_an_empty_shard_is_skipped_and_the_others_step_as_without_it(rank_one_of_two, make):
    mesh = rank_one_of_two
    torch.manual_seed(0)
    w_local, g_local = torch.randn(3, 4), torch.randn(3, 4)

    def run(with_empty: bool):
        weight = sharded(mesh, w_local.clone(), (6, 4))  # rank 1 holds rows 3-5
        params = [weight]
        weight.grad = local_grad(mesh, g_local.clone(), (6, 4))
        if with_empty:
            lora_a = sharded(mesh, torch.empty(0, 4), (1, 4))  # r=1: rank 0 holds the only row
            lora_a.grad = local_grad(mesh, torch.empty(0, 4), (1, 4))
            params.append(lora_a)
        optimizer = apply_local_shard_step(make(params, lr=1e-2))
        for _ in range(2):
            optimizer.step()
        return params, optimizer

    (alone,), reference = run(False)
    (weight, lora_a), optimizer = run(True)
    assert lora_a not in optimizer.state and lora_a.grad is not None  # skipped, its gradient left in place
    assert torch.equal(weight.to_local(), alone.to_local())
    state, expected = optimizer.state[weight], reference.state[alone]
    assert state.keys() == expected.keys()
    for key, value in expected.items():
        got = state[key]
        if isinstance(value, torch.Tensor):
            got, value = (t.to_local() if isinstance(t, DTensor) else t for t in (got, value))
            assert torch.equal(got, value), key
        else:
            assert got == value, key


def test_a_plain_empty_parameter_is_skipped_and_keeps_its_gradient():
    weight, empty = torch.nn.Parameter(torch.ones(2, 2)), torch.nn.Parameter(torch.empty(0, 2))
    weight.grad, empty.grad = torch.ones(2, 2), torch.empty(0, 2)
    optimizer = apply_local_shard_step(bnb.optim.AdamW32bit([weight, empty], lr=1e-2))
    optimizer.step()
    assert empty not in optimizer.state and weight in optimizer.state
    assert empty.grad is not None and not torch.equal(weight.detach(), torch.ones(2, 2))

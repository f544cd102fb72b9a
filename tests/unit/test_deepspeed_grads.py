"""The health check reads DeepSpeed's offloaded gradient partitions where they live, after their copies landed.

Issue 36, item 3. Two faults only a GPU shows, reproduced here with stand-ins
for the parts of DeepSpeed's optimizers the check reads (the attributes and
methods of DeepSpeed 0.19's stage_1_and_2.py and stage3.py):
- ZeRO-1/2 with the optimizer offloaded fills the host's fp32 partition with
  non-blocking copies that DeepSpeed waits for at the top of step(). The
  stand-in's copy "lands" only when that wait is made, so a check that reads
  first sees the stale buffer (all zeros) instead of the NaN.
- ZeRO-3 with the optimizer offloaded: DeepSpeed's per-parameter getter waits
  on the reduce stream and copies the partition to the device each time (the
  stand-in counts both, as the real one does on a GPU). The check must wait
  once and copy nothing, and still find each parameter's partition by name.
"""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
from torch import nn

from shardwise.trainer.nonfinite import grad_norms

pytest.importorskip("deepspeed")


def strategy_with(optimizer, model, stage):
    from shardwise.strategies.deepspeed import DeepSpeedStrategy

    strategy = DeepSpeedStrategy(stage=stage, offload_optimizer=True)
    strategy.engine = SimpleNamespace(optimizer=optimizer, module=model)
    return strategy


class InFlightOffload:
    """ZeRO-1/2 offload: the device-to-host copy of this window's gradient completes at DeepSpeed's wait."""

    def __init__(self, arrived: torch.Tensor) -> None:
        self.arrived = arrived
        self.single_partition_of_fp32_groups = [SimpleNamespace(grad=torch.zeros_like(arrived))]  # stale
        self.waits = 0

    def _wait_for_offload_copies(self) -> None:
        self.waits += 1
        self.single_partition_of_fp32_groups[0].grad.copy_(self.arrived)


def test_zero2_offload_waits_for_the_copies_before_reading():
    model = nn.Linear(2, 2)
    arrived = torch.tensor([0.5, float("nan"), 1.0, 2.0, 0.0, 1.0])
    optimizer = InFlightOffload(arrived)
    norms = grad_norms(strategy_with(optimizer, model, 2).gradients(model))
    assert optimizer.waits == 1
    assert norms.norms is not None and torch.isnan(norms.norms).all(), "read before the copy landed"


class CountingStream:
    def __init__(self) -> None:
        self.syncs = 0

    def synchronize(self) -> None:
        self.syncs += 1


class Zero3Offload:
    """ZeRO-3 with the optimizer offloaded: one flat fp32 gradient per sub-group on the host, each parameter's
    partition at (group, offset, count) in grad_position. get_local_fp32_grad_for_param behaves as DeepSpeed
    0.19's does on a GPU: a host wait on the reduce stream, then a copy of the partition to the device."""

    def __init__(self, params) -> None:
        self.offload_optimizer = True
        self.reduce_and_partition_stream = CountingStream()
        self.grad_position = {}
        self.bytes_copied = 0
        sizes = [p.numel() for p in params]
        flat = torch.arange(float(sum(sizes)))
        self.fp32_partitioned_groups_flat = [SimpleNamespace(grad=flat)]
        offset = 0
        for i, p in enumerate(params):
            p.ds_id = 100 + i
            p._z3_optimizer = self
            self.grad_position[p.ds_id] = [0, offset, p.numel()]
            offset += p.numel()

    def get_param_id(self, p) -> int:
        return p.ds_id

    def get_local_fp32_grad_for_param(self, p) -> torch.Tensor:
        self.reduce_and_partition_stream.synchronize()
        group, offset, count = self.grad_position[p.ds_id]
        partition = self.fp32_partitioned_groups_flat[group].grad.narrow(0, offset, count)
        self.bytes_copied += partition.numel() * partition.element_size()  # .to(current device) on a GPU
        return partition.clone()


def test_zero3_offload_reads_each_partition_in_place_with_one_wait():
    model = nn.Sequential(nn.Linear(3, 4), nn.Linear(4, 2))
    params = list(model.parameters())
    optimizer = Zero3Offload(params)
    held = strategy_with(optimizer, model, 3).gradients(model)
    assert optimizer.reduce_and_partition_stream.syncs == 1  # once per step, not once per parameter
    assert optimizer.bytes_copied == 0  # no partition copied anywhere: only the norms travel
    flat = optimizer.fp32_partitioned_groups_flat[0].grad
    assert [g.untyped_storage().data_ptr() for g in held] == [flat.untyped_storage().data_ptr()] * len(params)
    # One partition per trainable parameter, in model order: the check can name the parameter.
    expected = torch.stack([torch.linalg.vector_norm(optimizer.get_local_fp32_grad_for_param(p)) for p in params])
    assert torch.equal(grad_norms(held).norms, expected)

"""Collectives per optimizer step, counted in real training on gloo (issue 20, item 3).

Every strategy and accumulation setting of helpers/collective_counts.py
trains three optimizer steps through the Trainer while a dispatch mode
(torch's own interception point, the one CommDebugMode uses) logs every c10d
collective the process issues: FSDP2's all-gathers and reduce-scatters from
Python, and DDP's bucket all-reduce, which its C++ reducer calls through the
same dispatcher. Each collective is attributed to its optimizer step and
micro-batch, its phase (inside the autograd engine or not) and its group's
role (the mesh's shard or replicate dimension).

What is asserted, exactly: the parameter and gradient collectives of every
step, per FSDP unit (or DDP bucket), equal the table; those that run once per
step run in the last micro-batch (HYBRID_SHARD's replica all-reduce, DDP's and
NO_SHARD's all-reduce); the Trainer's own collectives (small all-reduces such
as the non-finite / preemption agreement) are the same whatever the strategy
and accumulation, and none runs in a non-final micro-batch. Two launches: the
2-process cases share one, HYBRID_SHARD's 2 x 2 mesh takes four processes.
"""

from __future__ import annotations

from collections import Counter
from typing import Any, Dict, List, Optional, Tuple

import pytest
import torch
import torch.distributed as dist
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils.data import DataLoader, TensorDataset

import shardwise
from shardwise import DDPStrategy, FSDPStrategy, Trainer, TrainModule

from helpers.collective_counts import CASES, CountCase, per_micro_batch

STEPS = 3
BATCH = 2
FSDP_UNITS = 3  # the two Blocks and the root, which owns the input and output layers
DDP_BUCKETS = 1  # the model is far below DDP's first bucket (1 MiB)
# c10d's in-place ops and the functional collectives DTensor uses, by what they do
KINDS = {
    "_allgather_base_": "all_gather",
    "allgather_into_tensor_coalesced_": "all_gather",
    "all_gather_into_tensor": "all_gather",
    "_reduce_scatter_base_": "reduce_scatter",
    "reduce_scatter_tensor": "reduce_scatter",
    "allreduce_": "all_reduce",
    "all_reduce": "all_reduce",
    "broadcast_": "broadcast",
    "broadcast": "broadcast",
}
NAMESPACES = ("c10d", "_c10d_functional", "c10d_functional")
NOT_COLLECTIVES = ("wait_tensor", "wait")


class CollectiveLog(TorchDispatchMode):
    """Every collective this process issues: (where, kind, group name, elements) in call order.

    `where` is set by the CountProbe callback: (step, micro-batch) during a
    micro-batch, (step, "step") from the optimizer step's first hook on; a
    collective inside the autograd engine is marked as backward."""

    def __init__(self) -> None:
        super().__init__()
        self.where: Optional[Tuple[int, Any]] = None
        self.calls: List[Tuple[Optional[Tuple[int, Any]], bool, str, str, int]] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        name = func.__name__.split(".")[0]
        if func.namespace in NAMESPACES and name not in NOT_COLLECTIVES:
            values = list(args) + list(kwargs.values())
            group, elements = "?", 0
            for value in values:
                if type(value).__name__ == "ScriptObject":  # c10d ops carry the ProcessGroup itself
                    try:
                        group = dist.ProcessGroup.unbox(value).group_name
                    except (RuntimeError, TypeError):
                        pass
                elif isinstance(value, str) and func.namespace != "c10d":  # functional ops: its name
                    group = value
                tensors = value if isinstance(value, (list, tuple)) else [value]
                for t in tensors:
                    if isinstance(t, torch.Tensor):
                        elements = max(elements, t.numel())
            in_backward = torch._C._current_graph_task_id() != -1
            self.calls.append((self.where, in_backward, KINDS.get(name, name), group, elements))
        return func(*args, **kwargs)


class CountProbe:
    """Callback: tells the log which step and micro-batch (or optimizer step) is running."""

    def __init__(self, log: CollectiveLog, accumulation: int) -> None:
        self.log, self.accumulation = log, accumulation

    def on_train_batch_start(self, trainer, module, batch, batch_idx):
        self.log.where = (trainer.global_step, batch_idx % self.accumulation)

    def on_before_optimizer_step(self, trainer, module, optimizer):
        self.log.where = (trainer.global_step, "step")

    def on_train_batch_end(self, trainer, module, outputs, batch, batch_idx):
        self.log.where = None


class Block(nn.Module):
    def __init__(self, width: int) -> None:
        super().__init__()
        self.linear = nn.Linear(width, width)

    def forward(self, x):
        return torch.relu(self.linear(x))


class CountedModule(TrainModule):
    """Two Blocks between an input and an output layer: with auto_wrap_policy={Block}, three FSDP units."""

    def configure_model(self):
        self.model = nn.Sequential(nn.Linear(8, 16), Block(16), Block(16), nn.Linear(16, 4))

    def training_step(self, batch):
        x, y = batch
        return nn.functional.mse_loss(self.model(x), y)

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1)


def _strategy(case: CountCase):
    if case.engine == "ddp":
        return DDPStrategy()
    return FSDPStrategy(
        auto_wrap_policy={Block}, sharding_strategy=case.sharding, device_mesh=case.mesh, accumulation_sync=case.sync
    )


def _roles(case: CountCase, strategy: Any) -> Dict[str, str]:
    """Group name -> its role. DDP reduces over the world, its replicas; FSDP by the mesh's dimension names."""
    if case.engine == "ddp":
        return {dist.group.WORLD.group_name: "replicate"}
    mesh = strategy.mesh
    # The mesh's dimensions are dp_replicate / dp_shard; the table's roles are replicate / shard.
    return {mesh.get_group(d).group_name: name.removeprefix("dp_") for d, name in enumerate(mesh.mesh_dim_names)}


def count_case(case: CountCase) -> Dict[str, Any]:
    """Train STEPS optimizer steps of `case` under the log; per step: model collectives and the rest."""
    shardwise.seed_everything(0)
    generator = torch.Generator().manual_seed(0)
    samples = case.devices * BATCH * case.accumulation * STEPS
    data = TensorDataset(torch.randn(samples, 8, generator=generator), torch.randn(samples, 4, generator=generator))
    log = CollectiveLog()
    strategy = _strategy(case)
    trainer = Trainer(
        accelerator="cpu",
        devices=case.devices,
        max_steps=STEPS,
        accumulate_grad_batches=case.accumulation,
        strategy=strategy,
        callbacks=[CountProbe(log, case.accumulation)],
        logger=False,
        enable_progress_bar=False,
        enable_checkpointing=False,
    )
    with log:
        trainer.fit(CountedModule(), DataLoader(data, batch_size=BATCH))
    roles = _roles(case, strategy)
    model: List[List[Dict[str, int]]] = [[{} for _ in range(case.accumulation)] for _ in range(STEPS)]
    other: List[List[Tuple[Any, str, int]]] = [[] for _ in range(STEPS)]
    for where, in_backward, kind, group, elements in log.calls:
        if where is None:
            continue  # set-up, or after a step's last hook (nothing runs there today)
        step, at = where
        gradient_or_parameter = kind in ("all_gather", "reduce_scatter") or (kind == "all_reduce" and in_backward)
        if gradient_or_parameter and at != "step":
            key = f"{kind}/{roles.get(group, group)}"
            model[step][at][key] = model[step][at].get(key, 0) + 1
        else:
            other[step].append((at, kind, elements))
    units = FSDP_UNITS if case.engine == "fsdp" else DDP_BUCKETS
    if case.engine == "fsdp":
        units_found = 1 + len(strategy.units)
        assert units_found == FSDP_UNITS, strategy.units
    return dict(model=model, other=other, units=units)


def measure(names: List[str]) -> Dict[str, Dict[str, Any]]:
    by_name = {case.name: case for case in CASES}
    return {name: count_case(by_name[name]) for name in names}


def _launch(devices: int) -> Dict[str, Dict[str, Any]]:
    names = [case.name for case in CASES if case.devices == devices]
    return shardwise.launch(measure, names, devices=devices)[0]


@pytest.fixture(scope="module")
def counted() -> Dict[str, Dict[str, Any]]:
    return {**_launch(2), **_launch(4)}


def _step_total(micro_batches: List[Dict[str, int]]) -> Dict[str, int]:
    total: Counter = Counter()
    for micro in micro_batches:
        total.update(micro)
    return dict(total)


@pytest.mark.parametrize("case", CASES, ids=lambda case: case.name)
def test_collectives_per_optimizer_step(counted, case):
    got = counted[case.name]
    units = got["units"]
    expected = {key: count * units for key, count in case.expected.items()}
    for step, micro_batches in enumerate(got["model"]):
        assert _step_total(micro_batches) == expected, (case.name, step, micro_batches)


@pytest.mark.parametrize("case", CASES, ids=lambda case: case.name)
def test_what_can_wait_runs_in_the_last_micro_batch(counted, case):
    got = counted[case.name]
    split = [
        {key: count * got["units"] for key, count in micro.items()}
        for micro in per_micro_batch(case.expected, case.accumulation)
    ]
    for step, micro_batches in enumerate(got["model"]):
        assert micro_batches == split, (case.name, step)


def test_hybrid_shard_all_reduces_across_replicas_once_per_step(counted):
    """Issue 20's acceptance: HSDP with accumulation 4 does one replica all-reduce per unit per step."""
    model = counted["hybrid_2x2-acc4"]["model"]
    for micro_batches in model:
        replica = [micro.get("all_reduce/replicate", 0) for micro in micro_batches]
        assert replica == [0, 0, 0, FSDP_UNITS], replica


def test_trainer_collectives_do_not_grow_with_micro_batches(counted):
    """The Trainer's own collectives are small, the same for every strategy and accumulation, and none
    runs in a non-final micro-batch (DDP's one-off bucket rebuild after its first step aside)."""
    steady = {name: sorted(got["other"][-1], key=repr) for name, got in counted.items()}
    first = next(iter(steady.values()))
    assert all(value == first for value in steady.values()), steady
    for name, got in counted.items():
        for step, calls in enumerate(got["other"]):
            for at, kind, elements in calls:
                assert elements <= 16, (name, step, at, kind, elements)
                if kind == "broadcast" and name.startswith("ddp") and step == 1 and at == 0:
                    continue  # DDP rebuilds its buckets once, in the second step's first forward
                assert at in ("step", 0), (name, step, at, kind)

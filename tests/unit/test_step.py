"""The step core shared by the Trainer and the planner (step.py), and the strategies' fake set-up.

What the planner predicts is only as good as its claim to run the training
code: these tests pin that the Trainer and the fake-tensor trace call the same
step functions, that the shared optimizer update keeps the Trainer's
semantics (skip, clip by value, several optimizers), and that a strategy set
up for planning builds fake shards through its own set-up code.
"""

from __future__ import annotations

import copy

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

import shardwise
from shardwise import TrainModule, step
from shardwise.distributed.env import single_process_env

from helpers.trainers import quiet_trainer as _trainer


def _data(n=32, seed=0):
    g = torch.Generator().manual_seed(seed)
    return TensorDataset(torch.randn(n, 8, generator=g), torch.randint(0, 3, (n,), generator=g))


class Classifier(TrainModule):
    def __init__(self):
        super().__init__()
        self.net = nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 3))

    def training_step(self, batch, batch_idx):
        x, y = batch
        return F.cross_entropy(self.net(x), y)

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1)


@pytest.fixture
def spy(monkeypatch):
    """Record every call of step.forward_backward (its `last` flag) and step.optimizer_update."""
    calls = []
    fb, ou = step.forward_backward, step.optimizer_update

    def forward_backward(*args, **kwargs):
        calls.append(("fb", kwargs["last"]))
        return fb(*args, **kwargs)

    def optimizer_update(*args, **kwargs):
        calls.append(("update", len(args[2])))
        return ou(*args, **kwargs)

    monkeypatch.setattr(step, "forward_backward", forward_backward)
    monkeypatch.setattr(step, "optimizer_update", optimizer_update)
    return calls


def test_the_trainer_and_the_planner_trace_run_the_same_step_functions(spy):
    if dist.is_initialized():  # an earlier in-process FSDP fit leaves its group until exit; the trace needs its own
        dist.destroy_process_group()
    _trainer(max_steps=2, accumulate_grad_batches=2).fit(Classifier(), DataLoader(_data(), batch_size=4))
    assert spy == [("fb", False), ("fb", True), ("update", 1)] * 2

    from shardwise.models import GPTConfig
    from shardwise.plan import Candidate
    from shardwise.plan.presets import gpt_spec
    from shardwise.plan.trace import fake_world, trace

    spy.clear()
    spec = gpt_spec("tiny", GPTConfig(vocab_size=128, block_size=16, n_layer=2, n_head=2, n_embd=32))
    with fake_world(2):
        traced = trace(
            spec,
            Candidate("fsdp", sharding="FULL_SHARD"),
            world_size=2,
            num_nodes=1,
            precision="32-true",
            seq_len=16,
            micro_batch=2,
            accumulation=2,
            depth=None,
        )
    assert spy == [("fb", False), ("fb", True), ("update", 1)]
    # The phases the trace records are the ones the step functions' hooks labelled.
    phases = {phase for phase, _, _ in traced.envelope}
    assert {"fwd1.0", "bwd1.0", "fwd1.1", "bwd1.1", "opt"} <= phases


def _two_optimizers():
    a, b = nn.Linear(4, 4), nn.Linear(4, 4)
    opts = [torch.optim.SGD(a.parameters(), lr=1.0), torch.optim.SGD(b.parameters(), lr=1.0)]
    model = nn.ModuleList([a, b])
    (a(torch.ones(2, 4)).sum() + b(torch.ones(2, 4)).sum()).backward()
    return model, opts


def test_optimizer_update_steps_and_zeroes_every_optimizer():
    model, opts = _two_optimizers()
    before = [p.detach().clone() for p in model.parameters()]
    from shardwise.strategies.single import SingleDeviceStrategy

    strategy = SingleDeviceStrategy()
    strategy.connect("cpu", "32-true")
    assert step.optimizer_update(strategy, model, opts) is True
    assert all(p.grad is None for p in model.parameters())
    assert all(not torch.equal(p, q) for p, q in zip(model.parameters(), before))


def test_a_cancelled_update_steps_no_optimizer_and_drops_every_gradient():
    from shardwise.strategies.single import SingleDeviceStrategy

    model, opts = _two_optimizers()
    before = [p.detach().clone() for p in model.parameters()]
    strategy = SingleDeviceStrategy()
    strategy.connect("cpu", "32-true")
    asked = []
    assert step.optimizer_update(strategy, model, opts, before_step=lambda i, o: asked.append(i) or False) is False
    assert asked == [0]
    assert all(p.grad is None for p in model.parameters())
    assert all(torch.equal(p, q) for p, q in zip(model.parameters(), before))


def test_trainer_clipping_by_value_equals_a_hand_written_loop():
    shardwise.seed_everything(0)
    module = Classifier()
    reference = copy.deepcopy(module.net)
    _trainer(max_steps=3, gradient_clip_val=0.01, gradient_clip_algorithm="value").fit(
        module, DataLoader(_data(), batch_size=8)
    )
    opt = torch.optim.SGD(reference.parameters(), lr=0.1)
    for i, (x, y) in enumerate(DataLoader(_data(), batch_size=8)):
        if i == 3:
            break
        F.cross_entropy(reference(x), y).backward()
        torch.nn.utils.clip_grad_value_(reference.parameters(), 0.01)
        opt.step()
        opt.zero_grad()
    for pa, pb in zip(module.net.parameters(), reference.parameters()):
        torch.testing.assert_close(pa, pb)


def test_a_none_loss_skips_the_backward_and_the_trainer_still_counts_the_batch():
    class SkipOdd(Classifier):
        def training_step(self, batch, batch_idx):
            return None if batch_idx % 2 else super().training_step(batch, batch_idx)

    seen = []
    module = SkipOdd()
    trainer = _trainer(max_steps=4)
    trainer.fit(module, DataLoader(_data(), batch_size=8))
    assert trainer.global_step == 4
    out, loss = step.forward_backward(
        trainer.strategy, trainer.model, ((torch.randn(2, 8), torch.zeros(2).long()), 1), before_backward=seen.append
    )
    assert out is None and loss is None and seen == []


# ------------------------------------------------------------- fake set-up of the strategies
class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.blocks = nn.ModuleList(nn.Linear(64, 64) for _ in range(2))
        self.head = nn.Linear(64, 8)
        self.init_calls = 0

    def init_weights(self):
        self.init_calls += 1

    def forward(self, x):
        for b in self.blocks:
            x = b(x)
        return self.head(x)


def _fake_env(world):
    import dataclasses

    return dataclasses.replace(
        single_process_env(),
        world_size=world,
        global_rank=0,
        local_rank=0,
        node_rank=0,
        num_nodes=1,
        local_world_size=world,
    )


def test_fsdp_set_up_for_planning_shards_fake_tensors_on_the_planned_mesh():
    from torch._subclasses.fake_tensor import FakeTensor, FakeTensorMode
    from torch.distributed.tensor import DTensor

    from shardwise.plan.trace import fake_world
    from shardwise.strategies.fsdp import FSDPStrategy

    strategy = FSDPStrategy(auto_wrap_policy={nn.Linear})
    strategy.connect("cpu", "32-true", devices=4)
    fake = FakeTensorMode(allow_non_fake_inputs=True)
    with fake_world(4):
        strategy.setup_fake_environment(_fake_env(4), fake)
        assert strategy.world_size == 4 and strategy.mesh.size() == 4
        with strategy.module_init_context():
            net = Net()
        model = strategy.setup_module(net)
        assert strategy.units == ["head", "blocks.1", "blocks.0"]
        weight = model.blocks[0].weight
        assert isinstance(weight, DTensor) and isinstance(weight.to_local(), FakeTensor)
        assert weight.to_local().shape == (16, 64)  # a quarter of the rows on rank 0
        assert net.init_calls == 0  # nothing allocated, nothing initialised
        with fake:
            model(torch.randn(2, 64)).sum().backward()
        assert isinstance(model.head.weight.grad.to_local(), FakeTensor)


def test_ddp_set_up_for_planning_keeps_fake_tensors_and_deepspeed_refuses():
    from torch._subclasses.fake_tensor import FakeTensor, FakeTensorMode

    from shardwise.strategies.ddp import DDPStrategy
    from shardwise.strategies.deepspeed import DeepSpeedStrategy

    strategy = DDPStrategy()
    strategy.connect("cpu", "32-true")
    fake = FakeTensorMode(allow_non_fake_inputs=True)
    strategy.setup_fake_environment(_fake_env(1), fake)
    with strategy.module_init_context():
        net = Net()
    with fake:
        model = strategy.setup_module(net)
    assert model is net and all(isinstance(p, FakeTensor) for p in model.parameters())
    assert net.init_calls == 0
    with pytest.raises(NotImplementedError, match="traces ZeRO stages as DDP"):
        DeepSpeedStrategy(stage=2).setup_fake_environment(_fake_env(1), fake)

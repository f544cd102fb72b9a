"""The Trainer loop on one process: hooks, optimizers, schedulers, logging, validation, accumulation."""

import copy

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

import shardwise
from shardwise import TrainModule

from helpers.trainers import quiet_trainer as _trainer


def _data(n=64, seed=0):
    g = torch.Generator().manual_seed(seed)
    return TensorDataset(torch.randn(n, 8, generator=g), torch.randint(0, 3, (n,), generator=g))


class Classifier(TrainModule):
    def __init__(self, optim="adam", sched=None):
        super().__init__()
        self.net = nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 3))  # built eagerly
        self.optim, self.sched = optim, sched

    def training_step(self, batch, batch_idx):
        x, y = batch
        loss = F.cross_entropy(self.net(x), y)
        self.log("loss", loss, prog_bar=True, on_epoch=True)
        return loss

    def validation_step(self, batch, batch_idx):
        x, y = batch
        self.log("val_loss", F.cross_entropy(self.net(x), y))

    def configure_optimizers(self):
        opt = torch.optim.SGD(self.parameters(), lr=0.1)
        if self.sched == "step":
            return {
                "optimizer": opt,
                "lr_scheduler": {"scheduler": torch.optim.lr_scheduler.StepLR(opt, 1, 0.5), "interval": "step"},
            }
        if self.sched == "epoch":
            return [opt], [torch.optim.lr_scheduler.StepLR(opt, 1, 0.5)]
        return opt


def test_hooks_run_in_order_and_module_sees_the_trainer():
    calls = []

    class Recorder:
        def __getattr__(self, name):
            if name.startswith("on_") or name in ("setup", "teardown"):
                return lambda *a, **k: calls.append(name)
            raise AttributeError(name)

    class Probe(Classifier):
        def on_train_start(self):
            calls.append(("module", self.trainer.world_size, len(self.trainer.strategy.optimizers)))

    trainer = _trainer(max_epochs=1, limit_train_batches=2, callbacks=[Recorder()])
    trainer.fit(Probe(), DataLoader(_data(), batch_size=8), DataLoader(_data(16), batch_size=8))
    assert calls[:3] == ["setup", "on_fit_start", "on_train_start"]
    assert ("module", 1, 1) in calls
    assert calls.index("on_train_epoch_start") < calls.index("on_train_batch_start")
    assert calls.index("on_validation_start") < calls.index("on_train_epoch_end")
    assert calls[-3:] == ["on_train_end", "on_fit_end", "teardown"]


def test_training_step_without_batch_idx():
    class NoIdx(Classifier):
        def training_step(self, batch):
            x, y = batch
            return F.cross_entropy(self.net(x), y)

    trainer = _trainer(max_steps=3)
    trainer.fit(NoIdx(), DataLoader(_data(), batch_size=8))
    assert trainer.global_step == 3


def test_step_scheduler_and_epoch_scheduler():
    trainer = _trainer(max_steps=3)
    module = Classifier(sched="step")
    trainer.fit(module, DataLoader(_data(), batch_size=8))
    assert trainer.strategy.optimizers[0].param_groups[0]["lr"] == pytest.approx(0.1 * 0.5**3)

    trainer = _trainer(max_epochs=2)
    module = Classifier(sched="epoch")
    trainer.fit(module, DataLoader(_data(), batch_size=8))
    assert trainer.strategy.optimizers[0].param_groups[0]["lr"] == pytest.approx(0.1 * 0.5**2)


def test_accumulation_matches_a_larger_batch():
    shardwise.seed_everything(0)
    base = Classifier()
    a, b = copy.deepcopy(base), copy.deepcopy(base)
    _trainer(max_steps=2, accumulate_grad_batches=2).fit(a, DataLoader(_data(), batch_size=4))
    _trainer(max_steps=2).fit(b, DataLoader(_data(), batch_size=8))
    for pa, pb in zip(a.parameters(), b.parameters()):
        torch.testing.assert_close(pa, pb, rtol=1e-5, atol=1e-6)


def test_trainer_equals_a_hand_written_loop_with_clipping():
    shardwise.seed_everything(0)
    module = Classifier()
    reference = copy.deepcopy(module.net)
    _trainer(max_steps=4, gradient_clip_val=0.05).fit(module, DataLoader(_data(), batch_size=8))
    opt = torch.optim.SGD(reference.parameters(), lr=0.1)
    for i, (x, y) in enumerate(DataLoader(_data(), batch_size=8)):
        if i == 4:
            break
        F.cross_entropy(reference(x), y).backward()
        torch.nn.utils.clip_grad_norm_(reference.parameters(), 0.05)
        opt.step()
        opt.zero_grad()
    for pa, pb in zip(module.net.parameters(), reference.parameters()):
        torch.testing.assert_close(pa, pb)


def test_logging_step_and_epoch_values_and_validation():
    trainer = _trainer(max_epochs=2, limit_train_batches=4, limit_val_batches=2)
    trainer.fit(Classifier(), DataLoader(_data(), batch_size=8), DataLoader(_data(32, seed=1), batch_size=8))
    logged = trainer.logged_metrics
    assert {"loss_step", "loss_epoch", "val_loss"} <= set(logged)
    assert "loss" in trainer.progress_bar_metrics
    assert trainer.current_epoch == 2 and trainer.global_step == 8


def test_val_check_interval_in_batches():
    runs = []

    class Count(Classifier):
        def on_validation_epoch_end(self):
            runs.append(self.trainer.global_step)

    trainer = _trainer(max_epochs=1, val_check_interval=3, limit_val_batches=1)
    trainer.fit(Count(), DataLoader(_data(), batch_size=8), DataLoader(_data(16), batch_size=8))
    assert runs == [3, 6]


def test_fractional_limit_and_validate():
    trainer = _trainer(max_epochs=1, limit_train_batches=0.5)
    module = Classifier()
    trainer.fit(module, DataLoader(_data(), batch_size=8))
    assert trainer.global_step == 4
    result = trainer.validate(module, DataLoader(_data(16), batch_size=8))
    assert "val_loss" in result[0]


def test_validate_needs_no_training_data():
    class EvalOnly(Classifier):  # a val_dataloader and no train_dataloader
        def train_dataloader(self):
            raise AssertionError("validate() built the training data")

        def val_dataloader(self):
            return DataLoader(_data(16), batch_size=8)

    module = EvalOnly()
    trainer = _trainer()
    result = trainer.validate(module)
    assert "val_loss" in result[0]
    assert trainer.module is module and trainer.lightning_module is module  # Lightning's name, same object

    class NoTrainData(Classifier):
        def val_dataloader(self):
            return DataLoader(_data(16), batch_size=8)

    assert "val_loss" in _trainer().validate(NoTrainData())[0]
    # A fit after validate() on the same Trainer still finds its training data.
    trainer = _trainer(max_steps=2)
    module = NoTrainData()
    trainer.validate(module)
    trainer.fit(module, DataLoader(_data(), batch_size=8))
    assert trainer.global_step == 2


def test_meta_init_is_the_same_across_runs_and_seeded():
    class Lazy(TrainModule):
        def configure_model(self):
            self.net = nn.Sequential(nn.Linear(8, 8), nn.LayerNorm(8), nn.Linear(8, 2))

        def training_step(self, batch):
            return self.net(batch).sum()

        def configure_optimizers(self):
            return torch.optim.SGD(self.parameters(), lr=0.0)

    weights = []
    for seed in (1, 1, 2):
        shardwise.seed_everything(seed)
        m = Lazy()
        _trainer(max_steps=1).fit(m, [torch.ones(2, 8)])
        weights.append(m.net[0].weight.detach().clone())
    assert torch.equal(weights[0], weights[1])
    assert not torch.equal(weights[0], weights[2])


def test_configure_optimizers_must_return_something():
    class Bad(Classifier):
        def configure_optimizers(self):
            return None

    with pytest.raises(ValueError, match="returned None"):
        _trainer(max_steps=1).fit(Bad(), DataLoader(_data(), batch_size=8))

"""The first-hour Lightning Trainer options (issue 24, item 7): fast_dev_run, num_sanity_val_steps,
overfit_batches, max_time, min_epochs / min_steps, detect_anomaly, estimated_stepping_batches, and
torch.compile(module) before fit."""

import datetime
import time

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

import shardwise
from shardwise import Trainer, TrainModule
from shardwise.callbacks import ModelCheckpoint
from shardwise.trainer.options import parse_max_time

from helpers.trainers import quiet_trainer as _trainer


def _data(n=24, seed=0):
    g = torch.Generator().manual_seed(seed)
    return TensorDataset(torch.randn(n, 4, generator=g), torch.randn(n, 1, generator=g))


class Counting(TrainModule):
    def __init__(self, pause=0.0):
        super().__init__()
        self.net = nn.Linear(4, 1)
        self.pause = pause
        self.seen = {"train": [], "val": [], "sanity": []}

    def training_step(self, batch, batch_idx):
        if self.pause:
            time.sleep(self.pause)
        self.seen["train"].append(batch[0][0, 0].item())
        x, y = batch
        return F.mse_loss(self.net(x), y)

    def validation_step(self, batch, batch_idx):
        self.seen["sanity" if self.trainer.sanity_checking else "val"].append(batch_idx)
        self.log("val_loss", F.mse_loss(self.net(batch[0]), batch[1]))

    def test_step(self, batch, batch_idx):
        self.log("test_loss", F.mse_loss(self.net(batch[0]), batch[1]))

    def predict_step(self, batch, batch_idx):
        return self.net(batch[0])

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.01)


def _loaders(batch_size=4):
    return DataLoader(_data(), batch_size=batch_size, shuffle=True), DataLoader(_data(16, 1), batch_size=4)


class Logs:
    def __init__(self):
        self.metrics = []

    def log_hyperparams(self, params):
        pass

    def log_metrics(self, metrics, step):
        self.metrics.append(dict(metrics))

    def finalize(self, status):
        pass


@pytest.mark.parametrize("value, batches", [(True, 1), (3, 3)])
def test_fast_dev_run(tmp_path, capsys, value, batches):
    module = Counting()
    logger = Logs()
    trainer = _trainer(fast_dev_run=value, logger=logger, enable_checkpointing=True, max_epochs=50)
    assert trainer.loggers == [] and not any(isinstance(c, ModelCheckpoint) for c in trainer.callbacks)
    assert "fast_dev_run" in capsys.readouterr().out
    trainer.fit(module, *_loaders())
    assert len(module.seen["train"]) == batches and len(module.seen["val"]) == batches
    assert module.seen["sanity"] == [] and trainer.global_step == batches and trainer.current_epoch == 1
    assert len(trainer.predict(module, DataLoader(_data(), batch_size=2))) == batches
    assert logger.metrics == []


def test_sanity_check_runs_first_and_keeps_nothing():
    module = Counting()
    logger = Logs()
    events = []

    class Watch:
        def on_sanity_check_start(self, trainer, module):
            events.append(("start", trainer.sanity_checking))

        def on_sanity_check_end(self, trainer, module):
            events.append(("end", trainer.callback_metrics.get("val_loss") is not None))

        def on_train_start(self, trainer, module):
            events.append(("train", "val_loss" in trainer.callback_metrics))

    assert _trainer().num_sanity_val_steps == 0  # Lightning's default is 2 (options.py says why not here)
    trainer = _trainer(max_epochs=1, logger=logger, callbacks=[Watch()], num_sanity_val_steps=2)
    trainer.fit(module, *_loaders())
    assert module.seen["sanity"] == [0, 1] and module.seen["val"] == [0, 1, 2, 3]
    assert events == [("start", True), ("end", True), ("train", False)]  # dropped before training
    assert sum("val_loss" in m for m in logger.metrics) == 1  # the end-of-epoch validation only

    for steps, expected in ((0, []), (-1, [0, 1, 2, 3])):
        module = Counting()
        _trainer(max_epochs=1, num_sanity_val_steps=steps).fit(module, *_loaders())
        assert module.seen["sanity"] == expected


def test_sanity_check_does_not_change_training():
    shardwise.seed_everything(0)
    a = Counting()
    b = Counting()
    b.load_state_dict(a.state_dict())
    shardwise.seed_everything(1)
    _trainer(max_epochs=2, num_sanity_val_steps=0).fit(a, *_loaders())
    shardwise.seed_everything(1)
    _trainer(max_epochs=2, num_sanity_val_steps=2).fit(b, *_loaders())
    assert a.seen["train"] == b.seen["train"]  # the same shuffled batches
    torch.testing.assert_close(a.net.weight, b.net.weight, rtol=0, atol=0)


def test_overfit_batches_repeats_the_first_batches_unshuffled():
    module = Counting()
    trainer = _trainer(max_epochs=3, overfit_batches=2, num_sanity_val_steps=0)
    trainer.fit(module, *_loaders())
    first = module.seen["train"][:2]
    assert module.seen["train"] == first * 3
    assert module.seen["train"][:2] == [_data()[0][0][0].item(), _data()[4][0][0].item()]
    assert module.seen["val"] == [0, 1] * 3
    with pytest.raises(ValueError, match="overfit_batches=2.*leave limit_train_batches out"):
        _trainer(overfit_batches=2, limit_train_batches=3)


def test_max_time_stops_training():
    assert parse_max_time("00:01:02:03") == datetime.timedelta(hours=1, minutes=2, seconds=3)
    assert parse_max_time({"minutes": 5}) == datetime.timedelta(minutes=5)
    with pytest.raises(ValueError, match="DD:HH:MM:SS"):
        _trainer(max_time="5 minutes")
    module = Counting(pause=0.05)
    trainer = _trainer(max_time=datetime.timedelta(seconds=0.3), num_sanity_val_steps=0)
    assert trainer.max_epochs == -1  # no default cap of 1000 epochs with a time limit
    started = time.monotonic()
    trainer.fit(module, _loaders()[0])
    assert time.monotonic() - started < 5
    assert 3 <= trainer.global_step <= 20


def test_min_epochs_and_min_steps_hold_off_a_stop():
    class StopAtOnce:
        def on_train_epoch_end(self, trainer, module):
            trainer.should_stop = True

    trainer = _trainer(max_epochs=10, min_epochs=3, callbacks=[StopAtOnce()], num_sanity_val_steps=0)
    trainer.fit(Counting(), _loaders()[0])
    assert trainer.current_epoch == 3

    class StopEveryBatch:
        def on_train_batch_end(self, trainer, module, outputs, batch, batch_idx):
            trainer.should_stop = True

    trainer = _trainer(max_epochs=10, min_steps=8, callbacks=[StopEveryBatch()], num_sanity_val_steps=0)
    trainer.fit(Counting(), _loaders()[0])
    assert trainer.global_step == 8
    with pytest.raises(ValueError, match="min_steps=5.*max_steps=3"):
        _trainer(max_steps=3, min_steps=5)


def test_detect_anomaly_names_the_backward_that_made_a_nan():
    class NaNGrad(Counting):
        def training_step(self, batch, batch_idx):
            x = self.net(batch[0]).sum()
            return torch.sqrt(x - x)  # 0 forward; inf * 0 = nan in backward

    with pytest.raises(RuntimeError, match="Backward0. returned nan values"):
        _trainer(max_steps=1, detect_anomaly=True, num_sanity_val_steps=0).fit(NaNGrad(), _loaders()[0])
    assert not torch.is_anomaly_enabled()


@pytest.mark.parametrize(
    "kwargs, expected",
    [
        (dict(max_epochs=2, accumulate_grad_batches=2), 4),  # 3 batches an epoch: 2 steps (a partial window)
        (dict(max_epochs=2, max_steps=3), 3),
        (dict(max_epochs=3, limit_train_batches=2), 6),
        (dict(max_epochs=-1, max_steps=-1), float("inf")),
    ],
)
def test_estimated_stepping_batches_in_configure_optimizers(kwargs, expected):
    seen = {}

    class OneCycle(Counting):
        def configure_optimizers(self):
            total = self.trainer.estimated_stepping_batches
            seen["total"] = total
            opt = torch.optim.SGD(self.parameters(), lr=0.01)
            if total == float("inf"):
                return opt
            sched = torch.optim.lr_scheduler.OneCycleLR(opt, max_lr=0.1, total_steps=total)
            return {"optimizer": opt, "lr_scheduler": {"scheduler": sched, "interval": "step"}}

    class StopAfterOne:  # an unbounded run: stop it after one step
        def on_train_batch_end(self, trainer, module, outputs, batch, batch_idx):
            trainer.should_stop = True

    stop = [StopAfterOne()] if expected == float("inf") else []
    trainer = _trainer(num_sanity_val_steps=0, callbacks=stop, **kwargs)
    trainer.fit(OneCycle(), DataLoader(_data(), batch_size=8))
    assert seen["total"] == expected
    if expected != float("inf"):
        assert trainer.global_step == expected  # OneCycleLR stepped exactly total_steps times without error


def test_torch_compile_before_fit():
    shardwise.seed_everything(0)
    plain = Counting()
    compiled_source = Counting()
    compiled_source.load_state_dict(plain.state_dict())
    loader = DataLoader(_data(), batch_size=8)
    _trainer(max_steps=3, num_sanity_val_steps=0).fit(plain, loader)
    trainer = _trainer(max_steps=3, num_sanity_val_steps=0)
    trainer.fit(torch.compile(compiled_source, backend="eager"), loader)
    assert trainer.module is compiled_source
    assert hasattr(compiled_source.training_step, "_torchdynamo_orig_callable")  # compiled, as Lightning does
    torch.testing.assert_close(compiled_source.net.weight, plain.net.weight)
    results = trainer.test(torch.compile(compiled_source, backend="eager"), loader, verbose=False)
    assert "test_loss" in results[0]


@pytest.mark.parametrize(
    "kwargs, match",
    [
        (dict(fast_dev_run=-1), "fast_dev_run=-1"),
        (dict(num_sanity_val_steps=-2), "num_sanity_val_steps=-2"),
        (dict(overfit_batches=1.5), "overfit_batches=1.5"),
        (dict(min_epochs=-1), "min_epochs=-1"),
        (dict(limit_test_batches=-3), "limit_test_batches=-3"),
    ],
)
def test_bad_values_are_named(kwargs, match):
    with pytest.raises(ValueError, match=match):
        _trainer(**kwargs)


def max_time_on_ranks():
    module = Counting(pause=0.02)
    trainer = Trainer(
        accelerator="cpu",
        devices=2,
        strategy="ddp",
        max_time={"seconds": 1},
        num_sanity_val_steps=0,
        logger=False,
        enable_progress_bar=False,
        enable_checkpointing=False,
    )
    if trainer.global_rank == 1:
        module.pause = 0.1  # a slower rank: its own clock would stop it at another step
    trainer.fit(module, DataLoader(_data(400), batch_size=2))
    return trainer.global_step


@pytest.mark.slow
def test_max_time_stops_every_rank_at_the_same_step():
    steps = shardwise.launch(max_time_on_ranks, devices=2)
    assert steps[0] == steps[1] and 1 <= steps[0] < 100

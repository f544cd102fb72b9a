"""What a Lightning script passes, accepted as Lightning means it: data hooks, datamodules, old spellings."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from test_checkpoint import Losses, Net, loaders  # noqa: E402

import shardwise
from shardwise import DataModule, Trainer


@pytest.fixture(autouse=True)
def _no_leftover_process_group():
    yield
    if dist.is_initialized():
        dist.destroy_process_group()


def _trainer(**kw):
    kw.setdefault("max_steps", 4)
    return Trainer(
        accelerator="cpu", devices=1, logger=False, enable_progress_bar=False, enable_checkpointing=False, **kw
    )


def _reference():
    shardwise.seed_everything(3)
    losses = Losses()
    train, val = loaders()
    _trainer(callbacks=[losses]).fit(Net(), train, val)
    return losses.by_step


class WithHooks(Net):
    def train_dataloader(self):
        return loaders()[0]

    def val_dataloader(self):
        return loaders()[1]


class Data(DataModule):
    def __init__(self):
        self.calls = []

    def prepare_data(self):
        self.calls.append("prepare_data")

    def setup(self, stage):
        self.calls.append(f"setup:{stage}")

    def train_dataloader(self):
        return loaders()[0]

    def val_dataloader(self):
        return loaders()[1]

    def teardown(self, stage):
        self.calls.append(f"teardown:{stage}")


def test_the_modules_own_loaders_and_a_datamodule_train_the_same():
    reference = _reference()
    for fit_args in ("hooks", "datamodule=", "positional"):
        shardwise.seed_everything(3)
        losses = Losses()
        trainer = _trainer(callbacks=[losses], val_check_interval=2)
        dm = Data()
        if fit_args == "hooks":
            trainer.fit(WithHooks())
        elif fit_args == "datamodule=":
            trainer.fit(Net(), datamodule=dm)
        else:
            trainer.fit(Net(), dm)  # Lightning accepts the datamodule as the second argument
        assert losses.by_step == reference, fit_args
        assert trainer.val_dataloaders is not None and "val_loss" in trainer.callback_metrics, fit_args
        if fit_args != "hooks":
            assert dm.calls == ["prepare_data", "setup:fit", "teardown:fit"]


def test_missing_or_double_data_is_named():
    with pytest.raises(TypeError, match=r"fit\(\) needs training data.*train_dataloader\(\) method on Net"):
        _trainer().fit(Net())
    with pytest.raises(ValueError, match="either dataloaders or a datamodule, not both"):
        _trainer().fit(Net(), loaders()[0], datamodule=Data())


def test_lightning_1x_spellings():
    from shardwise.strategies.deepspeed import DeepSpeedStrategy

    with pytest.warns(UserWarning, match=r"accelerator='ddp'\) is Lightning 1.x for strategy='ddp'"):
        t = Trainer(accelerator="ddp", devices=2, logger=False)
    assert t.strategy.name == "ddp" and t.accelerator == "cpu"
    t = Trainer(
        accelerator="cpu",
        devices=2,
        plugins=shardwise.DeepSpeedPlugin(stage=3, cpu_offload=False, partition_activations=True),
    )
    assert isinstance(t.strategy, DeepSpeedStrategy) and t.strategy.stage == 3
    t = Trainer(accelerator="cpu", devices=2, plugins="deepspeed_stage_2", precision="bf16-mixed")
    assert t.strategy.stage == 2
    with pytest.raises(ValueError, match="no CUDA device is visible"):
        Trainer(accelerator="gpu", devices=1)
    if not torch.cuda.is_available():
        with pytest.raises(ValueError, match="no CUDA device is visible"), pytest.warns(UserWarning, match="gpus="):
            Trainer(gpus=2)
    with pytest.raises(ValueError, match="pass only strategy="):
        Trainer(accelerator="cpu", strategy="fsdp", plugins="deepspeed_stage_2")
    with pytest.raises(TypeError, match="precision and cluster plugins are Trainer arguments"):
        Trainer(accelerator="cpu", plugins=[object()])

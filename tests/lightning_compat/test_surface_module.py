"""The LightningModule / LightningDataModule / Trainer surface Lightning scripts use, on one process.

hparams and save_hyperparameters as Lightning's (attribute access, names, a dict or Namespace,
ignore=, logger=False) and what load_from_checkpoint rebuilds from them; the attributes modules,
datamodules and callbacks read (self.logger, self.global_rank, self.all_gather, dm.trainer,
trainer.checkpoint_callback, ...); Lightning's call forms (one callback object, fit(model=...),
validate / test / predict with keywords, enable_model_summary, sync_batchnorm); a datamodule's own
state_dict saved in the checkpoint and handed back on resume.
"""

from __future__ import annotations

import argparse
import os

import pytest
import torch
from torch.utils.data import DataLoader, TensorDataset

import shardwise as L
from shardwise.callbacks import EarlyStopping, ModelCheckpoint, ModelSummary
from shardwise.loggers import CSVLogger
from shardwise.module_weights import constructor_arguments
from shardwise.trainer.options import apply_sync_batchnorm

X, Y = torch.randn(16, 3, generator=torch.Generator().manual_seed(0)), torch.randn(16, 1)
QUIET = dict(accelerator="cpu", devices=1, enable_progress_bar=False, throughput=False)


class Regressor(L.LightningModule):
    def __init__(self, hidden: int = 4, lr: float = 0.1, net: torch.nn.Module = None, **extra):
        super().__init__()
        self.save_hyperparameters(ignore=["net"])
        self.model = torch.nn.Sequential(torch.nn.Linear(3, hidden), torch.nn.Linear(hidden, 1))
        self.seen = {}

    def training_step(self, batch, batch_idx):
        x, y = batch
        self.seen.update(
            global_rank=self.global_rank, local_rank=self.local_rank, on_gpu=self.on_gpu,
            logger=self.logger, loggers=self.loggers, gathered=self.all_gather({"loss": torch.tensor(2.0), "n": 3}),
        )  # fmt: skip
        return torch.nn.functional.mse_loss(self.model(x), y)

    def validation_step(self, batch, batch_idx):
        self.log("val_loss", torch.nn.functional.mse_loss(self.model(batch[0]), batch[1]))

    def test_step(self, batch, batch_idx):
        self.log("test_loss", torch.nn.functional.mse_loss(self.model(batch[0]), batch[1]))

    def predict_step(self, batch, batch_idx):
        return self.model(batch[0])

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=self.hparams.lr)  # Lightning's attribute access


class Data(L.LightningDataModule):
    def __init__(self, batch_size: int = 8):
        super().__init__()
        self.save_hyperparameters()
        self.world_at_prepare = None
        self.loaded = None

    def prepare_data(self):
        self.world_at_prepare = self.trainer.world_size  # templates divide the global batch by it

    def train_dataloader(self):
        return DataLoader(TensorDataset(X, Y), batch_size=self.hparams.batch_size)

    def val_dataloader(self):
        return DataLoader(TensorDataset(X, Y), batch_size=self.hparams.batch_size)

    test_dataloader = predict_dataloader = val_dataloader

    def state_dict(self):
        return {"cursor": 5}

    def load_state_dict(self, state_dict):
        self.loaded = state_dict


def test_save_hyperparameters_takes_lightnings_forms():
    module = Regressor(8, lr=0.5, net=torch.nn.Linear(1, 1), extra=3)

    class KeepsNet(L.LightningModule):
        def __init__(self, net=None):
            super().__init__()
            self.save_hyperparameters()

    with pytest.warns(UserWarning, match=r"\['net'\] are nn.Module instances.*ignore=\['net'\]"):
        KeepsNet(net=torch.nn.Linear(1, 1))  # a checkpoint could only hold its repr
    assert isinstance(module.hparams, L.utilities.AttributeDict)
    assert dict(module.hparams) == {"hidden": 8, "lr": 0.5, "extra": 3}  # ignore= left net out, **extra flattened
    assert module.hparams.lr == module.hparams["lr"] == 0.5

    class Named(L.LightningModule):
        def __init__(self, a, b=2, c=3):
            super().__init__()
            self.save_hyperparameters("a", "c", logger=False)

    named = Named(1)
    assert dict(named.hparams) == {"a": 1, "c": 3}  # logger=False is no hyperparameter

    class Config(L.LightningModule):
        def __init__(self, config):
            super().__init__()
            self.save_hyperparameters(config)

    assert dict(Config({"depth": 2}).hparams) == {"depth": 2}
    assert Config(argparse.Namespace(depth=3)).hparams.depth == 3
    # load_from_checkpoint hands a saved dict back as the one argument it came from, as Lightning does.
    assert constructor_arguments(Config, {"depth": 2}, {}) == {"config": {"depth": 2}}
    assert constructor_arguments(Named, {"a": 1, "c": 4, "gone": 0}, {"b": 5}) == {"a": 1, "b": 5, "c": 4}

    class Wrong(L.LightningModule):
        def __init__(self, a=1):
            super().__init__()
            self.save_hyperparameters("b")

    with pytest.raises(ValueError, match=r"\['b'\] are not arguments of Wrong.__init__"):
        Wrong()
    assert dict(Data(16).hparams) == {"batch_size": 16}


def test_a_fit_with_lightnings_call_forms_attributes_and_checkpoint(tmp_path, capsys):
    L.seed_everything(7, workers=True)
    module, data = Regressor(hidden=6, lr=0.05), Data(batch_size=8)
    stop = EarlyStopping(monitor="val_loss", patience=5)
    trainer = L.Trainer(
        **QUIET, max_steps=2, callbacks=stop, enable_model_summary=True, sync_batchnorm=True,
        logger=CSVLogger(str(tmp_path)), default_root_dir=str(tmp_path),
    )  # fmt: skip
    trainer.fit(model=module, datamodule=data)
    printed = capsys.readouterr().out
    assert "0 | model | Sequential | 31     | train" in printed and "31       Total params" in printed
    assert trainer.early_stopping_callback is stop and trainer.early_stopping_callbacks == [stop]
    assert isinstance(trainer.checkpoint_callback, ModelCheckpoint) and trainer.num_devices == 1
    assert any(isinstance(c, ModelSummary) for c in trainer.callbacks)
    assert data.trainer is trainer and data.world_at_prepare == 1
    seen = module.seen
    assert (seen["global_rank"], seen["local_rank"], seen["on_gpu"]) == (0, 0, False)
    assert seen["logger"] is trainer.logger and seen["loggers"] == trainer.loggers
    assert float(seen["gathered"]["loss"]) == 2.0 and seen["gathered"]["n"] == 3  # one process: unchanged

    assert len(trainer.validate(model=module, datamodule=data, verbose=False)) == 1
    assert trainer.test(model=module, datamodule=data, verbose=False)[0].keys() == {"test_loss"}
    assert len(trainer.predict(model=module, dataloaders=DataLoader(TensorDataset(X), batch_size=8))) == 2

    path = trainer.save_checkpoint(str(tmp_path / "step2"))
    restored = Regressor.load_from_checkpoint(path)
    assert dict(restored.hparams) == {"hidden": 6, "lr": 0.05}  # the non-default arguments survive
    assert restored.model[0].out_features == 6
    for mine, theirs in zip(restored.parameters(), module.parameters()):
        assert torch.equal(mine, theirs)

    resumed_data = Data(batch_size=8)
    L.Trainer(**QUIET, max_steps=3, logger=False, enable_checkpointing=False).fit(
        Regressor(hidden=6, lr=0.05), datamodule=resumed_data, ckpt_path=path
    )
    assert resumed_data.loaded == {"cursor": 5}  # the datamodule's own state, saved and handed back


def test_hyperparameters_saved_with_logger_false_reach_no_logger(tmp_path):
    class Quiet(Regressor):
        def __init__(self, hidden=4, lr=0.1):
            super().__init__(hidden, lr)
            self.save_hyperparameters(logger=False)

    logger = CSVLogger(str(tmp_path))
    trainer = L.Trainer(**QUIET, max_steps=1, logger=logger, enable_checkpointing=False, enable_model_summary=False)
    trainer.fit(Quiet(hidden=5), DataLoader(TensorDataset(X, Y), batch_size=8))
    written = open(os.path.join(logger.log_dir, "hparams.yaml")).read()
    assert "hidden" not in written and "lr" not in written
    assert not any(isinstance(c, ModelSummary) for c in trainer.callbacks)


def test_the_loggers_get_the_module_and_datamodule_hyperparameters_merged(tmp_path):
    logger = CSVLogger(str(tmp_path))
    trainer = L.Trainer(**QUIET, max_steps=1, logger=logger, enable_checkpointing=False)
    trainer.fit(Regressor(hidden=5), datamodule=Data(batch_size=4))
    written = open(os.path.join(logger.log_dir, "hparams.yaml")).read()
    assert "hidden: 5" in written and "batch_size: 4" in written

    class Clashing(Data):
        def __init__(self, hidden=7):
            super().__init__()
            self.save_hyperparameters()

    with pytest.raises(ValueError, match=r"both record the hyperparameters \['hidden'\] with different values"):
        L.Trainer(**QUIET, max_steps=1, logger=CSVLogger(str(tmp_path)), enable_checkpointing=False).fit(
            Regressor(hidden=5), datamodule=Clashing()
        )
    # Without a logger nothing shows them, so nothing clashes (Lightning's rule too).
    L.Trainer(**QUIET, max_steps=1, logger=False, enable_checkpointing=False).fit(Regressor(), datamodule=Clashing())


def test_from_datasets_freeze_and_unfreeze():
    data = L.LightningDataModule.from_datasets(TensorDataset(X, Y), val_dataset=[TensorDataset(X, Y)], batch_size=4)
    train = data.train_dataloader()
    assert len(train) == 4 and isinstance(train.sampler, torch.utils.data.RandomSampler)  # shuffled, as Lightning's
    assert [len(loader) for loader in data.val_dataloader()] == [4]
    assert dict(Data.from_datasets(TensorDataset(X, Y), batch_size=2).hparams) == {"batch_size": 2}  # reaches __init__
    module = Regressor()
    module.freeze()
    assert not module.training and not any(p.requires_grad for p in module.parameters())
    module.unfreeze()
    assert module.training and all(p.requires_grad for p in module.parameters())


def test_sync_batchnorm_converts_where_processes_share_a_batch():
    def net():
        return torch.nn.Sequential(torch.nn.Linear(3, 4), torch.nn.BatchNorm1d(4), torch.nn.ReLU())

    one = net()
    assert apply_sync_batchnorm(one, world_size=1, device=torch.device("cpu")) == 0
    assert isinstance(one[1], torch.nn.BatchNorm1d)  # one process: nothing to synchronise, as in Lightning
    two = net()
    assert apply_sync_batchnorm(two, world_size=2, device=torch.device("cuda", 0)) == 1
    assert isinstance(two[1], torch.nn.SyncBatchNorm) and two[1].weight is not None
    with pytest.raises(ValueError, match="sync_batchnorm=True\\) on CPU: torch's SyncBatchNorm runs on CUDA only"):
        apply_sync_batchnorm(net(), world_size=2, device=torch.device("cpu"))


def test_a_saved_lightning_config_s_trainer_arguments_are_accepted_at_their_defaults(tmp_path):
    # What Lightning's CLI writes for every Trainer argument a config does not set.
    defaults = dict(benchmark=None, inference_mode=True, use_distributed_sampler=True, profiler=None,
                    barebones=False, reload_dataloaders_every_n_epochs=0, enable_autolog_hparams=True,
                    model_registry=None, enable_model_summary=True, sync_batchnorm=False)  # fmt: skip
    L.Trainer(**QUIET, **defaults)
    for name, value, instead in (("profiler", "simple", "profile_steps"), ("barebones", True, "logger=False"),
                                 ("use_distributed_sampler", False, "set yours on the DataLoader"),
                                 ("reload_dataloaders_every_n_epochs", 1, "built once per fit")):  # fmt: skip
        with pytest.raises(ValueError, match=f"Trainer\\({name}={value!r}\\) is not supported: .*{instead}"):
            L.Trainer(**QUIET, **{name: value})
    with pytest.raises(ValueError, match="benchmark=True, deterministic=True"):
        L.Trainer(**QUIET, benchmark=True, deterministic=True)
    logger = CSVLogger(str(tmp_path))
    L.Trainer(**QUIET, max_steps=1, logger=logger, enable_checkpointing=False, enable_autolog_hparams=False).fit(
        Regressor(hidden=5), DataLoader(TensorDataset(X, Y), batch_size=8)
    )
    hparams = os.path.join(logger.log_dir, "hparams.yaml")
    assert not os.path.exists(hparams) or "hidden" not in open(hparams).read()


def test_callbacks_given_as_a_class_or_name_are_refused_with_the_fix():
    with pytest.raises(TypeError, match="pass a callback object or a list of them"):
        L.Trainer(**QUIET, callbacks=EarlyStopping)

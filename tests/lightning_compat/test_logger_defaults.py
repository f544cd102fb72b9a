"""Loggers as Lightning's: TensorBoard is the default when installed, CSVLogger has an `experiment`, and
`experiment` on ranks other than 0 is an object whose every call does nothing (code written for rank 0,
such as the GAN example's `self.logger.experiment.add_image(...)`, runs on every rank), and the loggers take
Lightning's arguments (prefix, flush_logs_every_n_steps, sub_dir, default_hp_metric; log_graph refused)."""

from __future__ import annotations

import csv
import os

import pytest
import torch
import yaml
from torch.utils.data import DataLoader, TensorDataset

import shardwise
from shardwise.loggers import CSVLogger, TensorBoardLogger


class _Images(shardwise.TrainModule):
    def __init__(self):
        super().__init__()
        self.net = torch.nn.Linear(4, 1)

    def training_step(self, batch, batch_idx):
        loss = self.net(batch[0]).pow(2).mean()
        self.log("loss", loss)
        return loss

    def on_train_epoch_end(self):
        self.logger.experiment.add_image("generated", torch.rand(3, 4, 4), self.current_epoch)

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1)


def test_the_default_logger_is_tensorboard_when_installed(tmp_path):
    trainer = shardwise.Trainer(
        max_epochs=1, default_root_dir=str(tmp_path), enable_checkpointing=False, enable_progress_bar=False
    )
    trainer.fit(_Images(), DataLoader(TensorDataset(torch.randn(8, 4)), batch_size=4))
    assert isinstance(trainer.logger, TensorBoardLogger)
    log_dir = tmp_path / "shardwise_logs" / "version_0"
    assert trainer.logger.log_dir == str(log_dir)
    assert any(name.startswith("events.out.tfevents") for name in os.listdir(log_dir))


def test_csv_logger_experiment_writes_as_lightnings_experiment_writer(tmp_path):
    logger = CSVLogger(str(tmp_path), name="exp")
    writer = logger.experiment
    writer.log_hparams({"lr": 0.1})
    writer.log_metrics({"loss": 1.5}, step=3)
    assert writer.metrics == [{"loss": 1.5, "step": 3}]  # not yet written
    writer.save()
    assert writer.metrics == [] and writer.metrics_file_path == os.path.join(logger.log_dir, "metrics.csv")
    with open(writer.metrics_file_path, newline="") as fh:
        assert list(csv.DictReader(fh)) == [{"step": "3", "loss": "1.5"}]
    assert yaml.safe_load(open(os.path.join(writer.log_dir, "hparams.yaml"))) == {"lr": 0.1} == writer.hparams


def test_experiment_on_other_ranks_does_nothing(tmp_path, monkeypatch):
    # rank 1 of 2 as torchrun describes it (the process group is not needed to answer "am I rank 0?")
    for name, value in dict(RANK=1, WORLD_SIZE=2, LOCAL_RANK=1, LOCAL_WORLD_SIZE=2, MASTER_PORT=29999).items():
        monkeypatch.setenv(name, str(value))
    monkeypatch.setenv("MASTER_ADDR", "127.0.0.1")
    for logger in (TensorBoardLogger(str(tmp_path)), CSVLogger(str(tmp_path))):
        experiment = logger.experiment
        assert experiment is not None
        assert experiment.add_image("x", torch.rand(3, 2, 2), 0) is None
        assert experiment.log_metrics({"a": 1.0}, step=0) is None
        assert experiment["anything"].add_scalar("a", 1.0) is None
    assert not os.listdir(tmp_path)  # nothing written on a rank other than 0


def test_lightnings_logger_arguments(tmp_path):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    csv_logger = CSVLogger(str(tmp_path), name="csv", prefix="train", flush_logs_every_n_steps=1)
    csv_logger.log_metrics({"loss": 0.5}, step=1)  # written at once: flush_logs_every_n_steps=1
    with open(csv_logger.metrics_file, newline="") as fh:
        assert list(csv.DictReader(fh)) == [{"step": "1", "train-loss": "0.5"}]

    tb = TensorBoardLogger(str(tmp_path), name="tb", prefix="train", sub_dir="sub", default_hp_metric=False)
    assert tb.log_dir == str(tmp_path / "tb" / "version_0" / "sub")
    tb.log_metrics({"loss": 0.5}, step=1)
    tb.finalize("success")
    events = EventAccumulator(tb.log_dir)
    events.Reload()
    assert events.Tags()["scalars"] == ["train-loss"]
    with pytest.raises(ValueError, match="add_graph"):
        TensorBoardLogger(str(tmp_path), log_graph=True)

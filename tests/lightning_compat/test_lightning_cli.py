"""`from shardwise.cli import LightningCLI` runs Lightning's basics/autoencoder.py shape (a module, a datamodule,
the CLI) through every subcommand from a config file, in-process and tiny: the config, the command-line
overrides (`--model.x`, `--data.x`, `--trainer.x`), `--optimizer` / `--lr_scheduler` in both spellings,
subclass mode, `--print_config`, the saved config.yaml, and `run=False` as the example calls it."""

from __future__ import annotations

import os

import pytest
import torch
import yaml
from lightning_compat.cli_autoencoder import ImageSampler, LitAutoEncoder, MyDataModule

from shardwise.cli import LightningCLI

QUIET = {"enable_progress_bar": False}


@pytest.fixture
def config(tmp_path):
    path = tmp_path / "config_in.yaml"
    spec = {
        "trainer": {"max_epochs": 1, "default_root_dir": str(tmp_path), **QUIET},
        "model": {"hidden_dim": 8},
        "data": {"batch_size": 4},
    }
    path.write_text(yaml.safe_dump(spec))
    return str(path)


def test_each_subcommand_from_a_config_file(config, tmp_path):
    cli = LightningCLI(
        LitAutoEncoder,
        MyDataModule,
        args=["fit", "--config", config, "--model.learning_rate", "0.02", "--optimizer", "Adam"]
        + ["--optimizer.lr", "0.01", "--lr_scheduler", "StepLR", "--lr_scheduler.step_size", "1"],
    )
    assert cli.subcommand == "fit" and cli.trainer.global_step == 3  # 12 samples in batches of 4
    assert cli.model.hparams.hidden_dim == 8 and cli.model.hparams.learning_rate == 0.02
    assert cli.datamodule.batch_size == 4 and cli.trainer.max_epochs == 1
    optimizer = cli.trainer.optimizers[0]
    assert type(optimizer) is torch.optim.Adam  # the CLI's optimizer replaced the module's; torch's Adam
    assert optimizer.param_groups[0]["lr"] == pytest.approx(0.001)  # 0.01, stepped once by StepLR(gamma=0.1)
    saved = yaml.safe_load(open(os.path.join(cli.trainer.log_dir, "config.yaml")))
    assert saved["optimizer"]["class_path"] == "torch.optim.Adam" and saved["model"]["hidden_dim"] == 8
    assert saved["seed_everything"] == cli.config.fit.seed_everything and isinstance(saved["seed_everything"], int)
    checkpoint = str(tmp_path / "checkpoints" / "last.ckpt")
    assert os.path.exists(checkpoint)

    # the other subcommands, each with the Trainer method's own arguments; test from the config fit saved
    saved_config = os.path.join(cli.trainer.log_dir, "config.yaml")
    test = LightningCLI(
        LitAutoEncoder,
        MyDataModule,
        args=["test", "--config", saved_config, "--model.hidden_dim", "16", "--ckpt_path", checkpoint],
    )
    assert test.model.hparams.hidden_dim == 8  # the checkpoint's hyper-parameters win, as in Lightning
    assert isinstance(test.model.configure_optimizers()[1][0], torch.optim.lr_scheduler.StepLR)
    assert sorted(test.trainer.callback_metrics) == ["test_loss", "test_loss_epoch"]
    validate = LightningCLI(LitAutoEncoder, MyDataModule, args=["validate", "--config", config, "--verbose", "false"])
    assert sorted(validate.trainer.callback_metrics) == ["val_loss", "val_loss_epoch"]

    class Predict(LightningCLI):  # Lightning runs a method of the CLI named as the subcommand when there is one
        def predict(self, **kwargs):
            self.predictions = self.trainer.predict(**kwargs)

    predict = Predict(
        LitAutoEncoder, MyDataModule, args=["predict", "--config", config, "--return_predictions", "true"]
    )
    assert [tuple(p.shape) for p in predict.predictions] == [(4, 64), (4, 64)]  # 8 test images in batches of 4


class Adam(torch.optim.Adam):
    """Another optimizer named Adam (as bitsandbytes has): `--optimizer Adam` still means torch's."""


def test_subclass_mode_and_the_class_path_spelling(tmp_path):
    cli = LightningCLI(
        args=["fit", "--trainer.default_root_dir", str(tmp_path), "--trainer.enable_progress_bar", "false"]
        + ["--model", "lightning_compat.cli_autoencoder.LitAutoEncoder"]
        + [
            "--model.hidden_dim",
            "6",
            "--data",
            "lightning_compat.cli_autoencoder.MyDataModule",
            "--data.batch_size",
            "6",
        ]
        + ["--optimizer", '{"class_path": "torch.optim.SGD", "init_args": {"lr": 0.5}}', "--trainer.max_steps", "1"]
        + ["--trainer.logger", "false", "--seed_everything", "7"]
        + ["--lr_scheduler", "ReduceLROnPlateau", "--lr_scheduler.monitor", "train_loss"],
    )
    configured = cli.model.configure_optimizers()  # Lightning's plateau form: the scheduler names its monitor
    assert configured["lr_scheduler"]["monitor"] == "train_loss" and configured["lr_scheduler"]["scheduler"].monitor
    assert isinstance(cli.model, LitAutoEncoder) and cli.model.hparams.hidden_dim == 6
    assert isinstance(cli.datamodule, MyDataModule) and cli.datamodule.batch_size == 6
    assert (
        isinstance(cli.trainer.optimizers[0], torch.optim.SGD)
        and cli.trainer.optimizers[0].param_groups[0]["lr"] == 0.5
    )
    assert cli.trainer.global_step == 1 and cli.config.fit.seed_everything == 7


def test_print_config_prints_the_merged_config_and_exits(config, capsys):
    with pytest.raises(SystemExit) as exit:
        LightningCLI(
            LitAutoEncoder, MyDataModule, args=["fit", "--config", config, "--model.hidden_dim", "5", "--print_config"]
        )
    assert exit.value.code == 0
    printed = yaml.safe_load(capsys.readouterr().out)
    assert printed["model"]["hidden_dim"] == 5 and printed["data"]["batch_size"] == 4
    assert printed["trainer"]["max_epochs"] == 1


def test_run_false_as_the_autoencoder_example_calls_it(tmp_path):
    sampler = ImageSampler()
    cli = LightningCLI(
        LitAutoEncoder,
        MyDataModule,
        seed_everything_default=1234,
        run=False,
        trainer_defaults={"callbacks": sampler, "max_epochs": 2, "default_root_dir": str(tmp_path), **QUIET},
        save_config_kwargs={"overwrite": True},
        args=["--model.hidden_dim", "4", "--data.batch_size", "4"],
    )
    assert cli.subcommand is None and cli.config.seed_everything == 1234
    cli.trainer.fit(cli.model, datamodule=cli.datamodule)
    assert sampler.epochs == 2 and cli.trainer.global_step == 6
    (tested,) = cli.trainer.test(ckpt_path="best", datamodule=cli.datamodule, verbose=False)
    assert set(tested) == {"test_loss_epoch"}
    predictions = cli.trainer.predict(ckpt_path="best", datamodule=cli.datamodule)
    assert [tuple(p.shape) for p in predictions] == [(4, 64), (4, 64)]
    assert os.path.exists(os.path.join(cli.trainer.log_dir, "config.yaml"))

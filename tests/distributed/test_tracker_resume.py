"""W&B (offline) and MLflow (file store) runs of a two-process DDP job, killed with SIGKILL and resumed.

The job logs every step to both trackers, saves a checkpoint every 3 steps and
is killed at the start of step 6, after steps 4 and 5 reached the trackers but
after the checkpoint of step 3. The resumed job continues the checkpoint's
tracker runs. Read back with each library's own reader (MlflowClient; wandb's
`wandb leet inspect`), each job holds one run, the hyper-parameters and the
resolved plan, and every step's training loss exactly once. This file is also
the job script: the test runs it as a subprocess (and the self-launcher runs it
again in each worker).
"""

from __future__ import annotations

import argparse
import glob
import os
import signal
import subprocess
import sys
import time

MAX_STEPS, SAVE_EVERY, KILL_AT = 8, 3, 5  # killed after step 5 is logged, resumed from step 3


def _job(root: str, resume: bool) -> None:
    import torch
    import torch.nn.functional as F
    import wandb
    from torch import nn
    from torch.utils.data import DataLoader, TensorDataset

    import shardwise
    from shardwise import Trainer, TrainModule
    from shardwise.callbacks import ModelCheckpoint
    from shardwise.distributed.context import current as launch_context
    from shardwise.loggers import MLflowLogger, WandbLogger

    class Net(TrainModule):
        def __init__(self, width: int = 8, lr: float = 0.01) -> None:
            super().__init__()
            self.save_hyperparameters()

        def configure_model(self) -> None:
            self.net = nn.Sequential(
                nn.Linear(4, self.hparams["width"]), nn.Tanh(), nn.Linear(self.hparams["width"], 2)
            )

        def training_step(self, batch, batch_idx):
            x, y = batch
            loss = F.cross_entropy(self.net(x), y)
            self.log("train_loss", loss)
            return loss

        def validation_step(self, batch, batch_idx):
            x, y = batch
            self.log("val_loss", F.cross_entropy(self.net(x), y))

        def configure_optimizers(self):
            return torch.optim.SGD(self.parameters(), lr=self.hparams["lr"])

    class Killer:
        def on_train_batch_start(self, trainer, *args) -> None:
            if trainer.global_step == KILL_AT and trainer.is_global_zero:
                time.sleep(0.3)  # wandb-core writes the .wandb file every 0.05 s here (below)
                parent = os.getppid() if launch_context().launched_by_shardwise else None
                if parent is not None:  # the supervisor: its death takes the other worker with it
                    os.kill(parent, signal.SIGKILL)
                os.kill(os.getpid(), signal.SIGKILL)

    shardwise.seed_everything(0)
    g = torch.Generator().manual_seed(0)
    data = TensorDataset(torch.randn(48, 4, generator=g), torch.randint(0, 2, (48,), generator=g))
    loggers = [
        WandbLogger(
            project="shardwise-test",
            save_dir=root,
            mode="offline",
            settings=wandb.Settings(x_transaction_log_flush_interval=0.05, silent=True),
        ),
        MLflowLogger(tracking_uri=f"file:{root}/mlruns", experiment_name="tracker-resume"),
    ]
    trainer = Trainer(
        accelerator="cpu",
        devices=2,
        strategy="ddp",
        max_steps=MAX_STEPS,
        log_every_n_steps=1,
        val_check_interval=2,
        logger=loggers,
        enable_progress_bar=False,
        default_root_dir=root,
        callbacks=[ModelCheckpoint(every_n_train_steps=SAVE_EVERY)] + ([] if resume else [Killer()]),
    )
    loader = DataLoader(data, batch_size=4)
    trainer.fit(Net(), loader, DataLoader(data, batch_size=8), ckpt_path="last" if resume else None)


if __name__ == "__main__":  # the job (pytest must not be imported: the self-launcher refuses to run under it)
    parser = argparse.ArgumentParser()
    parser.add_argument("--root", required=True)
    parser.add_argument("--resume", action="store_true")
    args = parser.parse_args()
    _job(args.root, args.resume)
    sys.exit(0)

# ----------------------------------------------------------------------------- the test
import json  # noqa: E402

import pytest  # noqa: E402


def _env(root: str):
    return {
        **os.environ,
        "OMP_NUM_THREADS": "1",
        "PYTHONWARNINGS": "ignore",
        "WANDB_MODE": "offline",
        "WANDB_SILENT": "true",
        "WANDB_DIR": root,
        "WANDB_CONFIG_DIR": os.path.join(root, "wandb-config"),
        "WANDB_CACHE_DIR": os.path.join(root, "wandb-cache"),
        "MLFLOW_ALLOW_FILE_STORE": "true",
    }


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    root = str(tmp_path_factory.mktemp("tracker_resume"))
    cmd = [sys.executable, os.path.abspath(__file__), "--root", root]
    killed = subprocess.run(cmd, env=_env(root), capture_output=True, text=True, timeout=300)
    assert killed.returncode == -signal.SIGKILL, killed.stdout[-3000:] + killed.stderr[-3000:]
    resumed = subprocess.run(cmd + ["--resume"], env=_env(root), capture_output=True, text=True, timeout=300)
    assert resumed.returncode == 0, resumed.stdout[-3000:] + resumed.stderr[-3000:]
    return root


def test_mlflow_one_run_params_and_each_step_once(runs, monkeypatch):
    monkeypatch.setenv("MLFLOW_ALLOW_FILE_STORE", "true")
    from mlflow import MlflowClient

    client = MlflowClient(tracking_uri=f"file:{runs}/mlruns")
    experiment = client.get_experiment_by_name("tracker-resume")
    found = client.search_runs([experiment.experiment_id])
    assert len(found) == 1  # two jobs of two processes each: one run
    run = found[0]
    assert run.info.status == "FINISHED"
    params = run.data.params
    assert params["width"] == "8" and params["lr"] == "0.01"
    assert params["shardwise/strategy"] == "DDP" and params["shardwise/world_size"] == "2"
    assert params["shardwise/plan/engine"] == "ddp"
    steps = [m.step for m in client.get_metric_history(run.info.run_id, "train_loss")]
    assert sorted(steps) == list(range(1, MAX_STEPS + 1)), steps
    val_steps = [m.step for m in client.get_metric_history(run.info.run_id, "val_loss")]
    assert sorted(val_steps) == [2, 4, 6, 8], val_steps


def test_wandb_offline_one_run_config_and_each_step_once(runs):
    from shardwise.loggers.wandb import read_history

    files = sorted(glob.glob(os.path.join(runs, "wandb", "offline-run-*", "run-*.wandb")))
    assert len(files) == 2, files  # the killed attempt and the resumed one
    assert len({os.path.basename(f) for f in files}) == 1  # of the same run id: one run
    killed, resumed = (list(read_history(path)) for path in files)
    rows = killed + resumed
    steps = [int(row["_step"]) for row in rows if "train_loss" in row]
    assert sorted(steps) == list(range(1, MAX_STEPS + 1)), steps
    first = [int(row["_step"]) for row in killed if "train_loss" in row]
    assert max(first) > SAVE_EVERY  # the killed job got points past its checkpoint into the file
    assert sorted(int(row["_step"]) for row in rows if "val_loss" in row) == [2, 4, 6, 8]
    summary = subprocess.run(
        [sys.executable, "-m", "wandb", "leet", "inspect", "--summary", "--json", files[-1]],
        capture_output=True,
        text=True,
        timeout=120,
        check=True,
    )
    config = json.loads(summary.stdout)["config"]
    assert config["width"] == 8 and config["lr"] == 0.01
    assert config["shardwise/strategy"] == "DDP" and config["shardwise/plan/engine"] == "ddp"

"""The tracker loggers without a Trainer around them, and the CSV logger's resume inside a step.

MLflow runs against a local file store and is read back with MlflowClient:
a resumed logger continues the saved run and skips the points the run holds
from the checkpoint's step on (an interrupted job logged them), logs each
hyper-parameter once and reports one whose value changed. A missing package
names the extra to install. The CSV logger keeps the row of the checkpoint's
own step, which the interrupted run logged after the save (the distributed
kill-and-resume of both trackers is tests/distributed/test_tracker_resume.py).
"""

from __future__ import annotations

import csv
import sys

import pytest

from shardwise.loggers import CSVLogger, MLflowLogger, WandbLogger


@pytest.mark.parametrize(
    "make,modules,extra",
    [
        (lambda: WandbLogger(mode="offline"), ["wandb"], "shardwise[wandb]"),
        (lambda: MLflowLogger(), ["mlflow", "mlflow.entities"], "shardwise[mlflow]"),
    ],
)
def test_a_missing_package_names_the_extra_at_construction(monkeypatch, make, modules, extra):
    for name in modules:
        monkeypatch.setitem(sys.modules, name, None)  # import raises ImportError
    with pytest.raises(ImportError, match=extra.replace("[", r"\[").replace("]", r"\]")):
        make()


@pytest.fixture
def store(tmp_path, monkeypatch):
    monkeypatch.setenv("MLFLOW_ALLOW_FILE_STORE", "true")  # MLflow 3 wants it for a file store
    return f"file:{tmp_path}/mlruns"


def test_mlflow_resume_skips_what_the_run_holds_and_logs_params_once(store):
    from mlflow import MlflowClient

    first = MLflowLogger(tracking_uri=store, experiment_name="unit")
    first.log_hyperparams({"lr": 0.1, "model": {"width": 8}})
    first.log_run_config({"strategy": "DDP", "world_size": 2})
    for step in range(1, 6):
        first.log_metrics({"loss": 1.0 / step, "epoch": 0.0, "note": "text is not charted"}, step=step)
    first.log_metrics({"val_loss": 0.5}, step=4)
    saved = {**first.state_dict(), "checkpoint_step": 3}  # as a checkpoint of step 3 restores it
    # ... the job dies here without finalize; the resumed job replays steps 4 and 5 ...
    resumed = MLflowLogger(tracking_uri=store, experiment_name="unit")
    resumed.load_state_dict(saved)
    with pytest.warns(UserWarning, match="'lr' is 0.2 now but the run holds '0.1'"):
        resumed.log_hyperparams({"lr": 0.2, "model": {"width": 8}, "seed": 1})
    for step in range(4, 8):
        resumed.log_metrics({"loss": 1.0 / step, "epoch": 0.0}, step=step)
        if step % 2 == 0:
            resumed.log_metrics({"val_loss": 0.5}, step=step)
    resumed.finalize("success")

    assert resumed.run_id == first.run_id
    client = MlflowClient(tracking_uri=store)
    runs = client.search_runs([client.get_experiment_by_name("unit").experiment_id])
    assert len(runs) == 1 and runs[0].info.status == "FINISHED"
    assert runs[0].data.params == {
        "lr": "0.1",
        "model/width": "8",
        "seed": "1",
        "shardwise/strategy": "DDP",
        "shardwise/world_size": "2",
    }
    history = {key: [m.step for m in client.get_metric_history(first.run_id, key)] for key in runs[0].data.metrics}
    assert history == {"loss": [1, 2, 3, 4, 5, 6, 7], "epoch": [1, 2, 3, 4, 5, 6, 7], "val_loss": [4, 6]}


def test_a_run_id_other_than_the_checkpoints_is_refused(store):
    logger = MLflowLogger(tracking_uri=store, run_id="abc")
    with pytest.raises(ValueError, match="continues tracker run 'xyz'.*given run 'abc'"):
        logger.load_state_dict({"run_id": "xyz", "last_step": 3})


def test_wandb_refuses_the_init_arguments_it_sets_itself():
    with pytest.raises(ValueError, match="'resume'"):
        WandbLogger(mode="offline", resume="must")


def test_csv_keeps_the_row_of_the_checkpoint_step_after_a_resume(tmp_path):
    from test_checkpoint import fit  # noqa: E402  (same directory: the one-process fixtures)

    from shardwise.callbacks import ModelCheckpoint

    class Stop(Exception):
        pass

    class StopAtStep5:  # after step 5 is logged, before step 6: the checkpoint is step 3's
        def on_train_batch_start(self, trainer, *args):
            if trainer.global_step == 5:
                raise Stop

    def run(max_steps, callbacks=(), ckpt_path=None):
        logger = CSVLogger(str(tmp_path), flush_every_n_steps=1)
        kw = dict(checkpoint=ModelCheckpoint(every_n_train_steps=3), logger=logger, log_every_n_steps=1)
        fit(tmp_path, max_steps, ckpt_path=ckpt_path, callbacks_extra=callbacks, **kw)
        return logger

    with pytest.raises(Stop):
        run(7, callbacks=[StopAtStep5()])
    logger = run(7, ckpt_path="last")
    with open(logger.metrics_file) as fh:
        steps = [int(r["step"]) for r in csv.DictReader(fh) if r.get("epoch")]
    assert steps == list(range(1, 8))  # step 3's row was logged after its save; before the fix it was lost

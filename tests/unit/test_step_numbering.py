"""One numbering in every message (issue 26 item 4), as trainer.global_step and the loggers count.

"step N" is the optimizer step after which trainer.global_step reads N, the
step the loggers record its values at; "batch_idx i" is the index the batch
hooks receive. The error once said "optimizer step 5 ... the loss of batch 4"
for one event while trainer.global_step read 4. Here a NaN is planted in a
known micro-batch of a run with two micro-batches per step, so the step, the
batch index and trainer.global_step all differ, and every number the message
names is checked against what the hooks, the Trainer and a CSV logger show.
"""

from __future__ import annotations

import csv
import math
import re
import warnings

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from shardwise import TrainModule
from shardwise.health import NonFiniteError
from shardwise.loggers import CSVLogger

from helpers.trainers import quiet_trainer

PLANTED = 7  # batch_idx of the NaN: with 2 micro-batches per step, batches 6 and 7 make step 4


class Planted(TrainModule):
    def __init__(self, no_grad: bool = False) -> None:
        super().__init__()
        self.no_grad = no_grad
        self.during = {}  # batch_idx -> trainer.global_step inside training_step
        self.after = {}  # batch_idx -> trainer.global_step in on_train_batch_end

    def configure_model(self) -> None:
        self.net = nn.Linear(4, 1)

    def training_step(self, batch, batch_idx):
        x, y = batch
        loss = F.mse_loss(self.net(x), y)
        self.during[batch_idx] = self.trainer.global_step
        if batch_idx == PLANTED:
            loss = loss.detach() if self.no_grad else loss * float("nan")
        self.log("loss", loss.detach())
        return loss

    def on_train_batch_end(self, outputs, batch, batch_idx):
        self.after[batch_idx] = self.trainer.global_step

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.01)


def _run(tmp_path, module, non_finite):
    g = torch.Generator().manual_seed(0)
    data = TensorDataset(torch.randn(16, 4, generator=g), torch.randn(16, 1, generator=g))
    logger = CSVLogger(str(tmp_path), name="run", flush_every_n_steps=1)
    trainer = quiet_trainer(
        max_steps=6, accumulate_grad_batches=2, log_every_n_steps=1, logger=logger, non_finite=non_finite
    )
    try:
        trainer.fit(module, DataLoader(data, batch_size=1))
    finally:
        with open(logger.metrics_file) as fh:
            rows = list(csv.DictReader(fh))
    return trainer, rows


def _numbers(message):
    step = int(re.search(r"optimizer step (\d+)", message).group(1))
    batch_idx = int(re.search(r"batch_idx (\d+)", message).group(1))
    return step, batch_idx


def test_a_taken_nan_step_is_named_as_trainer_and_logger_count_it(tmp_path):
    module = Planted()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        trainer, rows = _run(tmp_path, module, "warn")
    message = next(str(w.message) for w in caught if "Non-finite" in str(w.message))
    step, batch_idx = _numbers(message)
    assert batch_idx == PLANTED  # the index training_step and the hooks received
    assert step == module.after[PLANTED] == 4  # trainer.global_step once the step is taken
    logged = [int(r["step"]) for r in rows if r.get("loss") and math.isnan(float(r["loss"]))]
    assert logged[0] == step  # the logger records the first NaN at the same step (the weights stay NaN after it)
    assert trainer.global_step == 6


def test_a_stopped_nan_step_says_where_trainer_global_step_stays(tmp_path):
    module = Planted()
    with pytest.raises(NonFiniteError) as err:
        _run(tmp_path, module, "error")
    trainer = module.trainer
    step, batch_idx = _numbers(str(err.value))
    stays = int(re.search(r"trainer.global_step stays (\d+)", str(err.value)).group(1))
    assert batch_idx == PLANTED and step == 4
    assert stays == trainer.global_step == module.during[PLANTED] == step - 1
    with open(trainer.logger.metrics_file) as fh:
        logged = [int(r["step"]) for r in csv.DictReader(fh) if r.get("loss")]
    assert max(logged) == stays  # the last step the logger has is the last one taken


def test_a_loss_without_grad_names_the_same_step_and_batch_idx(tmp_path):
    module = Planted(no_grad=True)
    with pytest.raises(RuntimeError, match="does not require grad") as err:
        _run(tmp_path, module, "error")
    message = str(err.value)
    step = int(re.search(r"\(step (\d+), batch_idx (\d+)\)", message).group(1))
    assert re.search(r"batch_idx (\d+)", message).group(1) == str(PLANTED)
    assert step == module.during[PLANTED] + 1 == 4

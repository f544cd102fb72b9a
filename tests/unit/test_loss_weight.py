"""loss_weight in one process (issue 20): a summed loss normalised over each optimizer step's global batch.

The tagger's micro-batches hold from 1 to 6 labelled positions per sample
(helpers/weighted.py). With `loss_weight` the same global batch gives the
same steps however it is split into micro-batches, the Trainer's logged
`train_loss` is the mean over every labelled position of the step, the
window is taken from the loader whole (never past the last step) and a run
resumed any number of times equals the uninterrupted one bitwise. The same
module with a mean loss differs between splits: what the hook is for. The
2-rank DDP / FSDP equality and the collective count are in
tests/distributed/test_loss_weight_ranks.py.
"""

from __future__ import annotations

import random

import pytest
import torch
import torch.distributed as dist
from torch.utils.data import DataLoader

import shardwise
from shardwise import Trainer
from shardwise.callbacks import ModelCheckpoint

from helpers.weighted import MeanTagger, StepRecord, SummedTagger, Tags, full_parameters, train


@pytest.fixture(autouse=True)
def _no_leftover_process_group():
    yield
    if dist.is_initialized():
        dist.destroy_process_group()


def _max_rel(a, b):
    return max(abs(x - y) / abs(y) for x, y in zip(a, b))


def _max_param_diff(a, b):
    return max(float((a[k] - b[k]).abs().max()) for k in b)


def test_the_same_global_batch_gives_the_same_steps_at_any_split():
    reference = train(SummedTagger, batch_size=8, accumulate=1)
    assert len(reference["losses"]) == 4
    # The logged loss is the mean over every labelled position of the step: the module's own sums.
    sums = reference["sums"]
    assert reference["losses"] == pytest.approx([s / n for s, n in sums], rel=1e-6)
    for batch_size, accumulate in ((2, 4), (1, 8)):
        split = train(SummedTagger, batch_size=batch_size, accumulate=accumulate)
        assert _max_rel(split["losses"], reference["losses"]) < 1e-6, (batch_size, split["losses"])
        assert _max_param_diff(split["params"], reference["params"]) < 1e-6, (batch_size, accumulate)
    # The same model with a mean loss: each micro-batch's mean counts the same, so the split changes the step.
    mean_one, mean_split = train(MeanTagger, batch_size=8), train(MeanTagger, batch_size=2, accumulate=4)
    assert _max_param_diff(mean_split["params"], mean_one["params"]) > 1e-3


def test_a_step_without_items_changes_nothing_and_logs_zero():
    class NothingLabelled(SummedTagger):
        def loss_weight(self, batch):
            return 0  # and the summed loss is a sum over nothing

        def training_step(self, batch, batch_idx):
            return super().training_step(batch, batch_idx) * 0.0

        def configure_optimizers(self):
            return torch.optim.SGD(self.parameters(), lr=0.1)  # no momentum, no decay: a zero gradient moves nothing

    class Initial:
        def on_train_start(self, trainer, module):
            self.params = full_parameters(module)

    shardwise.seed_everything(5)
    module, initial = NothingLabelled(), Initial()
    trainer = Trainer(
        accelerator="cpu", devices=1, max_steps=2, logger=False, enable_progress_bar=False, callbacks=[initial]
    )
    trainer.fit(module, DataLoader(Tags(), batch_size=4))
    assert trainer.callback_metrics["train_loss"] == 0.0 and float(trainer.step_weight) == 0.0
    assert _max_param_diff(full_parameters(module), initial.params) == 0.0


def test_the_window_is_fetched_when_asked_for_and_not_after_the_last_step():
    data = Tags()
    trainer = Trainer(
        accelerator="cpu",
        devices=1,
        max_steps=3,
        accumulate_grad_batches=2,
        logger=False,
        enable_progress_bar=False,
        enable_checkpointing=False,
    )
    shardwise.seed_everything(5)
    trainer.fit(SummedTagger(), DataLoader(data, batch_size=4, shuffle=True))
    assert data.fetched == 3 * 2 * 4  # three windows of two batches, none fetched for a fourth step
    assert float(trainer.step_weight) == float(sum(n for _, n in trainer.module.sums[-2:]))


class Losses:
    def __init__(self):
        self.by_step = {}

    def on_train_batch_end(self, trainer, module, outputs, batch, batch_idx):
        if trainer.is_last_microbatch:
            self.by_step[trainer.global_step] = trainer.callback_metrics["train_loss"]


def _fit(root, max_steps, ckpt_path=None, seed=3, every=None, **kw):
    shardwise.seed_everything(seed)
    losses = Losses()
    checkpoint = ModelCheckpoint(every_n_train_steps=every) if every else ModelCheckpoint(every_n_epochs=1)
    trainer = Trainer(
        accelerator="cpu",
        devices=1,
        max_steps=max_steps,
        enable_progress_bar=False,
        logger=False,
        default_root_dir=str(root),
        callbacks=[losses, checkpoint],
        **kw,
    )
    data = Tags(n=30, noisy=True)  # fetching draws from torch's generator, interleaved with dropout's
    trainer.fit(
        SummedTagger(dropout=0.3),
        DataLoader(data, batch_size=4, shuffle=True),
        DataLoader(Tags(n=8), batch_size=4),
        ckpt_path=ckpt_path,
    )
    return losses.by_step


@pytest.mark.parametrize("seed", [1, 2, 3])
def test_resume_chains_with_prefetched_windows_equal_the_uninterrupted_run(tmp_path, seed):
    # 8 batches per epoch, windows of 3 (the last one partial): the chains cross epoch ends and partial windows.
    total, rng = 8, random.Random(seed)
    stops = sorted(rng.sample(range(1, total), rng.randint(1, 3))) + [total]
    kw = dict(accumulate_grad_batches=3, val_check_interval=rng.choice([None, 2, 5]), every=rng.choice([1, 2, None]))
    reference = _fit(tmp_path / "ref", total, **kw)
    combined = {}
    for i, stop in enumerate(stops):
        combined.update(_fit(tmp_path / "run", stop, ckpt_path="last" if i else None, seed=100 + i if i else 3, **kw))
    assert sorted(combined) == list(range(1, total + 1))
    assert combined == reference, (stops, kw)


def test_a_module_without_loss_weight_logs_no_train_loss_and_has_no_step_weight():
    record = StepRecord()
    trainer = Trainer(
        accelerator="cpu",
        devices=1,
        max_steps=2,
        logger=False,
        enable_progress_bar=False,
        enable_checkpointing=False,
        callbacks=[record],
    )
    trainer.fit(MeanTagger(), DataLoader(Tags(), batch_size=4))
    assert trainer.weighting is None and trainer.step_weight is None
    assert "train_loss" not in trainer.callback_metrics and record.losses == []

"""torchmetrics objects logged with self.log, and the metric names test() / validate() give, as in Lightning.

A Metric logged as the value gives per step its forward's batch value and per epoch its own compute()
(its own cross-rank sync) followed by reset(): the epoch value must be what torchmetrics computes over
the whole epoch's data -- on one process and under DDP on two, where each rank saw half of it. The
names (`name_epoch` for a value logged per step and per epoch in evaluation, no step values among
callback_metrics, each validate() / test() starting afresh) were recorded from Lightning 2.6.6.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from lightning_compat import metric_logging as ml
from torch.utils.data import DataLoader, TensorDataset
from torchmetrics.classification import MulticlassAccuracy, MulticlassPrecision, MulticlassRecall

import shardwise


def _over(seen, stage, epoch, metric_cls):
    """torchmetrics over every batch of one epoch (None: all) of one stage, whichever rank saw it."""
    metric = metric_cls(num_classes=ml.CLASSES)
    for rank_seen in seen:
        for e, preds, target in rank_seen[stage]:
            if epoch is None or e == epoch:
                metric.update(torch.tensor(preds), torch.tensor(target))
    return float(metric.compute())


def _check(results):
    seen = [r["seen"] for r in results]
    for result in results:  # every rank reports the same epoch values: the metric synced itself
        for epoch in (0, 1):
            train, val = result["train"][epoch], result["val"][epoch]
            assert train["train_acc_epoch"] == pytest.approx(_over(seen, "train", epoch, MulticlassAccuracy), rel=1e-6)
            assert train["train_acc"] == train["train_acc_epoch"]
            assert val["val_acc"] == pytest.approx(_over(seen, "val", epoch, MulticlassAccuracy), rel=1e-6)
            assert val["val_prec"] == pytest.approx(_over(seen, "val", epoch, MulticlassPrecision), rel=1e-6)
            assert val["val_rec"] == pytest.approx(_over(seen, "val", epoch, MulticlassRecall), rel=1e-6)
        # on_train_epoch_end still sees the epoch's state; what it logs there is the same epoch value
        assert result["hook_values"] == [e["train_acc_epoch"] for e in result["train"]]
        assert result["fit_callback_metrics"]["train_acc_hook"] == result["train"][1]["train_acc_epoch"]
        # the step value is the last batch's forward result on this rank
        assert result["train"][-1]["train_acc_step"] == pytest.approx(result["batch_values"][-1], rel=1e-6)
        assert result["train"][0]["train_acc_epoch"] != result["train"][1]["train_acc_epoch"]  # reset between epochs
        assert result["step_values_reset"]
        (tested,) = result["test"]
        assert set(tested) == {"test_acc_epoch", "test_loss"}  # Lightning's names
        assert tested["test_acc_epoch"] == pytest.approx(_over(seen, "test", None, MulticlassAccuracy), rel=1e-6)
        assert result["test_callback_metrics"] == ["test_acc", "test_acc_epoch", "test_loss"]


def test_a_logged_metric_object_is_computed_over_the_epoch_on_one_process():
    result = ml.run()
    assert len(result["batch_values"]) == 2 * ml.SAMPLES // ml.BATCH
    _check([result])


@pytest.mark.slow
def test_a_logged_metric_object_syncs_itself_under_ddp():
    results = shardwise.launch(ml.run, "ddp", 2, devices=2)
    assert [len(r["batch_values"]) for r in results] == [ml.SAMPLES // ml.BATCH] * 2  # each rank half the data
    _check(results)


class _Keys(shardwise.TrainModule):
    def __init__(self):
        super().__init__()
        self.net = torch.nn.Linear(4, 1)

    def _loss(self, batch):
        return F.mse_loss(self.net(batch[0]), batch[1])

    def training_step(self, batch, batch_idx):
        loss = self._loss(batch)
        self.log("train_loss", loss, on_step=True, on_epoch=True)
        return loss

    def validation_step(self, batch, batch_idx):
        self.log("val_loss", self._loss(batch), on_step=True, on_epoch=True)
        self.log("val_only", self._loss(batch))

    def test_step(self, batch, batch_idx):
        loss = self._loss(batch)
        self.log("test_loss", loss, on_step=True, on_epoch=True)
        self.log("test_only", loss)
        self.log("test_steponly", loss, on_step=True, on_epoch=False)

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.01)


def test_test_and_validate_name_their_metrics_as_lightning():
    x = torch.randn(32, 4)
    loader = lambda: DataLoader(TensorDataset(x, x.sum(1, keepdim=True)), batch_size=8)  # noqa: E731
    options = dict(logger=False, enable_checkpointing=False, enable_progress_bar=False)
    trainer, module = shardwise.Trainer(max_epochs=1, **options), _Keys()
    trainer.fit(module, loader(), loader())
    # Lightning 2.6.6 gives exactly these (evaluation step values are not callback metrics)
    assert sorted(trainer.callback_metrics) == [
        "train_loss",
        "train_loss_epoch",
        "train_loss_step",
        "val_loss",
        "val_loss_epoch",
        "val_only",
    ]
    assert trainer.global_step == 4
    (validated,) = trainer.validate(module, loader())
    assert sorted(validated) == ["val_loss_epoch", "val_only"]
    assert sorted(trainer.callback_metrics) == ["val_loss", "val_loss_epoch", "val_only"]
    (tested,) = trainer.test(module, loader(), verbose=False)
    assert sorted(tested) == ["test_loss_epoch", "test_only"]
    assert sorted(trainer.callback_metrics) == ["test_loss", "test_loss_epoch", "test_only"]
    assert tested["test_loss_epoch"] == trainer.callback_metrics["test_loss"] == pytest.approx(tested["test_only"])
    assert trainer.global_step == 4
    fresh = shardwise.Trainer(**options)
    (tested,) = fresh.test(_Keys(), loader(), verbose=False)
    assert sorted(tested) == ["test_loss_epoch", "test_only"] and fresh.global_step == 0


def test_a_metric_collection_given_to_log_names_log_dict():
    from torchmetrics import MetricCollection

    collection = MetricCollection({"acc": MulticlassAccuracy(num_classes=3)})
    with pytest.raises(TypeError, match=r"self.log_dict\(collection\)"):
        ml.Classifier().log("metrics", collection)

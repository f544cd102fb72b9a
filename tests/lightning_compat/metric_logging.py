"""A Lightning-style classifier that logs torchmetrics objects, run by test_metric_logging.py on one
process and on two (DDP); importable by the spawned workers.

training_step calls the metric (forward: the batch value) and logs the object per step and per epoch,
and on_train_epoch_end computes it and logs it again, as torchmetrics' documentation does;
validation_step only updates its metrics and logs them per epoch, one of them through a
MetricCollection and log_dict; test_step logs a metric object per step and per epoch. Every rank
records the predictions and targets it saw, so the test can compute what torchmetrics gives over the
whole epoch's data itself.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch.utils.data import DataLoader, TensorDataset
from torchmetrics import MetricCollection
from torchmetrics.classification import MulticlassAccuracy, MulticlassPrecision, MulticlassRecall

import shardwise as L

CLASSES, FEATURES, SAMPLES, BATCH = 3, 6, 48, 8


def data(seed: int) -> TensorDataset:
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(SAMPLES, FEATURES, generator=g)
    return TensorDataset(x, torch.randint(0, CLASSES, (SAMPLES,), generator=g))


class Classifier(L.TrainModule):
    def __init__(self):
        super().__init__()
        self.net = torch.nn.Linear(FEATURES, CLASSES)
        self.train_acc = MulticlassAccuracy(num_classes=CLASSES)
        self.val_acc = MulticlassAccuracy(num_classes=CLASSES)
        self.val_metrics = MetricCollection(
            {"val_prec": MulticlassPrecision(num_classes=CLASSES), "val_rec": MulticlassRecall(num_classes=CLASSES)}
        )
        self.test_acc = MulticlassAccuracy(num_classes=CLASSES)
        self.seen = {"train": [], "val": [], "test": []}  # (epoch, preds, targets, batch value)
        self.batch_values = []
        self.hook_values = []

    def _preds(self, stage, batch):
        x, y = batch
        logits = self.net(x)
        self.seen[stage].append((self.current_epoch, logits.argmax(-1).tolist(), y.tolist()))
        return logits, y

    def training_step(self, batch, batch_idx):
        logits, y = self._preds("train", batch)
        batch_value = self.train_acc(logits, y)
        self.batch_values.append(float(batch_value))
        self.log("train_acc", self.train_acc, on_step=True, on_epoch=True)
        return F.cross_entropy(logits, y)

    def on_train_epoch_end(self):
        # torchmetrics' documented pattern: the epoch's state is still there in this hook
        self.hook_values.append(float(self.train_acc.compute()))
        self.log("train_acc_hook", self.train_acc)

    def validation_step(self, batch, batch_idx):
        logits, y = self._preds("val", batch)
        self.val_acc.update(logits, y)
        self.val_metrics.update(logits, y)
        self.log("val_acc", self.val_acc)
        self.log_dict(self.val_metrics)

    def test_step(self, batch, batch_idx):
        logits, y = self._preds("test", batch)
        self.test_acc(logits, y)
        self.log("test_acc", self.test_acc, on_step=True, on_epoch=True)
        self.log("test_loss", F.cross_entropy(logits, y))

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.5)


class EpochValues:
    """What a callback sees at each epoch's end (Lightning: the metric's compute() over the epoch)."""

    def __init__(self):
        self.train, self.val = [], []

    def on_train_epoch_end(self, trainer, module):
        self.train.append({k: float(v) for k, v in trainer.callback_metrics.items() if k.startswith("train_acc")})

    def on_validation_epoch_end(self, trainer, module):
        self.val.append({k: float(v) for k, v in trainer.callback_metrics.items() if k.startswith("val_")})


def run(strategy: str = "auto", devices: int = 1) -> dict:
    L.seed_everything(0)
    module, values = Classifier(), EpochValues()
    trainer = L.Trainer(
        max_epochs=2,
        devices=devices,
        strategy=strategy,
        accelerator="cpu",
        callbacks=[values],
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
    )
    loader = lambda seed: DataLoader(data(seed), batch_size=BATCH)  # noqa: E731
    trainer.fit(module, loader(1), loader(2))
    fit_metrics = {k: float(v) for k, v in trainer.callback_metrics.items()}
    tested = trainer.test(module, loader(3), verbose=False)
    return {
        "train": values.train,
        "val": values.val,
        "test": tested,
        "test_callback_metrics": sorted(trainer.callback_metrics),
        "seen": module.seen,
        "batch_values": module.batch_values,
        "hook_values": module.hook_values,
        "fit_callback_metrics": fit_metrics,
        "step_values_reset": module.train_acc._update_count == 0,  # reset at the epoch's end
    }

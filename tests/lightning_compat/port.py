"""A Lightning 2.x training script, ported to shardwise by changing its imports and nothing else.

It uses what a first hour with Lightning reaches for: prepare_data and setup building the
datasets, self.log per step and per epoch (an uneven last validation batch, so the epoch mean
must be weighted by batch size), a gradient norm logged in on_before_optimizer_step,
ReduceLROnPlateau on val_loss, EarlyStopping, and a Callback subclass reading
callback_metrics; it trains in precision="64-true", then runs trainer.test (an uneven last batch
again) and trainer.predict on held-out data. tests/fixtures/lightning_port_reference.json is what
this file printed under Lightning 2.6.6 (the same file with the import block below swapped by
tests/fixtures/record_lightning_port.py); test_port.py runs it here and compares.
"""

import torch
import torch.nn.functional as F
from torch.utils.data import DataLoader, TensorDataset

# --- imports: the only lines that differ from the Lightning script ---
from shardwise import Callback, EarlyStopping, Trainer, seed_everything
from shardwise import TrainModule as LightningModule

# --- end of imports ---


class Regression(LightningModule):
    def __init__(self, lr: float = 0.05, batch_size: int = 16, val_batch_size: int = 12):
        super().__init__()
        self.lr, self.batch_size, self.val_batch_size = lr, batch_size, val_batch_size
        self.net = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 1))
        self.prepared = 0

    def prepare_data(self):
        self.prepared += 1  # where a download would go: once per node

    def setup(self, stage):
        g = torch.Generator().manual_seed(1)
        x = torch.randn(96, 8, generator=g)
        w = torch.randn(8, 1, generator=g)
        shifted = w + 0.5 * torch.randn(8, 1, generator=g)  # the validation targets drift: val_loss plateaus
        self.train_set = TensorDataset(x[:64], x[:64] @ w + 0.1 * torch.randn(64, 1, generator=g))
        self.val_set = TensorDataset(x[64:], x[64:] @ shifted)

    def train_dataloader(self):
        return DataLoader(self.train_set, batch_size=self.batch_size)

    def val_dataloader(self):
        return DataLoader(self.val_set, batch_size=self.val_batch_size)

    def training_step(self, batch, batch_idx):
        x, y = batch
        loss = F.mse_loss(self.net(x), y)
        self.log("train_loss", loss, on_step=True, on_epoch=True, prog_bar=True)
        return loss

    def validation_step(self, batch, batch_idx):
        x, y = batch
        self.log("val_loss", F.mse_loss(self.net(x), y), prog_bar=True, sync_dist=True)

    def test_step(self, batch, batch_idx):
        x, y = batch
        self.log("test_loss", F.mse_loss(self.net(x), y), sync_dist=True)
        self.log("test_mae", F.l1_loss(self.net(x), y), sync_dist=True)

    def predict_step(self, batch, batch_idx):
        return self.net(batch[0])

    def on_before_optimizer_step(self, optimizer):
        norms = [torch.linalg.vector_norm(p.grad) for p in self.parameters() if p.grad is not None]
        self.log("grad_norm", torch.linalg.vector_norm(torch.stack(norms)))

    def on_train_epoch_end(self):
        self.log("lr", self.trainer.optimizers[0].param_groups[0]["lr"])

    def configure_optimizers(self):
        optimizer = torch.optim.SGD(self.parameters(), lr=self.lr)
        scheduler = torch.optim.lr_scheduler.ReduceLROnPlateau(optimizer, factor=0.5, patience=0)
        return {"optimizer": optimizer, "lr_scheduler": {"scheduler": scheduler, "monitor": "val_loss"}}


class History(Callback):
    def __init__(self):
        self.epochs = []
        self.batches = 0

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        self.batches += 1

    def on_train_epoch_end(self, trainer, pl_module):
        # A callback's on_train_epoch_end runs before the module's: "lr" is the previous epoch's here.
        metrics = trainer.callback_metrics
        names = ("train_loss_epoch", "val_loss", "grad_norm", "lr")
        self.epochs.append({k: float(metrics[k]) if k in metrics else None for k in names})


def held_out_data():
    # float32 data, as a user's would be: 64-true casts the batches to float64 on the way in.
    g = torch.Generator().manual_seed(2)
    x = torch.randn(30, 8, generator=g)
    return x, x.sum(dim=1, keepdim=True) / 4


def main(batch_size: int = 16, val_batch_size: int = 12, test_batch_size: int = 8, **trainer_kwargs):
    seed_everything(0)
    model = Regression(batch_size=batch_size, val_batch_size=val_batch_size)
    history = History()
    stopping = EarlyStopping(monitor="val_loss", patience=2, min_delta=1e-4)
    trainer = Trainer(
        max_epochs=40,
        callbacks=[history, stopping],
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        precision="64-true",
        **trainer_kwargs,
    )
    trainer.fit(model)
    prepared_by_fit = model.prepared
    x, y = held_out_data()
    tested = trainer.test(model, DataLoader(TensorDataset(x, y), batch_size=test_batch_size), verbose=False)
    predicted = trainer.predict(model, DataLoader(TensorDataset(x), batch_size=test_batch_size))
    return {
        "epochs": history.epochs,
        "batches": history.batches,
        "stopped_epoch": stopping.stopped_epoch,
        "wait_count": stopping.wait_count,
        "global_step": trainer.global_step,
        "prepared": prepared_by_fit,
        "prepared_in_all": model.prepared,  # Lightning calls prepare_data again in test and predict
        "lr": trainer.optimizers[0].param_groups[0]["lr"],
        "weights": [float(p.detach().double().sum()) for p in model.parameters()],
        "parameter_dtypes": sorted({str(p.dtype) for p in model.parameters()}),
        "test": [{k: float(v) for k, v in metrics.items()} for metrics in tested],
        "predictions": [p.tolist() for p in predicted],
        "prediction_dtypes": [str(p.dtype) for p in predicted],
    }


if __name__ == "__main__":
    print(main())

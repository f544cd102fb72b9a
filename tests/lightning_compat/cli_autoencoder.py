"""Lightning's examples/pytorch/basics/autoencoder.py in shape, renamed to shardwise and made tiny: a module, a
datamodule and LightningCLI (MNIST replaced by same-shaped random images, 8 x 8 here; no torchvision)."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import DataLoader, TensorDataset, random_split

from shardwise import LightningDataModule, LightningModule, callbacks

SIDE = 8


class ImageSampler(callbacks.Callback):
    """Counts the epochs it saw end (the example saves image grids here)."""

    def __init__(self) -> None:
        self.epochs = 0

    def on_train_epoch_end(self, trainer, pl_module) -> None:
        self.epochs += 1


class LitAutoEncoder(LightningModule):
    def __init__(self, hidden_dim: int = 64, learning_rate=10e-3):
        super().__init__()
        self.save_hyperparameters()
        self.encoder = nn.Sequential(nn.Linear(SIDE * SIDE, hidden_dim), nn.ReLU(), nn.Linear(hidden_dim, 3))
        self.decoder = nn.Sequential(nn.Linear(3, hidden_dim), nn.ReLU(), nn.Linear(hidden_dim, SIDE * SIDE))

    def forward(self, x):
        return self.decoder(self.encoder(x))

    def training_step(self, batch, batch_idx):
        return self._common_step(batch, batch_idx, "train")

    def validation_step(self, batch, batch_idx):
        self._common_step(batch, batch_idx, "val")

    def test_step(self, batch, batch_idx):
        self._common_step(batch, batch_idx, "test")

    def predict_step(self, batch, batch_idx, dataloader_idx=None):
        return self(self._prepare_batch(batch))

    def configure_optimizers(self):
        return torch.optim.Adam(self.parameters(), lr=self.hparams.learning_rate)

    def _prepare_batch(self, batch):
        x, _ = batch
        return x.view(x.size(0), -1)

    def _common_step(self, batch, batch_idx, stage: str):
        x = self._prepare_batch(batch)
        loss = F.mse_loss(x, self(x))
        self.log(f"{stage}_loss", loss, on_step=True)
        return loss


class MyDataModule(LightningDataModule):
    def __init__(self, batch_size: int = 32):
        super().__init__()
        g = torch.Generator().manual_seed(0)
        images = torch.rand(24, 1, SIDE, SIDE, generator=g)
        dataset = TensorDataset(images[:16], torch.zeros(16, dtype=torch.long))
        self.mnist_test = TensorDataset(images[16:], torch.zeros(8, dtype=torch.long))
        self.mnist_train, self.mnist_val = random_split(dataset, [12, 4], generator=torch.Generator().manual_seed(42))
        self.batch_size = batch_size

    def train_dataloader(self):
        return DataLoader(self.mnist_train, batch_size=self.batch_size)

    def val_dataloader(self):
        return DataLoader(self.mnist_val, batch_size=self.batch_size)

    def test_dataloader(self):
        return DataLoader(self.mnist_test, batch_size=self.batch_size)

    def predict_dataloader(self):
        return DataLoader(self.mnist_test, batch_size=self.batch_size)

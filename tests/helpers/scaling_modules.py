"""TrainModules for `shardwise check`: one that scales correctly and the three mistakes it must name.

A small MLP classifies points (a fixed synthetic dataset); its own train_dataloader()
gives the data, as a Lightning user's module does. Each planted mistake changes one
thing a user gets wrong:
- SameSamplesMLP: a sampler of its own that ignores the rank (every rank trains on
  the same samples);
- SummedLossMLP: the loss summed over the micro-batch without its weight;
- RankZeroBufferMLP: a running statistic (buffer) that only rank 0 updates.
WeightedLossMLP does it right for a count that varies per sample (positions not masked
with -100): the summed loss plus loss_weight(batch), which the Trainer divides by the
step's global count; TokenMeanMLP makes the usual mistake instead (a mean over each
micro-batch's own count).

Module-level so the workers `shardwise.check` starts can import them.
"""

from __future__ import annotations

from typing import Iterator, Optional

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import DataLoader, Sampler, TensorDataset

from shardwise import TrainModule

FEATURES, CLASSES = 8, 4


def points(n: int = 96, seed: int = 0) -> TensorDataset:
    """Points with a class given by a fixed random linear map (learnable in a few steps)."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, FEATURES, generator=g)
    w = torch.randn(FEATURES, CLASSES, generator=g)
    return TensorDataset(x, (x @ w).argmax(-1))


class MeanMLP(TrainModule):
    """Correct: a mean loss, a plain shuffled DataLoader (the Trainer shards it)."""

    def __init__(self, hidden: int = 16, lr: float = 0.1, samples: int = 96, batch_size: int = 4) -> None:
        super().__init__()
        self.hidden, self.lr, self.samples, self.batch_size = hidden, lr, samples, batch_size
        self.net: Optional[nn.Module] = None

    def configure_model(self) -> None:
        if self.net is None:
            self.net = nn.Sequential(nn.Linear(FEATURES, self.hidden), nn.Tanh(), nn.Linear(self.hidden, CLASSES))

    def training_step(self, batch):
        x, y = batch
        return F.cross_entropy(self.net(x), y)

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=self.lr, momentum=0.9)

    def train_dataloader(self):
        return DataLoader(points(self.samples), batch_size=self.batch_size, shuffle=True)


class EveryRankSampler(Sampler):
    """A seeded shuffle that knows nothing of ranks: every rank draws the same order."""

    def __init__(self, n: int, seed: int = 0) -> None:
        self.n, self.seed = n, seed

    def __len__(self) -> int:
        return self.n

    def __iter__(self) -> Iterator[int]:
        return iter(torch.randperm(self.n, generator=torch.Generator().manual_seed(self.seed)).tolist())


class SameSamplesMLP(MeanMLP):
    def train_dataloader(self):
        return DataLoader(points(self.samples), batch_size=self.batch_size, sampler=EveryRankSampler(self.samples))


class SummedLossMLP(MeanMLP):
    def training_step(self, batch):
        x, y = batch
        return F.cross_entropy(self.net(x), y, reduction="sum")


class RankZeroBufferMLP(MeanMLP):
    """Normalises its inputs by a running mean of the features that only rank 0 keeps up to date."""

    def __init__(self, **kwargs) -> None:
        super().__init__(**kwargs)
        self.register_buffer("feature_mean", torch.zeros(FEATURES))

    def training_step(self, batch):
        x, y = batch
        if self.trainer.is_global_zero:
            self.feature_mean.mul_(0.9).add_(x.mean(0), alpha=0.1)
        return F.cross_entropy(self.net(x - self.feature_mean), y)


def tagged_sequences(n: int = 96, length: int = 6, seed: int = 0) -> TensorDataset:
    """Sequences of points with a label per position; a random tail of each is masked (-100)."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, length, FEATURES, generator=g)
    w = torch.randn(FEATURES, CLASSES, generator=g)
    y = (x @ w).argmax(-1)
    keep = torch.randint(1, length + 1, (n, 1), generator=g)
    y[torch.arange(length).expand(n, length) >= keep] = -100
    return TensorDataset(x, y)


class WeightedLossMLP(MeanMLP):
    """Right for a varying count: the summed loss over unmasked positions, and their number as loss_weight."""

    def training_step(self, batch):
        x, y = batch
        logits = self.net(x)
        return F.cross_entropy(logits.reshape(-1, CLASSES), y.reshape(-1), ignore_index=-100, reduction="sum")

    def loss_weight(self, batch):
        return (batch[1] != -100).sum()

    def train_dataloader(self):
        return DataLoader(tagged_sequences(self.samples), batch_size=self.batch_size, shuffle=True)


class TokenMeanMLP(MeanMLP):
    """The usual mistake for a varying count: the mean over each micro-batch's own unmasked positions."""

    def training_step(self, batch):
        x, y = batch
        logits = self.net(x)
        return F.cross_entropy(logits.reshape(-1, CLASSES), y.reshape(-1), ignore_index=-100)

    def train_dataloader(self):
        return DataLoader(tagged_sequences(self.samples), batch_size=self.batch_size, shuffle=True)

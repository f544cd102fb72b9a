"""A TrainModule whose loss is a sum over a varying number of items, with and without `loss_weight` (issue 20).

Each sample is a sequence of 6 positions of which 1 to 6 carry a label (the
rest are -100), so micro-batches hold very different numbers of items. The
tagger returns the cross-entropy SUMMED over the labelled positions and says
how many there are in `loss_weight`; `MeanTagger` is the same model with the
usual mean loss and no `loss_weight`. `NoisyTags` draws noise from torch's
global generator in __getitem__, so the order in which batches are fetched
and dropout masks are drawn matters (what a resume must reproduce).
Module-level so spawned workers import it.
"""

from __future__ import annotations

from typing import Any, Dict, List, Optional

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import DataLoader, Dataset

from shardwise import Trainer, TrainModule

POSITIONS, FEATURES, CLASSES = 6, 4, 3


class Tags(Dataset):
    """n sequences; sample i has between 1 and POSITIONS labelled positions."""

    def __init__(self, n: int = 64, seed: int = 0, noisy: bool = False) -> None:
        g = torch.Generator().manual_seed(seed)
        self.x = torch.randn(n, POSITIONS, FEATURES, generator=g)
        labels = torch.randint(0, CLASSES, (n, POSITIONS), generator=g)
        counts = torch.randint(1, POSITIONS + 1, (n,), generator=g)
        self.y = labels.masked_fill(torch.arange(POSITIONS) >= counts[:, None], -100)
        self.noisy = noisy
        self.fetched = 0

    def __len__(self) -> int:
        return len(self.x)

    def __getitem__(self, i: int):
        self.fetched += 1
        x = self.x[i] + 0.01 * torch.randn(self.x[i].shape) if self.noisy else self.x[i]
        return x, self.y[i]


class MeanTagger(TrainModule):
    """Per-position classifier; the mean loss over the micro-batch's labelled positions (no loss_weight)."""

    def __init__(self, dropout: float = 0.0, lr: float = 0.1) -> None:
        super().__init__()
        self.dropout, self.lr = dropout, lr
        self.sums: List[float] = []  # weighted modules: every micro-batch's (summed loss, items), for checks

    def configure_model(self) -> None:
        self.net = nn.Sequential(nn.Linear(FEATURES, 16), nn.Tanh(), nn.Dropout(self.dropout), nn.Linear(16, CLASSES))

    def _logits(self, batch):
        x, y = batch
        return self.net(x).reshape(-1, CLASSES), y.reshape(-1)

    def training_step(self, batch, batch_idx):
        logits, y = self._logits(batch)
        return F.cross_entropy(logits, y, ignore_index=-100)

    def validation_step(self, batch, batch_idx):
        logits, y = self._logits(batch)
        self.log("val_loss", F.cross_entropy(logits, y, ignore_index=-100))

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=self.lr, momentum=0.9)


class SummedTagger(MeanTagger):
    """The same model returning the SUMMED loss, with the number of labelled positions as its weight."""

    def loss_weight(self, batch) -> torch.Tensor:
        return (batch[1] != -100).sum()

    def training_step(self, batch, batch_idx):
        logits, y = self._logits(batch)
        loss = F.cross_entropy(logits, y, ignore_index=-100, reduction="sum")
        self.sums.append((float(loss.detach()), int((y != -100).sum())))
        return loss


class StepRecord:
    """Callback: per optimizer step, the Trainer's logged train_loss (weighted modules) and the
    number of torch.distributed.all_reduce calls and their sizes since the step before (`counter`)."""

    def __init__(self, counter: Optional[List[int]] = None) -> None:
        self.losses: List[float] = []
        self.collectives: List[List[int]] = []
        self.counter = counter
        self._seen = 0

    def on_train_start(self, trainer, module):
        self._seen = len(self.counter) if self.counter is not None else 0

    def on_train_batch_end(self, trainer, module, outputs, batch, batch_idx):
        if not trainer.is_last_microbatch:
            return
        if trainer.weighting is not None:
            self.losses.append(trainer.callback_metrics["train_loss"])
        if self.counter is not None:
            self.collectives.append(list(self.counter[self._seen :]))
            self._seen = len(self.counter)


def full_parameters(module: TrainModule) -> Dict[str, torch.Tensor]:
    from torch.distributed.tensor import DTensor

    return {
        n: (p.full_tensor() if isinstance(p, DTensor) else p).detach().clone() for n, p in module.named_parameters()
    }


def count_all_reduces() -> List[int]:
    """Wrap torch.distributed.all_reduce (every helper in shardwise.distributed.ops calls it through the
    module); return the list that records the number of elements of each call."""
    import torch.distributed as dist

    calls: List[int] = []
    real = dist.all_reduce

    def counting(tensor, *args, **kwargs):
        calls.append(tensor.numel())
        return real(tensor, *args, **kwargs)

    dist.all_reduce = counting
    return calls


def train(
    module_cls: Any,
    strategy: str = "single",
    devices: int = 1,
    batch_size: int = 8,
    accumulate: int = 1,
    steps: int = 4,
    counter: Optional[List[int]] = None,
    **trainer_kw: Any,
) -> Dict[str, Any]:
    """Fit `module_cls()` for `steps` optimizer steps; its step losses, collectives and final parameters."""
    import shardwise

    shardwise.seed_everything(5)
    record = StepRecord(counter)
    trainer = Trainer(
        accelerator="cpu",
        devices=devices,
        strategy=strategy,
        max_steps=steps,
        accumulate_grad_batches=accumulate,
        callbacks=[record],
        logger=False,
        enable_progress_bar=False,
        enable_checkpointing=False,
        **trainer_kw,
    )
    module = module_cls()
    trainer.fit(module, DataLoader(Tags(), batch_size=batch_size, shuffle=True))
    return {
        "losses": record.losses,
        "collectives": record.collectives,
        "params": full_parameters(module),
        "sums": module.sums,
    }


def train_split_runs(configs: List[Dict[str, Any]]) -> Dict[str, Dict[str, Any]]:
    """Worker of shardwise.launch: several runs in one set of processes, all_reduce calls counted."""
    counter = count_all_reduces()
    return {c.pop("key"): train(counter=counter, **c) for c in configs}

"""The epoch's order and its end across ranks: the one-process batches, each sample once, the same steps.

Two ranks whose global generators differ (each reseeded by its rank, as
per-rank dropout streams are) read a shuffled loader: global rank 0's draw is
taken, so the ranks' micro-batch k together are exactly the one-process
micro-batch k of twice the size (the one-process run draws from rank 0's
generator state). 9 samples in batches of 4 per rank do not divide: rank 1
is one batch short and takes one repeated sample, and a summed loss with
loss_weight gives the repeat weight zero, so every step, the epoch's last
included, equals the one-process step (parameters within 1e-6; counting the
repeat moves them by 0.26 here). The same
holds at 3 ranks (RANKS, BATCH, SAMPLES = 3, 2, 7: two repeats), measured
once; one launch is what the suite affords. A mean loss over the same epoch warns, on
rank 0 once, naming the repeats; an unshuffled training loader is said to
stay unshuffled, on rank 0 only.
"""

from __future__ import annotations

import contextlib
import io
import warnings

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import DataLoader, Dataset

import shardwise
from shardwise import Trainer, TrainModule
from shardwise.data import shares

RANKS, BATCH, SAMPLES, EPOCHS = 2, 4, 9, 2


class Points(Dataset):
    def __init__(self) -> None:
        g = torch.Generator().manual_seed(0)
        self.x, self.y = torch.randn(SAMPLES, 4, generator=g), torch.randn(SAMPLES, 2, generator=g)

    def __len__(self) -> int:
        return SAMPLES

    def __getitem__(self, i: int):
        return i, self.x[i], self.y[i]


class Summed(TrainModule):
    """A squared error summed over the batch, its sample count as loss_weight; records each step's ids."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(1)
        self.net = nn.Linear(4, 2)
        self.ids = []

    def loss_weight(self, batch):
        return len(batch[0])

    def training_step(self, batch, batch_idx):
        ids, x, y = batch
        self.ids.append(ids.tolist())
        return F.mse_loss(self.net(x), y, reduction="sum")

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.05)


class Mean(Summed):
    loss_weight = None

    def training_step(self, batch, batch_idx):
        return F.mse_loss(self.net(batch[1]), batch[2])


def fit(module_cls, devices: int, batch_size: int, shuffle: bool):
    shardwise.seed_everything(3)
    module = module_cls()
    trainer = Trainer(
        accelerator="cpu",
        devices=devices,
        strategy="ddp" if devices > 1 else "auto",
        max_epochs=EPOCHS,
        logger=False,
        enable_progress_bar=False,
        enable_checkpointing=False,
    )
    torch.manual_seed(100 + trainer.global_rank)  # the ranks' global generators disagree; rank 0's decides
    trainer.fit(module, DataLoader(Points(), batch_size=batch_size, shuffle=shuffle))
    return trainer, module


def on_ranks():
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        trainer, summed = fit(Summed, RANKS, BATCH, shuffle=True)
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            fit(Mean, RANKS, BATCH, shuffle=False)
    repeats = [str(w.message) for w in caught if "repeated" in str(w.message)]
    params = {n: p.detach().clone() for n, p in summed.named_parameters()}
    return {
        "ids": summed.ids,
        "params": params,
        "said": out.getvalue(),
        "repeats": repeats,
        "rank": trainer.global_rank,
    }


def test_ranks_read_the_one_process_batches_and_the_epoch_end_counts_each_sample_once():
    ranks = shardwise.launch(on_ranks, devices=RANKS)
    _, one = fit(Summed, 1, RANKS * BATCH, shuffle=True)
    steps = len(one.ids)
    per_epoch = steps // EPOCHS
    padding = shares(SAMPLES, RANKS, BATCH)[1]
    assert any(padding) and all(len(r["ids"]) == steps for r in ranks)  # every rank takes the same steps
    for k, global_batch in enumerate(one.ids):
        last = k % per_epoch == per_epoch - 1  # each epoch's last step holds its last samples and the repeats
        real = [r["ids"][k] for r in ranks if not (last and padding[r["rank"]])]
        assert sorted(sum(real, [])) == sorted(global_batch), k
        if last:  # a rank one batch short reads one sample again
            assert all(len(r["ids"][k]) == 1 for r in ranks if padding[r["rank"]])
    for name, value in one.named_parameters():
        for r in ranks:
            assert torch.allclose(r["params"][name], value, rtol=0, atol=1e-6), (name, r["rank"])
    assert "Lightning would shuffle" in ranks[0]["said"] and all(r["said"] == "" for r in ranks[1:])
    assert len(ranks[0]["repeats"]) == 1 and f"{sum(padding)} sample(s) are repeated" in ranks[0]["repeats"][0]
    assert all(r["repeats"] == [] for r in ranks[1:])

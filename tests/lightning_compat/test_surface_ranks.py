"""The Lightning surface on two processes (DDP on CPU): what one process cannot show.

`self.all_gather` stacks every rank's values (and lets gradients through with sync_grads=True),
`self.global_rank` / `local_rank` are the process's, a datamodule's `self.trainer.world_size` is
the world's already in setup (templates divide the global batch by it), and
`strategy="ddp_find_unused_parameters_true"` trains a module with a parameter the loss never uses,
which plain DDP refuses at the second step.
"""

from __future__ import annotations

import pytest
import torch
from torch.utils.data import DataLoader, TensorDataset

import shardwise as L


class Data(L.LightningDataModule):
    def setup(self, stage):
        self.per_rank_batch = 8 // self.trainer.world_size

    def train_dataloader(self):
        return DataLoader(TensorDataset(torch.randn(32, 3), torch.randn(32, 1)), batch_size=self.per_rank_batch)


class Unused(L.LightningModule):
    def __init__(self):
        super().__init__()
        self.used, self.unused = torch.nn.Linear(3, 1), torch.nn.Linear(3, 1)
        self.seen = {}

    def training_step(self, batch, batch_idx):
        rank = torch.tensor(float(self.global_rank), requires_grad=True)
        gathered = self.all_gather({"rank": rank * 2, "n": self.local_rank}, sync_grads=True)
        # Through the gather, as Lightning's: every rank's sum(2 * rank_i) reaches this rank's input: 2 ranks x 2.
        gathered["rank"].sum().backward()
        self.seen.update(gathered=gathered["rank"].tolist(), n=gathered["n"].tolist(), grad=float(rank.grad))
        self.seen["batch"] = len(batch[0])
        return torch.nn.functional.mse_loss(self.used(batch[0]), batch[1])

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1)


def run_on_ranks():
    module = Unused()
    trainer = L.Trainer(
        accelerator="cpu", devices=2, strategy="ddp_find_unused_parameters_true", max_steps=3, logger=False,
        enable_checkpointing=False, enable_progress_bar=False, throughput=False,
    )  # fmt: skip
    trainer.fit(module, datamodule=Data())
    return {**module.seen, "rank": module.global_rank, "steps": trainer.global_step}


@pytest.mark.slow
def test_all_gather_ranks_datamodule_world_and_unused_parameters_on_two_processes():
    ranks = L.launch(run_on_ranks, devices=2)
    assert [r["rank"] for r in ranks] == [0, 1] and [r["steps"] for r in ranks] == [3, 3]
    for result in ranks:
        assert result["gathered"] == [0.0, 2.0] and result["n"] == [0, 1]  # every rank's values, in rank order
        assert result["grad"] == 4.0
        assert result["batch"] == 4  # 8 // world_size, read in the datamodule's setup

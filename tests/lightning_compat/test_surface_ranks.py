"""The Lightning surface on two processes (DDP on CPU): what one process cannot show.

`self.all_gather` stacks every rank's values (and lets gradients through with sync_grads=True),
`self.global_rank` / `local_rank` are the process's, a datamodule's `self.trainer.world_size` is
the world's already in setup (templates divide the global batch by it), and
`strategy="ddp_find_unused_parameters_true"` trains a module with a parameter the loss never uses,
which plain DDP refuses at the second step. `grad_norm` on FSDP's sharded gradients gives every rank
the norms of the whole gradients, those of the same run on one process.
"""

from __future__ import annotations

import pytest
import torch
from torch.utils.data import DataLoader, TensorDataset

import shardwise as L
from shardwise.utilities import grad_norm


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
    # A second fit in the same processes (one launch for both checks): FSDP's sharded gradients.
    return {**module.seen, "rank": module.global_rank, "steps": trainer.global_step, "norms": norms_of_a_fit("fsdp", 2)}


@pytest.fixture(scope="module")
def ranks():
    return L.launch(run_on_ranks, devices=2)


@pytest.mark.slow
def test_all_gather_ranks_datamodule_world_and_unused_parameters_on_two_processes(ranks):
    assert [r["rank"] for r in ranks] == [0, 1] and [r["steps"] for r in ranks] == [3, 3]
    for result in ranks:
        assert result["gathered"] == [0.0, 2.0] and result["n"] == [0, 1]  # every rank's values, in rank order
        assert result["grad"] == 4.0
        assert result["batch"] == 4  # 8 // world_size, read in the datamodule's setup


class Norms(L.LightningModule):
    def __init__(self):
        super().__init__()
        self.net = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Linear(8, 1))
        self.norms = []

    def training_step(self, batch, batch_idx):
        return torch.nn.functional.mse_loss(self.net(batch[0]), batch[1])

    def on_before_optimizer_step(self, optimizer):
        self.norms.append({k: float(v) for k, v in grad_norm(self, norm_type=2).items()})

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1)


def norms_of_a_fit(strategy="auto", devices=1):
    x = torch.randn(16, 4, generator=torch.Generator().manual_seed(1))
    data = TensorDataset(x, torch.randn(16, 1, generator=torch.Generator().manual_seed(2)))
    L.seed_everything(0)
    module = Norms()
    L.Trainer(
        accelerator="cpu", devices=devices, strategy=strategy, max_steps=2, logger=False, enable_checkpointing=False,
        enable_progress_bar=False, throughput=False,
    ).fit(module, DataLoader(data, batch_size=8 // devices))  # fmt: skip
    return module.norms


@pytest.mark.slow
def test_grad_norm_of_sharded_gradients_is_the_whole_gradients_norm(ranks):
    one = norms_of_a_fit()
    for ranks_norms in [result["norms"] for result in ranks]:
        assert len(ranks_norms) == len(one) == 2
        for mine, theirs in zip(ranks_norms, one):
            assert mine.keys() == theirs.keys() and "grad_2.0_norm/net.0.weight" in mine
            assert mine == pytest.approx(theirs, rel=1e-5)

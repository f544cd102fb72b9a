"""Ranks of a sequence-parallel group read the same samples; a sampler that splits them by global rank is stopped.

Under sp (and tp) the ranks of a group each run a share of ONE sample: the distributed sampler therefore
splits by data-parallel rank (strategy.data_parallel_rank over data_parallel_size), and the Trainer checks
on each epoch's first batch that the group holds the same batch. The planted bug: a user's own
DistributedSampler split by global rank (what every DDP script does) gives the two sp ranks different
samples; the run must stop before its first step, naming the ranks and the fix, rather than train each
rank's half of a different sample. The control (a plain DataLoader) trains, with one sampler replica.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.utils.data import DataLoader, DistributedSampler, TensorDataset

import shardwise
from shardwise import Trainer, TrainModule
from shardwise.models import GPT, Block, gpt_config
from shardwise.strategies import FSDPStrategy

CONFIG = dict(vocab_size=32, block_size=8, n_layer=1, n_head=2, n_kv_head=2, n_embd=16)


class TinyLM(TrainModule):
    def configure_model(self) -> None:
        if not hasattr(self, "model"):
            self.model = GPT(gpt_config("llama-tiny", **CONFIG))

    def training_step(self, batch):
        (tokens,) = batch
        logits = self.model(tokens[:, :-1])
        return F.cross_entropy(logits.flatten(0, 1), tokens[:, 1:].flatten())

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1)


def _fit(loader_for):
    dataset = TensorDataset(torch.arange(8 * 9).reshape(8, 9) % 32)
    trainer = Trainer(
        accelerator="cpu",
        devices=2,
        strategy=FSDPStrategy(auto_wrap_policy={Block}, sp_size=2),
        max_steps=2,
        logger=False,
        enable_progress_bar=False,
        enable_checkpointing=False,
    )
    trainer.fit(TinyLM(), loader_for(dataset))
    return trainer


def _worker():
    out = {}
    plain = _fit(lambda ds: DataLoader(ds, batch_size=2))
    sampler = plain.train_dataloader.sampler
    out["plain"] = (plain.global_step, sampler.num_replicas, plain.strategy.data_parallel_size)
    by_global_rank = lambda ds: DataLoader(  # noqa: E731
        ds, batch_size=2, sampler=DistributedSampler(ds, num_replicas=2, rank=dist.get_rank(), shuffle=False)
    )
    try:
        _fit(by_global_rank)
        out["planted"] = None
    except ValueError as error:
        out["planted"] = str(error)
    return out


def test_an_sp_group_reads_one_sample_and_a_sampler_split_by_global_rank_is_stopped():
    ranks = shardwise.launch(_worker, devices=2)
    for result in ranks:
        assert result["plain"] == (2, 1, 1)  # trained; the sampler has one replica: both ranks read every sample
        message = result["planted"]
        assert message is not None, "a sampler split by global rank trained silently under sp"
        assert "Ranks [0, 1] are one sequence/tensor-parallel group" in message
        assert "hold different batches" in message and "strategy.data_parallel_rank" in message

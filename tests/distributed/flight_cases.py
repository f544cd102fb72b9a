"""Planted desyncs for test_flight.py: what each rank runs under `shardwise.launch(planted, case, devices=3)`.

Every rank joins a gloo group, agrees on collective #1, then at collective #2
one rank (the planted one) does something else. The collective timeout is
long while the ranks start (a loaded machine) and TIMEOUT_S from #2 on, so a
hang ends quickly; the launcher's verdict must name the collective, that rank
and where it was.
"""

import datetime
import os
import time

import torch
import torch.distributed as dist

from shardwise import Callback, Trainer, TrainModule
from shardwise.distributed import progress

TIMEOUT_S = 2.0
_SHORT = datetime.timedelta(seconds=TIMEOUT_S)


def _collective_two(case: str, rank: int) -> None:
    if case == "skipped" and rank == 2:
        return  # skips this all_reduce
    if case == "wrong-shape" and rank == 1:
        dist.all_reduce(torch.ones(2))
    elif case == "other-op" and rank == 1:
        dist.all_gather([torch.zeros(4) for _ in range(dist.get_world_size())], torch.ones(4))
    elif case == "sleeping" and rank == 1:
        time.sleep(600)
    elif case == "dead" and rank == 1:
        os._exit(3)
    elif case == "raising" and rank == 1:
        raise ValueError("planted: rank 1 raises before all_reduce #2")
    elif case == "broadcast-src":
        dist.broadcast(torch.ones(4), src=1 if rank == 1 else 0)
    elif case == "barrier-rank0" and rank == 0:
        dist.barrier()
    elif case == "wrong-dtype" and rank == 1:
        dist.all_reduce(torch.ones(4, dtype=torch.float64))
    else:
        dist.all_reduce(torch.ones(4))


def planted(case: str) -> int:
    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=120))
    rank = dist.get_rank()
    dist.all_reduce(torch.ones(4))  # collective #1: every rank agrees
    dist.distributed_c10d._set_pg_timeout(_SHORT)
    progress.mark("training_step", 1)
    _collective_two(case, rank)
    dist.all_reduce(torch.ones(3))
    return rank


class _Model(TrainModule):
    def configure_model(self):
        self.net = torch.nn.Linear(4, 4)

    def training_step(self, batch, batch_idx):
        return self.net(batch).pow(2).mean()

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1)


class RankZeroReduce(Callback):
    """At step 2 rank 0's callback all-reduces a metric the other ranks never reduce."""

    def on_train_batch_start(self, trainer, module, batch, batch_idx):
        if trainer.global_step == 2:
            dist.distributed_c10d._set_pg_timeout(_SHORT)

    def on_train_batch_end(self, trainer, module, outputs, batch, batch_idx):
        if trainer.global_step == 2 and trainer.global_rank == 0:
            trainer.strategy.reduce(outputs["loss"] if isinstance(outputs, dict) else 1.0)


def callback_on_rank0() -> None:
    trainer = Trainer(
        accelerator="cpu",
        devices=3,
        strategy="fsdp",
        max_steps=6,
        callbacks=[RankZeroReduce()],
        logger=False,
        enable_progress_bar=False,
        enable_checkpointing=False,
        timeout_s=120,
    )
    trainer.fit(_Model(), [torch.ones(2, 4)] * 16)

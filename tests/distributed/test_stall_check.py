"""A collective only one rank reaches is named within seconds, by default, with the hook it came from.

A callback that runs a forward of an FSDP model on rank 0 only makes rank 0 all-gather alone; rank 1's
next forward pairs with it, and the ranks drift apart until both wait forever (torch's collective timeout
is 30 minutes). The stall check (distributed/faults.py) compares the ranks' flight records once no rank
has moved for a while and fails the run naming the first collective the ranks reached from different
code: the callback's on_train_epoch_end, file and line.
"""

from __future__ import annotations

import time

import pytest
import torch
from torch import nn

import shardwise
from shardwise import Callback, Trainer, TrainModule
from shardwise.distributed.faults import DEFAULT_STALL_S, STALL_ENV, stall_seconds
from shardwise.distributed.launch import WorkerFailedError


class Small(TrainModule):
    def configure_model(self) -> None:
        self.net = nn.Sequential(nn.Linear(4, 8), nn.Linear(8, 1))

    def forward(self, x):
        return self.net(x)

    def training_step(self, batch):
        return self(batch).pow(2).mean()

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1)


class RankZeroForward(Callback):
    def on_train_epoch_end(self, trainer, module) -> None:
        if trainer.global_rank == 0:
            module(torch.ones(2, 4))  # all-gathers the shards: rank 1 never joins


def fit_with_rank_zero_forward() -> None:
    trainer = Trainer(
        accelerator="cpu",
        devices=2,
        strategy="fsdp",
        max_epochs=2,
        callbacks=[RankZeroForward()],
        logger=False,
        enable_progress_bar=False,
        enable_checkpointing=False,
    )
    trainer.fit(Small(), torch.utils.data.DataLoader(torch.randn(8, 4), batch_size=2))


def test_stall_check_is_on_by_default_and_refuses_a_bad_value():
    assert stall_seconds({}) == DEFAULT_STALL_S > 0
    assert stall_seconds({STALL_ENV: "0"}) == 0
    with pytest.raises(ValueError, match=f"{STALL_ENV}='soon'.*0 turns the stall check off"):
        stall_seconds({STALL_ENV: "soon"})


def test_forward_on_rank_zero_only_in_a_callback_is_named_in_seconds(monkeypatch):
    # The check runs by default (above); a shorter wait keeps the test short, the path is the same.
    monkeypatch.setenv(STALL_ENV, "4")
    started = time.monotonic()
    with pytest.raises(WorkerFailedError) as err:
        shardwise.launch(fit_with_rank_zero_forward, devices=2)
    elapsed = time.monotonic() - started
    message = str(err.value)

    assert "CollectiveMismatchError" in message and "different collectives" in message
    first = message.splitlines()[0]
    assert "rank 0 called all_gather" in first, first
    # Where it began comes from each collective's Python stack; on a loaded machine the stacks can miss the
    # check's wait (seen once in a full suite run), and then the message says so instead of guessing.
    assert "from on_train_epoch_end (test_stall_check.py:" in first or "stacks were not read in time" in first, first
    assert "No rank moved for 4 s" in message  # the workers read the variable: this is the check's doing
    assert elapsed < 60, f"named after {elapsed:.0f} s"

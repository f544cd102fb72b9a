"""A callback hook and a module hook wrapped in rank_zero_only that call the model's forward, under FSDP.

Run on each of two ranks inside test_ports.py's launch (`rank_zero_runs`). Under FSDP that forward would
gather the shards on rank 0 alone, a collective rank 1 never joins; the Trainer gathers the parameters
on every rank around such a hook (trainer/hooks.py). The same fit runs twice, with and without the
hooks, so the test can ask that training after them computes bit for bit what it computes without them
(FSDP's reshard settings and prefetch record are put back), and what rank 0's forwards gave.
"""

from __future__ import annotations

import torch
from torch import nn

from shardwise import Callback, FSDPStrategy, Trainer, seed_everything
from shardwise.utilities import rank_zero_only

from helpers.checkpoints import Net, full_state, loader

X = torch.arange(16.0).reshape(2, 8) / 10


class Sampled(Net):
    def __init__(self) -> None:
        super().__init__(optimizer="adam")
        self.samples = []

    def forward(self, x):
        return self.net(x)

    @rank_zero_only
    def on_train_epoch_end(self) -> None:
        with torch.no_grad():
            self.samples.append(self(X).cpu())


class Sampler(Callback):
    def __init__(self) -> None:
        self.samples = []

    @rank_zero_only
    def on_train_epoch_end(self, trainer, pl_module) -> None:
        with torch.no_grad():  # two forwards: the second must not gather again either
            self.samples.append((pl_module(X).cpu(), pl_module(X).cpu()))


def rank_zero_runs() -> dict:
    """This rank's samples from both hooks, the trained weights (whole) with and without the hooks, and
    what the whole trained model gives for X."""
    out = {}
    for hooks in (True, False):
        seed_everything(0)
        module, sampler = (Sampled(), Sampler()) if hooks else (Net(optimizer="adam"), None)
        trainer = Trainer(
            accelerator="cpu",
            devices=2,
            strategy=FSDPStrategy(auto_wrap_policy={nn.Linear}),  # three units: the Linears and the root
            max_epochs=2,
            limit_train_batches=2,
            logger=False,
            enable_progress_bar=False,
            enable_checkpointing=False,
            callbacks=[sampler] if sampler else [],
        )
        trainer.fit(module, loader())
        out["state" if hooks else "state_without_hooks"] = full_state(trainer)["model"]
        if hooks:
            out["module"], out["callback"] = module.samples, sampler.samples
    whole = Net()
    whole.configure_model()
    whole.load_state_dict(out["state"])
    with torch.no_grad():
        out["expected"] = whole.net(X)
    return out

"""A callback hook and a module hook wrapped in rank_zero_only that call the model's forward, under FSDP.

Run on each of two ranks inside test_ports.py's launch (`rank_zero_runs`). Under FSDP that forward would
gather the shards on rank 0 alone, a collective rank 1 never joins; around such a hook rank 1 joins the
all-gathers of the units rank 0's forward goes through, as rank 0 names them (trainer/hooks.py,
fsdp_compat.gather_for_rank_zero). A third marked hook runs no forward, and all-gathers are counted on
each rank around the marked callbacks, so the test can ask that it gathered nothing and that the forwards
gathered the same units on both ranks. The same fit runs twice, with and without the hooks, so the test
can ask that training after them computes bit for bit what it computes without them (FSDP's reshard
settings and prefetch record are put back), and what rank 0's forwards gave.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
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
        with torch.no_grad():  # two forwards, each gathering the units it goes through
            self.samples.append((pl_module(X).cpu(), pl_module(X).cpu()))


class Quiet(Callback):
    """A marked hook that only records (prints, logs): it must gather nothing on any rank."""

    def __init__(self) -> None:
        self.steps = []

    @rank_zero_only
    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        self.steps.append(trainer.global_step)


class Counted(Callback):
    """Opens (`closes=False`) or closes a window around the callbacks between two instances of it, counting
    the all-gathers this rank issues inside (the real collective runs: the count only wraps it)."""

    def __init__(self, window: dict, closes: bool) -> None:
        self.window, self.closes = window, closes

    def _edge(self, hook: str) -> None:
        if not self.closes:
            original, counter = dist.all_gather_single, [0]

            def counting(*args, **kwargs):
                counter[0] += 1
                return original(*args, **kwargs)

            self.window["open"] = original, counter
            dist.all_gather_single = counting
        else:
            original, counter = self.window.pop("open")
            dist.all_gather_single = original
            self.window.setdefault(hook, []).append(counter[0])

    def on_train_batch_end(self, *args) -> None:
        self._edge("on_train_batch_end")

    def on_train_epoch_end(self, *args) -> None:
        self._edge("on_train_epoch_end")


def rank_zero_runs() -> dict:
    """This rank's samples from both hooks, the steps Quiet saw, the all-gathers counted around each marked
    callback hook, the trained weights (whole) with and without the hooks, and what the whole trained model
    gives for X."""
    out = {}
    for hooks in (True, False):
        seed_everything(0)
        module, sampler = (Sampled(), Sampler()) if hooks else (Net(optimizer="adam"), None)
        quiet, window = Quiet(), {}
        # Sampler's hook (epoch end) runs two forwards, Quiet's (batch end) none, each counted on its own.
        callbacks = [Counted(window, closes=False), sampler, quiet, Counted(window, closes=True)] if hooks else []
        trainer = Trainer(
            accelerator="cpu",
            devices=2,
            strategy=FSDPStrategy(auto_wrap_policy={nn.Linear}),  # three units: the Linears and the root
            max_epochs=2,
            limit_train_batches=2,
            logger=False,
            enable_progress_bar=False,
            enable_checkpointing=False,
            callbacks=callbacks,
        )
        trainer.fit(module, loader())
        out["state" if hooks else "state_without_hooks"] = full_state(trainer)["model"]
        if hooks:
            out["module"], out["callback"] = module.samples, sampler.samples
            out["quiet"], out["all_gathers"] = quiet.steps, window
    whole = Net()
    whole.configure_model()
    whole.load_state_dict(out["state"])
    with torch.no_grad():
        out["expected"] = whole.net(X)
    return out

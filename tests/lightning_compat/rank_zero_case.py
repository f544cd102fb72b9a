"""A callback hook and a module hook wrapped in rank_zero_only that call the model's forward, under FSDP.

Run on each of two ranks inside test_ports.py's launch (`rank_zero_runs`). Under FSDP that forward would
gather the shards on rank 0 alone, a collective rank 1 never joins; around such a hook rank 1 joins the
all-gathers of the units rank 0's forward goes through, as rank 0 names them (trainer/hooks.py,
fsdp_compat.gather_for_rank_zero). A third marked hook runs no forward, and all-gathers are counted on
each rank around the marked callbacks, so the test can ask that it gathered nothing and that the forwards
gathered the same units on both ranks; after fit, a marked hook raises in the middle of a forward and
the next one still samples with every rank in step. Under FULL_SHARD and SHARD_GRAD_OP, the same fit runs
twice, with and without the hooks, so the test can ask that training after them computes bit for bit what
it computes without them (FSDP's reshard settings and prefetch record are put back), and what rank 0's
forwards gave.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn

from shardwise import Callback, FSDPStrategy, Trainer, seed_everything
from shardwise.trainer.hooks import call_callbacks
from shardwise.utilities import rank_zero_only

from helpers.checkpoints import Net, full_state, loader

X = torch.arange(16.0).reshape(2, 8) / 10


class Validated(Net):
    def __init__(self) -> None:
        super().__init__(optimizer="adam")

    def forward(self, x):
        return self.net(x)

    def validation_step(self, batch, batch_idx):
        x, y = batch
        self.log("val_loss", torch.nn.functional.cross_entropy(self(x), y))


class Sampled(Validated):
    def __init__(self) -> None:
        super().__init__()
        self.samples = []

    @rank_zero_only
    def on_train_epoch_end(self) -> None:
        with torch.no_grad():
            self.samples.append(self(X).cpu())


class Sampler(Callback):
    def __init__(self) -> None:
        self.samples, self.val_samples = [], []

    @rank_zero_only
    def on_train_epoch_end(self, trainer, pl_module) -> None:
        with torch.no_grad():  # two forwards, each gathering the units it goes through
            self.samples.append((pl_module(X).cpu(), pl_module(X).cpu()))

    @rank_zero_only
    def broken_sample(self, trainer, pl_module) -> None:
        """Called by one_sharding after fit: the first Linear refuses 5 features, in the middle of a forward."""
        pl_module(torch.zeros(2, 5))

    @rank_zero_only
    def sample_after_error(self, trainer, pl_module) -> None:
        with torch.no_grad():
            self.samples.append((pl_module(X).cpu(),))

    @rank_zero_only
    def on_validation_epoch_end(self, trainer, pl_module) -> None:
        with torch.no_grad():  # after validation's forwards: units FSDP keeps whole stay so, on every rank
            self.val_samples.append(pl_module(X).cpu())


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

    def on_validation_epoch_end(self, *args) -> None:
        self._edge("on_validation_epoch_end")

    def broken_sample(self, *args) -> None:
        self._edge("broken_sample")

    def sample_after_error(self, *args) -> None:
        self._edge("sample_after_error")


def rank_zero_runs() -> dict:
    """What `one_sharding` gives for FULL_SHARD (units sharded again after each forward) and SHARD_GRAD_OP
    (units kept whole after a forward until backward: after validation's forwards some are whole on every
    rank when the hook starts, which rank 0's forward must not gather nor reshard)."""
    return {sharding: one_sharding(sharding) for sharding in ("FULL_SHARD", "SHARD_GRAD_OP")}


def one_sharding(sharding: str) -> dict:
    """This rank's samples from the hooks, the steps Quiet saw, the all-gathers counted around each marked
    callback hook, the trained weights (whole) and the last validation loss with and without the hooks, and
    what the whole trained model gives for X."""
    out = {}
    for hooks in (True, False):
        seed_everything(0)
        module, sampler = (Sampled(), Sampler()) if hooks else (Validated(), None)
        quiet, window = Quiet(), {}
        # Sampler's hooks run forwards, Quiet's (batch end) none, each counted on its own.
        callbacks = [Counted(window, closes=False), sampler, quiet, Counted(window, closes=True)] if hooks else []
        trainer = Trainer(
            accelerator="cpu",
            devices=2,
            # three units: the Linears and the root (its LayerNorm)
            strategy=FSDPStrategy(auto_wrap_policy={nn.Linear}, sharding_strategy=sharding),
            max_epochs=2,
            limit_train_batches=2,
            limit_val_batches=1,
            logger=False,
            enable_progress_bar=False,
            enable_checkpointing=False,
            callbacks=callbacks,
        )
        trainer.fit(module, loader(), loader())
        if hooks:  # a marked hook that raises in the middle of a forward, then one that samples
            try:
                call_callbacks(trainer, "broken_sample")
            except RuntimeError as error:
                out["error"] = str(error)
                callbacks[-1].broken_sample()  # close the count the error skipped
            call_callbacks(trainer, "sample_after_error")
        out["state" if hooks else "state_without_hooks"] = full_state(trainer)["model"]
        out["val_loss" if hooks else "val_loss_without_hooks"] = float(trainer.callback_metrics["val_loss"])
        if hooks:
            out["module"], out["callback"] = module.samples, sampler.samples
            out["quiet"], out["all_gathers"], out["validation"] = quiet.steps, window, sampler.val_samples
    whole = Net()
    whole.configure_model()
    whole.load_state_dict(out["state"])
    with torch.no_grad():
        out["expected"] = whole.net(X)
    return out

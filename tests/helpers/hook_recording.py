"""Record which hooks a trainer calls, in order, with a summary of their arguments.

The same code records real Lightning (tests/fixtures/record_lightning_hooks.py, run once
outside the suite) and shardwise (tests/unit/test_lightning_hooks.py): `framework` is a
namespace with `LightningModule`, `Callback` and `Trainer` from either package, and the
module below uses only what both offer. Every hook named is wrapped to append
{"who", "hook", "args"[, "kwargs"]} to CALLS before calling the class's own.
"""

from __future__ import annotations

import torch
from torch.utils.data import DataLoader, TensorDataset

CALLS: list = []

# Trainer arguments both frameworks take, for every recorded run.
TRAINER_KWARGS = dict(
    accelerator="cpu",
    devices=1,
    max_epochs=2,
    logger=False,
    enable_checkpointing=False,
    enable_progress_bar=False,
)


def summary(x):
    """An argument as the recording keeps it: its kind, or its value for plain numbers and strings."""
    if isinstance(x, torch.Tensor):
        return "Tensor"
    if isinstance(x, (list, tuple)) and x and all(isinstance(t, torch.Tensor) for t in x):
        return "batch"
    if isinstance(x, torch.optim.Optimizer) or (hasattr(x, "param_groups") and hasattr(x, "step")):
        return "Optimizer"  # Lightning's LightningOptimizer and our ClosureOptimizer alike
    if isinstance(x, dict):
        return "dict"
    if isinstance(x, BaseException):
        return "exception"
    if isinstance(x, (int, str, float, bool)) or x is None:
        return x
    if isinstance(x, torch.device):
        return "device"
    if callable(x) and not isinstance(x, torch.nn.Module):
        return "Closure"
    return type(x).__name__


def _recorder(owner: str, name: str, skip: int, cls: list):
    def method(self, *args, **kwargs):
        entry = {"who": owner, "hook": name, "args": [summary(a) for a in args[skip:]]}
        if kwargs:
            entry["kwargs"] = {k: summary(v) for k, v in kwargs.items()}
        CALLS.append(entry)
        return getattr(super(cls[0], self), name)(*args, **kwargs)  # the recording class's parent's hook

    method.__name__ = name
    return method


def module_class(framework):
    """A small regression module with validation, test and predict, its data built in setup()."""

    class Reference(framework.LightningModule):
        def __init__(self):
            super().__init__()
            self.layer = torch.nn.Linear(4, 2)

        def setup(self, stage):
            g = torch.Generator().manual_seed(0)
            self.data = TensorDataset(torch.randn(8, 4, generator=g), torch.randn(8, 2, generator=g))

        def train_dataloader(self):
            return DataLoader(self.data, batch_size=4)

        def val_dataloader(self):
            return DataLoader(self.data, batch_size=4)

        def test_dataloader(self):
            return DataLoader(self.data, batch_size=4)

        def predict_dataloader(self):
            return DataLoader(self.data, batch_size=4)

        def training_step(self, batch, batch_idx):
            x, y = batch
            return torch.nn.functional.mse_loss(self.layer(x), y)

        def validation_step(self, batch, batch_idx):
            x, y = batch
            self.log("val_loss", torch.nn.functional.mse_loss(self.layer(x), y))

        def test_step(self, batch, batch_idx):
            x, y = batch
            self.log("test_loss", torch.nn.functional.mse_loss(self.layer(x), y))

        def predict_step(self, batch, batch_idx):
            return self.layer(batch[0])

        def configure_optimizers(self):
            opt = torch.optim.SGD(self.parameters(), lr=0.1)
            sched = torch.optim.lr_scheduler.ReduceLROnPlateau(opt)
            return {"optimizer": opt, "lr_scheduler": {"scheduler": sched, "monitor": "val_loss"}}

    return Reference


def recording_classes(framework, module_hooks, callback_hooks):
    """(Module, Callback) classes that record the named hooks."""
    module_cls: list = []
    callback_cls: list = []
    base = module_class(framework)
    module_cls.append(type("Module", (base,), {h: _recorder("module", h, 0, module_cls) for h in module_hooks}))
    callback_cls.append(
        type("Recorder", (framework.Callback,), {h: _recorder("callback", h, 2, callback_cls) for h in callback_hooks})
    )
    return module_cls[0], callback_cls[0]


def record(framework, what, module_hooks, callback_hooks, **trainer_kwargs):
    """The calls of one `what` ("fit", "validate", "test", "predict") run, as a list of dicts."""
    module_cls, callback_cls = recording_classes(framework, module_hooks, callback_hooks)
    CALLS.clear()
    module = module_cls()
    trainer = framework.Trainer(**{**TRAINER_KWARGS, "callbacks": [callback_cls()], **trainer_kwargs})
    getattr(trainer, what)(module)
    return list(CALLS)

"""How the loop calls hooks cheaply (trainer/hooks.py): ModuleHooks' empty defaults are not called, the
callbacks' hooks are looked up once per list of callbacks, and neither changes what runs."""

import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from shardwise import Trainer, TrainModule
from shardwise.trainer import hooks


def test_only_the_empty_defaults_are_skipped():
    empty = set(hooks._EMPTY_DEFAULTS)
    assert {"on_train_batch_start", "on_train_batch_end", "on_before_backward", "on_after_backward"} <= empty
    # Defaults that do something are always called.
    assert not empty & {"optimizer_step", "optimizer_zero_grad", "configure_gradient_clipping",
                        "transfer_batch_to_device", "on_before_batch_transfer", "lr_scheduler_step"}  # fmt: skip


class _Net(TrainModule):
    def __init__(self):
        super().__init__()
        self.net = nn.Linear(4, 1)
        self.ends = 0

    def training_step(self, batch, batch_idx):
        return self.net(batch[0]).square().mean()

    def on_train_batch_end(self, outputs, batch, batch_idx):  # overridden: called
        self.ends += 1

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1)


class _Count:
    def __init__(self):
        self.n = 0

    def on_train_batch_end(self, trainer, module, outputs, batch, batch_idx):
        self.n += 1
        if trainer.global_step == 2:  # a callback added during the run is called from the next batch on
            trainer.callbacks.append(late)


late = _Count()


def test_callbacks_added_or_replaced_are_called():
    first = _Count()
    trainer = Trainer(accelerator="cpu", devices=1, max_steps=4, logger=False, enable_progress_bar=False,
                      enable_checkpointing=False, callbacks=[first])  # fmt: skip
    module = _Net()
    data = DataLoader(TensorDataset(torch.randn(16, 4)), batch_size=2)
    trainer.fit(module, data)
    assert (first.n, late.n, module.ends) == (4, 2, 4)
    calls = []
    first.on_train_batch_end = lambda *args: calls.append(args[-1])  # replaced between fits: the new one runs
    trainer.max_steps = 6
    trainer.fit(module, data)
    assert calls == [4, 5]


def test_a_hook_that_is_not_a_method_of_the_class_is_called():
    # Set on the instance, a hook is a plain function (no __func__): it runs whether ModuleHooks' default of
    # that name is empty (on_train_batch_start) or does something (on_test_model_eval puts the model in eval).
    class Tested(_Net):
        def test_step(self, batch, batch_idx):
            return self.net(batch[0]).sum()

    module, seen = Tested(), []
    module.on_train_batch_start = lambda batch, batch_idx: seen.append(batch_idx)
    module.on_test_model_eval = lambda: seen.append("eval")
    # Hooks the loop calls only when the module has its own: the instance's count too.
    module.on_before_backward = lambda loss: seen.append("backward")
    module.optimizer_zero_grad = lambda epoch, batch_idx, optimizer: seen.append("zero_grad")
    trainer = Trainer(accelerator="cpu", devices=1, max_steps=2, logger=False, enable_progress_bar=False,
                      enable_checkpointing=False)  # fmt: skip
    data = DataLoader(TensorDataset(torch.randn(8, 4)), batch_size=2)
    trainer.fit(module, data)
    trainer.test(module, data, verbose=False)
    assert seen == [0, "zero_grad", "backward", 1, "zero_grad", "backward", "eval"]

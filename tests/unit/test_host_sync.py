"""A training step must not read device values back to the host except where the user asked.

On a GPU, turning a device tensor into a Python number waits for all queued work, which costs
FSDP its overlap of communication with compute. The loop is run under a torch function mode that
sees every host read (float(), .item(), .tolist(), bool(), .cpu(), ...), so the test works on CPU.
"""

from collections import Counter

import torch
import torch.nn.functional as F
from torch import nn
from torch.overrides import TorchFunctionMode
from torch.utils.data import DataLoader, TensorDataset

from shardwise import Trainer, TrainModule

_READS = {"__float__", "__int__", "__bool__", "__index__", "item", "tolist", "numpy", "cpu"}


class _HostReads(TorchFunctionMode):
    """Counts host reads per training batch (batch -1: outside any batch)."""

    def __init__(self):
        super().__init__()
        self.batch = -1
        self.reads = Counter()

    def __torch_function__(self, func, types, args=(), kwargs=None):
        if getattr(func, "__name__", "") in _READS:
            self.reads[self.batch] += 1
        return func(*args, **(kwargs or {}))


class _Mark:
    def __init__(self, mode):
        self.mode = mode

    def on_train_batch_start(self, trainer, module, batch, batch_idx):
        self.mode.batch = batch_idx

    # A batch's reads run until the next batch starts: its values go to the loggers after
    # on_train_batch_end (Lightning's order, so that what that hook logs goes with them).
    def on_train_end(self, trainer, module):
        self.mode.batch = -1


class _Logs(TrainModule):
    def __init__(self):
        super().__init__()
        self.net = nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 3))
        self.seen = []  # (acc, peak) per batch, as tensors

    def training_step(self, batch, batch_idx):
        x, y = batch
        logits = self.net(x)
        loss = F.cross_entropy(logits, y)
        self.log("loss", loss, prog_bar=True)
        self.log("acc", (logits.argmax(-1) == y).float().mean(), on_step=True, on_epoch=True)
        self.log("lr", 0.1)  # a Python number
        self.log("peak", logits.abs().max(), on_step=False, on_epoch=True, reduce_fx="max")
        self.seen.append(((logits.argmax(-1) == y).float().mean().detach(), logits.abs().max().detach()))
        return loss

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1)


class _Collect:
    """A logger that keeps what it was given (it must be given Python floats)."""

    def __init__(self):
        self.rows = []
        self.name, self.version, self.save_dir, self.log_dir = "collect", 0, None, None

    def log_metrics(self, metrics, step=None):
        self.rows.append((step, dict(metrics)))

    def log_hyperparams(self, params):
        pass


def _fit(non_finite, accumulate=1):
    g = torch.Generator().manual_seed(0)
    data = TensorDataset(torch.randn(96, 8, generator=g), torch.randint(0, 3, (96,), generator=g))
    mode = _HostReads()
    logger = _Collect()
    trainer = Trainer(
        accelerator="cpu",
        devices=1,
        max_epochs=1,
        log_every_n_steps=4,
        non_finite=non_finite,
        accumulate_grad_batches=accumulate,
        logger=logger,
        enable_progress_bar=False,
        enable_checkpointing=False,
        callbacks=[_Mark(mode)],
    )
    module = _Logs()
    with mode:
        trainer.fit(module, DataLoader(data, batch_size=8))
    trainer.seen = module.seen
    return trainer, mode.reads, logger.rows


def test_steps_between_log_steps_read_nothing_back_without_the_health_check():
    trainer, reads, rows = _fit("off")
    # 12 batches; the loggers are due after optimizer steps 1, 4, 8 and 12 (batches 0, 3, 7, 11).
    due = {0, 3, 7, 11}
    quiet = {b: n for b, n in reads.items() if b >= 0 and b not in due}
    assert quiet == {}, f"host reads in batches that log nothing: {quiet}"
    assert all(reads[b] > 0 for b in due)  # the logged values did reach the host when due
    assert [step for step, _ in rows if "loss" in _] == [1, 4, 8, 12]
    assert all(type(v) is float for _, row in rows for v in row.values())
    # Lightning's names: a value logged per step and per epoch is also acc_step / acc_epoch to callbacks.
    assert set(trainer.callback_metrics) == {"loss", "acc", "acc_step", "acc_epoch", "lr", "peak"}
    assert all(type(v) is float for v in trainer.callback_metrics.values())


def test_the_health_check_costs_one_read_per_optimizer_step_not_per_micro_batch():
    _, off, _ = _fit("off", accumulate=2)
    _, on, _ = _fit("error", accumulate=2)
    # 12 micro-batches = 6 optimizer steps, the last micro-batch of each window (1, 3, 5, ...).
    extra = {b: on[b] - off.get(b, 0) for b in range(12)}
    assert extra == {b: (1 if b % 2 == 1 else 0) for b in range(12)}


def test_epoch_values_are_the_mean_and_max_of_the_step_values():
    trainer, _, rows = _fit("off")
    accs = torch.stack([a for a, _ in trainer.seen])
    peaks = torch.stack([p for _, p in trainer.seen])
    epoch = [row for _, row in rows if "acc_epoch" in row]
    assert len(epoch) == 1 and abs(epoch[0]["acc_epoch"] - accs.mean().item()) < 1e-6
    assert trainer.callback_metrics["peak"] == peaks.max().item()
    assert trainer.logged_metrics["peak"] == trainer.callback_metrics["peak"]
    assert trainer.callback_metrics["acc"] == epoch[0]["acc_epoch"]

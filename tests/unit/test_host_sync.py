"""A training step must not read device values back to the host except where the user asked.

On a GPU, turning a device tensor into a Python number waits for all queued work, which costs
FSDP its overlap of communication with compute and the CPU its run-ahead. The loop is run under a
torch function mode that sees every host read (float(), .item(), .tolist(), bool(), .cpu(), ...),
so the test works on CPU. The health check's verdict reaches the host by a non-blocking copy into
host memory and is read from there a step later (trainer/nonfinite.py); the tests below also check
what that delay must not cost: the step and rank are named, nothing non-finite is ever saved, and
'skip' still drops the bad update.
"""

import os
import signal
from collections import Counter

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.overrides import TorchFunctionMode
from torch.utils.data import DataLoader, TensorDataset

from shardwise import ModelCheckpoint, Trainer, TrainModule
from shardwise.checkpoint import layout
from shardwise.health import NonFiniteError
from shardwise.trainer.nonfinite import ZeroGradientError

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


def test_the_health_check_reads_nothing_back_between_log_steps():
    _, off, _ = _fit("off", accumulate=2)
    trainer, on, _ = _fit("error", accumulate=2)
    # 12 micro-batches = 6 optimizer steps. The verdict of each step is copied to host memory without a
    # read and acted on a step later (trainer/nonfinite.py): no batch reads more than with the check off.
    extra = {b: on[b] - off.get(b, 0) for b in range(12)}
    # Warm-up: the first step makes the host buffer (its numpy view is the one counted read).
    assert extra == {b: 1 if b == 1 else 0 for b in range(12)}
    # Read before its own update only where the step's values are read anyway: log steps 1 and 4.
    assert trainer.health.read_at_own_step == [1, 4]
    skipping, _, _ = _fit("skip", accumulate=2)  # 'skip' must decide before the update: every step
    assert skipping.health.read_at_own_step == [1, 2, 3, 4, 5, 6]


class _Planted(TrainModule):
    """A NaN loss, an infinite gradient or a loss times 0 at optimizer step `at` (1-based)."""

    def __init__(self, at, how):
        super().__init__()
        self.at, self.how = at, how
        self.net = nn.Linear(4, 2)

    def training_step(self, batch, batch_idx):
        loss = self.net(batch[0]).square().mean()
        if self.trainer.global_step + 1 == self.at:
            if self.how == "nan":
                loss = loss * float("nan")
            elif self.how == "inf_grad":  # sqrt's derivative at 0
                loss = loss + torch.sqrt(self.net.weight[0, 0] * 0)
            else:
                loss = loss * 0.0
        return loss

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1)


def _planted(tmp_path, at, how="nan", non_finite="error", steps=8, every=None):
    callbacks = [ModelCheckpoint(dirpath=str(tmp_path), every_n_train_steps=every)] if every else []
    trainer = Trainer(
        accelerator="cpu",
        devices=1,
        max_steps=steps,
        log_every_n_steps=4,
        non_finite=non_finite,
        logger=False,
        enable_progress_bar=False,
        enable_checkpointing=bool(every),
        default_root_dir=str(tmp_path),
        callbacks=callbacks,
    )
    data = TensorDataset(torch.randn(16, 4, generator=torch.Generator().manual_seed(0)))
    return trainer, lambda: trainer.fit(_Planted(at, how), DataLoader(data, batch_size=2))


def _last_step(tmp_path):
    return layout.read_manifest(os.path.realpath(tmp_path / "last.ckpt"))["global_step"]


def test_a_late_verdict_names_its_step_and_stops_before_the_next_update(tmp_path):
    trainer, fit = _planted(tmp_path, at=5)
    with pytest.raises(NonFiniteError) as err:
        fit()
    message = str(err.value)
    assert "optimizer step 5 (epoch 0): rank 0: the loss of batch_idx 4 (nan)" in message
    assert "Found before step 6's update" in message and "trainer.global_step is 5" in message
    assert trainer.global_step == 5 and trainer.nonfinite_step == 5  # step 6 was not taken
    # Without the loss to blame, the kept gradient norm names the parameter.
    _, fit = _planted(tmp_path / "inf", at=3, how="inf_grad")
    with pytest.raises(NonFiniteError, match=r"step 3 .*the gradient of net.weight \(its norm is (nan|inf)\)"):
        fit()
    _, fit = _planted(tmp_path / "zero", at=6, how="zero")
    with pytest.raises(ZeroGradientError, match=r"zero at optimizer step 6 .*2 gradient tensor\(s\), 10 "):
        fit()


def test_a_late_verdict_is_read_before_a_checkpoint_and_before_fit_ends(tmp_path):
    # A checkpoint after every step: step 5's verdict is read before step 5 is written.
    trainer, fit = _planted(tmp_path, at=5, every=1)
    with pytest.raises(NonFiniteError, match="step 5 .*Found before a checkpoint is written"):
        fit()
    assert _last_step(tmp_path) == 4
    # 'warn' takes the step; ModelCheckpoint then never saves it or a later one.
    trainer, fit = _planted(tmp_path / "warn", at=5, non_finite="warn", every=1)
    with pytest.warns(UserWarning, match=r"not saving step 5 or later: non-finite values were seen at step 5"):
        fit()
    assert trainer.global_step == 8 and _last_step(tmp_path / "warn") == 4
    # The last step (7 is no log step) is checked before fit returns.
    _, fit = _planted(tmp_path / "end", at=7, steps=7)
    with pytest.raises(NonFiniteError, match="step 7 .*Found at the end of fit"):
        fit()


def test_skip_reads_before_the_update_and_drops_it(tmp_path):
    trainer, fit = _planted(tmp_path, at=5, non_finite="skip")
    with pytest.warns(UserWarning, match=r"step 5: rank 0: the loss of batch_idx 4 \(nan\)\. The step was skipped"):
        fit()
    assert trainer.global_step == 8  # a skipped step counts, as GradScaler's do
    assert all(torch.isfinite(p).all() for p in trainer.lightning_module.parameters())


def test_epoch_values_are_the_mean_and_max_of_the_step_values():
    trainer, _, rows = _fit("off")
    accs = torch.stack([a for a, _ in trainer.seen])
    peaks = torch.stack([p for _, p in trainer.seen])
    epoch = [row for _, row in rows if "acc_epoch" in row]
    assert len(epoch) == 1 and abs(epoch[0]["acc_epoch"] - accs.mean().item()) < 1e-6
    assert trainer.callback_metrics["peak"] == peaks.max().item()
    assert trainer.logged_metrics["peak"] == trainer.callback_metrics["peak"]
    assert trainer.callback_metrics["acc"] == epoch[0]["acc_epoch"]


# ------------------------------------------------------------------ two ranks (gloo)
# On CPU the step's all-reduce is left in flight and waited for a step later (nonfinite._all_reduce_sum):
# what one rank sees must still stop every rank at the same step, name that rank, and never be saved.
class _PlantedOnRank(_Planted):
    """A NaN loss on global rank 1 only, at optimizer step `at`."""

    def training_step(self, batch, batch_idx):
        loss = self.net(batch[0]).square().mean()
        if self.trainer.global_rank == 1 and self.trainer.global_step + 1 == self.at:
            loss = loss * float("nan")
        return loss


class _SignalledOnRank(_Planted):
    """Rank 1 alone receives a preemption signal (its handler's flag is set) during optimizer step `at`."""

    def training_step(self, batch, batch_idx):
        if self.trainer.global_rank == 1 and self.trainer.global_step + 1 == self.at:
            self.trainer._preemption.flag.signal = signal.SIGUSR1
        return self.net(batch[0]).square().mean()


def _two_ranks(root):
    import torch.distributed as dist

    data = TensorDataset(torch.randn(32, 4, generator=torch.Generator().manual_seed(0)))
    preempted = Trainer(accelerator="cpu", devices=2, strategy="ddp", max_steps=8, log_every_n_steps=4,
                        logger=False, enable_progress_bar=False, enable_checkpointing=False)  # fmt: skip
    try:
        preempted.fit(_SignalledOnRank(2, "signal"), DataLoader(data, batch_size=2))
    except SystemExit as exc:  # the preempted run's exit code, for the job script
        assert exc.code == 75
    # non_finite='off': no health check, but the ranks still agree on the vote, on the same schedule
    # (summed in flight, read a step later) and without a host read of its own at every step.
    reads = _HostReads()
    unchecked = Trainer(accelerator="cpu", devices=2, strategy="ddp", max_steps=10, log_every_n_steps=4,
                        logger=False, enable_progress_bar=False, enable_checkpointing=False, non_finite="off",
                        callbacks=[_Mark(reads)])  # fmt: skip
    try:
        with reads:
            unchecked.fit(_SignalledOnRank(5, "signal"), DataLoader(data, batch_size=2))
    except SystemExit as exc:
        assert exc.code == 75
    trainer = Trainer(
        accelerator="cpu",
        devices=2,
        strategy="ddp",
        max_steps=5,
        log_every_n_steps=4,
        logger=False,
        enable_progress_bar=False,
        default_root_dir=root,
        callbacks=[ModelCheckpoint(dirpath=root, every_n_train_steps=1)],
    )
    try:
        trainer.fit(_PlantedOnRank(3, "nan"), DataLoader(data, batch_size=2))  # step 3 is no log step
        message = None
    except NonFiniteError as exc:
        message = str(exc)
    if dist.is_initialized():
        dist.destroy_process_group()
    return (preempted.global_step, unchecked.global_step, dict(reads.reads)), (
        trainer.global_step,
        trainer.nonfinite_step,
        trainer.health.read_at_own_step,
        message,
    )


def test_two_ranks_agree_on_a_verdict_read_a_step_later(tmp_path):
    import shardwise

    for (preempted_at, unchecked_at, reads), (step, bad_step, read_at_own_step, message) in shardwise.launch(
        _two_ranks, str(tmp_path), devices=2
    ):
        # The vote of step 2 (rank 1 signalled) is summed in flight and read before step 3's update: every
        # rank finishes step 3 and stops there.
        assert preempted_at == 3
        # The same under non_finite='off' (signalled in step 5: every rank stops after step 6), and the batches
        # that log nothing read nothing (batch 0 is step 1, a log step, which also makes the host buffer).
        assert unchecked_at == 6
        assert {b: n for b, n in reads.items() if b in (1, 2, 4, 5) and n} == {}, reads
        assert (step, bad_step, read_at_own_step) == (3, 3, [1])  # every rank stops before step 4's update
        assert "Non-finite values at optimizer step 3 (epoch 0): " in message
        assert "rank 1: the loss of batch_idx 2 (nan)" in message  # (DDP spread it to rank 0's gradients)
        assert "Found before a checkpoint is written" in message
    assert _last_step(tmp_path) == 2  # step 3 was never saved

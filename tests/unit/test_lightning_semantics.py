"""What Lightning's hooks, self.log, schedulers and EarlyStopping mean, here (issue 24 items 1, 3, 5).

Where a number is asserted, it is what Lightning 2.6.6 gives for the same module (checked by
running both; the hook order itself is tests/unit/test_lightning_hooks.py).
"""

from __future__ import annotations

import inspect
import math
import warnings

import pytest
import torch
from torch.utils.data import DataLoader, TensorDataset

import shardwise
from shardwise import Callback, DataModule, EarlyStopping, ModelCheckpoint, Trainer, TrainModule

QUIET = dict(accelerator="cpu", devices=1, logger=False, enable_checkpointing=False, enable_progress_bar=False)
if "num_sanity_val_steps" in inspect.signature(Trainer).parameters:
    QUIET["num_sanity_val_steps"] = 0  # the validations asserted here are the loop's own


def _loader(n=8, batch_size=4, seed=0):
    g = torch.Generator().manual_seed(seed)
    return DataLoader(
        TensorDataset(torch.randn(n, 2, generator=g), torch.randn(n, 1, generator=g)), batch_size=batch_size
    )


class Linear(TrainModule):
    def __init__(self, lr=0.1):
        super().__init__()
        self.lr = lr
        self.layer = torch.nn.Linear(2, 1)

    def training_step(self, batch, batch_idx):
        x, y = batch
        return torch.nn.functional.mse_loss(self.layer(x), y)

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=self.lr)


class Rows:
    """A logger that keeps every row it is given."""

    def __init__(self):
        self.rows = []

    def log_metrics(self, metrics, step=None):
        self.rows.append((step, dict(metrics)))

    def log_hyperparams(self, params):
        pass


# ------------------------------------------------------------------------------------ self.log
class Logs(Linear):
    def training_step(self, batch, batch_idx):
        self.log("both", float(batch_idx), on_step=True, on_epoch=True, prog_bar=True)
        self.log("hidden", float(batch_idx), logger=False, prog_bar=True)
        self.log("hidden_both", float(batch_idx), logger=False, on_step=True, on_epoch=True)
        return super().training_step(batch, batch_idx)

    def validation_step(self, batch, batch_idx):
        self.log("v", float(batch[0].shape[0]))
        self.log("v_hidden", 1.0, logger=False)

    def on_train_batch_end(self, outputs, batch, batch_idx):
        self.log("batch_end", 2.0)

    def on_train_epoch_end(self):
        self.log("ep_end", 3.0)


def test_logger_false_reaches_callbacks_and_the_progress_bar_but_never_a_logger():
    rows = Rows()
    trainer = Trainer(**{**QUIET, "logger": rows, "max_epochs": 1, "log_every_n_steps": 1})
    data = TensorDataset(torch.randn(5, 2), torch.randn(5, 1))
    trainer.fit(Logs(), DataLoader(data, batch_size=2), DataLoader(data, batch_size=4))
    logged = {name for _, row in rows.rows for name in row}
    assert not {"hidden", "hidden_step", "hidden_both_step", "hidden_both_epoch", "v_hidden"} & logged
    assert {"both_step", "both_epoch", "v", "ep_end", "batch_end"} <= logged
    assert {"hidden", "hidden_both", "hidden_both_step", "hidden_both_epoch", "v_hidden"} <= set(
        trainer.callback_metrics
    )
    assert "hidden" in trainer.progress_bar_metrics and "hidden" not in trainer.logged_metrics
    # Lightning's names to callbacks: name (the latest), name_step and name_epoch.
    assert {"both", "both_step", "both_epoch"} <= set(trainer.callback_metrics)
    # What on_train_batch_end and on_train_epoch_end log goes in the same row as the step's / epoch's values.
    assert all("both_step" in row for _, row in rows.rows if "batch_end" in row)
    assert [row for _, row in rows.rows if "ep_end" in row][0].keys() >= {"both_epoch", "ep_end"}
    assert trainer.validate(Logs(), DataLoader(data, batch_size=4)) == [{"v": pytest.approx(3.4)}]


def test_epoch_means_are_weighted_by_the_batch_size_read_from_the_batch():
    trainer = Trainer(**{**QUIET, "max_epochs": 1})
    data = TensorDataset(torch.randn(5, 2), torch.randn(5, 1))
    trainer.fit(Logs(), DataLoader(data, batch_size=2), DataLoader(data, batch_size=4))
    # Batches of 2, 2 and 1 logging 0, 1, 2: (0*2 + 1*2 + 2*1) / 5, as Lightning; validation: (4*4 + 1*1) / 5.
    assert trainer.callback_metrics["both_epoch"] == pytest.approx(0.8)
    assert trainer.callback_metrics["v"] == pytest.approx(3.4)


@pytest.mark.parametrize(
    ("hook", "kwargs", "error"),
    [("on_train_end", {}, "inside on_train_end"), ("on_train_epoch_end", {"on_step": True}, "once per epoch")],
)
def test_logging_where_lightning_refuses_it_is_an_error(hook, kwargs, error):
    module = type("LogsThere", (Linear,), {hook: lambda self: self.log("x", 1.0, **kwargs)})()
    with pytest.raises((RuntimeError, ValueError), match=error):
        Trainer(**{**QUIET, "max_epochs": 1}).fit(module, _loader())


# ---------------------------------------------------------------------------------- schedulers
class Plateau(Linear):
    monitor, strict, top_level = "val_loss", True, False

    def validation_step(self, batch, batch_idx):
        self.log("val_loss", 1.0)  # never improves: the LR halves after every epoch but the first

    def on_validation_epoch_start(self):
        self.seen = getattr(self, "seen", []) + [self.trainer.optimizers[0].param_groups[0]["lr"]]

    def configure_optimizers(self):
        opt = torch.optim.SGD(self.parameters(), lr=0.1)
        sched = torch.optim.lr_scheduler.ReduceLROnPlateau(opt, factor=0.5, patience=0)
        if self.top_level:
            return {"optimizer": opt, "lr_scheduler": sched, "monitor": self.monitor}
        return {"optimizer": opt, "lr_scheduler": {"scheduler": sched, "monitor": self.monitor, "strict": self.strict}}


@pytest.mark.parametrize("top_level", [False, True])
def test_reduce_on_plateau_steps_on_the_validation_it_follows(top_level):
    module = Plateau()
    module.top_level = top_level
    trainer = Trainer(**{**QUIET, "max_epochs": 3})
    trainer.fit(module, _loader(), _loader())
    assert module.seen == [0.1, 0.1, 0.05] and trainer.optimizers[0].param_groups[0]["lr"] == 0.025


def test_reduce_on_plateau_with_a_step_interval_monitors_a_step_metric():
    class PerStep(Linear):
        def training_step(self, batch, batch_idx):
            self.log("flat", 1.0)  # never improves: from the second step on, every step halves the LR
            return super().training_step(batch, batch_idx)

        def configure_optimizers(self):
            opt = torch.optim.SGD(self.parameters(), lr=0.1)
            sched = torch.optim.lr_scheduler.ReduceLROnPlateau(opt, factor=0.5, patience=0)
            return {"optimizer": opt, "lr_scheduler": {"scheduler": sched, "monitor": "flat", "interval": "step"}}

    trainer = Trainer(**{**QUIET, "max_steps": 4})
    trainer.fit(PerStep(), _loader(n=16))
    assert trainer.optimizers[0].param_groups[0]["lr"] == pytest.approx(0.1 / 2**3)


def test_a_missing_monitored_metric_is_an_error_unless_strict_is_false():
    module = Plateau()
    module.monitor = "val_acc"
    with pytest.raises(KeyError, match=r"monitors 'val_acc'.*'val_loss'"):
        Trainer(**{**QUIET, "max_epochs": 1}).fit(module, _loader(), _loader())
    module = Plateau()
    module.monitor, module.strict = "val_acc", False
    trainer = Trainer(**{**QUIET, "max_epochs": 2})
    with pytest.warns(RuntimeWarning, match="strict=False: the scheduler does not step"):
        trainer.fit(module, _loader(), _loader())
    assert trainer.optimizers[0].param_groups[0]["lr"] == 0.1


def test_a_plateau_scheduler_without_a_monitor_is_refused_at_set_up():
    class NoMonitor(Linear):
        def configure_optimizers(self):
            opt = torch.optim.SGD(self.parameters(), lr=0.1)
            return [opt], [torch.optim.lr_scheduler.ReduceLROnPlateau(opt)]

    with pytest.raises(ValueError, match="needs one to monitor"):
        Trainer(**{**QUIET, "max_epochs": 1}).fit(NoMonitor(), _loader())


def test_epoch_schedulers_step_after_the_last_batch_before_validation():
    class Step(Plateau):
        def on_train_batch_end(self, outputs, batch, batch_idx):
            self.after_batch = getattr(self, "after_batch", []) + [self.trainer.optimizers[0].param_groups[0]["lr"]]

        def configure_optimizers(self):
            opt = torch.optim.SGD(self.parameters(), lr=0.1)
            return [opt], [torch.optim.lr_scheduler.StepLR(opt, 1, 0.5)]

    module = Step()
    Trainer(**{**QUIET, "max_epochs": 2}).fit(module, _loader(), _loader())
    # Lightning 2.6.6 prints the same: the epoch's last on_train_batch_end and its validation see the new LR.
    assert module.after_batch == [0.1, 0.05, 0.05, 0.025] and module.seen == [0.05, 0.025]


# ------------------------------------------------------------------------------ optimization
def test_optimizer_step_overridden_for_warm_up_and_skipping_is_honoured():
    class WarmUp(Linear):
        def optimizer_step(self, epoch, batch_idx, optimizer, optimizer_closure):
            if batch_idx == 1:
                optimizer_closure()  # training_step and backward run; the step is skipped
                return
            optimizer.step(closure=optimizer_closure)
            for group in optimizer.param_groups:
                group["lr"] = 0.1 * min(1.0, (self.trainer.global_step + 1) / 4)

        def on_train_batch_start(self, batch, batch_idx):
            self.before = [p.detach().clone() for p in self.parameters()]

        def on_train_batch_end(self, outputs, batch, batch_idx):
            moved = any(not torch.equal(a, p) for a, p in zip(self.before, self.parameters()))
            self.moved = getattr(self, "moved", []) + [moved]
            assert all(p.grad is None for p in self.parameters())  # a skipped step leaves nothing behind

    module = WarmUp()
    trainer = Trainer(**{**QUIET, "max_epochs": 2})
    trainer.fit(module, _loader(n=12))
    assert module.moved == [True, False, True] * 2
    assert trainer.global_step == 4  # optimizer steps taken, as Lightning counts them
    assert trainer.optimizers[0].param_groups[0]["lr"] == pytest.approx(0.1)


def test_an_optimizer_step_that_never_runs_its_closure_is_an_error():
    class Forgets(Linear):
        def optimizer_step(self, epoch, batch_idx, optimizer, optimizer_closure):
            pass

    with pytest.raises(RuntimeError, match="did not run its optimizer_closure"):
        Trainer(**{**QUIET, "max_epochs": 1}).fit(Forgets(), _loader())


def test_configure_gradient_clipping_gets_the_trainers_values_and_its_rule_applies():
    class ClipsByValue(Linear):
        def configure_gradient_clipping(self, optimizer, gradient_clip_val=None, gradient_clip_algorithm=None):
            self.given = (gradient_clip_val, gradient_clip_algorithm)
            self.clip_gradients(optimizer, gradient_clip_val=1e-3, gradient_clip_algorithm="value")

    module = ClipsByValue(lr=1.0)
    before = [p.detach().clone() for p in module.parameters()]
    Trainer(**{**QUIET, "max_steps": 1, "gradient_clip_val": 5.0}).fit(module, _loader())
    assert module.given == (5.0, "norm")
    assert max((p.detach() - b).abs().max().item() for p, b in zip(module.parameters(), before)) <= 1e-3 * (1 + 1e-5)


def test_gradient_hooks_see_the_accumulated_gradients_once_per_window():
    class Watches(Linear):
        events = []

        def on_before_zero_grad(self, optimizer):
            self.events.append("zero")

        def on_before_backward(self, loss):
            self.events.append("backward")

        def on_after_backward(self):
            self.events.append("after")

        def on_before_optimizer_step(self, optimizer):
            self.events.append("step")
            self.log("grad_norm", torch.linalg.vector_norm(torch.cat([p.grad.flatten() for p in self.parameters()])))

    module = Watches()
    trainer = Trainer(**{**QUIET, "max_epochs": 1, "accumulate_grad_batches": 2})
    trainer.fit(module, _loader(n=8, batch_size=2))
    window = ["zero", "backward", "after", "backward", "after", "step"]
    assert module.events == window * 2 and "grad_norm" in trainer.callback_metrics


# -------------------------------------------------------------------------- set-up, callbacks
def test_setup_builds_the_data_and_runs_before_the_loaders_in_lightnings_order():
    order = []

    class Data(DataModule):
        def prepare_data(self):
            order.append("dm.prepare_data")

        def setup(self, stage):
            order.append(f"dm.setup({stage})")
            self.data = TensorDataset(torch.randn(8, 2), torch.randn(8, 1))

        def train_dataloader(self):
            order.append("dm.train_dataloader")
            return DataLoader(self.data, batch_size=4)

        def teardown(self, stage):
            order.append(f"dm.teardown({stage})")

    class Module(Linear):
        def prepare_data(self):
            order.append("prepare_data")

        def setup(self, stage):
            order.append(f"setup({stage})")

        def teardown(self, stage):
            order.append(f"teardown({stage})")

    class Watch(Callback):
        def setup(self, trainer, module, stage):
            order.append(f"cb.setup({stage})")

        def teardown(self, trainer, module, stage):
            order.append(f"cb.teardown({stage})")

    Trainer(**{**QUIET, "max_epochs": 1, "callbacks": [Watch()]}).fit(Module(), datamodule=Data())
    assert order == [
        "dm.prepare_data",
        "prepare_data",
        "dm.setup(fit)",
        "cb.setup(fit)",
        "setup(fit)",
        "dm.train_dataloader",
        "dm.teardown(fit)",
        "cb.teardown(fit)",
        "teardown(fit)",
    ]


def test_configure_callbacks_replaces_the_trainers_of_the_same_type_and_checkpoints_run_last(tmp_path):
    mine = EarlyStopping(monitor="loss", patience=9, strict=False)

    class Module(Linear):
        def configure_callbacks(self):
            return [mine]

    other = Callback()
    trainer = Trainer(
        **{**QUIET, "max_epochs": 1, "enable_checkpointing": True, "default_root_dir": str(tmp_path)},
        callbacks=[ModelCheckpoint(dirpath=str(tmp_path)), EarlyStopping(monitor="loss", strict=False), other],
    )
    trainer.fit(Module(), _loader())
    assert [type(c) for c in trainer.callbacks][-1] is ModelCheckpoint
    assert [c for c in trainer.callbacks if isinstance(c, EarlyStopping)] == [mine] and other in trainer.callbacks


# ------------------------------------------------------------------------------ EarlyStopping
def _checks(values, **kwargs):
    stopping = EarlyStopping(monitor="m", **kwargs)
    out = []
    for value in values:
        stop, _ = stopping.evaluate(value)
        out.append(stop)
        if stop:
            break
    return out, stopping


def test_early_stopping_counts_checks_without_improvement():
    assert _checks([3.0, 2.0, 2.5, 2.4, 2.1], patience=3)[0] == [False, False, False, False, True]
    # min_delta: an improvement smaller than it does not count.
    assert _checks([1.0, 0.99, 0.985], patience=2, min_delta=0.05)[0] == [False, False, True]
    assert _checks([1.0, 2.0, 1.5, 1.9], mode="max", patience=2)[0] == [False, False, False, True]
    assert _checks([1.0, 2.0, 1.5, 1.9], mode="max", patience=2)[1].best_score == 2.0


def test_early_stopping_thresholds_and_non_finite_values_stop_at_once():
    assert _checks([1.0, 0.5], stopping_threshold=0.6)[0] == [False, True]
    assert _checks([1.0, 5.0], divergence_threshold=4.0)[0] == [False, True]
    assert _checks([1.0, math.nan])[0] == [False, True]
    assert _checks([1.0, math.nan], check_finite=False)[0] == [False, False]


def test_early_stopping_stops_fit_and_its_state_survives_a_checkpoint(tmp_path):
    class Flat(Linear):
        def validation_step(self, batch, batch_idx):
            self.log("val_loss", 1.0)

    stopping = EarlyStopping(monitor="val_loss", patience=2)
    trainer = Trainer(**{**QUIET, "max_epochs": 20, "callbacks": [stopping]})
    trainer.fit(Flat(), _loader(), _loader())
    assert trainer.current_epoch == 3 and stopping.stopped_epoch == 2 and stopping.wait_count == 2
    path = trainer.save_checkpoint(str(tmp_path / "ckpt"))
    resumed = EarlyStopping(monitor="val_loss", patience=2)
    trainer = Trainer(**{**QUIET, "max_epochs": 20, "callbacks": [resumed]})
    trainer.fit(Flat(), _loader(), _loader(), ckpt_path=path)
    # The restored patience is spent: the first check after the resume stops it again.
    assert resumed.best_score == 1.0 and trainer.current_epoch == 4 and resumed.wait_count == 3


def test_early_stopping_on_a_missing_metric_is_an_error_unless_not_strict():
    with pytest.raises(RuntimeError, match="monitors 'val_acc'"):
        Trainer(**{**QUIET, "max_epochs": 1, "callbacks": [EarlyStopping("val_acc")]}).fit(Linear(), _loader())
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        trainer = Trainer(**{**QUIET, "max_epochs": 2, "callbacks": [EarlyStopping("val_acc", strict=False)]})
        trainer.fit(Linear(), _loader())
    assert trainer.current_epoch == 2


class _RankDependent(Linear):
    """val_loss improves on rank 0 and worsens on rank 1 (logged without sync_dist: each rank its own)."""

    def validation_step(self, batch, batch_idx):
        sign = 1.0 if self.trainer.global_rank == 1 else -1.0
        self.log("val_loss", sign * float(self.current_epoch))


def _stop_on_ranks():
    stopping = EarlyStopping(monitor="val_loss", patience=1)
    trainer = Trainer(**{**QUIET, "max_epochs": 10, "devices": 2, "strategy": "ddp", "callbacks": [stopping]})
    trainer.fit(_RankDependent(), _loader(), _loader())
    return trainer.current_epoch, stopping.wait_count


@pytest.mark.slow
def test_early_stopping_stops_every_rank_when_one_rank_decides():
    # Rank 1 runs out of patience after its second check; rank 0 keeps improving, and stops with it.
    assert shardwise.launch(_stop_on_ranks, devices=2) == [(2, 0), (2, 1)]


def test_rank_zero_only_is_accepted_and_never_reduced():
    class RankZero(Linear):
        def training_step(self, batch, batch_idx):
            if self.trainer.is_global_zero:
                self.log("only_here", 1.0, sync_dist=True, rank_zero_only=True, on_epoch=True)
            return super().training_step(batch, batch_idx)

    trainer = Trainer(**{**QUIET, "max_epochs": 1})
    trainer.fit(RankZero(), _loader())
    assert trainer.callback_metrics["only_here_epoch"] == 1.0

# Tests for the built-in callbacks and loggers, driven by a fake trainer
# (SimpleNamespace with the attributes the Trainer contract promises) so they run
# without trainer.py: CSV files round-trip including columns that appear late,
# versions increment, TensorBoard writes readable events, the LR monitor names and
# values match Lightning's conventions, the progress bar prints sparse plain lines
# when not on a terminal, and DeviceStatsMonitor logs tracked memory by category.
import csv
import io
import re
from types import SimpleNamespace

import pytest
import torch

from shardwise import memory
from shardwise.callbacks import DeviceStatsMonitor, LearningRateMonitor, RichProgressBar
from shardwise.loggers import CSVLogger, Logger, TensorBoardLogger


@pytest.fixture(autouse=True)
def _memory_state(monkeypatch):
    monkeypatch.setattr(memory, "_LAST", None)
    monkeypatch.setattr(memory, "_WARNED_OFF", False)
    yield
    if memory.active_tracker() is not None:
        memory.stop_tracking()
        pytest.fail("test left a MemoryTracker running")


def fake_trainer(**overrides):
    logged, printed = [], []
    trainer = SimpleNamespace(
        global_step=0,
        current_epoch=0,
        max_steps=-1,
        max_epochs=1,
        num_training_batches=10,
        batch_idx=0,
        accumulate_grad_batches=1,
        is_last_microbatch=True,
        is_global_zero=True,
        world_size=1,
        global_rank=0,
        validating=False,
        progress_bar_metrics={},
        callback_metrics={},
        loggers=[object()],
        log_dir=None,
        default_root_dir=".",
        strategy=SimpleNamespace(root_device=torch.device("cpu"), optimizers=[], lr_schedulers=[], module=None),
        logged=logged,
        printed=printed,
        log_metrics=lambda metrics, step=None: logged.append((step, dict(metrics))),
        print=lambda *args: printed.append(" ".join(map(str, args))),
    )
    for key, value in overrides.items():
        setattr(trainer, key, value)
    return trainer


def read_csv(path):
    with open(path, newline="") as f:
        reader = csv.DictReader(f)
        return reader.fieldnames, list(reader)


# ------------------------------------------------------------------- loggers
def test_csv_logger_round_trip_with_new_columns(tmp_path):
    logger = CSVLogger(tmp_path, flush_every_n_steps=1)
    assert isinstance(logger, Logger)
    logger.log_metrics({"loss": torch.tensor(1.5)}, step=0)
    logger.log_metrics({"loss": 0.5, "val": {"acc": 0.9}}, step=1)  # new (nested) column
    logger.log_metrics({"loss": 0.25}, step=2)  # appended, no rewrite needed
    logger.finalize("success")

    assert logger.log_dir == str(tmp_path / "shardwise_logs" / "version_0")
    header, rows = read_csv(logger.metrics_file)
    assert header == ["step", "loss", "val/acc"]
    assert rows == [
        {"step": "0", "loss": "1.5", "val/acc": ""},
        {"step": "1", "loss": "0.5", "val/acc": "0.9"},
        {"step": "2", "loss": "0.25", "val/acc": ""},
    ]

    # Buffered logging: nothing on disk until save(), then one consistent file.
    buffered = CSVLogger(tmp_path, name="buffered", flush_every_n_steps=100)
    for step in range(5):
        buffered.log_metrics({"a": step} if step < 3 else {"a": step, "b": -step}, step=step)
    assert not (tmp_path / "buffered").exists()
    buffered.save()
    header, rows = read_csv(buffered.metrics_file)
    assert header == ["step", "a", "b"] and [r["b"] for r in rows] == ["", "", "", "-3", "-4"]

    # Resuming into an existing version keeps old rows and merges the header.
    resumed = CSVLogger(tmp_path, version=0, flush_every_n_steps=1)
    resumed.log_metrics({"lr": 0.1}, step=3)
    header, rows = read_csv(resumed.metrics_file)
    assert header == ["step", "loss", "val/acc", "lr"] and len(rows) == 4 and rows[-1]["lr"] == "0.1"


def test_csv_logger_hparams_and_versions(tmp_path):
    yaml = pytest.importorskip("yaml")
    first = CSVLogger(tmp_path)
    assert first.version == 0
    first.log_hyperparams({"lr": 1e-3, "model": {"width": 64}, "dtype": torch.float32})
    saved = yaml.safe_load((tmp_path / "shardwise_logs" / "version_0" / "hparams.yaml").read_text())
    assert saved == {"lr": 1e-3, "model": {"width": 64}, "dtype": "torch.float32"}

    second = CSVLogger(tmp_path)
    assert second.version == 1
    second.log_metrics({"x": 1}, step=0)
    second.save()
    assert CSVLogger(tmp_path).version == 2
    named = CSVLogger(tmp_path, name="exp", version="baseline")
    assert named.log_dir == str(tmp_path / "exp" / "baseline") and named.name == "exp"


def test_tensorboard_logger_writes_events(tmp_path):
    pytest.importorskip("tensorboard")
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    logger = TensorBoardLogger(tmp_path)
    logger.log_hyperparams({"lr": 0.1})
    for step in range(3):
        logger.log_metrics({"train/loss": 1.0 / (step + 1), "note": "not a number"}, step=step)
    logger.finalize("success")
    log_dir = tmp_path / "shardwise_logs" / "version_0"
    assert list(log_dir.glob("events.out.tfevents.*")) and (log_dir / "hparams.yaml").exists()
    events = EventAccumulator(str(log_dir))
    events.Reload()
    values = [(e.step, round(e.value, 4)) for e in events.Scalars("train/loss")]
    assert values == [(0, 1.0), (1, 0.5), (2, 0.3333)]
    assert TensorBoardLogger(tmp_path).version == 1


def test_tensorboard_missing_names_the_extra(tmp_path, monkeypatch):
    import sys

    monkeypatch.setitem(sys.modules, "torch.utils.tensorboard", None)  # makes the import fail
    with pytest.raises(ImportError, match=re.escape('pip install "shardwise[tensorboard]"')):
        TensorBoardLogger(tmp_path)


# ---------------------------------------------------------------- LR monitor
def test_lr_monitor_names_and_values():
    model = torch.nn.Linear(4, 4)
    adam = torch.optim.Adam(model.parameters(), lr=0.1)
    sgd = torch.optim.SGD([{"params": [model.weight]}, {"params": [model.bias], "lr": 0.5}], lr=0.01, momentum=0.9)
    scheduler = torch.optim.lr_scheduler.StepLR(adam, step_size=1, gamma=0.5)
    trainer = fake_trainer()
    trainer.strategy.optimizers = [adam, sgd]
    trainer.strategy.lr_schedulers = [{"scheduler": scheduler, "interval": "step", "frequency": 1}]

    monitor = LearningRateMonitor(logging_interval="step", log_momentum=True)
    monitor.on_train_start(trainer, None)
    monitor.on_train_epoch_start(trainer, None)  # "step" interval: nothing at epoch start
    for _ in range(3):
        for opt in (adam, sgd):  # the trainer calls the hook once per optimizer
            monitor.on_before_optimizer_step(trainer, None, opt)
        model(torch.randn(2, 4)).sum().backward()
        adam.step()
        sgd.step()
        scheduler.step()
        trainer.global_step += 1

    assert [step for step, _ in trainer.logged] == [0, 1, 2]
    assert [m["lr-Adam"] for _, m in trainer.logged] == pytest.approx([0.1, 0.05, 0.025])
    first = trainer.logged[0][1]
    assert first["lr-SGD/pg1"] == 0.01 and first["lr-SGD/pg2"] == 0.5
    assert first["lr-Adam-momentum"] == 0.9 and first["lr-SGD/pg1-momentum"] == 0.9


def test_lr_monitor_interval_none_and_duplicate_names():
    a, b = torch.nn.Linear(2, 2), torch.nn.Linear(2, 2)
    opt_a, opt_b = torch.optim.Adam(a.parameters(), lr=1.0), torch.optim.Adam(b.parameters(), lr=2.0)
    per_epoch = torch.optim.lr_scheduler.StepLR(opt_b, step_size=1)
    trainer = fake_trainer()
    trainer.strategy.optimizers = [opt_a, opt_b]
    trainer.strategy.lr_schedulers = [{"scheduler": per_epoch, "interval": "epoch", "name": "lr-decoder"}]
    monitor = LearningRateMonitor()
    monitor.on_train_start(trainer, None)
    monitor.on_train_epoch_start(trainer, None)
    monitor.on_before_optimizer_step(trainer, None, opt_a)
    # The epoch-interval scheduler logs at epoch start, the unscheduled optimizer at steps.
    assert trainer.logged == [(0, {"lr-decoder": 2.0}), (0, {"lr-Adam": 1.0})]

    trainer.strategy.lr_schedulers = []
    monitor = LearningRateMonitor("epoch")
    monitor.on_train_start(trainer, None)
    assert set(monitor.extract("epoch")) == {"lr-Adam", "lr-Adam-1"}

    with pytest.raises(ValueError, match="needs a logger"):
        LearningRateMonitor().on_train_start(fake_trainer(loggers=[]), None)
    with pytest.raises(ValueError, match="logging_interval"):
        LearningRateMonitor("batch")


# -------------------------------------------------------------- progress bar
def _run_progress(bar, trainer, batches, accumulate=1):
    bar.on_train_start(trainer, None)
    bar.on_train_epoch_start(trainer, None)
    for batch_idx in range(batches):
        trainer.batch_idx = batch_idx
        trainer.is_last_microbatch = (batch_idx + 1) % accumulate == 0
        if trainer.is_last_microbatch:
            trainer.global_step += 1
        trainer.progress_bar_metrics = {"loss": torch.tensor(1.0 / (batch_idx + 1))}
        bar.on_train_batch_end(trainer, None, None, None, batch_idx)
    trainer.callback_metrics = {"val_loss": 0.125, "train_loss": 1.0}
    bar.on_validation_start(trainer, None)
    bar.on_validation_end(trainer, None)
    bar.on_train_epoch_end(trainer, None)
    bar.on_train_end(trainer, None)


def test_progress_bar_plain_lines_when_not_a_terminal():
    out = io.StringIO()
    trainer = fake_trainer(max_steps=50, num_training_batches=100, accumulate_grad_batches=2)
    _run_progress(RichProgressBar(print_every_n_steps=10, file=out), trainer, batches=100, accumulate=2)
    lines = out.getvalue().splitlines()
    assert "\x1b" not in out.getvalue()  # no cursor movement or colour codes
    train_lines = [line for line in lines if line.startswith("epoch")]
    assert [re.search(r"step (\d+)/50", line).group(1) for line in train_lines] == ["10", "20", "30", "40", "50"]
    assert "loss=" in train_lines[0] and "it/s" in train_lines[0] and "rss " in train_lines[0]
    assert any(line.startswith("validation") and "val_loss=0.125" in line for line in lines)
    assert lines[-1].startswith("done: 50 steps")
    assert len(lines) == 7

    # Default cadence: about 20 lines per run, never one per step.
    out = io.StringIO()
    _run_progress(RichProgressBar(file=out), fake_trainer(max_steps=1000, num_training_batches=1000), batches=1000)
    assert 20 <= len(out.getvalue().splitlines()) <= 23

    out = io.StringIO()  # other ranks stay silent
    _run_progress(RichProgressBar(file=out), fake_trainer(is_global_zero=False), batches=10)
    assert out.getvalue() == ""


def test_progress_bar_terminal_mode_and_tracked_memory(monkeypatch):
    class FakeTTY(io.StringIO):
        def isatty(self):
            return True

    monkeypatch.setenv("TERM", "xterm")
    out = FakeTTY()
    bar = RichProgressBar(file=out)
    assert bar.is_terminal
    with memory.track_memory():
        _run_progress(bar, fake_trainer(), batches=10)
    assert "done: 10 steps" in out.getvalue() and "(tracked peak)" in out.getvalue()


# ------------------------------------------------------------- device stats
def test_device_stats_monitor_cpu_logs_tracked_categories():
    torch.manual_seed(0)
    model = torch.nn.Linear(256, 256)
    opt = torch.optim.Adam(model.parameters())
    param_bytes = (256 * 256 + 256) * 4
    trainer = fake_trainer()
    trainer.strategy.module, trainer.strategy.optimizers = model, [opt]

    monitor = DeviceStatsMonitor(log_every_n_steps=2)
    monitor.on_train_start(trainer, model)
    tracker = memory.active_tracker()
    assert tracker is not None
    x = torch.randn(16, 256)
    for batch_idx in range(4):
        model(x).square().mean().backward()
        opt.step()
        opt.zero_grad()
        trainer.global_step += 1
        monitor.on_train_batch_end(trainer, model, None, None, batch_idx)
    monitor.on_train_end(trainer, model)

    assert [step for step, _ in trainer.logged] == [2, 4]
    stats = trainer.logged[-1][1]
    assert stats["memory/current/parameters"] == param_bytes
    assert stats["memory/current/optimizer"] == 2 * param_bytes + 2 * 4
    assert stats["memory/current/gradients"] == 0
    assert stats["memory/peak/gradients"] == param_bytes
    assert stats["memory/peak"] == sum(v for k, v in stats.items() if k.startswith("memory/peak/"))
    assert stats["memory/rss"] > 0 and stats["memory/rss_peak"] >= stats["memory/rss"] // 2
    assert any("peak tracked tensor memory" in line for line in trainer.printed)

    # Tracking stopped, but the peak stays readable until reset.
    assert memory.active_tracker() is None
    assert memory.max_memory_allocated() == stats["memory/peak"]
    memory.reset_peak_memory_stats()
    with pytest.warns(UserWarning, match="tracking is off"):
        assert memory.max_memory_allocated() == 0


def test_device_stats_monitor_reuses_a_running_tracker():
    trainer = fake_trainer()
    with memory.track_memory() as outer:
        monitor = DeviceStatsMonitor()
        monitor.on_train_start(trainer, None)
        assert memory.active_tracker() is outer
        monitor.on_train_end(trainer, None)
        assert outer.active  # not ours to stop
    assert not outer.active

"""The loop's own faults, in one process: bad settings, empty or endless data, NaN, a second fit.

Each case used to end silently (an endless loop, training uphill, NaN weights
saved as `last`, trained weights re-initialised) or with torch's message; each
must now stop with a shardwise error that names the argument, the step or the
tensor and says what to change. The multi-rank side (the guilty rank named,
hangs, killed ranks) is in tests/distributed/test_faults.py.
"""

from __future__ import annotations

import math
import os

import pytest
import torch
import torch.distributed as dist
from test_checkpoint import Losses, Net, fit, loaders  # noqa: E402
from torch import nn
from torch.utils.data import DataLoader, IterableDataset, TensorDataset

from shardwise import Trainer
from shardwise.callbacks import ModelCheckpoint
from shardwise.checkpoint import layout
from shardwise.health import NonFiniteError


@pytest.fixture(autouse=True)
def _no_leftover_process_group():
    yield
    if dist.is_initialized():
        dist.destroy_process_group()


def trainer(**kw):
    kw.setdefault("max_steps", 3)
    return Trainer(
        accelerator="cpu", devices=1, logger=False, enable_progress_bar=False, enable_checkpointing=False, **kw
    )


# ------------------------------------------------------------- settings
@pytest.mark.parametrize(
    "name,value,allowed",
    [
        ("limit_train_batches", -3, "between 0.0 and 1.0"),
        ("limit_train_batches", 1.5, "between 0.0 and 1.0"),
        ("limit_val_batches", -1, "between 0.0 and 1.0"),
        ("gradient_clip_val", -1, "positive, finite"),
        ("gradient_clip_val", 0, "positive, finite"),
        ("gradient_clip_val", math.inf, "positive, finite"),
        ("accumulate_grad_batches", 2.5, "whole number of micro-batches"),
        ("accumulate_grad_batches", 0, "whole number of micro-batches"),
        ("max_epochs", -5, "-1 for no limit"),
        ("max_steps", -2, "-1 for no limit"),
        ("val_check_interval", 0, "1 or more"),
        ("val_check_interval", 1.5, r"\(0.0, 1.0\]"),
        ("check_val_every_n_epoch", 0, "1 or more"),
        ("log_every_n_steps", 0, "1 or more"),
        ("non_finite", "ignore", "'error'"),
        ("preemption_signals", ["SIGNOPE"], "is not a signal"),
    ],
)
def test_impossible_settings_are_refused_when_the_trainer_is_built(name, value, allowed):
    with pytest.raises(ValueError, match=rf"{name}.*{allowed}"):
        trainer(**{name: value})


def test_a_model_without_parameters_and_a_loss_without_grad_are_named():
    class Empty(Net):
        def configure_model(self):
            self.layers = [nn.Linear(8, 3)]  # a plain list: not registered

    with pytest.raises(ValueError, match=r"no trainable parameters.*nn.ModuleList"):
        trainer().fit(Empty(), loaders()[0])

    class Detached(Net):
        def training_step(self, batch, batch_idx):
            return super().training_step(batch, batch_idx).detach()

    with pytest.raises(RuntimeError, match=r"does not require grad \(step 1, batch_idx 0\).*return None to skip"):
        trainer().fit(Detached(), loaders()[0])


# ----------------------------------------------------------------- data
class Stream(IterableDataset):
    def __init__(self, n):
        self.n = n

    def __iter__(self):
        g = torch.Generator().manual_seed(0)
        for _ in range(self.n):
            yield torch.randn(8, generator=g), torch.randint(0, 3, (), generator=g)


def test_an_iterable_dataset_without_len_trains_with_max_steps():
    t = trainer(max_steps=7)
    t.fit(Net(), DataLoader(Stream(1000), batch_size=4))
    assert t.global_step == 7 and math.isinf(t.num_training_batches)


def test_empty_data_is_an_error_that_says_so():
    empty = DataLoader(TensorDataset(torch.randn(0, 8), torch.zeros(0, dtype=torch.long)), batch_size=4)
    with pytest.raises(ValueError, match=r"train DataLoader is empty: its dataset has 0 samples, batch size 4"):
        trainer().fit(Net(), empty)
    with pytest.raises(ValueError, match=r"limit_train_batches=0 leaves none of the train DataLoader's 10"):
        trainer(limit_train_batches=0).fit(Net(), loaders()[0])
    with pytest.raises(ValueError, match=r"yielded no batch in epoch 0"):
        trainer(max_steps=5).fit(Net(), DataLoader(Stream(0), batch_size=4))


def test_a_validation_interval_longer_than_an_epoch_is_refused():
    # 10 training batches per epoch: an interval of 11 batches would never validate, and said nothing.
    train, val = loaders()
    with pytest.raises(ValueError, match=r"val_check_interval=11 is larger than an epoch \(10 training batches\)"):
        trainer(val_check_interval=11).fit(Net(), train, val)
    # limit_train_batches shortens the epoch the interval is measured against.
    with pytest.raises(ValueError, match=r"val_check_interval=5 is larger than an epoch \(4 training batches\)"):
        trainer(val_check_interval=5, limit_train_batches=4).fit(Net(), train, val)
    trainer(val_check_interval=10).fit(Net(), train, val)  # the whole epoch: allowed


def test_fsdp_cpu_offload_with_bf16_true_trains():
    # It used to start and die in the first forward ("mat1 and mat2 must have the same dtype"): the
    # float32 batch met bf16 weights. True half precision casts floating inputs, as Lightning does.
    from shardwise.strategies import FSDPStrategy

    t = trainer(strategy=FSDPStrategy(cpu_offload=True), precision="bf16-true", max_steps=2)
    module = Net()
    t.fit(module, loaders()[0])
    assert t.global_step == 2
    assert {p.dtype for p in module.parameters()} == {torch.bfloat16}


# --------------------------------------------------------------- NaN
class NaNAt(Net):
    """The loss becomes NaN at optimizer step `step` (1-based), as a diverging run's does."""

    def __init__(self, step):
        super().__init__()
        self.nan_step = step

    def training_step(self, batch, batch_idx):
        loss = super().training_step(batch, batch_idx)
        return loss * float("nan") if self.trainer.global_step + 1 == self.nan_step else loss


class InfGrad(Net):
    """A finite loss whose backward gives inf: sqrt at 0."""

    def training_step(self, batch, batch_idx):
        loss = super().training_step(batch, batch_idx)
        if self.trainer.global_step + 1 == 4:
            loss = loss + torch.sqrt(self.net[0].weight[0, 0] * 0)
        return loss


@pytest.mark.parametrize("strategy", ["single", "fsdp"])
def test_a_nan_loss_stops_the_run_at_that_step_and_last_stays_sound(tmp_path, strategy):
    with pytest.raises(
        NonFiniteError,
        match=r"optimizer step 5 .*rank 0: the loss of batch_idx 4 \(nan\).*"
        # Step 5 is no log step: its verdict is read before step 6's update (trainer/nonfinite.py).
        r"Found before step 6's update.*nothing from step 5 on was saved.*non_finite='skip'",
    ):
        fit(tmp_path, 10, strategy, module=NaNAt(5), checkpoint=ModelCheckpoint(every_n_train_steps=2))
    last = os.path.realpath(tmp_path / "checkpoints" / "last.ckpt")
    assert layout.read_manifest(last)["global_step"] == 4


def test_an_infinite_gradient_is_named():
    with pytest.raises(
        NonFiniteError,
        # Read a step late (step 4 is no log step), the gradient is gone: its norm was kept.
        match=r"step 4 .*the gradient of net.0.weight \(its norm is (nan|inf)\)",
    ):
        trainer(max_steps=6).fit(InfGrad(), loaders()[0])


def test_skip_drops_the_step_and_warn_never_moves_last(tmp_path):
    with pytest.warns(UserWarning, match=r"step 5: rank 0: the loss of batch_idx 4 \(nan\)\. The step was skipped"):
        t, losses = fit(tmp_path / "skip", 8, module=NaNAt(5), non_finite="skip")
    assert t.global_step == 8 and math.isnan(losses[5])
    assert all(torch.isfinite(p).all() for p in t.lightning_module.parameters())
    with pytest.warns(UserWarning, match=r"not saving step .*non-finite values were seen at step 5"):
        fit(tmp_path / "warn", 8, module=NaNAt(5), non_finite="warn", checkpoint=ModelCheckpoint(every_n_train_steps=2))
    last = os.path.realpath(tmp_path / "warn" / "checkpoints" / "last.ckpt")
    assert layout.read_manifest(last)["global_step"] == 4


# ------------------------------------------------------------ second fit
class Guarded(Net):
    def configure_model(self):
        if not hasattr(self, "net"):
            super().configure_model()


def test_a_second_fit_continues_from_the_trained_weights():
    module = Guarded()
    trainer(max_steps=5).fit(module, loaders()[0])
    trained = {k: v.clone() for k, v in module.state_dict().items()}
    recorder = Losses()
    second = trainer(max_steps=1, callbacks=[recorder])
    weights_at_start = {}
    second.callbacks.insert(
        0,
        type(
            "Grab",
            (),
            {
                "on_train_start": lambda self, t, m: weights_at_start.update(
                    {k: v.clone() for k, v in m.state_dict().items()}
                )
            },
        )(),
    )
    second.fit(module, loaders()[0])
    assert all(torch.equal(weights_at_start[k], trained[k]) for k in trained)


def test_a_second_fit_that_would_reinitialise_is_refused():
    module = Net()  # configure_model builds unconditionally
    trainer().fit(module, loaders()[0])
    with pytest.raises(RuntimeError, match=r"rebuilt the layers of a Net that was already trained.*guard it"):
        trainer().fit(module, loaders()[0])


def test_a_second_trainer_on_an_fsdp_module_says_what_to_do():
    module = Guarded()
    trainer(strategy="fsdp").fit(module, loaders()[0])
    dist.destroy_process_group()
    with pytest.raises(
        RuntimeError,
        match=r"already set up and trained by another Trainer's FSDPStrategy.*"
        r"call fit\(\) again on the same Trainer",
    ):
        trainer(strategy="fsdp").fit(module, loaders()[0])


# ------------------------------------------------------------- torch's wrap()
def test_torch_fsdp_wrap_inside_configure_model_makes_a_unit():
    from torch.distributed.fsdp.wrap import wrap

    class Wrapped(Net):
        def configure_model(self):
            self.net = nn.Sequential(wrap(nn.Linear(8, 16)), nn.LayerNorm(16), nn.Linear(16, 3))

    t = trainer(strategy="fsdp")
    t.fit(Wrapped(), loaders()[0])
    assert "FSDP" in type(t.lightning_module.net[0]).__name__  # its own fully_shard unit
    assert "FSDP" not in type(t.lightning_module.net[2]).__name__


# -------------------------------------------------- custom initialisation
class CustomInit(Net):
    def configure_model(self):
        super().configure_model()
        nn.init.zeros_(self.net[3].weight)  # lost on the meta device


class LoadsWeights(Net):
    def __init__(self, state):
        super().__init__()
        self.pretrained = state

    def configure_model(self):
        super().configure_model()
        self.net.load_state_dict(self.pretrained)


class InitHook(Net):
    def init_weights(self):
        for m in self.net:
            if hasattr(m, "reset_parameters"):
                m.reset_parameters()
        nn.init.zeros_(self.net[3].weight)


@pytest.mark.parametrize("strategy", ["single", "fsdp"])
def test_a_custom_init_in_configure_model_is_never_silently_replaced(strategy):
    with pytest.raises(
        RuntimeError,
        match=r"writes values into 1 parameter\(s\) .*zero_ at test_trainer_faults.py"
        r".*TrainModule.init_weights\(\)",
    ):
        trainer(strategy=strategy).fit(CustomInit(), loaders()[0])
    state = nn.Sequential(nn.Linear(8, 16), nn.LayerNorm(16), nn.Dropout(0.2), nn.Linear(16, 3)).state_dict()
    with pytest.raises(RuntimeError, match=r"writes values into 6 parameter\(s\).*copy_"):
        trainer(strategy=strategy).fit(LoadsWeights(state), loaders()[0])
    if dist.is_initialized():
        dist.destroy_process_group()
    t = trainer(strategy=strategy, max_steps=0)
    t.fit(InitHook(), loaders()[0])
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

    full = get_model_state_dict(t.model, options=StateDictOptions(full_state_dict=True))
    assert torch.count_nonzero(full["net.3.weight"]) == 0  # the hook's init is what the model got


def test_the_trainer_timeout_reaches_every_strategy():
    from shardwise.strategies.deepspeed import DeepSpeedStrategy

    for strategy in ("single", "ddp", "fsdp", DeepSpeedStrategy(stage=2)):
        t = Trainer(accelerator="cpu", devices=2, strategy=strategy, timeout_s=42, logger=False)
        assert t.strategy.timeout_s == 42, strategy
    with pytest.raises(ValueError, match="timeout_s"):
        Trainer(accelerator="cpu", devices=1, timeout_s=-1)


def test_freezing_a_layer_in_configure_model_is_not_an_init():
    class Frozen(Net):
        def configure_model(self):
            super().configure_model()
            self.net[0].weight.requires_grad_(False)  # a flag, not a value: allowed

    trainer().fit(Frozen(), loaders()[0])

"""Bad inputs to the newer features are refused before training, each with the fix named.

One parametrised test, in one process: LoRA options out of range or matching no module, QLoRA where
bitsandbytes cannot run (no LoRA, no package, ZeRO-3), tensor / sequence parallel degrees that do not
divide the world, a logger whose package is missing, a training_step returning a dict without "loss" or an
int, a loader that yields nothing, and a checkpoint of another architecture or of a newer layout version.
Each case must raise its error type with a message naming the problem and the way out; the ones that go
through fit() must also leave the model's weights untouched (no step was taken). A training_step that
returns None follows Lightning's rule instead: the batch is skipped, not refused.
"""

from __future__ import annotations

import socket
import sys
import time
import types

import pytest
import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

import shardwise
from shardwise import Trainer
from shardwise.checkpoint import CheckpointMismatchError, CheckpointVersionError, layout

from helpers.checkpoints import Net, loader


def _trainer(root, max_steps=2):
    return Trainer(
        accelerator="cpu",
        devices=1,
        max_steps=max_steps,
        logger=False,
        enable_progress_bar=False,
        enable_checkpointing=False,
        default_root_dir=str(root),
    )


def _weights(module):
    return {k: v.detach().clone() for k, v in module.state_dict().items()}


class Returns(Net):
    """Net whose training_step returns `value` (after running the forward, as a user's would)."""

    def __init__(self, value):
        super().__init__()
        self.value = value

    def training_step(self, batch, batch_idx):
        super().training_step(batch, batch_idx)
        return self.value


class Wider(Net):
    def configure_model(self):
        self.net = nn.Sequential(nn.Linear(8, 32), nn.LayerNorm(32), nn.GELU(), nn.Linear(32, 3))


def _lora(**options):
    from shardwise.adapters.lora import LoraOptions

    return LoraOptions(**options).validate()


def _lora_targets(_):
    pytest.importorskip("peft")
    from shardwise.adapters.lora import LoraOptions, check_lora

    with torch.device("meta"):
        model = nn.Sequential(nn.Linear(8, 8), nn.Linear(8, 8))
    check_lora(model, LoraOptions(r=4, target_modules=["q_proj"]))


def _qlora(config, strategy="auto"):
    from shardwise.adapters.quantize import check_4bit_config

    check_4bit_config(types.SimpleNamespace(load_in_4bit=True, precision="32-true", **config), strategy)


def _qlora_without_bitsandbytes(monkeypatch):
    monkeypatch.setitem(sys.modules, "bitsandbytes", None)  # import fails as if not installed
    _qlora({"lora_r": 16})


def _qlora_zero3(_):
    from shardwise.adapters.quantize import check_4bit_plan
    from shardwise.strategies.parallel import ParallelPlan

    check_4bit_plan(ParallelPlan.from_name("deepspeed_stage_3"))


def _degrees(tp, sp):
    from shardwise.strategies.parallel import ParallelPlan

    ParallelPlan(engine="fsdp", tp=tp, sp=sp).mesh(2)


def _wandb_missing(monkeypatch):
    from shardwise.loggers import WandbLogger

    monkeypatch.setitem(sys.modules, "wandb", None)
    WandbLogger(project="p")


def _mlflow_unreachable():
    from shardwise.loggers import MLflowLogger

    with socket.socket() as sock:  # a port nothing listens on: bound, then closed
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    started = time.monotonic()
    try:
        MLflowLogger(tracking_uri=f"http://127.0.0.1:{port}")
    finally:
        assert time.monotonic() - started < 15  # bounded: MLflow's own client retried for 262 s


def _fit(module, data=None):
    def run(tmp_path):
        before = _weights(module)
        try:
            _trainer(tmp_path).fit(module, data if data is not None else loader())
        finally:
            after = _weights(module)
            if before.keys() == after.keys():  # set up: no optimizer step may have been taken
                assert all(torch.equal(before[k], after[k]) for k in before), "a step was taken"

    return run


def _resume_other_architecture(tmp_path):
    shardwise.seed_everything(0)
    trainer = _trainer(tmp_path / "a")
    trainer.fit(Net(), loader())
    trainer.save_checkpoint(str(tmp_path / "net.ckpt"))
    _trainer(tmp_path / "b").fit(Wider(), loader(), ckpt_path=str(tmp_path / "net.ckpt"))


def _resume_newer_layout(tmp_path, monkeypatch):
    trainer = _trainer(tmp_path / "a")
    trainer.fit(Net(), loader())
    monkeypatch.setattr(layout, "FORMAT_VERSION", layout.FORMAT_VERSION + 1)  # as a newer shardwise writes
    trainer.save_checkpoint(str(tmp_path / "newer.ckpt"))
    monkeypatch.undo()
    _trainer(tmp_path / "b").fit(Net(), loader(), ckpt_path=str(tmp_path / "newer.ckpt"))


EMPTY = DataLoader(TensorDataset(torch.zeros(0, 8), torch.zeros(0, dtype=torch.long)), batch_size=4)

# name -> (what runs it, given tmp_path and monkeypatch; the error; what its message must say)
CASES = {
    "lora_r_zero": (lambda t, m: _lora(r=0), ValueError, r"lora_r=0: use a whole number of 1 or more"),
    "lora_dropout_out_of_range": (lambda t, m: _lora(r=8, dropout=1.5), ValueError, r"lora_dropout=1.5.*\[0, 1\)"),
    "lora_alpha_zero": (lambda t, m: _lora(r=8, alpha=0), ValueError, r"lora_alpha=0: use a positive number"),
    "lora_targets_match_nothing": (lambda t, m: _lora_targets(t), ValueError, r"\['q_proj'\] match no module"),
    "qlora_without_lora": (lambda t, m: _qlora({"lora_r": 0}), ValueError, r"load_in_4bit.*Set lora_r"),
    "qlora_without_bitsandbytes": (lambda t, m: _qlora_without_bitsandbytes(m), ValueError, r"pip install"),
    "qlora_under_zero3": (lambda t, m: _qlora_zero3(t), ValueError, r"ZeRO-3.*Use strategy='fsdp'"),
    "tp_not_dividing_world": (lambda t, m: _degrees(3, 1), ValueError, r"= 3 does not divide the 2 processes"),
    "sp_not_dividing_world": (lambda t, m: _degrees(1, 3), ValueError, r"= 3 does not divide the 2 processes"),
    "logger_without_package": (lambda t, m: _wandb_missing(m), ImportError, r"pip install .*shardwise\[wandb\]"),
    "logger_server_unreachable": (lambda t, m: _mlflow_unreachable(), ConnectionError, r"cannot be reached.*CSVLogger"),
    "dict_without_loss": (lambda t, m: _fit(Returns({"out": 1.0}))(t), TypeError, r"a dict with a 'loss' key"),
    "int_from_training_step": (lambda t, m: _fit(Returns(3))(t), TypeError, r"must return a loss tensor"),
    "loader_yields_nothing": (lambda t, m: _fit(Net(), EMPTY)(t), ValueError, r"(?i)empty|no batch"),
    "checkpoint_of_another_architecture": (
        lambda t, m: _resume_other_architecture(t),
        CheckpointMismatchError,
        r"shape",
    ),
    "checkpoint_of_a_newer_layout": (
        lambda t, m: _resume_newer_layout(t, m),
        CheckpointVersionError,
        r"layout version 2.*reads version 1",
    ),
}


@pytest.mark.parametrize("case", sorted(CASES))
def test_bad_input_is_refused_before_training_with_the_fix(tmp_path, monkeypatch, case):
    run, error, message = CASES[case]
    with pytest.raises(error, match=message):
        run(tmp_path, monkeypatch)


def test_training_step_returning_none_skips_the_batch_as_lightning_does(tmp_path):
    # Lightning (automatic optimization): None from training_step skips the batch, no error; so here.
    module = Returns(None)
    _fit(module)(tmp_path)

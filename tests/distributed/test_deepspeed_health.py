"""Under DeepSpeed ZeRO-2 and ZeRO-3 a NaN or all-zero step stops the run, as under every other strategy.

From ZeRO-2 on the engine reduces each gradient into its partitions and clears
param.grad, so a check that looks at param.grad sees nothing: a planted NaN
gradient or a loss times 0 trained on silently. DeepSpeedStrategy.gradients
hands the health check what the engine holds (trainer/nonfinite.py). Each case
plants its fault at step 2, which is no log step, so the verdict is read a step
late from the kept gradient norms; step 1 is read at once, and must pass. One
process (DS_ACCELERATOR=cpu over gloo), all eight runs in one launch; the last two with the optimizer
offloaded to the host, whose partitions the check reads in place.
"""

from __future__ import annotations

from typing import Dict, Tuple

import pytest
import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

import shardwise
from shardwise import Trainer, TrainModule

pytest.importorskip("deepspeed")
pytestmark = pytest.mark.deepspeed

AT = 2  # the optimizer step the fault is planted in


class Planted(TrainModule):
    def __init__(self, how: str) -> None:
        super().__init__()
        self.how = how

    def configure_model(self) -> None:
        self.net = nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 2))

    def training_step(self, batch, batch_idx):
        loss = self.net(batch[0]).square().mean()
        if self.trainer.global_step + 1 == AT:
            if self.how == "nan_loss":
                loss = loss * float("nan")
            elif self.how == "nan_grad":  # a finite loss whose backward gives NaN: sqrt at 0, times 0
                loss = loss + torch.sqrt(self.net[0].weight[0, 0] * 0)
            else:
                loss = loss * 0.0
        return loss

    def configure_optimizers(self):
        return torch.optim.AdamW(self.parameters(), lr=1e-3)


def runs() -> Dict[Tuple[int, bool, str], Tuple[str, str, int]]:
    """(stage, optimizer offloaded, fault) -> (error class, message, trainer.global_step when it stopped)."""
    from shardwise.strategies.deepspeed import DeepSpeedStrategy

    data = TensorDataset(torch.randn(16, 4, generator=torch.Generator().manual_seed(0)))
    out = {}
    for stage, offload in ((2, False), (3, False), (2, True), (3, True)):
        # With the optimizer offloaded the gradients are read from its host partitions (deepspeed_grads.py):
        # the fault only they show, once per stage (DeepSpeedCPUAdam steps there; each run costs seconds).
        for how in ("nan_grad",) if offload else ("nan_loss", "nan_grad", "zero"):
            shardwise.seed_everything(0)
            trainer = Trainer(
                accelerator="cpu",
                devices=1,
                strategy=DeepSpeedStrategy(stage=stage, offload_optimizer=offload),
                max_steps=4,
                accumulate_grad_batches=2,
                logger=False,
                enable_progress_bar=False,
                enable_checkpointing=False,
                throughput=False,
            )
            try:
                trainer.fit(Planted(how), DataLoader(data, batch_size=2))
                out[stage, offload, how] = ("", "no error", trainer.global_step)
            except Exception as exc:  # noqa: BLE001 - the error is what is checked
                out[stage, offload, how] = (type(exc).__name__, str(exc), trainer.global_step)
            trainer.strategy.teardown()
    return out


@pytest.fixture(scope="module")
def stopped():
    return shardwise.launch(runs, devices=1)[0]


@pytest.mark.parametrize("stage", [2, 3])
def test_a_nan_or_zero_step_stops_zero_2_and_3(stopped, stage):
    offload = False
    kind, message, step = stopped[stage, offload, "nan_loss"]
    assert kind == "NonFiniteError" and "optimizer step 2 " in message, message
    assert "rank 0: the loss of batch_idx 2 (nan)" in message and step == AT
    kind, message, step = stopped[stage, offload, "nan_grad"]
    # Only the engine's gradient partitions show this one: the loss was finite.
    assert kind == "NonFiniteError" and "optimizer step 2 " in message, message
    assert "rank 0: the gradient of net.0.weight (its norm is nan)" in message or (
        "rank 0: gradient tensor" in message and "(its norm is nan)" in message
    ), message
    kind, message, step = stopped[stage, offload, "zero"]
    assert kind == "ZeroGradientError" and "Every trainable gradient is zero at optimizer step 2 " in message
    assert "rank 0: " in message and "element(s) held here, all zero" in message and step == AT


@pytest.mark.parametrize("stage", [2, 3])
def test_a_nan_gradient_stops_zero_2_and_3_with_the_optimizer_offloaded(stopped, stage):
    kind, message, step = stopped[stage, True, "nan_grad"]
    assert kind == "NonFiniteError" and "optimizer step 2 " in message, message
    assert "rank 0: the gradient of net.0.weight (its norm is nan)" in message or (
        "rank 0: gradient tensor" in message and "(its norm is nan)" in message
    ), message

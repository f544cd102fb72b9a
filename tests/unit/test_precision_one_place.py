"""Precision: 64-true trains in float64 (parameters, inputs, tensors a step creates), and a strategy's
MixedPrecision object or DeepSpeed config is the one place precision is set (issue 24, item 6)."""

from collections import namedtuple

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.distributed.fsdp import MixedPrecision, MixedPrecisionPolicy
from torch.utils.data import DataLoader, TensorDataset

from shardwise import FSDPStrategy, TrainModule
from shardwise.precision import build_precision

from helpers.trainers import quiet_trainer as _trainer


def _data(n=32):
    g = torch.Generator().manual_seed(0)
    return TensorDataset(torch.randn(n, 4, generator=g), torch.randn(n, 1, generator=g))


class Regressor(TrainModule):
    """Records the dtypes a step sees: its input, a tensor it creates, its parameters."""

    def __init__(self):
        super().__init__()
        self.seen = []

    def configure_model(self):
        if not hasattr(self, "net"):
            self.net = nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 1))

    def training_step(self, batch, batch_idx):
        x, y = batch
        noise = torch.randn(x.shape[0], 1)  # created in the step: the default dtype
        self.seen.append((x.dtype, y.dtype, noise.dtype))
        return F.mse_loss(self.net(x) + 0 * noise, y)

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.05)


@pytest.mark.parametrize("strategy", ["single", "fsdp"])
def test_64_true_trains_in_float64(strategy):
    module = Regressor()
    trainer = _trainer(precision="64-true", strategy=strategy, max_steps=4)
    trainer.fit(module, DataLoader(_data(), batch_size=8))
    params = list(module.parameters())
    assert params and all(p.dtype == torch.float64 for p in params), [p.dtype for p in params]
    assert module.seen and set(module.seen) == {(torch.float64, torch.float64, torch.float64)}
    assert torch.get_default_dtype() == torch.float32  # restored after each step
    assert trainer.global_step == 4


def test_64_true_casts_a_module_built_in_init():
    class Eager(Regressor):
        def __init__(self):
            super().__init__()
            self.net = nn.Linear(4, 1)

    module = Eager()
    _trainer(precision="64-true", max_steps=1).fit(module, DataLoader(_data(), batch_size=8))
    assert module.net.weight.dtype == torch.float64


def test_convert_input_casts_floating_tensors_only():
    Pair = namedtuple("Pair", "x ids")
    batch = {"a": [torch.ones(2), torch.arange(2)], "b": Pair(torch.ones(1), torch.arange(3)), "c": "text"}
    out = build_precision("64-true").convert_input(batch)
    assert out["a"][0].dtype == torch.float64 and out["a"][1].dtype == torch.int64
    assert isinstance(out["b"], Pair) and out["b"].x.dtype == torch.float64 and out["b"].ids.dtype == torch.int64
    assert out["c"] == "text"
    assert build_precision("bf16-true").convert_input(torch.ones(1)).dtype == torch.bfloat16
    same = torch.ones(1)
    assert build_precision("bf16-mixed").convert_input(same) is same  # autocast handles mixed modes
    assert build_precision("32-true").convert_input(same) is same


@pytest.mark.parametrize(
    "mixed_precision",
    [MixedPrecision(param_dtype=torch.bfloat16), MixedPrecisionPolicy(param_dtype=torch.bfloat16)],
    ids=["MixedPrecision", "MixedPrecisionPolicy"],
)
def test_strategy_mixed_precision_is_the_one_place(mixed_precision):
    trainer = _trainer(strategy=FSDPStrategy(mixed_precision=mixed_precision))
    assert trainer.strategy.precision.name == "bf16-mixed"
    # The same value given twice is no contradiction.
    assert _trainer(strategy=FSDPStrategy(mixed_precision=mixed_precision), precision="bf16-mixed")


def test_explicit_contradiction_names_both():
    with pytest.raises(ValueError, match=r"precision='bf16-mixed' \(by mixed_precision=MixedPrecision.*'32-true'"):
        _trainer(strategy=FSDPStrategy(mixed_precision=MixedPrecision(param_dtype=torch.bfloat16)), precision="32-true")


def test_default_precision_is_32_true():
    assert _trainer().strategy.precision.name == "32-true"


def test_deepspeed_config_is_the_one_place():
    pytest.importorskip("deepspeed")
    from shardwise import DeepSpeedStrategy
    from shardwise.strategies.deepspeed_config import DeepSpeedConfigError

    trainer = _trainer(strategy=DeepSpeedStrategy(config={"bf16": {"enabled": True}}))
    assert trainer.strategy.precision.name == "bf16-mixed"
    assert trainer.strategy.config["bf16"]["enabled"] is True
    with pytest.raises(DeepSpeedConfigError, match="bf16.enabled=True but the Trainer's precision='32-true'"):
        _trainer(strategy=DeepSpeedStrategy(config={"bf16": {"enabled": True}}), precision="32-true")

"""`TrainModule.load_from_checkpoint` for full, sharded and DeepSpeed checkpoints, and a model usable for
inference after fit under FSDP2 (`module.gathered()`) (issue 24, item 7)."""

import os

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

import shardwise
from shardwise import FSDPStrategy, Trainer, TrainModule

from helpers.trainers import quiet_trainer as _trainer


def _data(n=32):
    g = torch.Generator().manual_seed(0)
    return TensorDataset(torch.randn(n, 6, generator=g), torch.randint(0, 3, (n,), generator=g))


class Net(TrainModule):
    """Layers built in __init__ (head) and in configure_model (body), sized by hyperparameters."""

    def __init__(self, hidden=8, lr=0.1):
        super().__init__()
        self.save_hyperparameters()
        self.hidden, self.lr = hidden, lr
        self.head = nn.Linear(hidden, 3)
        self.body = None

    def configure_model(self):
        if self.body is None:
            self.body = nn.Sequential(nn.Linear(6, self.hidden), nn.Tanh())

    def forward(self, x):
        return self.head(self.body(x))

    def training_step(self, batch, batch_idx):
        x, y = batch
        return F.cross_entropy(self(x), y)

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=self.lr)


def _full_state(module):
    from torch.distributed.tensor import DTensor

    return {
        k: (v.full_tensor() if isinstance(v, DTensor) else v).detach().clone() for k, v in module.state_dict().items()
    }


@pytest.mark.parametrize("strategy", ["single", "fsdp_sharded", "fsdp_full"])
def test_load_from_checkpoint_every_format(tmp_path, strategy):
    shardwise.seed_everything(0)
    module = Net(hidden=12)
    chosen = {
        "single": "single",
        "fsdp_sharded": FSDPStrategy(state_dict_type="sharded"),
        "fsdp_full": FSDPStrategy(state_dict_type="full"),
    }[strategy]
    trainer = _trainer(strategy=chosen, max_steps=3)
    trainer.fit(module, DataLoader(_data(), batch_size=8))
    path = trainer.save_checkpoint(str(tmp_path / "model.ckpt"))
    expected = _full_state(module)
    assert os.path.isdir(path) == (strategy == "fsdp_sharded")

    loaded = Net.load_from_checkpoint(path)
    assert isinstance(loaded, Net) and loaded.hidden == 12 and loaded.hparams["hidden"] == 12
    assert {p.device.type for p in loaded.parameters()} == {"cpu"}
    assert not any(type(p).__name__ == "DTensor" for p in loaded.parameters())
    assert set(loaded.state_dict()) == set(expected)
    for name, value in loaded.state_dict().items():
        torch.testing.assert_close(value, expected[name], rtol=0, atol=0)
    x = torch.randn(4, 6)
    with torch.no_grad():
        assert loaded(x).shape == (4, 3)
    # Keyword arguments override the saved hyperparameters (a shape change is named).
    assert Net.load_from_checkpoint(path, lr=0.5).lr == 0.5
    with pytest.raises(RuntimeError, match="shape"):
        Net.load_from_checkpoint(path, hidden=4)


def test_strict_and_refusals(tmp_path):
    trainer = _trainer(max_steps=1)
    trainer.fit(Net(), DataLoader(_data(), batch_size=8))
    path = trainer.save_checkpoint(str(tmp_path / "model.ckpt"))

    class Bigger(Net):
        def __init__(self, hidden=8, lr=0.1):
            super().__init__(hidden, lr)
            self.extra = nn.Linear(2, 2)

    with pytest.raises(RuntimeError, match=r"Missing from the checkpoint: \['extra.weight', 'extra.bias'\]"):
        Bigger.load_from_checkpoint(path)
    loose = Bigger.load_from_checkpoint(path, strict=False)
    torch.testing.assert_close(loose.head.weight, trainer.module.head.weight.detach())
    with pytest.raises(TypeError, match="hparams_file"):
        Net.load_from_checkpoint(path, hparams_file="hparams.yaml")
    seen = {}

    class Hooked(Net):
        def on_load_checkpoint(self, checkpoint):
            seen["step"] = checkpoint["train_state"]["global_step"]

    Hooked.load_from_checkpoint(path)
    assert seen["step"] == 1


def test_module_is_usable_for_inference_after_fsdp_fit():
    shardwise.seed_everything(0)
    module = Net()
    trainer = _trainer(strategy=FSDPStrategy(auto_wrap_policy={nn.Sequential}), max_steps=2)
    trainer.fit(module, DataLoader(_data(), batch_size=8))
    x = torch.randn(5, 6)
    with torch.no_grad():
        through_root = trainer.model(x)  # the root's hooks gather every unit
        with pytest.raises(Exception, match="DTensor"):
            module.head(module.body(x))  # the head belongs to the root unit, sharded outside its forward
        with module.gathered():
            direct = module.head(module.body(x))
            assert not any(type(p).__name__ == "DTensor" for p in module.head.parameters())
    torch.testing.assert_close(direct, through_root)
    assert all(type(p).__name__ == "DTensor" for p in module.head.parameters())  # resharded after the block


def test_gathered_is_a_no_op_without_sharding():
    module = Net()
    trainer = _trainer(max_steps=1)
    trainer.fit(module, DataLoader(_data(), batch_size=8))
    with module.gathered():
        assert module(torch.randn(2, 6)).shape == (2, 3)


def deepspeed_save_and_load(path):
    shardwise.seed_everything(0)
    module = Net()
    trainer = Trainer(
        accelerator="cpu",
        devices=1,
        strategy="deepspeed_stage_3",
        max_steps=2,
        logger=False,
        enable_progress_bar=False,
        enable_checkpointing=False,
    )
    trainer.fit(module, DataLoader(_data(), batch_size=8))
    saved = trainer.save_checkpoint(path)
    full = trainer.strategy.model_state_dict(trainer.model)
    with torch.no_grad(), module.gathered():
        gathered = module(torch.ones(2, 6))
    return saved, {k: v.clone() for k, v in full.items()}, gathered


@pytest.mark.slow
@pytest.mark.deepspeed
def test_deepspeed_checkpoint_loads_and_zero3_gathers(tmp_path):
    pytest.importorskip("deepspeed")
    saved, full, gathered = shardwise.launch(deepspeed_save_and_load, str(tmp_path / "ds.ckpt"), devices=1)[0]
    loaded = Net.load_from_checkpoint(saved)
    for name, value in loaded.state_dict().items():
        torch.testing.assert_close(value, full[name])
    with torch.no_grad():
        torch.testing.assert_close(loaded(torch.ones(2, 6)), gathered)

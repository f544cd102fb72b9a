"""A small classifier, its data, and an exact comparison of two runs' state, for the checkpoint tests.

A checkpoint test trains, saves, resumes elsewhere (another strategy, world size or device) and
asks: is the resumed model and optimizer state the saved one, to the bit? `full_state` answers
the "what" as full CPU tensors (a collective under FSDP: every rank calls it), and
`assert_same_state` compares two of them, naming the case and the tensor that differ.
"""

from __future__ import annotations

from typing import Any, Dict

import torch
import torch.nn.functional as F
from torch import nn
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict, get_optimizer_state_dict
from torch.utils.data import DataLoader, TensorDataset

from shardwise import TrainModule

OPTIMIZERS = {
    "sgd": lambda params: torch.optim.SGD(params, lr=0.1),
    "momentum": lambda params: torch.optim.SGD(params, lr=0.1, momentum=0.9),
    "adam": lambda params: torch.optim.Adam(params, lr=1e-2),
    "adamw": lambda params: torch.optim.AdamW(params, lr=1e-2),
}


class Net(TrainModule):
    """Linear, LayerNorm, GELU, Linear: weights, biases and a norm in a few hundred values.

    `scheduler=True` adds a StepLR (halves the lr every step), so a resume must restore it too.
    """

    def __init__(self, optimizer: str = "adamw", scheduler: bool = False) -> None:
        super().__init__()
        self.optimizer, self.scheduler = optimizer, scheduler

    def configure_model(self) -> None:
        self.net = nn.Sequential(nn.Linear(8, 16), nn.LayerNorm(16), nn.GELU(), nn.Linear(16, 3))

    def training_step(self, batch, batch_idx):
        x, y = batch
        return F.cross_entropy(self.net(x), y)

    def configure_optimizers(self):
        opt = OPTIMIZERS[self.optimizer](self.parameters())
        if self.scheduler:
            return [opt], [torch.optim.lr_scheduler.StepLR(opt, 1, 0.5)]
        return opt


def loader() -> DataLoader:
    g = torch.Generator().manual_seed(0)
    return DataLoader(
        TensorDataset(torch.randn(40, 8, generator=g), torch.randint(0, 3, (40,), generator=g)),
        batch_size=4,
        shuffle=True,
    )


def full_state(trainer) -> Dict[str, Any]:
    """Model and optimizer state as full CPU tensors, the first param group's settings, the step (collective)."""
    options = StateDictOptions(full_state_dict=True)
    model = {k: v.detach().cpu().clone() for k, v in get_model_state_dict(trainer.model, options=options).items()}
    osd = get_optimizer_state_dict(trainer.model, trainer.optimizers[0], options=options)
    optim = {
        f"{fqn}/{k}": v.detach().cpu().clone()
        for fqn, s in osd["state"].items()
        for k, v in s.items()
        if isinstance(v, torch.Tensor)
    }
    # Loading a full file under FSDP hands `betas` back as a list: the same values, compared as lists.
    group = {
        k: list(v) if isinstance(v, tuple) else v
        for k, v in trainer.optimizers[0].param_groups[0].items()
        if k != "params"
    }
    return {"model": model, "optim": optim, "group": repr(sorted(group.items())), "step": trainer.global_step}


def assert_same_state(expected: Dict[str, Any], got: Dict[str, Any], what: Any) -> None:
    """Bit-for-bit equal model and optimizer tensors, the same param-group settings (lr included) and step."""
    assert got["step"] == expected["step"], (what, got["step"], expected["step"])
    assert got["group"] == expected["group"], (what, got["group"], expected["group"])
    assert expected["model"].keys() == got["model"].keys(), what
    for key in expected["model"]:
        assert torch.equal(expected["model"][key], got["model"][key]), (what, key)
    assert expected["optim"].keys() == got["optim"].keys(), what
    for key in expected["optim"]:
        assert torch.equal(expected["optim"][key], got["optim"][key]), (what, key)

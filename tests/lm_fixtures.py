"""Shared test fixtures: the seed's language model on the bundled text, and a per-step loss recorder.

Module-level so spawned worker processes can import them.
"""
from __future__ import annotations

from typing import Any, Dict, List

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import DataLoader

import shardwise
from shardwise import FSDPStrategy, TrainModule, Trainer
from shardwise.demos import PythonDocsText, Transformer

LAYERS = {nn.TransformerEncoderLayer, nn.TransformerDecoderLayer}
SMALL = dict(nlayers=2, nhid=64, ninp=32, nhead=2)


class LanguageModel(TrainModule):
    """The seed's LanguageModel, with the model built in configure_model (meta device under FSDP)."""

    def __init__(self, vocab_size: int, lr: float = 1e-3, **sizes: Any) -> None:
        super().__init__()
        self.vocab_size, self.lr, self.sizes = vocab_size, lr, sizes or SMALL
        self.model = None

    def configure_model(self) -> None:
        if self.model is None:
            self.model = Transformer(vocab_size=self.vocab_size, **self.sizes)

    def training_step(self, batch):
        input, target = batch
        output = self.model(input, target)
        loss = F.nll_loss(output, target.view(-1))
        self.log("train_loss", loss, prog_bar=True)
        return loss

    def validation_step(self, batch, batch_idx):
        input, target = batch
        loss = F.nll_loss(self.model(input, target), target.view(-1))
        self.log("val_loss", loss, sync_dist=True)

    def configure_optimizers(self):
        return torch.optim.Adam(self.parameters(), lr=self.lr)


class StepLosses:
    """Callback: the loss of each optimizer step, averaged over its micro-batches and all ranks."""

    def __init__(self) -> None:
        self.losses: List[float] = []
        self._window: List[torch.Tensor] = []

    def on_train_batch_end(self, trainer, module, outputs, batch, batch_idx):
        self._window.append(outputs.detach().float())
        if trainer.is_last_microbatch:
            mean = torch.stack(self._window).mean()
            self.losses.append(float(trainer.strategy.reduce(mean, "mean")))
            self._window = []


def strategy_for(name: str):
    if name == "fsdp_full":
        return FSDPStrategy(auto_wrap_policy=LAYERS)
    if name == "fsdp_full_ac":
        return FSDPStrategy(auto_wrap_policy=LAYERS, activation_checkpointing_policy=LAYERS)
    if name == "fsdp_grad_op":
        return FSDPStrategy(auto_wrap_policy=LAYERS, sharding_strategy="SHARD_GRAD_OP")
    if name == "fsdp_no_shard":
        return FSDPStrategy(auto_wrap_policy=LAYERS, sharding_strategy="NO_SHARD")
    if name == "fsdp_hybrid_2x2":
        return FSDPStrategy(auto_wrap_policy=LAYERS, sharding_strategy="HYBRID_SHARD", device_mesh=(2, 2))
    return name


def train_losses(name: str, devices: int, batch_size: int, steps: int = 20, precision: str = "32-true",
                 accumulate: int = 2, clip: float = 0.5, lr: float = 1e-3) -> List[float]:
    shardwise.seed_everything(1234)
    data = PythonDocsText(block_size=16)
    recorder = StepLosses()
    trainer = Trainer(accelerator="cpu", devices=devices, strategy=strategy_for(name), precision=precision,
                      max_steps=steps, accumulate_grad_batches=accumulate, gradient_clip_val=clip,
                      callbacks=[recorder], enable_progress_bar=False, logger=False, enable_checkpointing=False)
    trainer.fit(LanguageModel(data.vocab_size, lr=lr), DataLoader(data, batch_size=batch_size))
    return recorder.losses


def train_many(configs: List[Dict[str, Any]]) -> Dict[str, List[float]]:
    """Several runs in one set of worker processes (process start-up dominates small tests)."""
    return {c.pop("key", c["name"]): train_losses(**c) for c in configs}

"""Shared test fixtures: the seed's language model runs on the bundled text, and a per-step loss recorder.

Module-level so spawned worker processes can import them.
"""
from __future__ import annotations

from typing import Any, Dict, List

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import DataLoader

import shardwise
from shardwise import FSDPStrategy, Trainer
from shardwise.demos import LanguageModel, PythonDocsText

LAYERS = {nn.TransformerEncoderLayer, nn.TransformerDecoderLayer}
SMALL = dict(nlayers=2, nhid=64, ninp=32, nhead=2)


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
    trainer.fit(LanguageModel(data.vocab_size, lr=lr, **SMALL), DataLoader(data, batch_size=batch_size))
    return recorder.losses


def train_many(configs: List[Dict[str, Any]]) -> Dict[str, List[float]]:
    """Several runs in one set of worker processes (process start-up dominates small tests)."""
    return {c.pop("key", c["name"]): train_losses(**c) for c in configs}

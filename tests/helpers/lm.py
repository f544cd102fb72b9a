"""Shared training pieces: the demo language model's runs on the bundled text, a per-step loss recorder,
and the shipped GPT at a tiny size on sequences that count upwards (learnable: the loss falls in a few steps).

Module-level so spawned worker processes can import them.
"""

from __future__ import annotations

from typing import Any, Dict, List, Optional

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

import shardwise
from shardwise import Trainer, TrainModule
from shardwise.demos import LanguageModel, PythonDocsText
from shardwise.memory import start_tracking, stop_tracking
from shardwise.models import GPT, gpt_config
from shardwise.strategies import build_strategy
from shardwise.strategies.base import global_seed
from shardwise.strategies.materialize import reset_each_module

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


class PeakOfSteps:
    """Callback: tracked tensor memory from train start to train end (peak and its breakdown by category)."""

    def on_train_start(self, trainer, module):
        start_tracking(trainer.strategy.module, trainer.strategy.optimizers)

    def on_train_end(self, trainer, module):
        tracker = stop_tracking()
        self.peak, self.breakdown = tracker.peak_bytes, tracker.peak_breakdown


def strategy_for(name: str, wrap: bool = True, **options):
    """A strategy-table name for the small Transformer: FSDP wraps its layers unless `wrap=False`."""
    return build_strategy(name, blocks=LAYERS if wrap else None, **options)


def train_losses(
    name: str,
    devices: int,
    batch_size: int,
    steps: int = 20,
    precision: str = "32-true",
    accumulate: int = 2,
    clip: float = 0.5,
    lr: float = 1e-3,
    wrap: bool = True,
    **strategy_options: Any,
) -> List[float]:
    shardwise.seed_everything(1234)
    data = PythonDocsText(block_size=16)
    recorder = StepLosses()
    trainer = Trainer(
        accelerator="cpu",
        devices=devices,
        strategy=strategy_for(name, wrap, **strategy_options),
        precision=precision,
        max_steps=steps,
        accumulate_grad_batches=accumulate,
        gradient_clip_val=clip,
        callbacks=[recorder],
        enable_progress_bar=False,
        logger=False,
        enable_checkpointing=False,
    )
    trainer.fit(LanguageModel(data.vocab_size, lr=lr, **SMALL), DataLoader(data, batch_size=batch_size))
    return recorder.losses


def train_many(configs: List[Dict[str, Any]]) -> Dict[str, List[float]]:
    """Several runs in one set of worker processes (process start-up dominates small tests)."""
    return {c.pop("key", c["name"]): train_losses(**c) for c in configs}


# ------------------------------------------------------------------ a tiny GPT
GPT_TINY = dict(vocab_size=128, block_size=32, n_layer=2, n_head=4, n_embd=64, tie_embeddings=False)


def token_data(n: int = 256, seq: int = 17, vocab: int = 128, seed: int = 0) -> TensorDataset:
    """Sequences counting upwards (mod vocab) from a random start: learnable structure."""
    g = torch.Generator().manual_seed(seed)
    start = torch.randint(0, vocab, (n, 1), generator=g)
    return TensorDataset((start + torch.arange(seq)) % vocab)


class TinyGPT(TrainModule):
    """The shipped GPT (untied head, 2 blocks), built in configure_model so strategies choose its device."""

    def __init__(self, lr: float = 1e-3, freeze_positions: bool = False, optimizer: str = "adamw") -> None:
        super().__init__()
        self.cfg = gpt_config("gpt-tiny", **GPT_TINY)
        self.lr = lr
        self.optimizer = optimizer
        # A frozen parameter is the case zero_to_fp32 stores apart from the optimizer's partitions.
        self.freeze_positions = freeze_positions
        self.model: Optional[GPT] = None

    def configure_model(self) -> None:
        if self.model is None:
            self.model = GPT(self.cfg)
            if self.freeze_positions:
                self.model.wpe.weight.requires_grad_(False)

    def init_weights(self) -> None:
        # The tests on this model compare engines with each other, ZeRO-3 among them: under zero.Init the
        # constructor's own init cannot be replayed as on the meta device, so all engines use the one
        # initialisation every engine can run, each module's reset_parameters() under its per-module seed.
        reset_each_module(self, global_seed())

    def _loss(self, batch) -> torch.Tensor:
        (tokens,) = batch
        logits = self.model(tokens[:, :-1])
        return F.cross_entropy(logits.float().reshape(-1, logits.size(-1)), tokens[:, 1:].reshape(-1))

    def training_step(self, batch):
        return self._loss(batch)

    def validation_step(self, batch, batch_idx):
        self.log("val_loss", self._loss(batch), sync_dist=True)

    def configure_optimizers(self):
        trainable = [p for p in self.parameters() if p.requires_grad]
        if self.optimizer == "sgd":  # no per-element normalisation: fp32 noise stays fp32 noise
            return torch.optim.SGD(trainable, lr=self.lr)
        return torch.optim.AdamW(trainable, lr=self.lr, weight_decay=0.0)

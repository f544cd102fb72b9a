"""What the smoke checks share: the bundled GPT as a TrainModule with an optional planted NaN, learnable
token data, a per-step loss recorder, and `Skip`.

The model is shardwise's own `models.GPT` (its `Block` is what FSDP wraps and compile compiles), trained
on sequences that count upwards modulo the vocabulary, so the loss falls within a few steps and a check
can tell training from noise.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any, List, Optional

import torch
import torch.nn.functional as F
from torch.utils.data import DataLoader, TensorDataset

from shardwise.models import GPT, gpt_config
from shardwise.module import TrainModule


class Skip(Exception):
    """The check cannot run here (no CUDA, a package missing): reported as SKIP with this reason."""


class SmokeFailure(AssertionError):
    """A failed check that carries what it saw (kept in the check's data beside the traceback)."""

    def __init__(self, message: str, data: dict) -> None:
        super().__init__(message)
        self.data = data


def require_cuda() -> None:
    if not torch.cuda.is_available():
        raise Skip("needs CUDA (torch.cuda.is_available() is False)")


def require(package: str) -> Any:
    import importlib

    try:
        return importlib.import_module(package)
    except ImportError as exc:
        raise Skip(f"{package} is not installed ({exc}); tools/gpu_wheels.sh builds the wheels to carry") from exc


def gpt(preset: str = "gpt-tiny", **changes: Any) -> Any:
    return dataclasses.replace(gpt_config(preset), **changes)


class GPTModule(TrainModule):
    """The bundled GPT; `nan_at=(step, rank)` makes that rank's loss NaN in that optimizer step (1-based)."""

    def __init__(self, config: Any, lr: float = 3e-3, nan_at: Optional[tuple] = None) -> None:
        super().__init__()
        self.config, self.lr, self.nan_at = config, lr, nan_at
        self.model: Optional[GPT] = None

    def configure_model(self) -> None:
        if self.model is None:
            self.model = GPT(self.config)

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        idx, target = batch
        logits = self.model(idx)
        loss = F.cross_entropy(logits.flatten(0, 1).float(), target.flatten())
        if self.nan_at is not None and (self.trainer.global_step + 1, self.trainer.global_rank) == tuple(self.nan_at):
            loss = loss * float("nan")
        return loss

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.AdamW(self.parameters(), lr=self.lr)


def counting_data(config: Any, rows: int = 64, seq: Optional[int] = None, batch_size: int = 8) -> DataLoader:
    """Sequences start, start+1, ... modulo the vocabulary: next-token prediction a GPT learns in a few steps."""
    seq = seq or config.block_size
    g = torch.Generator().manual_seed(0)
    starts = torch.randint(0, config.vocab_size, (rows, 1), generator=g)
    tokens = (starts + torch.arange(seq + 1)) % config.vocab_size
    return DataLoader(TensorDataset(tokens[:, :-1], tokens[:, 1:]), batch_size=batch_size, shuffle=False)


class StepLosses:
    """Callback: each optimizer step's loss on this rank (the last micro-batch's), read after the step."""

    def __init__(self) -> None:
        self.losses: List[float] = []

    def on_train_batch_end(self, trainer: Any, module: Any, outputs: Any, batch: Any, batch_idx: int) -> None:
        if getattr(trainer, "is_last_microbatch", True):
            self.losses.append(float(outputs.detach().float()))


def finite(values: List[float]) -> bool:
    return bool(values) and all(math.isfinite(v) for v in values)


def quiet_trainer_kwargs(**kwargs: Any) -> dict:
    """What every smoke Trainer shares: no logger files, no progress bar, no checkpoints."""
    return {"logger": False, "enable_progress_bar": False, "enable_checkpointing": False, **kwargs}

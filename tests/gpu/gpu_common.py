"""Shared pieces of the GPU smoke suite (tests/gpu): device, world size, small models, a Trainer.

Every module of the suite calls `skip_without_gpu()` at import, so
`python -m pytest tests/gpu -q` skips cleanly on a machine without CUDA.
Tests that need more than one rank use `world()` = min(2, GPUs visible): on
one GPU they still run, as one rank. DEVICE_TYPE is the one switch between
the GPU and a CPU dry run of the same test bodies (set it to "cpu" to
exercise the code on a CPU-only machine; the suite ships with "cuda").
Module-level, so the worker processes shardwise.launch starts can import it.
"""
from __future__ import annotations

import math
import os
import sys
from typing import Any, Dict, List, Optional

import pytest
import torch
import torch.nn.functional as F
from torch.utils.data import DataLoader, TensorDataset

HERE = os.path.dirname(os.path.abspath(__file__))
for path in (os.path.dirname(HERE), os.path.join(os.path.dirname(HERE), "recipes")):
    if path not in sys.path:
        sys.path.insert(0, path)

import shardwise  # noqa: E402
from shardwise import FSDPStrategy, Trainer, TrainModule  # noqa: E402
from shardwise.models import GPT, Block, gpt_config  # noqa: E402

DEVICE_TYPE = "cuda"
GPT_CONFIG = dict(vocab_size=128, block_size=32, n_layer=2, n_head=4, n_embd=64, tie_embeddings=False)


def skip_without_gpu() -> None:
    """Module-level: skip the whole module when the suite targets CUDA and there is none."""
    if DEVICE_TYPE == "cuda" and not torch.cuda.is_available():
        pytest.skip("tests/gpu needs a CUDA GPU (torch.cuda.is_available() is False)", allow_module_level=True)


def world(wanted: int = 2) -> int:
    """Ranks for a multi-rank test: min(wanted, visible GPUs); on the CPU dry run, `wanted` processes."""
    if DEVICE_TYPE == "cuda":
        return max(1, min(wanted, torch.cuda.device_count()))
    return wanted


def deterministic_math() -> None:
    """fp32 means fp32: no TF32 matmuls, so strategies compare at fp32 tolerances."""
    if torch.cuda.is_available():
        torch.backends.cuda.matmul.allow_tf32 = False
        torch.backends.cudnn.allow_tf32 = False


class StepLosses:
    """Callback: each optimizer step's loss, averaged over its micro-batches and all ranks."""

    def __init__(self) -> None:
        self.losses: List[float] = []
        self._window: List[torch.Tensor] = []

    def on_train_batch_end(self, trainer, module, outputs, batch, batch_idx):
        self._window.append(outputs.detach().float())
        if trainer.is_last_microbatch:
            mean = torch.stack(self._window).mean()
            self.losses.append(float(trainer.strategy.reduce(mean, "mean")))
            self._window = []


class TinyGPT(TrainModule):
    """The shipped GPT, tiny, on counting sequences (the loss falls within a few steps)."""

    def __init__(self, lr: float = 1e-3) -> None:
        super().__init__()
        self.cfg = gpt_config("gpt-tiny", **GPT_CONFIG)
        self.lr = lr
        self.model: Optional[GPT] = None

    def configure_model(self) -> None:
        if self.model is None:
            self.model = GPT(self.cfg)

    def _loss(self, batch) -> torch.Tensor:
        (tokens,) = batch
        logits = self.model(tokens[:, :-1])
        return F.cross_entropy(logits.float().reshape(-1, logits.size(-1)), tokens[:, 1:].reshape(-1))

    def training_step(self, batch):
        return self._loss(batch)

    def validation_step(self, batch, batch_idx):
        self.log("val_loss", self._loss(batch), sync_dist=True)

    def configure_optimizers(self):
        return torch.optim.AdamW(self.parameters(), lr=self.lr, weight_decay=0.0)


def token_data(n: int = 256, seq: int = 17, vocab: int = 128, seed: int = 0) -> TensorDataset:
    g = torch.Generator().manual_seed(seed)
    start = torch.randint(0, vocab, (n, 1), generator=g)
    return TensorDataset((start + torch.arange(seq)) % vocab)


def strategy_for(name: str) -> Any:
    """Names of the parity runs -> strategies (FSDP wraps the GPT's Blocks)."""
    from shardwise.strategies.deepspeed import DeepSpeedStrategy

    blocks = {Block}
    table = {
        "fsdp_full": lambda: FSDPStrategy(auto_wrap_policy=blocks),
        "fsdp_full_ac": lambda: FSDPStrategy(auto_wrap_policy=blocks, activation_checkpointing_policy=blocks),
        "fsdp_grad_op": lambda: FSDPStrategy(auto_wrap_policy=blocks, sharding_strategy="SHARD_GRAD_OP"),
        "fsdp_no_shard": lambda: FSDPStrategy(auto_wrap_policy=blocks, sharding_strategy="NO_SHARD"),
        "fsdp_offload": lambda: FSDPStrategy(auto_wrap_policy=blocks, cpu_offload=True),
        "zero1": lambda: DeepSpeedStrategy(stage=1),
        "zero2": lambda: DeepSpeedStrategy(stage=2),
        "zero3": lambda: DeepSpeedStrategy(stage=3),
    }
    return table[name]() if name in table else name


def gpu_trainer(**kwargs: Any) -> Trainer:
    defaults = dict(accelerator=DEVICE_TYPE, logger=False, enable_progress_bar=False, enable_checkpointing=False)
    return Trainer(**{**defaults, **kwargs})


def fit_gpt(name: Any, devices: int, global_batch: int = 8, steps: int = 8, precision: str = "32-true",
            accumulate: int = 2, clip: Optional[float] = 0.5, lr: float = 3e-3, root: Optional[str] = None,
            val: bool = False, ckpt_path: Optional[str] = None, **trainer_kwargs: Any) -> Dict[str, Any]:
    """One run; the same global batch whatever the world size. Returns losses, val metric, trainer."""
    deterministic_math()
    shardwise.seed_everything(1234)
    recorder = StepLosses()
    strategy = strategy_for(name) if isinstance(name, str) else name  # or a strategy object
    trainer = gpu_trainer(devices=devices, strategy=strategy, precision=precision, max_steps=steps,
                          accumulate_grad_batches=accumulate, gradient_clip_val=clip, callbacks=[recorder],
                          default_root_dir=root, **({"val_check_interval": accumulate * 4, "limit_val_batches": 2}
                                                    if val else {}), **trainer_kwargs)
    per_rank = max(1, global_batch // max(1, devices))
    loader = DataLoader(token_data(), batch_size=per_rank, shuffle=True)
    val_loader = DataLoader(token_data(32, seed=1), batch_size=per_rank) if val else None
    module = TinyGPT(lr=lr)
    trainer.fit(module, loader, val_loader, ckpt_path=ckpt_path)
    return {"losses": recorder.losses, "trainer": trainer, "module": module,
            "val_loss": float(trainer.callback_metrics["val_loss"]) if val else None}


def rel(a: List[float], b: List[float]) -> float:
    return max(abs(x - y) / max(abs(y), 1e-12) for x, y in zip(a, b))


def finite(values: List[float]) -> bool:
    return bool(values) and all(math.isfinite(v) for v in values)

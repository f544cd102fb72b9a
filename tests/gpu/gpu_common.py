"""Shared pieces of the GPU smoke suite (tests/gpu): device, world size, small models, a Trainer.

Every module of the suite calls `skip_without_gpu()` at import, so
`python -m pytest tests/gpu -q` skips cleanly on a machine without CUDA.
Tests that need more than one rank use `world()` = min(2, GPUs visible): on
one GPU they still run, as one rank, since NCCL refuses two ranks on one
device and so does `Trainer(devices=2)` with one GPU visible; the multi-process
paths one GPU can run (forked ranks on cuda:0 over gloo, NCCL's refusal) are
in test_one_gpu_paths_gpu.py. DEVICE_TYPE is the one switch between
the GPU and a CPU dry run of the same test bodies (set it to "cpu" to
exercise the code on a CPU-only machine; the suite ships with "cuda").
Module-level, so the worker processes shardwise.launch starts can import it. The
recorder, the tiny GPT and its data are tests/helpers/lm.py's, shared with the CPU suite.
"""

from __future__ import annotations

import math
from typing import Any, Dict, List, Optional

import pytest
import torch
from torch.utils.data import DataLoader

import shardwise
from shardwise import Trainer
from shardwise.models import Block
from shardwise.strategies import build_strategy

from helpers.lm import StepLosses, TinyGPT, token_data  # noqa: F401  (token_data, TinyGPT: used by the GPU tests)

DEVICE_TYPE = "cuda"


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


def strategy_for(name: str) -> Any:
    """A strategy-table name for the GPT (FSDP wraps its Blocks; `_ac` checkpoints them)."""
    return build_strategy(name, blocks={Block})


def gpu_trainer(**kwargs: Any) -> Trainer:
    defaults = dict(accelerator=DEVICE_TYPE, logger=False, enable_progress_bar=False, enable_checkpointing=False)
    return Trainer(**{**defaults, **kwargs})


def fit_gpt(
    name: Any,
    devices: int,
    global_batch: int = 8,
    steps: int = 8,
    precision: str = "32-true",
    accumulate: int = 2,
    clip: Optional[float] = 0.5,
    lr: float = 3e-3,
    root: Optional[str] = None,
    val: bool = False,
    ckpt_path: Optional[str] = None,
    **trainer_kwargs: Any,
) -> Dict[str, Any]:
    """One run; the same global batch whatever the world size. Returns losses, val metric, trainer."""
    deterministic_math()
    shardwise.seed_everything(1234)
    recorder = StepLosses()
    strategy = strategy_for(name) if isinstance(name, str) else name  # or a strategy object
    trainer = gpu_trainer(
        devices=devices,
        strategy=strategy,
        precision=precision,
        max_steps=steps,
        accumulate_grad_batches=accumulate,
        gradient_clip_val=clip,
        callbacks=[recorder],
        default_root_dir=root,
        **({"val_check_interval": accumulate * 4, "limit_val_batches": 2} if val else {}),
        **trainer_kwargs,
    )
    per_rank = max(1, global_batch // max(1, devices))
    loader = DataLoader(token_data(), batch_size=per_rank, shuffle=True)
    val_loader = DataLoader(token_data(32, seed=1), batch_size=per_rank) if val else None
    module = TinyGPT(lr=lr)
    trainer.fit(module, loader, val_loader, ckpt_path=ckpt_path)
    return {
        "losses": recorder.losses,
        "trainer": trainer,
        "module": module,
        "val_loss": float(trainer.callback_metrics["val_loss"]) if val else None,
    }


def rel(a: List[float], b: List[float]) -> float:
    return max(abs(x - y) / max(abs(y), 1e-12) for x, y in zip(a, b))


def finite(values: List[float]) -> bool:
    return bool(values) and all(math.isfinite(v) for v in values)

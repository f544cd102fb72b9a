"""seed_everything: one call makes Python, NumPy, torch and shardwise's init agree.

The seed is also recorded in this process's launch context
(distributed/context.py), so that the worker processes a shardwise launcher
starts get it, and so the sharding-invariant initialisation
(strategies/materialize.py) derives every module's weights from it: the
seed of one module is `module_seed(seed, its name)`, drawn under
`fork_rng(devices=rng_devices())`. Those two sit here, below the engines,
because LoRA's initialisation (adapters/lora.py) draws the same way. And
what else `Trainer(deterministic=True)` needs before CUDA starts
(apply_cublas_workspace_config).
"""

from __future__ import annotations

import os
import random
import zlib
from typing import List, Optional

import numpy as np
import torch

from shardwise.distributed import context
from shardwise.fqn import canonical_name


def seed_everything(seed: Optional[int] = None, workers: bool = False, verbose: bool = True) -> int:
    """Seed every RNG; returns the seed (a random one when None).

    workers (Lightning's): DataLoader workers get their own Python, NumPy and torch seeds. torch's
    DataLoader already does so in every worker, from a base seed drawn from the seeded torch generator,
    so a seeded run's workers are reproducible either way (with other numbers than Lightning's).
    verbose is accepted for Lightning's signature; nothing is printed.
    """
    if seed is None:
        seed = context.current().seed
        seed = random.randint(0, 2**31 - 1) if seed is None else seed
    seed = int(seed)
    if not 0 <= seed < 2**32:
        raise ValueError(f"seed {seed} is outside [0, 2**32).")
    context.update(seed=seed)
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)
    return seed


# ------------------------------------------------------------------ per-module seeds (strategies/materialize.py)
def module_seed(seed: int, fqn: str) -> int:
    """The seed of the module named `fqn` (wrappers stripped): the same module draws the same weights under
    every strategy and world size."""
    return zlib.crc32(f"{seed}:{canonical_name(fqn)}".encode()) & 0x7FFFFFFF


def rng_devices(device: Optional[torch.device] = None) -> List[torch.device]:
    """The CUDA generators `torch.manual_seed` changes here, for `fork_rng(devices=...)` to restore.

    manual_seed seeds every GPU's generator; `fork_rng(devices=[])` restores
    only the CPU's, which would leave the CUDA stream (dropout) seeded by the
    last initialised module -- unlike a run whose weights were built eagerly.
    """
    if device is not None and device.type == "cuda":
        return [device]
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        return [torch.device("cuda", torch.cuda.current_device())]
    return []


# ------------------------------------------------------------------ deterministic runs
CUBLAS_WORKSPACE_ENV = "CUBLAS_WORKSPACE_CONFIG"


def apply_cublas_workspace_config() -> str:
    """CUBLAS_WORKSPACE_CONFIG=:4096:8 unless the user set it; returns the value in force.

    cuBLAS (CUDA >= 10.2) is deterministic only with a fixed workspace, read from this variable
    when torch sets up its handle, at the first matrix product: so it is set in the process that
    builds the Trainer, before its CUDA work, and the workers a launcher starts later inherit it.
    torch.use_deterministic_algorithms alone only warns (warn_only) or raises at that product.
    """
    return os.environ.setdefault(CUBLAS_WORKSPACE_ENV, ":4096:8")

"""seed_everything: one call makes Python, NumPy, torch and shardwise's init agree.

The seed is also recorded in this process's launch context
(distributed/context.py), so that the worker processes a shardwise launcher
starts get it, and so the sharding-invariant initialisation
(strategies/materialize.py) derives every module's weights from it.
"""

from __future__ import annotations

import random
from typing import Optional

import numpy as np
import torch

from shardwise.distributed import context


def seed_everything(seed: Optional[int] = None) -> int:
    """Seed every RNG; returns the seed (a random one when None)."""
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

"""seed_everything: one call makes Python, NumPy, torch and shardwise's init agree.

The seed is also exported in the environment so that worker processes the
Trainer starts (and DataLoader workers) inherit it, and so the
sharding-invariant initialisation (strategies/materialize.py) derives every
module's weights from it.
"""

from __future__ import annotations

import os
import random
from typing import Optional

import numpy as np
import torch

from shardwise.strategies.base import SEED_ENV


def seed_everything(seed: Optional[int] = None) -> int:
    """Seed every RNG; returns the seed (a random one when None)."""
    if seed is None:
        seed = int(os.environ.get(SEED_ENV, random.randint(0, 2**31 - 1)))
    seed = int(seed)
    if not 0 <= seed < 2**32:
        raise ValueError(f"seed {seed} is outside [0, 2**32).")
    os.environ[SEED_ENV] = str(seed)
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)
    return seed

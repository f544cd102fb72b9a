"""`isolate_rng`: run a block without moving the global random streams (`lightning.pytorch.utilities.seed`).

A callback that samples inside a run (a validation image, a generated text)
uses it so the training run draws the same numbers as without the callback.
Python's, NumPy's and torch's CPU generators, and CUDA's when initialised, are
put back as they were on exit.
"""

from __future__ import annotations

import contextlib
import random
from typing import Iterator

import numpy as np
import torch


@contextlib.contextmanager
def isolate_rng(include_cuda: bool = True) -> Iterator[None]:
    """Restore the global generators' states on exit (include_cuda=False leaves CUDA's alone)."""
    python, numpy_state, cpu = random.getstate(), np.random.get_state(), torch.get_rng_state()
    cuda = torch.cuda.get_rng_state_all() if include_cuda and torch.cuda.is_initialized() else None
    try:
        yield
    finally:
        random.setstate(python)
        np.random.set_state(numpy_state)
        torch.set_rng_state(cpu)
        if cuda is not None:
            torch.cuda.set_rng_state_all(cuda)

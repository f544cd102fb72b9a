"""Every random-number generator a training step can draw from, captured and restored.

Exact resume needs the resumed run to draw the same random numbers as the
uninterrupted one: dropout masks come from torch's generator, augmentations
often from Python's or NumPy's, and each rank has its own streams. The state
is captured as plain Python values and tensors (no NumPy objects), so a
checkpoint's trainer state stays loadable without trusting arbitrary pickles.
"""

from __future__ import annotations

import random
from typing import Any, Dict

import numpy as np
import torch


def capture_rng_states() -> Dict[str, Any]:
    """This process's generator states: python, numpy, torch (CPU) and, when used, CUDA."""
    kind, keys, pos, has_gauss, gauss = np.random.get_state(legacy=True)
    states: Dict[str, Any] = {
        "python": random.getstate(),
        "numpy": (kind, torch.from_numpy(keys.copy()), int(pos), int(has_gauss), float(gauss)),
        "torch": torch.get_rng_state(),
    }
    # Only when CUDA is already initialised: querying it would otherwise
    # create a context on a GPU this process may not own.
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        states["cuda"] = torch.cuda.get_rng_state_all()
    return states


def restore_rng_states(states: Dict[str, Any]) -> None:
    """Put the generators back to a state from capture_rng_states (missing parts are left alone)."""
    if "python" in states:
        version, internal, gauss = states["python"]
        random.setstate((version, tuple(internal), gauss))
    if "numpy" in states:
        kind, keys, pos, has_gauss, gauss = states["numpy"]
        keys = keys.numpy() if isinstance(keys, torch.Tensor) else np.asarray(keys)
        np.random.set_state((kind, keys.astype(np.uint32), pos, has_gauss, gauss))
    if "torch" in states:
        torch.set_rng_state(states["torch"])
    if "cuda" in states and torch.cuda.is_available():
        cuda = states["cuda"]
        if len(cuda) == torch.cuda.device_count():
            torch.cuda.set_rng_state_all(cuda)
        else:  # another GPU count: restore the devices both runs have
            for index, state in enumerate(cuda[: torch.cuda.device_count()]):
                torch.cuda.set_rng_state(state, index)

"""Training progress: the only counters the loop keeps.

Epoch, optimizer steps, and the position inside the epoch (batches
consumed). Checkpoints save exactly this, and an exact mid-epoch resume is
a matter of restoring it and telling the sampler where to start.
"""
from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any, Dict


@dataclass
class TrainState:
    epoch: int = 0            # current epoch (0-based)
    global_step: int = 0      # optimizer steps taken
    batch_idx: int = 0        # batches consumed in the current epoch
    total_batches: int = 0    # batches consumed over the whole run
    stage: str = "idle"       # "fit" | "validate" | "idle"

    def state_dict(self) -> Dict[str, Any]:
        return asdict(self)

    def load_state_dict(self, state: Dict[str, Any]) -> None:
        for key, value in state.items():
            if hasattr(self, key):
                setattr(self, key, value)

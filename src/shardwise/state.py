"""Training progress: the contract between the loop and the checkpoint layer.

`TrainState` is everything the loop and a checkpoint exchange. The saved part
is three counters -- epoch, optimizer steps, batches consumed in the epoch --
and an exact mid-epoch resume is restoring them and telling the sampler where
to start. The rest describes where in the loop a save happens, which the
checkpoint layer needs to put a resumed run at the same point: whether the
epoch's own work is done (a save from epoch-end hooks resumes at the next
epoch), training's RNG states while validation runs on a copy of them, and a
restored RNG state the loop re-applies when it creates its data iterator.
The Trainer hands it to checkpoint/training.py among the explicit stateful
parts of a run (TrainingStates); the checkpoint layer reads nothing else.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from typing import Any, Dict, Optional

_SAVED = ("epoch", "global_step", "batch_idx")


@dataclass
class TrainState:
    epoch: int = 0  # current epoch (0-based)
    global_step: int = 0  # optimizer steps taken
    batch_idx: int = 0  # batches consumed in the current epoch
    # One id per run, kept across its resumes: tells this run's checkpoints from another's in a
    # directory (os.urandom, so no training RNG is drawn).
    run_id: str = field(default_factory=lambda: os.urandom(6).hex())
    # Where the loop is (not saved as such; see the module docstring).
    in_epoch_end: bool = False
    rng_outside_validation: Optional[Dict[str, Any]] = field(default=None, repr=False)
    pending_rng: Optional[Dict[str, Any]] = field(default=None, repr=False)

    def state_dict(self) -> Dict[str, Any]:
        return {**{key: getattr(self, key) for key in _SAVED}, "run_id": self.run_id}

    def load_state_dict(self, state: Dict[str, Any]) -> None:
        for key in _SAVED:
            if key in state:
                setattr(self, key, int(state[key]))
        if state.get("run_id"):
            self.run_id = str(state["run_id"])

    def resume_position(self) -> Dict[str, int]:
        """Where a run resumed from a save taken now starts: after epoch-end work, the next epoch."""
        position = self.state_dict()
        del position["run_id"]
        if self.in_epoch_end:
            position["epoch"] += 1
            position["batch_idx"] = 0
        return position

"""What the Trainer does to a datamodule besides asking it for loaders (Lightning's LightningDataModule).

A datamodule is given the Trainer (`dm.trainer`) before its prepare_data, so
its setup can read the world (a template divides its global batch by
`self.trainer.world_size`); and its state_dict() travels in checkpoints
beside the callbacks' states, so a resumed fit hands load_state_dict() what
was saved. Its hooks are called from lightning_hooks.py.
"""

from __future__ import annotations

from typing import Any, Dict, List


def attach_datamodule(datamodule: Any, trainer: Any) -> None:
    """`dm.trainer = trainer`, as Lightning sets it before prepare_data / setup."""
    if datamodule is not None:
        try:
            datamodule.trainer = trainer
        except AttributeError:  # a read-only property of the user's own: it has its own way
            pass


class DataModuleState:
    """A datamodule's state_dict() in a checkpoint, saved and restored with the callbacks' (keyed by its class)."""

    def __init__(self, datamodule: Any) -> None:
        self.datamodule = datamodule
        self.state_key = f"datamodule:{type(datamodule).__qualname__}"

    def state_dict(self) -> Dict[str, Any]:
        return self.datamodule.state_dict()

    def load_state_dict(self, state: Dict[str, Any]) -> None:
        self.datamodule.load_state_dict(state)


def datamodule_states(datamodule: Any) -> List[Any]:
    """[DataModuleState] for a datamodule with state_dict / load_state_dict, else nothing to save."""
    if datamodule is None or not callable(getattr(datamodule, "state_dict", None)):
        return []
    return [DataModuleState(datamodule)]

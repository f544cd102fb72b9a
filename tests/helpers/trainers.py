"""A Trainer for one-process tests: on the CPU, one device, no logger, progress bar or checkpoints
unless a test asks for them (every keyword can be overridden)."""

from shardwise import Trainer

QUIET = {
    "accelerator": "cpu",
    "devices": 1,
    "logger": False,
    "enable_progress_bar": False,
    "enable_checkpointing": False,
}


def quiet_trainer(**kw) -> Trainer:
    return Trainer(**{**QUIET, **kw})

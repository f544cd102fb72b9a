"""Checkpoints: sharded by default, exact resume, any world size, atomic, one command to a consolidated file.

`save_training_checkpoint` / `load_training_checkpoint` are what
`Trainer.save_checkpoint` and `fit(ckpt_path=...)` call; `open_checkpoint`
reads any checkpoint tensor by tensor without a model (used by
`shardwise convert` and `shardwise inspect`). Files: layout.py (names,
atomic commit, `last`), formats.py (model + optimizers, "full" / "sharded"),
training.py (everything else a resumed run needs), onefile.py (a one-file
checkpoint's own manifest and digest, checked before anything is unpickled),
integrity.py (checksums), rng.py, reader.py, convert.py, inspect.py, errors.py.
"""

from shardwise.checkpoint.errors import (
    CheckpointError,
    CheckpointFormatError,
    CheckpointMismatchError,
    CheckpointNotFoundError,
    CheckpointVersionError,
    CheckpointWriteError,
    ChecksumMismatchError,
    CorruptCheckpointError,
    ForeignCheckpointError,
    ManifestMismatchError,
    UnsafeCheckpointError,
    UnverifiableCheckpointError,
)
from shardwise.checkpoint.integrity import check_writable
from shardwise.checkpoint.layout import FORMAT_VERSION, LAST_NAME, latest_checkpoint, list_checkpoints
from shardwise.checkpoint.lock import CheckpointDirectoryBusyError
from shardwise.checkpoint.reader import open_checkpoint
from shardwise.checkpoint.training import load_training_checkpoint, save_training_checkpoint

__all__ = [
    "save_training_checkpoint",
    "load_training_checkpoint",
    "open_checkpoint",
    "list_checkpoints",
    "latest_checkpoint",
    "FORMAT_VERSION",
    "LAST_NAME",
    "CheckpointError",
    "CheckpointNotFoundError",
    "CorruptCheckpointError",
    "CheckpointMismatchError",
    "CheckpointVersionError",
    "CheckpointFormatError",
    "CheckpointWriteError",
    "ChecksumMismatchError",
    "UnsafeCheckpointError",
    "UnverifiableCheckpointError",
    "ManifestMismatchError",
    "ForeignCheckpointError",
    "CheckpointDirectoryBusyError",
    "check_writable",
]

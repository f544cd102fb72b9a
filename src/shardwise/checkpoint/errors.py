"""The errors a checkpoint can raise, each saying what is wrong and what to do.

Loading is where a long run meets its past: a wrong path, a file cut short by
a full disk, flipped bytes, a file that asks to run code, a model that
changed shape since the save, a checkpoint from another shardwise release or
another run, a manifest edited after the save;
saving is where it meets a full or read-only disk. Each case has its own exception type (so tests and
callers can catch it precisely) and a message that names the file, the keys
or the versions involved instead of surfacing a pickle or zip traceback.
"""

from __future__ import annotations


class CheckpointError(RuntimeError):
    """Base class of every checkpoint error."""


class CheckpointNotFoundError(CheckpointError, FileNotFoundError):
    """The path does not exist (the message lists the checkpoints that do)."""


class CorruptCheckpointError(CheckpointError):
    """A checkpoint file is truncated or unreadable (the message names it)."""


class ChecksumMismatchError(CorruptCheckpointError):
    """A checkpoint file's bytes differ from the checksum recorded when it was written."""


class UnsafeCheckpointError(CorruptCheckpointError):
    """A checkpoint file asks to run code (a pickled global outside the allow-list); nothing was executed."""


class UnverifiableCheckpointError(CorruptCheckpointError):
    """A checkpoint carries no checksum to verify it by (written before one-file checkpoints had one, or by
    plain torch.save); the message names SHARDWISE_VERIFY_CHECKSUMS=0, which loads it unverified."""


class ManifestMismatchError(CorruptCheckpointError):
    """A manifest's fields (global_step, run_id, ...) disagree with the state its checkpoint holds: edited."""


class ForeignCheckpointError(CheckpointError):
    """Looking for a run's checkpoint found another run's (placed in, or copied over one in, its directory).

    Passing that checkpoint explicitly as ckpt_path loads it; only discovery (`last`) refuses to guess.
    """


class CheckpointWriteError(CheckpointError, OSError):
    """Writing a checkpoint failed in the filesystem (no space, read-only, permission); names the path.

    Also an OSError with the original errno, so `exc.errno == errno.ENOSPC` works.
    """

    def __init__(self, message: str, errno_: int = 0, path: str = "") -> None:
        super().__init__(message)
        self.errno = errno_
        self.filename = path

    def __str__(self) -> str:
        return self.args[0] if self.args else ""


class CheckpointMismatchError(CheckpointError):
    """The checkpoint's model / optimizer keys or shapes differ from the running ones."""


class CheckpointVersionError(CheckpointError):
    """The checkpoint was written in a layout version this shardwise cannot read."""


class CheckpointFormatError(CheckpointError):
    """The checkpoint's format cannot be read by the running strategy."""

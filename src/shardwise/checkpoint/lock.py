"""One live run per checkpoint directory.

Two runs writing into one directory delete each other's temporary saves and
prune each other's checkpoints. The run that saves into a directory holds an
exclusive `flock` on `<dir>/.shardwise.lock` for as long as it trains; a
second run fails at once with a message naming the holder. The kernel drops
a flock when its process dies, however it dies, so the lock of a killed run
is taken over by the next one without any stale-lock heuristics. The holder
deletes the file when it ends; a run that locked a file which was deleted
meanwhile notices (the path no longer names its inode) and tries again. The
file holds the holder's host, pid and start time, for the message only.
"""

from __future__ import annotations

import contextlib
import datetime
import fcntl
import os
import socket
from typing import Iterator, Optional

from shardwise.checkpoint.errors import CheckpointError

LOCK_NAME = ".shardwise.lock"


class CheckpointDirectoryBusyError(CheckpointError):
    """Another live run saves checkpoints into the same directory."""


class DirectoryLock:
    def __init__(self, directory: str) -> None:
        self.directory = os.path.abspath(directory)
        self.path = os.path.join(self.directory, LOCK_NAME)
        self._fd: Optional[int] = None

    @property
    def held(self) -> bool:
        return self._fd is not None

    def acquire(self) -> None:
        if self._fd is not None:
            return
        os.makedirs(self.directory, exist_ok=True)
        while True:
            fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o644)
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                holder = _read(fd)
                os.close(fd)
                raise CheckpointDirectoryBusyError(
                    f"Another run ({holder or 'unknown process'}) is saving checkpoints into {self.directory}. "
                    "Two runs in one directory would delete each other's saves: give this run its own "
                    "default_root_dir or ModelCheckpoint(dirpath=...), or wait for the other run to end."
                ) from None
            if _same_file(fd, self.path):
                break
            os.close(fd)  # the previous holder deleted it between our open and our lock
        os.ftruncate(fd, 0)
        since = datetime.datetime.now().astimezone().isoformat(timespec="seconds")
        os.write(fd, f"host {socket.gethostname()} pid {os.getpid()} since {since}\n".encode())
        self._fd = fd

    def release(self) -> None:
        if self._fd is None:
            return
        fd, self._fd = self._fd, None
        try:
            os.unlink(self.path)  # while still locked: nobody can hold a lock on this inode now
        except OSError:
            pass
        finally:
            os.close(fd)  # releases the flock


@contextlib.contextmanager
def waiting_lock(path: str) -> Iterator[None]:
    """Hold an exclusive flock on `path` (created), waiting for a live holder; the file goes when done.

    For work one process does and the others wait for (a cache entry built once). As with
    DirectoryLock, a lock taken on a file its holder deleted meanwhile is taken again on the new one,
    so two waiters never both think they hold it; a killed holder's flock is dropped by the kernel.
    """
    os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
    while True:
        fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
        fcntl.flock(fd, fcntl.LOCK_EX)
        if _same_file(fd, path):
            break
        os.close(fd)
    try:
        yield
    finally:
        with contextlib.suppress(OSError):
            os.unlink(path)  # while still locked: nobody can hold a lock on this inode now
        os.close(fd)


def _same_file(fd: int, path: str) -> bool:
    try:
        return os.fstat(fd).st_ino == os.stat(path).st_ino
    except FileNotFoundError:
        return False


def _read(fd: int) -> str:
    try:
        return os.pread(fd, 200, 0).decode(errors="replace").strip()
    except OSError:
        return ""

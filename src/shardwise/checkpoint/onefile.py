"""One-file checkpoints that carry their own manifest and digest, checked before anything is unpickled.

A "full" checkpoint is one torch zip file (`torch.load(path)["state_dict"]`
works as ever). A zip archive ends with a comment that torch and every zip
reader skip; shardwise writes its trailer there:

    shardwise-manifest/1 LF <manifest JSON> LF sha256-tree/64MiB: <64 hex digits>

The digest covers every byte before its own 64 digits: torch's archive, the
manifest (an edited field fails it) and the framing. It is a two-level
sha256 -- the sha256 of the concatenated sha256 digests of each 64 MiB leaf --
so that threads, and the ranks of a load, verify one large file together.
It is computed while torch.save writes (nothing is read back) and checked
before torch unpickles a byte; the pages read to check it are the ones the
memory-mapped load then uses, so a verified load reads the file from disk
once. The manifest alone comes from the file's last 64 KiB (discovery,
`inspect`, the version check), with its own seal (integrity.seal). Keeping
all of it inside the file rather than in a sidecar keeps a checkpoint one
file to copy and one rename to commit.
"""

from __future__ import annotations

import hashlib
import json
import os
import pickletools
import struct
import zipfile
from dataclasses import dataclass
from typing import Any, Callable, Dict, List, Optional, Tuple

from shardwise.checkpoint.errors import CheckpointError, ChecksumMismatchError, CorruptCheckpointError
from shardwise.checkpoint.integrity import ALGORITHM, VERIFY_ENV, RecordingWriter, parallel_map, seal

MAGIC = b"shardwise-manifest/1\n"
TAG = b"\nsha256-tree/64MiB:"
HEX_LEN = 64
LEAF = 64 << 20
_EOCD = b"PK\x05\x06"  # a zip's end-of-central-directory record: 22 bytes, then the comment
_EOCD_SIZE = 22
_MAX_COMMENT = 0xFFFF
_READ = 8 << 20


@dataclass(frozen=True)
class Trailer:
    manifest: Dict[str, Any]
    digest: str  # as recorded
    covered: int  # bytes the digest covers: everything before it


def combine(leaves: List[bytes]) -> str:
    return hashlib.sha256(b"".join(leaves)).hexdigest()


class LeafHasher:
    """The sha256 of each LEAF bytes of a stream; `hexdigest()` is the file's digest (`combine`)."""

    def __init__(self) -> None:
        self.leaves: List[bytes] = []
        self._h = hashlib.sha256()
        self._fill = 0

    def update(self, data: Any) -> None:
        view = memoryview(data).cast("B")
        while len(view):
            take = min(len(view), LEAF - self._fill)
            self._h.update(view[:take])
            self._fill += take
            view = view[take:]
            if self._fill == LEAF:
                self.leaves.append(self._h.digest())
                self._h, self._fill = hashlib.sha256(), 0

    def hexdigest(self) -> str:
        return combine(self.leaves + ([self._h.digest()] if self._fill or not self.leaves else []))


class TrailerWriter:
    """The file torch.save writes into: hashes each byte as it passes and `finish` appends the trailer.

    The last two bytes torch writes are the archive comment's length (0); they are held back
    from the hash until `finish` has set them. Also keeps the OSError a write raised
    (integrity.RecordingWriter), which torch's zip writer would report as "unexpected pos".
    """

    def __init__(self, fh: Any) -> None:
        self._fh = fh
        self._out = RecordingWriter(fh)
        self._hasher = LeafHasher()
        self._held = b""
        self.size = 0

    @property
    def error(self) -> Optional[OSError]:
        return self._out.error

    def write(self, data: Any) -> int:
        written = self._out.write(data)
        view = memoryview(data).cast("B")
        if len(view) >= 2:
            self._hasher.update(self._held)
            self._hasher.update(view[:-2])
            self._held = bytes(view[-2:])
        else:
            joined = self._held + bytes(view)
            self._hasher.update(joined[:-2])
            self._held = joined[-2:]
        self.size += len(view)
        return written

    def flush(self) -> None:
        self._fh.flush()

    def fileno(self) -> int:
        return self._fh.fileno()

    def __getattr__(self, name: str) -> Any:
        return getattr(self._fh, name)

    def finish(self, manifest: Dict[str, Any]) -> None:
        """Set the comment's length and append MAGIC, the sealed manifest, TAG and the digest."""
        if self._held != b"\0\0":
            raise CheckpointError("torch.save wrote a zip archive comment; shardwise's trailer has no room.")
        body = MAGIC + json.dumps(seal(manifest), sort_keys=True).encode() + TAG
        if len(body) + HEX_LEN > _MAX_COMMENT:
            raise CheckpointError(f"The checkpoint manifest is {len(body)} bytes; at most {_MAX_COMMENT} fit.")
        length = struct.pack("<H", len(body) + HEX_LEN)
        self._fh.seek(self.size - 2)
        self._out.write(length)
        self._fh.seek(self.size)
        self._hasher.update(length)
        self._hasher.update(body)
        self._out.write(body + self._hasher.hexdigest().encode())


def archive_comment(path: str) -> Optional[bytes]:
    """The zip comment at the end of `path` (b"" when it has none); None when the file does not end
    like a zip archive (cut short, appended to, or not one at all)."""
    size = os.path.getsize(path)
    with open(path, "rb") as fh:
        fh.seek(max(0, size - _EOCD_SIZE - _MAX_COMMENT))
        tail = fh.read()
    pos = len(tail)
    while True:
        pos = tail.rfind(_EOCD, 0, pos)
        if pos < 0:
            return None
        if pos + _EOCD_SIZE <= len(tail):
            (length,) = struct.unpack_from("<H", tail, pos + 20)
            if pos + _EOCD_SIZE + length == len(tail):
                return tail[pos + _EOCD_SIZE :]


def parse_trailer(path: str, comment: bytes) -> Trailer:
    """The trailer in an archive comment (torch writes none, so any comment must be ours, whole)."""

    def damaged(what: str) -> CorruptCheckpointError:
        return CorruptCheckpointError(
            f"{path} is corrupt: its shardwise trailer (the manifest and sha256 at the end of the file) is "
            f"damaged: {what}. Resume from an earlier checkpoint."
        )

    if not comment.startswith(MAGIC):
        raise damaged("it does not start with the shardwise marker")
    body, tag, digest = comment[len(MAGIC) :].rpartition(TAG)
    text = digest.decode("ascii", "replace")
    if not tag or len(digest) != HEX_LEN or any(c not in "0123456789abcdef" for c in text):
        raise damaged("its sha256 is not 64 hex digits")
    try:
        manifest = json.loads(body)
    except ValueError as exc:
        raise damaged(f"its manifest is not JSON ({exc})") from None
    if not isinstance(manifest, dict):
        raise damaged("its manifest is not a JSON object")
    return Trailer(manifest, text, os.path.getsize(path) - HEX_LEN)


def read_trailer(path: str) -> Optional[Trailer]:
    """The trailer of the one-file checkpoint at `path`; None for a zip archive without one."""
    comment = archive_comment(path)
    if comment is None:
        raise CorruptCheckpointError(
            f"{path} is truncated or corrupt: it does not end like a torch (zip) file ({os.path.getsize(path)} "
            "bytes). Resume from an earlier checkpoint."
        )
    return parse_trailer(path, comment) if comment else None


def leaf_ranges(covered: int) -> List[Tuple[int, int]]:
    count = max(1, -(-covered // LEAF))
    return [(i * LEAF, min((i + 1) * LEAF, covered)) for i in range(count)]


def _hash_range(fd: int, start: int, end: int) -> bytes:
    h = hashlib.sha256()
    buffer = bytearray(min(_READ, max(1, end - start)))
    view = memoryview(buffer)
    pos = start
    while pos < end:
        n = os.preadv(fd, [view[: min(len(buffer), end - pos)]], pos)
        if n <= 0:  # the file is shorter than recorded: the digest will differ
            break
        h.update(view[:n])
        pos += n
    return h.digest()


def verify(
    path: str,
    trailer: Trailer,
    rank: int = 0,
    world_size: int = 1,
    gather: Optional[Callable[[Any], List[Any]]] = None,
) -> None:
    """ChecksumMismatchError unless the file's digest is the recorded one.

    Rank `rank` hashes every world_size-th leaf (on threads); `gather(obj) -> list`, a
    collective over the loading ranks, shares the leaves, so every rank raises or none does.
    """
    ranges = leaf_ranges(trailer.covered)
    mine = list(range(len(ranges)))[rank::world_size]
    error = None
    leaves: Dict[int, bytes] = {}
    try:
        fd = os.open(path, os.O_RDONLY)
        try:
            leaves = dict(parallel_map(lambda i: (i, _hash_range(fd, *ranges[i])), mine, world_size))
        finally:
            os.close(fd)
    except OSError as exc:
        error = f"reading {path} failed: {exc}"
    parts = gather((leaves, error)) if gather is not None else [(leaves, error)]
    for part, problem in parts:
        if problem:
            raise CorruptCheckpointError(problem)
        leaves.update(part)
    actual = combine([leaves[i] for i in range(len(ranges))])
    if actual != trailer.digest:
        raise ChecksumMismatchError(
            f"{path} is corrupt: the {ALGORITHM} of its {trailer.covered} bytes (a tree of 64 MiB leaves) is "
            f"{actual} but {trailer.digest} was recorded when it was written. Resume from an earlier checkpoint "
            f"(or set {VERIFY_ENV}=0 to load it anyway)."
        )


_STRINGS = {"SHORT_BINUNICODE", "BINUNICODE", "UNICODE", "BINUNICODE8"}
_INTS = {"BININT", "BININT1", "BININT2", "LONG1", "INT", "LONG"}


def peek_format_version(path: str) -> Optional[int]:
    """The manifest's format_version in a torch file without a trailer, read from the pickle's opcodes
    (pickletools decodes them; nothing is constructed); None when it cannot be found."""
    try:
        with zipfile.ZipFile(path) as zf:
            name = next(n for n in zf.namelist() if n.endswith("/data.pkl") and n.count("/") == 1)
            data = zf.read(name)
        after_key = False
        for op, arg, _ in pickletools.genops(data):
            if op.name in _STRINGS:
                after_key = arg == "format_version"
            elif after_key and op.name in _INTS:
                return int(arg)
            elif op.name not in ("MEMOIZE", "BINPUT", "LONG_BINPUT", "PUT"):
                after_key = False
    except Exception:  # a damaged file: the caller's message says enough
        return None
    return None

"""Checksums for every checkpoint file and for the manifests, and filesystem errors that say what and where.

Bytes flipped inside a tensor load silently as wrong weights (1e30, NaN), a
flipped or edited `global_step` resumes at the wrong position (skipped data),
and a full disk surfaces from torch's zip writer as "unexpected pos 704 vs
598". This file closes those gaps for every format:
- a directory checkpoint's manifest records the sha256 of every file it
  holds (`checksums`: relative path -> {sha256, bytes}); each rank hashes
  the files it wrote, rank 0 merges them into the manifest before the
  commit. A one-file checkpoint carries one digest of all its bytes, the
  manifest included, in its own trailer (onefile.py).
- every manifest carries its own seal (`manifest_sha256`, over its canonical
  JSON), and `check_agreement` compares its fields with the trainer state the
  checksummed files hold, so an edited step is refused however it was edited.
- loading verifies all of it before anything is unpickled, spread over the
  ranks, unless SHARDWISE_VERIFY_CHECKSUMS=0, which `note_unverified` says once
  per checkpoint and process.
- a write that fails in the filesystem (ENOSPC, EROFS, EACCES, EDQUOT)
  becomes CheckpointWriteError naming the errno, the path and the fix;
  `check_writable(directory)` finds a read-only or full directory before the
  first step instead of at the first save.
"""

from __future__ import annotations

import errno
import hashlib
import json
import os
import shutil
import warnings
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Callable, Dict, Iterable, List, Optional

import torch.distributed as dist

from shardwise.checkpoint.errors import (
    CheckpointWriteError,
    ChecksumMismatchError,
    CorruptCheckpointError,
    ManifestMismatchError,
)

# The manifest's file name. It lives here, not in layout.py (which re-exports it), because
# layout.py writes checkpoints through this module, and this module rewrites the manifest.
MANIFEST_NAME = "shardwise.json"
ALGORITHM = "sha256"
SEAL_KEY = "manifest_sha256"
VERIFY_ENV = "SHARDWISE_VERIFY_CHECKSUMS"
PART_PREFIX = ".checksums-rank"
# Fields of a manifest that describe the checksums, not the checkpoint: not compared with the trainer state.
_INTEGRITY_KEYS = ("checksums", SEAL_KEY)
_noted: set = set()


def verify_enabled() -> bool:
    """Checksums are verified on load unless SHARDWISE_VERIFY_CHECKSUMS=0 (for a trusted, fast disk)."""
    return os.environ.get(VERIFY_ENV, "1").strip().lower() not in ("0", "false", "no", "off")


def note_unverified(path: str) -> None:
    """Say (once per checkpoint and process, on rank 0) that SHARDWISE_VERIFY_CHECKSUMS=0 skipped its checks."""
    key = os.path.realpath(path)
    if key in _noted or (dist.is_available() and dist.is_initialized() and dist.get_rank() != 0):
        return
    _noted.add(key)
    warnings.warn(
        f"{VERIFY_ENV}=0: the checksums of {path} are not verified; damaged or edited files load as they are.",
        stacklevel=3,
    )


def wanted(verify: Optional[bool], path: str) -> bool:
    """Whether to verify: `verify` when given (inspect's --no-verify), else unless the opt-out is set,
    which is then said (`note_unverified`)."""
    if verify is not None:
        return verify
    if verify_enabled():
        return True
    note_unverified(path)
    return False


def parallel_map(fn: Callable[[Any], Any], items: List[Any], share: int = 1) -> List[Any]:
    """fn over items on up to one thread per core, or per `share` cores where that many processes
    hash at once (hashlib releases the GIL while it hashes)."""
    workers = min(len(items), max(1, (os.cpu_count() or 1) // max(1, share)))
    if workers <= 1:
        return [fn(item) for item in items]
    with ThreadPoolExecutor(max_workers=workers) as pool:
        return list(pool.map(fn, items))


# ------------------------------------------------------------------ hashing
def file_digest(path: str) -> Dict[str, Any]:
    with open(path, "rb") as fh:
        digest = hashlib.file_digest(fh, ALGORITHM)
    return {ALGORITHM: digest.hexdigest(), "bytes": os.path.getsize(path)}


def hash_files(directory: str, relpaths: Iterable[str]) -> Dict[str, Dict[str, Any]]:
    relpaths = list(relpaths)
    sums = parallel_map(lambda rel: file_digest(os.path.join(directory, rel)), relpaths)
    return dict(zip(relpaths, sums))


# ---------------------------------------------------------------- manifests
def _manifest_path(directory: str) -> str:
    return os.path.join(directory, MANIFEST_NAME)


def _canonical(manifest: Dict[str, Any]) -> Dict[str, Any]:
    """The manifest as JSON gives it back (tuples as lists, keys as strings), without its seal."""
    return json.loads(json.dumps({k: v for k, v in manifest.items() if k != SEAL_KEY}, default=str))


def _seal_of(plain: Dict[str, Any]) -> str:
    text = json.dumps(plain, sort_keys=True, separators=(",", ":"), ensure_ascii=True)
    return hashlib.new(ALGORITHM, text.encode()).hexdigest()


def seal(manifest: Dict[str, Any]) -> Dict[str, Any]:
    """`manifest` as plain JSON data with its own sha256 (`manifest_sha256`, over its canonical JSON)."""
    plain = _canonical(manifest)
    return {**plain, SEAL_KEY: _seal_of(plain)}


def check_seal(manifest: Dict[str, Any], where: str) -> None:
    """ChecksumMismatchError if the manifest's fields were changed after it was sealed.

    A manifest without a seal (written before manifests had one) passes: its fields are
    still compared with the checksummed trainer state (`check_agreement`) on load.
    """
    recorded = manifest.get(SEAL_KEY)
    if recorded is None:
        return
    actual = _seal_of(_canonical(manifest))
    if actual != recorded:
        raise ChecksumMismatchError(
            f"{where} was changed after it was written: the {ALGORITHM} of its fields is {actual} but it "
            f"recorded {recorded}. Resume from an earlier checkpoint (or set {VERIFY_ENV}=0 to load it anyway)."
        )


def check_agreement(where: str, manifest: Dict[str, Any], state: Dict[str, Any]) -> None:
    """ManifestMismatchError unless the manifest's fields equal those the (verified) trainer state holds.

    The trainer state keeps its own copy of the manifest (`state["shardwise"]`) and the
    position (`state["train_state"]`); a manifest whose step, epoch, run or format differs from
    them was edited, and resuming by it would start at the wrong place.
    """
    saved = _canonical(state.get("shardwise") or {})
    position = _canonical(state.get("train_state") or {})
    differ = [
        (key, manifest.get(key), value)
        for source in (saved, position)
        for key, value in source.items()
        if key not in _INTEGRITY_KEYS and (source is saved or key in manifest) and manifest.get(key) != value
    ]
    if differ:
        listed = ", ".join(f"{k}={m!r} in the manifest but {v!r} in the checkpoint's state" for k, m, v in differ[:4])
        raise ManifestMismatchError(
            f"{where}: the manifest disagrees with the state the checkpoint holds ({listed}): it was edited "
            f"after the save. Resume from an earlier checkpoint (or set {VERIFY_ENV}=0 to load it anyway)."
        )


def write_json_durably(path: str, obj: Any) -> None:
    tmp = path + ".partial"
    try:
        with open(tmp, "w") as fh:
            json.dump(obj, fh, indent=2)
            fh.flush()
            os.fsync(fh.fileno())
        os.replace(tmp, path)
    except OSError as exc:
        _remove_quietly(tmp)
        raise write_error(exc, path) from exc


def write_manifest(directory: str, manifest: Dict[str, Any]) -> None:
    """The directory's manifest, sealed (`seal`), written atomically."""
    write_json_durably(_manifest_path(directory), seal(manifest))


def record_checksums(directory: str, sums: Dict[str, Dict[str, Any]]) -> None:
    """Merge `sums` into the directory's manifest and re-seal it (rank 0, before the commit)."""
    path = _manifest_path(directory)
    with open(path) as fh:
        manifest = json.load(fh)
    manifest.setdefault("checksums", {}).update(sums)
    write_manifest(directory, manifest)


def write_checksum_part(directory: str, rank: int, sums: Dict[str, Dict[str, Any]]) -> None:
    """One rank's sums, for async saves whose writes finish in a background thread (no collective there)."""
    write_json_durably(os.path.join(directory, f"{PART_PREFIX}{rank}.json"), sums)


def merge_checksum_parts(directory: str) -> None:
    """Fold the per-rank `.checksums-rankN.json` of an async save into the manifest (rank 0, before commit).

    Optional: load reads the parts as well, so an uncommitted merge loses nothing.
    """
    if not os.path.isdir(directory):
        return
    parts = sorted(n for n in os.listdir(directory) if n.startswith(PART_PREFIX))
    if not parts:
        return
    sums: Dict[str, Any] = {}
    for name in parts:
        with open(os.path.join(directory, name)) as fh:
            sums.update(json.load(fh))
    record_checksums(directory, sums)
    for name in parts:
        _remove_quietly(os.path.join(directory, name))


def recorded_checksums(directory: str, manifest: Dict[str, Any]) -> Dict[str, Dict[str, Any]]:
    sums = dict(manifest.get("checksums") or {})
    for name in sorted(os.listdir(directory)):
        if name.startswith(PART_PREFIX):
            try:
                with open(os.path.join(directory, name)) as fh:
                    sums.update(json.load(fh))
            except (OSError, ValueError) as exc:
                raise CorruptCheckpointError(f"{os.path.join(directory, name)} is unreadable: {exc}") from exc
    return sums


def check_file(directory: str, rel: str, expected: Dict[str, Any]) -> Optional[str]:
    """None when `rel` matches its recorded sum, else what is wrong with it, naming the file."""
    path = os.path.join(directory, rel)
    if not os.path.exists(path):
        return f"{path} is missing: the checkpoint is incomplete."
    actual = file_digest(path)
    if actual[ALGORITHM] != expected.get(ALGORITHM):
        return (
            f"{path} is corrupt: its {ALGORITHM} is {actual[ALGORITHM]} ({actual['bytes']} bytes) but the "
            f"manifest recorded {expected.get(ALGORITHM)} ({expected.get('bytes')} bytes) when it was "
            f"written. Resume from an earlier checkpoint (or set {VERIFY_ENV}=0 to load it anyway)."
        )
    return None


def verify_files(
    directory: str, sums: Dict[str, Dict[str, Any]], relpaths: Iterable[str], share: int = 1
) -> Optional[str]:
    """None when every listed file matches its recorded sum, else the first problem, naming the file."""
    relpaths = list(relpaths)
    problems = parallel_map(lambda rel: check_file(directory, rel, sums[rel]), relpaths, share)
    return next((p for p in problems if p), None)


def verify_directory(
    directory: str,
    manifest: Dict[str, Any],
    rank: int = 0,
    world_size: int = 1,
    gather: Any = None,
    only: Optional[Iterable[str]] = None,
    verify: Optional[bool] = None,
) -> None:
    """Check every recorded file (or those in `only`), this rank taking every world_size-th.

    `gather(obj) -> list` must be a collective over the loading ranks (or None in one process), so
    that every rank raises together instead of some waiting in the next collective. `verify`:
    see `wanted` (None: unless SHARDWISE_VERIFY_CHECKSUMS=0).
    """
    if not wanted(verify, directory):
        return
    sums = recorded_checksums(directory, manifest)
    names = sorted(sums if only is None else set(only) & set(sums))
    problem = verify_files(directory, sums, names[rank::world_size], world_size) if names else None
    problems = [p for p in (gather(problem) if gather is not None else [problem]) if p]
    if problems:
        raise ChecksumMismatchError(problems[0])


# ------------------------------------------------------------ write errors
_FIX = {
    errno.ENOSPC: "no space left on the device: free space or point the checkpoint directory at a larger disk "
    "(the previous checkpoints are untouched)",
    errno.EDQUOT: "the disk quota is exceeded: free space or raise the quota",
    errno.EROFS: "the filesystem is read-only: choose a writable checkpoint directory (dirpath= / default_root_dir=)",
    errno.EACCES: "permission denied: choose a directory this user may write, or fix its permissions",
    errno.EPERM: "operation not permitted: choose a directory this user may write, or fix its permissions",
}


def find_os_error(exc: BaseException) -> Optional[OSError]:
    """The OSError behind `exc` (its cause / context chain, or DCP's per-rank failures)."""
    seen = set()
    stack: List[BaseException] = [exc]
    while stack:
        e = stack.pop()
        if e is None or id(e) in seen:
            continue
        seen.add(id(e))
        if isinstance(e, OSError) and e.errno:
            return e
        failures = getattr(e, "failures", None)  # torch's CheckpointException: {rank: (exception, trace)}
        if isinstance(failures, dict):
            for value in failures.values():
                value = value[0] if isinstance(value, tuple) and value else value
                if isinstance(value, BaseException):
                    stack.append(value)
        stack.extend([e.__cause__, e.__context__])
    return None


def write_error(exc: BaseException, path: str) -> CheckpointWriteError:
    """A CheckpointWriteError for a failed write of `path`, naming the errno when one is found."""
    if isinstance(exc, CheckpointWriteError):
        return exc
    os_error = find_os_error(exc)
    code = os_error.errno if os_error is not None else 0
    where = getattr(os_error, "filename", None) or path
    name = errno.errorcode.get(code, "")
    what = f"{name} ({os.strerror(code)})" if code else f"{type(exc).__name__}: {exc}"
    fix = _FIX.get(code, "check the disk and the directory's permissions")
    free = ""
    try:
        usage = shutil.disk_usage(os.path.dirname(os.path.abspath(path)) or ".")
        free = f" The filesystem has {usage.free / 2**20:,.1f} MiB free."
    except OSError:
        pass
    return CheckpointWriteError(f"Writing checkpoint file {where} failed: {what}; {fix}.{free}", code, where)


class RecordingWriter:
    """A binary file for torch.save that keeps the OSError its write raised.

    torch's zip writer reports a failed write as "unexpected pos N vs M" and
    drops the reason; this wrapper lets the caller re-raise the real one.
    """

    def __init__(self, fh: Any) -> None:
        self._fh = fh
        self.error: Optional[OSError] = None

    def write(self, data: Any) -> int:
        try:
            return self._fh.write(data)
        except OSError as exc:
            self.error = self.error or exc
            raise

    def flush(self) -> None:
        self._fh.flush()

    def fileno(self) -> int:
        return self._fh.fileno()

    def __getattr__(self, name: str) -> Any:
        return getattr(self._fh, name)


def _remove_quietly(path: str) -> None:
    try:
        os.unlink(path)
    except OSError:
        pass


def check_writable(directory: str) -> None:
    """Raise CheckpointWriteError unless `directory` can be created and a file written, synced and removed in it.

    Call before the first step so that a read-only mount, a missing permission
    or a full disk stops the run at once instead of at its first checkpoint.
    """
    directory = os.path.abspath(os.path.expanduser(os.fspath(directory)))
    probe = os.path.join(directory, f".shardwise-write-test-{os.getpid()}-{os.urandom(3).hex()}")
    try:
        os.makedirs(directory, exist_ok=True)
        fd = os.open(probe, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
        try:
            os.write(fd, b"\0" * 4096)  # a real block, so a full disk answers ENOSPC here
            os.fsync(fd)
        finally:
            os.close(fd)
    except OSError as exc:
        _remove_quietly(probe)
        error = write_error(exc, probe if os.path.isdir(directory) else directory)
        raise CheckpointWriteError(
            f"The checkpoint directory {directory} is not writable. {error}", error.errno, error.filename
        ) from exc
    _remove_quietly(probe)

"""Where checkpoints live on disk and how they appear there atomically.

A checkpoint is either ONE FILE (format "full": a torch.save'd dict holding
the consolidated model, optimizers and trainer state) or ONE DIRECTORY
(format "sharded": torch.distributed.checkpoint files, one per rank, plus
`trainer_state.pt` and a human-readable `shardwise.json` manifest; other
directory formats such as DeepSpeed's follow the same rules). Either way it
is written under a hidden temporary name in the same directory
(`.NAME.tmp-TOKEN`) and renamed into place by rank 0 only after every rank
has finished writing: the rename is the commit. A checkpoint directory's
`last.ckpt` is a relative symlink moved (atomically, by rename) only after the
checkpoint it points to is committed, and old checkpoints are deleted only
after that. A process killed at any moment therefore leaves every
previously committed checkpoint, and `last.ckpt`, intact; what it leaves
behind is a hidden temporary entry that the next run removes.

Every checkpoint's manifest names the run that wrote it (`run_id`, kept
across the run's resumes). Looking for the checkpoint to resume (`last`)
never picks another run's: checkpoints of other runs in the directory are
named and left alone, and where the filesystem keeps extended attributes the
directory remembers which run committed the checkpoint `last.ckpt` points to
(`user.shardwise.last`), so another run's checkpoint copied over it under the
same name is refused (ForeignCheckpointError) instead of resumed.
"""

from __future__ import annotations

import ctypes
import datetime
import difflib
import json
import os
import shutil
import time
import warnings
from dataclasses import dataclass
from typing import Any, Dict, List, Optional

import torch

from shardwise._version import __version__
from shardwise.checkpoint import onefile
from shardwise.checkpoint.errors import (
    CheckpointNotFoundError,
    CheckpointVersionError,
    CorruptCheckpointError,
    ForeignCheckpointError,
    UnverifiableCheckpointError,
)
from shardwise.checkpoint.integrity import (
    MANIFEST_NAME,
    VERIFY_ENV,
    RecordingWriter,
    check_agreement,
    check_seal,
    file_digest,
    verify_enabled,
    write_error,
    write_manifest,
)
from shardwise.checkpoint.safety import plain_state, safe_torch_load, unsafe_error, unsafe_globals

#: Version of the on-disk layout. Bump it when a change makes old checkpoints
#: unreadable, and teach load() to read the old one or say how to convert it.
FORMAT_VERSION = 1
TRAINER_STATE_NAME = "trainer_state.pt"
SUFFIX = ".ckpt"
LAST_NAME = "last" + SUFFIX
_TEMP_MARK = ".tmp-"
_TRASH_MARK = ".deleting-"
_LAST_RECORD = "user.shardwise.last"  # extended attribute of a checkpoint directory (see the docstring)


def new_token() -> str:
    """A unique suffix for temporary names; uses os.urandom so no training RNG is disturbed."""
    return f"{int(time.time())}-{os.getpid()}-{os.urandom(3).hex()}"


def temp_path(final: str, token: str) -> str:
    parent, name = os.path.split(os.path.abspath(final))
    return os.path.join(parent, f".{name}{_TEMP_MARK}{token}")


def is_hidden_leftover(name: str) -> bool:
    return name.startswith(".") and (_TEMP_MARK in name or _TRASH_MARK in name)


# ---------------------------------------------------------------- manifest
def build_manifest(
    checkpoint_format: str, strategy: str, world_size: int, train_state: Dict[str, Any]
) -> Dict[str, Any]:
    return {
        "format_version": FORMAT_VERSION,
        "checkpoint_format": checkpoint_format,
        "strategy": strategy,
        "world_size": world_size,
        "epoch": int(train_state.get("epoch", 0)),
        "global_step": int(train_state.get("global_step", 0)),
        "batch_idx": int(train_state.get("batch_idx", 0)),
        "created": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "shardwise_version": __version__,
        "torch_version": str(torch.__version__),  # TorchVersion is a class; the manifest holds plain data
    }


def check_version(manifest: Dict[str, Any], path: str) -> None:
    found = manifest.get("format_version")
    if found != FORMAT_VERSION:
        raise CheckpointVersionError(
            f"{path} uses checkpoint layout version {found!r} (written by shardwise "
            f"{manifest.get('shardwise_version', '?')}), but this shardwise reads version {FORMAT_VERSION}. "
            "Load it with the shardwise release that wrote it and re-save, or export the weights with that "
            "release's `shardwise convert`."
        )


def fsync_file(path: str) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def fsync_dir(path: str) -> None:
    """Make a rename durable: fsync the directory that holds the entry."""
    try:
        fsync_file(path)
    except OSError:  # some filesystems refuse fsync on directories
        pass


def save_torch_durably(obj: Any, path: str, manifest: Optional[Dict[str, Any]] = None) -> None:
    """torch.save + flush + fsync, so a later rename never exposes a half-written file.

    With `manifest`, the file is a one-file checkpoint: the manifest and the digest of every
    byte are appended as its trailer (onefile.py), hashed as torch writes them.
    A failed write (full disk, read-only filesystem) removes the partial file
    and raises CheckpointWriteError with the real errno: torch's zip writer
    would otherwise report only "unexpected pos N vs M".
    """
    writer: Any = None
    try:
        with open(path, "wb") as fh:
            writer = RecordingWriter(fh) if manifest is None else onefile.TrailerWriter(fh)
            torch.save(obj, writer)
            if manifest is not None:
                writer.finish(manifest)
            fh.flush()
            os.fsync(fh.fileno())
    except (OSError, RuntimeError) as exc:
        try:
            os.unlink(path)
        except OSError:
            pass
        if isinstance(exc, OSError) or (writer is not None and writer.error is not None):
            raise write_error(writer.error if writer is not None and writer.error else exc, path) from exc
        raise


def write_trainer_state(directory: str, state: Dict[str, Any]) -> None:
    """For directory formats: write `state` and the JSON manifest into `directory` (rank 0 only).

    Strategies with their own directory format (DeepSpeed) call this from
    `Strategy.save_checkpoint` so that every directory checkpoint is
    recognised, inspected and resumed the same way.
    """
    try:
        os.makedirs(directory, exist_ok=True)
    except OSError as exc:
        raise write_error(exc, directory) from exc
    state_path = os.path.join(directory, TRAINER_STATE_NAME)
    # Plain data only (an object in hparams becomes its repr): loading never unpickles code.
    save_torch_durably(plain_state(state, "trainer state"), state_path)
    # The data files' sums are added by the strategy once every rank has written them.
    write_manifest(directory, {**state["shardwise"], "checksums": {TRAINER_STATE_NAME: file_digest(state_path)}})


def read_trainer_state(directory: str, verify: Optional[bool] = None) -> Dict[str, Any]:
    """A directory checkpoint's trainer state (verify its checksum first), checked against the manifest
    unless `verify` is False (None: unless SHARDWISE_VERIFY_CHECKSUMS=0)."""
    state = load_torch(os.path.join(directory, TRAINER_STATE_NAME))
    if verify_enabled() if verify is None else verify:
        check_agreement(os.path.join(directory, MANIFEST_NAME), read_manifest(directory, verify), state)
    return state


def load_torch(path: str, map_location: Any = "cpu", mmap: bool = False) -> Any:
    """torch.load of tensors and plain data only (safety.py): a file that asks to run code is refused
    (UnsafeCheckpointError) and a damaged one is CorruptCheckpointError; both name the file."""
    if not os.path.exists(path):
        raise CorruptCheckpointError(f"{path} is missing: the checkpoint is incomplete.")
    return safe_torch_load(path, map_location=map_location, mmap=mmap)


def read_manifest(path: str, verify: Optional[bool] = None) -> Dict[str, Any]:
    """The manifest of the checkpoint at `path` (a file or a directory), its seal checked; reads no tensor.

    A one-file checkpoint's manifest comes from its trailer, unpickling nothing. A file without a
    trailer cannot be verified before unpickling: it is refused with the reason (code it would
    run, damage, another layout version, or UnverifiableCheckpointError naming the opt-out).
    `verify=False` (or, when None, SHARDWISE_VERIFY_CHECKSUMS=0) skips the seal and reads such a
    file's manifest from its pickled structure instead.
    """
    verify = verify_enabled() if verify is None else verify
    if os.path.isdir(path):
        manifest_path = os.path.join(path, MANIFEST_NAME)
        if not os.path.exists(manifest_path):
            hint = (
                " It looks like a directory of checkpoints: pass one of them, or ckpt_path='last'."
                if list_checkpoints(path)
                else ""
            )
            raise CorruptCheckpointError(f"{path} is not a shardwise checkpoint: it has no {MANIFEST_NAME}.{hint}")
        try:
            with open(manifest_path) as fh:
                manifest = json.load(fh)
        except (ValueError, OSError) as exc:
            raise CorruptCheckpointError(f"{manifest_path} is truncated or corrupt: {exc}") from exc
        if not isinstance(manifest, dict):
            raise CorruptCheckpointError(f"{manifest_path} is corrupt: not a JSON object.")
        if verify:
            check_seal(manifest, manifest_path)
        return manifest
    if not os.path.exists(path):
        raise CorruptCheckpointError(f"{path} is missing: the checkpoint is incomplete.")
    comment = onefile.archive_comment(path)
    if comment:
        manifest = onefile.parse_trailer(path, comment).manifest
        if verify:
            check_seal(manifest, f"The manifest in {path}'s trailer")
        return manifest
    return _manifest_without_trailer(path, comment is not None, verify)


def _manifest_without_trailer(path: str, is_zip: bool, verify: bool) -> Dict[str, Any]:
    """The reason a file without a trailer is refused (read from its structure, nothing unpickled),
    or with SHARDWISE_VERIFY_CHECKSUMS=0 its manifest, unpickled without tensors."""
    names = unsafe_globals(path)
    if names:
        raise unsafe_error(path, "", names)
    if not is_zip:
        raise CorruptCheckpointError(
            f"{path} is truncated or corrupt: it does not end like a torch (zip) file "
            f"({os.path.getsize(path)} bytes). Resume from an earlier checkpoint."
        )
    version = onefile.peek_format_version(path)
    if version is not None:
        check_version({"format_version": version, "shardwise_version": "?"}, path)
    if verify:
        raise UnverifiableCheckpointError(
            f"{path} carries no checksum trailer, so nothing can verify it before it is unpickled: it was "
            "written by a shardwise from before one-file checkpoints carried one, or by plain torch.save. If "
            f"you trust it, load it once with {VERIFY_ENV}=0 (unverified; the checkpoints that run saves are "
            "verified)."
        )
    # Load it on the meta device, which reads only the pickled structure, never the tensor
    # bytes (and through the safe unpickler).
    payload = load_torch(path, map_location="meta")
    if not isinstance(payload, dict) or "shardwise" not in payload:
        raise CorruptCheckpointError(f"{path} is a torch file but not a shardwise checkpoint (no 'shardwise' entry).")
    return payload["shardwise"]


def run_of(path: str) -> Optional[str]:
    """The run id in the manifest of the checkpoint at `path`; None when it has none or is unreadable."""
    try:
        run_id = read_manifest(path).get("run_id")
    except Exception:  # noqa: BLE001 - unreadable: whoever loads it says why
        return None
    return str(run_id) if run_id else None


# -------------------------------------------------------------- committing
_RENAME_EXCHANGE = 2
_AT_FDCWD = -100


def _exchange(a: str, b: str) -> bool:
    """Atomically swap two existing paths (Linux renameat2); False when unsupported."""
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        fn = libc.renameat2
    except (OSError, AttributeError):
        return False
    return fn(_AT_FDCWD, os.fsencode(a), _AT_FDCWD, os.fsencode(b), _RENAME_EXCHANGE) == 0


def commit(tmp: str, final: str) -> None:
    """Rename a finished temporary checkpoint into place (rank 0). Replacing an existing one is atomic too."""
    if os.path.lexists(final):
        if os.path.isfile(tmp) and os.path.isfile(final) and not os.path.islink(final):
            os.replace(tmp, final)
        elif _exchange(tmp, final):
            remove_checkpoint(tmp)  # now holds the old checkpoint
        else:  # no atomic swap here: move the old one aside first (a short window without `final`)
            aside = temp_path(final, new_token()).replace(_TEMP_MARK, _TRASH_MARK)
            os.rename(final, aside)
            os.rename(tmp, final)
            remove_checkpoint(aside)
    else:
        os.rename(tmp, final)
    fsync_dir(os.path.dirname(os.path.abspath(final)))


def remove_checkpoint(path: str) -> None:
    """Delete a checkpoint so that no half-deleted one is ever visible under its name."""
    if os.path.islink(path) or not os.path.exists(path):
        if os.path.lexists(path):
            os.unlink(path)
        return
    trash = path
    if not is_hidden_leftover(os.path.basename(path)):
        trash = temp_path(path, new_token()).replace(_TEMP_MARK, _TRASH_MARK)
        os.rename(path, trash)
    if os.path.isdir(trash):
        shutil.rmtree(trash, ignore_errors=True)
    else:
        os.unlink(trash)


def remove_leftovers(directory: str) -> List[str]:
    """Delete hidden temporary / half-deleted entries a killed run left in `directory`."""
    removed = []
    if not os.path.isdir(directory):
        return removed
    for name in os.listdir(directory):
        if is_hidden_leftover(name):
            remove_checkpoint(os.path.join(directory, name))
            removed.append(name)
    return removed


def point_last(directory: str, target: str, name: str = LAST_NAME) -> str:
    """Atomically make `directory/last.ckpt` a relative symlink to `target` (a checkpoint in `directory`)."""
    link = os.path.join(directory, name)
    tmp = temp_path(link, new_token())
    os.symlink(os.path.relpath(os.path.abspath(target), os.path.abspath(directory)), tmp)
    os.replace(tmp, link)  # rename() replaces the link itself, never what it points to
    fsync_dir(directory)
    _record_last(directory, target)
    return link


def _record_last(directory: str, target: str) -> None:
    """Remember (an extended attribute of the directory) which run committed `target`, where supported.

    A crash between moving the link and this leaves the previous record, naming another
    checkpoint: compared only when the names match, it never refuses a sound checkpoint.
    """
    run_id = run_of(target)
    if not run_id or not hasattr(os, "setxattr"):
        return
    try:
        os.setxattr(directory, _LAST_RECORD, json.dumps({"name": os.path.basename(target), "run_id": run_id}).encode())
    except OSError:  # no extended attributes on this filesystem (or no permission): nothing remembered
        pass


def recorded_last(directory: str) -> Optional[Dict[str, Any]]:
    """{name, run_id} of the checkpoint a run last pointed `last.ckpt` at in `directory`, if recorded."""
    try:
        record = json.loads(os.getxattr(directory, _LAST_RECORD))
    except (OSError, ValueError, AttributeError):
        return None
    return record if isinstance(record, dict) else None


def replaced_reason(path: str, run_id: Optional[str]) -> Optional[str]:
    """Why the checkpoint at `path` is not the one its directory's run committed under that name, if so."""
    record = recorded_last(os.path.dirname(os.path.abspath(path)))
    if not record or record.get("name") != os.path.basename(path) or not record.get("run_id"):
        return None
    if run_id == record["run_id"]:
        return None
    return (
        f"{path} holds a checkpoint of run {run_id or '(none recorded)'}, but run {record['run_id']} committed "
        "the checkpoint of that name here and pointed last.ckpt at it: another run's checkpoint was copied over "
        "it (or that run started here without resuming and was interrupted in its first save)"
    )


# ------------------------------------------------------------------ finding
@dataclass
class CheckpointEntry:
    path: str
    manifest: Dict[str, Any]

    @property
    def step(self) -> int:
        return int(self.manifest.get("global_step", -1))


def list_checkpoints(directory: str, skipped: Optional[List[str]] = None) -> List[CheckpointEntry]:
    """Committed shardwise checkpoints in `directory`, oldest step first (symlinks and leftovers skipped).

    Reads manifests only (JSON, or a one-file checkpoint's structure through the
    safe unpickler). Entries that cannot be read are left out and, when given,
    appended to `skipped` as "path: reason".
    """
    entries: List[CheckpointEntry] = []
    if not os.path.isdir(directory):
        return entries
    for name in os.listdir(directory):
        path = os.path.join(directory, name)
        if name.startswith(".") or os.path.islink(path):
            continue
        is_dir_ckpt = os.path.isdir(path) and os.path.exists(os.path.join(path, MANIFEST_NAME))
        if not (is_dir_ckpt or (os.path.isfile(path) and name.endswith(SUFFIX))):
            continue
        try:
            entries.append(CheckpointEntry(path, read_manifest(path)))
        except Exception as exc:  # unreadable or unsafe: not something to resume from
            if skipped is not None:
                skipped.append(f"{path}: {type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}")
            continue
    entries.sort(key=lambda e: (e.step, os.path.getmtime(e.path)))
    return entries


def latest_checkpoint(directory: str) -> Optional[str]:
    """`directory/last.ckpt` if it points to something, else the committed checkpoint with the highest step.

    A run killed after committing a checkpoint but before moving `last` to it
    leaves that checkpoint newer than `last`: it is the resume point when its
    manifest names the same run (run_id) as `last`'s target. Another run's
    checkpoints in the directory are never picked: they are named in a warning,
    and without a `last.ckpt` to say which run is this directory's, checkpoints
    of several runs are a ForeignCheckpointError that asks for an explicit path.
    """
    link = os.path.join(directory, LAST_NAME)
    if os.path.exists(link):  # exists() follows the link: a dangling one is skipped
        return _newest_of_the_same_run(directory, os.path.realpath(link))
    skipped: List[str] = []
    entries = list_checkpoints(directory, skipped)
    if skipped:
        warnings.warn(
            f"Skipped {len(skipped)} unreadable checkpoint(s) in {directory} while looking for the "
            "latest:\n  " + "\n  ".join(skipped) + "\nDelete or move them if they are not yours.",
            stacklevel=2,
        )
    runs: Dict[Any, CheckpointEntry] = {}
    for entry in entries:  # oldest first: the last one kept per run is its newest
        runs[entry.manifest.get("run_id")] = entry
    if len(runs) > 1:
        newest = "\n  ".join(f"{e.path} (run {run}, step {e.step})" for run, e in runs.items())
        raise ForeignCheckpointError(
            f"{directory} holds checkpoints of {len(runs)} different runs and no last.ckpt says which is this "
            f"run's; the newest of each:\n  {newest}\nPass the one to resume as ckpt_path."
        )
    return entries[-1].path if entries else None


def _newest_of_the_same_run(directory: str, target: str) -> str:
    try:
        manifest = read_manifest(target)
    except Exception:  # loading it will say what is wrong
        return target
    run_id, step = manifest.get("run_id"), int(manifest.get("global_step", -1))
    replaced = replaced_reason(target, run_id)
    if replaced:
        raise ForeignCheckpointError(
            f"last.ckpt in {directory} points to a checkpoint from another run: {replaced}. Pass it as ckpt_path "
            "to resume from it anyway, or an earlier checkpoint of this run."
        )
    if not run_id:
        return target
    entries = list_checkpoints(directory)
    others = [e for e in entries if e.manifest.get("run_id") != run_id]
    if others:
        listed = ", ".join(f"{os.path.basename(e.path)} (run {e.manifest.get('run_id')})" for e in others[-5:])
        warnings.warn(
            f"{directory} also holds {len(others)} checkpoint(s) of other runs than last.ckpt's (run {run_id}): "
            f"{listed}. They are not resumed; delete or move them if they are not meant to be there.",
            stacklevel=3,
        )
    newer = [e for e in entries if e.manifest.get("run_id") == run_id and e.step > step]
    if not newer:
        return target
    warnings.warn(
        f"{newer[-1].path} (step {newer[-1].step}) was committed after last.ckpt was last moved (the run "
        "was interrupted between the two): resuming from it.",
        stacklevel=3,
    )
    return newer[-1].path


def foreign_reason(path: str) -> Optional[str]:
    """Why the checkpoint at `path` belongs to another run than its directory's (`last.ckpt`'s), if it does."""
    path = os.path.realpath(path)
    directory = os.path.dirname(path)
    run_id = run_of(path)
    replaced = replaced_reason(path, run_id)
    if replaced:
        return replaced
    link = os.path.join(directory, LAST_NAME)
    if not os.path.exists(link) or os.path.realpath(link) == path:
        return None
    theirs = run_of(os.path.realpath(link))
    if theirs and theirs != run_id:
        return f"it is run {run_id or '(none recorded)'}'s, and {directory}'s last.ckpt is run {theirs}'s"
    return None


def candidate_names(directory: str) -> List[str]:
    """Names in `directory` that look like checkpoints, from the listing alone (no file is opened)."""
    if not os.path.isdir(directory):
        return []
    return sorted(
        n
        for n in os.listdir(directory)
        if not n.startswith(".") and (n.endswith(SUFFIX) or os.path.exists(os.path.join(directory, n, MANIFEST_NAME)))
    )


def describe_available(directories: List[str], wanted: Optional[str] = None) -> str:
    """What exists in `directories`, by name only: never opens a file (a stray pickle must not run).

    With `wanted` (the mistyped path), the closest names come first.
    """
    lines = []
    for directory in dict.fromkeys(os.path.abspath(d) for d in directories):
        names = candidate_names(directory)
        if not names:
            continue
        close = difflib.get_close_matches(os.path.basename(wanted), names, n=3, cutoff=0.5) if wanted else []
        if close:
            lines.append("  did you mean: " + ", ".join(os.path.join(directory, n) for n in close))
        shown = names[-10:]
        more = f" ... ({len(names) - len(shown)} more)" if len(names) > len(shown) else ""
        lines.append(f"  in {directory}: {', '.join(shown)}{more}")
    return "\n".join(lines) if lines else "  (none)"


def resolve(ckpt_path: str, search_dirs: List[str]) -> Optional[str]:
    """Turn fit(ckpt_path=...) into a committed checkpoint path; None for 'last' when nothing was saved yet."""
    if ckpt_path == "last":
        for directory in search_dirs:
            found = latest_checkpoint(directory)
            if found:
                return found
        return None
    path = os.path.abspath(os.path.expanduser(os.fspath(ckpt_path)))
    if not os.path.exists(path):
        dirs = [os.path.dirname(path)] + list(search_dirs)
        raise CheckpointNotFoundError(
            f"Checkpoint {path} does not exist. Pass an existing checkpoint path, or ckpt_path='last' to resume the "
            f"newest one. Checkpoints found:\n{describe_available(dirs, wanted=path)}"
        )
    if os.path.islink(path) and os.path.basename(path) == LAST_NAME:  # a run directory's `last`, by its name
        replaced = replaced_reason(os.path.realpath(path), run_of(path))
        if replaced:
            raise ForeignCheckpointError(
                f"{path} points to a checkpoint from another run: {replaced}. Pass the file it points to "
                "(not last.ckpt) to resume from it anyway."
            )
    return os.path.realpath(path)

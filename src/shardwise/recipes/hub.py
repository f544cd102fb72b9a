"""Hugging Face Hub names for models and data sets: resolved to a local snapshot, and the exported folder uploaded.

`shardwise finetune --model_name org/model --dataset_name org/chat` takes hub
ids where a folder or file was needed before: `resolve_model` and
`resolve_dataset` turn an id (with a revision) into a snapshot folder in the
Hugging Face cache through `huggingface_hub.snapshot_download`, so HF_HOME /
HF_HUB_CACHE, HF_TOKEN (or `hf auth login`), HF_HUB_OFFLINE and HF_ENDPOINT
mean what they mean everywhere else. A model brings only its safetensors,
config, tokenizer, generation config and chat template files: a pickle
(`*.bin`, `*.pth`) can run code when it is loaded, so it is never fetched, and
a repo that has nothing else is refused. Every process of a run asks, under
one file lock in the cache, so one process per cache (per node, or per
cluster on a shared file system) downloads and the others wait, saying so,
then find the files there. Every failure a user can fix -- a private or gated
repo without a token, a repo or revision that does not exist, offline with
nothing cached, a disk too small -- is a HubError naming the fix, raised
before any worker starts. A local path is returned unchanged.

`HubUpload` pushes the exported folder (`--push_to_hub`) from global rank 0 in
a background thread, after the export is written and verified; a failed
upload leaves the folder in place and prints the command that retries it.
"""

from __future__ import annotations

import fnmatch
import os
import re
import shutil
import sys
import threading
from dataclasses import dataclass
from typing import Any, Callable, List, Optional, Sequence

# What a model needs: weights, config, tokenizer (incl. sentencepiece / tiktoken), generation config, chat template.
MODEL_PATTERNS = ["*.safetensors", "*.json", "*.model", "*.jinja", "merges.txt", "vocab.txt", "*.tiktoken"]
CONFIG_PATTERNS = ["config.json"]
TOKENIZER_PATTERNS = [p for p in MODEL_PATTERNS if p != "*.safetensors"]
PICKLE_PATTERNS = ("*.bin", "*.pth", "*.pt", "*.ckpt", "*.pkl")
DATA_SUFFIXES = (".jsonl", ".json", ".jsonl.gz", ".json.gz", ".parquet", ".csv", ".arrow")
DATASET_IGNORE = ["*.py", ".gitattributes"]  # no loading scripts: datasets no longer runs them
HUB_STRATEGIES = ("end", "every_save")
_ID = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]*/[A-Za-z0-9][A-Za-z0-9._-]*$")
_COMMIT = re.compile(r"^[0-9a-f]{40}$")
_LOGIN = "set HF_TOKEN=<your token> (https://huggingface.co/settings/tokens) or run `hf auth login`"


class HubError(ValueError):
    """A hub name cannot be resolved or uploaded to; the message says what to do."""


@dataclass(frozen=True)
class Snapshot:
    """Where a hub id resolved to: the local snapshot folder and the commit it holds."""

    repo_id: str
    repo_type: str  # "model" | "dataset"
    revision: str  # as asked (a branch, a tag, a commit)
    commit: str
    path: str


def is_hub_id(name: Optional[str]) -> bool:
    """`org/name` that is not an existing local path (a local folder always wins, as in from_pretrained)."""
    if not name or os.path.exists(name) or name.startswith((".", "/", "~")):
        return False
    return bool(_ID.match(name))


def snapshot_commit(path: str) -> Optional[str]:
    """The commit of a path inside the hub cache (`.../snapshots/<commit>/...`), else None."""
    parts = os.path.abspath(path).split(os.sep)
    for i, part in enumerate(parts[:-1]):
        if part == "snapshots" and _COMMIT.match(parts[i + 1]):
            return parts[i + 1]
    return None


def cache_dir() -> str:
    from huggingface_hub import constants

    return constants.HF_HUB_CACHE  # HF_HUB_CACHE, else $HF_HOME/hub, as huggingface_hub read them


def _offline() -> bool:
    from huggingface_hub import constants

    return bool(constants.is_offline_mode())


def _say(message: str) -> None:
    rank = os.environ.get("RANK")
    print(f"shardwise hub{f' [rank {rank}]' if rank else ''}: {message}", file=sys.stderr, flush=True)


def _matches(name: str, patterns: Sequence[str]) -> bool:
    return any(fnmatch.fnmatch(name, p) or fnmatch.fnmatch(os.path.basename(name), p) for p in patterns)


def _size(n: int) -> str:
    return f"{n / 2**30:.2f} GiB" if n >= 2**30 else f"{n / 2**20:.2f} MiB"


def _free_bytes(folder: str) -> int:
    while not os.path.exists(folder):
        folder = os.path.dirname(folder) or "."
    return shutil.disk_usage(folder).free


def _check_remote(
    repo_id: str, repo_type: str, revision: str, token: Optional[str], patterns: Optional[Sequence[str]], what: str
) -> None:
    """Online: the repo's file list, before anything is fetched: pickles-only refused, the disk checked."""
    from huggingface_hub import HfApi
    from huggingface_hub.errors import EntryNotFoundError
    from huggingface_hub.file_download import repo_folder_name

    try:
        files = [
            f
            for f in HfApi(token=token).list_repo_tree(repo_id, revision=revision, repo_type=repo_type, recursive=True)
            if getattr(f, "size", None) is not None
        ]
    except EntryNotFoundError:
        files = []
    names = [f.path for f in files]
    if repo_type == "model" and patterns is MODEL_PATTERNS and not any(n.endswith(".safetensors") for n in names):
        pickles = [n for n in names if _matches(n, PICKLE_PATTERNS)]
        if pickles:
            raise HubError(
                f"{what} {repo_id!r} (revision {revision}) has only PyTorch pickle weights ({', '.join(pickles[:4])}). "
                "shardwise loads safetensors only: unpickling a file can run code. Use a revision with "
                "*.safetensors (many repos have a safetensors conversion on a refs/pr/N branch: --revision refs/pr/N), "
                "or convert once on a trusted machine with from_pretrained + save_pretrained(safe_serialization=True) "
                "and give that folder."
            )
        raise HubError(f"{what} {repo_id!r} (revision {revision}) has no *.safetensors weights; files there: {names}.")
    wanted = [f for f in files if patterns is None or _matches(f.path, patterns)]
    if repo_type == "dataset":
        wanted = [f for f in wanted if not _matches(f.path, DATASET_IGNORE)]
    # What the cache holds already (blobs are named by their etag: the LFS sha256, else the git blob id) is free.
    blobs = os.path.join(cache_dir(), repo_folder_name(repo_id=repo_id, repo_type=repo_type), "blobs")
    need = sum(
        int(f.size) for f in wanted if not os.path.exists(os.path.join(blobs, f.lfs.sha256 if f.lfs else f.blob_id))
    )
    free = _free_bytes(cache_dir())
    if need > free:
        raise HubError(
            f"{what} {repo_id!r} (revision {revision}) needs {_size(need)} in the hub cache {cache_dir()} "
            f"but only {_size(free)} are free there. Free space, or point HF_HUB_CACHE (or HF_HOME) at a "
            "larger disk."
        )


def _explain(exc: Exception, repo_id: str, repo_type: str, revision: str, token: Optional[str], what: str) -> HubError:
    from huggingface_hub.errors import (
        GatedRepoError,
        HfHubHTTPError,
        LocalEntryNotFoundError,
        RepositoryNotFoundError,
        RevisionNotFoundError,
    )

    url = ("datasets/" if repo_type == "dataset" else "") + repo_id
    if isinstance(exc, RevisionNotFoundError):
        return HubError(
            f"{what} {repo_id!r}: revision {revision!r} does not exist. Give a branch, tag or commit hash of the repo "
            f"(see https://huggingface.co/{url}/tree/main), or drop the revision for main."
        )
    if isinstance(exc, GatedRepoError):
        return HubError(
            f"{what} {repo_id!r} is gated: accept its terms at https://huggingface.co/{url} with your account, then "
            f"{_LOGIN}." + (" The token given has no access yet." if token or os.environ.get("HF_TOKEN") else "")
        )
    if isinstance(exc, RepositoryNotFoundError) or (
        isinstance(exc, HfHubHTTPError) and getattr(exc.response, "status_code", None) in (401, 403)
    ):
        has_token = bool(token or os.environ.get("HF_TOKEN"))
        return HubError(
            f"{what} {repo_id!r} does not exist, or it is private or gated and "
            + ("the token given (HF_TOKEN / --hub_token) has no access to it" if has_token else "no token was given")
            + f". Check the name ({'--dataset_name' if repo_type == 'dataset' else '--model_name'}); for a private "
            f"or gated repo {_LOGIN}."
        )
    if isinstance(exc, LocalEntryNotFoundError) or _offline():
        why = "HF_HUB_OFFLINE=1 is set" if _offline() else f"the hub could not be reached ({exc})"
        return HubError(
            f"{what} {repo_id!r} (revision {revision}) is not in the hub cache {cache_dir()} and {why}. Download it "
            "once with network access (unset HF_HUB_OFFLINE; `hf download "
            + (f"--repo-type dataset {repo_id}`" if repo_type == "dataset" else f"{repo_id}`")
            + "), or point HF_HUB_CACHE / HF_HOME at a cache that has it."
        )
    return HubError(f"{what} {repo_id!r} (revision {revision}): {type(exc).__name__}: {exc}")


def resolve_snapshot(
    repo_id: str,
    repo_type: str = "model",
    revision: Optional[str] = None,
    token: Optional[str] = None,
    allow_patterns: Optional[Sequence[str]] = MODEL_PATTERNS,
    what: str = "model",
) -> Snapshot:
    """The snapshot folder of `repo_id` at `revision`, downloading what is missing under one lock per repo."""
    from filelock import FileLock, Timeout
    from huggingface_hub import snapshot_download
    from huggingface_hub.file_download import repo_folder_name

    revision = revision or "main"
    lock_path = os.path.join(cache_dir(), ".locks", "shardwise", repo_folder_name(repo_id=repo_id, repo_type=repo_type))
    os.makedirs(os.path.dirname(lock_path), exist_ok=True)
    lock = FileLock(lock_path + ".lock")
    try:
        lock.acquire(timeout=1)
    except Timeout:
        _say(f"waiting for another process to download {what} {repo_id} ({revision}) into {cache_dir()} ...")
        while True:
            try:
                lock.acquire(timeout=60)
                break
            except Timeout:
                _say(f"still waiting for the download of {repo_id} (lock {lock_path}.lock).")
        _say(f"{repo_id}: downloaded by another process; reading the same snapshot.")
    try:
        if not _offline() and not _COMMIT.match(revision):
            try:
                _check_remote(repo_id, repo_type, revision, token, allow_patterns, what)
            except HubError:
                raise
            except Exception as exc:  # the hub cannot be reached: snapshot_download uses the cache or says why
                if not type(exc).__name__.endswith(("ConnectError", "TimeoutException", "OfflineModeIsEnabled")):
                    raise _explain(exc, repo_id, repo_type, revision, token, what) from exc
        try:
            path = snapshot_download(
                repo_id,
                repo_type=repo_type,
                revision=revision,
                token=token,
                allow_patterns=list(allow_patterns) if allow_patterns else None,
                ignore_patterns=DATASET_IGNORE if repo_type == "dataset" else None,
            )
        except Exception as exc:
            raise _explain(exc, repo_id, repo_type, revision, token, what) from exc
    finally:
        lock.release()
    return Snapshot(repo_id, repo_type, revision, snapshot_commit(path) or revision, path)


def resolve_model(
    name: str, revision: Optional[str] = None, token: Optional[str] = None, config_only: bool = False
) -> str:
    """A local model folder for `name`: itself when it is a local path, else its hub snapshot."""
    if not is_hub_id(name):
        return name
    patterns = CONFIG_PATTERNS if config_only else MODEL_PATTERNS
    return resolve_snapshot(name, "model", revision, token, patterns, "model").path


def resolve_tokenizer(name: str, revision: Optional[str] = None, token: Optional[str] = None) -> str:
    """A local tokenizer folder for `name`: itself when it is a local path, else its hub snapshot (no weights)."""
    if not is_hub_id(name):
        return name
    return resolve_snapshot(name, "model", revision, token, TOKENIZER_PATTERNS, "tokenizer").path


def resolve_dataset(
    name: str, revision: Optional[str] = None, config: Optional[str] = None, token: Optional[str] = None
) -> Optional[Snapshot]:
    """The hub snapshot of data set `name` (None for a local path); `config` picks its subfolder."""
    if not is_hub_id(name):
        if config:
            raise HubError(f"--dataset_config {config!r} applies to a hub data set id; {name!r} is a local path.")
        return None
    snap = resolve_snapshot(name, "dataset", revision, token, None, "data set")
    if config:
        sub = os.path.join(snap.path, config)
        if not os.path.isdir(sub):
            subs = sorted(d for d in os.listdir(snap.path) if os.path.isdir(os.path.join(snap.path, d)))
            raise HubError(f"data set {name!r} has no config {config!r} (a subfolder of the repo); it has {subs}.")
        snap = Snapshot(snap.repo_id, snap.repo_type, snap.revision, snap.commit, sub)
    return snap


def dataset_path(folder: str) -> str:
    """The one data file of a snapshot folder when it holds one, else the folder (its files are the splits)."""
    found = []
    for root, _dirs, files in os.walk(folder):
        found += [os.path.join(root, f) for f in files if f.lower().endswith(DATA_SUFFIXES)]
    return found[0] if len(found) == 1 else folder


# ------------------------------------------------------------------ upload
def check_push_options(push_to_hub: bool, hub_model_id: Optional[str], hub_strategy: str, output_dir: str) -> str:
    """The repo id the run will push to (`hub_model_id`, else the output folder's name), or a HubError."""
    if hub_strategy not in HUB_STRATEGIES:
        raise HubError(f"hub_strategy={hub_strategy!r}: use one of {HUB_STRATEGIES}.")
    repo = hub_model_id or os.path.basename(os.path.abspath(output_dir))
    if push_to_hub and not re.match(r"^([A-Za-z0-9][A-Za-z0-9._-]*/)?[A-Za-z0-9][A-Za-z0-9._-]*$", repo):
        raise HubError(f"hub_model_id={repo!r} is not a repo id: use name or org/name.")
    if push_to_hub and _offline():
        raise HubError("--push_to_hub with HF_HUB_OFFLINE=1: unset HF_HUB_OFFLINE, or drop --push_to_hub.")
    return repo


def exported_files(folder: str, verify: Callable[[str], Any]) -> List[str]:
    """The files an export wrote at the top of `folder` (and in merged/), after `verify(folder)` accepts it."""
    verify(folder)
    out = []
    for rel in sorted(os.listdir(folder)) + [
        os.path.join("merged", f) for f in _listdir(os.path.join(folder, "merged"))
    ]:
        if os.path.isfile(os.path.join(folder, rel)) and _matches(rel, MODEL_PATTERNS + ["README.md"]):
            if os.path.basename(rel) != "finetune_history.json":
                out.append(rel.replace(os.sep, "/"))
    return out


def push_export(upload: "HubUpload", output_dir: str, adapter: bool = False) -> None:
    """Start uploading the export in `output_dir` once it checks out: a model folder's config and every weight
    file its index lists, or an adapter folder's config and weights."""
    from shardwise.recipes.hf_model import inspect_model_folder

    def verify_adapter(folder: str) -> None:
        missing = [
            f
            for f in ("adapter_config.json", "adapter_model.safetensors")
            if not os.path.isfile(os.path.join(folder, f))
        ]
        if missing:
            raise HubError(f"push_to_hub: the adapter export in {folder} lacks {missing}; nothing uploaded.")

    folder = os.path.abspath(output_dir)
    upload.start(folder, exported_files(folder, verify_adapter if adapter else inspect_model_folder))


def _listdir(folder: str) -> List[str]:
    return sorted(os.listdir(folder)) if os.path.isdir(folder) else []


class HubUpload:
    """`create_repo` + `upload_folder` of an exported folder in a background thread (global rank 0 only)."""

    def __init__(self, repo_id: str, private: bool = False, token: Optional[str] = None) -> None:
        self.repo_id, self.private, self.token = repo_id, private, token
        self.thread: Optional[threading.Thread] = None
        self.error: Optional[BaseException] = None
        self.url: Optional[str] = None

    def retry_command(self, folder: str, path_in_repo: str = ".") -> str:
        private = " --private" if self.private else ""
        return f"hf upload{private} {self.repo_id} {folder} {path_in_repo}"

    def start(self, folder: str, files: Sequence[str], path_in_repo: str = ".") -> None:
        """Upload `files` (relative to `folder`) after the previous upload finished; returns at once."""
        previous = self.thread

        def work() -> None:
            if previous is not None:
                previous.join()
            try:
                from huggingface_hub import HfApi

                api = HfApi(token=self.token)
                # A bare name lands in the token's namespace: the returned URL names the repo in full.
                self.repo_id = api.create_repo(self.repo_id, private=self.private, exist_ok=True).repo_id
                info = api.upload_folder(
                    repo_id=self.repo_id,
                    folder_path=folder,
                    path_in_repo=None if path_in_repo == "." else path_in_repo,
                    allow_patterns=list(files),
                    commit_message=f"shardwise finetune: {path_in_repo if path_in_repo != '.' else 'final model'}",
                )
                self.url = getattr(info, "commit_url", None) or str(info)
                _say(f"uploaded {len(files)} files of {folder} to {self.repo_id} ({self.url}).")
            except Exception as exc:  # the local folder stays; the user retries by hand
                self.error = exc
                _say(
                    f"upload of {folder} to {self.repo_id} failed ({type(exc).__name__}: {exc}). The folder is kept; "
                    f"retry with: {self.retry_command(folder, path_in_repo)}"
                )

        self.thread = threading.Thread(target=work, name=f"hub-upload-{self.repo_id}", daemon=False)
        self.thread.start()

    def wait(self) -> Optional[BaseException]:
        if self.thread is not None:
            self.thread.join()
        return self.error


class PushCheckpoints:
    """hub_strategy every_save: each committed step checkpoint of `checkpoint` (a ModelCheckpoint) is uploaded to
    last-checkpoint/ of the repo in the background (as Trainer's hub_strategy "checkpoint" does, so a run
    resumes from it). Put it before the ModelCheckpoint: at a saving step it first lets a still-running upload
    finish, so the checkpoint being uploaded is never pruned under it (training waits only then)."""

    def __init__(self, upload: HubUpload, checkpoint: Any, every_n_steps: int) -> None:
        self.upload, self.checkpoint, self.every_n_steps = upload, checkpoint, every_n_steps
        self.pushed: Optional[str] = None

    def on_train_batch_end(self, trainer: Any, module: Any, *args: Any) -> None:
        if not trainer.is_global_zero:
            return
        if self.every_n_steps and trainer.global_step % self.every_n_steps == 0:
            self.upload.wait()  # the ModelCheckpoint after us may now save and prune
        self._push_new()

    def on_fit_end(self, trainer: Any, module: Any) -> None:
        if trainer.is_global_zero:  # the save of the last step is committed by now (ModelCheckpoint.on_train_end)
            self._push_new()

    def on_train_epoch_end(self, trainer: Any, module: Any) -> None:
        if trainer.is_global_zero and not self.every_n_steps:  # saving by epoch: prunes at the epoch's end
            self.upload.wait()

    def _push_new(self) -> None:
        path = getattr(self.checkpoint, "last_model_path", None)
        if path and path != self.pushed and os.path.isdir(path):  # committed: a checkpoint appears atomically
            self.pushed = path
            files = [
                os.path.relpath(os.path.join(root, f), path).replace(os.sep, "/")
                for root, _dirs, names in os.walk(path)
                for f in names
            ]
            self.upload.start(path, files, "last-checkpoint")


__all__ = [
    "HubError",
    "HubUpload",
    "PushCheckpoints",
    "Snapshot",
    "check_push_options",
    "dataset_path",
    "exported_files",
    "is_hub_id",
    "push_export",
    "resolve_dataset",
    "resolve_model",
    "resolve_snapshot",
    "resolve_tokenizer",
    "snapshot_commit",
]

"""Read any shardwise checkpoint tensor by tensor, without building a model.

`shardwise convert` and `shardwise inspect` must work on a laptop for a
checkpoint of a model that only fits on a cluster, so nothing here loads a
whole checkpoint:
- a "full" file is opened on the meta device (torch reads only the pickled
  structure, through the weights_only unpickler, and records where each
  tensor's bytes start in the file); a tensor is then read with one
  positioned read of exactly its storage;
- a "sharded" (DCP) directory is described by its `.metadata`; a tensor is
  read by asking DCP for that one key, which reads just the byte ranges of
  its shards, from whichever rank files hold them.
Peak memory is therefore about the largest tensor (plus one dtype-cast copy),
not the model. The checksums recorded at save time are verified before
anything is unpickled: a full file's digest (onefile.py) and a directory's
small files when the reader opens, a directory's data files before the first
tensor is returned (integrity.py); SHARDWISE_VERIFY_CHECKSUMS=0 skips both.
Nothing is ever unpickled outside the allow-lists of safety.py. Other directory formats (DeepSpeed) plug in with
`register_reader(name, factory)`.
"""

from __future__ import annotations

import os
import warnings
from dataclasses import dataclass
from typing import Any, Callable, Dict, Iterable, List, Optional, Tuple

import torch
import torch.distributed.checkpoint as dcp

from shardwise.checkpoint import layout
from shardwise.checkpoint.errors import (
    CheckpointError,
    CheckpointFormatError,
    CheckpointNotFoundError,
    CorruptCheckpointError,
)
from shardwise.checkpoint.formats import read_dcp_metadata, verify_one_file
from shardwise.checkpoint.integrity import check_agreement, recorded_checksums, verify_directory, wanted
from shardwise.checkpoint.safety import SafeFileSystemReader, SafeLoadPlanner


@dataclass(frozen=True)
class TensorInfo:
    name: str
    shape: Tuple[int, ...]
    dtype: torch.dtype

    @property
    def numel(self) -> int:
        n = 1
        for d in self.shape:
            n *= d
        return n

    @property
    def nbytes(self) -> int:
        return self.numel * torch.empty((), dtype=self.dtype).element_size()


class CheckpointReader:
    """What every reader offers: the manifest, the model's tensors, and reading some of them."""

    def __init__(self, path: str, manifest: Dict[str, Any]) -> None:
        self.path = path
        self.manifest = manifest

    @property
    def format(self) -> str:
        return self.manifest.get("checkpoint_format", "?")

    def tensors(self) -> List[TensorInfo]:
        raise NotImplementedError

    def read(self, names: Iterable[str]) -> Dict[str, torch.Tensor]:
        raise NotImplementedError

    def optimizer_tensors(self) -> List[TensorInfo]:
        return []

    def trainer_state(self) -> Dict[str, Any]:
        return {}

    def files(self) -> List[Tuple[str, int]]:
        if os.path.isfile(self.path):
            return [(os.path.basename(self.path), os.path.getsize(self.path))]
        out = []
        for root, _, names in os.walk(self.path):
            for name in sorted(names):
                full = os.path.join(root, name)
                out.append((os.path.relpath(full, self.path), os.path.getsize(full)))
        return out


def _infos(tree: Any, prefix: str = "") -> List[TensorInfo]:
    out: List[TensorInfo] = []
    if isinstance(tree, torch.Tensor):
        out.append(TensorInfo(prefix, tuple(tree.shape), tree.dtype))
    elif isinstance(tree, dict):
        for key, value in tree.items():
            out += _infos(value, f"{prefix}.{key}" if prefix else str(key))
    elif isinstance(tree, (list, tuple)):
        for i, value in enumerate(tree):
            out += _infos(value, f"{prefix}.{i}" if prefix else str(i))
    return out


class FullFileReader(CheckpointReader):
    """One torch file; tensors come from positioned reads of their storage records."""

    def __init__(self, path: str, verify: Optional[bool] = None) -> None:
        # Every byte before the structure is unpickled (threads share the file); `verify`: integrity.wanted.
        manifest, verified = verify_one_file(path, verify)
        self._meta = layout.load_torch(path, map_location="meta")
        if not isinstance(self._meta, dict) or "shardwise" not in self._meta or "state_dict" not in self._meta:
            raise CorruptCheckpointError(f"{path} is a torch file but not a full shardwise checkpoint.")
        if verified:
            check_agreement(path, manifest, self._meta)
        super().__init__(path, manifest)
        self._state = self._meta["state_dict"]
        self._mapped: Optional[Dict[str, torch.Tensor]] = None

    def tensors(self) -> List[TensorInfo]:
        return [TensorInfo(k, tuple(v.shape), v.dtype) for k, v in self._state.items() if isinstance(v, torch.Tensor)]

    def optimizer_tensors(self) -> List[TensorInfo]:
        return _infos(self._meta.get("optimizer_states", []), "optimizer")

    def trainer_state(self) -> Dict[str, Any]:
        return {k: v for k, v in self._meta.items() if k not in ("state_dict", "optimizer_states")}

    def read(self, names: Iterable[str]) -> Dict[str, torch.Tensor]:
        out = {}
        with open(self.path, "rb") as fh:
            for name in names:
                out[name] = self._read_one(fh, name, self._state[name])
        return out

    def _read_one(self, fh: Any, name: str, meta: torch.Tensor) -> torch.Tensor:
        storage = meta.untyped_storage()
        offset = getattr(storage, "_checkpoint_offset", None)
        nbytes = storage.nbytes()
        if offset is None:  # a torch that does not record storage offsets: fall back to mmap
            if self._mapped is None:
                self._mapped = layout.load_torch(self.path, mmap=True)
            return self._mapped["state_dict"][name].clone()
        if nbytes == 0:
            return torch.empty(meta.shape, dtype=meta.dtype)
        buffer = bytearray(nbytes)
        fh.seek(offset)
        if fh.readinto(buffer) != nbytes:
            raise CorruptCheckpointError(f"{self.path} is truncated: a tensor's bytes end past the end of the file.")
        flat = torch.frombuffer(buffer, dtype=torch.uint8).view(meta.dtype)
        tensor = flat.as_strided(meta.shape, meta.stride(), meta.storage_offset())
        # A view of a larger storage (rare in state dicts) keeps only its own bytes.
        return tensor if tensor.numel() == flat.numel() and tensor.is_contiguous() else tensor.clone()


class ShardedDirReader(CheckpointReader):
    """A torch.distributed.checkpoint directory written by shardwise."""

    _MODEL = "model."
    _OPTIM = "optimizers."

    def __init__(self, path: str, manifest: Dict[str, Any], verify: Optional[bool] = None) -> None:
        super().__init__(path, manifest)
        # The small files (.metadata, trainer_state.pt) before they are unpickled; the data
        # files before the first tensor is read. `verify`: integrity.wanted.
        self._verify = wanted(verify, path)
        small = [rel for rel in recorded_checksums(path, manifest) if not rel.endswith(".distcp")]
        verify_directory(path, manifest, only=small, verify=self._verify)
        self.metadata = read_dcp_metadata(path)
        self._verified = not self._verify

    def _tensor_md(self, prefix: str) -> List[TensorInfo]:
        out = []
        for key, md in self.metadata.state_dict_metadata.items():
            if key.startswith(prefix) and hasattr(md, "size"):
                out.append(TensorInfo(key[len(prefix) :], tuple(md.size), md.properties.dtype))
        return out

    def tensors(self) -> List[TensorInfo]:
        return self._tensor_md(self._MODEL)

    def optimizer_tensors(self) -> List[TensorInfo]:
        return [TensorInfo("optimizer." + t.name, t.shape, t.dtype) for t in self._tensor_md(self._OPTIM)]

    def trainer_state(self) -> Dict[str, Any]:
        return layout.read_trainer_state(self.path, self._verify)

    def read(self, names: Iterable[str]) -> Dict[str, torch.Tensor]:
        metadata = self.metadata  # read once (safely), not once per tensor
        if not self._verified:  # once, before the first tensor is handed out (SHARDWISE_VERIFY_CHECKSUMS=0 skips)
            data = [rel for rel in recorded_checksums(self.path, self.manifest) if rel.endswith(".distcp")]
            verify_directory(self.path, self.manifest, only=data, verify=True)
            self._verified = True
        info = {t.name: t for t in self.tensors()}
        target = {self._MODEL + n: torch.empty(info[n].shape, dtype=info[n].dtype) for n in names}
        try:
            with warnings.catch_warnings():  # "assuming the intent is to load in a single process": it is
                warnings.simplefilter("ignore")
                dcp.load(
                    target,
                    storage_reader=SafeFileSystemReader(self.path, metadata),
                    planner=SafeLoadPlanner(allow_partial_load=True),
                    no_dist=True,
                )
        except CheckpointError:
            raise
        except BaseException as exc:  # torch's CheckpointException is a BaseException
            raise CorruptCheckpointError(
                f"Reading {sorted(names)[:3]} from {self.path} failed; a data file may be corrupt: {exc}"
            ) from exc
        return {k[len(self._MODEL) :]: v for k, v in target.items()}


# Directory formats other than "sharded" register here from their strategy's module (DeepSpeed's
# from strategies/__init__.py), so nothing in checkpoint/ imports a strategy. A factory is called
# as factory(path, manifest, verify) (`verify`: integrity.wanted).
_READERS: Dict[str, Callable[..., CheckpointReader]] = {
    "sharded": ShardedDirReader,
}


def register_reader(checkpoint_format: str, factory: Callable[..., CheckpointReader]) -> None:
    """Teach convert / inspect a directory format: factory(path, manifest, verify) -> CheckpointReader."""
    _READERS[checkpoint_format] = factory


def resolve_cli_path(path: str) -> str:
    """A checkpoint, or a directory of checkpoints (then its `last`); errors list what exists."""
    full = os.path.abspath(os.path.expanduser(path))
    if not os.path.exists(full):
        # Names only: a stray file beside the typo is never opened.
        raise CheckpointNotFoundError(
            f"Checkpoint {full} does not exist. Checkpoints found:\n"
            f"{layout.describe_available([os.path.dirname(full)], wanted=full)}"
        )
    if os.path.isdir(full) and not os.path.exists(os.path.join(full, layout.MANIFEST_NAME)):
        latest = layout.latest_checkpoint(full)
        if latest is not None:
            return latest
    return os.path.realpath(full)


def open_checkpoint(path: str, check_version: bool = True, verify: Optional[bool] = None) -> CheckpointReader:
    """A reader for the checkpoint at `path` (or the newest one in a checkpoint directory).

    `verify`: integrity.wanted (None: unless SHARDWISE_VERIFY_CHECKSUMS=0; `inspect` passes False
    after its own report has verified every file).
    """
    path = resolve_cli_path(path)
    if os.path.isfile(path):
        reader: CheckpointReader = FullFileReader(path, verify)
    else:
        manifest = layout.read_manifest(path, verify)
        factory = _READERS.get(manifest.get("checkpoint_format", ""))
        if factory is None:
            raise CheckpointFormatError(
                f"{path} is in format {manifest.get('checkpoint_format')!r}, which no reader is registered for "
                f"(known: full, {', '.join(sorted(_READERS))}). Its strategy module registers one when imported."
            )
        reader = factory(path, manifest, verify)
    if check_version:
        layout.check_version(reader.manifest, path)
    return reader


def largest(infos: List[TensorInfo]) -> Optional[TensorInfo]:
    return max(infos, key=lambda t: t.nbytes, default=None)

"""Reading DCP shard files in one pass: each byte read once, checksummed on the way, decoded safely.

DCP's own FileSystemReader unpickles non-tensor items with weights_only=False,
and hashing the files separately would read them twice. `VerifyingReader`
reads each file's items in offset order with one read per item, feeds the
same bytes (and the gaps between items) to the file's sha256, and decodes
through the weights_only loader. A file read to its end is compared with the
manifest (ChecksumMismatchError names it); `verified` lists those files, so
the caller hashes the ones no rank read in full. Nothing is decoded or
copied into the model while reading: once every file is verified the caller
calls `apply(planner)`, which maps each item again (the pages the hash just
read, from the page cache) and decodes it; so a damaged checkpoint is refused
with the model and optimizer untouched, and resident memory stays one item.
"""

from __future__ import annotations

import hashlib
import io
import mmap
import os
import sys
import warnings
from typing import Any, Dict, List, Optional, Set

import torch
from torch import _weights_only_unpickler
from torch.distributed._shard._utils import narrow_tensor_by_index  # what DCP itself uses
from torch.distributed.checkpoint.planner import LoadItemType

from shardwise.checkpoint.errors import CheckpointError, ChecksumMismatchError, CorruptCheckpointError
from shardwise.checkpoint.integrity import ALGORITHM, VERIFY_ENV
from shardwise.checkpoint.safety import EXTRA_SAFE_GLOBALS, SafeFileSystemReader

_GAP_CHUNK = 8 << 20


class VerifyingReader(SafeFileSystemReader):
    """SafeFileSystemReader whose read_data hashes each file while decoding it (see the module docstring)."""

    def __init__(self, path: str, metadata: Any = None, checksums: Optional[Dict[str, Dict[str, Any]]] = None) -> None:
        super().__init__(path, metadata)
        self.checksums = checksums or {}
        self.verified: Set[str] = set()
        self.pending: List[Any] = []  # (request, storage info, file) until apply()

    def apply(self, planner: Any) -> None:
        """Decode every item read and copy it into its target (call once all files are verified)."""
        pending, self.pending = self.pending, []
        files: Dict[str, Any] = {}
        try:
            for req, info, path in pending:
                if path not in files:
                    files[path] = open(path, "rb", buffering=0)
                buf = _map_item(files[path], info.offset, info.length, path)
                self._decode(req, info, buf, planner, path)
                del buf  # unmaps the item: resident memory stays one item, not the file
        finally:
            for fh in files.values():
                fh.close()

    def read_data(self, plan: Any, planner: Any) -> Any:
        per_file: Dict[str, List[Any]] = {}
        for req in plan.items:
            per_file.setdefault(self.storage_data[req.storage_index].relative_path, []).append(req)
        for relative, reqs in per_file.items():
            # Offset order: one forward pass over the file, so it can be hashed as it is read.
            reqs.sort(key=lambda r: self.storage_data[r.storage_index].offset)
            self._read_file(relative, reqs, planner)
        done: torch.futures.Future = torch.futures.Future()  # DCP waits on a torch future
        done.set_result(None)
        return done

    def _read_file(self, relative: str, reqs: List[Any], planner: Any) -> None:
        path = os.path.join(str(self.path), relative)
        expected = self.checksums.get(relative)
        # Hash here only a file this rank reads mostly anyway (its own shard file); a few items of
        # another rank's file (deduplicated replicated values) would mean reading all of it again.
        wanted = sum(
            {
                self.storage_data[r.storage_index].offset: self.storage_data[r.storage_index].length for r in reqs
            }.values()
        )
        if expected and 2 * wanted < int(expected.get("bytes") or 0):
            expected = None
        hasher = hashlib.new(ALGORITHM) if expected else None
        pos = 0
        with open(path, "rb", buffering=0) as fh:
            for req in reqs:
                info = self.storage_data[req.storage_index]
                self.pending.append((req, info, path))  # decoded by apply(), once every file is verified
                if hasher is not None and info.offset > pos:
                    pos = self._hash_range(fh, hasher, pos, info.offset, path)
                if hasher is not None and info.offset == pos:
                    buf = _map_item(fh, info.offset, info.length, path)
                    hasher.update(buf.view)
                    pos = info.offset + info.length
                    del buf  # unmaps the item
                # (info.offset < pos: the same item requested twice, already hashed)
            if hasher is not None:
                pos = self._hash_range(fh, hasher, pos, None, path)
        if hasher is not None:
            self._compare(path, hasher, expected, pos)
            self.verified.add(relative)

    @staticmethod
    def _compare(path: str, hasher: Any, expected: Dict[str, Any], size: int) -> None:
        actual = hasher.hexdigest()
        if actual != expected.get(ALGORITHM):
            raise ChecksumMismatchError(
                f"{path} is corrupt: its {ALGORITHM} is {actual} but the manifest recorded "
                f"{expected.get(ALGORITHM)} ({expected.get('bytes')} bytes) when it was written. Resume from "
                f"an earlier checkpoint (or set {VERIFY_ENV}=0 to load it anyway)."
            )

    @staticmethod
    def _hash_range(fh: Any, hasher: Any, start: int, end: Optional[int], path: str) -> int:
        fh.seek(start)
        pos = start
        while end is None or pos < end:
            chunk = fh.read(_GAP_CHUNK if end is None else min(_GAP_CHUNK, end - pos))
            if not chunk:
                break
            hasher.update(chunk)
            pos += len(chunk)
        return pos

    def _decode(self, req: Any, info: Any, buf: "_MappedItem", planner: Any, path: str) -> None:
        if req.type == LoadItemType.BYTE_IO or info.transform_descriptors:
            stream = self.transforms.transform_load_stream(
                req, info.transform_descriptors or (), io.BytesIO(bytes(buf.view))
            )
        if req.type == LoadItemType.BYTE_IO:
            try:
                planner.load_bytes(req, io.BytesIO(stream.read(-1)))
            except CheckpointError as exc:  # name the file, not only the item
                raise type(exc)(f"{path} (item at byte {info.offset}): {exc}") from exc
            return
        try:
            if info.transform_descriptors:  # compressed / extension-encoded: torch's own path
                if not stream.seekable():
                    stream = io.BytesIO(stream.read(-1))
                with torch.serialization.safe_globals(EXTRA_SAFE_GLOBALS):
                    tensor = torch.load(stream, map_location="cpu", weights_only=True)
            else:
                tensor = decode_tensor(buf)
        except Exception as exc:
            raise CorruptCheckpointError(
                f"{path}: the item at byte {info.offset} ({req.dest_index.fqn}) cannot "
                f"be decoded ({str(exc).splitlines()[0] if str(exc) else exc!r})."
            ) from exc
        tensor = narrow_tensor_by_index(tensor, req.storage_offsets, req.lengths)
        target = planner.resolve_tensor(req).detach()
        if target.size() != tensor.size():
            raise CorruptCheckpointError(
                f"{path}: {req.dest_index.fqn} has shape {tuple(tensor.size())} in the "
                f"file but {tuple(target.size())} is expected."
            )
        target.copy_(tensor)
        planner.commit_tensor(req, target)


class _MappedItem:
    """One item's bytes, mapped read-only from the file (no copy into process memory).

    Also the file object torch's zip reader needs (it reads only the small
    headers through it); `torch.frombuffer` views of the records keep the
    mapping alive until DCP has copied them into the target tensors.
    """

    def __init__(self, fh: Any, offset: int, length: int) -> None:
        start = offset - offset % mmap.ALLOCATIONGRANULARITY
        self._map = mmap.mmap(fh.fileno(), length + (offset - start), access=mmap.ACCESS_READ, offset=start)
        self.view = memoryview(self._map)[offset - start :]
        self._pos = 0

    def __len__(self) -> int:
        return len(self.view)

    # file protocol for torch._C.PyTorchFileReader
    def seek(self, pos: int, whence: int = 0) -> int:
        self._pos = pos if whence == 0 else (self._pos + pos if whence == 1 else len(self.view) + pos)
        return self._pos

    def tell(self) -> int:
        return self._pos

    def seekable(self) -> bool:
        return True

    def read(self, size: int = -1) -> bytes:
        end = len(self.view) if size is None or size < 0 else min(len(self.view), self._pos + size)
        out = self.view[self._pos : end].tobytes()
        self._pos = end
        return out

    def readinto(self, target: Any) -> int:
        data = self.read(len(memoryview(target)))
        memoryview(target).cast("B")[: len(data)] = data
        return len(data)


def _map_item(fh: Any, offset: int, length: int, path: str) -> "_MappedItem":
    size = os.fstat(fh.fileno()).st_size
    if offset + length > size:
        raise CorruptCheckpointError(
            f"{path} is truncated: an item at byte {offset} needs {length} bytes, the file has {size}."
        )
    return _MappedItem(fh, offset, length)


def decode_tensor(buf: Any) -> torch.Tensor:
    """A torch.save'd tensor (one DCP item) as a view of `buf`: no copy of its bytes.

    torch.load(BytesIO) would copy every storage out of the buffer (and pass
    it through Python file reads); here the weights_only unpickler rebuilds
    the tensor around `torch.frombuffer` views of the records instead. The
    view keeps `buf` alive; DCP copies it into the target right after.
    """
    mapped = isinstance(buf, _MappedItem)
    memory = buf.view if mapped else buf
    archive = torch._C.PyTorchFileReader(buf if mapped else io.BytesIO(buf))
    if archive.has_record("byteorder") and archive.get_record("byteorder").decode() != sys.byteorder:
        with torch.serialization.safe_globals(EXTRA_SAFE_GLOBALS):  # rare: let torch byte-swap
            return torch.load(io.BytesIO(bytes(memory)), map_location="cpu", weights_only=True)

    def persistent_load(saved_id: Any) -> Any:
        _, storage_type, key, _location, numel = saved_id
        dtype = torch.uint8 if storage_type is torch.UntypedStorage else storage_type.dtype
        nbytes = numel * torch._utils._element_size(dtype)
        if nbytes:
            offset = archive.get_record_offset(f"data/{key}")
            with warnings.catch_warnings():  # read-only mapping: DCP only ever copies out of it
                warnings.filterwarnings("ignore", message="The given buffer is not writable")
                storage = torch.frombuffer(memory, dtype=torch.uint8, count=nbytes, offset=offset).untyped_storage()
        else:
            storage = torch.UntypedStorage(0)
        return torch.storage.TypedStorage(wrap_storage=storage, dtype=dtype, _internal=True)

    unpickler = _weights_only_unpickler.Unpickler(io.BytesIO(archive.get_record("data.pkl")), encoding="utf-8")
    unpickler.persistent_load = persistent_load
    with torch.serialization.safe_globals(EXTRA_SAFE_GLOBALS):
        tensor = unpickler.load()
    if not isinstance(tensor, torch.Tensor):
        raise CorruptCheckpointError(f"a tensor item decodes to {type(tensor).__name__}")
    return tensor

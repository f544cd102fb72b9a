"""Hugging Face's sharded weights layout: written one tensor at a time, read by its index.

A weights folder holds `model.safetensors`, or, when larger than the shard
size, `model-0000i-of-0000n.safetensors` plus `model.safetensors.index.json`
mapping every tensor name to its shard (`pytorch_model*.bin` for torch files).
`ShardWriter` is the one writer of that layout: `shardwise convert` feeds it
tensors read from a checkpoint, the fine-tuning recipe's export feeds it
tensors gathered from a sharded model. It keeps only the current shard in
memory, so a writer's peak is about `max_shard_size` plus one tensor whatever
the model's size; the safetensors library writes each shard.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
from typing import Callable, Dict, List, Optional, Sequence, Tuple

import torch
from safetensors import safe_open
from safetensors.torch import save_file

SAFE_SINGLE = "model.safetensors"
SAFE_INDEX = "model.safetensors.index.json"
_FORMATS = {"safetensors": ("model", ".safetensors"), "torch": ("pytorch_model", ".bin")}


def save_safetensors(tensors: Dict[str, torch.Tensor], path: str, metadata: Optional[Dict[str, str]] = None) -> None:
    save_file(tensors, path, metadata={"format": "pt", **(metadata or {})})


def save_torch(tensors: Dict[str, torch.Tensor], path: str, metadata: Optional[Dict[str, str]] = None) -> None:
    torch.save(tensors, path)


SAVERS: Dict[str, Callable[..., None]] = {"safetensors": save_safetensors, "torch": save_torch}


def save_durably(
    fmt: str, tensors: Dict[str, torch.Tensor], path: str, metadata: Optional[Dict[str, str]] = None
) -> None:
    """Write `tensors` to `path` through a temporary name, synced before the rename: never a half file."""
    tmp = os.path.join(os.path.dirname(os.path.abspath(path)), f".{os.path.basename(path)}.partial")
    SAVERS[fmt](tensors, tmp, metadata)
    with open(tmp, "rb") as fh:
        os.fsync(fh.fileno())
    os.replace(tmp, path)


class ShardWriter:
    """Cut (name, tensor) pairs, in the order given, into shards of at most `max_shard_size` bytes.

    A tensor larger than the limit gets a shard of its own. Shards are written
    under hidden names as they fill up and renamed once their number is known
    (`close`), when the index is written too; a previous export's shards in
    the folder are removed then, so the two never mix.
    """

    def __init__(
        self, out_dir: str, max_shard_size: int, fmt: str = "safetensors", metadata: Optional[Dict[str, str]] = None
    ) -> None:
        if fmt not in _FORMATS:
            raise ValueError(f"format {fmt!r}: use one of {', '.join(_FORMATS)}.")
        self.out_dir, self.max_shard_size, self.fmt, self.metadata = out_dir, max_shard_size, fmt, metadata
        self.base, self.ext = _FORMATS[fmt]
        self._current: Dict[str, torch.Tensor] = {}
        self._current_bytes = 0
        self._shards: List[List[str]] = []  # the tensor names of each written shard
        self.total_bytes = 0
        os.makedirs(out_dir, exist_ok=True)

    def _temp(self, index: int) -> str:
        return os.path.join(self.out_dir, f".{self.base}-export-{index:05d}{self.ext}")

    def add(self, name: str, tensor: torch.Tensor) -> None:
        """Take a contiguous CPU tensor the writer may keep until its shard is written."""
        size = tensor.numel() * tensor.element_size()
        if self._current and self._current_bytes + size > self.max_shard_size:
            self._flush()
        self._current[name] = tensor
        self._current_bytes += size
        self.total_bytes += size

    def _flush(self) -> None:
        if self._current:
            save_durably(self.fmt, self._current, self._temp(len(self._shards)), self.metadata)
            self._shards.append(list(self._current))
            self._current, self._current_bytes = {}, 0

    def close(self) -> List[str]:
        """Write the last shard, give every shard its final name, write the index; returns the paths."""
        self._flush()
        count = len(self._shards)
        pattern = re.compile(rf"{re.escape(self.base)}(-\d{{5}}-of-\d{{5}})?{re.escape(self.ext)}(\.index\.json)?")
        for stale in os.listdir(self.out_dir):
            if pattern.fullmatch(stale):
                os.remove(os.path.join(self.out_dir, stale))
        written, weight_map = [], {}
        for i, names in enumerate(self._shards):
            final = f"{self.base}{self.ext}" if count == 1 else f"{self.base}-{i + 1:05d}-of-{count:05d}{self.ext}"
            os.replace(self._temp(i), os.path.join(self.out_dir, final))
            weight_map.update({name: final for name in names})
            written.append(os.path.join(self.out_dir, final))
        if count > 1:
            index = os.path.join(self.out_dir, f"{self.base}{self.ext}.index.json")
            with open(index, "w") as fh:
                json.dump(
                    {"metadata": {"total_size": self.total_bytes}, "weight_map": dict(sorted(weight_map.items()))},
                    fh,
                    indent=2,
                )
            written.append(index)
        return written


def weight_files(folder: str) -> List[str]:
    """The safetensors files of a weights folder: those its index names, else `model.safetensors`."""
    index = os.path.join(folder, SAFE_INDEX)
    if os.path.exists(index):
        with open(index) as fh:
            return sorted(set(json.load(fh)["weight_map"].values()))
    return [SAFE_SINGLE]


def read_safetensors_plan(path: str, files: Sequence[str]) -> List[Tuple[str, str, List[int]]]:
    """(file, key, shape) of every tensor, in the order of the bytes in each file: only headers are read."""
    plan = []
    for fname in files:
        with safe_open(os.path.join(path, fname), framework="pt") as handle:
            for key in handle.offset_keys():
                plan.append((fname, key, list(handle.get_slice(key).get_shape())))
    return plan


class SafetensorsReader(contextlib.ExitStack):
    """Tensors read by key from a weights folder's files, each file open only while it is needed.

    A file opens when a key in it is first read; `close_unused(i, last_use)`
    closes those whose last reader (by step index) has passed, so the mapped
    pages of finished files leave the process's RSS. Every file still open
    closes with the context."""

    def __init__(self, path: str, file_of: Dict[str, str]) -> None:
        super().__init__()
        self.path, self.file_of = path, file_of
        self.handles: Dict[str, Tuple[contextlib.ExitStack, object]] = {}
        self.bytes_read = 0
        self.callback(lambda: [stack.close() for stack, _ in self.handles.values()])

    def read(self, key: str) -> torch.Tensor:
        fname = self.file_of[key]
        if fname not in self.handles:
            stack = contextlib.ExitStack()
            self.handles[fname] = (stack, stack.enter_context(safe_open(os.path.join(self.path, fname), "pt")))
        tensor = self.handles[fname][1].get_tensor(key)
        self.bytes_read += tensor.numel() * tensor.element_size()
        return tensor

    def close_unused(self, index: int, last_use: Dict[str, int]) -> None:
        for fname in [f for f in self.handles if last_use[f] <= index]:
            self.handles.pop(fname)[0].close()

"""A checkpoint's tensors -> consolidated weight files: the plain part of `shardwise convert`.

`write_weights` writes what the rest of the ecosystem loads: a folder in
Hugging Face's layout (`model.safetensors`, split into shards with an index
when larger than the shard size; hf_shards.py), or one file (safetensors or
torch), each tensor under the name the caller gives it. The command itself
(recipes/convert.py) decides those names and what goes beside the weights:
it also knows the fine-tuning recipe's checkpoints and merges adapters into a
base model, which this layer must not import.

Tensors are read from the checkpoint one at a time (reader.py; small ones a
few together) and cast on their own, so a folder's peak memory is about one
shard plus one tensor. A single file has to be held whole before it is
written, so it is refused up front when the host cannot hold it.
"""

from __future__ import annotations

import json
import os
from typing import Any, Callable, Dict, Iterator, List, Optional, Tuple

import torch

from shardwise.checkpoint.hf_shards import ShardWriter, save_durably
from shardwise.checkpoint.reader import CheckpointReader, TensorInfo
from shardwise.sysmem import available_host_bytes


def _cast_dtype(info: TensorInfo, dtype: Optional[torch.dtype]) -> torch.dtype:
    return dtype if dtype is not None and info.dtype.is_floating_point else info.dtype


def _out_info(info: TensorInfo, dtype: Optional[torch.dtype]) -> TensorInfo:
    return TensorInfo(info.name, info.shape, _cast_dtype(info, dtype))


def _groups(infos: List[TensorInfo], budget: int) -> List[List[TensorInfo]]:
    """Consecutive tensors grouped so that each read holds about `budget` bytes (a large one alone)."""
    groups: List[List[TensorInfo]] = [[]]
    size = 0
    for info in infos:
        if groups[-1] and size + info.nbytes > budget:
            groups.append([])
            size = 0
        groups[-1].append(info)
        size += info.nbytes
    return groups


def read_cast(
    reader: CheckpointReader, infos: List[TensorInfo], dtype: Optional[torch.dtype], read_budget: int = 0
) -> Iterator[Tuple[str, torch.Tensor]]:
    """(name, tensor) for every tensor of `infos`, in order, floating ones cast to `dtype`."""
    for group in _groups(infos, read_budget):
        tensors = reader.read([i.name for i in group])
        for info in group:
            yield info.name, tensors.pop(info.name).to(_cast_dtype(info, dtype)).contiguous()


def write_safetensors(
    path: str,
    reader: CheckpointReader,
    infos: List[TensorInfo],
    dtype: Optional[torch.dtype],
    metadata: Optional[Dict[str, str]] = None,
    read_budget: int = 0,
) -> int:
    """Write `infos` from `reader` into one safetensors file; returns the bytes of tensor data written."""
    tensors = dict(read_cast(reader, infos, dtype, read_budget))
    save_durably("safetensors", tensors, path, metadata)
    return sum(t.numel() * t.element_size() for t in tensors.values())


def _renamed(
    reader: CheckpointReader, infos: List[TensorInfo], cast: Any, budget: int, names: Dict[str, str]
) -> Iterator[Tuple[str, torch.Tensor]]:
    """read_cast's (name, tensor) pairs under the names they are written as."""
    for name, tensor in read_cast(reader, infos, cast, budget):
        yield names[name], tensor


def write_weights(
    reader: CheckpointReader,
    infos: List[TensorInfo],
    out: str,
    *,
    names: Dict[str, str],
    cast: Optional[torch.dtype],
    fmt: str,
    max_bytes: int,
    single_file: bool,
    state: Dict[str, Any],
    model_files: Optional[Callable[[], List[str]]] = None,
    regroup: Optional[Callable[[Iterator[Tuple[str, torch.Tensor]]], Iterator[Tuple[str, torch.Tensor]]]] = None,
) -> Tuple[List[str], int]:
    """Write the tensors `infos` of `reader`, each as `names[its name]`, floating ones cast to `cast`, into
    the one file `out` or the folder `out` (shards of at most `max_bytes`, then `model_files()`' files, then
    the run's hyperparameters from the trainer `state` as hparams.json). `regroup` turns the stream of
    (written name, tensor) into the one written (a model's layout into its hub layout). Returns (the files
    written, the bytes of tensor data)."""
    regroup = regroup or (lambda stream: stream)
    total_bytes = sum(_out_info(i, cast).nbytes for i in infos)
    # Small tensors are read in groups (one DCP request each costs a few ms),
    # never more bytes at once than the largest tensor or 4 MiB.
    budget = max(max((i.nbytes for i in infos), default=0), 4 * 2**20)
    meta = {"shardwise_step": str(reader.manifest.get("global_step", "")), "shardwise_format": reader.format}
    written: List[str] = []
    if single_file:
        available = available_host_bytes()
        if available is not None and total_bytes > available:
            raise ValueError(
                f"one file of {total_bytes / 2**30:.1f} GiB must be held in memory to be written, and "
                f"this host has {available / 2**30:.1f} GiB available: give a folder as OUT (shards of "
                "--max-shard-size, one at a time)."
            )
        os.makedirs(os.path.dirname(os.path.abspath(out)), exist_ok=True)
        save_durably(fmt, dict(regroup(_renamed(reader, infos, cast, budget, names))), out, meta)
        written.append(out)
        return written, total_bytes
    writer = ShardWriter(out, max_bytes, fmt, meta)
    for name, tensor in regroup(_renamed(reader, infos, cast, budget, names)):
        writer.add(name, tensor)
    written += writer.close()
    if model_files is not None:
        written += model_files()
    hparams = state.get("hyper_parameters") or {}
    if hparams:
        try:
            text = json.dumps(hparams, indent=2, default=str)
            with open(os.path.join(out, "hparams.json"), "w") as fh:
                fh.write(text)
            written.append(os.path.join(out, "hparams.json"))
        except (TypeError, ValueError):
            pass
    return written, total_bytes

"""`move_to_device(batch, device)`: put whatever a DataLoader yields on the training device.

Collators return more than tensors, lists and dicts: Hugging Face's return a
`BatchEncoding` (a `UserDict`), others a namedtuple, a dataclass, or an
object with its own `.to(device)` (PyG's `Data`, PackedSequence). A batch
left on the CPU fails at the first forward on a GPU ("Expected all tensors
to be on the same device"), so this walks all of them, nested, and returns a
new container of the same type; the caller's batch is not modified. It is
the one function both the Trainer and a hand-written loop use (see
examples/strategy_without_trainer.py). Copies are asynchronous only where
that is safe: to CUDA from pinned host memory or from another CUDA tensor;
a copy to the host always completes before it returns.
"""

from __future__ import annotations

import copy
import dataclasses
from collections import UserDict, defaultdict
from collections.abc import Mapping
from typing import Any, Union

import torch

DeviceLike = Union[torch.device, str, int]


def _non_blocking(t: torch.Tensor, device: torch.device) -> bool:
    # Host -> CUDA is only asynchronous from pinned memory (otherwise it is
    # synchronous anyway); CUDA -> host must finish before the host reads it.
    return device.type == "cuda" and (t.device.type == "cuda" or t.is_pinned())


def _move_tensor(t: torch.Tensor, device: torch.device) -> torch.Tensor:
    if t.device == device:
        return t
    return t.to(device, non_blocking=_non_blocking(t, device))


def _move_mapping(batch: Mapping, device: torch.device) -> Mapping:
    items = {k: move_to_device(v, device) for k, v in batch.items()}
    if isinstance(batch, UserDict):  # BatchEncoding: keep its other attributes (encodings, n_sequences)
        out = copy.copy(batch)
        out.data = items
        return out
    if type(batch) is dict:
        return items
    if isinstance(batch, defaultdict):
        return type(batch)(batch.default_factory, items)
    try:
        return type(batch)(items)
    except TypeError:  # a Mapping type that cannot be built from a dict
        return items


def _move_dataclass(batch: Any, device: torch.device) -> Any:
    out = copy.copy(batch)
    for f in dataclasses.fields(batch):
        # object.__setattr__: frozen dataclasses too; fields with init=False as well.
        object.__setattr__(out, f.name, move_to_device(getattr(batch, f.name), device))
    return out


def move_to_device(batch: Any, device: DeviceLike) -> Any:
    """Return `batch` with every tensor in it on `device`, containers rebuilt with their own types.

    Handles tensors; mappings (dict and its subclasses, `UserDict` such as
    Hugging Face's `BatchEncoding`); namedtuples; lists and tuples; dataclass
    instances (fields replaced on a shallow copy); and any other object with
    a `.to(device)` method, whose own method is used. Anything else (numbers,
    strings, None) is returned unchanged.
    """
    device = torch.device(device)
    if isinstance(batch, torch.Tensor):
        return _move_tensor(batch, device)
    if isinstance(batch, Mapping):
        return _move_mapping(batch, device)
    if callable(getattr(batch, "to", None)) and not isinstance(batch, type):
        # The object knows its own layout (e.g. PackedSequence keeps batch_sizes on the host).
        return batch.to(device)
    if isinstance(batch, tuple) and hasattr(batch, "_fields"):  # namedtuple
        return type(batch)(*(move_to_device(v, device) for v in batch))
    if isinstance(batch, (list, tuple)):
        moved = [move_to_device(v, device) for v in batch]
        try:
            return type(batch)(moved)
        except TypeError:
            return moved if isinstance(batch, list) else tuple(moved)
    if dataclasses.is_dataclass(batch) and not isinstance(batch, type):
        return _move_dataclass(batch, device)
    return batch

"""Loading a checkpoint never runs code from it: the allow-lists every read goes through.

A torch file or a DCP `.metadata` is a pickle, and unpickling calls whatever
global the file names (`os.system` included). Every load here therefore
goes through an allow-list instead: torch's weights_only unpickler (tensors,
plain containers, numbers, strings) plus the few extra types our own saves
need (`TorchVersion`, a str subclass old manifests hold), and for DCP's
`.metadata` a restricted unpickler that admits only DCP's metadata
dataclasses, torch sizes / dtypes / layouts and paths. A file that names
anything else fails with UnsafeCheckpointError naming the global, before
anything is constructed. DCP's own reader and planner unpickle with
weights_only=False; `SafeFileSystemReader` / `SafeLoadPlanner` replace those
two calls. On the save side `plain_state` turns values the safe loader would
refuse (a user's hparams object, a namedtuple) into their repr, so our own
checkpoints always load.
"""

from __future__ import annotations

import importlib
import io
import os
import pickle
import pickletools
import warnings
import zipfile
from typing import Any, Iterable, Iterator, Optional

import torch
from torch.distributed.checkpoint import DefaultLoadPlanner, FileSystemReader
from torch.distributed.checkpoint._nested_dict import set_element  # DCP's own helper
from torch.distributed.checkpoint.metadata import StorageMeta

from shardwise.checkpoint.errors import CorruptCheckpointError, UnsafeCheckpointError

# Types beyond torch's weights_only defaults that our own saves contain.
EXTRA_SAFE_GLOBALS = [torch.torch_version.TorchVersion, frozenset]


def _first_line(exc: BaseException) -> str:
    text = str(exc)
    return text.splitlines()[0] if text else type(exc).__name__


def _pickle_globals(data: bytes) -> list:
    """Every global a pickle names, found by reading its opcodes (pickletools runs nothing)."""
    found, strings, memo = [], [], {}
    try:
        for op, arg, _ in pickletools.genops(data):
            if op.name in (
                "SHORT_BINUNICODE",
                "BINUNICODE",
                "UNICODE",
                "BINUNICODE8",
                "SHORT_BINSTRING",
                "BINSTRING",
                "STRING",
            ):
                strings.append(arg)
            elif op.name == "MEMOIZE" and strings:
                memo[len(memo)] = strings[-1]
            elif op.name in ("BINGET", "LONG_BINGET", "GET") and arg in memo:
                strings.append(memo[arg])
            elif op.name == "GLOBAL":
                found.append(arg.replace(" ", "."))
            elif op.name == "STACK_GLOBAL" and len(strings) >= 2:
                found.append(f"{strings[-2]}.{strings[-1]}")
    except Exception:  # a damaged pickle: report what was found before the damage
        pass
    return found


def unsafe_globals(path: str, allowed: Iterable[str] = ()) -> list:
    """The globals the torch file at `path` names beyond torch's allow-list and `allowed` (nothing is run)."""
    allowed = set(allowed)
    return [n for n in _unsafe_names(path) if n not in allowed]


def _unsafe_names(source: Any) -> list:
    """The globals a torch file names beyond the allow-list (read with pickletools: nothing runs)."""
    if not isinstance(source, (str, os.PathLike)):
        return []
    try:
        if zipfile.is_zipfile(source):
            with torch.serialization.safe_globals(EXTRA_SAFE_GLOBALS):
                return list(torch.serialization.get_unsafe_globals_in_checkpoint(source))
        with open(source, "rb") as fh:
            names = _pickle_globals(fh.read(1 << 20))
        return [n for n in dict.fromkeys(names) if not n.startswith(("torch.", "collections.OrderedDict"))]
    except Exception:  # unreadable: the load error says enough
        return []


def unsafe_error(path: str, detail: str, names: Optional[list] = None) -> UnsafeCheckpointError:
    wanted = ", ".join(names) if names else detail
    return UnsafeCheckpointError(
        f"{path} asks to construct {wanted}, which is not a tensor, a plain container or one of the types "
        "shardwise saves. shardwise does not execute code from checkpoint files, so it did not load it. "
        "If you wrote this file yourself and trust it, load it with torch.load(weights_only=False) and "
        "re-save its tensors (e.g. `shardwise convert` on a shardwise checkpoint); otherwise delete it."
    )


def safe_torch_load(
    path: Any,
    map_location: Any = "cpu",
    mmap: bool = False,
    name: Optional[str] = None,
    extra_safe: Optional[list] = None,
) -> Any:
    """torch.load restricted to tensors and plain data; UnsafeCheckpointError / CorruptCheckpointError name the file."""
    label = name or str(path)
    try:
        with torch.serialization.safe_globals(EXTRA_SAFE_GLOBALS + list(extra_safe or [])), warnings.catch_warnings():
            warnings.filterwarnings("ignore", message="Detected pickle protocol")  # refused anyway if unsafe
            return torch.load(path, map_location=map_location, weights_only=True, mmap=mmap)
    except pickle.UnpicklingError as exc:
        # Every weights_only refusal is an UnpicklingError; it is "unsafe" when
        # the file names a global outside the allow-list, else plain damage.
        names = _unsafe_names(path)
        if names or "Unsupported global" in str(exc):
            raise unsafe_error(label, _unsupported(str(exc)), names) from None
        detail = str(exc).split("WeightsUnpickler error:", 1)[-1].strip() or _first_line(exc)
        raise CorruptCheckpointError(
            f"{label} is truncated or corrupt (unpickling said: {_first_line(Exception(detail))}). "
            "Resume from an earlier checkpoint."
        ) from exc
    except (Exception, BaseException) as exc:
        if isinstance(exc, (KeyboardInterrupt, SystemExit)):
            raise
        size = os.path.getsize(path) if isinstance(path, (str, os.PathLike)) and os.path.exists(path) else "?"
        raise CorruptCheckpointError(
            f"{label} is truncated or corrupt ({size} bytes; torch.load said: "
            f"{_first_line(exc)}). Resume from an earlier checkpoint."
        ) from exc


def _unsupported(text: str) -> str:
    """The 'GLOBAL x.y' torch names in its weights_only message, else a generic phrase."""
    for line in text.splitlines():
        if "Unsupported global" in line or "GLOBAL" in line:
            return line.strip().split(":", 1)[-1].strip()
    return "a global outside the allow-list"


def safe_loads_bytes(data: io.BytesIO, label: str) -> Any:
    """A DCP 'bytes' item (optimizer hyper-parameters and other non-tensor values)."""
    try:
        with torch.serialization.safe_globals(EXTRA_SAFE_GLOBALS):
            return torch.load(data, map_location="cpu", weights_only=True)
    except pickle.UnpicklingError as exc:
        if "Unsupported global" in str(exc):
            raise unsafe_error(label, _unsupported(str(exc))) from None
        detail = str(exc).split("WeightsUnpickler error:", 1)[-1].strip() or _first_line(exc)
        raise CorruptCheckpointError(
            f"{label} is corrupt (unpickling said: {_first_line(Exception(detail))}). "
            "Resume from an earlier checkpoint."
        ) from exc
    except Exception as exc:
        raise CorruptCheckpointError(
            f"{label} is corrupt ({_first_line(exc)}). Resume from an earlier checkpoint."
        ) from exc


# ------------------------------------------------------------ DCP metadata
_DCP_MODULES = ("torch.distributed.checkpoint.metadata",)
_ALLOWED = {
    ("torch.distributed.checkpoint.filesystem", "_StorageInfo"),
    ("torch.serialization", "_get_layout"),
    ("torch", "Size"),
    ("collections", "OrderedDict"),
    ("builtins", "set"),
    ("builtins", "frozenset"),
    ("builtins", "slice"),
    ("pathlib", "PosixPath"),
    ("pathlib", "PurePosixPath"),
    ("pathlib", "WindowsPath"),
    ("pathlib", "PureWindowsPath"),
    ("pathlib", "Path"),
    ("torch.distributed.checkpoint._extension", "ExtensionRegistry"),
}


class _MetadataUnpickler(pickle.Unpickler):
    def __init__(self, fh: Any, label: str) -> None:
        super().__init__(fh)
        self.label = label

    def find_class(self, module: str, name: str) -> Any:
        if (module, name) in _ALLOWED or module in _DCP_MODULES or module == "torch":
            obj = getattr(importlib.import_module(module), name, None)
            if module in _DCP_MODULES and isinstance(obj, type):
                return obj  # DCP's metadata dataclasses and enums
            if module == "torch" and (
                name == "Size" or isinstance(obj, (torch.dtype, torch.layout, torch.memory_format))
            ):
                return obj
            if (module, name) in _ALLOWED and obj is not None:
                return obj
        if module == "torch.distributed.checkpoint.metadata" or module.startswith("torch.distributed.checkpoint"):
            obj = getattr(importlib.import_module(module), name, None)
            if isinstance(obj, type) and getattr(obj, "__dataclass_fields__", None) is not None:
                return obj
        raise unsafe_error(self.label, f"GLOBAL {module}.{name}", [f"{module}.{name}"])


def load_dcp_metadata(path: str) -> Any:
    """DCP's `.metadata` through the restricted unpickler."""
    try:
        with open(path, "rb") as fh:
            return _MetadataUnpickler(fh, path).load()
    except UnsafeCheckpointError:
        raise
    except Exception as exc:
        raise CorruptCheckpointError(f"{path} is truncated or corrupt: {_first_line(exc)}") from exc


class SafeFileSystemReader(FileSystemReader):
    """DCP's file reader with the metadata read through the allow-list (and read only once)."""

    def __init__(self, path: str, metadata: Any = None) -> None:
        super().__init__(path)
        self._metadata = metadata

    def read_metadata(self, *args: Any, **kwargs: Any) -> Any:
        if self._metadata is None:
            metadata = load_dcp_metadata(os.path.join(str(self.path), ".metadata"))
            if getattr(metadata, "storage_meta", None) is None:
                metadata.storage_meta = StorageMeta()
            metadata.storage_meta.load_id = self.load_id
            if getattr(metadata, "storage_data", None) is None:
                metadata.storage_data = {}
            self._metadata = metadata
        return self._metadata


class SafeLoadPlanner(DefaultLoadPlanner):
    """DCP's planner, unpickling 'bytes' items with weights_only=True instead of False."""

    def load_bytes(self, read_item: Any, value: io.BytesIO) -> None:
        obj = safe_loads_bytes(value, f"{read_item.dest_index.fqn!r} in a sharded checkpoint")
        if self.flatten_state_dict:
            set_element(self.original_state_dict, self.mappings[read_item.dest_index.fqn], obj)
        else:
            self.state_dict[read_item.dest_index.fqn] = obj


# -------------------------------------------------------------------- save
_SCALARS = (str, int, float, bool, type(None), bytes, complex)
_TORCH_VALUES = (torch.Tensor, torch.dtype, torch.device, torch.Size)


def plain_state(value: Any, where: str = "state", _notes: Optional[list] = None) -> Any:
    """`value` with anything the safe loader would refuse replaced by its repr (a warning names each)."""
    top = _notes is None
    notes: list = [] if top else _notes
    if type(value) in _SCALARS or isinstance(value, _TORCH_VALUES):
        out = value
    elif isinstance(value, bool):
        out = bool(value)
    elif isinstance(value, (int, float, str)):  # TorchVersion, str / int enums: the plain value
        out = next(t for t in (int, float, str) if isinstance(value, t))(value)
    elif isinstance(value, dict):  # OrderedDict stays one; other dict subclasses become dicts
        keep = type(value) if type(value).__name__ == "OrderedDict" else dict
        out = keep(
            (k if type(k) in _SCALARS else repr(k), plain_state(v, f"{where}[{k!r}]", notes)) for k, v in value.items()
        )
    elif isinstance(value, (list, tuple, set, frozenset)):  # a namedtuple keeps its values, not its class
        kind = type(value) if type(value) in (list, tuple, set, frozenset) else tuple
        out = kind(plain_state(v, f"{where}[{i}]", notes) for i, v in enumerate(value))
    else:
        notes.append(f"{where} ({type(value).__qualname__})")
        out = repr(value)
    if top and notes:
        warnings.warn(
            "The checkpoint stores the repr of values that are not tensors or plain data (shardwise "
            "loads checkpoints without executing code, so it does not pickle objects): "
            + ", ".join(notes[:5])
            + (f", ... ({len(notes) - 5} more)" if len(notes) > 5 else ""),
            stacklevel=3,
        )
    return out


def iter_files(directory: str) -> Iterator[str]:
    """Relative paths of every regular file under `directory`, sorted."""
    out = []
    for root, _, names in os.walk(directory):
        for name in names:
            out.append(os.path.relpath(os.path.join(root, name), directory))
    return iter(sorted(out))

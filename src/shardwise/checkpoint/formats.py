"""The two built-in formats for a model and its optimizers: "full" and "sharded".

Both go through torch.distributed.checkpoint.state_dict's get/set functions,
which give the same canonical parameter names for a plain module, DDP and
FSDP2 (wrapper prefixes such as `module.` or `_checkpoint_wrapped_module.`
removed) and key optimizer state by those names instead of by parameter
position. That shared naming is what lets any format load under any
strategy:

- "full": every rank takes part in gathering the state to rank 0 one tensor
  at a time (cpu_offload=True, so an accelerator never holds more than one
  full tensor), and rank 0 writes one torch file. Loading maps the file
  (mmap) on every rank; FSDP keeps only its local slices.
- "sharded": torch.distributed.checkpoint (DCP) writes one file per rank plus
  `.metadata`; nothing is gathered. Loading asks DCP for exactly the tensors
  the running model holds, so a checkpoint written by 2 ranks loads on 1, on
  4, or under DDP (each rank then reads whole tensors).

Strategies call `save_model_and_optimizers` / `load_model_and_optimizers`
from `Strategy.save_checkpoint` / `load_checkpoint` (see strategies/base.py
for the contract). Before loading, the checkpoint's parameter names and
shapes are compared with the running model's, so a mismatch is reported as
a list of differences rather than a failure deep inside a copy.
"""
from __future__ import annotations

import os
from concurrent.futures import Future
from typing import Any, Dict, List, Mapping, Optional, Tuple

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.state_dict import (StateDictOptions, get_model_state_dict,
                                                     get_optimizer_state_dict, set_model_state_dict,
                                                     set_optimizer_state_dict)

from shardwise.checkpoint.errors import CheckpointFormatError, CheckpointMismatchError, CorruptCheckpointError
from shardwise.checkpoint.layout import (MANIFEST_NAME, load_torch, read_trainer_state, save_torch_durably,
                                         write_trainer_state)

BUILTIN_FORMATS = ("full", "sharded")
_DCP_METADATA = ".metadata"
_MODEL, _OPTIMIZERS = "model", "optimizers"
_async_group: Optional[Any] = None


def _rank() -> int:
    return dist.get_rank() if dist.is_available() and dist.is_initialized() else 0


def _is_sharded(model: torch.nn.Module) -> bool:
    from torch.distributed.tensor import DTensor

    return any(isinstance(p, DTensor) for p in model.parameters())


# ------------------------------------------------------------------ compare
def shapes_of(state: Mapping[str, Any]) -> Dict[str, Tuple[int, ...]]:
    return {k: tuple(v.shape) for k, v in state.items() if isinstance(v, torch.Tensor)}


def describe_differences(checkpoint: Dict[str, Tuple[int, ...]], model: Dict[str, Tuple[int, ...]],
                         limit: int = 5) -> Optional[str]:
    """None when names and shapes agree, else a short report of the first differences."""
    missing = [k for k in model if k not in checkpoint]
    unexpected = [k for k in checkpoint if k not in model]
    reshaped = [k for k in model if k in checkpoint and tuple(checkpoint[k]) != tuple(model[k])]
    if not (missing or unexpected or reshaped):
        return None

    def head(keys: List[str], fmt=lambda k: k) -> str:
        more = f", ... ({len(keys) - limit} more)" if len(keys) > limit else ""
        return ", ".join(fmt(k) for k in keys[:limit]) + more

    lines = []
    if missing:
        lines.append(f"  in the model but not in the checkpoint ({len(missing)}): {head(missing)}")
    if unexpected:
        lines.append(f"  in the checkpoint but not in the model ({len(unexpected)}): {head(unexpected)}")
    if reshaped:
        lines.append(f"  different shapes ({len(reshaped)}): "
                     + head(reshaped, lambda k: f"{k} checkpoint {list(checkpoint[k])} vs model {list(model[k])}"))
    return "\n".join(lines)


def _check_model(path: str, checkpoint: Dict[str, Tuple[int, ...]], model: torch.nn.Module) -> None:
    report = describe_differences(checkpoint, shapes_of(get_model_state_dict(model)))
    if report:
        raise CheckpointMismatchError(
            f"The model in {path} does not match the running model:\n{report}\n"
            "Build the model with the configuration the checkpoint was trained with.")


def _check_optimizer_count(path: str, saved: int, running: int) -> None:
    if saved != running:
        raise CheckpointMismatchError(
            f"{path} holds {saved} optimizer state(s) but configure_optimizers() returned {running} optimizer(s).")


# --------------------------------------------------------------------- save
def save_model_and_optimizers(model: torch.nn.Module, optimizers: List[torch.optim.Optimizer], path: str,
                              state: Dict[str, Any], checkpoint_format: str,
                              async_save: bool = False) -> Optional[Future]:
    """Write model + optimizers + trainer `state` at `path` (collective: call on every rank)."""
    if checkpoint_format == "full":
        _save_full(model, optimizers, path, state)
        return None
    if checkpoint_format == "sharded":
        return _save_sharded(model, optimizers, path, state, async_save)
    raise CheckpointFormatError(f"Unknown checkpoint format {checkpoint_format!r}; built in: {BUILTIN_FORMATS}.")


def _save_full(model: torch.nn.Module, optimizers: List[torch.optim.Optimizer], path: str,
               state: Dict[str, Any]) -> None:
    # full_state_dict + cpu_offload: tensors are all-gathered one at a time and
    # only rank 0 keeps them (in host memory); the other ranks get {}.
    options = StateDictOptions(full_state_dict=True, cpu_offload=True)
    model_state = get_model_state_dict(model, options=options)
    optim_states = [get_optimizer_state_dict(model, opt, options=options) for opt in optimizers]
    if _rank() == 0:
        os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
        save_torch_durably({**state, "state_dict": model_state, "optimizer_states": optim_states}, path)


def _checkpoint_group() -> Any:
    """A separate gloo group for DCP's background collectives, so they never interleave with training's.

    Created once per default process group (collectively, at the first async
    save, which every rank reaches); a new world gets a new one.
    """
    global _async_group
    world = dist.group.WORLD
    if _async_group is None or _async_group[0] is not world:
        _async_group = (world, dist.new_group(backend="gloo"))
    return _async_group[1]


def _save_sharded(model: torch.nn.Module, optimizers: List[torch.optim.Optimizer], path: str,
                  state: Dict[str, Any], async_save: bool) -> Optional[Future]:
    payload = {
        _MODEL: get_model_state_dict(model),
        _OPTIMIZERS: {str(i): get_optimizer_state_dict(model, opt) for i, opt in enumerate(optimizers)},
    }
    if _rank() == 0:
        write_trainer_state(path, state)  # creates the directory
    writer = dcp.FileSystemWriter(path, sync_files=True, single_file_per_rank=True)
    if async_save:
        # Staging copies this rank's shards to host memory now; the writing
        # (and DCP's own collectives, on a private group) runs in a thread.
        return dcp.async_save(payload, storage_writer=writer, process_group=_checkpoint_group())
    dcp.save(payload, storage_writer=writer)
    return None


# --------------------------------------------------------------------- load
def load_model_and_optimizers(model: torch.nn.Module, optimizers: List[torch.optim.Optimizer], path: str,
                              checkpoint_format: str) -> Dict[str, Any]:
    """Load a "full" or "sharded" checkpoint into a running model + optimizers; return the trainer state."""
    if checkpoint_format == "full":
        return _load_full(model, optimizers, path)
    if checkpoint_format == "sharded":
        return _load_sharded(model, optimizers, path)
    raise CheckpointFormatError(
        f"{path} is a {checkpoint_format!r} checkpoint, which this strategy cannot load (it reads "
        f"{', '.join(BUILTIN_FORMATS)}). Resume it with the strategy that wrote it, or export its weights with "
        "`shardwise convert` and load those.")


def _load_full(model: torch.nn.Module, optimizers: List[torch.optim.Optimizer], path: str) -> Dict[str, Any]:
    # mmap: the file's pages are shared between ranks through the page cache
    # instead of each rank holding a private copy.
    payload = load_torch(path, mmap=True)
    if "state_dict" not in payload:
        raise CorruptCheckpointError(f"{path} has no 'state_dict' entry: not a full shardwise checkpoint.")
    _check_model(path, shapes_of(payload["state_dict"]), model)
    optim_states = payload.get("optimizer_states", [])
    _check_optimizer_count(path, len(optim_states), len(optimizers))
    # FSDP: every rank has the whole tensor and keeps its slice (no broadcast).
    options = StateDictOptions(full_state_dict=True) if _is_sharded(model) else StateDictOptions()
    set_model_state_dict(model, payload["state_dict"], options=options)
    for index, (opt, osd) in enumerate(zip(optimizers, optim_states)):
        try:
            set_optimizer_state_dict(model, opt, osd, options=options)
        except (KeyError, ValueError, RuntimeError) as exc:
            raise CheckpointMismatchError(
                f"Optimizer {index} in {path} does not match the running optimizer "
                f"({type(opt).__name__}): {exc}") from exc
    return {k: v for k, v in payload.items() if k not in ("state_dict", "optimizer_states")}


def check_dcp_files(path: str, metadata: Any) -> None:
    """Every data file the metadata refers to exists and is long enough (names the first that is not)."""
    needed: Dict[str, int] = {}
    for info in getattr(metadata, "storage_data", {}).values():
        end = info.offset + info.length
        needed[info.relative_path] = max(needed.get(info.relative_path, 0), end)
    for relative, size in sorted(needed.items()):
        file = os.path.join(path, relative)
        if not os.path.exists(file):
            raise CorruptCheckpointError(f"{file} is missing: the sharded checkpoint {path} is incomplete.")
        actual = os.path.getsize(file)
        if actual < size:
            raise CorruptCheckpointError(
                f"{file} is truncated: {actual} bytes, the checkpoint's metadata needs at least {size}.")


def read_dcp_metadata(path: str) -> Any:
    file = os.path.join(path, _DCP_METADATA)
    if not os.path.exists(file):
        raise CorruptCheckpointError(f"{file} is missing: {path} is not a complete sharded checkpoint.")
    try:
        metadata = dcp.FileSystemReader(path).read_metadata()
    except Exception as exc:
        raise CorruptCheckpointError(f"{file} is truncated or corrupt: {exc}") from exc
    check_dcp_files(path, metadata)
    return metadata


def _prefixed_shapes(metadata: Any, prefix: str) -> Dict[str, Tuple[int, ...]]:
    out = {}
    for key, md in metadata.state_dict_metadata.items():
        if key.startswith(prefix) and hasattr(md, "size"):
            out[key[len(prefix):]] = tuple(md.size)
    return out


def _load_sharded(model: torch.nn.Module, optimizers: List[torch.optim.Optimizer], path: str) -> Dict[str, Any]:
    state = read_trainer_state(path)
    metadata = read_dcp_metadata(path)
    _check_model(path, _prefixed_shapes(metadata, _MODEL + "."), model)
    saved_optims = {k.split(".")[1] for k in metadata.state_dict_metadata if k.startswith(_OPTIMIZERS + ".")}
    _check_optimizer_count(path, len(saved_optims), len(optimizers))
    # Templates in the running layout (DTensor shards under FSDP, whole
    # tensors otherwise): DCP reads into them whatever slices they cover.
    payload = {
        _MODEL: get_model_state_dict(model),
        _OPTIMIZERS: {str(i): get_optimizer_state_dict(model, opt) for i, opt in enumerate(optimizers)},
    }
    try:
        dcp.load(payload, storage_reader=dcp.FileSystemReader(path))
    except Exception as exc:
        # Names and shapes were checked above and the optimizer types by the
        # caller, so what is left is a file DCP could not decode.
        raise CorruptCheckpointError(f"Reading {path} failed; a data file may be corrupt: {exc}") from exc
    set_model_state_dict(model, payload[_MODEL])
    for i, opt in enumerate(optimizers):
        set_optimizer_state_dict(model, opt, payload[_OPTIMIZERS][str(i)])
    return state


def is_directory_checkpoint(path: str) -> bool:
    return os.path.isdir(path) and os.path.exists(os.path.join(path, MANIFEST_NAME))

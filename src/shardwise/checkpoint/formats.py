"""The two built-in formats for a model and its optimizers, "full" and "sharded", saved and loaded.

Both use torch.distributed.checkpoint.state_dict's get/set functions, whose
parameter names are the same for a plain module, DDP and FSDP2, so any format
loads under any strategy. "full" gathers the state to rank 0 one tensor at a
time and writes one torch file (or, when rank 0's host could not hold it,
saves that step "sharded" with a warning); its trailer carries the manifest
and the digest of every byte, checked before a load unpickles anything
(onefile.py). "sharded" is DCP: one file per rank plus `.metadata`, loadable
at another world size; its files are hashed while they are read and nothing
is copied into the model before all of them matched (dcp_io.py). Strategies call
`save_model_and_optimizers` / `load_model_and_optimizers` (the contract is in
strategies/base.py); a load first compares names and shapes with the running
model and reports the differences.
"""

from __future__ import annotations

import datetime
import os
import warnings
import weakref
from concurrent.futures import Future
from typing import Any, Dict, List, Mapping, Optional, Tuple

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_optimizer_state_dict,
    set_model_state_dict,
    set_optimizer_state_dict,
)
from torch.distributed.tensor import DTensor

from shardwise.checkpoint import onefile
from shardwise.checkpoint.adapters import is_adapter_checkpoint, load_options, model_state
from shardwise.checkpoint.dcp_io import VerifyingReader
from shardwise.checkpoint.errors import (
    CheckpointError,
    CheckpointFormatError,
    CheckpointMismatchError,
    ChecksumMismatchError,
    CorruptCheckpointError,
)
from shardwise.checkpoint.integrity import (
    check_agreement,
    find_os_error,
    hash_files,
    record_checksums,
    recorded_checksums,
    verify_directory,
    verify_enabled,
    wanted,
    write_checksum_part,
    write_error,
)
from shardwise.checkpoint.layout import (
    load_torch,
    read_manifest,
    read_trainer_state,
    save_torch_durably,
    write_trainer_state,
)
from shardwise.checkpoint.safety import SafeFileSystemReader, SafeLoadPlanner, plain_state
from shardwise.distributed import ops
from shardwise.sysmem import available_host_bytes

BUILTIN_FORMATS = ("full", "sharded")
_DCP_METADATA = ".metadata"
_MODEL, _OPTIMIZERS = "model", "optimizers"
# (weak reference to the default group, weak reference to its checkpoint group): see checkpoint_group.
_async_group: Optional[Tuple[Any, Any]] = None


def _is_sharded(model: torch.nn.Module) -> bool:
    return any(isinstance(p, DTensor) for p in model.parameters())


# ------------------------------------------------------------------ compare
def shapes_of(state: Mapping[str, Any]) -> Dict[str, Tuple[int, ...]]:
    return {k: tuple(v.shape) for k, v in state.items() if isinstance(v, torch.Tensor)}


def describe_differences(
    checkpoint: Dict[str, Tuple[int, ...]], model: Dict[str, Tuple[int, ...]], limit: int = 5
) -> Optional[str]:
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
        lines.append(
            f"  different shapes ({len(reshaped)}): "
            + head(reshaped, lambda k: f"{k} checkpoint {list(checkpoint[k])} vs model {list(model[k])}")
        )
    return "\n".join(lines)


def _check_model(path: str, checkpoint: Dict[str, Tuple[int, ...]], model: torch.nn.Module, adapter: bool) -> None:
    report = describe_differences(checkpoint, shapes_of(model_state(model, None, adapter)))
    if report:
        raise CheckpointMismatchError(
            f"The model in {path} does not match the running model:\n{report}\n"
            "Build the model with the configuration the checkpoint was trained with."
        )


def _check_optimizer_count(path: str, saved: int, running: int) -> None:
    if saved != running:
        raise CheckpointMismatchError(
            f"{path} holds {saved} optimizer state(s) but configure_optimizers() returned {running} optimizer(s)."
        )


# --------------------------------------------------------------------- save
def save_model_and_optimizers(
    model: torch.nn.Module,
    optimizers: List[torch.optim.Optimizer],
    path: str,
    state: Dict[str, Any],
    checkpoint_format: str,
    async_save: bool = False,
) -> Optional[Future]:
    """Write model + optimizers + trainer `state` at `path` (collective: call on every rank).

    An adapter checkpoint (the manifest's `adapter` entry, checkpoint/adapters.py) holds the trainable
    parameters of the model only."""
    adapter = is_adapter_checkpoint(state["shardwise"])
    if checkpoint_format == "full":
        budget = (model, optimizers, True) if adapter else (model, optimizers)  # adapter: trainable tensors only
        needed, available = _full_state_budget(*budget)
        if available is None or needed <= _HOST_SHARE * available:
            return _save_full(model, optimizers, path, state, adapter)
        # Gathering would run rank 0's host out of memory and the kernel would kill the run with
        # everything since the last checkpoint. Save this step sharded (nothing is gathered);
        # the manifest says so, and every strategy resumes from either format.
        if ops.rank() == 0:
            warnings.warn(
                f"state_dict_type='full': this checkpoint would gather {_gib(needed)} (model and optimizer "
                f"state) in rank 0's host memory, which has {_gib(available)} available; {path} is saved "
                "sharded instead (a directory, one file per rank). It resumes like a full one; "
                f"`shardwise convert {path} weights/` writes the weights in Hugging Face's layout. Use "
                "state_dict_type='sharded' to choose this yourself.",
                stacklevel=3,
            )
        state = {**state, "shardwise": {**state["shardwise"], "checkpoint_format": "sharded"}}
        return _save_sharded(model, optimizers, path, state, async_save, adapter)
    if checkpoint_format == "sharded":
        return _save_sharded(model, optimizers, path, state, async_save, adapter)
    raise CheckpointFormatError(f"Unknown checkpoint format {checkpoint_format!r}; built in: {BUILTIN_FORMATS}.")


_HOST_SHARE = 0.9  # of rank 0's available host memory a full gather may take


def _gib(n: float) -> str:
    return f"{n / 2**30:.1f} GiB"


def _full_state_budget(
    model: torch.nn.Module, optimizers: List[torch.optim.Optimizer], adapter: bool = False
) -> Tuple[int, Optional[float]]:
    """(bytes a full save gathers on rank 0, rank 0's available host bytes), the same on every rank.

    A DTensor's numel() is its global size, so every rank computes the same total without
    communicating; rank 0's free memory is shared in one all-reduce (a collective: every rank calls).
    """
    tensors = [t for t in model.state_dict().values() if isinstance(t, torch.Tensor)]
    if adapter:
        tensors = [p for p in model.parameters() if p.requires_grad]
    for opt in optimizers:
        for per_param in opt.state.values():
            tensors += [t for t in per_param.values() if isinstance(t, torch.Tensor)]
    needed = sum(t.numel() * t.element_size() for t in tensors)
    free = available_host_bytes() if ops.rank() == 0 else None
    if ops.world_size() > 1:  # -1 stands for "unknown", and for every rank but 0
        free = float(ops.reduce(torch.tensor(-1.0 if free is None else float(free), dtype=torch.float64), "max"))
        free = None if free < 0 else free
    return needed, free


def _failed(exc: BaseException) -> Future:
    """A failed write as a completed Future: the commit reports it on every rank and removes the
    temporary checkpoint, instead of this rank raising alone while the others wait in a collective."""
    future: Future = Future()
    future.set_exception(exc)
    # A synchronous save that failed: the other ranks, whose part succeeded, return None and commit at
    # once; this rank must too (PendingCheckpoint.is_async), or it would wait for the next save alone.
    future.synchronous = True  # type: ignore[attr-defined]
    return future


def _save_full(
    model: torch.nn.Module, optimizers: List[torch.optim.Optimizer], path: str, state: Dict[str, Any], adapter: bool
) -> Optional[Future]:
    # full_state_dict + cpu_offload: tensors are all-gathered one at a time and
    # only rank 0 keeps them (in host memory); the other ranks get {}.
    options = StateDictOptions(full_state_dict=True, cpu_offload=True)
    weights = model_state(model, options, adapter)
    optim_states = [get_optimizer_state_dict(model, opt, options=options) for opt in optimizers]
    if ops.rank() == 0:
        body = {
            **plain_state({k: v for k, v in state.items() if k != "shardwise"}, "trainer state"),
            "state_dict": weights,
            "optimizer_states": optim_states,
        }
        # The manifest is pickled with the state (torch.load users see it) and, sealed, in the trailer
        # that also holds the digest of every byte (onefile.py).
        manifest = state["shardwise"]
        try:
            os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
            save_torch_durably({**body, "shardwise": manifest}, path, manifest=manifest)
        except (OSError, CheckpointError) as exc:
            return _failed(write_error(exc, path))
    return None


def checkpoint_group() -> Any:
    """A separate gloo group for checkpoint writing: DCP's background collectives, and the commit.

    Background collectives on it never interleave with training's. Its timeout
    is long because ranks wait on it while rank 0 writes a full checkpoint (tens
    of minutes for a large model), which the training timeout must not cut short;
    a rank that dies meanwhile is still caught by the launcher. Created once per
    default process group (collectively, at the first use, which every rank reaches).

    Held by weak reference only, so that it dies with its default group (its sockets
    closed) rather than living on here into the next fit's process group.
    """
    global _async_group
    world = dist.group.WORLD
    group = None
    if _async_group is not None and _async_group[0]() is world:
        group = _async_group[1]()
    if group is None:
        group = dist.new_group(backend="gloo", timeout=datetime.timedelta(hours=6))
        _async_group = (weakref.ref(world), weakref.ref(group))
    return group


def _save_sharded(
    model: torch.nn.Module,
    optimizers: List[torch.optim.Optimizer],
    path: str,
    state: Dict[str, Any],
    async_save: bool,
    adapter: bool = False,
) -> Optional[Future]:
    payload = {
        _MODEL: model_state(model, None, adapter),
        _OPTIMIZERS: {str(i): get_optimizer_state_dict(model, opt) for i, opt in enumerate(optimizers)},
    }
    error: Optional[BaseException] = None
    if ops.rank() == 0:
        try:
            write_trainer_state(path, state)  # creates the directory
        except (OSError, CheckpointError) as exc:
            error = write_error(exc, path)
    # Every rank still enters DCP's collectives (a failure there is shared by
    # DCP itself); a rank that raised here alone would leave the others waiting.
    writer = dcp.FileSystemWriter(path, sync_files=True, single_file_per_rank=True)
    if async_save:
        # Staging copies this rank's shards to host memory now; the writing
        # (and DCP's own collectives, on a private group) runs in a thread.
        response = dcp.async_save(payload, storage_writer=writer, process_group=checkpoint_group())
        return _hash_when_written(response, path, error)
    try:
        dcp.save(payload, storage_writer=writer)
    except BaseException as exc:  # CheckpointException is a BaseException
        if isinstance(exc, KeyboardInterrupt):
            raise
        error = error or write_error(exc, path)
    # Each rank hashes its own data file(s); rank 0 also .metadata; rank 0 records all in the manifest.
    sums: Dict[str, Any] = {}
    if error is None:
        try:
            sums = hash_files(path, _own_files(path, ops.rank()))
        except OSError as exc:
            error = write_error(exc, path)
    gathered = ops.all_gather_object((sums, None if error is None else str(error)))
    if error is None and ops.rank() == 0 and not any(e for _, e in gathered):
        try:
            record_checksums(path, {k: v for part, _ in gathered for k, v in part.items()})
        except (OSError, CheckpointError) as exc:
            error = write_error(exc, path)
    return None if error is None else _failed(error)


def _own_files(path: str, rank: int) -> List[str]:
    """The files rank `rank` wrote in a DCP directory: its `__{rank}_*.distcp`, and `.metadata` for rank 0."""
    names = [n for n in os.listdir(path) if n.startswith(f"__{rank}_") and n.endswith(".distcp")]
    return sorted(names) + ([_DCP_METADATA] if rank == 0 else [])


def _hash_when_written(response: Any, path: str, error: Optional[BaseException]) -> Future:
    """A Future completing once DCP's background write is done AND this rank's files are hashed.

    No collective may run in that thread, so each rank writes its sums to
    `.checksums-rankN.json` (integrity.merge_checksum_parts folds them into the
    manifest at commit; load reads them either way).
    """
    inner = getattr(response, "upload_completion", response)
    done: Future = Future()
    rank = ops.rank()

    def finish(fut: Any) -> None:
        try:
            fut.result()
            if error is not None:
                raise error
            write_checksum_part(path, rank, hash_files(path, _own_files(path, rank)))
            done.set_result(None)
        except BaseException as exc:  # noqa: B036 - reported by the commit on every rank
            done.set_exception(write_error(exc, path) if find_os_error(exc) is not None else exc)

    inner.add_done_callback(finish)
    return done


# --------------------------------------------------------------------- load
def load_model_and_optimizers(
    model: torch.nn.Module, optimizers: List[torch.optim.Optimizer], path: str, checkpoint_format: str
) -> Dict[str, Any]:
    """Load a "full" or "sharded" checkpoint into a running model + optimizers; return the trainer state."""
    loader = {"full": _load_full, "sharded": _load_sharded}.get(checkpoint_format)
    if loader is not None:
        try:
            return loader(model, optimizers, path)
        except CheckpointError:
            raise
        except BaseException as exc:  # noqa: B036 - DCP's CheckpointException is not an Exception
            if isinstance(exc, (KeyboardInterrupt, SystemExit)):
                raise
            raise CorruptCheckpointError(
                f"Loading {path} ({checkpoint_format}) failed: {type(exc).__name__}: "
                f"{str(exc).splitlines()[0] if str(exc) else ''}. If the model or optimizer changed since the "
                "save, build them as they were; otherwise the files may be damaged: resume from an earlier "
                "checkpoint."
            ) from exc
    raise CheckpointFormatError(
        f"{path} is a {checkpoint_format!r} checkpoint, which this strategy cannot load (it reads "
        f"{', '.join(BUILTIN_FORMATS)}). Resume it with the strategy that wrote it, or export its weights with "
        f"`shardwise convert {path} weights.safetensors` and load those in configure_model (the optimizer "
        "state does not carry over)."
    )


def check_format_readable(path: str, checkpoint_format: str, strategy_format: str) -> None:
    """Raise CheckpointFormatError, with the command that converts it, if a strategy writing
    `strategy_format` cannot resume a `checkpoint_format` checkpoint. Cheap (no file is read): meant
    to run before anything compares optimizer names, so the user hears the real reason first."""
    readable = BUILTIN_FORMATS if strategy_format in BUILTIN_FORMATS else (strategy_format,)
    if checkpoint_format in readable:
        return
    raise CheckpointFormatError(
        f"{path} is a {checkpoint_format!r} checkpoint; a strategy saving {strategy_format!r} checkpoints reads "
        f"{', '.join(readable)}. Resume it with the strategy that wrote it, or export its weights with "
        f"`shardwise convert {path} weights.safetensors` and load those in configure_model (the optimizer "
        "state does not carry over)."
    )


def verify_one_file(path: str, verify: Optional[bool] = None) -> Tuple[Dict[str, Any], bool]:
    """A one-file checkpoint's manifest and whether its digest was checked (collective: every rank
    hashes a share of the file, all raise together). Nothing has been unpickled when it returns.
    `verify`: integrity.wanted (None: unless SHARDWISE_VERIFY_CHECKSUMS=0)."""
    verify = wanted(verify, path)
    manifest = read_manifest(path, verify)  # from the trailer; a file without one is refused here
    if verify:
        trailer = onefile.read_trailer(path)
        if trailer is None:  # cannot happen after read_manifest; never load unverified by accident
            raise ChecksumMismatchError(f"{path} has no checksum trailer.")
        onefile.verify(path, trailer, ops.rank(), ops.world_size(), gather=ops.all_gather_object)
    return manifest, verify


def _load_full(model: torch.nn.Module, optimizers: List[torch.optim.Optimizer], path: str) -> Dict[str, Any]:
    # Verified first, in shares across the ranks: the pages read to hash it are those
    # the mapped load below uses, so the file is read from disk once.
    manifest, verified = verify_one_file(path)
    # mmap: the file's pages are shared between ranks through the page cache
    # instead of each rank holding a private copy.
    payload = load_torch(path, mmap=True)
    if not isinstance(payload, dict) or "state_dict" not in payload:
        raise CorruptCheckpointError(f"{path} has no 'state_dict' entry: not a full shardwise checkpoint.")
    if verified:
        check_agreement(path, manifest, payload)
    adapter = is_adapter_checkpoint(manifest)
    _check_model(path, shapes_of(payload["state_dict"]), model, adapter)
    optim_states = payload.get("optimizer_states", [])
    _check_optimizer_count(path, len(optim_states), len(optimizers))
    # FSDP: every rank has the whole tensor and keeps its slice (no broadcast).
    options = StateDictOptions(full_state_dict=True) if _is_sharded(model) else StateDictOptions()
    set_model_state_dict(model, payload["state_dict"], options=load_options(options, adapter))
    for index, (opt, osd) in enumerate(zip(optimizers, optim_states)):
        # An optimizer without per-parameter tensors (plain SGD) has nothing to
        # slice, and torch's full-state path then fails ("Expected device to be
        # set"): its hyper-parameters load the same way under any layout.
        opt_options = options if _has_tensor_state(osd) else StateDictOptions()
        try:
            set_optimizer_state_dict(model, opt, osd, options=opt_options)
        except (KeyError, ValueError, RuntimeError) as exc:
            raise CheckpointMismatchError(
                f"Optimizer {index} in {path} does not match the running optimizer ({type(opt).__name__}): {exc}"
            ) from exc
    return {k: v for k, v in payload.items() if k not in ("state_dict", "optimizer_states")}


def _has_tensor_state(osd: Mapping[str, Any]) -> bool:
    return any(
        isinstance(v, torch.Tensor) and v.dim() > 0
        for per_param in (osd.get("state") or {}).values()
        if isinstance(per_param, dict)
        for v in per_param.values()
    )


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
                f"{file} is truncated: {actual} bytes, the checkpoint's metadata needs at least {size}."
            )


def read_dcp_metadata(path: str) -> Any:
    """DCP's `.metadata`, unpickled through the allow-list (safety.py), with every data file checked present."""
    file = os.path.join(path, _DCP_METADATA)
    if not os.path.exists(file):
        raise CorruptCheckpointError(f"{file} is missing: {path} is not a complete sharded checkpoint.")
    metadata = SafeFileSystemReader(path).read_metadata()
    check_dcp_files(path, metadata)
    return metadata


def _prefixed_shapes(metadata: Any, prefix: str) -> Dict[str, Tuple[int, ...]]:
    out = {}
    for key, md in metadata.state_dict_metadata.items():
        if key.startswith(prefix) and hasattr(md, "size"):
            out[key[len(prefix) :]] = tuple(md.size)
    return out


def _load_sharded(model: torch.nn.Module, optimizers: List[torch.optim.Optimizer], path: str) -> Dict[str, Any]:
    manifest = read_manifest(path)
    sums = recorded_checksums(path, manifest) if verify_enabled() else {}
    data_files = {rel for rel in sums if rel.endswith(".distcp")}
    # Small files first (each rank a share, all raise together); the data
    # files are hashed while DCP reads them (dcp_io.py): one pass, not two.
    verify_directory(
        path, manifest, ops.rank(), ops.world_size(), gather=ops.all_gather_object, only=set(sums) - data_files
    )
    state = read_trainer_state(path)
    metadata = read_dcp_metadata(path)
    adapter = is_adapter_checkpoint(manifest)
    _check_model(path, _prefixed_shapes(metadata, _MODEL + "."), model, adapter)
    saved_optims = {k.split(".")[1] for k in metadata.state_dict_metadata if k.startswith(_OPTIMIZERS + ".")}
    _check_optimizer_count(path, len(saved_optims), len(optimizers))
    # Templates in the running layout (DTensor shards under FSDP, whole
    # tensors otherwise): DCP reads into them whatever slices they cover.
    payload = {
        _MODEL: model_state(model, None, adapter),
        _OPTIMIZERS: {str(i): get_optimizer_state_dict(model, opt) for i, opt in enumerate(optimizers)},
    }
    reader = VerifyingReader(path, metadata, {rel: sums[rel] for rel in data_files})
    planner = SafeLoadPlanner()
    # no_dist on every rank: each rank plans its own reads from the metadata
    # (its DTensor shards say which slices it needs), skipping DCP's three
    # planning / result collectives; the one gather below shares the verdicts.
    error: Optional[BaseException] = None
    try:
        with warnings.catch_warnings():  # "assuming the intent is to load in a single process": per rank, yes
            warnings.filterwarnings("ignore", message="torch.distributed is disabled")
            dcp.load(payload, storage_reader=reader, planner=planner, no_dist=True)
    except BaseException as exc:  # noqa: B036 - CheckpointException is a BaseException
        if isinstance(exc, (KeyboardInterrupt, SystemExit)):
            raise
        error = _our_error(exc) or (
            exc
            if isinstance(exc, CheckpointError)
            else CorruptCheckpointError(
                f"Reading {path} failed; a data file may be corrupt: {type(exc).__name__}: "
                f"{str(exc).splitlines()[0] if str(exc) else ''}"
            )
        )
        error.__cause__ = exc
    verdicts = ops.all_gather_object(
        (None if error is None else f"{type(error).__name__}: {error}", sorted(reader.verified))
    )
    if error is not None:
        raise error
    failed = [v for v, _ in verdicts if v]
    if failed:
        raise CorruptCheckpointError(f"Loading {path} failed on another rank: {failed[0]}")
    # Data files no rank read to the end (a partial or resharded read): hash them now.
    covered = set().union(*[set(v) for _, v in verdicts])
    if data_files - covered:
        verify_directory(
            path, manifest, ops.rank(), ops.world_size(), gather=ops.all_gather_object, only=data_files - covered
        )
    # Every file verified: only now is anything decoded and copied into the model and optimizers.
    problem: Optional[BaseException] = None
    try:
        reader.apply(planner)
    except Exception as exc:  # noqa: BLE001 - shared with every rank below, then raised by name
        problem = exc if isinstance(exc, CheckpointError) else CorruptCheckpointError(f"Decoding {path} failed: {exc}")
    verdict = None if problem is None else f"{type(problem).__name__}: {problem}"
    failed = [v for v in ops.all_gather_object(verdict) if v]
    if problem is not None:
        raise problem
    if failed:
        raise CorruptCheckpointError(f"Loading {path} failed on another rank: {failed[0]}")
    set_model_state_dict(model, payload[_MODEL], options=load_options(None, adapter))
    for i, opt in enumerate(optimizers):
        set_optimizer_state_dict(model, opt, payload[_OPTIMIZERS][str(i)])
    return state


def _our_error(exc: BaseException) -> Optional[CheckpointError]:
    """The shardwise error inside DCP's CheckpointException ({rank: (exception, trace)}), if any."""
    for value in (getattr(exc, "failures", None) or {}).values():
        inner = value[0] if isinstance(value, tuple) and value else value
        if isinstance(inner, CheckpointError):
            return inner
    return None

"""DeepSpeed checkpoints inside shardwise's checkpoint layout, and their conversion to one state dict.

A "deepspeed" checkpoint is a directory: the engine's own files under
`engine/` (every rank writes its ZeRO shard), `trainer_state.pt` and the
manifest `shardwise.json` (written by checkpoint/layout.py, so it is listed,
inspected and resumed like any other), and `deepspeed.json`: the stage, the
world size and every parameter and persistent buffer of the model with its
shape and, for a parameter registered under two names, the name it aliases.
That list is what makes conversion trustworthy: zero_to_fp32 rebuilds
weights from the optimizer's flat partitions, which hold each shared
parameter once, so aliases (tied heads) come back missing -- the way a
peer's stage-2 conversion drops parameters. `consolidate` restores aliases
from their owner and fails, naming them, if any listed tensor is still absent
or mis-shaped. Resuming at another world size goes through DeepSpeed's
universal checkpoint (converted once, into `universal/` beside `engine/`).

Trust: DeepSpeed (its engine, ds_to_universal, zero_to_fp32) unpickles its
files with weights_only=False. Before any of them runs, every engine file is
scanned (pickletools, nothing executed) and refused with
UnsafeCheckpointError if it names a global beyond torch's allow-list and
the three DeepSpeed types its own files hold (`DS_SAFE_GLOBALS`). Every file
is also checksummed in the manifest after the save (each rank hashes a share)
and verified before loading or converting, and the manifest's fields are
compared with trainer_state.pt before the engine loads (integrity.py).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
from typing import Any, Dict, Iterable, List, Optional

import torch
from torch import nn

from shardwise.checkpoint.errors import (
    CheckpointError,
    CheckpointFormatError,
    CheckpointMismatchError,
    CheckpointWriteError,
    CorruptCheckpointError,
)
from shardwise.checkpoint.integrity import (
    hash_files,
    record_checksums,
    verify_directory,
    wanted,
    write_error,
    write_json_durably,
)
from shardwise.checkpoint.layout import (
    MANIFEST_NAME,
    TRAINER_STATE_NAME,
    read_manifest,
    read_trainer_state,
    remove_checkpoint,
    save_torch_durably,
    write_trainer_state,
)
from shardwise.checkpoint.reader import CheckpointReader, TensorInfo
from shardwise.checkpoint.safety import iter_files, safe_torch_load, unsafe_error, unsafe_globals
from shardwise.distributed import ops
from shardwise.strategies.deepspeed_env import ensure_accelerator_env

FORMAT = "deepspeed"
#: What DeepSpeed 0.19's ZeRO files pickle besides tensors and plain data (found by scanning stages 0-3).
DS_SAFE_GLOBALS = (
    "deepspeed.runtime.fp16.loss_scaler.LossScaler",
    "deepspeed.runtime.fp16.loss_scaler.DynamicLossScaler",
    "deepspeed.runtime.zero.config.ZeroStageEnum",
    "deepspeed.utils.tensor_fragment.fragment_address",
)
ENGINE_TAG = "engine"
UNIVERSAL_TAG = "universal"
PARAMS_NAME = "deepspeed.json"


def describe_model(module: nn.Module) -> Dict[str, Dict[str, Any]]:
    """Every parameter (aliases included) and persistent buffer: shape, dtype, and the name it aliases."""
    owners: Dict[int, str] = {}
    out: Dict[str, Dict[str, Any]] = {}
    for name, p in module.named_parameters(remove_duplicate=False):
        shape = tuple(getattr(p, "ds_shape", p.shape))  # ZeRO-3 parameters are empty locally
        entry = {
            "shape": list(shape),
            "dtype": str(p.dtype).replace("torch.", ""),
            "kind": "parameter",
            "requires_grad": bool(p.requires_grad),
        }
        if id(p) in owners:
            entry["alias_of"] = owners[id(p)]
        else:
            owners[id(p)] = name
        out[name] = entry
    for prefix, mod in module.named_modules():
        for name, b in mod._buffers.items():
            if b is not None and name not in mod._non_persistent_buffers_set:
                full = f"{prefix}.{name}" if prefix else name
                out[full] = {"shape": list(b.shape), "dtype": str(b.dtype).replace("torch.", ""), "kind": "buffer"}
    return out


def read_params(path: str) -> Dict[str, Any]:
    file = os.path.join(path, PARAMS_NAME)
    if not os.path.exists(file):
        raise CorruptCheckpointError(
            f"{path} has no {PARAMS_NAME}: it is not a complete shardwise DeepSpeed "
            "checkpoint (or it was written by another tool)."
        )
    try:
        with open(file) as fh:
            return json.load(fh)
    except ValueError as exc:  # damaged: said by name (its checksum, where verified, says more)
        raise CorruptCheckpointError(f"{file} is truncated or corrupt: {exc}") from None


# --------------------------------------------------------------- save / load
class _RecordedErrors:
    """While DeepSpeed's engine saves, its file writes record their failure instead of raising it.

    The engine ends its save with a barrier: a rank whose write raised would leave the others waiting
    in it until the collective timeout. Recorded, the error reaches every rank through the gather that
    follows the save. Files go through save_torch_durably (checkpoint/layout.py) when the engine writes
    with torch.save, so a full disk is named ENOSPC instead of torch's "unexpected pos".
    """

    def __init__(self, engine: Any) -> None:
        self.engine = engine
        self.error: Optional[BaseException] = None
        self.saved: List[str] = []

    def _guard(self, fn: Any, where: Any) -> Any:
        def guarded(*args: Any, **kwargs: Any) -> Any:
            if self.error is not None:  # the disk failed already: write nothing more
                return None
            try:
                return fn(*args, **kwargs)
            except (OSError, RuntimeError) as exc:
                self.error = write_error(exc, where(*args, **kwargs))
                return None

        return guarded

    def __enter__(self) -> "_RecordedErrors":
        ce = self.engine.checkpoint_engine
        save = ce.save
        if type(ce).__name__ == "TorchCheckpointEngine":

            def save(state_dict: Any, path: str) -> None:  # noqa: F811 - the engine's own save, with errors named
                save_torch_durably(state_dict, path)

        ce.save = self._guard(save, lambda *a, **k: k.get("path") or a[1])
        ce.makedirs = self._guard(ce.makedirs, lambda *a, **k: a[0])
        self.engine._copy_recovery_script = self._guard(self.engine._copy_recovery_script, lambda *a, **k: a[0])
        return self

    def __exit__(self, *exc: Any) -> None:
        for owner, name in ((self.engine.checkpoint_engine, "save"), (self.engine.checkpoint_engine, "makedirs")):
            owner.__dict__.pop(name, None)
        self.engine.__dict__.pop("_copy_recovery_script", None)


def _agree(strategy: Any, path: str, error: Optional[BaseException]) -> None:
    """Every rank raises together when any rank's write failed (collective); the temporary directory goes."""
    errors = [
        e
        for e in ops.all_gather_object(
            None if error is None else (strategy.global_rank, str(error), getattr(error, "errno", 0))
        )
        if e
    ]
    if not errors:
        return
    if strategy.is_global_zero:
        try:
            remove_checkpoint(path)
        except OSError:  # a read-only disk: it stays, hidden, and the next run removes it
            pass
    message = f"Saving the DeepSpeed checkpoint {path} failed; the previous checkpoints are untouched. " + "; ".join(
        f"rank {rank}: {text}" for rank, text, _ in errors
    )
    codes = [code for _, _, code in errors if code]
    if codes:
        raise CheckpointWriteError(message, codes[0], path)
    raise CheckpointError(message)


def save_engine_checkpoint(strategy: Any, path: str, state: Dict[str, Any]) -> None:
    """Every rank writes its ZeRO shard through the engine; rank 0 adds trainer state and the parameter list.

    A failed write on any rank (full disk, read-only folder) raises the same CheckpointWriteError on every
    rank, right after the engine's save, and removes the temporary directory.
    """
    engine = strategy.require_engine()
    error: Optional[BaseException] = None
    if strategy.is_global_zero:
        try:
            os.makedirs(path, exist_ok=True)
        except OSError as exc:
            error = write_error(exc, path)
    _agree(strategy, path, error)
    # The engine saves only what it owns; the trainer's state travels in trainer_state.pt.
    with _RecordedErrors(engine) as recorded:
        engine.save_checkpoint(path, tag=ENGINE_TAG, client_state={}, save_latest=False)
    error = recorded.error
    if strategy.is_global_zero and error is None:
        try:
            # DeepSpeed's own tools (zero_to_fp32.py) find the tag here.
            with open(os.path.join(path, "latest"), "w") as fh:
                fh.write(ENGINE_TAG)
            write_trainer_state(path, state)
            info = {
                "stage": strategy.stage,
                "world_size": strategy.world_size,
                "precision": strategy.precision.name if strategy.precision else None,
                "tensors": describe_model(strategy.module),
            }
            write_json_durably(os.path.join(path, PARAMS_NAME), info)
        except (OSError, CheckpointError) as exc:
            error = write_error(exc, path)
    _agree(strategy, path, error)
    # Every file now exists: each rank hashes every world_size-th, rank 0 records them all.
    sums: Dict[str, Any] = {}
    try:
        files = [f for f in iter_files(path) if f != MANIFEST_NAME]
        sums = hash_files(path, files[strategy.global_rank :: strategy.world_size])
    except OSError as exc:
        error = write_error(exc, path)
    gathered = ops.all_gather_object(sums)
    if error is None and strategy.is_global_zero:
        try:
            record_checksums(path, {k: v for part in gathered for k, v in part.items()})
        except (OSError, CheckpointError) as exc:
            error = write_error(exc, path)
    _agree(strategy, path, error)


def check_engine_files(path: str) -> None:
    """Refuse engine files that name globals beyond the allow-list, before DeepSpeed unpickles them."""
    for sub in (ENGINE_TAG, UNIVERSAL_TAG):
        root = os.path.join(path, sub)
        if not os.path.isdir(root):
            continue
        for rel in iter_files(root):
            if rel.endswith(".pt"):
                file = os.path.join(root, rel)
                names = unsafe_globals(file, DS_SAFE_GLOBALS)
                if names:
                    raise unsafe_error(file, "", names)


def verify_checkpoint(strategy: Any, path: str) -> None:
    """Checksums (a share per rank, verdicts shared) and the global scan, before DeepSpeed reads anything."""
    verify_directory(path, read_manifest(path), strategy.global_rank, strategy.world_size, gather=ops.all_gather_object)
    check_engine_files(path)


def load_engine_checkpoint(
    strategy: Any, path: str, checkpoint_format: str = FORMAT, load_optimizer_states: bool = True
) -> Dict[str, Any]:
    if checkpoint_format != FORMAT:
        raise CheckpointFormatError(
            f"{path} is a {checkpoint_format!r} checkpoint, which the DeepSpeed engine cannot load. Convert it to "
            f"weights (`shardwise convert {path} weights.safetensors`), load them into the model in "
            "configure_model, and start a new run (the optimizer state does not carry over)."
        )
    verify_checkpoint(strategy, path)
    # Before the engine loads anything: the trainer state, compared with the manifest (an edited step fails).
    state = read_trainer_state(path)
    info = read_params(path)
    engine = strategy.require_engine()
    tag = ENGINE_TAG
    if info["world_size"] != strategy.world_size:
        tag = _universal_for(strategy, path, info)
    engine._config.load_universal_checkpoint = tag == UNIVERSAL_TAG  # read by load_checkpoint only
    try:
        loaded, _ = engine.load_checkpoint(
            path,
            tag=tag,
            load_optimizer_states=load_optimizer_states,
            load_lr_scheduler_states=False,
            load_module_strict=True,
        )
    finally:
        engine._config.load_universal_checkpoint = False
    if loaded is None:
        raise CorruptCheckpointError(f"DeepSpeed found no loadable engine state in {os.path.join(path, tag)}.")
    return state


def _universal_for(strategy: Any, path: str, info: Dict[str, Any]) -> str:
    """Convert the engine files to DeepSpeed's world-size-independent layout once (rank 0), then use it."""
    target = os.path.join(path, UNIVERSAL_TAG)
    error: Optional[str] = None
    if strategy.is_global_zero and not os.path.isdir(target):
        tmp = target + ".tmp"
        shutil.rmtree(tmp, ignore_errors=True)
        try:
            to_universal(os.path.join(path, ENGINE_TAG), tmp)
            os.replace(tmp, target)
            # The converter names its output folder in `latest_universal`; that was the temporary name.
            with open(os.path.join(path, "latest_universal"), "w") as fh:
                fh.write(UNIVERSAL_TAG)
        except Exception as exc:  # report on every rank, not only the one that failed
            shutil.rmtree(tmp, ignore_errors=True)
            error = f"{type(exc).__name__}: {exc}"
    error = strategy.broadcast(error)
    if error is not None:
        raise CheckpointMismatchError(
            f"{path} was saved by {info['world_size']} ranks and this run has {strategy.world_size}. Converting it "
            f"to DeepSpeed's universal checkpoint failed ({error}). Resume with devices x num_nodes = "
            f"{info['world_size']}, or start a new run from its weights: `shardwise convert {path} "
            "weights.safetensors` and load them in configure_model."
        )
    return UNIVERSAL_TAG


def to_universal(engine_dir: str, output_dir: str) -> None:
    """DeepSpeed's ds_to_universal on one checkpoint tag, in this process (no worker pools)."""
    from deepspeed.checkpoint import ds_to_universal

    # inject_missing_state: stages 1-2 need a universal_checkpoint_info entry that only tensor-parallel
    # clients (Megatron) write; for pure data parallelism DeepSpeed's own default (its version) is right.
    # Without it a ZeRO-1/2 checkpoint could not resume at another world size (stage 3 never needed it).
    args = argparse.Namespace(
        input_folder=engine_dir,
        output_folder=output_dir,
        num_extract_workers=1,
        num_merge_workers=1,
        keep_temp_folder=False,
        strict=True,
        inject_missing_state=True,
    )
    ds_to_universal.main(args)


# ---------------------------------------------------------------- conversion
def consolidate(path: str, names: Optional[Iterable[str]] = None) -> Dict[str, torch.Tensor]:
    """The full fp32 state dict of a shardwise DeepSpeed checkpoint, checked against its parameter list."""
    info = read_params(path)
    expected: Dict[str, Dict[str, Any]] = info["tensors"]
    if info["stage"] == 0:
        state = _stage0_state(path)
    else:
        ensure_accelerator_env(None)
        from deepspeed.utils.zero_to_fp32 import get_fp32_state_dict_from_zero_checkpoint

        state = get_fp32_state_dict_from_zero_checkpoint(path, tag=ENGINE_TAG)
    # Shared parameters are stored once: give each alias its owner's tensor back.
    for name, entry in expected.items():
        owner = entry.get("alias_of")
        if name not in state and owner is not None and owner in state:
            state[name] = state[owner]
    missing = [n for n in expected if n not in state]
    wrong = [
        f"{n}: {tuple(state[n].shape)} instead of {tuple(expected[n]['shape'])}"
        for n in expected
        if n in state and tuple(state[n].shape) != tuple(expected[n]["shape"])
    ]
    if missing or wrong:
        lines = [f"  - missing {n}" for n in missing[:20]] + [f"  - {w}" for w in wrong[:20]]
        raise CorruptCheckpointError(
            f"Consolidating {path} lost {len(missing)} tensor(s) and mis-shaped {len(wrong)} of the "
            f"{len(expected)} the model had:\n" + "\n".join(lines)
        )
    wanted = list(expected) if names is None else list(names)
    return {n: state[n].detach().contiguous() for n in wanted}


class _DeepSpeedObject:
    """Stands in for DeepSpeed's own objects (DS_SAFE_GLOBALS) while the structure of its files is read
    for `inspect`: their tensors' shapes are all it needs, so nothing of DeepSpeed is imported or run."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        pass

    def __setstate__(self, state: Any) -> None:
        pass


def _tensor_infos(tree: Any, prefix: str) -> List[TensorInfo]:
    if isinstance(tree, torch.Tensor):
        return [TensorInfo(prefix, tuple(tree.shape), tree.dtype)]
    items = tree.items() if isinstance(tree, dict) else enumerate(tree) if isinstance(tree, (list, tuple)) else ()
    return [info for key, value in items for info in _tensor_infos(value, f"{prefix}.{key}")]


def optimizer_state_infos(path: str) -> List[TensorInfo]:
    """Shape and dtype of every tensor of the engine's optimizer state, every rank's partition: ZeRO's
    `*optim_states.pt` (the optimizer's moments and the fp32 master partitions), or, without ZeRO (stage 0),
    the optimizer section of the model file. Only the pickled structure is read (meta device)."""
    root = os.path.join(path, ENGINE_TAG)
    stand_ins = [(_DeepSpeedObject, name) for name in DS_SAFE_GLOBALS]
    out: List[TensorInfo] = []
    for rel in iter_files(root) if os.path.isdir(root) else ():
        if not rel.endswith(("optim_states.pt", "model_states.pt")):
            continue
        tree = safe_torch_load(os.path.join(root, rel), map_location="meta", extra_safe=stand_ins)
        if rel.endswith("model_states.pt"):
            tree = tree.get("optimizer") if isinstance(tree, dict) else None  # None under ZeRO
        out += _tensor_infos(tree, f"optimizer.{rel[: -len('.pt')]}")
    return out


def _stage0_state(path: str) -> Dict[str, torch.Tensor]:
    file = os.path.join(path, ENGINE_TAG, "mp_rank_00_model_states.pt")
    if not os.path.exists(file):
        raise CorruptCheckpointError(f"{file} is missing: the checkpoint is incomplete.")
    payload = safe_torch_load(file)  # no DeepSpeed type in a stage-0 model file
    return {k: v.float() if v.is_floating_point() else v for k, v in payload["module"].items()}


class DeepSpeedReader(CheckpointReader):
    """Lets `shardwise convert` / `inspect` read DeepSpeed checkpoints (consolidating once, on first read)."""

    def __init__(self, path: str, manifest: Dict[str, Any], verify: Optional[bool] = None) -> None:
        super().__init__(path, manifest)
        self.info = read_params(path)
        self._state: Optional[Dict[str, torch.Tensor]] = None
        self._verify = wanted(verify, path)  # every file before the first read (integrity.wanted)

    def tensors(self) -> List[TensorInfo]:
        # Master weights are fp32, whatever precision the model trained in.
        out = []
        for name, entry in self.info["tensors"].items():
            dtype = getattr(torch, entry["dtype"])
            if entry["kind"] == "parameter" and dtype.is_floating_point:
                dtype = torch.float32
            out.append(TensorInfo(name, tuple(entry["shape"]), dtype))
        return out

    def read(self, names: Iterable[str]) -> Dict[str, torch.Tensor]:
        if self._state is None:
            verify_directory(self.path, read_manifest(self.path, self._verify), verify=self._verify)
            check_engine_files(self.path)
            self._state = consolidate(self.path)
        return {n: self._state[n] for n in names}

    def optimizer_tensors(self) -> List[TensorInfo]:
        engine = [os.path.join(ENGINE_TAG, rel) for rel in iter_files(os.path.join(self.path, ENGINE_TAG))]
        verify_directory(self.path, self.manifest, only=[f for f in engine if f.endswith(".pt")], verify=self._verify)
        return optimizer_state_infos(self.path)

    def trainer_state(self) -> Dict[str, Any]:
        verify_directory(self.path, self.manifest, only=[TRAINER_STATE_NAME], verify=self._verify)
        return read_trainer_state(self.path, self._verify)

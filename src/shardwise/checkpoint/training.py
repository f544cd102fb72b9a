"""Save and restore a whole training run: the trainer's side of a checkpoint.

The strategy writes the model and optimizers in its format (strategies/base.py
states the contract); this file gathers everything else a resumed run needs
to continue exactly where the saved one was -- progress counters, the data
position, every rank's RNG states, LR schedulers, the grad scaler, callback
and logger state, the module's own extras and hyperparameters -- and runs
the atomic commit (layout.py). The caller hands over these stateful parts
explicitly, as one `TrainingStates` (torchtitan passes its `states=` the same
way): nothing here reads the Trainer or calls into it. Where the RNG states
come from and where they go back is the subtle part, explained at
`_resume_position` and in trainer/loaders.epoch_iterator: a checkpoint is taken
right after an optimizer step, and the resumed run puts the generators back
at the matching point of its own loop, so both runs draw the same numbers
from there on.
"""

from __future__ import annotations

import errno
import io
import itertools
import os
import shutil
import warnings
from concurrent.futures import Future
from dataclasses import dataclass
from typing import Any, Callable, Dict, List, Optional, Tuple

import torch

from shardwise.checkpoint import adapters, formats, layout, loader_state
from shardwise.checkpoint.errors import CheckpointError, CheckpointMismatchError, CheckpointWriteError
from shardwise.checkpoint.formats import check_format_readable
from shardwise.checkpoint.integrity import merge_checksum_parts, write_error
from shardwise.checkpoint.rng import capture_rng_states
from shardwise.checkpoint.safety import safe_torch_load
from shardwise.data import find_sampler
from shardwise.distributed import ops
from shardwise.state import TrainState


@dataclass
class TrainingStates:
    """The stateful parts of a run that a checkpoint saves and restores, handed over by the Trainer.

    The model and optimizers are saved by the strategy in its own format; these
    are the rest. Restoring writes into them (the train state, the sampler, the
    LR schedulers and grad scaler, callbacks, loggers, the metrics dict), never
    into their owner.
    """

    strategy: Any  # model, optimizers, LR schedulers, grad scaler; ranks and collectives; the format
    train_state: TrainState  # progress counters, run id, where in the loop the save happens, RNG bookkeeping
    loader: Any  # the training DataLoader: its sampler's position and its batch size
    callbacks: List[Any]  # saved with state_dict() / restored with load_state_dict(), keyed by state_key
    loggers: List[Any]  # the same
    callback_metrics: Dict[str, Any]  # saved, and updated in place on restore
    module: Any  # the TrainModule: its hparams and on_save_checkpoint / on_load_checkpoint hooks
    # Runs the callbacks' ("on_save_checkpoint" | "on_load_checkpoint", checkpoint) hooks, with the
    # arguments Lightning's callbacks expect (the Trainer binds itself as their first one).
    callback_hook: Callable[[str, Dict[str, Any]], None]


class PendingCheckpoint:
    """A checkpoint written (or being written) under its temporary name, not yet committed.

    `commit()` is collective: every rank waits for its own writes, the ranks
    agree that all succeeded, then rank 0 renames the checkpoint into place.
    """

    def __init__(self, strategy: Any, tmp: str, final: str, future: Optional[Any]) -> None:
        self.strategy, self.tmp, self.final, self.future = strategy, tmp, final, future

    @property
    def is_async(self) -> bool:
        # The same answer on every rank: a synchronous save that failed on some ranks only hands those
        # a completed Future (formats._failed), and all ranks must still commit together, now.
        return self.future is not None and not getattr(self.future, "synchronous", False)

    def written_everywhere(self) -> bool:
        """Whether every rank's background write has ended, well or not (collective: one all-reduce).

        Not on the checkpoint group: DCP's own background collectives may still be running on it.
        """
        future = getattr(self.future, "upload_completion", self.future)
        done = not isinstance(future, Future) or future.done()
        return bool(ops.reduce(float(done), "min").item() > 0) if ops.is_initialized() else done

    def commit(self) -> str:
        error, errno_ = None, None
        try:
            future = getattr(self.future, "upload_completion", self.future)  # AsyncSaveResponse or Future
            if isinstance(future, Future):
                future.result()
        except BaseException as exc:  # reported to every rank below, so none waits forever
            error = f"rank {self.strategy.global_rank}: {type(exc).__name__}: {exc}"
            errno_ = getattr(exc, "errno", None)
        # On the checkpoint group: the other ranks wait here while rank 0 writes a full checkpoint.
        group = formats.checkpoint_group() if ops.is_initialized() else None
        reports = [r for r in ops.all_gather_object((error, errno_), group=group) if r[0]]
        if reports:
            if self.strategy.is_global_zero:
                _remove_quietly(self.tmp)
            message = f"Saving {self.final} failed; the previous checkpoints are untouched. " + "; ".join(
                e for e, _ in reports
            )
            codes = [c for _, c in reports if c]
            if codes:  # a filesystem error (ENOSPC, EROFS, ...): keep it an OSError with its errno
                raise CheckpointWriteError(message, codes[0], self.final)
            raise CheckpointError(message)
        # The rename can fail too (the folder turned read-only since the write began, as an async save's
        # commit at the next save may find it): every rank learns it from rank 0, none waits alone.
        failure: Optional[Tuple[str, int]] = None
        if self.strategy.is_global_zero:
            try:
                try:  # an async save's per-rank checksums into the manifest
                    merge_checksum_parts(self.tmp)
                except OSError:  # a full disk: the rename below needs no room, and loading reads the parts
                    pass
                layout.commit(self.tmp, self.final)
                _LAST_BYTES[os.path.dirname(self.final)] = checkpoint_bytes(self.final)
            except OSError as exc:
                error_ = write_error(exc, self.final)
                failure = (str(error_), error_.errno)
                _remove_quietly(self.tmp)
        failure = self.strategy.broadcast(failure)
        if failure is not None:
            raise CheckpointWriteError(
                f"Committing {self.final} failed; the previous checkpoints are untouched. rank 0: {failure[0]}",
                failure[1],
                self.final,
            )
        return self.final


def _remove_quietly(path: str) -> None:
    """Remove a temporary checkpoint; on a read-only disk it stays, hidden, and the next run removes it."""
    try:
        layout.remove_checkpoint(path)
    except OSError:
        pass


# ------------------------------------------------------- room on the disk
# The size of the last checkpoint committed in each directory by this process (rank 0): the next save's
# estimate. Saves of one run differ only by a few bytes of trainer state.
_LAST_BYTES: Dict[str, int] = {}


def checkpoint_bytes(path: str) -> int:
    """The bytes a checkpoint (one file, or a directory's files) takes."""
    if not os.path.isdir(path):
        return os.path.getsize(path)
    return sum(os.path.getsize(os.path.join(root, n)) for root, _, names in os.walk(path) for n in names)


def estimated_checkpoint_bytes(strategy: Any, directory: str, adapter: bool = False) -> Tuple[int, str]:
    """(bytes the next checkpoint in `directory` will take, where that figure comes from), on rank 0.

    The last checkpoint this process committed there, else the model's and the optimizers' state as held in
    memory (a DTensor counts its global size; DeepSpeed's partitioned state counts this rank's part, so the
    first estimate errs low: a save is refused only when it surely cannot fit).
    """
    if directory in _LAST_BYTES:
        return _LAST_BYTES[directory], "the size of the last checkpoint saved there"
    module = strategy.module
    tensors = itertools.chain(
        (p for p in module.parameters() if p.requires_grad or not adapter), [] if adapter else module.buffers()
    )
    total = sum(int(getattr(t, "ds_numel", t.numel())) * t.element_size() for t in tensors)
    for opt in strategy.optimizers:
        try:
            states = list(getattr(opt, "state", {}).values())
        except Exception:  # noqa: BLE001 - an engine's optimizer wrapper without a plain `state`: count the model
            states = []
        for per_param in states:
            if isinstance(per_param, dict):
                total += sum(t.numel() * t.element_size() for t in per_param.values() if isinstance(t, torch.Tensor))
    return total, "the model's and optimizers' state"


def _mib(n: float) -> str:
    return f"{n / 2**20:,.1f} MiB"


def check_room(strategy: Any, final: str, adapter: bool = False) -> None:
    """Refuse, on every rank at once, a save whose folder cannot be made or whose disk cannot hold it.

    Collective. Runs before anything is written, so a refused save leaves nothing behind and the previous
    checkpoints, and `last`, as they were. Rank 0 needs room for the whole checkpoint (it writes it all on a
    shared disk, or the one file), every other rank for its share (node-local disks).
    """
    directory = os.path.dirname(final)
    problem: Optional[Tuple[str, int]] = None
    need, basis = 0, ""
    if strategy.is_global_zero:
        try:
            os.makedirs(directory, exist_ok=True)
        except OSError as exc:
            error = write_error(exc, directory)
            problem = (str(error), error.errno)
        need, basis = estimated_checkpoint_bytes(strategy, directory, adapter)
    need = strategy.broadcast(need)
    if problem is None and os.path.isdir(directory):
        share = need if strategy.is_global_zero else need // max(1, strategy.world_size)
        free = shutil.disk_usage(directory).free
        if free < share:
            problem = (
                f"Not saving {final}: it needs about {_mib(share)} on rank {strategy.global_rank} "
                f"({basis or 'its share of the checkpoint'}) and the filesystem holding {directory} has "
                f"{_mib(free)} free. ENOSPC ({os.strerror(errno.ENOSPC)}): nothing was written and the previous "
                "checkpoints and last.ckpt are untouched; free space or point the checkpoint directory at a "
                "larger disk (ModelCheckpoint(dirpath=...) / default_root_dir=), then resume with "
                "ckpt_path='last'.",
                errno.ENOSPC,
            )
    reports = [r for r in ops.all_gather_object(problem) if r]
    if reports:
        raise CheckpointWriteError("; ".join(m for m, _ in reports), reports[0][1], final)


# --------------------------------------------------------------------- save
def _resume_position(train_state: TrainState) -> Dict[str, Any]:
    """The loop position a resumed run must start from (TrainState.resume_position).

    Inside on_train_epoch_end the epoch's work is done (its validation, its
    epoch-interval schedulers, its callbacks) although the counters still
    say `epoch`: a run resumed from there starts at the next epoch, or it
    would repeat that work. Anywhere else the counters are the position.
    """
    return train_state.resume_position()


def _keyed(objects: List[Any], method: str) -> Dict[str, Any]:
    out: Dict[str, Any] = {}
    for obj in objects:
        fn = getattr(obj, method, None)
        if not callable(fn):
            continue
        key = getattr(obj, "state_key", None) or type(obj).__qualname__
        base, n = key, 1
        while key in out:  # two callbacks of one class: keep both, in order
            n += 1
            key = f"{base}#{n}"
        out[key] = fn()
    return out


def _with_step(logger_state: Any, state: Dict[str, Any]) -> Any:
    """A logger's saved state plus the checkpoint's step ("checkpoint_step"): a resumed logger drops or
    skips what the interrupted run logged after it (loggers/csv.py, loggers/tracker.py)."""
    step = (state.get("train_state") or {}).get("global_step")
    if not isinstance(logger_state, dict) or step is None:
        return logger_state
    return {**logger_state, "checkpoint_step": int(step)}


def _gather_rng(rng: Dict[str, Any]) -> List[Dict[str, Any]]:
    """Every rank's RNG states, on every rank. They travel as torch.save bytes: pickling a
    tensor straight through all_gather_object does not round-trip its storage."""
    buffer = io.BytesIO()
    torch.save(rng, buffer)
    return [
        safe_torch_load(io.BytesIO(blob), name="an RNG state from another rank")
        for blob in ops.all_gather_object(buffer.getvalue())
    ]


def _layout_label(strategy: Any) -> Optional[str]:
    """The strategy's parallel layout in words, or None for a strategy that cannot describe itself."""
    try:
        return strategy.parallel_plan.label
    except (AttributeError, TypeError, ValueError):  # a user's strategy without a plan: the checkpoint needs none
        return None


def collect_state(states: TrainingStates) -> Dict[str, Any]:
    """Everything but the model and optimizers, identical on every rank (collective: gathers RNG states)."""
    strategy, module, train_state = states.strategy, states.module, states.train_state
    position = _resume_position(train_state)
    # During validation the generators run on a copy; save training's own.
    rng = train_state.rng_outside_validation or capture_rng_states()
    loader = states.loader
    sampler = find_sampler(loader)
    state: Dict[str, Any] = {
        "shardwise": {
            **layout.build_manifest(
                strategy.checkpoint_format, getattr(strategy, "name", "?"), strategy.world_size, position
            ),
            "optimizers": [type(opt).__name__ for opt in strategy.optimizers],
            # What `shardwise inspect` shows: "FSDP FULL_SHARD x sp 2"; loading reads no layout from it.
            "layout": _layout_label(strategy),
            "run_id": train_state.run_id,
            # An adapter model saves its trainable weights only, and names its base (adapters.py).
            **({adapters.ADAPTER_KEY: adapter} if (adapter := adapters.record(module)) else {}),
        },
        "train_state": {**position, "run_id": train_state.run_id},
        # The sampler's replicas: ranks of a sequence/tensor-parallel group read the same samples.
        "data": {"batch_size": getattr(loader, "batch_size", None), "data_parallel_size": strategy.data_parallel_size},
        "sampler": sampler.state_dict() if sampler is not None else None,
        # A streaming loader's own position, one per rank (loader_state.py); None under shardwise's sampler.
        "loader_state": loader_state.capture(loader),
        "rng_states": _gather_rng(rng),
        "lr_schedulers": [entry["scheduler"].state_dict() for entry in strategy.lr_schedulers],
        "grad_scaler": strategy.grad_scaler.state_dict() if strategy.grad_scaler is not None else None,
        "callbacks": _keyed(states.callbacks, "state_dict"),
        "loggers": _keyed(states.loggers, "state_dict"),
        "callback_metrics": dict(states.callback_metrics),
        "hyper_parameters": dict(getattr(module, "hparams", {}) or {}),
    }
    if module is not None:
        module.on_save_checkpoint(state)
    states.callback_hook("on_save_checkpoint", state)
    return state


def save_training_checkpoint(states: TrainingStates, path: str, wait: bool = True) -> Any:
    """Write a resumable checkpoint of the run `states` describe at `path`; call on every rank.

    Returns the committed path, or with wait=False the PendingCheckpoint, whose
    commit() the caller must then run on every rank: ModelCheckpoint commits a
    synchronous save at once and an async one at its next save or at the end
    of training, and runs its own follow-up (move `last`, prune) after that.
    """
    strategy = states.strategy
    if strategy.module is None:
        raise CheckpointError("save_checkpoint() needs a set-up model: call it during or after fit().")
    final, token = strategy.broadcast((os.path.abspath(os.fspath(path)), layout.new_token()))
    check_room(strategy, final, adapter=bool(adapters.record(states.module)))
    state = collect_state(states)
    tmp = layout.temp_path(final, token)
    strategy.barrier("checkpoint-start")
    future = strategy.save_checkpoint(tmp, state)
    pending = PendingCheckpoint(strategy, tmp, final, future)
    return pending.commit() if wait else pending


# --------------------------------------------------------------------- load
def load_training_checkpoint(states: TrainingStates, path: str, search_dirs: List[str]) -> Optional[str]:
    """Restore a set-up run's `states` from a checkpoint; returns the path used, None if 'last' found none.

    search_dirs: where path="last" looks (the checkpoint callbacks' directories, then the default one).
    """
    resolved = layout.resolve(path, search_dirs)
    if resolved is None:
        warnings.warn(
            f"ckpt_path='last' found no checkpoint in {search_dirs}; training starts from scratch.",
            stacklevel=3,
        )
        return None
    manifest = layout.read_manifest(resolved)
    layout.check_version(manifest, resolved)
    # Before the optimizer names: a DeepSpeed checkpoint under another strategy gets the
    # message with the `shardwise convert` command, not an optimizer mismatch.
    strategy = states.strategy
    check_format_readable(resolved, manifest["checkpoint_format"], strategy.checkpoint_format)
    adapters.check_resume(resolved, manifest, states.module)  # an adapter needs its own base
    running = [type(opt).__name__ for opt in strategy.optimizers]
    if manifest.get("optimizers", running) != running:
        raise CheckpointMismatchError(
            f"{resolved} holds the state of optimizer(s) {manifest['optimizers']}, but configure_optimizers() "
            f"returned {running}. Resume with the same optimizer(s), or load only the weights."
        )
    state = strategy.load_checkpoint(resolved, manifest["checkpoint_format"])
    restore_state(states, state)
    strategy.barrier("checkpoint-loaded")
    return resolved


def _restore_position(states: TrainingStates, state: Dict[str, Any]) -> None:
    """Progress counters and the data position, re-expressed for this world size and batch size."""
    position = dict(state["train_state"])
    loader = states.loader
    sampler = find_sampler(loader)
    saved = state.get("data", {})
    batch_size = getattr(loader, "batch_size", None)
    old = (saved.get("batch_size"), saved.get("data_parallel_size", saved.get("world_size")))  # (older: world)
    new = (batch_size, states.strategy.data_parallel_size)
    if position["batch_idx"] and None not in old + new and old != new:
        # Data-parallel ranks take interleaved slices of one permutation, so the
        # samples consumed so far are its first batch_idx * batch_size * dp
        # entries, whatever the layout: continue after the same count.
        consumed = position["batch_idx"] * old[0] * old[1]
        position["batch_idx"] = consumed // (new[0] * new[1])
        if consumed % (new[0] * new[1]):
            warnings.warn(
                f"Resuming mid-epoch with batch size x world size {new[0]}x{new[1]} instead of "
                f"{old[0]}x{old[1]}: {consumed % (new[0] * new[1])} sample(s) will be seen twice.",
                stacklevel=4,
            )
    restored = loader_state.restore(
        loader,
        state.get("loader_state"),
        states.strategy.global_rank,
        states.strategy.world_size,
        position["batch_idx"],
    )
    if position["batch_idx"] and sampler is None and loader is not None and not restored:
        warnings.warn(
            "Resuming mid-epoch, but the train DataLoader has no shardwise sampler to skip the "
            "consumed batches (custom sampler or IterableDataset) and the checkpoint holds no position of "
            "its own (a loader with state_dict() / load_state_dict(), such as torchdata's "
            "StatefulDataLoader, has one): the epoch restarts from its first batch.",
            stacklevel=4,
        )
    states.train_state.load_state_dict(position)
    if sampler is not None and state.get("sampler"):
        sampler.load_state_dict(state["sampler"])


def restore_state(states: TrainingStates, state: Dict[str, Any]) -> None:
    """Put what collect_state saved back into `states` (after the strategy restored model and optimizers)."""
    strategy, module = states.strategy, states.module
    _restore_position(states, state)
    rng_states = state.get("rng_states") or []
    if len(rng_states) != strategy.world_size:
        warnings.warn(
            f"The checkpoint holds RNG states of {len(rng_states)} rank(s), this run has "
            f"{strategy.world_size}: random streams (dropout, augmentation) will differ from the "
            "saved run's.",
            stacklevel=3,
        )
    if strategy.global_rank < len(rng_states):
        # Applied by the loop at the point the saved run was at (trainer/loaders.epoch_iterator).
        states.train_state.pending_rng = rng_states[strategy.global_rank]
    saved_scheds = state.get("lr_schedulers", [])
    if len(saved_scheds) != len(strategy.lr_schedulers):
        raise CheckpointMismatchError(
            f"The checkpoint holds {len(saved_scheds)} LR scheduler(s) but "
            f"configure_optimizers() returned {len(strategy.lr_schedulers)}."
        )
    for entry, sched_state in zip(strategy.lr_schedulers, saved_scheds):
        entry["scheduler"].load_state_dict(sched_state)
    if strategy.grad_scaler is not None and state.get("grad_scaler"):
        strategy.grad_scaler.load_state_dict(state["grad_scaler"])
    for objects, key in ((states.callbacks, "callbacks"), (states.loggers, "loggers")):
        saved = state.get(key, {})
        current = _keyed(objects, "state_dict")  # same keys, in the same order
        for obj, name in zip([o for o in objects if callable(getattr(o, "state_dict", None))], current):
            if name in saved and callable(getattr(obj, "load_state_dict", None)):
                obj.load_state_dict(_with_step(saved[name], state) if key == "loggers" else saved[name])
    states.callback_metrics.update(state.get("callback_metrics", {}))
    if module is not None:
        module.on_load_checkpoint(state)
    states.callback_hook("on_load_checkpoint", state)

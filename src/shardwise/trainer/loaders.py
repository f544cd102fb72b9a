"""The run's data as the loop sees it: where the loaders come from, and how many batches it takes.

Loaders come, as in Lightning, from fit()'s arguments, a datamodule, or the
module's own train_dataloader() / val_dataloader(); they are resolved in the
workers, with the process group up, so that a datamodule's prepare_data runs
once per node behind a barrier before any rank reads what it prepared. The
loop takes `limit_*_batches` of a loader (a count or a fraction of it), and an
empty loader is an error that says why it is empty. At N data-parallel ranks
the run says once, on rank 0, what its training order does that Lightning's
would not (`announce_order`).
"""

from __future__ import annotations

import math
import warnings
from typing import Any, Callable, Iterator, Optional, Set, Tuple, Union

from torch.utils.data import IterableDataset

from shardwise.checkpoint.rng import restore_rng_states
from shardwise.data import find_sampler
from shardwise.distributed import env

_announced: Set[str] = set()  # what this process has said already: each notice once


def resolve_data(
    sources: Tuple[Any, Any, Any], module: Any, strategy: Any, need_train_data: bool = True
) -> Tuple[Any, Any]:
    """(train, val) loaders from fit()'s (train, val, datamodule), the datamodule's or the module's hooks.

    validate() passes need_train_data=False: it must not build (or require) training data.
    """
    train, val, datamodule = sources
    if datamodule is not None:
        if strategy.local_rank == 0 and callable(getattr(datamodule, "prepare_data", None)):
            datamodule.prepare_data()  # once per node, before any rank reads what it prepares
        strategy.barrier("prepare_data")
        if callable(getattr(datamodule, "setup", None)):
            datamodule.setup("fit")
        owner = datamodule
    else:
        owner = module
    if train is None and need_train_data and callable(getattr(owner, "train_dataloader", None)):
        train = owner.train_dataloader()
    if val is None and callable(getattr(owner, "val_dataloader", None)):
        val = owner.val_dataloader()
    return train, val


def length(loader: Any) -> float:
    """len(loader), or infinity for loaders without one (an IterableDataset without __len__)."""
    try:
        return float(len(loader))
    except TypeError:
        return float("inf")


def limit(value: Union[int, float, None], available: float) -> float:
    """The batches the loop takes: all, a fraction (float <= 1.0) or a count of `available`."""
    if value is None:
        return available
    if isinstance(value, float) and value <= 1.0:
        if math.isinf(available):
            raise ValueError("A fractional limit_*_batches needs a DataLoader with a length.")
        return int(available * value)
    return min(int(value), available)


def describe_empty(loader: Any) -> str:
    """Why a loader yields nothing: its dataset's size, the ranks sharing it, the batch size, drop_last."""
    dataset = getattr(loader, "dataset", None)
    try:
        size = f"its dataset has {len(dataset)} samples"
    except TypeError:
        size = "its dataset yields no samples"
    batch = getattr(loader, "batch_size", None)
    drop = " and drop_last=True drops a final partial batch" if getattr(loader, "drop_last", False) else ""
    share = ""
    sampler = getattr(loader, "sampler", None)
    if getattr(sampler, "num_replicas", 1) > 1:
        share = f" ({sampler.num_replicas} ranks share it)"
    return f"{size}{share}, batch size {batch}{drop}."


def batches_to_train(
    loader: Any, limit_train_batches: Union[int, float, None], val_check_interval: Union[int, float, None] = None
) -> float:
    """The training batches per epoch, refusing an empty loader, a limit that leaves none, or a
    validation interval (in batches) that an epoch never reaches."""
    available = length(loader)
    if available == 0:
        raise ValueError(
            f"The train DataLoader is empty: {describe_empty(loader)} Nothing can be trained; "
            "check the dataset's path and filters, and the batch size against the dataset size."
        )
    count = limit(limit_train_batches, available)
    if count == 0:
        raise ValueError(
            f"limit_train_batches={limit_train_batches!r} leaves none of the train "
            f"DataLoader's {int(available)} batches: raise it, or leave it None for all."
        )
    # An int interval counts training batches within an epoch (Lightning's rule, which refuses the same):
    # one larger than the epoch would never validate, silently.
    if isinstance(val_check_interval, int) and count != float("inf") and val_check_interval > count:
        raise ValueError(
            f"val_check_interval={val_check_interval} is larger than an epoch ({int(count)} training batches), so "
            f"validation would never run. Use at most {int(count)}, a float fraction of the epoch (e.g. 0.5), "
            "or None to validate at each epoch's end."
        )
    return count


def empty_epoch_error(loader: Any, epoch: int) -> ValueError:
    """The error for a loader without a length that yielded nothing (it would loop over empty epochs forever)."""
    return ValueError(
        f"The train DataLoader yielded no batch in epoch {epoch}: "
        f"{describe_empty(loader)} Check the dataset (an IterableDataset must yield "
        "samples on every rank, every epoch)."
    )


def announce_order(loader: Any, weighted: bool) -> None:
    """On global rank 0, once: an unshuffled training loader kept so at N ranks (Lightning shuffles it
    there), and an epoch end whose repeated samples count in a mean loss (`weighted`: the module has
    loss_weight, which gives them weight zero)."""
    sampler = find_sampler(loader)
    if sampler is None or sampler.num_replicas < 2 or not env.is_global_zero():
        return
    ranks = sampler.num_replicas
    if sampler.kept_unshuffled and "unshuffled" not in _announced:
        _announced.add("unshuffled")
        print(
            f"The training DataLoader is not shuffled (shuffle=False): at {ranks} data-parallel ranks shardwise "
            "keeps its order, so every number of ranks reads the same global batches. Lightning would shuffle "
            "it here (its DistributedSampler shuffles every training loader). To shuffle, build it with "
            "DataLoader(..., shuffle=True)."
        )
    if sampler.repeated_samples and not weighted and "repeated" not in _announced:
        _announced.add("repeated")
        warnings.warn(
            f"The training DataLoader's {sampler.length} samples per epoch do not fill the same number of "
            f"batches of {sampler.batch_size} on each of {ranks} ranks: {sampler.repeated_samples} sample(s) "
            "are repeated in each epoch's last step (a rank one batch short trains one sample again) and count "
            "in its mean loss. Use drop_last=True, a dataset size that fills whole batches on every rank, or a "
            "summed loss with loss_weight(batch) (the repeats then weigh nothing).",
            stacklevel=3,
        )


def position_sampler(loader: Any, state: Any) -> None:
    """Set the sampler's epoch (its shuffle) and, on a mid-epoch resume, skip the consumed batches by
    index without loading them (0 at a fresh epoch: the position is TrainState's, never the sampler's)."""
    sampler = getattr(loader, "sampler", None)
    if hasattr(sampler, "set_epoch"):
        sampler.set_epoch(state.epoch)
    dataset = getattr(loader, "dataset", None)
    if isinstance(dataset, IterableDataset) and callable(getattr(dataset, "set_epoch", None)):
        # A streaming dataset shuffles by epoch (Hugging Face's IterableDataset), and a restored mid-epoch
        # position applies to its own epoch only: without this every epoch after a resume would replay it.
        dataset.set_epoch(state.epoch)
    if hasattr(sampler, "set_start_index"):
        sampler.set_start_index(state.batch_idx * (loader.batch_size or 1))


def epoch_iterator(loader: Any, state: Any, done: Optional[Callable[[], bool]] = None) -> Any:
    """iter(loader), re-applying a checkpoint's RNG states at the point the saved run was at, and
    stopping before drawing a batch once `done()` says the loop takes no more.

    A loader that keeps its own position (loader_state.py) advances it when a
    batch is drawn: a batch drawn and never trained would be skipped by a run
    resumed from the checkpoint the stopped loop saves.

    A checkpoint captures the generators right after an optimizer step.
    Creating a DataLoader iterator draws a seed from torch's generator: the
    saved run drew it before a mid-epoch checkpoint and after an
    end-of-epoch one, so the resumed run restores after, respectively
    before, creating its iterator, and then draws the same numbers.
    """
    pending, state.pending_rng = state.pending_rng, None
    if pending is not None and state.batch_idx == 0:
        restore_rng_states(pending)
    iterator = iter(loader)
    if pending is not None and state.batch_idx > 0:
        restore_rng_states(pending)
    return iterator if done is None else _until(iterator, done)


def _until(iterator: Iterator[Any], done: Callable[[], bool]) -> Iterator[Any]:
    while not done():
        try:
            batch = next(iterator)
        except StopIteration:
            return
        yield batch

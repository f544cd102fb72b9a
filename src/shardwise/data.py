"""Distributed sampling with a resumable position.

A plain DataLoader handed to the Trainer is rebuilt around `ResumableSampler`:
PyTorch's DistributedSampler (seeded, reshuffled each epoch by `set_epoch`,
disjoint per rank) plus a start position, so that a run resumed in the middle
of an epoch skips the batches it already consumed by index -- without
loading them -- and sees exactly the samples the uninterrupted run would
have seen next. It is used at world size 1 too, so one device and N devices
draw from the same permutation. The position itself is not the sampler's
state: the Trainer's TrainState.batch_idx is, and the Trainer sets the start
from it at every epoch start, so a stale start can never outlive a resume.
"""

from __future__ import annotations

import itertools
import warnings
from typing import Any, Dict, Iterator, Optional

from torch.utils.data import (
    BatchSampler,
    DataLoader,
    DistributedSampler,
    IterableDataset,
    RandomSampler,
    SequentialSampler,
)


class ResumableSampler(DistributedSampler):
    """DistributedSampler that can start part-way through an epoch."""

    def __init__(
        self, dataset, num_replicas: int, rank: int, shuffle: bool, seed: int, drop_last: bool = False
    ) -> None:
        super().__init__(dataset, num_replicas=num_replicas, rank=rank, shuffle=shuffle, seed=seed, drop_last=drop_last)
        self.start_index = 0

    def set_start_index(self, index: int) -> None:
        """Skip the first `index` samples of this rank's share of the current epoch."""
        self.start_index = max(0, int(index))

    def set_epoch(self, epoch: int) -> None:
        if epoch != self.epoch:
            self.start_index = 0
        super().set_epoch(epoch)

    def __iter__(self) -> Iterator[int]:
        return itertools.islice(super().__iter__(), self.start_index, None)

    def __len__(self) -> int:
        # The whole epoch's share, also after a mid-epoch start: len(loader) is
        # the epoch length the loop counts batch_idx against. (Shrinking it by
        # the skipped part ended a second resume's epoch early.)
        return self.num_samples

    def state_dict(self) -> Dict[str, Any]:
        return {"epoch": self.epoch, "seed": self.seed, "shuffle": self.shuffle, "num_replicas": self.num_replicas}

    def load_state_dict(self, state: Dict[str, Any]) -> None:
        self.epoch = state["epoch"]
        self.start_index = 0  # set from TrainState.batch_idx by the loop, never from a saved sampler
        # The permutation is a function of (seed, epoch): without the saved seed a
        # resumed run that did not call seed_everything would shuffle differently.
        self.seed = state.get("seed", self.seed)


def distribute_dataloader(loader: Any, world_size: int, rank: int, seed: int, shuffle: Optional[bool] = None) -> Any:
    """Return a loader whose sampler gives this rank its disjoint, resumable share."""
    if not isinstance(loader, DataLoader):
        return loader
    if isinstance(loader.dataset, IterableDataset):
        if world_size > 1:
            warnings.warn(
                "An IterableDataset is not split across ranks automatically: make its __iter__ "
                "yield a disjoint share per rank (torch.distributed.get_rank()).",
                stacklevel=3,
            )
        return loader
    if isinstance(loader.sampler, ResumableSampler):
        return loader
    if isinstance(loader.sampler, DistributedSampler):
        return loader  # the user chose their own distributed sampling
    if type(loader.batch_sampler) is not BatchSampler or not isinstance(
        loader.sampler, (RandomSampler, SequentialSampler)
    ):
        if world_size > 1:
            warnings.warn(
                "The DataLoader uses a custom sampler; shardwise leaves it alone, so make sure each "
                "rank gets a disjoint share.",
                stacklevel=3,
            )
        return loader
    if shuffle is None:
        shuffle = isinstance(loader.sampler, RandomSampler)
    sampler = ResumableSampler(loader.dataset, num_replicas=world_size, rank=rank, shuffle=shuffle, seed=seed)
    return rebuild(loader, sampler=sampler)


def rebuild(loader: DataLoader, **changes: Any) -> DataLoader:
    """The same DataLoader (dataset, batch size, collate_fn, workers, ...) with `changes` applied."""
    kwargs: Dict[str, Any] = dict(
        batch_size=loader.batch_size,
        num_workers=loader.num_workers,
        collate_fn=loader.collate_fn,
        pin_memory=loader.pin_memory,
        drop_last=loader.drop_last,
        timeout=loader.timeout,
        worker_init_fn=loader.worker_init_fn,
        multiprocessing_context=loader.multiprocessing_context,
        generator=loader.generator,
        persistent_workers=loader.persistent_workers,
    )
    if loader.num_workers > 0:
        kwargs["prefetch_factor"] = loader.prefetch_factor
    return DataLoader(loader.dataset, **{**kwargs, **changes})


def find_sampler(loader: Any) -> Optional[ResumableSampler]:
    sampler = getattr(loader, "sampler", None)
    return sampler if isinstance(sampler, ResumableSampler) else None

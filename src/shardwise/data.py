"""Distributed sampling with a resumable position, in the order a plain DataLoader would draw.

A plain DataLoader handed to the Trainer is rebuilt around `ResumableSampler`.
It deals one global order out to the data-parallel ranks in turn (rank r
takes positions r, r + N, r + 2N, ...), so the ranks' micro-batch k together
are the one-process micro-batch k of N times the size, at any world size.
The global order is the user's own: a shuffled loader (a RandomSampler)
draws its epoch's seed from torch's global generator at the same moment
torch's RandomSampler does, or follows the sampler's own generator, so one
process reads exactly the batches, and leaves exactly the random stream
(dropout afterwards), of the plain DataLoader or Lightning; at N ranks every
rank draws the same way and all take global rank 0's value. The epoch's
draw is saved with a checkpoint, so a mid-epoch resume (at any world size)
continues the same order; the resumed run skips the consumed batches by index
without loading them. The position itself is not the sampler's state: the
Trainer's TrainState.batch_idx is, and the Trainer sets the start from it at
every epoch start, so a stale start can never outlive a resume.

An epoch that does not divide over the ranks is not padded inside a batch:
ranks' last batches may be smaller than the others, and a rank left one
batch short takes one batch of a single repeated sample (`padded_batch`),
so every rank takes the same number of steps. A module with `loss_weight`
gives that batch weight zero (trainer/weighting.py): every sample counts
once and N ranks give the one-process step. drop_last=True drops the
epoch's last partial GLOBAL batch (N x batch size), as one process would.
"""

from __future__ import annotations

import itertools
import math
import warnings
from typing import Any, Dict, Iterator, List, Optional, Tuple, Union

import torch
from torch.utils.data import (
    BatchSampler,
    DataLoader,
    DistributedSampler,
    IterableDataset,
    RandomSampler,
    SequentialSampler,
)

from shardwise.distributed import ops

Key = Union[int, torch.Tensor]  # an epoch's draw: a seed (global generator) or a generator's state


def shares(length: int, replicas: int, batch_size: int) -> Tuple[List[int], List[int]]:
    """Per rank: the real samples of its share of `length` positions dealt in turn, and the padding
    (0 or 1) that gives it as many batches of `batch_size` as rank 0."""
    real = [len(range(rank, length, replicas)) for rank in range(replicas)]
    batches = math.ceil(real[0] / batch_size)
    return real, [int(math.ceil(count / batch_size) < batches) for count in real]


def epoch_length(length: int, replicas: int, batch_size: int, drop_last: bool) -> int:
    """The positions of an epoch the ranks read: all, or with drop_last whole global batches only."""
    return length - length % (replicas * batch_size) if drop_last else length


class ResumableSampler(DistributedSampler):
    """This rank's share of the epoch's global order, startable part-way through the epoch.

    `follow`: the user's RandomSampler whose draws the order reproduces (None: in dataset order, or with
    shuffle=True a permutation of (seed, epoch)). `batch_size` and `drop_last` are the loader's.
    """

    def __init__(
        self,
        dataset,
        num_replicas: int,
        rank: int,
        shuffle: bool,
        seed: int,
        drop_last: bool = False,
        batch_size: int = 1,
        follow: Optional[RandomSampler] = None,
    ) -> None:
        super().__init__(dataset, num_replicas=num_replicas, rank=rank, shuffle=shuffle, seed=seed)
        self.follow = follow
        self.drop_last = drop_last
        self.batch_size = max(1, int(batch_size))
        self.start_index = 0
        self.kept_unshuffled = False  # an unshuffled loader kept so (Lightning would shuffle it at N ranks)
        drawn = len(follow) if follow is not None else len(dataset)  # type: ignore[arg-type]
        self.length = epoch_length(drawn, num_replicas, self.batch_size, drop_last)
        real, padding = shares(self.length, num_replicas, self.batch_size)
        self.padding = padding[rank]
        self.repeated_samples = sum(padding)  # over all ranks: samples read twice in an epoch
        self.num_samples = real[rank] + self.padding
        self.total_size = self.length + self.repeated_samples
        self.epoch_key: Optional[Tuple[int, Key]] = None  # the epoch and its draw, once drawn
        self._resumed: Optional[Tuple[int, Key]] = None  # a checkpoint's draw, for the epoch it was saved in
        self._unknown_draw: Optional[int] = None  # the epoch of a checkpoint that did not save its draw

    def set_start_index(self, index: int) -> None:
        """Skip the first `index` samples of this rank's share of the current epoch."""
        self.start_index = max(0, int(index))

    def set_epoch(self, epoch: int) -> None:
        if epoch != self.epoch:
            self.start_index = 0
        super().set_epoch(epoch)

    def padded_batch(self, batch_idx: int) -> bool:
        """Whether this rank's batch `batch_idx` of the epoch is the single repeated sample."""
        return bool(self.padding) and batch_idx == (len(self) - 1) // self.batch_size

    def __iter__(self) -> Iterator[int]:
        # A generator: the order is drawn at the first index asked for, as torch's RandomSampler draws
        # (after the DataLoader iterator took its own base seed), so the global random stream matches.
        order = self._order()
        share = order[self.rank : self.length : self.num_replicas]
        if self.padding:
            share.append(order[0])
        yield from itertools.islice(share, self.start_index, None)

    def __len__(self) -> int:
        # The whole epoch's share, also after a mid-epoch start: len(loader) is
        # the epoch length the loop counts batch_idx against. (Shrinking it by
        # the skipped part ended a second resume's epoch early.)
        return self.num_samples

    def _order(self) -> List[int]:
        """The epoch's global order (at least `self.length` positions)."""
        if self.follow is None:
            if not self.shuffle:
                return list(range(self.length))
            generator = torch.Generator()
            generator.manual_seed(self.seed + self.epoch)
            return torch.randperm(len(self.dataset), generator=generator).tolist()  # type: ignore[arg-type]
        key = self._draw()
        generator = self.follow.generator
        if generator is None:
            generator = torch.Generator()
            generator.manual_seed(key)
        else:
            generator.set_state(key)  # the user's generator: advanced by the draw below, as torch's own sampler
        return list(RandomSampler(self.follow.data_source, self.follow.replacement, len(self.follow), generator))

    def _draw(self) -> Key:
        """The epoch's draw: a checkpoint's for the epoch it was saved in (the restored random states are
        past it), else drawn here as RandomSampler draws, on every rank, and rank 0's taken."""
        if self._resumed is not None and self._resumed[0] == self.epoch:
            key = self._resumed[1]
        else:
            if self._unknown_draw == self.epoch and self.start_index:
                warnings.warn(
                    f"The checkpoint holds no draw of epoch {self.epoch}'s shuffled order (an older checkpoint): "
                    "the rest of the epoch follows a new order, so some samples are read twice and some not "
                    "at all. The next epochs are not affected.",
                    stacklevel=4,
                )
            generator = self.follow.generator  # type: ignore[union-attr]
            if generator is None:
                key = int(torch.empty((), dtype=torch.int64).random_().item())
            else:
                key = generator.get_state()
            key = _agree(key)
        self._resumed = self._unknown_draw = None
        self.epoch_key = (self.epoch, key)
        return key

    def state_dict(self) -> Dict[str, Any]:
        state: Dict[str, Any] = {
            "epoch": self.epoch,
            "seed": self.seed,
            "shuffle": self.shuffle,
            "num_replicas": self.num_replicas,
            "epoch_key": self.epoch_key,
        }
        generator = self.follow.generator if self.follow is not None else None
        if generator is not None:  # where the user's generator is now: the next epoch draws from here
            state["generator_state"] = generator.get_state()
        return state

    def load_state_dict(self, state: Dict[str, Any]) -> None:
        self.epoch = state["epoch"]
        self.start_index = 0  # set from TrainState.batch_idx by the loop, never from a saved sampler
        # The permutation is a function of (seed, epoch): without the saved seed a
        # resumed run that did not call seed_everything would shuffle differently.
        self.seed = state.get("seed", self.seed)
        if self.follow is None:
            return
        key = state.get("epoch_key")
        self._resumed = (int(key[0]), key[1]) if key is not None else None
        self._unknown_draw = None if "epoch_key" in state else self.epoch
        if self.follow.generator is not None and state.get("generator_state") is not None:
            self.follow.generator.set_state(state["generator_state"])


def _agree(key: Key) -> Key:
    """Global rank 0's draw on every rank: the ranks' generators may differ (per-rank dropout streams)."""
    if ops.world_size() <= 1:
        return key
    if isinstance(key, torch.Tensor):  # a generator's state travels as bytes (a pickled tensor does not)
        return torch.frombuffer(bytearray(ops.broadcast_object(key.numpy().tobytes())), dtype=torch.uint8).clone()
    return int(ops.broadcast_object(key))


def _splits_itself(dataset: Any) -> bool:
    """Whether an IterableDataset gives each rank its own share without help.

    shardwise's PackedMixture, a Hugging Face IterableDataset after `split_dataset_by_node`, and the
    streaming datasets of litdata and mosaic streaming (which read the rank themselves) do; a dataset of the
    user's that does says so with a true `splits_across_ranks` attribute.
    """
    if getattr(dataset, "splits_across_ranks", False):
        return True
    module = type(dataset).__module__ or ""
    if module.startswith("shardwise.corpus"):
        return True
    if module.startswith("datasets.") and getattr(dataset, "_distributed", None) is not None:
        return True
    return module.split(".")[0] in ("litdata", "streaming") and type(dataset).__name__ == "StreamingDataset"


def distribute_dataloader(loader: Any, world_size: int, rank: int, seed: int, shuffle: Optional[bool] = None) -> Any:
    """Return a loader whose sampler gives this rank its disjoint, resumable share.

    shuffle=None keeps the loader's own choice (a RandomSampler's draws are followed); True or False
    overrides it (True on an unshuffled loader: a permutation of (seed, epoch))."""
    if not isinstance(loader, DataLoader):
        return loader
    if isinstance(loader.dataset, IterableDataset):
        if world_size > 1 and not _splits_itself(loader.dataset):
            warnings.warn(
                "An IterableDataset is not split across ranks automatically: make its __iter__ "
                "yield a disjoint share per rank (torch.distributed.get_rank()), or, if it already does, set "
                "`splits_across_ranks = True` on it.",
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
    random = isinstance(loader.sampler, RandomSampler)
    follow = loader.sampler if random and shuffle is not False else None
    sampler = ResumableSampler(
        loader.dataset,
        num_replicas=world_size,
        rank=rank,
        shuffle=random if shuffle is None else shuffle,
        seed=seed,
        drop_last=loader.drop_last,
        batch_size=loader.batch_size or 1,
        follow=follow,
    )
    sampler.kept_unshuffled = shuffle is None and not random
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

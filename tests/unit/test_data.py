"""Distributed sampling: disjoint shares per rank, reshuffled per epoch, resumable by position."""

import torch
from torch.utils.data import DataLoader, TensorDataset

from shardwise.data import ResumableSampler, distribute_dataloader


def _loader(shuffle):
    return DataLoader(TensorDataset(torch.arange(40)), batch_size=4, shuffle=shuffle)


def _indices(loader):
    return [int(x) for (batch,) in loader for x in batch]


def test_ranks_get_disjoint_shares_covering_the_data():
    shares = [_indices(distribute_dataloader(_loader(True), 2, r, seed=3)) for r in range(2)]
    assert not set(shares[0]) & set(shares[1])
    assert sorted(shares[0] + shares[1]) == list(range(40))


def test_one_device_sees_the_union_of_the_ranks_batches():
    single = distribute_dataloader(_loader(False), 1, 0, seed=3)
    ranks = [distribute_dataloader(_loader(False), 2, r, seed=3) for r in range(2)]
    first_two = _indices(single)[:8]  # batch 4 on one device: two batches = one per rank
    union = torch.cat([next(iter(r))[0] for r in ranks])
    assert sorted(first_two) == sorted(union.tolist())


def test_epochs_reshuffle_and_seed_decides():
    loader = distribute_dataloader(_loader(True), 2, 0, seed=3)
    loader.sampler.set_epoch(0)
    e0 = _indices(loader)
    loader.sampler.set_epoch(1)
    assert _indices(loader) != e0
    other = distribute_dataloader(_loader(True), 2, 0, seed=4)
    other.sampler.set_epoch(0)
    assert _indices(other) != e0


def test_resume_skips_consumed_batches_without_loading_them():
    loaded = []

    class Spy(TensorDataset):
        def __getitem__(self, i):
            loaded.append(i)
            return super().__getitem__(i)

    loader = distribute_dataloader(DataLoader(Spy(torch.arange(40)), batch_size=4, shuffle=True), 2, 1, seed=0)
    full = _indices(loader)
    loaded.clear()
    assert isinstance(loader.sampler, ResumableSampler)
    loader.sampler.set_start_index(2 * 4)  # two batches consumed
    rest = _indices(loader)
    assert rest == full[8:]
    assert len(loaded) == len(rest)  # skipped samples were never read

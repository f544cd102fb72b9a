"""Distributed sampling: the plain DataLoader's own order, dealt out to the ranks in turn, resumable by position.

One process reads a shuffled loader exactly as torch's RandomSampler does
(the same batches, and the same global random stream afterwards: dropout),
also inside the Trainer, where a raw PyTorch loop is the reference. N ranks
read the one-process batches split N ways; an epoch that does not divide
gives a rank one batch short a single repeated sample, marked for the
loss weighting, never a batch of its own elsewhere. Ranks simulated in one
process draw from the same global generator state, as ranks of a seeded
run would (across real ranks, global rank 0's draw is taken:
tests/distributed/test_epoch_order.py).
"""

import warnings

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import DataLoader, Dataset, RandomSampler, TensorDataset

from shardwise import Trainer, TrainModule
from shardwise.data import ResumableSampler, distribute_dataloader
from shardwise.trainer import loaders


def _loader(shuffle, n=40, batch_size=4, **kw):
    return DataLoader(TensorDataset(torch.arange(n)), batch_size=batch_size, shuffle=shuffle, **kw)


def _batches(loader):
    return [batch.tolist() for (batch,) in loader]


def _rank_batches(make, ranks, seed=0):
    """Each simulated rank's batches, every rank drawing from the same global generator state."""
    out = []
    for rank in range(ranks):
        torch.manual_seed(seed)
        out.append(_batches(distribute_dataloader(make(), ranks, rank, seed=3)))
    return out


def test_ranks_get_disjoint_shares_covering_the_data():
    shares = [sum(b, []) for b in _rank_batches(lambda: _loader(True), 2)]
    assert not set(shares[0]) & set(shares[1])
    assert sorted(shares[0] + shares[1]) == list(range(40))


@pytest.mark.parametrize("shuffle", [False, True])
def test_any_split_reads_the_one_process_batches_and_each_sample_once(shuffle):
    for n in (1, 9, 11, 12):
        for batch_size in (1, 2):
            for drop_last in (False, True):
                for ranks in (1, 2, 3, 4):
                    torch.manual_seed(0)
                    one = _batches(_loader(shuffle, n, batch_size * ranks, drop_last=drop_last))
                    split = _rank_batches(lambda: _loader(shuffle, n, batch_size, drop_last=drop_last), ranks)
                    case = (n, batch_size, drop_last, ranks)
                    assert {len(b) for b in split} == {len(one)}, case  # every rank takes the same steps
                    loader = lambda r: distribute_dataloader(  # noqa: E731
                        _loader(shuffle, n, batch_size, drop_last=drop_last), ranks, r, seed=3
                    )
                    samplers = [loader(r).sampler for r in range(ranks)]
                    for k, global_batch in enumerate(one):
                        real = [b[k] for r, b in enumerate(split) if drop_last or not samplers[r].padded_batch(k)]
                        # The ranks' micro-batch k is the one-process micro-batch k, dealt out in turn.
                        assert sorted(sum(real, [])) == sorted(global_batch), case
                    repeats = sum(s.padding for s in samplers)
                    assert sum(len(x) for b in split for x in b) == len(sum(one, [])) + repeats, case


def test_a_shuffled_loader_reads_torchs_order_and_leaves_its_random_stream():
    for generator in (None, 5):  # the global generator, and a RandomSampler with its own generator
        runs = []
        for wrap in (False, True):
            torch.manual_seed(7)
            g = torch.Generator().manual_seed(generator) if generator is not None else None
            loader = _loader(True, n=23, generator=g)
            loader = distribute_dataloader(loader, 1, 0, seed=0) if wrap else loader
            epochs = [_batches(loader) for _ in range(3)]
            runs.append((epochs, torch.rand(3).tolist(), g.get_state().tolist() if g is not None else None))
        assert runs[0] == runs[1], generator


class _Ids(Dataset):
    def __init__(self, n=22):
        g = torch.Generator().manual_seed(0)
        self.x, self.y = torch.randn(n, 4, generator=g), torch.randn(n, 1, generator=g)

    def __len__(self):
        return len(self.x)

    def __getitem__(self, i):
        return i, self.x[i], self.y[i]


def _net():
    return nn.Sequential(nn.Linear(4, 16), nn.Dropout(0.5), nn.Linear(16, 1))


class _Dropout(TrainModule):
    def __init__(self):
        super().__init__()
        self.net, self.ids, self.losses = _net(), [], []

    def training_step(self, batch, batch_idx):
        ids, x, y = batch
        loss = F.mse_loss(self.net(x), y)
        self.ids.append(ids.tolist())
        self.losses.append(loss.item())
        return loss

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1)


def test_the_trainer_on_a_shuffled_loader_equals_a_raw_pytorch_loop_bitwise():
    torch.manual_seed(1)
    module = _Dropout()
    trainer = Trainer(accelerator="cpu", devices=1, max_epochs=2, logger=False, enable_progress_bar=False)
    trainer.fit(module, DataLoader(_Ids(), batch_size=4, shuffle=True))
    after = torch.rand(2)
    torch.manual_seed(1)
    model, ids, losses = _net(), [], []
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    loader = DataLoader(_Ids(), batch_size=4, shuffle=True)
    for _ in range(2):
        for batch_ids, x, y in loader:
            loss = F.mse_loss(model(x), y)
            ids.append(batch_ids.tolist())
            losses.append(loss.item())
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
    assert module.ids == ids  # the same samples per step
    assert module.losses == losses  # and the same dropout masks: bitwise
    assert torch.equal(after, torch.rand(2))  # the global stream is where the raw loop leaves it


@pytest.mark.parametrize("own_generator", [False, True])
def test_a_mid_epoch_resume_continues_the_saved_draw(own_generator):
    def make():
        g = torch.Generator().manual_seed(11) if own_generator else None
        return distribute_dataloader(_loader(True, n=30, batch_size=2, generator=g), 2, 1, seed=0)

    torch.manual_seed(4)
    loader = make()
    it = iter(loader)
    first = [next(it)[0].tolist() for _ in range(3)]
    saved = loader.sampler.state_dict()
    rest = [b.tolist() for (b,) in it]
    following = _batches(loader)  # the next epoch's draw
    torch.manual_seed(99)  # another process: its generators elsewhere
    resumed = make()
    resumed.sampler.load_state_dict(saved)
    resumed.sampler.set_start_index(3 * 2)
    assert _batches(resumed) == rest
    resumed.sampler.set_start_index(0)  # the loop's next epoch starts at its first batch
    if own_generator:  # the loader's generator was restored too: the next epoch draws the same
        assert _batches(resumed) == following
    assert first + rest != _batches(resumed)


def test_an_older_checkpoint_without_the_draw_says_the_order_changes():
    sampler = distribute_dataloader(_loader(True), 1, 0, seed=0).sampler
    sampler.load_state_dict({"epoch": 0, "seed": 0, "shuffle": True, "num_replicas": 1})
    sampler.set_start_index(8)
    with pytest.warns(UserWarning, match="holds no draw of epoch 0"):
        list(sampler)


def test_epochs_reshuffle_and_seed_decides_an_explicit_shuffle_of_an_unshuffled_loader():
    loader = distribute_dataloader(_loader(False), 2, 0, seed=3, shuffle=True)
    assert loader.sampler.follow is None
    loader.sampler.set_epoch(0)
    e0 = _batches(loader)
    assert _batches(loader) == e0  # a function of (seed, epoch), not of the global generator
    loader.sampler.set_epoch(1)
    assert _batches(loader) != e0
    other = distribute_dataloader(_loader(False), 2, 0, seed=4, shuffle=True)
    assert _batches(other) != e0


def test_resume_skips_consumed_batches_without_loading_them():
    loaded = []

    class Spy(TensorDataset):
        def __getitem__(self, i):
            loaded.append(i)
            return super().__getitem__(i)

    loader = distribute_dataloader(DataLoader(Spy(torch.arange(40)), batch_size=4, shuffle=True), 2, 1, seed=0)
    it = iter(loader)
    next(it)
    assert isinstance(loader.sampler, ResumableSampler)
    full = _batches(loader)  # a new draw for this pass; the next pass draws anew as well
    loaded.clear()
    saved = loader.sampler.state_dict()
    loader.sampler.load_state_dict(saved)  # a resumed run reuses the saved draw
    loader.sampler.set_start_index(2 * 4)  # two batches consumed
    rest = _batches(loader)
    assert rest == full[2:]
    assert len(loaded) == sum(len(b) for b in rest)  # skipped samples were never read


def test_at_n_ranks_rank_zero_says_once_that_an_unshuffled_loader_stays_unshuffled(capsys, monkeypatch):
    monkeypatch.setattr(loaders, "_announced", set())
    kept = distribute_dataloader(_loader(False), 2, 0, seed=0)
    for _ in range(2):
        loaders.announce_order(kept, weighted=False)
    said = capsys.readouterr().out
    assert said.count("not shuffled") == 1 and "Lightning would shuffle" in said and "shuffle=True" in said
    for quiet in (
        distribute_dataloader(_loader(False), 1, 0, seed=0),  # one rank: Lightning keeps the order too
        distribute_dataloader(_loader(True), 2, 0, seed=0),
        distribute_dataloader(_loader(False), 2, 0, seed=0, shuffle=False),  # the Trainer's own choice
    ):
        monkeypatch.setattr(loaders, "_announced", set())
        loaders.announce_order(quiet, weighted=False)
        assert capsys.readouterr().out == ""


def test_repeated_samples_in_a_mean_loss_are_named_once(monkeypatch):
    monkeypatch.setattr(loaders, "_announced", set())
    uneven = distribute_dataloader(_loader(True, n=9), 2, 0, seed=0)  # 9 over 2 ranks x 4: one repeat
    assert uneven.sampler.repeated_samples == 1
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        loaders.announce_order(uneven, weighted=True)  # loss_weight gives the repeat weight zero
    with pytest.warns(UserWarning, match=r"1 sample\(s\) are repeated.*drop_last=True"):
        loaders.announce_order(uneven, weighted=False)
    even = distribute_dataloader(_loader(True, n=9, drop_last=True), 2, 0, seed=0)
    assert even.sampler.repeated_samples == 0


def test_a_random_sampler_with_replacement_keeps_its_draws():
    sampler = RandomSampler(range(10), replacement=True, num_samples=25)
    torch.manual_seed(3)
    plain = _batches(DataLoader(TensorDataset(torch.arange(10)), batch_size=4, sampler=sampler))
    torch.manual_seed(3)
    loader = DataLoader(TensorDataset(torch.arange(10)), batch_size=4, sampler=sampler)
    assert _batches(distribute_dataloader(loader, 1, 0, seed=0)) == plain


def test_an_iterable_dataset_is_left_alone_and_named_only_if_it_may_not_split_itself():
    from datasets import Dataset as HFDataset
    from datasets.distributed import split_dataset_by_node
    from torch.utils.data import IterableDataset

    class Stream(IterableDataset):
        def __iter__(self):
            return iter(range(8))

    class OwnShare(Stream):
        splits_across_ranks = True  # its __iter__ reads the rank itself

    hf = HFDataset.from_dict({"x": list(range(8))}).to_iterable_dataset()
    for dataset, warned in ((Stream(), True), (OwnShare(), False), (split_dataset_by_node(hf, 0, 2), False)):
        loader = DataLoader(dataset, batch_size=2)
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            assert distribute_dataloader(loader, 2, 0, seed=0) is loader
            assert distribute_dataloader(loader, 1, 0, seed=0) is loader  # one rank: nothing to split
        said = [str(w.message) for w in caught]
        assert len(said) == int(warned), (type(dataset).__name__, said)
        assert not warned or "splits_across_ranks = True" in said[0]

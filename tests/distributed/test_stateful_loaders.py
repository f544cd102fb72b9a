"""Streaming loaders as users bring them, stopped mid-epoch and resumed from `last` under DDP and FSDP.

Two loaders that cannot skip by index and know their position only through state_dict():
torchdata's StatefulDataLoader over a Hugging Face streaming data set (`to_iterable_dataset` on
local data, split per rank with `split_dataset_by_node`), and a user's own IterableDataset with
state_dict() under a plain DataLoader, which shuffles its share by epoch (`set_epoch`). In one
2-process launch, for each strategy and loader: a run stopped by max_steps in the middle of the
first epoch, then resumed from `last` to a step of the second epoch, must train on exactly the
samples the uninterrupted run trained on from that step on, on every rank, without the warning that
the epoch restarts. A mid-epoch checkpoint of those 2 ranks resumed on 1 process is refused by name:
the loader's position cannot be re-split over another number of processes.

Every run logs its batch fingerprints (callbacks/fingerprint.py), and `shardwise check fingerprints`
compares them: the resumed runs equal the uninterrupted ones at every step, two different streams do
not, and a map-style data set trained on 2 processes with batch 2 equals one process with batch 4
(the fingerprint does not depend on how the global batch is split).
"""

from __future__ import annotations

import os
import warnings

import pytest

N, BATCH, STOP, STEPS = 24, 2, 4, 9  # 12 samples a rank, 6 steps an epoch: stopped mid-epoch, resumed into the next


def _user_loader():
    import torch
    import torch.distributed as dist
    from torch.utils.data import DataLoader, IterableDataset

    class Shard(IterableDataset):
        """This rank's interleaved share of N samples, reshuffled each epoch, resumable at a position."""

        def __init__(self) -> None:
            self.epoch, self.position, self.resume_at = 0, 0, 0

        def set_epoch(self, epoch: int) -> None:
            self.epoch = epoch

        def __iter__(self):
            rank, world = (dist.get_rank(), dist.get_world_size()) if dist.is_initialized() else (0, 1)
            order = torch.randperm(N, generator=torch.Generator().manual_seed(self.epoch)).tolist()[rank::world]
            self.position, self.resume_at = self.resume_at, 0
            for i in order[self.position :]:
                self.position += 1
                yield {"id": i, "x": torch.full((4,), float(i))}

        def state_dict(self):
            return {"position": self.position, "epoch": self.epoch}

        def load_state_dict(self, state) -> None:
            self.resume_at = state["position"]

    return DataLoader(Shard(), batch_size=BATCH)


def _hf_loader():
    import datasets
    from datasets.distributed import split_dataset_by_node
    from torchdata.stateful_dataloader import StatefulDataLoader

    data = datasets.Dataset.from_dict({"id": list(range(N)), "x": [[float(i)] * 4 for i in range(N)]})
    stream = data.to_iterable_dataset(num_shards=4).with_format("torch")
    # Built before fit() starts the process group: the launcher's environment names the rank.
    stream = split_dataset_by_node(stream, rank=int(os.environ["RANK"]), world_size=int(os.environ["WORLD_SIZE"]))
    return StatefulDataLoader(stream, batch_size=BATCH)


LOADERS = {"hf-stateful": _hf_loader, "user-iterable": _user_loader}


def _module():
    import torch
    from torch import nn

    from shardwise import TrainModule

    class Recorder(TrainModule):
        """Trains a Linear on the batch and records the sample ids of every step."""

        def __init__(self) -> None:
            super().__init__()
            self.seen = []

        def configure_model(self) -> None:
            self.net = nn.Linear(4, 1)

        def training_step(self, batch, batch_idx):
            self.seen.append([int(i) for i in batch["id"]])
            return self.net(batch["x"].float()).pow(2).mean()

        def configure_optimizers(self):
            return torch.optim.SGD(self.parameters(), lr=1e-3)

    return Recorder()


def _map_loader(batch_size=BATCH):
    import torch
    from torch.utils.data import DataLoader

    return DataLoader([{"id": i, "x": torch.full((4,), float(i))} for i in range(N)], batch_size, shuffle=True)


def _fit(root, strategy, make_loader, max_steps, ckpt_path=None):
    import shardwise
    from shardwise import FSDPStrategy, Trainer
    from shardwise.callbacks import ModelCheckpoint
    from shardwise.callbacks.fingerprint import BatchFingerprint

    shardwise.seed_everything(0)
    module = _module()
    trainer = Trainer(
        accelerator="cpu",
        devices=int(os.environ.get("WORLD_SIZE", "1")),
        strategy=FSDPStrategy() if strategy == "fsdp" else strategy,
        max_steps=max_steps,
        logger=False,
        enable_progress_bar=False,
        throughput=False,
        default_root_dir=root,
        callbacks=[
            ModelCheckpoint(dirpath=os.path.join(root, "ckpt"), every_n_train_steps=100),
            BatchFingerprint("id"),
        ],
    )
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        trainer.fit(module, make_loader(), ckpt_path=ckpt_path)
    trainer.strategy.teardown()
    return module.seen, [str(w.message) for w in caught]


def _runs(root):
    out = {}
    for kind, make_loader in LOADERS.items():
        out[kind, "uninterrupted"] = _fit(os.path.join(root, kind, "full"), "ddp", make_loader, STEPS)[0]
        for strategy in ("ddp", "fsdp"):
            where = os.path.join(root, kind, strategy)
            out[kind, strategy, "stopped"] = _fit(where, strategy, make_loader, STOP)[0]
            out[kind, strategy, "resumed"] = _fit(where, strategy, make_loader, STEPS, ckpt_path="last")
    _fit(os.path.join(root, "map", "2x2"), "ddp", _map_loader, 3)
    return out


@pytest.mark.slow
def test_stateful_loaders_resume_exactly_under_ddp_and_fsdp(tmp_path):
    import shardwise
    from shardwise.checkpoint import CheckpointMismatchError

    ranks = shardwise.launch(_runs, str(tmp_path), devices=2)
    for rank, out in enumerate(ranks):
        for kind in LOADERS:
            full = out[kind, "uninterrupted"]
            assert len(full) == STEPS and len({i for step in full[:6] for i in step}) == N // 2, (kind, rank, full)
            if kind == "user-iterable":  # set_epoch reached the dataset: the second epoch is reshuffled
                assert full[6:9] != full[0:3], full
            for strategy in ("ddp", "fsdp"):
                assert out[kind, strategy, "stopped"] == full[:STOP], (kind, strategy, rank)
                resumed, messages = out[kind, strategy, "resumed"]
                assert resumed == full[STOP:], (kind, strategy, rank, resumed, full)
                assert not [m for m in messages if "restarts" in m], messages
    assert ranks[0]["hf-stateful", "ddp", "resumed"][0] != ranks[1]["hf-stateful", "ddp", "resumed"][0]

    # The fingerprints: what the sample lists above show, in one number per step.
    from shardwise.cli import main as cli

    def check(a, b):  # the exit status of `shardwise check fingerprints a b`: 0 the same batches, 1 not
        return cli(["check", "fingerprints", str(tmp_path / a), str(tmp_path / b)])

    for kind in LOADERS:
        for strategy in ("ddp", "fsdp"):
            assert check(f"{kind}/full", f"{kind}/{strategy}") == 0
    assert check("hf-stateful/full", "user-iterable/full") == 1
    _fit(str(tmp_path / "map" / "1x4"), "auto", lambda: _map_loader(2 * BATCH), 3)
    assert check("map/2x2", "map/1x4") == 0
    from shardwise.callbacks.fingerprint import read_fingerprints

    assert sorted(read_fingerprints(str(tmp_path / "hf-stateful" / "fsdp"))) == list(range(1, STEPS + 1))

    # The 2 ranks' mid-epoch positions cannot be re-split over 1 process: refused, naming the loader.
    with pytest.raises(CheckpointMismatchError, match=r"saved mid-epoch by 2 process\(es\).*Shard.*this run has 1"):
        _fit(str(tmp_path / "user-iterable" / "ddp"), "ddp", _user_loader, STEPS + 1, ckpt_path="last")

"""Checkpoints in one process: exact resume, ModelCheckpoint, errors, convert, inspect, atomic layout.

FSDP runs here on a world of one (its own gloo group), which exercises the
sharded (DCP) format end to end; multi-process resharding and SIGKILL tests
live in tests/distributed/test_checkpoint_*.py.
"""

from __future__ import annotations

import json
import os

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from safetensors.torch import load_file
from torch import nn
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict
from torch.utils.data import DataLoader, TensorDataset

import shardwise
from shardwise import Trainer, TrainModule
from shardwise.callbacks import ModelCheckpoint
from shardwise.checkpoint import (
    CheckpointMismatchError,
    CheckpointNotFoundError,
    CheckpointVersionError,
    CorruptCheckpointError,
    layout,
)
from shardwise.checkpoint import convert as convert_mod
from shardwise.cli import main as cli_main
from shardwise.recipes.convert import convert


class Net(TrainModule):
    def __init__(self, width: int = 16) -> None:
        super().__init__()
        self.save_hyperparameters()
        self.width = width

    def configure_model(self) -> None:
        self.net = nn.Sequential(
            nn.Linear(8, self.width), nn.LayerNorm(self.width), nn.Dropout(0.2), nn.Linear(self.width, 3)
        )

    def training_step(self, batch, batch_idx):
        x, y = batch
        return F.cross_entropy(self.net(x), y)

    def validation_step(self, batch, batch_idx):
        x, y = batch
        self.log("val_loss", F.cross_entropy(self.net(x), y))

    def configure_optimizers(self):
        opt = torch.optim.AdamW(self.parameters(), lr=1e-2)
        return {
            "optimizer": opt,
            "lr_scheduler": {"scheduler": torch.optim.lr_scheduler.StepLR(opt, 3, 0.7), "interval": "step"},
        }


class Losses:
    def __init__(self):
        self.by_step = {}

    def on_train_batch_end(self, trainer, module, outputs, batch, batch_idx):
        self.by_step[trainer.global_step] = float(outputs.detach())


def loaders():
    g = torch.Generator().manual_seed(0)
    data = TensorDataset(torch.randn(40, 8, generator=g), torch.randint(0, 3, (40,), generator=g))
    return DataLoader(data, batch_size=4, shuffle=True), DataLoader(data, batch_size=8)


def fit(
    root, max_steps, strategy="single", ckpt_path=None, seed=3, module=None, checkpoint=None, callbacks_extra=(), **kw
):
    shardwise.seed_everything(seed)
    losses = Losses()
    callbacks = [losses, *callbacks_extra] + ([checkpoint] if checkpoint is not None else [])
    kw.setdefault("logger", False)
    trainer = Trainer(
        accelerator="cpu",
        devices=1,
        strategy=strategy,
        max_steps=max_steps,
        enable_progress_bar=False,
        default_root_dir=str(root),
        callbacks=callbacks,
        **kw,
    )
    train, val = loaders()
    trainer.fit(module or Net(), train, val, ckpt_path=ckpt_path)
    return trainer, losses.by_step


def weights(trainer):
    return {
        k: v.clone()
        for k, v in get_model_state_dict(trainer.model, options=StateDictOptions(full_state_dict=True)).items()
    }


@pytest.fixture(autouse=True)
def _no_leftover_process_group():
    yield
    if dist.is_initialized():  # FSDP on one process creates its own group
        dist.destroy_process_group()


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    """One trained run per format: (checkpoint path, trainer) for "full" (single) and "sharded" (FSDP)."""
    out = {}
    for fmt, strategy in (("full", "single"), ("sharded", "fsdp")):
        root = tmp_path_factory.mktemp(fmt)
        trainer, _ = fit(root, 6, strategy=strategy, checkpoint=ModelCheckpoint(every_n_train_steps=3))
        out[fmt] = (os.path.realpath(os.path.join(root, "checkpoints", "last.ckpt")), weights(trainer))
        if dist.is_initialized():
            dist.destroy_process_group()
    return out


# ------------------------------------------------------------- exact resume
@pytest.mark.parametrize("strategy", ["single", "fsdp"])
@pytest.mark.parametrize(
    "stop,every", [(12, {"every_n_train_steps": 4}), (20, {"every_n_epochs": 1})], ids=["mid-epoch", "epoch-end"]
)
def test_resume_reproduces_uninterrupted_losses_bitwise(tmp_path, strategy, stop, every):
    # 10 batches per epoch, dropout, shuffling, a step LR schedule and
    # validation every 7 batches (which must not disturb training's RNG).
    _, reference = fit(tmp_path / "ref", 25, strategy, val_check_interval=7)
    _, first = fit(tmp_path / "run", stop, strategy, val_check_interval=7, checkpoint=ModelCheckpoint(**every))
    last = os.path.join(tmp_path, "run", "checkpoints", "last.ckpt")
    assert layout.read_manifest(last)["global_step"] == stop
    _, second = fit(
        tmp_path / "run",
        25,
        strategy,
        ckpt_path="last",
        seed=999,
        val_check_interval=7,
        checkpoint=ModelCheckpoint(**every),
    )
    assert sorted(second) == list(range(stop + 1, 26))
    assert {**first, **second} == reference


def test_last_without_checkpoints_starts_fresh(tmp_path):
    with pytest.warns(UserWarning, match="found no checkpoint"):
        trainer, losses = fit(tmp_path, 2, ckpt_path="last")
    assert trainer.global_step == 2


# ---------------------------------------------------------- ModelCheckpoint
def test_top_k_by_monitor_keeps_best_and_last_points_to_newest(tmp_path):
    ckpt = ModelCheckpoint(monitor="val_loss", mode="min", save_top_k=2, filename="{epoch}-{val_loss:.4f}")
    trainer, _ = fit(tmp_path, 50, max_epochs=5, checkpoint=ckpt)
    directory = os.path.join(tmp_path, "checkpoints")
    names = sorted(n for n in os.listdir(directory) if n != "last.ckpt")
    assert all(n.startswith("epoch=") and "-val_loss=" in n for n in names)
    assert len(ckpt.best_k_models) == 2
    scores = sorted(ckpt.best_k_models.values())
    assert ckpt.best_model_score == scores[0]
    newest = os.path.realpath(os.path.join(directory, "last.ckpt"))
    assert layout.read_manifest(newest)["epoch"] == 5  # saved at the end of epoch 4: resumes in epoch 5
    assert set(names) == {os.path.basename(p) for p in ckpt.best_k_models} | {os.path.basename(newest)}
    assert not [n for n in os.listdir(directory) if n.startswith(".")]


def test_save_checkpoint_writes_one_file_and_replaces_atomically(tmp_path):
    trainer, _ = fit(tmp_path, 3)
    path = tmp_path / "manual.ckpt"
    assert trainer.save_checkpoint(str(path)) == str(path)
    first = torch.load(path, weights_only=False)
    assert first["shardwise"]["checkpoint_format"] == "full" and "state_dict" in first
    assert len(first["optimizer_states"]) == 1 and first["hyper_parameters"] == {"width": 16}
    trainer.save_checkpoint(str(path))
    assert [n for n in os.listdir(tmp_path) if n.endswith(".ckpt") or n.startswith(".")] == ["manual.ckpt"]


# ------------------------------------------------------------------- errors
def test_missing_path_lists_existing_checkpoints(tmp_path, saved):
    existing = saved["full"][0]
    with pytest.raises(CheckpointNotFoundError) as err:
        fit(tmp_path, 1, ckpt_path=os.path.join(os.path.dirname(existing), "nope.ckpt"))
    assert "does not exist" in str(err.value) and os.path.basename(existing) in str(err.value)


def test_truncated_full_file_is_named(tmp_path, saved):
    src = saved["full"][0]
    broken = tmp_path / "broken.ckpt"
    broken.write_bytes(open(src, "rb").read()[: os.path.getsize(src) // 2])
    with pytest.raises(CorruptCheckpointError, match="broken.ckpt is truncated or corrupt"):
        fit(tmp_path, 1, ckpt_path=str(broken))


def test_truncated_shard_file_is_named(tmp_path, saved):
    import shutil

    broken = tmp_path / "sharded.ckpt"
    shutil.copytree(saved["sharded"][0], broken)
    shard = broken / "__0_0.distcp"
    with open(shard, "r+b") as fh:
        fh.truncate(os.path.getsize(shard) // 3)
    with pytest.raises(CorruptCheckpointError, match=r"__0_0\.distcp is truncated"):
        fit(tmp_path, 1, strategy="fsdp", ckpt_path=str(broken))


def test_model_mismatch_lists_first_differences(tmp_path, saved):
    with pytest.raises(CheckpointMismatchError) as err:
        fit(tmp_path, 1, module=Net(width=32), ckpt_path=saved["full"][0])
    text = str(err.value)
    assert "different shapes (5)" in text and "net.0.weight checkpoint [16, 8] vs model [32, 8]" in text


def test_garbage_file_is_named(tmp_path):
    garbage = tmp_path / "garbage.ckpt"
    garbage.write_bytes(os.urandom(4096))
    with pytest.raises(CorruptCheckpointError, match="garbage.ckpt is truncated or corrupt"):
        fit(tmp_path, 1, ckpt_path=str(garbage))


class SGDNet(Net):
    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1)


def test_other_optimizer_is_refused(tmp_path, saved):
    with pytest.raises(CheckpointMismatchError, match=r"optimizer\(s\) \['AdamW'\].*returned \['SGD'\]"):
        fit(tmp_path, 1, module=SGDNet(), ckpt_path=saved["sharded"][0])


def test_other_format_version_is_refused(tmp_path, saved):
    payload = torch.load(saved["full"][0], weights_only=False)
    payload["shardwise"]["format_version"] = 99
    old = tmp_path / "old.ckpt"
    torch.save(payload, old)
    with pytest.raises(CheckpointVersionError, match="layout version 99"):
        fit(tmp_path, 1, ckpt_path=str(old))


# ---------------------------------------------------------- convert / inspect
@pytest.mark.parametrize("fmt", ["full", "sharded"])
def test_convert_round_trip_loads_into_plain_module(tmp_path, saved, fmt):
    path, trained = saved[fmt]
    plain = nn.Sequential(nn.Linear(8, 16), nn.LayerNorm(16), nn.Dropout(0.2), nn.Linear(16, 3))
    # One safetensors file.
    assert cli_main(["convert", path, str(tmp_path / "one")]) == 0
    state = {k.removeprefix("net."): v for k, v in load_file(tmp_path / "one" / "model.safetensors").items()}
    plain.load_state_dict(state)
    assert all(torch.equal(plain.state_dict()[k], trained["net." + k]) for k in state)
    # Sharded output with an index, cast to bf16.
    assert cli_main(["convert", path, str(tmp_path / "split"), "--dtype", "bf16", "--max-shard-size", "300B"]) == 0
    index = json.load(open(tmp_path / "split" / "model.safetensors.index.json"))
    merged = {}
    for shard in set(index["weight_map"].values()):
        merged.update(load_file(tmp_path / "split" / shard))
    assert merged.keys() == trained.keys() and all(v.dtype == torch.bfloat16 for v in merged.values())
    assert all(torch.equal(merged[k], trained[k].to(torch.bfloat16)) for k in merged)
    # A torch file.
    convert(path, str(tmp_path / "w.pt"), quiet=True)
    loaded = torch.load(tmp_path / "w.pt")
    assert all(torch.equal(loaded[k], trained[k]) for k in trained)


def test_convert_reads_one_tensor_at_a_time(tmp_path, saved, monkeypatch):
    from shardwise.checkpoint.reader import open_checkpoint

    reader = open_checkpoint(saved["sharded"][0])
    calls = []
    original = reader.read
    monkeypatch.setattr(reader, "read", lambda names: calls.append(list(names)) or original(names))
    infos = reader.tensors()
    convert_mod.write_safetensors(str(tmp_path / "m.safetensors"), reader, infos, None, read_budget=0)
    assert calls == [[i.name] for i in infos]
    assert load_file(tmp_path / "m.safetensors").keys() == {i.name for i in infos}


def test_convert_refuses_one_file_the_host_cannot_hold_but_writes_a_folder(tmp_path, saved, monkeypatch):
    monkeypatch.setattr(convert_mod, "available_host_bytes", lambda: 100)  # bytes: less than the model
    with pytest.raises(ValueError, match="give a folder as OUT"):
        convert(saved["sharded"][0], str(tmp_path / "m.safetensors"), quiet=True)
    assert not (tmp_path / "m.safetensors").exists()
    written = convert(saved["sharded"][0], str(tmp_path / "out"), max_shard_size="300B", quiet=True)
    assert len([w for w in written if w.endswith(".safetensors")]) > 1
    # A second export into the same folder replaces the first one's shards instead of mixing with them.
    again = convert(saved["sharded"][0], str(tmp_path / "out"), quiet=True)
    assert sorted(os.listdir(tmp_path / "out")) == sorted({os.path.basename(w) for w in again} | {"hparams.json"})


def test_inspect_lists_format_progress_and_tensors(saved, capsys):
    assert cli_main(["inspect", saved["sharded"][0]]) == 0
    out = capsys.readouterr().out
    assert "format       sharded (layout version 1)" in out and "global step 6" in out
    assert "net.0.weight" in out and "__0_0.distcp" in out and "RNG states of 1 rank(s)" in out
    assert cli_main(["inspect", saved["full"][0], "--json"]) == 0
    summary = json.loads(capsys.readouterr().out)
    assert summary["manifest"]["checkpoint_format"] == "full" and summary["model_params"] == 227


def test_cli_reports_missing_checkpoint(tmp_path, saved, capsys):
    directory = os.path.dirname(saved["full"][0])
    assert cli_main(["convert", os.path.join(directory, "missing.ckpt"), str(tmp_path / "out")]) == 1
    err = capsys.readouterr().err
    assert "does not exist" in err and os.path.basename(saved["full"][0]) in err
    assert cli_main(["inspect", directory]) == 0  # a checkpoint directory means its last.ckpt
    assert "global step 6" in capsys.readouterr().out


# ------------------------------------------------------------------- layout
def test_commit_last_pointer_and_leftovers(tmp_path):
    def make(name, text):
        os.makedirs(tmp_path / name)
        (tmp_path / name / "x").write_text(text)

    make(".a.ckpt.tmp-1", "new")
    make("a.ckpt", "old")
    layout.commit(str(tmp_path / ".a.ckpt.tmp-1"), str(tmp_path / "a.ckpt"))
    assert (tmp_path / "a.ckpt" / "x").read_text() == "new"
    link = layout.point_last(str(tmp_path), str(tmp_path / "a.ckpt"))
    assert os.readlink(link) == "a.ckpt"
    make(".b.ckpt.tmp-2", "partial")
    assert layout.remove_leftovers(str(tmp_path)) == [".b.ckpt.tmp-2"]
    assert sorted(os.listdir(tmp_path)) == ["a.ckpt", "last.ckpt"]


# ------------------------------------------------- a full save rank 0 cannot hold
@pytest.mark.parametrize("strategy", ["single", "fsdp_full_state"])
def test_a_full_save_too_big_for_the_host_is_saved_sharded_and_resumes_bitwise(tmp_path, strategy, monkeypatch):
    from shardwise.checkpoint import formats
    from shardwise.strategies import FSDPStrategy

    def make():
        return "single" if strategy == "single" else FSDPStrategy(state_dict_type="full")

    _, reference = fit(tmp_path / "ref", 9, make())
    budgets = []
    real_budget = formats._full_state_budget

    def small_host(model, optimizers):
        needed, _ = real_budget(model, optimizers)
        budgets.append((needed, weights_and_state_bytes(model, optimizers)))
        return needed, needed / 2  # rank 0 could hold half of it

    monkeypatch.setattr(formats, "_full_state_budget", small_host)
    with pytest.warns(UserWarning, match=r"would gather .* GiB .*saved sharded instead"):
        fit(tmp_path / "run", 6, make(), checkpoint=ModelCheckpoint(every_n_train_steps=3, save_top_k=1))
    assert budgets and all(needed == exact for needed, exact in budgets)  # the estimate is the exact size
    directory = tmp_path / "run" / "checkpoints"
    kept = [n for n in os.listdir(directory) if n != "last.ckpt"]
    assert kept == ["epoch=0-step=6.ckpt"]  # the step-3 directory was pruned like a file would be
    assert os.path.isdir(directory / kept[0])
    assert layout.read_manifest(str(directory / kept[0]))["checkpoint_format"] == "sharded"
    monkeypatch.setattr(formats, "_full_state_budget", real_budget)  # enough memory again: one file
    _, resumed = fit(
        tmp_path / "run",
        9,
        make(),
        ckpt_path="last",
        seed=11,
        checkpoint=ModelCheckpoint(every_n_train_steps=3, save_top_k=1),
    )
    assert {s: resumed[s] for s in (7, 8, 9)} == {s: reference[s] for s in (7, 8, 9)}
    assert os.path.isfile(directory / "epoch=0-step=9.ckpt")


def weights_and_state_bytes(model, optimizers):
    """What a full checkpoint's tensors take, measured on the gathered state itself."""
    from torch.distributed.checkpoint.state_dict import get_optimizer_state_dict

    options = StateDictOptions(full_state_dict=True)
    states = [get_model_state_dict(model, options=options)]
    states += [get_optimizer_state_dict(model, opt, options=options)["state"] for opt in optimizers]

    def count(obj):
        if isinstance(obj, torch.Tensor):
            return obj.numel() * obj.element_size()
        if isinstance(obj, dict):
            return sum(count(v) for v in obj.values())
        return 0

    return sum(count(s) for s in states)

"""Checkpoints a user can trust, in one process: no code runs on load, damage is detected, disk errors are named.

A pickle whose __reduce__ runs a shell command is placed wherever a
checkpoint is read from (fit(ckpt_path=...), ckpt_path="last", a mistyped
path's neighbours, `shardwise inspect`, `shardwise convert`, a sharded
directory's trainer_state.pt and DCP .metadata); each test asserts that the
command's marker file was never created. Flipped bytes must fail with the
file and both checksums named; a full or read-only disk must say ENOSPC /
EROFS and where, leave no partial checkpoint and keep the previous one.
FSDP runs on a world of one (its own gloo group), which exercises DCP.
"""

from __future__ import annotations

import errno
import os
import pickle
import subprocess

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

import shardwise
from shardwise import Trainer, TrainModule
from shardwise.callbacks import ModelCheckpoint
from shardwise.checkpoint import layout
from shardwise.checkpoint.errors import (
    CheckpointError,
    CheckpointNotFoundError,
    CheckpointWriteError,
    ChecksumMismatchError,
    CorruptCheckpointError,
    UnsafeCheckpointError,
)
from shardwise.checkpoint.integrity import VERIFY_ENV, check_writable
from shardwise.cli import main as cli_main


class Config:
    """An arbitrary object in the hparams: saved as its repr, never pickled."""

    def __repr__(self) -> str:
        return "Config(depth=2)"


class Net(TrainModule):
    def __init__(self, config=None) -> None:
        super().__init__()
        self.save_hyperparameters()

    def configure_model(self) -> None:
        self.net = nn.Sequential(nn.Linear(8, 16), nn.LayerNorm(16), nn.Linear(16, 3))

    def training_step(self, batch, batch_idx):
        x, y = batch
        return F.cross_entropy(self.net(x), y)

    def configure_optimizers(self):
        return torch.optim.AdamW(self.parameters(), lr=1e-2)


def loader():
    g = torch.Generator().manual_seed(0)
    return DataLoader(
        TensorDataset(torch.randn(40, 8, generator=g), torch.randint(0, 3, (40,), generator=g)),
        batch_size=4,
        shuffle=True,
    )


def fit(root, max_steps, strategy="single", ckpt_path=None, checkpoint=None, module=None):
    shardwise.seed_everything(0)
    trainer = Trainer(
        accelerator="cpu",
        devices=1,
        strategy=strategy,
        max_steps=max_steps,
        logger=False,
        enable_progress_bar=False,
        default_root_dir=str(root),
        enable_checkpointing=checkpoint is not None,
        callbacks=[checkpoint] if checkpoint else [],
    )
    trainer.fit(module or Net(), loader(), ckpt_path=ckpt_path)
    return trainer


@pytest.fixture(autouse=True)
def _no_leftover_process_group():
    yield
    if dist.is_initialized():
        dist.destroy_process_group()


# ------------------------------------------------------------------ payloads
class Evil:
    def __init__(self, marker: str) -> None:
        self.marker = marker

    def __reduce__(self):
        return (os.system, (f"touch {self.marker}",))


def write_evil(path, marker, kind="torch"):
    """A file that runs `touch marker` when unpickled without an allow-list."""
    payload = {
        "shardwise": {"format_version": 1, "checkpoint_format": "full", "global_step": 999},
        "state_dict": {},
        "x": Evil(marker),
    }
    if kind == "torch":
        torch.save(payload, path)
    else:
        with open(path, "wb") as fh:
            pickle.dump(payload, fh)
    # The payload really is live: loading it unsafely would create the marker.
    return path


@pytest.fixture
def marker(tmp_path):
    path = str(tmp_path / "PWNED")
    yield path
    assert not os.path.exists(path), "a checkpoint load executed code from the file"


@pytest.fixture(scope="module")
def good(tmp_path_factory):
    """A full (single) and a sharded (FSDP) checkpoint, each in its own checkpoints/ dir."""
    out = {}
    for fmt, strategy in (("full", "single"), ("sharded", "fsdp")):
        root = tmp_path_factory.mktemp(fmt)
        fit(root, 3, strategy, checkpoint=ModelCheckpoint(every_n_train_steps=3))
        if dist.is_initialized():
            dist.destroy_process_group()
        out[fmt] = os.path.realpath(os.path.join(root, "checkpoints", "last.ckpt"))
    return out


def test_evil_payload_is_live(tmp_path):
    # Guards the other tests: a plain torch.load of the payload does run the command.
    marker = str(tmp_path / "ran")
    torch.load(write_evil(str(tmp_path / "e.ckpt"), marker), weights_only=False)
    assert os.path.exists(marker)


@pytest.mark.parametrize("kind", ["torch", "pickle"])
def test_fit_refuses_evil_checkpoint(tmp_path, marker, kind):
    path = write_evil(str(tmp_path / "evil.ckpt"), marker, kind)
    with pytest.raises(UnsafeCheckpointError) as err:
        fit(tmp_path / "run", 1, ckpt_path=path)
    assert "posix.system" in str(err.value) and "does not execute" in str(err.value) and path in str(err.value)


def test_last_skips_evil_newest_and_refuses_evil_link(tmp_path, marker, good):
    ckdir = tmp_path / "run" / "checkpoints"
    ckdir.mkdir(parents=True)
    genuine = ckdir / "epoch=0-step=3.ckpt"
    genuine.write_bytes(open(good["full"], "rb").read())
    evil = write_evil(str(ckdir / "epoch=9-step=999.ckpt"), marker)
    os.utime(evil, (2e9, 2e9))  # the newest entry by time and by name
    with pytest.warns(UserWarning, match="unreadable checkpoint"):
        trainer = fit(tmp_path / "run", 4, ckpt_path="last")
    assert trainer.global_step == 4  # resumed from the genuine step-3 checkpoint
    layout.point_last(str(ckdir), evil)
    with pytest.raises(UnsafeCheckpointError):
        fit(tmp_path / "run", 5, ckpt_path="last")


def test_mistyped_path_names_neighbours_without_opening_them(tmp_path, marker):
    ckdir = tmp_path / "checkpoints"
    ckdir.mkdir()
    for name in ("epoch=0-step=10.ckpt", "epoch=0-step=20.ckpt"):
        write_evil(str(ckdir / name), marker)
    with pytest.raises(CheckpointNotFoundError) as err:
        fit(tmp_path, 1, ckpt_path=str(ckdir / "epoch=0-step=2O.ckpt"))
    assert "did you mean" in str(err.value) and "epoch=0-step=20.ckpt" in str(err.value)
    assert cli_main(["inspect", str(ckdir / "epoch=0-step=1O.ckpt")]) == 1
    assert cli_main(["convert", str(ckdir / "epoch=0-step=1O.ckpt"), str(tmp_path / "out")]) == 1


def test_inspect_and_convert_refuse_evil_file(tmp_path, marker, capsys):
    path = write_evil(str(tmp_path / "evil.ckpt"), marker)
    assert cli_main(["inspect", path]) == 1
    assert "does not execute" in capsys.readouterr().err
    assert cli_main(["convert", path, str(tmp_path / "out")]) == 1
    assert "does not execute" in capsys.readouterr().err
    # A directory of checkpoints whose newest is evil: inspect falls back to none / refuses, never runs it.
    assert cli_main(["inspect", str(tmp_path)]) == 1


@pytest.mark.parametrize("victim", ["trainer_state.pt", ".metadata"])
def test_sharded_directory_with_evil_file(tmp_path, marker, good, victim):
    import shutil

    ckpt = str(tmp_path / "copy.ckpt")
    shutil.copytree(good["sharded"], ckpt)
    with open(os.path.join(ckpt, victim), "wb") as fh:
        pickle.dump(Evil(marker), fh)
    # The checksum alone would refuse it; an attacker who also rewrites the manifest meets the allow-list.
    with pytest.raises(ChecksumMismatchError):
        fit(tmp_path / "run", 4, strategy="fsdp", ckpt_path=ckpt)
    from shardwise.checkpoint.integrity import file_digest, record_checksums

    record_checksums(ckpt, {victim: file_digest(os.path.join(ckpt, victim))})
    with pytest.raises(UnsafeCheckpointError):
        fit(tmp_path / "run", 4, strategy="fsdp", ckpt_path=ckpt)
    assert cli_main(["inspect", ckpt]) == 1
    assert cli_main(["convert", ckpt, str(tmp_path / "out")]) == 1


def test_own_checkpoints_hold_plain_data_only(tmp_path, good):
    # Every file our saves write loads under torch's weights_only unpickler (plus TorchVersion-free manifests).
    for path in (good["full"], os.path.join(good["sharded"], "trainer_state.pt")):
        torch.load(path, weights_only=True)
    with pytest.warns(UserWarning, match="repr"):
        trainer = fit(tmp_path, 2, module=Net(config=Config()))
        trainer.save_checkpoint(str(tmp_path / "h.ckpt"))
    state = torch.load(str(tmp_path / "h.ckpt"), weights_only=True)
    assert state["hyper_parameters"]["config"] == "Config(depth=2)"


# ----------------------------------------------------------------- integrity
def _flip(path, offset_from_end=64):
    with open(path, "r+b") as fh:
        fh.seek(-offset_from_end, os.SEEK_END)
        byte = fh.read(1)
        fh.seek(-offset_from_end, os.SEEK_END)
        fh.write(bytes([byte[0] ^ 0x7F]))


def test_flipped_byte_in_dcp_shard_is_named(tmp_path, good, monkeypatch):
    import shutil

    ckpt = str(tmp_path / "copy.ckpt")
    shutil.copytree(good["sharded"], ckpt)
    manifest = layout.read_manifest(ckpt)
    assert {"__0_0.distcp", ".metadata", "trainer_state.pt"} <= set(manifest["checksums"])
    shard = os.path.join(ckpt, "__0_0.distcp")
    _flip(shard, 200)
    with pytest.raises(ChecksumMismatchError) as err:
        fit(tmp_path / "run", 4, strategy="fsdp", ckpt_path=ckpt)
    text = str(err.value)
    assert shard in text and manifest["checksums"]["__0_0.distcp"]["sha256"] in text and VERIFY_ENV in text
    assert cli_main(["convert", ckpt, str(tmp_path / "out")]) == 1
    # Opting out skips the check: what is left is DCP's own decoding, which may or may not notice.
    monkeypatch.setenv(VERIFY_ENV, "0")
    try:
        fit(tmp_path / "run2", 4, strategy="fsdp", ckpt_path=ckpt)
    except CheckpointError as exc:
        assert not isinstance(exc, ChecksumMismatchError)


def test_flipped_byte_in_full_file_is_named(tmp_path, good):
    path = str(tmp_path / "copy.ckpt")
    with open(good["full"], "rb") as src, open(path, "wb") as dst:
        dst.write(src.read())
    # Damage a tensor's bytes (the first data record), not the zip directory.
    import zipfile

    with zipfile.ZipFile(path) as zf:
        info = next(i for i in zf.infolist() if "/data/" in i.filename and i.file_size >= 64)
    import struct

    with open(path, "r+b") as fh:
        fh.seek(info.header_offset + 26)  # the local header's own name / extra lengths (torch pads the extra)
        name_len, extra_len = struct.unpack("<HH", fh.read(4))
        fh.seek(info.header_offset + 30 + name_len + extra_len + 16)
        byte = fh.read(1)
        fh.seek(-1, os.SEEK_CUR)
        fh.write(bytes([byte[0] ^ 0x40]))
    with pytest.raises(ChecksumMismatchError) as err:
        fit(tmp_path / "run", 4, ckpt_path=path)
    assert path in str(err.value) and "recorded" in str(err.value)
    assert cli_main(["convert", path, str(tmp_path / "w.safetensors")]) == 1  # verified tensor by tensor too
    assert cli_main(["convert", good["full"], str(tmp_path / "ok.safetensors")]) == 0


def test_damaged_dcp_files_raise_named_exceptions(tmp_path, good, monkeypatch):
    # torch's CheckpointException is a BaseException: it must never escape `except Exception`.
    import shutil

    monkeypatch.setenv(VERIFY_ENV, "0")
    for victim in (".metadata", "__0_0.distcp"):
        ckpt = str(tmp_path / f"copy{victim}.ckpt")
        shutil.copytree(good["sharded"], ckpt)
        with open(os.path.join(ckpt, victim), "r+b") as fh:
            fh.seek(0)
            fh.write(b"\xff" * 48)
        try:
            fit(tmp_path / "run", 4, strategy="fsdp", ckpt_path=ckpt)
        except Exception as exc:  # noqa: BLE001 - the point: an Exception, and ours
            assert isinstance(exc, CorruptCheckpointError), repr(exc)
            assert ckpt in str(exc)
        else:
            pytest.fail(f"damaged {victim} loaded")
        if dist.is_initialized():
            dist.destroy_process_group()


# --------------------------------------------------------------- disk errors
def _mount_tmpfs(path, options):
    os.makedirs(path, exist_ok=True)
    result = subprocess.run(["mount", "-t", "tmpfs", "-o", options, "tmpfs", path], capture_output=True)
    if result.returncode:
        pytest.skip(f"cannot mount a tmpfs here ({result.stderr.decode().strip()}); the mock tests cover it")
    return path


@pytest.fixture
def small_disk(tmp_path):
    path = _mount_tmpfs(str(tmp_path / "disk"), "size=1m")
    yield path
    subprocess.run(["umount", "-l", path])


def _fill(directory, leave_bytes):
    """Fill the filesystem, then free `leave_bytes`: the next checkpoint starts writing and runs out."""
    filler = os.path.join(directory, "filler")
    fd = os.open(filler, os.O_WRONLY | os.O_CREAT)
    try:
        while os.write(fd, b"\0" * 4096):
            pass
    except OSError as exc:
        assert exc.errno == errno.ENOSPC
    finally:
        os.close(fd)
    os.truncate(filler, max(0, os.path.getsize(filler) - leave_bytes))


@pytest.mark.parametrize(
    "strategy,leave",
    [("single", 8192), ("fsdp", 8192), ("fsdp", 40960)],
    ids=["full", "sharded-trainer-state", "sharded-dcp-shard"],
)
def test_full_disk_names_enospc_and_keeps_previous(tmp_path, small_disk, strategy, leave):
    trainer = fit(tmp_path / "run", 2, strategy)
    first = os.path.join(small_disk, "first.ckpt")
    trainer.save_checkpoint(first)
    before = sorted(os.listdir(small_disk))
    _fill(small_disk, leave)
    with pytest.raises(CheckpointError) as err:
        trainer.save_checkpoint(os.path.join(small_disk, "second.ckpt"))
    text = str(err.value)
    assert "ENOSPC" in text and "No space left" in text and small_disk in text, text
    assert "unexpected pos" not in text
    assert sorted(os.listdir(small_disk)) == sorted(before + ["filler"])  # no partial .tmp- left
    os.unlink(os.path.join(small_disk, "filler"))
    if dist.is_initialized():
        dist.destroy_process_group()
    assert fit(tmp_path / "run2", 3, strategy, ckpt_path=first).global_step == 3


def test_full_disk_mid_write_mock(tmp_path, monkeypatch):
    # Without mount privileges: the durable writer's file runs out of space after 4 KiB.
    real_open = open

    class Full:
        def __init__(self, fh):
            self.fh, self.written = fh, 0

        def write(self, data):
            self.written += len(data)
            if self.written > 4096:
                raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
            return self.fh.write(data)

        def __getattr__(self, name):
            return getattr(self.fh, name)

        def __enter__(self):
            return self

        def __exit__(self, *exc):
            self.fh.close()

    def fake_open(path, mode="r", *a, **k):
        fh = real_open(path, mode, *a, **k)
        return Full(fh) if "w" in mode and str(path).startswith(str(tmp_path / "ck")) else fh

    trainer = fit(tmp_path / "run", 2)
    os.makedirs(tmp_path / "ck")
    monkeypatch.setattr(layout, "open", fake_open, raising=False)
    with pytest.raises(CheckpointError) as err:
        trainer.save_checkpoint(str(tmp_path / "ck" / "a.ckpt"))
    assert "ENOSPC" in str(err.value) and str(tmp_path / "ck") in str(err.value)
    assert os.listdir(tmp_path / "ck") == []


def test_check_writable(tmp_path, monkeypatch):
    check_writable(str(tmp_path / "new" / "dir"))  # creates it
    assert os.listdir(tmp_path / "new" / "dir") == []  # the probe is gone
    ro = _mount_tmpfs(str(tmp_path / "ro"), "ro,size=64k") if os.geteuid() == 0 else None
    if ro:
        try:
            with pytest.raises(CheckpointWriteError) as err:
                check_writable(os.path.join(ro, "checkpoints"))
            assert err.value.errno == errno.EROFS and "EROFS" in str(err.value) and ro in str(err.value)
        finally:
            subprocess.run(["umount", "-l", ro])
    real = os.open

    def denied(path, flags, *a, **k):
        if str(path).startswith(str(tmp_path / "locked")) and flags & os.O_CREAT:
            raise PermissionError(errno.EACCES, os.strerror(errno.EACCES), str(path))
        return real(path, flags, *a, **k)

    os.makedirs(tmp_path / "locked")
    monkeypatch.setattr(os, "open", denied)
    with pytest.raises(CheckpointWriteError) as err:
        check_writable(str(tmp_path / "locked"))
    assert err.value.errno == errno.EACCES and "permission" in str(err.value).lower()
    assert str(tmp_path / "locked") in str(err.value)

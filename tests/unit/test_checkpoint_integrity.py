"""Integrity of every checkpoint format: damage is refused by name before anything is loaded.

Issue 27's campaign as tests, in one process: one file written by DDP, one
file written by FSDP with state_dict_type="full", and an FSDP sharded (DCP)
directory are each built once per module by two runs (a and b, 6 steps, a
checkpoint every 3; benchmarks/checkpoint_damage.py, which also runs the
longer campaign with a --seed and DeepSpeed). Then: every kind of damage to
every file (flip, truncate, delete, replace with run b's, edit a field) is
refused with a named error and nothing loaded -- by fit(ckpt_path=...),
fit(ckpt_path="last"), `shardwise inspect` and `shardwise convert`; the
acceptance cases by hand (a flipped byte in data.pkl and in the pickled
global_step); a one-file checkpoint without a trailer (an older release's)
is refused naming the opt-out, which loads it and says so once; an edited
manifest is refused even when re-sealed; another run's checkpoint in a run's
directory is detected by discovery and by inspect, and still loads when
passed explicitly; inspect's per-file report and exit status; a random file
as ckpt_path; and a verified one-file load reads the file once.
"""

from __future__ import annotations

import hashlib
import json
import os
import pickle
import pickletools
import random
import shutil
import struct
import warnings
import zipfile

import pytest
import torch
import torch.distributed as dist
from checkpoint_damage import (  # benchmarks/, on pytest's pythonpath
    FAST_FORMATS,
    SEED_UNDER_TEST,
    TARGET,
    Outcome,
    Spy,
    build,
    campaign_in_worker,
    cases,
    train,
)

import shardwise
from shardwise.checkpoint import layout, onefile
from shardwise.checkpoint.errors import (
    ChecksumMismatchError,
    CorruptCheckpointError,
    ForeignCheckpointError,
    ManifestMismatchError,
    UnverifiableCheckpointError,
)
from shardwise.checkpoint.integrity import MANIFEST_NAME, SEAL_KEY, VERIFY_ENV, seal
from shardwise.cli import main as cli_main

SEED = int(os.environ.get("SHARDWISE_DAMAGE_SEED", "27"))


@pytest.fixture(autouse=True)
def _no_leftover_process_group():
    yield
    if dist.is_initialized():
        dist.destroy_process_group()


@pytest.fixture(scope="module")
def built(tmp_path_factory):
    root = str(tmp_path_factory.mktemp("damage"))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return {fmt: build(root, fmt) for fmt in FAST_FORMATS}


def _run_copy(tmp_path, b):
    """A copy of run `b`'s directory (its checkpoints/, last.ckpt and the directory's record included)."""
    root = str(tmp_path / f"copy-{b.fmt}")
    shutil.copytree(b.a, root, symlinks=True)
    return root, os.path.join(root, "checkpoints")


def _fit(root, fmt, ckpt_path):
    spy = Spy()
    train(root, fmt, SEED_UNDER_TEST, ckpt_path, spy)
    return spy


# ------------------------------------------------------------------ the campaign
@pytest.mark.parametrize("fmt", FAST_FORMATS)
def test_every_damage_to_every_file_is_refused_by_name_with_nothing_loaded(tmp_path, built, fmt):
    outcomes = cases(built[fmt], str(tmp_path), random.Random(f"{SEED}-{fmt}"))
    kinds = {o.kind for o in outcomes}
    assert kinds == {"flip", "truncate", "delete", "replace", "edit"}, kinds
    files = {o.rel for o in outcomes}
    sharded = {".metadata", "__0_0.distcp", MANIFEST_NAME, "trainer_state.pt"}
    assert files == (sharded if fmt == "fsdp_sharded" else {"(the file)"})
    bad = [f"{o.rel} {o.kind} ({o.what}): {'; '.join(o.problems)}" for o in outcomes if not o.ok]
    assert not bad, f"seed {SEED}:\n" + "\n".join(bad)


@pytest.mark.slow  # a launched worker and DeepSpeed engines: ~6-10 s on 2 cores
@pytest.mark.deepspeed
def test_every_damage_to_every_deepspeed_file_is_refused_by_name_with_nothing_loaded(tmp_path):
    pytest.importorskip("deepspeed")
    entries = shardwise.launch(campaign_in_worker, str(tmp_path), ["deepspeed"], SEED, 1, devices=1)[0]
    outcomes = [Outcome(**entry) for entry in entries]
    files = {o.rel for o in outcomes}
    assert {"trainer_state.pt", "deepspeed.json", MANIFEST_NAME, "latest"} <= files
    assert len([f for f in files if f.startswith("engine/")]) >= 2, files
    bad = [f"{o.rel} {o.kind} ({o.what}): {'; '.join(o.problems)}" for o in outcomes if not o.ok]
    assert not bad, f"seed {SEED}:\n" + "\n".join(bad)


# ------------------------------------------------------------------ acceptance, by hand
def _data_pkl(path):
    """(offset of data.pkl's bytes in the file, those bytes)."""
    with zipfile.ZipFile(path) as zf:
        info = next(i for i in zf.infolist() if i.filename.endswith("/data.pkl"))
        data = zf.read(info)
    with open(path, "rb") as fh:
        fh.seek(info.header_offset + 26)
        name_len, extra_len = struct.unpack("<HH", fh.read(4))
    return info.header_offset + 30 + name_len + extra_len, data


def _flip_at(path, offset, mask=0x01):
    with open(path, "r+b") as fh:
        fh.seek(offset)
        byte = fh.read(1)[0]
        fh.seek(offset)
        fh.write(bytes([byte ^ mask]))


@pytest.mark.parametrize("fmt", ["ddp", "fsdp_full"])
@pytest.mark.parametrize("where", ["middle of data.pkl", "pickled global_step"])
def test_one_file_flipped_data_pkl_or_step_is_refused_and_reported(tmp_path, built, fmt, where):
    root, directory = _run_copy(tmp_path, built[fmt])
    ckpt = os.path.join(directory, TARGET)
    start, data = _data_pkl(ckpt)
    if where == "pickled global_step":
        ops = list(pickletools.genops(data))
        key = next(i for i, (op, arg, _) in enumerate(ops) if arg == "global_step")
        value = next(pos for op, arg, pos in ops[key + 1 :] if op.name.startswith("BININT"))
        offset = start + value + 1  # the opcode, then its argument: 6 becomes 7
    else:
        offset = start + len(data) // 2
    _flip_at(ckpt, offset)
    with pytest.raises(ChecksumMismatchError, match="recorded"):
        _fit(root, fmt, ckpt)
    assert cli_main(["inspect", ckpt]) == 1
    assert cli_main(["convert", ckpt, str(tmp_path / "w.safetensors")]) == 1


def test_the_trailer_keeps_the_file_a_torch_file_and_covers_every_byte(built):
    ckpt = os.path.join(built["ddp"].a, "checkpoints", TARGET)
    assert torch.load(ckpt, weights_only=True)["train_state"]["global_step"] == 6  # torch.load as ever
    trailer = onefile.read_trailer(ckpt)
    assert trailer.covered == os.path.getsize(ckpt) - onefile.HEX_LEN
    assert trailer.manifest["run_id"] and trailer.manifest[SEAL_KEY] == seal(trailer.manifest)[SEAL_KEY]
    with open(ckpt, "rb") as fh:
        body = fh.read(trailer.covered)
    leaves = [hashlib.sha256(body[i : i + onefile.LEAF]).digest() for i in range(0, len(body), onefile.LEAF)]
    assert onefile.combine(leaves) == trailer.digest


# ------------------------------------------------------------------ older checkpoints
def test_a_one_file_checkpoint_without_trailer_is_refused_naming_the_opt_out(tmp_path, built, monkeypatch):
    source = os.path.join(built["ddp"].a, "checkpoints", TARGET)
    old = str(tmp_path / "old.ckpt")
    torch.save(torch.load(source, weights_only=True), old)  # what shardwise wrote before trailers existed
    with pytest.raises(UnverifiableCheckpointError) as err:
        _fit(str(tmp_path / "run"), "ddp", old)
    assert VERIFY_ENV in str(err.value) and "old.ckpt" in str(err.value)
    assert cli_main(["inspect", old]) == 1
    assert cli_main(["inspect", old, "--no-verify"]) == 0
    monkeypatch.setenv(VERIFY_ENV, "0")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        spy = _fit(str(tmp_path / "run"), "ddp", old)
    assert spy.loaded["global_step"] == 6
    said = [w for w in caught if VERIFY_ENV in str(w.message)]
    assert len(said) == 1, [str(w.message) for w in said]


def test_a_directory_manifest_without_a_seal_still_loads(tmp_path, built):
    root, directory = _run_copy(tmp_path, built["fsdp_sharded"])
    manifest_path = os.path.join(directory, TARGET, MANIFEST_NAME)
    manifest = json.load(open(manifest_path))
    del manifest[SEAL_KEY]  # written before manifests carried one: its fields are still cross-checked
    json.dump(manifest, open(manifest_path, "w"))
    assert _fit(root, "fsdp_sharded", os.path.join(directory, TARGET)).loaded["global_step"] == 6


# ------------------------------------------------------------------ edited manifests
def test_an_edited_step_is_refused_however_it_was_edited(tmp_path, built):
    root, directory = _run_copy(tmp_path, built["fsdp_sharded"])
    ckpt = os.path.join(directory, TARGET)
    manifest_path = os.path.join(ckpt, MANIFEST_NAME)
    original = json.load(open(manifest_path))
    json.dump({**original, "global_step": 5}, open(manifest_path, "w"))
    with pytest.raises(ChecksumMismatchError, match="changed after it was written"):
        _fit(root, "fsdp_sharded", ckpt)
    json.dump(seal({**original, "global_step": 5}), open(manifest_path, "w"))  # re-sealed, as a forger would
    with pytest.raises(ManifestMismatchError, match="global_step=5 in the manifest but 6"):
        _fit(root, "fsdp_sharded", ckpt)
    assert cli_main(["inspect", ckpt]) == 1


# ------------------------------------------------------------------ another run's checkpoints
def test_another_runs_checkpoint_in_a_runs_directory_is_detected(tmp_path, built, capsys):
    b = built["ddp"]
    root, directory = _run_copy(tmp_path, b)
    theirs = os.path.join(b.b, "checkpoints", TARGET)
    placed = os.path.join(directory, "epoch=0-step=9.ckpt")  # newer than the run's own last
    shutil.copyfile(theirs, placed)
    with pytest.warns(UserWarning, match=r"other runs than last.ckpt's .*epoch=0-step=9.ckpt"):
        spy = _fit(root, "ddp", "last")
    assert spy.loaded["global_step"] == 6  # the run's own, not the newer foreign one
    assert cli_main(["inspect", placed]) == 1
    assert "from another run" in capsys.readouterr().out
    # Passed explicitly it loads: resuming from another run's checkpoint is a choice one may make.
    assert _fit(str(tmp_path / "elsewhere"), "ddp", placed).loaded["run_id"] != spy.loaded["run_id"]


def test_another_runs_checkpoint_copied_over_last_is_refused_unless_named(tmp_path, built):
    b = built["fsdp_full"]
    root, directory = _run_copy(tmp_path, b)
    if layout.recorded_last(directory) is None:
        pytest.skip("this filesystem keeps no extended attributes: the directory cannot remember its run")
    ckpt = os.path.join(directory, TARGET)
    shutil.copyfile(os.path.join(b.b, "checkpoints", TARGET), ckpt)  # same name, same step, run b's
    with pytest.raises(ForeignCheckpointError, match="another run"):
        _fit(root, "fsdp_full", "last")
    with pytest.raises(ForeignCheckpointError):
        _fit(root, "fsdp_full", os.path.join(directory, "last.ckpt"))
    assert cli_main(["inspect", ckpt]) == 1
    assert _fit(root, "fsdp_full", ckpt).loaded["global_step"] == 6  # the file, by its own name


def test_without_last_checkpoints_of_two_runs_are_not_guessed_between(tmp_path, built):
    b = built["ddp"]
    root, directory = _run_copy(tmp_path, b)
    os.unlink(os.path.join(directory, "last.ckpt"))
    shutil.copyfile(os.path.join(b.b, "checkpoints", TARGET), os.path.join(directory, "epoch=0-step=7.ckpt"))
    with pytest.raises(ForeignCheckpointError, match="2 different runs"):
        _fit(root, "ddp", "last")


# ------------------------------------------------------------------ inspect
def test_inspect_reports_each_file_and_exits_1_when_any_is_wrong(tmp_path, built, capsys):
    root, directory = _run_copy(tmp_path, built["fsdp_sharded"])
    ckpt = os.path.join(directory, TARGET)
    assert cli_main(["inspect", ckpt, "--json"]) == 0
    summary = json.loads(capsys.readouterr().out)
    assert summary["ok"] and {e["status"] for e in summary["files"]} == {"ok"} and len(summary["files"]) == 4
    _flip_at(os.path.join(ckpt, "__0_0.distcp"), 100)
    os.unlink(os.path.join(ckpt, "trainer_state.pt"))
    assert cli_main(["inspect", ckpt, "--json"]) == 1
    out = capsys.readouterr()
    statuses = {e["name"]: e["status"] for e in json.loads(out.out)["files"]}
    expected = {MANIFEST_NAME: "ok", ".metadata": "ok", "__0_0.distcp": "damaged", "trainer_state.pt": "missing"}
    assert statuses == expected
    assert "__0_0.distcp" in out.err or "trainer_state.pt" in out.err
    assert cli_main(["inspect", ckpt]) == 1
    text = capsys.readouterr().out
    assert "NOT OK: 1 damaged, 1 missing of 4 file(s)" in text and "not read further" in text
    # --no-verify only describes; the trainer state is gone, so describing fails by name too.
    assert cli_main(["inspect", ckpt, "--no-verify"]) == 1
    assert "trainer_state.pt is missing" in capsys.readouterr().err


# ------------------------------------------------------------------ bad inputs
@pytest.mark.parametrize("size", [0, 21, 4096])
def test_a_random_file_as_ckpt_path_is_a_named_error_without_torch_in_its_chain(tmp_path, size):
    path = tmp_path / "random.bin"
    path.write_bytes(random.Random(size).randbytes(size))
    with pytest.raises(CorruptCheckpointError, match="random.bin is truncated or corrupt") as err:
        _fit(str(tmp_path / "run"), "ddp", str(path))
    chain, exc = [], err.value
    while exc is not None:
        chain.append(exc)
        exc = exc.__cause__ or exc.__context__
    assert not [e for e in chain if isinstance(e, pickle.UnpicklingError)], chain


# ------------------------------------------------------------------ cost
def _rchar():
    with open("/proc/self/io") as fh:
        return next(int(line.split()[1]) for line in fh if line.startswith("rchar:"))


def test_a_verified_one_file_load_reads_the_file_once(tmp_path, monkeypatch):
    from shardwise.checkpoint.formats import load_model_and_optimizers, save_model_and_optimizers
    from shardwise.checkpoint.layout import build_manifest

    model = torch.nn.Sequential(torch.nn.Linear(1024, 1024), torch.nn.Linear(1024, 1024))
    path = str(tmp_path / "big.ckpt")
    state = {"shardwise": build_manifest("full", "single", 1, {}), "train_state": {"global_step": 0}}
    save_model_and_optimizers(model, [], path, state, "full")
    size = os.path.getsize(path)
    reads = {}
    for verify in ("1", "0"):
        monkeypatch.setenv(VERIFY_ENV, verify)
        before = _rchar()
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            load_model_and_optimizers(model, [], path, "full")
        reads[verify] = _rchar() - before
    # Verified: the hash reads every byte once; the mapped load then uses those pages (no read()).
    assert 0.99 * size <= reads["1"] <= 1.1 * size, (reads, size)
    assert reads["0"] < 0.1 * size, (reads, size)

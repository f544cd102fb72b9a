"""Hub ids for models and data sets, against a hub on 127.0.0.1 (tests/helpers/hub_server.py) and a hub cache laid
out as a download leaves it: the real huggingface_hub client code runs, nothing reaches the internet.

What users rely on: a snapshot is fetched once however many processes ask (one downloads under the lock, the
others wait and say so), a dropped download resumes where it stopped, pickles are never fetched, a cached
repo works with HF_HUB_OFFLINE=1 (finetune's checks and `shardwise plan`), and every mistake -- a wrong token,
a missing revision, offline with nothing cached, a disk too small -- is refused before any worker starts,
naming the fix. Training with hub names and --push_to_hub is tests/seeds/test_seed_003.py.
"""

from __future__ import annotations

import dataclasses
import hashlib
import os
import subprocess
import sys
import time

import pytest
from filelock import FileLock
from huggingface_hub import constants

from shardwise.recipes import hub
from shardwise.recipes.data import DataOptions
from shardwise.recipes.finetune import FinetuneConfig, finetune, validate_config

from helpers.hf import build_model_folder, chat_records, write_jsonl
from helpers.hub_server import HubServer, folder_files, lay_cache, point_at

TOKEN = "hf_test_token"


@pytest.fixture(scope="module")
def repos(tmp_path_factory):
    """The tiny model's files (plus a pickle the download must skip) and a chat data set, as repo contents."""
    root = tmp_path_factory.mktemp("hub-repos")
    model = folder_files(build_model_folder(str(root / "tiny"), chat_records(20), max_positions=64))
    model["pytorch_model.bin"] = b"a pickle is never fetched"
    (root / "chat").mkdir()
    data = folder_files(os.path.dirname(write_jsonl(str(root / "chat" / "train.jsonl"), chat_records(40))))
    return model, data


@pytest.fixture
def hub_env(tmp_path, monkeypatch):
    """A fresh hub cache and a running local hub, for this process (huggingface_hub's constants) and its children."""
    server = HubServer(token=TOKEN).__enter__()
    cache = point_at(monkeypatch, server, str(tmp_path / "hf"))
    yield server, cache
    server.__exit__()


def test_processes_sharing_a_cache_fetch_each_file_once(hub_env, repos, tmp_path):
    server, cache = hub_env
    model, _ = repos
    server.add_repo("org/tiny", model)
    # Two processes (two nodes sharing a file system) ask while a third holds the download lock: both wait, saying
    # so; then one downloads and the other reads the same snapshot.
    lock = FileLock(os.path.join(cache, ".locks", "shardwise", "models--org--tiny.lock"))
    os.makedirs(os.path.dirname(lock.lock_file), exist_ok=True)
    # The hub module alone (it needs huggingface_hub, not torch): a process that starts in a second.
    code = (
        "import importlib.util as u, sys; s = u.spec_from_file_location('hub', %r); m = u.module_from_spec(s); "
        "sys.modules['hub'] = m; s.loader.exec_module(m); print(m.resolve_model('org/tiny'))" % hub.__file__
    )
    errs = [str(tmp_path / f"stderr{i}") for i in range(2)]
    with lock:
        procs = [
            subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, stderr=open(err, "w"), text=True)
            for err in errs
        ]
        deadline = time.time() + 120
        while time.time() < deadline and not all("waiting for" in open(err).read() for err in errs):
            assert all(p.poll() is None for p in procs), [open(err).read() for err in errs]
            time.sleep(0.2)
    outs = [(p.communicate(timeout=120)[0], open(err).read()) for p, err in zip(procs, errs)]
    assert all(p.returncode == 0 for p in procs), outs
    paths = {out.strip() for out, _ in outs}
    assert len(paths) == 1 and os.path.isdir(paths.pop())
    assert all("waiting for another process to download model org/tiny" in err for _, err in outs), outs
    wanted = [f for f in model if f != "pytorch_model.bin"]
    assert {f: server.file_gets(f) for f in wanted} == {f: 1 for f in wanted}, server.log
    assert server.file_gets("pytorch_model.bin") == 0


def test_a_cut_download_resumes_where_it_stopped(hub_env):
    server, cache = hub_env
    big = os.urandom(constants.DOWNLOAD_CHUNK_SIZE + 200_000)  # the client keeps what it got in whole chunks
    commit = server.add_repo("org/big", {"config.json": b"{}", "model.safetensors": big})
    url = f"/org/big/resolve/{commit}/model.safetensors"
    server.cut_after[url] = constants.DOWNLOAD_CHUNK_SIZE + 1000
    path = hub.resolve_model("org/big")
    with open(os.path.join(path, "model.safetensors"), "rb") as fh:
        assert hashlib.sha256(fh.read()).digest() == hashlib.sha256(big).digest()
    # The first GET stopped half-way; the second asked for the rest only (a 206 answer to its Range).
    assert [(m, s) for m, p, s in server.log if p == url and m == "GET"] == [("GET", 599), ("GET", 206)]


def test_mistakes_are_refused_before_any_worker_starts_naming_the_fix(hub_env, repos, monkeypatch, tmp_path):
    server, cache = hub_env
    model, data = repos
    server.add_repo("org/tiny", model)
    server.add_repo("org/chat", data, repo_type="dataset")
    server.add_repo("org/private", model, private=True)
    server.add_repo("org/pickles", {"config.json": model["config.json"], "pytorch_model.bin": b"x"})

    def refused(**options):
        cfg = FinetuneConfig(
            model_path=options.pop("model", "org/tiny"),
            data=DataOptions(dataset=options.pop("dataset", "org/chat"), max_seq_len=32),
            output_dir=str(tmp_path / "out"),
            devices=2,  # finetune() would start two workers: the error must come first
            max_steps=1,
            precision="32-true",
            **options,
        )
        with pytest.raises(hub.HubError) as err:
            finetune(cfg)
        return str(err.value)

    said = refused(model="org/private")
    assert "HF_TOKEN" in said and "hf auth login" in said and "no token was given" in said
    monkeypatch.setenv("HF_TOKEN", "hf_wrong")
    assert "has no access" in refused(model="org/private")
    monkeypatch.setenv("HF_TOKEN", TOKEN)
    assert os.path.isfile(os.path.join(hub.resolve_model("org/private"), "model.safetensors"))  # the right token
    said = refused(revision="v2.0")
    assert "revision 'v2.0' does not exist" in said
    said = refused(dataset_revision="nope")
    assert "data set 'org/chat': revision 'nope' does not exist" in said
    said = refused(model="org/pickles")
    assert "only PyTorch pickle weights (pytorch_model.bin)" in said and "safetensors" in said
    assert "does not exist" in refused(model="org/missing")
    real_disk_usage = hub.shutil.disk_usage
    monkeypatch.setattr(hub.shutil, "disk_usage", lambda path: type("U", (), {"free": 1000})())
    server.add_repo("org/other", {k: v for k, v in model.items() if k != "pytorch_model.bin"})
    said = refused(model="org/other")
    size = sum(len(v) for k, v in model.items() if k != "pytorch_model.bin") / 2**20  # the pickle is not counted
    assert f"model 'org/other' (revision main) needs {size:.2f} MiB in the hub cache" in said, said
    assert "only 0.00 MiB are free" in said and "HF_HUB_CACHE" in said
    hub.resolve_model("org/tiny")  # cached already: nothing to fit on the disk
    monkeypatch.setattr(hub.shutil, "disk_usage", real_disk_usage)
    # A tokenizer repo has no weights, and needs none.
    server.add_repo("org/tok", {k: v for k, v in model.items() if k.startswith(("tokenizer", "special"))})
    assert os.path.isfile(os.path.join(hub.resolve_tokenizer("org/tok"), "tokenizer.json"))
    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(tmp_path / "empty-cache"))  # nothing cached, offline
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", True)
    said = refused(model="org/tiny")
    assert "HF_HUB_OFFLINE=1" in said and str(tmp_path / "empty-cache") in said
    assert not os.path.exists(str(tmp_path / "out"))  # no worker ran: nothing was written


def test_push_export_checks_the_adapter_folder_then_uploads_it(hub_env, tmp_path, monkeypatch):
    server, _ = hub_env
    monkeypatch.setenv("HF_TOKEN", TOKEN)
    folder = tmp_path / "adapter"
    folder.mkdir()
    (folder / "adapter_config.json").write_text('{"r": 4}')
    (folder / "finetune_history.json").write_text("{}")  # the run's log, not the export
    (folder / "checkpoints").mkdir()
    (folder / "checkpoints" / "state.json").write_text("{}")
    with pytest.raises(hub.HubError, match=r"lacks \['adapter_model.safetensors'\]; nothing uploaded"):
        hub.push_export(hub.HubUpload("org/adapter"), str(folder), adapter=True)
    (folder / "adapter_model.safetensors").write_bytes(os.urandom(1000))
    upload = hub.HubUpload("org/adapter")
    hub.push_export(upload, str(folder), adapter=True)
    assert upload.wait() is None
    assert sorted(server.files("org/adapter")) == ["adapter_config.json", "adapter_model.safetensors"]
    for name, data in server.files("org/adapter").items():
        assert hashlib.sha256(data).digest() == hashlib.sha256((folder / name).read_bytes()).digest()


def test_a_failed_upload_keeps_the_folder_and_says_how_to_retry(hub_env, tmp_path, capsys):
    server, _ = hub_env
    folder = tmp_path / "export"
    folder.mkdir()
    (folder / "config.json").write_text("{}")
    upload = hub.HubUpload("me/model", private=True, token="hf_wrong")
    upload.start(str(folder), ["config.json"])
    assert upload.wait() is not None and (folder / "config.json").exists()
    assert f"retry with: hf upload --private me/model {folder} ." in capsys.readouterr().err
    assert ("model", "me/model") not in server.repos


def test_offline_cache_as_a_download_leaves_it(tmp_path, repos, monkeypatch, capsys):
    model, data = repos
    cache = str(tmp_path / "hub")
    snapshot = lay_cache(cache, "org/tiny", {k: v for k, v in model.items() if k != "pytorch_model.bin"})
    lay_cache(cache, "org/chat", data, repo_type="dataset")
    monkeypatch.setattr(constants, "HF_HUB_CACHE", cache)
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", True)
    for name, url in (("ENDPOINT", ""), ("HUGGINGFACE_CO_URL_TEMPLATE", "/{repo_id}/resolve/{revision}/{filename}")):
        monkeypatch.setattr(constants, name, "http://127.0.0.1:9" + url)  # nothing listens: offline must not ask
    cfg = FinetuneConfig(
        model_path="org/tiny", data=DataOptions(dataset="org/chat", max_seq_len=32), output_dir=str(tmp_path / "o")
    )
    checked = validate_config(cfg)
    assert checked["folder"].path == snapshot
    assert checked["data"].dataset.endswith(os.path.join("snapshots", checked["dataset_revision"], "train.jsonl"))
    # Another revision of the data set is another snapshot, so another tokenisation cache key; the same one
    # resolves to the same key again (nothing re-tokenised).
    from transformers import AutoTokenizer

    from shardwise.recipes.data import cache_key

    fewer = b"".join(data["train.jsonl"].splitlines(keepends=True)[:20])
    lay_cache(cache, "org/chat", {"train.jsonl": fewer}, "dataset", "v2")
    tokenizer = AutoTokenizer.from_pretrained(snapshot)

    def key(**options):
        again = validate_config(dataclasses.replace(cfg, **options))
        spec = dataclasses.replace(again["data"].spec(again["text_field"], 0), revision=again["dataset_revision"])
        return cache_key(spec, tokenizer), again["dataset_revision"]

    (main_key, main_rev), (v2_key, v2_rev) = key(), key(dataset_revision="v2")
    assert main_rev == checked["dataset_revision"] and v2_rev != main_rev and v2_key != main_key
    assert key() == (main_key, main_rev)
    # A local folder is taken exactly as before.
    assert hub.resolve_model(snapshot) == snapshot and hub.resolve_dataset(checked["data"].dataset) is None
    from shardwise.cli import main

    assert (
        main(
            [
                "plan",
                "--model",
                "org/tiny",
                "--devices",
                "2",
                "--device-memory",
                "8GiB",
                "--precision",
                "32-true",
                "--accelerator",
                "cpu",
                "--seq-len",
                "32",
                "--only",
                "fsdp",
            ]
        )
        == 0
    )
    out = capsys.readouterr().out
    assert out.startswith(f"org/tiny (revision main): {snapshot}") and "fsdp" in out.lower()

# Two "nodes" on one machine: two `shardwise launch` invocations on 127.0.0.1
# (node ranks 0 and 1, 2 processes each) fine-tune with HYBRID_SHARD --
# parameters sharded within a node, replicated across the two -- and must
# reproduce the per-step losses of one process with the same global batch
# (4 accumulated micro-batches; same data order, same weights). The model and data set are named by hub id and
# served by a hub on 127.0.0.1 (tests/helpers/hub_server.py): the four workers of the two nodes and the
# reference run at the same time and share one hub cache, and each file is fetched from the hub exactly once.
from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

HERE = os.path.dirname(os.path.abspath(__file__))
SRC = os.path.join(HERE, "..", "..", "src")


def _env():
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([os.path.abspath(SRC), env.get("PYTHONPATH", "")])
    env.setdefault("OMP_NUM_THREADS", "1")
    return env


def _launch(args, log):
    return subprocess.Popen(
        [sys.executable, "-m", "shardwise.cli", "launch", *args], env=_env(), stdout=log, stderr=subprocess.STDOUT
    )


def _stop(procs):
    # SIGTERM reaches the elastic agent, which stops its workers (they run in
    # their own sessions, so killing the agent alone would orphan them).
    for proc in procs:
        if proc.poll() is None:
            proc.terminate()
    for proc in procs:
        try:
            proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            proc.kill()


def _wait(procs, logs):
    try:
        for proc, log in zip(procs, logs):
            code = proc.wait(timeout=420)
            log.flush()
            assert code == 0, open(log.name).read()[-4000:]
    finally:
        _stop(procs)


def _losses(out):
    with open(os.path.join(out, "finetune_history.json")) as fh:
        return [s["loss"] for s in json.load(fh)["losses"]]


@pytest.mark.slow
def test_two_launchers_hybrid_shard_match_one_node(tmp_path, monkeypatch):
    from shardwise.distributed.env import find_free_port

    from helpers.hf import build_model_folder, chat_records, write_jsonl
    from helpers.hub_server import HubServer, folder_files, point_at

    records = chat_records(120)
    model = build_model_folder(str(tmp_path / "model"), records)
    os.makedirs(tmp_path / "data")
    data = write_jsonl(str(tmp_path / "data" / "train.jsonl"), records)
    hub = HubServer().__enter__()
    hub.add_repo("org/tiny", folder_files(model))
    hub.add_repo("org/chat", folder_files(os.path.dirname(data)), repo_type="dataset")
    point_at(monkeypatch, hub, str(tmp_path / "hf"))  # the launches inherit HF_ENDPOINT and HF_HOME
    config = tmp_path / "run.yaml"
    config.write_text(
        "model_path: org/tiny\ndataset: org/chat\nmax_seq_len: 64\nmax_steps: 6\nlogging_steps: 1\n"
        "learning_rate: 0.003\nprecision: 32-true\neval_split_ratio: 0\nseed: 3\n"
        f"cache_dir: {tmp_path / 'cache'}\n"
    )
    finetune = ["shardwise", "finetune", "--config", str(config)]

    port = str(find_free_port())
    hybrid = str(tmp_path / "hybrid")
    logs = [open(tmp_path / f"node{i}.log", "w") for i in range(2)]
    nodes = [
        _launch(
            [
                "--nnodes",
                "2",
                "--node-rank",
                str(i),
                "--master-addr",
                "127.0.0.1",
                "--master-port",
                port,
                "--nproc-per-node",
                "2",
                *finetune,
                "--num_nodes",
                "2",
                "--sharding_strategy",
                "HYBRID_SHARD",
                "--output_dir",
                hybrid,
            ],
            logs[i],
        )
        for i in range(2)
    ]
    # The reference, started beside the nodes (its start-up fills their rendezvous and collective waits): one
    # process with the same global batch (4 ranks' micro-batches as 4 accumulated ones; the loss is normalised
    # over the step's global target tokens, so the steps are the same as 4 FULL_SHARD ranks').
    single = str(tmp_path / "single")
    logs.append(open(tmp_path / "single.log", "w"))
    one = [*finetune, "--devices", "1", "--gradient_accumulation_steps", "4", "--output_dir", single]
    nodes.append(subprocess.Popen(one, env=_env(), stdout=logs[-1], stderr=subprocess.STDOUT))
    _wait(nodes, logs)

    got, want = _losses(hybrid), _losses(single)
    assert len(got) == len(want) == 6
    assert got == pytest.approx(want, rel=1e-5, abs=1e-6)
    assert got[-1] < got[0]
    # both runs exported a Hugging Face folder with identical weights
    from safetensors.torch import load_file

    a, b = load_file(os.path.join(hybrid, "model.safetensors")), load_file(os.path.join(single, "model.safetensors"))
    assert set(a) == set(b)
    for name in a:
        assert (a[name] - b[name]).abs().max() < 1e-5, name
    # Five processes on two "nodes" sharing the hub cache: one download of each file (the others waited for it).
    assert all(hub.file_gets(f) == 1 for f in ("model.safetensors", "config.json", "train.jsonl")), hub.log
    hub.__exit__()

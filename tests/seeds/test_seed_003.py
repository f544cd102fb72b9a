"""Seed 003, fine-tuning Llama 2 70B with FSDP: its command line as printed, on a tiny Llama and data set
served under the seed's hub names by a hub on 127.0.0.1 (tests/helpers/hub_server.py), uploaded back to it.

`accelerate launch --config_file fsdp_config.yaml --num_processes 16 --num_machines 2 ... train.py <flags>`
becomes `shardwise finetune --fsdp_config fsdp_config.yaml --num_processes 2 --num_machines 1 <flags>`;
the train.py flags are passed unchanged except sizes (500 steps -> 2, 2048 tokens -> 32, ...), with the
seed's `--model_name meta-llama/Llama-2-70b-chat-hf --dataset_name smangrul/code-chat-assistant-v1` and
`--push_to_hub --hub_private_repo True --hub_strategy every_save`. Its `--optim paged_adamw_32bit` runs
bitsandbytes' CPU kernels on the FSDP shards.
"""

from __future__ import annotations

import hashlib
import json
import math
import os

import pytest

from helpers.hf import ACCELERATE_FSDP_YAML, build_model_folder, chat_records, seed_records, train_args, write_jsonl
from helpers.hub_server import HubServer, folder_files, point_at

pytest.importorskip("transformers")
pytest.importorskip("bitsandbytes")


@pytest.mark.slow
def test_seed_003_command_line(tmp_path, capsys, monkeypatch):
    from shardwise.cli import main as shardwise_main

    def main(argv):
        return shardwise_main(["finetune", *argv])

    model = build_model_folder(str(tmp_path / "Llama-2-70b-chat-hf"), chat_records(20), max_positions=64)
    os.makedirs(tmp_path / "data")
    data = write_jsonl(str(tmp_path / "data" / "train.jsonl"), seed_records(40))
    hub = HubServer(token="hf_seed").__enter__()
    hub.add_repo("meta-llama/Llama-2-70b-chat-hf", folder_files(model))
    hub.add_repo("smangrul/code-chat-assistant-v1", folder_files(os.path.dirname(data)), repo_type="dataset")
    point_at(monkeypatch, hub, str(tmp_path / "hf"))
    monkeypatch.setenv("HF_TOKEN", "hf_seed")
    model, data = "meta-llama/Llama-2-70b-chat-hf", "smangrul/code-chat-assistant-v1"
    config = tmp_path / "fsdp_config.yaml"
    config.write_text(ACCELERATE_FSDP_YAML.format(machines=2, processes=16))
    out = str(tmp_path / "full-finetune-llama-chat-asst")
    # The launcher's flags (this machine: one node, two processes), then train.py's.
    argv = ["--fsdp_config", str(config), "--num_processes", "2", "--num_machines", "1"]
    argv += train_args(model, data, out, max_steps=2, eval_steps=1, save_steps=2, logging_steps=1, max_seq_len=32)
    assert main(argv) == 0
    err = capsys.readouterr().err
    for flag in ("--log_level", "fsdp_sync_module_states", "fsdp_use_orig_params"):
        assert flag in err, (flag, err)
    history = json.load(open(os.path.join(out, "finetune_history.json")))
    assert [h["step"] for h in history["losses"]] == [1, 2]
    assert all(math.isfinite(h["loss"]) for h in history["losses"]) and history["eval_losses"]
    assert os.path.isfile(os.path.join(out, "config.json"))  # the consolidated Hugging Face folder
    assert os.path.isdir(os.path.join(out, "checkpoints"))  # --save_steps 2

    # Each file of the snapshots was fetched once, by the process the user started; its two workers read them.
    assert all(hub.file_gets(f) == 1 for f in ("model.safetensors", "config.json", "train.jsonl")), hub.log
    # Uploaded (bare name: the token's namespace): every file of the export, byte for byte, and the checkpoint.
    pushed = hub.files("tester/full-finetune-llama-chat-asst")
    exported = [f for f in os.listdir(out) if f.endswith((".json", ".safetensors")) and f != "finetune_history.json"]
    assert "model.safetensors" in exported or "model.safetensors.index.json" in exported
    for name in exported:
        with open(os.path.join(out, name), "rb") as fh:
            assert hashlib.sha256(pushed[name]).digest() == hashlib.sha256(fh.read()).digest(), name
    assert any(f.startswith("last-checkpoint/") for f in pushed), sorted(pushed)
    assert hub.repos[("model", "tester/full-finetune-llama-chat-asst")].private
    hub.__exit__()

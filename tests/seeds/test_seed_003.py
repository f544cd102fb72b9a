"""Seed 003, fine-tuning Llama 2 70B with FSDP: its command line as printed, on a tiny local Llama.

`accelerate launch --config_file fsdp_config.yaml --num_processes 16 --num_machines 2 ... train.py <flags>`
becomes `shardwise finetune --fsdp_config fsdp_config.yaml --num_processes 2 --num_machines 1 <flags>`;
the train.py flags are passed unchanged except model / dataset paths and sizes (500 steps -> 2, 2048
tokens -> 32, ...). Its `--optim paged_adamw_32bit` runs bitsandbytes' CPU kernels on the FSDP shards.
"""

from __future__ import annotations

import json
import math
import os

import pytest

from helpers.hf import ACCELERATE_FSDP_YAML, build_model_folder, chat_records, seed_records, train_args, write_jsonl

pytest.importorskip("transformers")
pytest.importorskip("bitsandbytes")


@pytest.mark.slow
def test_seed_003_command_line(tmp_path, capsys):
    from shardwise.cli import main as shardwise_main

    def main(argv):
        return shardwise_main(["finetune", *argv])

    model = build_model_folder(str(tmp_path / "Llama-2-70b-chat-hf"), chat_records(20), max_positions=64)
    data = write_jsonl(str(tmp_path / "code-chat-assistant-v1.jsonl"), seed_records(40))
    config = tmp_path / "fsdp_config.yaml"
    config.write_text(ACCELERATE_FSDP_YAML.format(machines=2, processes=16))
    out = str(tmp_path / "full-finetune-llama-chat-asst")
    # The launcher's flags (this machine: one node, two processes), then train.py's.
    argv = ["--fsdp_config", str(config), "--num_processes", "2", "--num_machines", "1"]
    argv += train_args(model, data, out, max_steps=2, eval_steps=1, save_steps=2, logging_steps=1, max_seq_len=32)
    assert main(argv) == 0
    err = capsys.readouterr().err
    for flag in ("--push_to_hub", "--log_level", "fsdp_sync_module_states", "fsdp_use_orig_params"):
        assert flag in err, (flag, err)
    history = json.load(open(os.path.join(out, "finetune_history.json")))
    assert [h["step"] for h in history["losses"]] == [1, 2]
    assert all(math.isfinite(h["loss"]) for h in history["losses"]) and history["eval_losses"]
    assert os.path.isfile(os.path.join(out, "config.json"))  # the consolidated Hugging Face folder
    assert os.path.isdir(os.path.join(out, "checkpoints"))  # --save_steps 2

"""`shardwise finetune` reads the HF recipe's flags and an Accelerate FSDP config (issue 12, item 4).

All at validate_config level: no worker starts. The end-to-end run of the
same command line is tests/seeds/test_seed_003.py.
"""

from __future__ import annotations

import json

import pytest
import torch

from shardwise.cli.finetune import parser as build_parser
from shardwise.recipes.finetune import FinetuneConfig, validate_config
from shardwise.recipes.hf_args import map_accelerate_config, translate_argv

from helpers.hf import ACCELERATE_FSDP_YAML, build_model_folder, chat_records, seed_records, train_args, write_jsonl


@pytest.fixture(scope="module")
def assets(tmp_path_factory):
    root = tmp_path_factory.mktemp("ft-flags")
    model = build_model_folder(str(root / "model"), chat_records(20), max_positions=64)
    return {"root": root, "model": model, "data": write_jsonl(str(root / "chat.jsonl"), seed_records())}


def _config(argv):
    translated, notes = translate_argv(argv)
    ns = build_parser().parse_args(translated)
    return FinetuneConfig(**{k: v for k, v in ns.as_dict().items() if k != "config"}), notes


def test_the_recipes_command_line_maps_to_our_options(assets, tmp_path):
    pytest.importorskip("bitsandbytes")  # --optim paged_adamw_32bit
    cfg_file = tmp_path / "fsdp_config.yaml"
    cfg_file.write_text(ACCELERATE_FSDP_YAML.format(machines=1, processes=2))
    argv = ["--fsdp_config", str(cfg_file)] + train_args(assets["model"], assets["data"], str(tmp_path / "out"))
    cfg, notes = _config(argv)
    assert (cfg.model_path, cfg.data.dataset, cfg.data.dataset_text_field) == (
        assets["model"],
        assets["data"],
        "content",
    )
    assert (cfg.precision, cfg.timeout_s, cfg.optim, cfg.seed) == ("bf16-mixed", 5400.0, "paged_adamw_32bit", 100)
    assert cfg.gradient_checkpointing and cfg.data.packing and not cfg.data.add_special_tokens
    assert not cfg.data.append_concat_token
    assert (cfg.eval_steps, cfg.save_steps, cfg.logging_steps, cfg.max_steps) == (1, 2, 1, 2)
    assert (cfg.strategy, cfg.sharding_strategy, cfg.state_dict_type, cfg.cpu_offload) == (
        "fsdp",
        "FULL_SHARD",
        "sharded",
        False,
    )
    assert (cfg.devices, cfg.num_nodes) == (2, 1)
    if not torch.cuda.is_available():
        assert cfg.attn_implementation == "sdpa"
        assert any(n.startswith("--use_flash_attn True: flash-attn kernels are CUDA-only") for n in notes)
    # Each name it cannot honour is said once, in one line; the ones it does honour say nothing.
    assert sum(n.startswith("--log_level:") for n in notes) == 1, notes
    # The upload flags are honoured as HF's Trainer means them (the seed test uploads to a local hub).
    assert (cfg.push_to_hub, cfg.hub_private_repo, cfg.hub_strategy) == (True, True, "every_save")
    assert not any(n.startswith(("--push_to_hub", "--hub_")) for n in notes), notes
    for name in (
        "fsdp_sync_module_states",
        "fsdp_use_orig_params",
        "fsdp_cpu_ram_efficient_loading",
        "fsdp_forward_prefetch",
        "fsdp_backward_prefetch_policy",
    ):
        assert sum(f": {name}=" in n for n in notes) == 1, (name, notes)
    quiet = ("--use_reentrant", "--splits", "--logging_strategy", "--evaluation_strategy", "--save_strategy")
    assert not any(n.split(":")[0].split(" ")[0] in quiet for n in notes), notes
    assert all("\n" not in n for n in notes)
    validate_config(cfg)


def test_accelerate_config_keys():
    raw = {
        "distributed_type": "FSDP",
        "mixed_precision": "bf16",
        "num_machines": 2,
        "num_processes": 16,
        "machine_rank": 1,
        "main_process_ip": "10.0.0.1",
        "main_process_port": 29500,
        "fsdp_config": {
            "fsdp_sharding_strategy": "HYBRID_SHARD",
            "fsdp_offload_params": True,
            "fsdp_state_dict_type": "FULL_STATE_DICT",
            "fsdp_auto_wrap_policy": "TRANSFORMER_BASED_WRAP",
            "fsdp_transformer_layer_cls_to_wrap": "LlamaDecoderLayer",
            "fsdp_activation_checkpointing": True,
            "fsdp_wibble": 3,
        },
    }
    out, notes = map_accelerate_config(raw, source="cfg.yaml")
    assert out == {
        "strategy": "fsdp",
        "precision": "bf16-mixed",
        "num_nodes": 2,
        "_num_processes": 16,
        "sharding_strategy": "HYBRID_SHARD",
        "auto_wrap_policy": ["LlamaDecoderLayer"],
        "cpu_offload": True,
        "state_dict_type": "full",
        "gradient_checkpointing": True,
    }
    assert any("machine_rank, main_process_ip, main_process_port are the launcher's" in n for n in notes)
    assert any("fsdp_wibble is not understood" in n for n in notes)
    # Accelerate's numbers and the ZeRO-2 flavour of hybrid sharding; size-based wrapping is named, not honoured.
    out, notes = map_accelerate_config(
        {
            "distributed_type": "FSDP",
            "fsdp_config": {
                "fsdp_sharding_strategy": 5,
                "fsdp_auto_wrap_policy": "SIZE_BASED_WRAP",
                "fsdp_min_num_params": 100000,
            },
        }
    )
    assert out["sharding_strategy"] == "HYBRID_SHARD" and out["strategy_options"] == {"reshard_after_forward": False}
    assert any("SIZE_BASED_WRAP (min_num_params=100000) is not honoured" in n for n in notes)
    out, _ = map_accelerate_config(
        {"distributed_type": "DEEPSPEED", "deepspeed_config": {"zero_stage": 3, "offload_optimizer_device": "cpu"}}
    )
    assert out["strategy"] == "deepspeed_stage_3_offload"
    # num_processes is accelerate's total over machines; devices is per node.
    argv, _ = translate_argv(["--num_processes", "16", "--num_machines", "2", "--fsdp", "shard_grad_op auto_wrap"])
    assert argv[argv.index("--devices") + 1] == "8" and argv[argv.index("--num_nodes") + 1] == "2"
    assert argv[argv.index("--sharding_strategy") + 1] == "SHARD_GRAD_OP"


def test_flags_it_cannot_follow_fail_with_the_fix():
    with pytest.raises(ValueError, match="--logging_strategy epoch: .*--logging_steps N"):
        translate_argv(["--logging_strategy", "epoch"])
    with pytest.raises(ValueError, match="--splits 'a,b,c'.*--splits train,test"):
        translate_argv(["--splits", "a,b,c"])
    with pytest.raises(FileNotFoundError, match="does not exist"):
        translate_argv(["--fsdp_config", "/nonexistent.yaml"])
    # Our own names pass through, and jsonargparse still names a misspelt flag.
    argv, notes = translate_argv(
        ["--model_path", "m", "--learning_rate", "1e-5", "--strategy_options", json.dumps({"limit_all_gathers": True})]
    )
    assert argv[:4] == ["--model_path", "m", "--learning_rate", "1e-5"] and not notes
    with pytest.raises(SystemExit):
        build_parser().parse_args(translate_argv(["--use_flash_atn", "True"])[0])


def test_a_flat_data_option_in_python_names_where_it_goes():
    # Flags and YAML take `max_seq_len` flat; in Python it belongs in DataOptions, and the error says so
    # instead of Python's bare "unexpected keyword argument".
    from shardwise.recipes.finetune import DataOptions

    with pytest.raises(TypeError, match=r"FinetuneConfig\(data=DataOptions\(dataset='chat.jsonl', max_seq_len=64\)\)"):
        FinetuneConfig(model_path="m", dataset="chat.jsonl", max_seq_len=64)
    cfg = FinetuneConfig(model_path="m", data=DataOptions(dataset="chat.jsonl", max_seq_len=64))
    assert (cfg.data.dataset, cfg.data.max_seq_len) == ("chat.jsonl", 64)

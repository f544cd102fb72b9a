# Every configuration mistake the fine-tuning recipe can see up front fails in
# the calling process, before any worker starts or any weight is read, with a
# message that says what to do instead.
from __future__ import annotations

import os
import shutil

import pytest
import torch

from shardwise.cli import main as shardwise_main
from shardwise.recipes.causal_lm import lr_lambda
from shardwise.recipes.data import DatasetFieldError
from shardwise.recipes.finetune import coerce_config, finetune, validate_config
from shardwise.recipes.hf_model import ModelFolderError

from helpers.hf import build_model_folder, chat_records, write_jsonl


@pytest.fixture(scope="module")
def assets(tmp_path_factory):
    root = tmp_path_factory.mktemp("ft-errors")
    records = chat_records(20)
    model = build_model_folder(str(root / "model"), records, max_positions=64)
    return {"root": root, "model": model, "data": write_jsonl(str(root / "chat.jsonl"), records)}


def _cfg(assets, **changes):
    base = dict(
        model_path=assets["model"],
        dataset=assets["data"],
        max_seq_len=32,
        max_steps=2,
        output_dir=str(assets["root"] / "out"),
    )
    base.update(changes)
    return coerce_config(base)


def test_valid_config_passes(assets):
    checked = validate_config(_cfg(assets))
    assert checked["text_field"] == "messages" and checked["folder"].max_positions == 64


def test_model_folder_without_weights(assets, tmp_path):
    folder = tmp_path / "no-weights"
    shutil.copytree(assets["model"], folder)
    os.remove(folder / "model.safetensors")
    torch.save({}, folder / "pytorch_model.bin")
    with pytest.raises(ModelFolderError, match=r"no weights .*pytorch_model.bin.*convert them to safetensors"):
        finetune(_cfg(assets, model_path=str(folder)))


def test_model_folder_without_config(assets, tmp_path):
    folder = tmp_path / "no-config"
    shutil.copytree(assets["model"], folder)
    os.remove(folder / "config.json")
    with pytest.raises(ModelFolderError, match="has no config.json"):
        finetune(_cfg(assets, model_path=str(folder)))
    with pytest.raises(ModelFolderError, match="is not a folder"):
        finetune(_cfg(assets, model_path=str(tmp_path / "nowhere")))


def test_dataset_field_that_does_not_exist_lists_the_fields(assets):
    with pytest.raises(DatasetFieldError, match=r"dataset_text_field='content'.*\['messages', 'id'\]"):
        finetune(_cfg(assets, dataset_text_field="content"))


def test_sequence_length_above_the_model_maximum(assets):
    with pytest.raises(ValueError, match=r"max_seq_len=128 exceeds the model's maximum of 64 positions"):
        finetune(_cfg(assets, max_seq_len=128))


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the no-CUDA error")
def test_flash_attention_without_cuda(assets):
    with pytest.raises(ValueError, match=r"flash_attention_2' needs a CUDA GPU.*attn_implementation='sdpa'"):
        finetune(_cfg(assets, attn_implementation="flash_attention_2"))


def test_paged_adamw_needs_bitsandbytes_not_cuda(assets):
    # bitsandbytes' CPU kernels run it unpaged; under FSDP it steps on the local shards.
    import importlib.util

    if importlib.util.find_spec("bitsandbytes") is None:
        with pytest.raises(ValueError, match=r"paged_adamw_32bit' needs the bitsandbytes package"):
            validate_config(_cfg(assets, optim="paged_adamw_32bit"))
    else:
        validate_config(_cfg(assets, optim="paged_adamw_32bit"))


def test_other_option_errors(assets):
    with pytest.raises(ValueError, match="lr_scheduler_type"):
        validate_config(_cfg(assets, lr_scheduler_type="exponential"))
    with pytest.raises(ValueError, match="strategy='fsdp3'.*deepspeed_stage_3"):
        validate_config(_cfg(assets, strategy="fsdp3"))
    with pytest.raises(ValueError, match="unknown finetune option"):
        coerce_config({"model_path": "x", "use_flash_atn": True})
    with pytest.raises(ValueError, match=r"unknown data option\(s\) \['max_seq_lenn'\]"):
        coerce_config({"model_path": "x", "data": {"max_seq_lenn": 64}})
    # A flat data option overrides the same one under `data`, as the flags do.
    data = coerce_config({"data": {"max_seq_len": 8, "packing": False}, "max_seq_len": 64}).data
    assert (data.max_seq_len, data.packing) == (64, False)
    with pytest.raises(RuntimeError, match="shardwise launch --nnodes 2"):
        finetune(_cfg(assets, num_nodes=2, devices=1))


def test_cli_reports_the_error_and_exits_2(assets, capsys, tmp_path):
    config = tmp_path / "run.yaml"
    config.write_text(f"model_path: {assets['model']}\ndataset: {assets['data']}\nmax_seq_len: 32\n")
    assert shardwise_main(["finetune", "--config", str(config), "--dataset_text_field", "prompt"]) == 2
    assert "fields are ['messages', 'id']" in capsys.readouterr().err


def test_lr_schedules():
    cosine = lr_lambda(10, 2, "cosine")
    assert [cosine(s) for s in (0, 1, 2)] == [0.0, 0.5, 1.0] and abs(cosine(10)) < 1e-9
    assert lr_lambda(10, 0, "linear")(5) == 0.5 and lr_lambda(10, 0, "constant")(9) == 1.0


def test_flash_attention_with_fp32_is_refused_before_any_worker(assets, monkeypatch):
    from shardwise.recipes import finetune as recipe_module

    monkeypatch.setattr(recipe_module, "launch", lambda *a, **k: pytest.fail("a worker was started"))
    for precision in ("32-true", "64-true"):
        with pytest.raises(
            ValueError,
            match=rf"flash_attention_2' with precision='{precision}'.*"
            r"precision='bf16-mixed'.*attn_implementation='sdpa'",
        ):
            finetune(_cfg(assets, attn_implementation="flash_attention_2", precision=precision, devices=2))


def test_flash_attention_on_a_gpu_older_than_ampere(assets, monkeypatch):
    import sys
    import types

    from shardwise.recipes import finetune as recipe

    monkeypatch.setattr(recipe, "_has_cuda", lambda cfg: True)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda *a: (7, 5))
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda *a: "Tesla T4")
    monkeypatch.setitem(sys.modules, "flash_attn", types.ModuleType("flash_attn"))
    with pytest.raises(ValueError, match=r"compute capability 8.0 or newer.*Tesla T4 is 7.5.*'sdpa'"):
        validate_config(_cfg(assets, attn_implementation="flash_attention_2", precision="bf16-mixed"))

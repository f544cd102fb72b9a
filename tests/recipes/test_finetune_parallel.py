"""`shardwise finetune --tp_size N --sp_size N`: the refusals up front, and the same losses at every layout.

The refusals run in this process, as validate_config does before any worker
starts: each names the fix. The acceptance run fine-tunes a tiny local Llama
on packed chat data in fp32 for 5 steps with the same global batch (4
blocks of 32 tokens) on 1 process, then on 2 with sp_size 2 and on 2 with
tp_size 2 (one launch, shared with other recipe files: tests/recipes/conftest.py):
the per-step losses agree with one process's within 1e-4 relative. In the same launch the tp 2 run's step-3
checkpoint resumes as 2-way FSDP within 1e-5. The fourth layout of the acceptance, 4 processes
as FSDP x sp 2, shares its launch with the resume test
(tests/distributed/test_parallel_resume.py), which compares it with one
process the same way.
"""

from __future__ import annotations

import pytest

from shardwise.recipes.finetune import coerce_config, finetune, validate_config

from helpers.hf import build_model_folder, build_tokenizer, chat_records, write_jsonl


def _assets(root):
    records = chat_records(64)
    words = len(build_tokenizer([m["content"] for r in records for m in r["messages"]]))
    return {
        "root": root,
        "records": records,
        # 4 attention heads, 2 key/value heads: tp / sp 2 split them, 4 does not split the kv heads;
        # the vocabulary padded to a multiple of 4 (tensor parallel splits the output head by it)
        "model": build_model_folder(str(root / "model"), records, max_positions=64, vocab_pad=-words % 4),
        "data": write_jsonl(str(root / "chat.jsonl"), records),
    }


@pytest.fixture(scope="module")
def assets(tmp_path_factory):
    return _assets(tmp_path_factory.mktemp("ft-parallel"))


def _edited_model(assets, path, **config_changes):
    """A copy of the model folder whose config.json says something else (the refusals read only it)."""
    import json
    import shutil

    shutil.copytree(assets["model"], path)
    config = json.loads((path / "config.json").read_text())
    config.update(config_changes)
    (path / "config.json").write_text(json.dumps(config))
    return str(path)


def _cfg(assets, **changes):
    base = dict(
        model_path=assets["model"],
        dataset=assets["data"],
        max_seq_len=32,
        max_steps=2,
        precision="32-true",
        accelerator="cpu",
        devices=2,
        output_dir=str(assets["root"] / "out"),
    )
    base.update(changes)
    return coerce_config(base)


def test_tp_and_sp_build_one_fsdp_strategy(assets, tmp_path):
    from shardwise.recipes.parallel import build_recipe_strategy
    from shardwise.strategies import FSDPStrategy

    folder = validate_config(_cfg(assets, sp_size=2))["folder"]
    # tp 2 x sp 2 splits the key/value heads over 4 ranks: this model's 2 cannot be, one with 4 can.
    with pytest.raises(ValueError, match=r"sp_size=2 does not divide the model's 2 key/value heads \(per tp_size=2"):
        build_recipe_strategy(_cfg(assets, tp_size=2, sp_size=2, devices=4), folder)
    four_kv = _edited_model(assets, tmp_path / "kv4", num_key_value_heads=4)
    four_kv_folder = validate_config(_cfg(assets, model_path=four_kv))["folder"]
    for changes, dims, model in (
        (dict(sp_size=2), (1, 2), folder),
        (dict(tp_size=2), (2, 1), folder),
        (dict(sp_size=2, devices=4), (1, 2), folder),
        (dict(tp_size=2, sp_size=2, devices=4, model_path=four_kv), (2, 2), four_kv_folder),
    ):
        strategy = build_recipe_strategy(_cfg(assets, **changes), model)
        assert isinstance(strategy, FSDPStrategy)
        assert (strategy.tp_size, strategy.sp_size) == dims
        assert (strategy.parallel_plan.tp, strategy.parallel_plan.sp) == dims
    # unpacked batches are padded up to a multiple of sp_size: any max_seq_len works
    validate_config(_cfg(assets, sp_size=2, max_seq_len=31, packing=False))
    with pytest.raises(ValueError, match=r"strategy_options\['sp_size'\].*set sp_size: 2"):
        build_recipe_strategy(_cfg(assets, strategy_options={"sp_size": 2}), folder)


@pytest.mark.parametrize(
    "changes,message",
    [
        (dict(tp_size=0), r"tp_size=0: use a positive integer"),
        (dict(sp_size=2, devices=3), r"tp_size x sp_size = 2 does not divide the 3 processes.*multiple of 2"),
        (dict(tp_size=2, sp_size=2, devices=2), r"= 4 does not divide the 2 processes"),
        (dict(sp_size=4, devices=4), r"sp_size=4 does not divide the model's 2 key/value heads.*\[1, 2\]"),
        (dict(tp_size=3, devices=3), r"tp_size=3 does not divide the model's 4 attention heads.*\[1, 2\]"),
        (dict(sp_size=2, max_seq_len=31), r"sp_size=2 does not divide max_seq_len=31.*max_seq_len=30"),
        (dict(tp_size=2, strategy="deepspeed_stage_3"), r"ZeRO .*Use strategy='fsdp'"),
        (dict(sp_size=2, strategy="zero2"), r"ZeRO .*Use strategy='fsdp'"),
        (dict(sp_size=2, strategy="ddp"), r"dimensions of the FSDP strategy's mesh. Use strategy='fsdp'"),
        (dict(tp_size=2, strategy="auto"), r"Use strategy='fsdp'"),
        (dict(tp_size=2, cpu_offload=True), r"tp_size=2 with cpu_offload.*Drop cpu_offload"),
        (dict(tp_size=2, strategy="fsdp_cpu_offload"), r"with cpu_offload.*Drop cpu_offload"),
        (dict(tp_size=2, lora_r=4), r"tp_size=2 with lora_r=4 \(LoRA\).*Use sp_size or FSDP alone"),
        (dict(tp_size=2, torch_compile=True), r"torch_compile with tp_size=2.*Drop torch_compile"),
        (dict(sp_size=2, torch_compile=True), r"torch_compile with sp_size=2"),
    ],
)
def test_refused_before_any_worker_with_the_fix(assets, changes, message):
    with pytest.raises(ValueError, match=message):
        validate_config(_cfg(assets, **changes))


def test_flash_attention_under_sp_is_refused(assets):
    # Checked on the config alone (no CUDA needed to say it cannot work).
    from shardwise.recipes.parallel import check_parallel

    cfg = _cfg(assets, sp_size=2, attn_implementation="flash_attention_2")
    folder = validate_config(_cfg(assets))["folder"]
    with pytest.raises(ValueError, match=r"flash_attention_2.*Use attn_implementation='sdpa'"):
        check_parallel(cfg, folder)


@pytest.mark.parametrize(
    "config_changes,changes,message",
    [
        (dict(base_model_tp_plan=None), dict(tp_size=2), r"declares no tensor-parallel plan.*Use sp_size"),
        (dict(tie_word_embeddings=True), dict(tp_size=2), r"ties its output head.*Use sp_size or FSDP alone"),
        (
            dict(base_model_tp_plan={"layers.*.mlp.up_proj": "local_colwise"}),
            dict(tp_size=2),
            r"styles shardwise does not translate \(layers.\*.mlp.up_proj: local_colwise",
        ),
        (dict(intermediate_size=129), dict(tp_size=2), r"tp_size=2 does not divide the model's intermediate_size=129"),
        (dict(vocab_size=101), dict(tp_size=2), r"vocab_size=101.*pad the vocabulary"),
        (dict(attention_dropout=0.1), dict(sp_size=2), r"attention_dropout=0.1.*attention_dropout=0"),
        (dict(sliding_window=16), dict(sp_size=2), r"max_seq_len=32: .* sliding window of 16"),
    ],
)
def test_what_the_model_folder_cannot_split_is_refused(assets, tmp_path, config_changes, changes, message):
    model = _edited_model(assets, tmp_path / "edited", **config_changes)
    with pytest.raises(ValueError, match=message):
        validate_config(_cfg(assets, model_path=model, **changes))


# ------------------------------------------------------------------ the same losses at every layout
STEPS = 5
GLOBAL_BATCH = 4  # packed 32-token blocks per optimizer step, at every layout


def _run_config(assets, name, **changes):
    """fp32, constant LR, the default clipping (max_grad_norm 1.0): only the layout changes between runs."""
    return _cfg(
        assets,
        max_steps=STEPS,
        learning_rate=3e-3,
        lr_scheduler_type="constant",
        eval_split_ratio=0.0,
        logging_steps=1,
        seed=3,
        cache_dir=str(assets["root"] / "tokenized"),
        output_dir=str(assets["root"] / name),
        **changes,
    )


def _losses_at_two_layouts(sp2, tp2):
    """In 2 launched processes, in turn: sp 2, tp 2 (a checkpoint at step 3), and that checkpoint resumed as
    2-way FSDP; rank 0's per-step losses of each."""
    import dataclasses
    import os

    from shardwise.checkpoint import layout

    out = {"sp2": finetune(sp2).losses, "tp2": finetune(tp2).losses}
    step3 = layout.latest_checkpoint(os.path.join(tp2.output_dir, "checkpoints"))
    as_fsdp = dataclasses.replace(
        tp2,
        tp_size=1,
        save_steps=None,
        output_dir=tp2.output_dir + "-as-fsdp",
        resume_from_checkpoint=step3,
        data=dataclasses.replace(tp2.data, per_device_train_batch_size=GLOBAL_BATCH // 2),
    )
    out["tp2_resumed_as_fsdp"] = finetune(as_fsdp).losses
    return {name: [s["loss"] for s in losses] for name, losses in out.items()}


def shared_launch(root):
    """For tests/recipes/conftest.py: the assets, and the worker that trains on them with its arguments."""
    assets = _assets(root)
    sp2 = _run_config(assets, "sp2", devices=2, sp_size=2, per_device_train_batch_size=GLOBAL_BATCH)
    tp2 = _run_config(assets, "tp2", devices=2, tp_size=2, per_device_train_batch_size=GLOBAL_BATCH, save_steps=3)
    return assets, _losses_at_two_layouts, (sp2, tp2)


@pytest.fixture(scope="module")
def layouts(recipe_runs):
    # The 2-process runs are in the recipe files' shared launch (tests/recipes/conftest.py).
    assets, ranks = recipe_runs[__name__]
    one = finetune(_run_config(assets, "one", devices=1, per_device_train_batch_size=GLOBAL_BATCH))
    return {"one": [s["loss"] for s in one.losses], **ranks[0]}


@pytest.mark.slow
@pytest.mark.parametrize("layout", ["sp2", "tp2"])
def test_per_step_losses_match_one_process(layouts, layout):
    one = layouts["one"]
    assert len(one) == STEPS and one[-1] < one[0]  # it trains
    assert layouts[layout] == pytest.approx(one, rel=1e-4), layout


@pytest.mark.slow
def test_a_tp_checkpoint_resumes_as_fsdp(layouts):
    # DCP reads the (dp, tp) DTensor shards into 2-way FSDP's; steps 1-3 travel in the checkpoint
    tp2, resumed = layouts["tp2"], layouts["tp2_resumed_as_fsdp"]
    assert resumed[:3] == tp2[:3]
    assert resumed[3:] == pytest.approx(tp2[3:], rel=1e-5, abs=1e-5)


# ------------------------------------------------------------------ spellings: CLI, Accelerate, shardwise fit
def test_cli_flags_reach_the_config(assets):
    from shardwise.cli import finetune as cli

    argv = cli.translate(["--model_path", assets["model"], "--dataset", assets["data"], "--tp_size", "2"])
    cfg = cli.parser().parse_args(argv + ["--sp_size", "2"])
    assert (cfg.tp_size, cfg.sp_size) == (2, 2)


def test_accelerate_parallelism_config_is_read(tmp_path):
    from shardwise.recipes.hf_args import read_accelerate_config, translate_argv

    path = tmp_path / "accelerate.yaml"
    path.write_text(
        "distributed_type: FSDP\nnum_processes: 8\nfsdp_config: {fsdp_version: 2}\n"
        "parallelism_config:\n  parallelism_config_dp_replicate_size: 1\n  parallelism_config_dp_shard_size: 2\n"
        "  parallelism_config_tp_size: 2\n  parallelism_config_cp_size: 2\n"
        "  parallelism_config_cp_comm_strategy: alltoall\n"
    )
    values, notes = read_accelerate_config(str(path))
    assert values["tp_size"] == 2 and values["sp_size"] == 2 and values["strategy"] == "fsdp"
    assert any("cp_size=2 (torch context parallel) runs as sp_size=2" in n for n in notes)
    assert any("cp_comm_strategy=alltoall has nothing to do here" in n for n in notes)
    argv, notes = translate_argv(["--parallelism_config_sp_size", "4", "--parallelism_config_dp_replicate_size", "2"])
    assert argv[argv.index("--sp_size") + 1] == "4"
    assert argv[argv.index("--sharding_strategy") + 1] == "HYBRID_SHARD"
    with pytest.raises(ValueError, match="both sp_size=2 and cp_size=2"):
        translate_argv(["--parallelism_config_sp_size", "2", "--parallelism_config_cp_size", "2"])


def test_shardwise_fit_reaches_the_degrees_through_the_strategy_class():
    # `shardwise fit` takes every Trainer argument; a strategy object is given by its class and arguments.
    from shardwise.cli import fit

    cfg = fit.parser().parse_args(
        [
            "--model",
            "shardwise.demos.LanguageModel",
            "--model.vocab_size",
            "32",
            "--data",
            "shardwise.demos.PythonDocsText",
            "--trainer.strategy",
            "shardwise.strategies.FSDPStrategy",
            "--trainer.strategy.tp_size",
            "2",
            "--trainer.strategy.sp_size",
            "2",
        ]
    )
    strategy = cfg.trainer.strategy
    assert strategy.class_path.endswith("FSDPStrategy")
    assert (strategy.init_args.tp_size, strategy.init_args.sp_size) == (2, 2)

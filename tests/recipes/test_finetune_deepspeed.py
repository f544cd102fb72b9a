# The fine-tuning recipe under DeepSpeed ZeRO, on 2 processes (CPU, gloo; the 2-process runs in the launch
# shared with other recipe files: tests/recipes/conftest.py).
# ZeRO-3: parameters are partitioned as the model is built (zero.Init); the
# recipe's loader fills the partitions from safetensors read by rank 0 only,
# without gathering any parameter, so before any training step the gathered
# weights are exactly the checkpoint's. ZeRO-3 and ZeRO-2 then fine-tune a
# few steps (the loss falls), checkpoint through the engine (save_steps) and
# export a Hugging Face folder whose weights are the live trained ones.
# Plus the configuration errors for strategy names and strategy_options,
# raised before any worker starts.
from __future__ import annotations

import dataclasses
import os

import pytest
import torch

from shardwise.recipes.data import DataOptions
from shardwise.recipes.finetune import FinetuneConfig, coerce_config, finetune, validate_config

from helpers.hf import build_model_folder, chat_records, write_jsonl


def live_weights(module):
    """after_fit hook (every rank): the trained weights, gathered by the strategy's own state-dict path."""
    import torch.distributed as dist

    from shardwise.fqn import canonical_name

    strategy = module.trainer.strategy
    state = strategy.model_state_dict(module)  # ZeRO-3: gathers one module at a time
    out = {canonical_name(k[len("model.") :]): v for k, v in state.items() if k.startswith("model.")}
    return out if dist.get_rank() == 0 else None


def _zero3_load(model_dir):
    """Build and load the recipe's module under ZeRO-3 by hand; compare with the checkpoint before training."""
    import torch.distributed as dist
    from deepspeed.runtime.zero.partition_parameters import ZeroParamStatus
    from safetensors.torch import load_file

    from shardwise.recipes import hf_model
    from shardwise.recipes.finetune import build_module
    from shardwise.strategies.deepspeed import DeepSpeedStrategy

    strategy = DeepSpeedStrategy(stage=3)
    strategy.connect("cpu", "32-true", devices=int(os.environ["WORLD_SIZE"]))
    strategy.configure_training(micro_batch_size=1)
    strategy.setup_environment()
    folder = hf_model.inspect_model_folder(model_dir)
    module = build_module(FinetuneConfig(model_path=model_dir, data=DataOptions(dataset="-")), folder, 1)
    with strategy.module_init_context():
        module.configure_model()
    params = list(module.parameters())
    partitioned = all(hasattr(p, "ds_id") and p.ds_tensor.numel() < p.ds_numel for p in params)
    hook, seen = module.init_weights, []

    def spy() -> None:  # how many parameters are gathered when the strategy hands over to the loader
        seen.append(sum(p.ds_status == ZeroParamStatus.AVAILABLE for p in params))
        hook()

    module.init_weights = spy
    # Count DeepSpeed gathers during set-up: loading must write partitions, never gather a parameter.
    import deepspeed

    real_gather, gathers = deepspeed.zero.GatheredParameters, []

    def counting_gather(params, *args, **kwargs):
        gathers.append(len(params) if isinstance(params, (list, tuple)) else 1)
        return real_gather(params, *args, **kwargs)

    deepspeed.zero.GatheredParameters = counting_gather
    try:
        module = strategy.setup_module(module)
    finally:
        deepspeed.zero.GatheredParameters = real_gather
    state = strategy.model_state_dict(module)
    report = module.load_report
    mismatched = None
    if dist.get_rank() == 0:
        reference = load_file(os.path.join(model_dir, "model.safetensors"))
        mismatched = sorted(k for k in reference if not torch.equal(reference[k], state["model." + k]))
        mismatched += sorted(set("model." + k for k in reference) ^ set(k for k in state if "rotary" not in k))
    inv_freq = dict(module.named_buffers())["model.model.rotary_emb.inv_freq"].clone()
    # No teardown: the process group stays for the fine-tuning runs that follow in this process.
    return dict(
        partitioned=partitioned,
        gathered_at_hook=seen,
        gathers=gathers,
        mismatched=mismatched,
        bytes_read=report.bytes_read,
        tensors=report.tensors,
        inv_freq=inv_freq,
    )


def _runs(model_dir, data, root):
    out = {"load": _zero3_load(model_dir)}
    for stage in (3, 2):
        cfg = FinetuneConfig(
            model_path=model_dir,
            max_steps=8,
            learning_rate=3e-3,
            lr_scheduler_type="constant",
            precision="32-true",
            devices=2,
            strategy=f"deepspeed_stage_{stage}",
            save_steps=4 if stage == 2 else None,
            save_total_limit=2,
            gradient_checkpointing=stage == 2,
            output_dir=os.path.join(root, f"zero{stage}"),
            logging_steps=100,
            seed=3,
            data=DataOptions(
                dataset=data,
                max_seq_len=64,
                per_device_train_batch_size=2,
                eval_split_ratio=0.0,
                cache_dir=os.path.join(root, "cache"),
            ),
        )
        out[stage] = finetune(cfg, after_fit=live_weights)
    # Resume the ZeRO-2 run from its step-4 engine checkpoint: steps 5-8 again.
    ckpts = os.path.join(root, "zero2", "checkpoints")
    step4 = next(os.path.join(ckpts, f) for f in sorted(os.listdir(ckpts)) if "step=4" in f)
    cfg = dataclasses.replace(cfg, output_dir=os.path.join(root, "resumed"), resume_from_checkpoint=step4)
    out["resumed"] = finetune(cfg)
    return out


def shared_launch(root):
    """For tests/recipes/conftest.py: the assets, and the worker that trains on them with its arguments."""
    records = chat_records(120)
    model_dir = build_model_folder(str(root / "tiny-llama"), records)
    data = write_jsonl(str(root / "chat.jsonl"), records)
    return model_dir, _runs, (model_dir, data, str(root))


@pytest.mark.slow
def test_zero3_and_zero2_load_from_rank0_finetune_and_export(recipe_runs):
    from transformers import AutoModelForCausalLM

    # The 2-process runs are in the recipe files' shared launch (tests/recipes/conftest.py), the first there.
    model_dir, ranks = recipe_runs[__name__]
    results = ranks[0]

    # ZeRO-3 loading, before any step: partitioned from the start, the loader
    # got the parameters still partitioned and wrote the partitions without
    # gathering any parameter, only rank 0 read the file, and every weight is
    # the checkpoint's.
    load = results["load"]
    assert load["partitioned"] and load["gathered_at_hook"] == [0]
    assert load["gathers"] == [] and ranks[1]["load"]["gathers"] == []
    assert load["mismatched"] == []
    assert load["bytes_read"] > 0 and ranks[1]["load"]["bytes_read"] == 0
    assert ranks[1]["load"]["tensors"] == load["tensors"] > 0
    reference = AutoModelForCausalLM.from_pretrained(model_dir)
    torch.testing.assert_close(load["inv_freq"], reference.model.rotary_emb.inv_freq)  # recomputed buffer

    original = reference.state_dict()
    for stage in (3, 2):
        result = results[stage]
        losses = [s["loss"] for s in result.losses]
        assert len(losses) == 8
        assert sum(losses[-3:]) / 3 < 0.8 * sum(losses[:3]) / 3, (stage, losses)
        assert result.load["bytes_read"] > 0 and ranks[1][stage].load["bytes_read"] == 0
        trained = result.extra
        exported = AutoModelForCausalLM.from_pretrained(result.output_dir).state_dict()
        assert set(trained) == set(original) and set(exported) == set(original)
        for name, value in trained.items():
            assert torch.equal(exported[name], value), (stage, name)
        assert not torch.equal(
            exported["model.layers.0.mlp.up_proj.weight"], original["model.layers.0.mlp.up_proj.weight"]
        )
    # save_steps went through the engine's own checkpoint format, and resuming
    # from step 4 continues the same loss curve.
    ckpt = os.path.join(results[2].output_dir, "checkpoints", "last.ckpt")
    assert os.path.isdir(os.path.join(ckpt, "engine")), os.listdir(os.path.dirname(ckpt))
    resumed = results["resumed"].losses
    assert [s["step"] for s in resumed] == [1, 2, 3, 4, 5, 6, 7, 8]  # steps 1-4 from the checkpoint's history
    assert [s["loss"] for s in resumed] == pytest.approx([s["loss"] for s in results[2].losses], rel=1e-5)


def _zero3_load_without_fp16(model_dir):
    # As DeepSpeed's CPU accelerator says on CPUs without AVX512-FP16 (AMD EPYC): the case in which
    # DeepSpeed 0.19 built bf16 partitions for an fp32 run, whatever dtype zero.Init was given.
    from deepspeed.accelerator import get_accelerator

    get_accelerator().is_fp16_supported = lambda: False
    return _zero3_load(model_dir)


@pytest.mark.parametrize("devices", [1, 3])
def test_zero3_load_equals_the_file_in_other_layouts(tmp_path, devices):
    import shardwise

    records = chat_records(8)
    model_dir = build_model_folder(str(tmp_path / "tiny-llama"), records)
    ranks = shardwise.launch(_zero3_load_without_fp16, model_dir, devices=devices)
    assert ranks[0]["mismatched"] == []  # every weight bit-equal to the file, in the file's dtype
    assert all(r["gathers"] == [] for r in ranks)
    assert [r["bytes_read"] > 0 for r in ranks] == [True] + [False] * (devices - 1)


@pytest.fixture(scope="module")
def assets(tmp_path_factory):
    root = tmp_path_factory.mktemp("ft-ds-errors")
    records = chat_records(10)
    return {
        "model": build_model_folder(str(root / "model"), records),
        "data": write_jsonl(str(root / "chat.jsonl"), records),
        "out": str(root / "out"),
    }


def _cfg(assets, **changes):
    return coerce_config(
        dict(
            model_path=assets["model"],
            dataset=assets["data"],
            max_seq_len=32,
            max_steps=2,
            output_dir=assets["out"],
            **changes,
        )
    )


def test_every_strategy_name_of_the_table_is_accepted(assets):
    from shardwise.recipes.finetune import _build_strategy
    from shardwise.strategies import CLASSES, FSDPStrategy
    from shardwise.strategies.deepspeed import DeepSpeedStrategy
    from shardwise.strategies.parallel import PLANS

    folder = validate_config(_cfg(assets))["folder"]
    for name, (kind, options) in ((n, (p.engine, p.strategy_options())) for n, p in PLANS.items()):
        if options.get("offload_optimizer"):  # the constructor would need DeepSpeed's CPU Adam op built
            continue
        strategy = _build_strategy(_cfg(assets, strategy=name), folder)
        assert isinstance(strategy, CLASSES[kind]), name
        if kind == "deepspeed":
            assert strategy.stage == options["stage"]
        if kind == "fsdp":
            assert strategy.sharding_strategy == options.get("sharding_strategy", "FULL_SHARD")
            assert strategy.cpu_offload == options.get("cpu_offload", False)
    assert isinstance(_build_strategy(_cfg(assets, strategy="zero3"), folder), DeepSpeedStrategy)  # an alias
    with pytest.raises(ValueError, match="contradicts strategy='fsdp_hybrid_shard'"):
        _build_strategy(_cfg(assets, strategy="fsdp_hybrid_shard", sharding_strategy="SHARD_GRAD_OP"), folder)
    assert isinstance(
        _build_strategy(_cfg(assets, strategy="fsdp_no_shard", sharding_strategy="NO_SHARD"), folder), FSDPStrategy
    )
    strategy = _build_strategy(
        _cfg(
            assets,
            strategy="deepspeed",
            strategy_options={"stage": 3, "config": {"zero_optimization": {"stage3_max_live_parameters": 1000}}},
        ),
        folder,
    )
    assert strategy.stage == 3 and strategy.config["zero_optimization"]["stage3_max_live_parameters"] == 1000
    fsdp = _build_strategy(
        _cfg(assets, strategy_options={"limit_all_gathers": True, "reshard_after_forward": False}), folder
    )
    assert fsdp.limit_all_gathers is True and fsdp.reshard_after_forward is False


def test_unknown_strategy_lists_the_valid_names(assets):
    with pytest.raises(
        ValueError,
        match=r"strategy='zero4' is not a fine-tuning strategy\. Valid: auto, single, "
        r"ddp, fsdp, .*deepspeed_stage_3_offload",
    ):
        finetune(_cfg(assets, strategy="zero4", devices=2))


def test_strategy_options_are_checked_before_any_worker_starts(assets):
    with pytest.raises(
        ValueError,
        match=r"strategy_options\['offload_optimiser'\] is not an argument of "
        r"DeepSpeedStrategy .*Valid: stage, offload_optimizer, offload_parameters",
    ):
        finetune(_cfg(assets, strategy="deepspeed_stage_3", devices=2, strategy_options={"offload_optimiser": True}))
    with pytest.raises(
        ValueError,
        match=r"strategy_options\['limit_allgathers'\] is not an argument of "
        r"FSDPStrategy .*limit_all_gathers",
    ):
        finetune(_cfg(assets, devices=2, strategy_options={"limit_allgathers": True}))
    with pytest.raises(
        ValueError,
        match=r"strategy_options\['sharding_strategy'\]: the recipe sets .*own option "
        r"'sharding_strategy'; set sharding_strategy: 'NO_SHARD'",
    ):
        finetune(_cfg(assets, devices=2, strategy_options={"sharding_strategy": "NO_SHARD"}))
    with pytest.raises(
        ValueError,
        match=r"strategy_options\['stage'\]=2 contradicts "
        r"strategy='deepspeed_stage_3'",
    ):
        validate_config(_cfg(assets, strategy="deepspeed_stage_3", strategy_options={"stage": 2}))
    with pytest.raises(ValueError, match=r"sharding_strategy configure FSDP; strategy='deepspeed_stage_2'"):
        validate_config(_cfg(assets, strategy="deepspeed_stage_2", sharding_strategy="HYBRID_SHARD"))
    with pytest.raises(ValueError, match=r"strategy='single' takes no options"):
        validate_config(_cfg(assets, strategy="single", strategy_options={"timeout_s": 5}))

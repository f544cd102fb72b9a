# QLoRA (load_in_4bit) through the fine-tuning recipe, plus quantize_to_4bit's unit tests and the refusals.
#
# One 2-process launch (CPU, gloo; shared with other recipe files: tests/recipes/conftest.py):
# FSDP FULL_SHARD, fp32, NF4 base with LoRA r=8 on every linear layer,
# 20 steps (with activation checkpointing the losses are the same; checked by hand, see docs/adapters.md).
# Checked: the loss falls; the trainable count is reported; every targeted linear layer is a bitsandbytes
# Linear4bit whose packed codes are a DTensor sharded over both ranks (half the codes each) with the whole
# quantisation state on each rank, and the codes the ranks hold together and every rank's state are bit for
# bit those of quantising the checkpoint's weight; the frozen base gets no gradient. The first 5 losses equal
# those of ONE process without FSDP (strategy single, the same global batch) within 5e-6. Why 5e-6: the codes
# are bit-identical in both runs, so they differ only in the order of float32 sums (the gradient
# reduce-scatter, the loss all-reduce): 4.8e-7 over 5 steps when written. Planted on this tiny random-weight
# model, the two ranks' halves of one layer's codes swapped move the first loss by 7e-5 (q_proj) to 2e-3
# (down_proj), two layers' states swapped by 1.8e-5, all above 5e-6; a silent failure (loss 0, NaN) by far
# more. The exports: the merged folder (4-bit base dequantised + LoRA delta) loaded by transformers, and the
# adapter folder loaded by PEFT onto transformers' own 4-bit base, both reproduce the trained model's logits
# within 1e-4.
from __future__ import annotations

import dataclasses
import os
import sys

import pytest
import torch
from torch import nn

from shardwise.adapters.quantize import (
    check_4bit_plan,
    compute_dtype_for,
    fourbit_bytes,
    is_4bit,
    packed_shape,
    quantize_to_4bit,
)
from shardwise.recipes.data import DataOptions
from shardwise.recipes.finetune import FinetuneConfig, finetune, validate_config

from helpers.hf import build_model_folder, chat_records, write_jsonl

bnb = pytest.importorskip("bitsandbytes")

STEPS, PARITY_STEPS = 20, 5
IDS = torch.arange(3, 19).reshape(2, 8)  # a fixed batch for the logits checks


def _no_cpu_repacking(model):
    """bitsandbytes' no-grad eval forward on AVX512-BF16 CPUs switches to a repacked lower-precision kernel
    (about 2e-3 off on this model); shardwise's own 4-bit layers never take it (adapters/quantize.py)."""
    for m in model.modules():
        if hasattr(m, "support_avx512bf16_for_cpu"):
            m.support_avx512bf16_for_cpu = False
    return model


def qlora_facts(module):
    """after_fit hook (every rank): how the 4-bit base is held, and the trained model's logits."""
    import torch.distributed as dist
    from torch.distributed.tensor import DTensor, Shard

    layers = [(n, m) for n, m in module.model.named_modules() if isinstance(m, bnb.nn.Linear4bit)]
    facts = {
        "layers": len(layers),
        "sharded": all(
            isinstance(m.weight, DTensor) and m.weight.placements == (Shard(0),) and m.weight.dtype == torch.uint8
            for _, m in layers
        ),
        "local_rows": [m.weight.to_local().shape[0] for _, m in layers],
        "full_rows": [m.weight.shape[0] for _, m in layers],
        "state_shapes": [tuple(m.quant_state.shape) == (m.out_features, m.in_features) for _, m in layers],
        "frozen_with_grad": [
            n for n, p in module.model.named_parameters() if not p.requires_grad and p.grad is not None
        ],
    }
    # The packed codes all ranks hold together, and each rank's quantisation state, are bit for bit what
    # quantising the checkpoint's weight gives (no wrong or stale slice, no lost or mixed-up state).
    from safetensors.torch import load_file

    from shardwise.adapters.lora import base_weight_name
    from shardwise.adapters.quantize import quantize_weight

    weights = load_file(os.path.join(module.folder.path, "model.safetensors"))
    exact = []
    for name, m in layers:
        codes, state = quantize_weight(weights[base_weight_name(name + ".weight")], m)
        held = m.weight.full_tensor()
        exact.append(
            torch.equal(held.view(torch.uint8), codes.view(torch.uint8))
            and all(
                torch.equal(a, b)
                for a, b in (
                    (m.quant_state.absmax, state.absmax),
                    (m.quant_state.offset, state.offset),
                    (m.quant_state.state2.absmax, state.state2.absmax),
                )
            )
        )
    facts["exact_codes_and_states"] = exact
    module.model.eval()
    with torch.no_grad(), module.trainer.strategy.gathered(module):
        facts["logits"] = module.model(input_ids=IDS).logits.detach().clone()
    return facts if dist.get_rank() == 0 else None


def _folder(root):
    root = str(root)
    model_dir = build_model_folder(os.path.join(root, "model"))
    data = write_jsonl(os.path.join(root, "chat.jsonl"), chat_records(120))
    config = FinetuneConfig(
        model_path=model_dir,
        max_steps=STEPS,
        learning_rate=3e-3,
        lr_scheduler_type="constant",
        precision="32-true",
        devices=2,
        strategy="fsdp",
        logging_steps=100,
        seed=5,
        lora_r=8,
        lora_alpha=16,
        lora_target_modules=["all-linear"],
        load_in_4bit=True,
        merge=True,
        output_dir=os.path.join(root, "fsdp"),
        data=DataOptions(
            dataset=data,
            max_seq_len=64,
            packing=True,
            per_device_train_batch_size=2,
            eval_split_ratio=0.0,
            cache_dir=os.path.join(root, "cache"),
        ),
    )
    return {"base": config, "model_dir": model_dir, "root": root}


def _fsdp_run(base):
    """The 2-process QLoRA run (one rank of it)."""
    return finetune(base, after_fit=qlora_facts)


def shared_launch(root):
    """For tests/recipes/conftest.py: the assets, and the worker that trains on them with its arguments."""
    folder = _folder(root)
    return folder, _fsdp_run, (folder["base"],)


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    """The tiny Llama, the chat data and the QLoRA run's config (nothing trained)."""
    return _folder(tmp_path_factory.mktemp("qlora"))


@pytest.fixture(scope="module")
def qlora(recipe_runs):
    # The 2-process run is in the recipe files' shared launch (tests/recipes/conftest.py).
    folder, ranks = recipe_runs[__name__]
    base, root, fsdp = folder["base"], folder["root"], ranks[0]
    # One process, no sharding at all, the same global batch (4 sequences per step).
    single = finetune(
        dataclasses.replace(
            base,
            devices=1,
            strategy="single",
            max_steps=PARITY_STEPS,
            merge=False,
            output_dir=os.path.join(root, "single"),
            data=dataclasses.replace(base.data, per_device_train_batch_size=4),
        )
    )
    return {"fsdp": fsdp, "single": single, "model_dir": folder["model_dir"]}


def test_qlora_trains_sharded_and_matches_one_process(qlora):
    fsdp, single = qlora["fsdp"], qlora["single"]
    losses = [e["loss"] for e in fsdp.losses]
    assert len(losses) == STEPS and all(torch.isfinite(torch.tensor(losses)))
    assert losses[-1] < losses[0] - 0.4, losses  # 3.71 -> 2.98 when written
    # LoRA r=8 on q, k, v, o, gate, up, down of 2 layers (hidden 64, kv 32, intermediate 128).
    per_layer = 8 * ((64 + 64) + 2 * (64 + 32) + (64 + 64) + 3 * (64 + 128))
    assert fsdp.parameters["trainable"] == 2 * per_layer
    # The total counts each 4-bit weight as its out x in weights, not its packed codes (a quarter as many
    # float32 entries): the base model's own count plus the adapters.
    from transformers import AutoModelForCausalLM

    base_total = sum(p.numel() for p in AutoModelForCausalLM.from_pretrained(qlora["model_dir"]).parameters())
    assert fsdp.parameters["total"] == base_total + 2 * per_layer, (fsdp.parameters, base_total)
    facts = fsdp.extra
    assert facts["layers"] == 14 and facts["sharded"] and all(facts["state_shapes"])
    assert [2 * r for r in facts["local_rows"]] == facts["full_rows"]  # half the packed codes on each rank
    assert facts["frozen_with_grad"] == [] and facts["exact_codes_and_states"] == [True] * 14
    one = [e["loss"] for e in single.losses]
    assert len(one) == PARITY_STEPS
    assert max(abs(a - b) for a, b in zip(losses, one)) < 5e-6, (losses[:PARITY_STEPS], one)


def test_qlora_exports_reproduce_the_trained_logits(qlora):
    from peft import PeftModel
    from transformers import AutoModelForCausalLM, BitsAndBytesConfig

    trained = qlora["fsdp"].extra["logits"]
    out = qlora["fsdp"].output_dir
    merged = AutoModelForCausalLM.from_pretrained(os.path.join(out, "merged"), dtype=torch.float32).eval()
    quantized = BitsAndBytesConfig(
        load_in_4bit=True,
        bnb_4bit_quant_type="nf4",
        bnb_4bit_use_double_quant=True,
        bnb_4bit_compute_dtype=torch.float32,
        bnb_4bit_quant_storage=torch.float32,
    )
    base = AutoModelForCausalLM.from_pretrained(
        qlora["model_dir"], quantization_config=quantized, dtype=torch.float32, device_map="cpu"
    )
    adapter = _no_cpu_repacking(PeftModel.from_pretrained(base, out)).eval()
    with torch.no_grad():
        assert (merged(input_ids=IDS).logits - trained).abs().max() < 1e-4
        assert (adapter(input_ids=IDS).logits - trained).abs().max() < 1e-4


# ------------------------------------------------------------------ quantize_to_4bit
class Tiny(nn.Module):
    def __init__(self):
        super().__init__()
        self.body = nn.Sequential(nn.Linear(64, 128), nn.ReLU(), nn.Linear(128, 64, bias=False))
        self.lm_head = nn.Linear(64, 16)

    def forward(self, x):
        return self.lm_head(self.body(x))


def test_quantize_to_4bit_real_weights():
    torch.manual_seed(0)
    model = Tiny()
    originals = {n: m.weight.detach().clone() for n, m in model.named_modules() if isinstance(m, nn.Linear)}
    assert not is_4bit(model)
    replaced = quantize_to_4bit(model, torch.float32)
    assert replaced == ["body.0", "body.2"] and is_4bit(model) and model.is_loaded_in_4bit
    assert type(model.lm_head) is nn.Linear  # skip=("lm_head",)
    x = torch.randn(3, 64)
    for name in replaced:
        layer = model.get_submodule(name)
        assert isinstance(layer, bnb.nn.Linear4bit) and not layer.weight.requires_grad
        assert layer.weight.dtype == torch.uint8 and tuple(layer.weight.shape) == packed_shape(
            layer.out_features, layer.in_features, torch.uint8
        )
        full = bnb.functional.dequantize_4bit(layer.weight.data, layer.quant_state)
        assert full.dtype == torch.float32 and full.shape == originals[name].shape
        # NF4: at most half the widest code gap (0.30, between -1 and -0.70) of the block's absmax off,
        # plus the 8-bit double quantisation of that absmax.
        assert (full - originals[name]).abs().max() <= 0.17 * originals[name].abs().max()
    # The layer computes with exactly its dequantised weight.
    first = model.body[0]
    expected = nn.functional.linear(x, bnb.functional.dequantize_4bit(first.weight.data, first.quant_state), first.bias)
    torch.testing.assert_close(first(x), expected, rtol=1e-6, atol=1e-6)
    y = model(x.requires_grad_())
    y.sum().backward()  # backward through the 4-bit layers to the input
    assert x.grad is not None and torch.isfinite(x.grad).all() and model.lm_head.weight.grad is not None


def test_quantize_to_4bit_meta_placeholders_and_refusals():
    with torch.device("meta"):
        model = Tiny()
    assert quantize_to_4bit(model, torch.bfloat16, skip=()) == ["body.0", "body.2", "lm_head"]
    layer = model.body[0]
    assert layer.weight.is_meta and layer.quant_state is None and tuple(layer.weight.shape) == (64 * 128 // 2, 1)
    assert layer.weight.dtype == torch.uint8
    assert layer.compute_dtype == torch.bfloat16 and layer.support_avx512bf16_for_cpu is False
    with pytest.raises(ValueError, match="not a multiple of 8"):
        packed_shape(3, 5, torch.float32)
    zero3 = Tiny()
    zero3.body[0].weight.ds_id = 0  # what deepspeed.zero.Init leaves on a partitioned parameter
    with pytest.raises(ValueError, match="ZeRO-3"):
        quantize_to_4bit(zero3, torch.float32)
    with pytest.raises(ValueError, match="compute_dtype"):
        quantize_to_4bit(Tiny(), torch.float64)
    with pytest.raises(ValueError, match="stored as uint8 only"):
        quantize_to_4bit(Tiny(), torch.bfloat16, torch.bfloat16)
    assert compute_dtype_for("32-true") == torch.float32 and compute_dtype_for("bf16-mixed") == torch.bfloat16
    with pytest.raises(ValueError, match="precision='64-true'"):
        compute_dtype_for("64-true")


def test_packed_codes_are_bytes_no_float_path_reads():
    """Issue 36, item 8: the codes are uint8, so no cast or NaN-canonicalising float copy can alter them.
    Read as bf16 (how they were stored before), this layer's codes hold NaN bit patterns: the health check
    took them for non-finite parameters, and a float copy may rewrite them (bitsandbytes #1945)."""
    from shardwise import health

    torch.manual_seed(0)
    model = Tiny()
    quantize_to_4bit(model, torch.bfloat16)
    codes = model.body[0].weight.data
    assert codes.dtype == torch.uint8 and not codes.is_floating_point()
    assert torch.isnan(codes.reshape(-1).view(torch.bfloat16)).any()  # the hazard is real for these very bytes
    assert health.first_nonfinite(model, []) is None


def test_fourbit_bytes_match_the_real_state():
    n = 256 * 192
    packed, state = bnb.functional.quantize_4bit(
        torch.randn(256, 192), blocksize=64, compress_statistics=True, quant_type="nf4", quant_storage=torch.bfloat16
    )
    real = sum(
        t.numel() * t.element_size()
        for t in (state.absmax, state.code, state.offset, state.state2.absmax, state.state2.code)
    )
    assert fourbit_bytes(n, torch.bfloat16) == {"packed": packed.numel() * 2, "state": real}
    assert fourbit_bytes(n, torch.bfloat16, shards=2)["packed"] == n // 4  # n/2 bytes of codes over 2 ranks
    big = fourbit_bytes(8192 * 28672, torch.bfloat16, shards=2)  # a 70B MLP weight on 2 ranks
    assert big["packed"] == 8192 * 28672 // 4 and 1 / 33 < big["state"] / (8192 * 28672 / 2) < 1 / 31


# ------------------------------------------------------------------ refusals
def _cfg(folder, **kw):
    return dataclasses.replace(folder["base"], output_dir="unused", **kw)


@pytest.mark.parametrize(
    "changes, match",
    [
        ({"lora_r": 0}, "Set lora_r"),
        ({"strategy": "deepspeed_stage_3"}, "ZeRO-3"),
        ({"strategy": "deepspeed", "strategy_options": {"stage": 3}}, "ZeRO-3"),
        ({"cpu_offload": True}, "CPU offload"),
        ({"strategy": "deepspeed_stage_2_offload"}, "CPU offload"),
        ({"precision": "64-true"}, "4-bit layers compute in float32"),
    ],
)
def test_qlora_refusals(folder, changes, match):
    with pytest.raises(ValueError, match=match):
        validate_config(_cfg(folder, **changes))


def test_qlora_without_bitsandbytes_is_refused(folder, monkeypatch):
    monkeypatch.setitem(sys.modules, "bitsandbytes", None)  # `import bitsandbytes` raises ImportError
    with pytest.raises(ValueError, match=r"pip install shardwise\[lora\]"):
        validate_config(_cfg(folder))


def test_check_4bit_plan_passes_what_works():
    from shardwise.strategies.parallel import ParallelPlan

    for name in ("fsdp", "fsdp_hybrid_shard", "ddp", "deepspeed_stage_1", "deepspeed_stage_2", "single"):
        check_4bit_plan(ParallelPlan.from_name(name))

"""Hugging Face mixture-of-experts models fine-tuned under expert parallel by the recipe, against one process.

A tiny Qwen3-MoE and a tiny Mixtral (4 experts, top-2, 2 layers, saved with save_pretrained: the hub's
per-expert layout) with their router's load-balancing loss switched on (output_router_logits, a large
coefficient so that it moves the weights) are fully fine-tuned in fp32 for 2 steps on the same global
batches: on one process, and in one 4-rank gloo launch under dp 2 x ep 2; the Qwen3-MoE also under ep 4
(each rank holding one expert) with 2 micro-batches per step, and under ep 2 on 2 processes (in the recipes'
shared 2-process launch, tests/recipes/conftest.py), against one process with the same
accumulation; the Mixtral, trained on padded (unpacked) batches, also under sp 2 x ep 2 (Ulysses sequence
parallel: the router losses count each sp rank's slice without its padding). The per-step losses (the router
loss included) must agree within 1e-5 relative, and
every export (experts gathered back from their ep ranks, written per expert as on the hub) must hold the
one-process run's trained weights within 1e-5 relative and load with AutoModelForCausalLM, giving its logits
within 1e-4. LoRA (adapters on the
attention projections) of the Qwen3-MoE trains under dp 2 x ep 2 in the same launch as on one process (losses
within 1e-5) and its adapter folder loads onto the base model with PEFT (logits within 1e-4); adapters on the
stacked experts ('all-linear') are refused before launch. The Qwen3-MoE's dp 2 x ep 2 run checkpoints at
step 1; resumed from there in the same launch it ends with the uninterrupted run's losses and bitwise its
exported weights. Each layer's tokens per expert are in every run's logs (the Trainer's ExpertLoadMonitor).
"""

from __future__ import annotations

import dataclasses
import os
import pathlib
from typing import Any, Dict, List

import pytest
import torch

from helpers.hf import build_tokenizer, chat_records, write_jsonl
from helpers.shared_launch import init_process_group

transformers = pytest.importorskip("transformers")

STEPS = 2
PROBE = [[3, 8, 5, 9, 12, 4, 7, 6]]
ATTN = dict(hidden_size=32, num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128)
FAMILIES = {
    "qwen3-moe": ("Qwen3MoeConfig", dict(intermediate_size=64, moe_intermediate_size=16, num_experts=4, head_dim=8)),
    "mixtral": ("MixtralConfig", dict(intermediate_size=16, num_local_experts=4)),
}
# layout -> (processes, per-device batch, accumulation, ep_size, sp_size): 4 samples a micro-batch over all ranks.
LAYOUTS = {
    "1 process": (1, 4, 1, 1, 1),
    "1 process, accumulation 2": (1, 4, 2, 1, 1),
    "ep 2": (2, 2, 1, 2, 1),  # in the recipes' shared 2-process launch (conftest.py), not the 4-rank one
    "dp 2 x ep 2": (4, 1, 1, 2, 1),
    "ep 4, accumulation 2": (4, 1, 2, 4, 1),
    "sp 2 x ep 2": (4, 2, 1, 2, 2),  # 2 data-parallel ranks, each an sp pair splitting its sequences
}
PADDED = {"mixtral"}  # families trained on padded (unpacked) batches: the router losses must leave padding out
LORA = dict(lora_r=4, lora_alpha=8, lora_target_modules=["q_proj", "k_proj", "v_proj", "o_proj"])
LORA_LAYOUTS = {"1 process, LoRA": "1 process", "dp 2 x ep 2, LoRA": "dp 2 x ep 2"}  # -> LAYOUTS' layout


def build_family(root: str, family: str, records: List[Dict]) -> str:
    cls_name, fields = FAMILIES[family]
    tokenizer = build_tokenizer([m["content"] for r in records for m in r["messages"]])
    config = getattr(transformers, cls_name)(
        vocab_size=len(tokenizer),
        num_hidden_layers=2,
        num_experts_per_tok=2,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
        tie_word_embeddings=False,
        output_router_logits=True,
        router_aux_loss_coef=0.5,
        **ATTN,
        **fields,
    )
    torch.manual_seed(0)
    path = os.path.join(root, family)
    transformers.AutoModelForCausalLM.from_config(config).save_pretrained(path)
    tokenizer.save_pretrained(path)
    return path


def run_config(model_dir: str, data: str, out: str, layout: str, packing: bool = True) -> Any:
    from shardwise.recipes.finetune import coerce_config

    devices, per_device, accumulation, ep, sp = LAYOUTS[LORA_LAYOUTS.get(layout, layout)]
    return coerce_config(
        dict(
            **(LORA if layout in LORA_LAYOUTS else {}),
            model_path=model_dir,
            dataset=data,
            max_seq_len=32,
            per_device_train_batch_size=per_device,
            gradient_accumulation_steps=accumulation,
            devices=devices,
            strategy="fsdp" if devices > 1 else "auto",
            ep_size=ep,
            sp_size=sp,
            packing=packing,
            precision="32-true",
            max_steps=STEPS,
            learning_rate=1e-2,
            lr_scheduler_type="constant",
            max_grad_norm=None,
            eval_split_ratio=0.0,
            logging_steps=1,
            seed=5,
            output_dir=out,
            cache_dir=os.path.join(os.path.dirname(out), "cache"),
        )
    )


def run(cfg: Any) -> Dict[str, Any]:
    from shardwise.recipes import finetune as recipe

    result = recipe.finetune(cfg)
    return {"losses": [s["loss"] for s in result.losses], "out": result.output_dir}


def resumed(cfg: Any) -> Any:
    """`cfg`'s run again from its step-1 checkpoint, into a folder of its own."""
    from shardwise.checkpoint import layout

    step1 = next(e.path for e in layout.list_checkpoints(os.path.join(cfg.output_dir, "checkpoints")) if e.step == 1)
    return dataclasses.replace(
        cfg, output_dir=cfg.output_dir + "-resumed", resume_from_checkpoint=step1, save_steps=None
    )


def run_four_rank(configs: List[Any]) -> List[Dict[str, Any]]:
    """Worker of shardwise.launch: every expert-parallel run, one after another in one process group; a
    ("resume", cfg) entry resumes cfg's run (earlier in the list) from its step-1 checkpoint."""

    init_process_group()  # not dist.init_process_group: see its docstring
    return [run(resumed(cfg[1]) if isinstance(cfg, tuple) else cfg) for cfg in configs]


def shared_launch(root):
    """For tests/recipes/conftest.py: the Qwen3-MoE under ep 2 on 2 processes (the same model, data and
    global batch as the `runs` fixture's, which builds them again from the same seeds)."""
    root = str(root)
    records = chat_records(24)
    data = write_jsonl(os.path.join(root, "chat.jsonl"), records)
    cfg = run_config(build_family(root, "qwen3-moe", records), data, os.path.join(root, "ep-2"), "ep 2")
    return None, run_four_rank, ([cfg],)


@pytest.fixture(scope="module")
def runs(tmp_path_factory, recipe_runs):
    import shardwise

    root = str(tmp_path_factory.mktemp("moe-ep"))
    records = chat_records(24)
    data = write_jsonl(os.path.join(root, "chat.jsonl"), records)
    results, launched = {}, []
    for family in FAMILIES:
        model_dir = build_family(root, family, records)
        for layout in [*LAYOUTS, *LORA_LAYOUTS]:
            devices = LAYOUTS[LORA_LAYOUTS.get(layout, layout)][0]
            if family == "mixtral" and ("accumulation" in layout or "LoRA" in layout):  # one family (test time)
                continue
            if (family == "qwen3-moe" and "sp" in layout) or devices == 2:
                continue
            out = os.path.join(root, "runs", family, layout.replace(" ", "-"))
            cfg = run_config(model_dir, data, out, layout, packing=family not in PADDED)
            if (family, layout) == ("qwen3-moe", "dp 2 x ep 2"):  # checkpoints at steps 1 and 2; resumed below
                cfg = dataclasses.replace(cfg, save_steps=1, save_total_limit=2)
            if devices == 1:
                results[(family, layout)] = run(cfg)
            else:
                launched.append(((family, layout), cfg))
                if cfg.save_steps:
                    launched.append(((family, layout + ", resumed"), ("resume", cfg)))
    ranks = shardwise.launch(run_four_rank, [cfg for _, cfg in launched], devices=4)
    for i, (key, _) in enumerate(launched):
        results[key] = ranks[0][i]
    results[("qwen3-moe", "ep 2")] = recipe_runs[__name__][1][0][0]  # rank 0's result of the shared launch
    results["qwen3-moe dir"], results["data"] = os.path.join(root, "qwen3-moe"), data
    return results


def _logged(out: str) -> bytes:
    """Everything a run's logger wrote (the metric names appear once per logged value)."""
    logs = os.path.join(out, "shardwise_logs")
    return b"".join(pathlib.Path(d, f).read_bytes() for d, _, files in os.walk(logs) for f in files)


def _export_weights(folder: str) -> Dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    files = [f for f in sorted(os.listdir(folder)) if f.endswith(".safetensors")]
    return {name: t for f in files for name, t in load_file(os.path.join(folder, f)).items()}


def _export_logits(folder: str) -> torch.Tensor:
    model = transformers.AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32)
    with torch.no_grad():
        return model(input_ids=torch.tensor(PROBE)).logits


@pytest.mark.parametrize("family", list(FAMILIES))
def test_expert_parallel_fine_tunes_as_one_process(runs, family):
    pairs = [
        ("ep 2", "1 process"),
        ("dp 2 x ep 2", "1 process"),
        ("ep 4, accumulation 2", "1 process, accumulation 2"),
        ("sp 2 x ep 2", "1 process"),
    ]
    for layout, reference in pairs:
        if (family, layout) not in runs:
            continue
        reference_logits = _export_logits(runs[(family, reference)]["out"])
        got, want = runs[(family, layout)]["losses"], runs[(family, reference)]["losses"]
        assert len(got) == STEPS, (layout, got)
        for a, b in zip(got, want):
            assert abs(a - b) <= 1e-5 * abs(b), f"{family} {layout}: losses {got} vs {reference} {want}"
        # The export holds every expert, gathered from the ep ranks, in the hub's per-expert layout: the
        # trained weights, each tensor within 1e-5 of the one-process run's (norm of the difference over the
        # tensor's norm: AdamW's per-element steps turn summation-order differences of tiny gradients into
        # ~1e-6 absolute differences of single entries).
        want_w, got_w = (_export_weights(runs[(family, name)]["out"]) for name in (reference, layout))
        assert set(got_w) == set(want_w) and any("experts" in name for name in want_w)
        for name, w in want_w.items():
            assert float((got_w[name] - w).norm()) <= 1e-5 * float(w.norm()), f"{family} {layout} {name}"
        logits = _export_logits(runs[(family, layout)]["out"])
        assert float((logits - reference_logits).abs().max()) <= 1e-4, f"{family} {layout}: export logits"
        # The Trainer attached an ExpertLoadMonitor to the MoE model: each layer's tokens per expert are logged.
        written = _logged(runs[(family, layout)]["out"])
        assert b"experts/layer1/expert3" in written and b"experts/layer0/max_load" in written, layout


def test_lora_on_the_attention_under_dp2_ep2_trains_and_exports_as_one_process(runs):
    from peft import PeftModel

    got, want = runs[("qwen3-moe", "dp 2 x ep 2, LoRA")], runs[("qwen3-moe", "1 process, LoRA")]
    assert len(got["losses"]) == STEPS and got["losses"][-1] < got["losses"][0]
    for a, b in zip(got["losses"], want["losses"]):
        assert abs(a - b) <= 1e-5 * abs(b), (got["losses"], want["losses"])
    logits = []
    for result in (got, want):  # the adapter folder loads onto the base model with PEFT
        base = transformers.AutoModelForCausalLM.from_pretrained(runs["qwen3-moe dir"], dtype=torch.float32)
        with torch.no_grad():
            logits.append(PeftModel.from_pretrained(base, result["out"]).eval()(input_ids=torch.tensor(PROBE)).logits)
    assert float((logits[0] - logits[1]).abs().max()) <= 1e-4
    base = transformers.AutoModelForCausalLM.from_pretrained(runs["qwen3-moe dir"], dtype=torch.float32)
    with torch.no_grad():  # the adapters moved the model
        assert float((base(input_ids=torch.tensor(PROBE)).logits - logits[1]).abs().max()) > 1e-4


def test_lora_on_the_stacked_experts_is_refused_before_launch(runs, tmp_path):
    from shardwise.recipes.finetune import validate_config

    cfg = run_config(runs["qwen3-moe dir"], runs["data"], str(tmp_path / "out"), "dp 2 x ep 2, LoRA")
    with pytest.raises(ValueError, match=r"LoRA adapters on the stacked experts .*model.layers.0.mlp.experts"):
        validate_config(dataclasses.replace(cfg, lora_target_modules=["all-linear"]))


def test_a_dp2_ep2_checkpoint_resumes_bitwise(runs):
    from safetensors.torch import load_file

    straight, again = runs[("qwen3-moe", "dp 2 x ep 2")], runs[("qwen3-moe", "dp 2 x ep 2, resumed")]
    assert again["losses"] == straight["losses"], (again["losses"], straight["losses"])  # step 1 from the history
    metric = b"experts/layer0/max_load"  # logged at each trained step: the resumed run trained step 2 alone
    assert (_logged(straight["out"]).count(metric), _logged(again["out"]).count(metric)) == (2, 1)
    want = load_file(os.path.join(straight["out"], "model.safetensors"))
    got = load_file(os.path.join(again["out"], "model.safetensors"))
    assert set(got) == set(want) and any("experts" in name for name in want)
    assert all(torch.equal(got[name], want[name]) for name in want)

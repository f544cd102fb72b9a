"""Checkpoints across layouts: kill and resume under dp2 x sp2 bitwise, then resume at dp4 and on one process.

A tiny local Llama is fine-tuned by the recipe on packed chat data (fp32, a
checkpoint every 3 steps, the same global batch of 4 blocks at every layout):
1. parallel_resume_script.py trains on 4 processes as FSDP x sp 2 and is
   SIGKILLed right after step 5; the last committed checkpoint is step 3's.
2. One launch of 4 processes runs, in turn: the resume from `last` under
   dp2 x sp2 to step 6, which must repeat an uninterrupted dp2 x sp2 run
   (run next in the same processes) bit for bit; then step 3's checkpoint
   resumed as plain 4-way FSDP (DCP reshards the sp-flattened shards, the
   sampler continues at 4 data-parallel ranks), whose losses continue the
   uninterrupted run's within 1e-5.
3. In this process: step 3's checkpoint resumed on one process (within
   1e-5), and one process from scratch, which the uninterrupted dp2 x sp2
   run matches per step within 1e-4 relative (the fourth layout of
   tests/recipes/test_finetune_parallel.py's acceptance, sharing this launch).
4. The Hugging Face folder the resumed dp2 x sp2 run exported loads with
   AutoModelForCausalLM, holds exactly the weights that run trained (as does
   `shardwise convert` of its last checkpoint), and gives the one-process
   run's logits.
"""

from __future__ import annotations

import dataclasses
import os
import subprocess
import sys

import pytest
import torch
from parallel_resume_script import STEPS, recipe_config

import shardwise
from shardwise.checkpoint import layout
from shardwise.recipes.finetune import finetune

from helpers.hf import build_model_folder, build_tokenizer, chat_records, gather_trained_weights, write_jsonl

SCRIPT = os.path.join(os.path.dirname(__file__), "parallel_resume_script.py")
KILL_AT = 5
LAST_SAVED = 3

pytestmark = pytest.mark.slow


def _losses(result):
    return {s["step"]: s["loss"] for s in result.losses}


def _four_process_runs(root, model, data, step3):
    """In 4 launched processes: the resume, the uninterrupted run, and the resume as 4-way FSDP."""
    resumed = finetune(
        recipe_config(root, model, data, "run", resume_from_checkpoint="last"), after_fit=gather_trained_weights
    )
    straight = finetune(recipe_config(root, model, data, "straight", save_steps=None))
    as_fsdp = finetune(
        recipe_config(
            root, model, data, "fsdp4", sp_size=1, per_device_train_batch_size=1, resume_from_checkpoint=step3
        )
    )
    return {
        "resumed": _losses(resumed),
        "weights": resumed.extra,
        "straight": _losses(straight),
        "fsdp4": _losses(as_fsdp),
    }


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    root = str(tmp_path_factory.mktemp("parallel-resume"))
    records = chat_records(64)
    words = len(build_tokenizer([m["content"] for r in records for m in r["messages"]]))
    model = build_model_folder(os.path.join(root, "model"), records, max_positions=64, vocab_pad=-words % 4)
    data = write_jsonl(os.path.join(root, "chat.jsonl"), records)

    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONWARNINGS": "ignore"}
    killed = subprocess.run(
        [sys.executable, SCRIPT, root, model, data, str(KILL_AT)], capture_output=True, text=True, timeout=600, env=env
    )
    assert killed.returncode != 0, f"the run was supposed to be killed:\n{killed.stderr[-3000:]}"
    last = layout.latest_checkpoint(os.path.join(root, "run", "checkpoints"))
    assert last is not None, killed.stderr[-3000:]
    manifest = layout.read_manifest(last)
    assert manifest["global_step"] == LAST_SAVED and manifest["layout"] == "FSDP FULL_SHARD x sp 2"  # for inspect

    out = shardwise.launch(_four_process_runs, root, model, data, last, devices=4)[0]
    one = recipe_config(root, model, data, "one-resumed", devices=1, sp_size=1, per_device_train_batch_size=4)
    out["one_resumed"] = _losses(finetune(dataclasses.replace(one, resume_from_checkpoint=last)))
    out["one"] = _losses(finetune(dataclasses.replace(one, output_dir=os.path.join(root, "one"), save_steps=None)))
    out.update(root=root, model=model)
    return out


def test_kill_and_resume_under_dp2_sp2_is_bitwise(runs):
    straight, resumed = runs["straight"], runs["resumed"]
    assert sorted(straight) == list(range(1, STEPS + 1))
    # steps 1-3 are the killed run's (they travel in the checkpoint), 4-6 the resumed run's
    assert resumed == straight


def test_the_checkpoint_resumes_as_4_way_fsdp_and_on_one_process(runs):
    straight = runs["straight"]
    after = list(range(LAST_SAVED + 1, STEPS + 1))
    for name in ("fsdp4", "one_resumed"):
        got = runs[name]
        assert sorted(got) == list(range(1, STEPS + 1)), name
        assert [got[s] for s in after] == pytest.approx([straight[s] for s in after], rel=1e-5, abs=1e-5), name


def test_dp2_sp2_matches_one_process_per_step(runs):
    one, straight = runs["one"], runs["straight"]
    assert [straight[s] for s in sorted(one)] == pytest.approx([one[s] for s in sorted(one)], rel=1e-4)


def test_the_export_loads_with_transformers_and_gives_the_trained_logits(runs):
    from transformers import AutoModelForCausalLM

    exported = AutoModelForCausalLM.from_pretrained(os.path.join(runs["root"], "run"))
    state = exported.state_dict()
    trained = runs["weights"]
    assert trained and set(trained) <= set(state)
    for name, value in trained.items():
        assert torch.equal(state[name], value), name
    original = AutoModelForCausalLM.from_pretrained(runs["model"]).state_dict()
    assert not torch.equal(
        original["model.layers.0.self_attn.q_proj.weight"], state["model.layers.0.self_attn.q_proj.weight"]
    )
    # `shardwise convert` of the run's last checkpoint (step 6, dp2 x sp2) writes the same weights
    from safetensors.torch import load_file

    from shardwise.recipes.convert import convert

    last = layout.latest_checkpoint(os.path.join(runs["root"], "run", "checkpoints"))
    assert layout.read_manifest(last)["global_step"] == STEPS
    converted = os.path.join(runs["root"], "converted.safetensors")
    convert(last, converted)
    weights = load_file(converted)  # named as the TrainModule holds them: the recipe's module keeps the model in .model
    prefix = next(k[: -len("lm_head.weight")] for k in weights if k.endswith("lm_head.weight"))
    assert set(weights) == {prefix + name for name in trained}
    for name, value in trained.items():
        assert torch.equal(weights[prefix + name], value), name
    one = AutoModelForCausalLM.from_pretrained(os.path.join(runs["root"], "one-resumed"))
    ids = torch.tensor([[2, 5, 9, 12, 3, 7, 11, 4]])
    with torch.no_grad():
        torch.testing.assert_close(exported(ids).logits, one(ids).logits, rtol=1e-4, atol=1e-4)

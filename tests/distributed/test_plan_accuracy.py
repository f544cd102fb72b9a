"""The planner's headline claim: predicted peak tracked memory per rank is within 10% of a real run.

Each case plans a model with `shardwise.plan` (fake tensors, nothing
allocated) and trains the same TrainModule for real with the Trainer on CPU
(1 or 2 processes via shardwise.launch), measuring peak tracked tensor memory
with shardwise.memory's tracker; see benchmarks/plan_measure.py. The quick
cases cover DDP, FSDP with and without activation checkpointing and ZeRO
1/2/3 across both models and both world sizes; the full matrix (every
configuration of the GPT on 2 processes, a few otherwise; the
table in BENCHMARKS.md has all of them) is marked slow. Models are 6 blocks
deep, so every prediction is extrapolated from the planner's 3- and 4-block
traces. Sequence parallel 2 and tensor parallel 2
(FSDP on a 2-rank mesh, the real Ulysses all-to-alls and DTensor projections
on gloo) are held to 5%, in the quick subset.
"""

from __future__ import annotations

import pytest
from plan_measure import (  # benchmarks/, on pytest's pythonpath
    ACCURACY_CONFIGURATIONS,
    PARALLEL_CONFIGURATIONS,
    accuracy_models,
    compare,
)

TOLERANCE = 0.10
QUICK = {
    ("gpt", 2): ["ddp", "fsdp_shard_grad_op", "fsdp_ac", "deepspeed_stage_2", "deepspeed_stage_3"],
    ("transformer", 1): ["fsdp_no_shard", "fsdp", "deepspeed_stage_1"],
}


def _check(rows):
    bad = [r for r in rows if abs(r["error"]) > TOLERANCE]
    table = "\n".join(
        f"{r['model']} x{r['devices']} {r['config']}: predicted {r['predicted']:.0f} B, measured "
        f"{r['measured']:.0f} B ({r['error']:+.1%})"
        for r in rows
    )
    assert not bad, f"predictions off by more than {TOLERANCE:.0%}:\n{table}"


@pytest.mark.deepspeed
@pytest.mark.parametrize("model, devices", list(QUICK))
def test_predicted_peak_within_10_percent(model, devices, request):
    # The quick subset (-m "not slow"); a full run checks these cases in the full matrix below.
    if "slow" not in (request.config.getoption("-m") or ""):
        pytest.skip("covered by test_predicted_peak_within_10_percent_full_matrix in a full run")
    pytest.importorskip("deepspeed")
    spec, seq = accuracy_models()[model]
    _check(compare(spec, seq, devices, QUICK[(model, devices)]))


# On one process the suite checks FSDP and ZeRO-3 at a world of one, each with activation checkpointing
# (FSDP's own option, and the blocks DeepSpeed has checkpointed by hand); FSDP FULL_SHARD without it on one
# process is test_adapter_peak_within_5_percent[qlora-1]'s engine, and every other configuration takes paths
# the two-process matrix checks. Each real run costs seconds of suite time; `python benchmarks/plan_accuracy.py`
# measures every configuration at both sizes (the table in BENCHMARKS.md).
ONE_PROCESS = ("fsdp_ac", "deepspeed_stage_3_ac")
# On two processes the GPT (rotary, SwiGLU: the planner's main path) runs every configuration; the
# Transformer (nn.MultiheadAttention) one of each engine and sharding, with and without checkpointing.
TRANSFORMER_TWO = ("ddp", "fsdp_shard_grad_op", "fsdp", "fsdp_ac", "deepspeed_stage_2", "deepspeed_stage_3")


def _is_parallel(row) -> bool:
    return " x sp " in row["config"] or " x tp " in row["config"]


@pytest.fixture(scope="module")
def gpt_two_processes(request):
    """The GPT on 2 processes: every configuration the selected tests check, planned at once and trained
    in one launch (start-up dominates at this size): the full matrix when it is selected, and sp 2 / tp 2."""
    selected = {item.name for item in request.session.items if item.module is request.module}
    configurations = list(PARALLEL_CONFIGURATIONS)
    if "test_predicted_peak_within_10_percent_full_matrix[gpt-2]" in selected:
        pytest.importorskip("deepspeed")
        configurations = [*ACCURACY_CONFIGURATIONS, *configurations]
    spec, seq = accuracy_models()["gpt"]
    return compare(spec, seq, 2, configurations)


@pytest.mark.slow
@pytest.mark.deepspeed
@pytest.mark.parametrize("model, devices", [("gpt", 2), ("transformer", 2), ("transformer", 1)])
def test_predicted_peak_within_10_percent_full_matrix(model, devices, request):
    pytest.importorskip("deepspeed")
    if model == "gpt":
        rows = [r for r in request.getfixturevalue("gpt_two_processes") if not _is_parallel(r)]
        assert len(rows) == len(ACCURACY_CONFIGURATIONS), [r["config"] for r in rows]
        _check(rows)
        return
    spec, seq = accuracy_models()[model]
    _check(compare(spec, seq, devices, ONE_PROCESS if devices == 1 else TRANSFORMER_TWO))


ADAPTER_TOLERANCE = 0.05
ADAPTER_CASES = {  # (LoRA / QLoRA keywords, processes): configurations
    ("lora", 2): ["ddp", "fsdp"],
    ("qlora", 2): ["fsdp", "ddp"],
    ("qlora", 1): ["fsdp"],
}


@pytest.mark.slow
@pytest.mark.parametrize("kind, devices", list(ADAPTER_CASES))
def test_adapter_peak_within_5_percent(kind, devices):
    # LoRA r=8 on q_proj / v_proj of a Llama-shaped GPT (6 blocks), QLoRA with the base in NF4; the
    # same adapter LMModule trained for real on CPU (measured: within 0.03% in BENCHMARKS.md).
    pytest.importorskip("peft")
    pytest.importorskip("bitsandbytes")
    from shardwise.models import GPTConfig
    from shardwise.plan.presets import gpt_spec

    llama = GPTConfig(
        vocab_size=2048, block_size=64, n_layer=6, n_head=4, n_embd=256, norm="rmsnorm", mlp="swiglu", rope=True
    )
    spec = gpt_spec("llama-6x256", llama)
    adapters = dict(lora_r=8, load_in_4bit=kind == "qlora")
    rows = compare(spec, 64, devices, ADAPTER_CASES[(kind, devices)], precision="bf16-mixed", adapters=adapters)
    bad = [r for r in rows if abs(r["error"]) > ADAPTER_TOLERANCE]
    assert not bad, f"{kind} predictions off by more than {ADAPTER_TOLERANCE:.0%}: {bad}"


PARALLEL_TOLERANCE = 0.05


def test_sp_and_tp_peaks_within_5_percent(gpt_two_processes):
    # Issue 22's acceptance: the accuracy GPT (6 blocks, untied) at sp 2 and at tp 2 on 2 processes,
    # planned through the real apply_sequence_parallel / apply_tensor_parallel on the fake group
    # and trained for real, in the full matrix's launch when that runs (measured: -0.02% and +3.0%,
    # BENCHMARKS.md).
    rows = [r for r in gpt_two_processes if _is_parallel(r)]
    assert [r["config"] for r in rows] == ["FSDP FULL_SHARD x sp 2", "FSDP FULL_SHARD x tp 2"]
    assert all(r["method"].startswith("traced") for r in rows)
    bad = [r for r in rows if abs(r["error"]) > PARALLEL_TOLERANCE]
    assert not bad, f"sp / tp predictions off by more than {PARALLEL_TOLERANCE:.0%}: {bad}"

"""The planner's headline claim: predicted peak tracked memory per rank is within 10% of a real run.

Each case plans a model with `shardwise.plan` (fake tensors, nothing
allocated) and trains the same TrainModule for real with the Trainer on CPU
(1 or 2 processes via shardwise.launch), measuring peak tracked tensor memory
with shardwise.memory's tracker; see benchmarks/plan_measure.py. The suite
checks a representative subset of the configuration matrix: DDP, FSDP at each
sharding with and without activation checkpointing, and ZeRO 1/2/3 with and
without it, across both models and both world sizes. The full matrix (every
configuration of both models on 1 and 2 processes) is
`python benchmarks/plan_accuracy.py`, whose table is in BENCHMARKS.md
("Memory planner"). Models are 6 blocks deep, so every prediction is
extrapolated from the planner's 3- and 4-block traces. Sequence parallel 2 and
tensor parallel 2 (FSDP on a 2-rank mesh, the real Ulysses all-to-alls and
DTensor projections on gloo) and LoRA / QLoRA are held to 5%.

The fp32 cases of one world size train in one launch (plan_measure.compare_many):
process, import and DeepSpeed start-up dominate at these sizes, so the 2-process
cases share one launch and the 1-process cases another. The adapter cases keep a
launch each (see test_adapter_peak_within_5_percent).
"""

from __future__ import annotations

import importlib.util

import pytest
from plan_measure import PARALLEL_CONFIGURATIONS, accuracy_models, compare_many  # benchmarks/, on pythonpath

TOLERANCE = 0.10
# (model, processes): configurations. Together: every engine, FSDP NO_SHARD / SHARD_GRAD_OP / FULL_SHARD each
# with and without checkpointing, ZeRO-1/2/3 and ZeRO-3 + AC, on both models. On one process the suite checks
# FSDP and ZeRO-3 at a world of one, each with activation checkpointing (FSDP's own option, and the blocks
# DeepSpeed has checkpointed by hand); FSDP FULL_SHARD without it on one process is
# test_adapter_peak_within_5_percent[qlora-1]'s engine. The rows the benchmark measured off by more than 1%
# (GPT x2 FULL_SHARD, ZeRO-1, ZeRO-2, ZeRO-3 + AC) are all here.
SUBSET = {
    ("gpt", 2): (
        "ddp",
        "fsdp",
        "fsdp_shard_grad_op_ac",
        "deepspeed_stage_1",
        "deepspeed_stage_2",
        "deepspeed_stage_3_ac",
    ),
    ("transformer", 2): ("fsdp_no_shard", "fsdp_shard_grad_op", "fsdp_ac", "deepspeed_stage_3"),
    ("transformer", 1): ("fsdp_ac", "deepspeed_stage_3_ac"),
}

ADAPTER_TOLERANCE = 0.05
ADAPTER_CASES = {  # (LoRA / QLoRA keywords, processes): configurations
    ("lora", 2): ["ddp", "fsdp"],
    ("qlora", 2): ["fsdp", "ddp"],
    ("qlora", 1): ["fsdp"],
}
PARALLEL_TOLERANCE = 0.05


def _installed(*names: str) -> bool:
    return all(importlib.util.find_spec(n) is not None for n in names)


def _llama_spec():
    from shardwise.models import GPTConfig
    from shardwise.plan.presets import gpt_spec

    llama = GPTConfig(
        vocab_size=2048, block_size=64, n_layer=6, n_head=4, n_embd=256, norm="rmsnorm", mlp="swiglu", rope=True
    )
    return gpt_spec("llama-6x256", llama)


def _cases(devices: int, selected: set) -> dict:
    """compare_many's cases for the selected tests at one world size, keyed by what the tests look up."""
    cases = {}
    models = accuracy_models()
    for model, n in SUBSET:
        if (
            n == devices
            and f"test_predicted_peak_within_10_percent[{model}-{n}]" in selected
            and _installed("deepspeed")
        ):
            spec, seq = models[model]
            cases[(model, n)] = dict(spec=spec, seq_len=seq, candidates=SUBSET[(model, n)])
    if devices == 2 and "test_sp_and_tp_peaks_within_5_percent" in selected:
        spec, seq = models["gpt"]
        cases["parallel"] = dict(spec=spec, seq_len=seq, candidates=PARALLEL_CONFIGURATIONS)
    return cases


def _launch(devices: int, request) -> dict:
    selected = {item.name for item in request.session.items if item.module is request.module}
    cases = _cases(devices, selected)
    if not cases:
        return {}
    return dict(zip(cases, compare_many(list(cases.values()), devices)))


@pytest.fixture(scope="module")
def two_processes(request):
    """Every selected 2-process case, planned here and trained in one 2-process launch."""
    return _launch(2, request)


@pytest.fixture(scope="module")
def one_process(request):
    """Every selected 1-process case, planned here and trained in one 1-process launch."""
    return _launch(1, request)


def _rows(request, devices: int, key):
    return request.getfixturevalue("two_processes" if devices == 2 else "one_process")[key]


@pytest.mark.deepspeed
@pytest.mark.parametrize("model, devices", list(SUBSET))
def test_predicted_peak_within_10_percent(model, devices, request):
    pytest.importorskip("deepspeed")
    rows = _rows(request, devices, (model, devices))
    assert [r["config"] for r in rows] == [_label(c) for c in SUBSET[(model, devices)]]
    bad = [r for r in rows if abs(r["error"]) > TOLERANCE]
    table = "\n".join(
        f"{r['model']} x{r['devices']} {r['config']}: predicted {r['predicted']:.0f} B, measured "
        f"{r['measured']:.0f} B ({r['error']:+.1%})"
        for r in rows
    )
    assert not bad, f"predictions off by more than {TOLERANCE:.0%}:\n{table}"


def _label(name: str) -> str:
    from shardwise.plan.candidates import parse_candidate

    return parse_candidate(name).config_label


@pytest.mark.slow
@pytest.mark.parametrize("kind, devices", list(ADAPTER_CASES))
def test_adapter_peak_within_5_percent(kind, devices):
    # LoRA r=8 on q_proj / v_proj of a Llama-shaped GPT (6 blocks), QLoRA with the base in NF4; the
    # same adapter LMModule trained for real on CPU (measured: within 0.03% in BENCHMARKS.md). Each
    # in a launch of its own: after the fp32 cases (sp / tp among them) in the same worker processes
    # the LoRA DDP run measured 14% below its prediction, alone it is within 0.03%.
    pytest.importorskip("peft")
    pytest.importorskip("bitsandbytes")
    adapters = dict(lora_r=8, load_in_4bit=kind == "qlora")
    case = dict(
        spec=_llama_spec(),
        seq_len=64,
        candidates=ADAPTER_CASES[(kind, devices)],
        precision="bf16-mixed",
        adapters=adapters,
    )
    (rows,) = compare_many([case], devices)
    bad = [r for r in rows if abs(r["error"]) > ADAPTER_TOLERANCE]
    assert not bad, f"{kind} predictions off by more than {ADAPTER_TOLERANCE:.0%}: {bad}"


def test_sp_and_tp_peaks_within_5_percent(two_processes):
    # Issue 22's acceptance: the accuracy GPT (6 blocks, untied) at sp 2 and at tp 2 on 2 processes,
    # planned through the real apply_sequence_parallel / apply_tensor_parallel on the fake group
    # and trained for real, in the 2-process launch (measured: -0.02% and +3.0%, BENCHMARKS.md).
    rows = two_processes["parallel"]
    assert [r["config"] for r in rows] == ["FSDP FULL_SHARD x sp 2", "FSDP FULL_SHARD x tp 2"]
    assert all(r["method"].startswith("traced") for r in rows)
    bad = [r for r in rows if abs(r["error"]) > PARALLEL_TOLERANCE]
    assert not bad, f"sp / tp predictions off by more than {PARALLEL_TOLERANCE:.0%}: {bad}"

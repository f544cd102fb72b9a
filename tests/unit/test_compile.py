"""Per-block torch.compile on one device: what compile= accepts and refuses, which modules are the blocks,
compiled vs eager losses (inductor's C++ backend, fp32, 10 steps), and the recompile warning.

The parity run compiles the tiny GPT's block once (forward and backward, about 15 s of C++ on a cold
inductor cache); the other runs use dynamo's "eager" backend, which exercises the same graph capture,
guards and recompilations without generating code.
"""

import warnings

import pytest
import torch
from torch import nn
from torch.utils.data import DataLoader

import shardwise
from shardwise import Trainer
from shardwise.models import GPT, gpt_config
from shardwise.models.gpt import Block
from shardwise.strategies import DDPStrategy, FSDPStrategy, SingleDeviceStrategy, build_strategy
from shardwise.strategies.compile import (
    CompileOptions,
    apply_compile,
    build_compile_options,
    find_blocks,
    is_compiled,
)
from shardwise.strategies.parallel import ParallelPlan

from helpers.lm import GPT_TINY, StepLosses, TinyGPT, token_data

STEPS = 10
# Inductor's C++ code for these tests: one compile thread (no worker pool for one small graph), kernels for
# one CPU thread (as each rank of test_compile_parity.py runs, so the two share inductor's on-disk cache),
# scalar loops instead of SIMD (half the C++ compile time; the same lowering, fusion and AOT autograd).
FAST_INDUCTOR = {"compile_threads": 1, "cpp.threads": 1, "cpp.vec_isa_ok": False}


def _fit(compile, data, steps=STEPS, module=None, **kwargs):
    shardwise.seed_everything(0)
    recorder = StepLosses()
    trainer = Trainer(
        accelerator="cpu",
        devices=1,
        max_steps=steps,
        callbacks=[recorder],
        enable_progress_bar=False,
        logger=False,
        enable_checkpointing=False,
        compile=compile,
        **kwargs,
    )
    trainer.fit(module or TinyGPT(lr=1e-2), data)
    return recorder.losses, trainer


# ------------------------------------------------------------------ the option, without compiling anything
def test_compile_spellings_and_refusals():
    assert build_compile_options(None) is None and build_compile_options(False) is None
    assert build_compile_options(True) == CompileOptions() == build_compile_options("blocks")
    assert build_compile_options("model").mode == "model"
    assert build_compile_options({"backend": "eager", "max_recompiles": 2}).max_recompiles == 2
    for bad in ("fast", 3, {"mode": "layers"}, {"nope": 1}, {"max_recompiles": -1}):
        with pytest.raises(ValueError, match="compile"):
            build_compile_options(bad)
    # The plan carries it: a field, a label, built into the strategy; names and planner candidates ignore it.
    plan = ParallelPlan("fsdp", compile=True)
    assert plan.compile == "blocks" and plan.label == "FSDP FULL_SHARD + compile" and plan.name == "fsdp"
    assert plan.build(blocks={Block}).compile_options == CompileOptions()
    assert FSDPStrategy(compile="model").parallel_plan.compile == "model"
    assert DDPStrategy(compile=True).parallel_plan.compile == "blocks"
    assert build_strategy("single").parallel_plan.compile == "none"
    # DeepSpeed is refused before anything runs, as a plan and as a Trainer argument.
    with pytest.raises(ValueError, match="not supported with DeepSpeed.*strategy='fsdp'"):
        ParallelPlan("deepspeed", zero_stage=3, compile="blocks")
    with pytest.raises(ValueError, match="not supported with DeepSpeed"):
        Trainer(accelerator="cpu", devices=1, strategy="deepspeed_stage_2", compile=True, logger=False)
    # The Trainer and the strategy must agree; the same value twice is fine.
    with pytest.raises(ValueError, match="compile.*set it in one place"):
        Trainer(accelerator="cpu", devices=1, strategy=SingleDeviceStrategy(compile="model"), compile=True)
    trainer = Trainer(accelerator="cpu", devices=1, strategy=SingleDeviceStrategy(compile=True), compile=True)
    assert trainer.strategy.parallel_plan.label == "single device + compile"


def test_the_blocks_are_found_in_each_kind_of_model():
    gpt = GPT(gpt_config("gpt-tiny", **GPT_TINY))
    assert [n for n, _ in find_blocks(gpt)] == ["blocks.0", "blocks.1"]
    encoder = nn.TransformerEncoder(nn.TransformerEncoderLayer(16, 2, 32, batch_first=True), num_layers=3)
    assert [n for n, _ in find_blocks(encoder)] == ["layers.0", "layers.1", "layers.2"]

    class Decoder(nn.Module):  # a Hugging Face model names its blocks in _no_split_modules
        _no_split_modules = ["Layer"]

        def __init__(self):
            super().__init__()
            self.embed = nn.Embedding(8, 4)
            self.layers = nn.ModuleList([Layer(), Layer()])
            self.extra = nn.ModuleList([nn.Linear(4, 4), nn.ReLU()])  # mixed classes: not blocks

    class Layer(nn.Linear):
        def __init__(self):
            super().__init__(4, 4)

    assert [n for n, _ in find_blocks(Decoder())] == ["layers.0", "layers.1"]
    from transformers import LlamaConfig, LlamaForCausalLM  # the recipe's models: their decoder layers

    with torch.device("meta"):
        llama = LlamaForCausalLM(
            LlamaConfig(hidden_size=16, intermediate_size=32, num_hidden_layers=2, num_attention_heads=2)
        )
    assert [n for n, _ in find_blocks(llama)] == ["model.layers.0", "model.layers.1"]
    assert [n for n, _ in find_blocks(gpt, blocks="MLP")] == ["blocks.0.mlp", "blocks.1.mlp"]
    # A checkpointed block is compiled with its checkpoint wrapper (recomputation inside the graph).
    from shardwise.strategies.fsdp import apply_activation_checkpointing

    apply_activation_checkpointing(gpt, {Block})
    found = find_blocks(gpt, {Block})
    assert [type(m).__name__ for _, m in found] == ["CheckpointWrapper", "CheckpointWrapper"]
    names = apply_compile(gpt, CompileOptions(backend="eager"))
    assert names == ["blocks.0", "blocks.1"] and all(is_compiled(m) for _, m in found)
    assert not is_compiled(gpt.blocks[0]._checkpoint_wrapped_module)
    # Compiling leaves the state dict's names as they were.
    assert "blocks.0.attn.q_proj.weight" in gpt.state_dict()
    with pytest.raises(ValueError, match=r"found no repeated block in Sequential.*compile='model'"):
        apply_compile(nn.Sequential(nn.Linear(2, 2), nn.ReLU()), CompileOptions())


# ------------------------------------------------------------------ compiled runs
def test_compiled_blocks_match_eager_and_do_not_recompile():
    import torch._inductor.config as inductor_config

    data = DataLoader(token_data(n=80, seq=9), batch_size=4)  # the shapes of a rank in test_compile_parity.py
    eager, _ = _fit(None, data)
    torch._dynamo.reset()  # compile here, not from an earlier test's in-memory cache
    graphs = torch._dynamo.utils.counters["stats"]["unique_graphs"]
    with (
        inductor_config.patch(FAST_INDUCTOR),
        warnings.catch_warnings(record=True) as caught,
    ):
        warnings.simplefilter("always")
        compiled, trainer = _fit(True, data)
    assert not [w for w in caught if "recompiling" in str(w.message)]  # none on a run of fixed shapes
    assert trainer.strategy.compiled == ["model.blocks.0", "model.blocks.1"]
    assert torch._dynamo.utils.counters["stats"]["unique_graphs"] > graphs  # dynamo did capture the blocks
    assert len(compiled) == STEPS and max(abs(a - b) for a, b in zip(compiled, eager)) < 1e-4, (compiled, eager)
    watch = trainer.strategy.recompile_watch
    assert not watch.recompiles and watch.message is None
    # The whole-network form: the TrainModule's network compiled as one function, the same losses.
    model_losses, trainer = _fit({"mode": "model", "backend": "eager"}, data, steps=3)
    assert trainer.strategy.compiled == ["model"] and is_compiled(trainer.module.model)
    assert max(abs(a - b) for a, b in zip(model_losses, eager)) < 1e-4


class VaryingLengths(torch.utils.data.Dataset):
    """The planted fault: every sample a different length, so every step brings a new shape."""

    def __len__(self):
        return 12

    def __getitem__(self, i):
        return (torch.arange(i + 4) % 128,)


def test_a_run_that_keeps_recompiling_warns_once_with_the_failed_guard():
    torch._dynamo.reset()
    options = CompileOptions(backend="eager", dynamic=False, max_recompiles=2)
    with pytest.warns(UserWarning, match=r"keeps recompiling forward \(.*gpt.py:\d+\) on rank 0") as caught:
        _fit(options, DataLoader(VaryingLengths(), batch_size=1), steps=8)
    messages = [str(w.message) for w in caught if "keeps recompiling" in str(w.message)]
    assert len(messages) == 1, messages
    assert "size mismatch at index 1" in messages[0]  # dynamo's own words for the failed guard
    assert "pad to a fixed length" in messages[0]

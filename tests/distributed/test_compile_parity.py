"""Per-block torch.compile under DDP, FSDP and FSDP + activation checkpointing: the same losses as eager.

One launch of 2 CPU ranks (gloo) runs each strategy eager and compiled (inductor's C++ backend, fp32,
10 optimizer steps of the tiny GPT) and returns what the tests check. Identical blocks share one compiled
graph, and FSDP's unsharded parameters look like DDP's to the compiled block, so the three compiled runs
need two compilations (the plain block and the checkpointed one), each rank compiling its own.
"""

import pytest
from torch.utils.data import DataLoader

import shardwise
from shardwise import Trainer
from shardwise.models.gpt import Block
from shardwise.strategies import build_strategy

from helpers.lm import StepLosses, TinyGPT, token_data

# test_compile.py says why; the same settings, so the two tests share inductor's on-disk cache.
FAST_INDUCTOR = {"compile_threads": 1, "cpp.threads": 1, "cpp.vec_isa_ok": False}

STEPS = 10
RUNS = {"ddp": "ddp", "fsdp": "fsdp", "fsdp + AC": "fsdp_ac"}


def _fit(name, compile, steps=STEPS):
    shardwise.seed_everything(0)
    recorder = StepLosses()
    trainer = Trainer(
        accelerator="cpu",
        devices=2,
        strategy=build_strategy(name, blocks={Block}),
        max_steps=steps,
        callbacks=[recorder],
        enable_progress_bar=False,
        logger=False,
        enable_checkpointing=False,
        compile=compile,
    )
    trainer.fit(TinyGPT(lr=1e-2), DataLoader(token_data(n=160, seq=9), batch_size=4))
    return recorder.losses, trainer.strategy


def compare():
    import torch._inductor.config as inductor_config

    inductor_config.patch(FAST_INDUCTOR).__enter__()  # for this worker process's life
    out = {}
    for key, name in RUNS.items():
        eager, _ = _fit(name, None)
        compiled, strategy = _fit(name, True)
        out[key] = dict(
            eager=eager,
            compiled=compiled,
            names=strategy.compiled,
            units=list(getattr(strategy, "units", [])),
            wrapped=[type(m).__name__ for m in strategy.unwrap(strategy.module).model.blocks],
            recompiles=dict(strategy.recompile_watch.recompiles),
        )
    # The whole network compiled as one function under FSDP (dynamo steps around FSDP's hooks).
    compiled, strategy = _fit("fsdp", {"mode": "model", "backend": "eager"}, steps=3)
    out["fsdp, model"] = dict(eager=out["fsdp"]["eager"][:3], compiled=compiled, names=strategy.compiled)
    return out


@pytest.fixture(scope="module")
def runs():
    results = shardwise.launch(compare, devices=2)
    for key in results[0]:  # every rank saw the same reduced losses
        assert results[0][key]["compiled"] == results[1][key]["compiled"], key
    return results[0]


@pytest.mark.parametrize("key", list(RUNS) + ["fsdp, model"])
def test_compiled_losses_match_eager(runs, key):
    run = runs[key]
    assert len(run["compiled"]) == len(run["eager"]) > 0
    gap = max(abs(a - b) for a, b in zip(run["compiled"], run["eager"]))
    assert gap < 1e-4, (key, run["compiled"], run["eager"])
    assert run["compiled"][-1] < run["compiled"][0]


def test_the_blocks_are_compiled_after_checkpointing_and_sharded_after_compile(runs):
    assert runs["ddp"]["names"] == ["model.blocks.0", "model.blocks.1"]
    for key in ("fsdp", "fsdp + AC"):  # the compiled modules are the FSDP units (the root is not compiled)
        assert sorted(runs[key]["names"]) == sorted(runs[key]["units"]) == ["model.blocks.0", "model.blocks.1"]
    assert runs["fsdp"]["wrapped"] == ["FSDPBlock", "FSDPBlock"]
    assert runs["fsdp + AC"]["wrapped"] == ["FSDPCheckpointWrapper", "FSDPCheckpointWrapper"]
    assert runs["fsdp, model"]["names"] == ["model"]
    for key in RUNS:  # fixed shapes: nothing recompiles after the first step
        assert runs[key]["recompiles"] == {}, (key, runs[key]["recompiles"])

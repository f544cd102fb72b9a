"""`shardwise check` on a mixture-of-experts module: expert parallel against one process, and its refusals.

One 2-process check (ep 2: the 8 experts split 4 + 4, the tokens exchanged by all-to-all on gloo) with
accumulation 2 passes against one process with the same global batch, router losses included. A degree
the module or the processes cannot take is refused before any process starts, naming the fix.
"""

from __future__ import annotations

import shardwise
from shardwise.cli import main
from shardwise.strategies import ParallelPlan

from helpers.lm import token_data
from helpers.moe_check import TinyMoE


def test_expert_parallel_trains_as_one_process():
    data = token_data(24, seq=17, vocab=64, seed=1)
    report = shardwise.check(
        TinyMoE, data, strategy=ParallelPlan("fsdp", ep=2), devices=2, accumulate_grad_batches=2, batch_size=2
    )
    assert report.ok, report.format()
    assert report.weighted and report.global_batch == 8 and report.reference_accumulate == 2
    assert "micro-batch 4 x accumulation 2 = batch 8" in report.format()
    assert report.param_diff <= report.param_rtol and report.rows[-1].reference < report.rows[0].reference


def test_degrees_that_cannot_run_are_refused_before_launch(capsys):
    assert main(["check", "helpers.moe_check.TinyMoE", "--strategy", "fsdp", "--ep_size", "3", "--devices", "3"]) == 2
    assert "does not divide helpers.moe_check.TinyMoE's 8 experts" in capsys.readouterr().err
    assert main(["check", "helpers.moe_check.TinyMoE", "--strategy", "fsdp", "--ep_size", "4", "--devices", "2"]) == 2
    assert "does not divide the 2 data-parallel shard ranks" in capsys.readouterr().err
    assert main(["check", "helpers.scaling_modules.MeanMLP", "--strategy", "fsdp", "--ep_size", "2"]) == 2
    assert "has no experts" in capsys.readouterr().err
    assert main(["check", "helpers.moe_check.TinyMoE", "--strategy", "ddp", "--ep_size", "2"]) == 2
    assert "expert parallel runs with FSDP only" in capsys.readouterr().err

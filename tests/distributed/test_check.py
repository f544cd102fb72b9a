"""`shardwise check` on real runs: 2 CPU ranks (gloo) against one process with the same global batch.

A correct module passes under DDP and FSDP with accumulation 2; each planted mistake
(tests/helpers/scaling_modules.py) fails, and the verdict names it. Every check starts
2 worker processes once (~6 s on an idle 2-core machine) and runs the reference here.
"""

from torch.utils.data import Subset

import shardwise
from shardwise.cli import main
from shardwise.models import Block
from shardwise.strategies import ParallelPlan

from helpers import scaling_modules
from helpers.lm import TinyGPT, token_data


def _passed(report):
    assert report.ok, report.format()
    assert report.verdict.startswith("verdict: PASS")
    assert len(report.rows) == report.steps == 3
    for row in report.rows:
        assert row.rel_diff <= report.loss_rtol and row.shared == 0 and row.union_equal, report.format()
    assert report.init_name is None and report.param_diff <= report.param_rtol
    assert report.rows[-1].reference < report.rows[0].reference  # it trained


def test_the_bundled_gpt_passes_under_fsdp_with_accumulation():
    # A strategy object (pickled to the workers): FSDP with each GPT block as its own unit.
    strategy = shardwise.FSDPStrategy(auto_wrap_policy={Block})
    # One of each sequence: token_data repeats some, and a repeat read by two ranks counts as a shared sample.
    data = token_data()
    distinct = Subset(data, sorted({tuple(x.tolist()): i for i, (x,) in enumerate(data)}.values()))
    report = shardwise.check(TinyGPT, distinct, strategy=strategy, devices=2, accumulate_grad_batches=2, batch_size=4)
    _passed(report)
    assert report.global_batch == 16 and report.strategy == "FSDPStrategy (fsdp)"


def test_cli_passes_a_correct_module_under_ddp_with_accumulation(capsys):
    argv = ["check", "helpers.scaling_modules.MeanMLP", "--strategy", "ddp", "--accumulate-grad-batches", "2"]
    assert main(argv) == 0
    out = capsys.readouterr().out
    assert "global batch 16" in out and "initial weights: identical in both runs" in out
    assert (
        out.strip().splitlines()[-1].startswith("verdict: PASS, equivalent within tolerance (loss rel. diff <= 1e-05")
    )


def test_cli_names_the_same_samples_on_every_rank(capsys):
    assert main(["check", "helpers.scaling_modules.SameSamplesMLP", "--devices", "2"]) == 1
    lines = capsys.readouterr().out.strip().splitlines()
    assert lines[-2].startswith("verdict: FAIL, every rank trained on the same samples"), lines
    assert lines[-1].startswith("  fix: let the Trainer shard the data")


def test_a_loss_summed_without_its_weight_is_named():
    report = shardwise.check(scaling_modules.SummedLossMLP, strategy=ParallelPlan("fsdp"), accumulate_grad_batches=2)
    assert report.cause.kind == "summed_loss", report.format()
    assert "1/4 = 1/(devices x accumulation)" in report.cause.summary
    assert "define loss_weight()" in report.cause.fix
    assert all(row.union_equal for row in report.rows)  # the data was right: only the loss is off
    assert abs(report.rows[0].run / report.rows[0].reference - 0.25) < 1e-6


def test_a_buffer_only_rank_zero_updates_is_named():
    report = shardwise.check(scaling_modules.RankZeroBufferMLP, strategy="fsdp")
    assert report.cause.kind == "rank_state", report.format()
    assert report.cause.summary.startswith("buffer feature_mean differs across ranks")
    assert [name for name, _ in report.buffers_across_ranks] == ["feature_mean"]


def test_a_summed_loss_with_loss_weight_passes():
    # The Trainer divides the summed losses by the step's global weight (TrainModule.loss_weight).
    report = shardwise.check(scaling_modules.WeightedLossMLP, strategy="ddp", accumulate_grad_batches=2)
    assert report.weighted
    _passed(report)


def test_a_mean_over_a_varying_count_fails_and_points_to_loss_weight():
    # The mistake issue 20 measured: each micro-batch's mean over its own unmasked positions.
    report = shardwise.check(scaling_modules.TokenMeanMLP, strategy="fsdp", accumulate_grad_batches=2)
    assert report.cause.kind == "differs", report.format()
    assert report.rows[0].rel_diff > 1e-4 and all(row.union_equal for row in report.rows)
    assert "define loss_weight(batch)" in report.cause.fix

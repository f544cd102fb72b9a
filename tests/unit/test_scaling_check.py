"""`shardwise check` without worker processes: naming the module, typing its init args, hashing samples,
the one-process run, and the verdict's order of causes on records built by hand."""

import os
import random

import pytest
import torch

from shardwise.cli import main
from shardwise.cli.check import translate
from shardwise.scaling import CheckSetupError, check
from shardwise.scaling.record import Job, MicroBatch, RankRecord, digest, run_here, sample_hashes
from shardwise.scaling.target import DataSource, ModuleSource, load_target
from shardwise.scaling.verdict import ScalingReport, compare

from helpers import scaling_modules

SCRIPT = """
import torch
from shardwise import TrainModule

class First(TrainModule):
    def __init__(self, width: int = 3):
        super().__init__()
        self.width = width

class Second(First):
    pass

if __name__ == "__main__":
    raise SystemExit("a check imports the script; this block must not run")
"""


# ------------------------------------------------------------------ naming the module
def test_a_script_is_imported_not_run_and_its_module_named(tmp_path):
    script = tmp_path / "train_two.py"
    script.write_text(SCRIPT)
    with pytest.raises(CheckSetupError, match=r"several TrainModules \(First, Second\): name one, .*:First"):
        load_target(str(script))
    assert load_target(f"{script}:Second").__name__ == "Second"
    one = tmp_path / "train_one.py"
    one.write_text(SCRIPT.replace("class Second(First):\n    pass\n", ""))
    assert load_target(f"python:{one}").__name__ == "First"


def test_a_relative_script_path_is_made_absolute_for_the_workers(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "mine.py").write_text(SCRIPT)
    source = ModuleSource("mine.py:First", {"width": 5})
    assert source.target == os.path.join(str(tmp_path), "mine.py") + ":First"
    assert source.build().width == 5


def test_init_args_are_typed_against_the_signature():
    source = ModuleSource("helpers.scaling_modules.MeanMLP", {"hidden": "8", "lr": 0.5})
    module = source.build()
    assert isinstance(module, scaling_modules.MeanMLP) and module.hidden == 8 and module.lr == 0.5
    with pytest.raises(CheckSetupError, match="hiden"):
        ModuleSource("helpers.scaling_modules.MeanMLP", {"hiden": 8}).validate()
    with pytest.raises(CheckSetupError, match="cannot import"):
        ModuleSource("helpers.scaling_modules.NoSuchModule").validate()


def test_nested_init_args_on_the_command_line_are_merged():
    argv = ["x.Y", "--init_args.config.n_layer", "2", "--init_args.lr", "0.1", "--init_args.config.rope=true"]
    assert translate(argv) == ["x.Y", "--init_args.lr", "0.1", "--init_args.config", '{"n_layer": 2, "rope": true}']


def test_usage_mistakes_exit_2_before_any_process_starts(capsys, tmp_path):
    assert main(["check", "helpers.scaling_modules.MeanMLP", "--init_args.hiden", "3"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("shardwise check: error: init args for MeanMLP") and len(err.splitlines()) == 1
    config = tmp_path / "check.yaml"  # the module and its init args from a YAML file, merged with flags
    config.write_text("target: helpers.scaling_modules.MeanMLP\ninit_args: {hidden: 8}\nstrategy: fsdp\n")
    assert main(["check", "--config", str(config), "--init_args.hiden", "3"]) == 2
    assert "init args for MeanMLP" in capsys.readouterr().err
    assert main(["check", "no_such_package.Model"]) == 2
    assert "cannot import" in capsys.readouterr().err
    assert main(["check", "helpers.scaling_modules.MeanMLP", "--devices", "0"]) == 2
    assert "devices must be a positive integer" in capsys.readouterr().err


def test_too_little_data_for_the_steps_is_refused_by_the_one_process_run():
    with pytest.raises(CheckSetupError, match=r"96 samples; 3 steps of a global batch of 64 need 192"):
        check(scaling_modules.MeanMLP, batch_size=8, devices=4, accumulate_grad_batches=2)


# ------------------------------------------------------------------ what a run records
def test_a_sample_hashes_the_same_in_any_batch_and_position():
    x, y = torch.arange(12.0).reshape(6, 2), torch.arange(6)
    whole = sample_hashes([x, y])
    assert len(set(whole)) == 6
    assert sample_hashes([x[[4, 1]], y[[4, 1]]]) == [whole[4], whole[1]]
    assert sample_hashes({"y": y[:2], "x": x[:2]}) == sample_hashes({"x": x[:2], "y": y[:2]})
    assert sample_hashes({"text": ["a", "b"], "ids": y[:2]}) != sample_hashes({"text": ["b", "a"], "ids": y[:2]})
    assert digest(torch.zeros(2)) != digest(torch.zeros(2, dtype=torch.float64))


def test_the_one_process_run_records_every_step_and_leaves_the_generators_alone(tmp_path):
    random.seed(7)
    torch.manual_seed(7)
    before = (random.random(), torch.rand(1))
    random.seed(7)
    torch.manual_seed(7)
    job = Job(ModuleSource(scaling_modules.MeanMLP), DataSource(), "single", 1, 1, 2, 2, 42, str(tmp_path))
    record = run_here(job)
    assert (random.random(), torch.rand(1)) == before
    assert [m.step for m in record.micro] == [0, 1] and record.micro_batch_size == 4
    assert all(len(m.samples) == 8 and m.loss > 0 for m in record.micro)
    assert record.param_names == ["net.0.bias", "net.0.weight", "net.2.bias", "net.2.weight"]
    assert not torch.equal(record.initial["net.0.weight"], record.final["net.0.weight"])


# ------------------------------------------------------------------ the verdict, on records built by hand
def _record(rank, micro, params, buffers=None, initial=None, dropout=()):
    initial = dict(params if initial is None else initial)
    return RankRecord(
        rank=rank,
        world_size=2,
        micro_batch_size=2,
        dataset_size=None,
        seconds=0.0,
        micro=micro,
        param_names=sorted(params),
        initial=initial if rank == 0 else {},
        final={**params, **(buffers or {})} if rank == 0 else {},
        initial_digests={k: digest(v) for k, v in initial.items()},
        final_digests={k: digest(v) for k, v in params.items()},
        buffers=dict(buffers or {}),
        dropout=list(dropout),
    )


def _verdict(ref, ranks, accumulate=1):
    settings = ScalingReport("m", "ddp", 2, accumulate, 2, 1, loss_rtol=1e-5, param_rtol=1e-5)
    return compare(ref, ranks, settings)


W = {"w": torch.ones(3)}


def test_equal_runs_pass():
    ref = _record(0, [MicroBatch(0, 0, 2.0, None, ["a", "b", "c", "d"])], W)
    ranks = [
        _record(0, [MicroBatch(0, 0, 1.5, None, ["a", "c"])], W),
        _record(1, [MicroBatch(0, 0, 2.5, None, ["b", "d"])], W),
    ]
    report = _verdict(ref, ranks)
    assert report.ok and report.rows[0].rel_diff == 0 and report.rows[0].union_equal and "PASS" in report.format()


def test_weighted_losses_are_summed_over_the_global_weight():
    ref = _record(0, [MicroBatch(0, 0, 12.0, 6.0, ["a", "b", "c", "d"])], W)
    ranks = [
        _record(0, [MicroBatch(0, 0, 2.0, 1.0, ["a", "c"])], W),
        _record(1, [MicroBatch(0, 0, 10.0, 5.0, ["b", "d"])], W),
    ]
    report = _verdict(ref, ranks)
    assert report.weighted and report.rows[0].run == 2.0 and report.ok  # (2 + 10) / (1 + 5), not mean(2/1, 10/5)


def test_initial_weights_that_differ_come_first():
    ref = _record(0, [MicroBatch(0, 0, 2.0, None, ["a", "b", "c", "d"])], W, initial={"w": torch.zeros(3)})
    ranks = [
        _record(0, [MicroBatch(0, 0, 2.0, None, ["a", "a"])], W),
        _record(1, [MicroBatch(0, 0, 2.0, None, ["a", "a"])], W),
    ]
    report = _verdict(ref, ranks)
    assert report.cause.kind == "init" and "not reproducible from the seed" in report.cause.summary


def test_a_loss_divided_by_the_accumulation_by_hand_is_a_scaled_loss():
    ref = _record(0, [MicroBatch(0, 0, 2.0, None, list("abcdefgh"))], W)
    ranks = [
        _record(0, [MicroBatch(0, 0, 1.0, None, ["a", "c"]), MicroBatch(0, 1, 1.0, None, ["e", "g"])], W),
        _record(1, [MicroBatch(0, 0, 1.0, None, ["b", "d"]), MicroBatch(0, 1, 1.0, None, ["f", "h"])], W),
    ]
    report = _verdict(ref, ranks, accumulate=2)
    assert report.cause.kind == "scaled_loss" and "0.5 x the 1-process loss" in report.cause.summary


def test_disjoint_samples_from_another_order_are_named_when_the_numbers_differ():
    ref = _record(0, [MicroBatch(0, 0, 2.0, None, ["a", "b", "c", "d"])], W)
    ranks = [
        _record(0, [MicroBatch(0, 0, 2.2, None, ["a", "e"])], W),
        _record(1, [MicroBatch(0, 0, 2.0, None, ["b", "f"])], W),
    ]
    report = _verdict(ref, ranks)
    assert report.cause.kind == "data_order" and report.rows[0].shared == 0 and not report.rows[0].union_equal


def test_beyond_tolerance_says_by_how_much_and_mentions_dropout():
    ref = _record(0, [MicroBatch(0, 0, 2.0, None, ["a", "b", "c", "d"])], W)
    moved = {"w": torch.tensor([1.0, 1.0, 1.1])}
    ranks = [
        _record(0, [MicroBatch(0, 0, 2.0, None, ["a", "c"])], moved, initial=W, dropout=["drop"]),
        _record(1, [MicroBatch(0, 0, 2.0, None, ["b", "d"])], moved, initial=W),
    ]
    report = _verdict(ref, ranks)
    assert report.cause.kind == "differs" and "parameters rel. diff 0.0577" in report.cause.summary
    assert "drops at random (drop)" in report.cause.fix and report.param_name == "w"


def test_a_buffer_computed_from_each_ranks_share_is_named_last():
    ref = _record(0, [MicroBatch(0, 0, 2.0, None, ["a", "b", "c", "d"])], W, buffers={"seen": torch.tensor(4.0)})
    mine = {"seen": torch.tensor(2.0)}
    ranks = [
        _record(0, [MicroBatch(0, 0, 2.0, None, ["a", "c"])], W, mine),
        _record(1, [MicroBatch(0, 0, 2.0, None, ["b", "d"])], W, mine),
    ]
    report = _verdict(ref, ranks)
    assert report.cause.kind == "reference_buffer" and report.buffers_vs_reference[0][0] == "seen"

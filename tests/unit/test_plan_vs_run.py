"""The plan checked against the run it planned (issue 23.3): plan/runcheck.PlanCheck on real CPU runs.

A fit with `device_memory` plans its configuration first; after two optimizer
steps the tracked peak is compared with the prediction, logged, and a
difference over 10% is a warning naming the term that differs most. The
demo's model and batch (`shardwise demo`'s defaults, one process) must stay
quiet; a planted mis-prediction -- the planner fed a model twice as deep --
must warn.
"""

from __future__ import annotations

import warnings

import pytest
from torch.utils.data import DataLoader

from shardwise import Trainer
from shardwise.demos import LanguageModel, load_text_dataset
from shardwise.plan import plan
from shardwise.plan.runcheck import PlanCheck, Prediction, compare

DEMO = dict(nlayers=8, nhid=1024, ninp=128, nhead=4)  # cli/demo.py's defaults
SMALL = dict(nlayers=2, nhid=256, ninp=64, nhead=4)


@pytest.fixture(scope="module")
def demo_data():
    dataset = load_text_dataset(None, block_size=32)
    return dataset, DataLoader(dataset, batch_size=4, shuffle=False)


def _trainer(**kwargs):
    return Trainer(
        accelerator="cpu",
        devices=1,
        strategy="single",
        max_steps=2,
        enable_progress_bar=False,
        logger=False,
        enable_checkpointing=False,
        **kwargs,
    )


def _off_warnings(record):
    return [str(w.message) for w in record if "prediction is off" in str(w.message)]


def test_planned_demo_run_is_checked_and_stays_quiet(demo_data, capsys):
    dataset, loader = demo_data
    trainer = _trainer(device_memory="8GiB")
    with warnings.catch_warnings(record=True) as record:
        warnings.simplefilter("always")
        trainer.fit(LanguageModel(dataset.vocab_size, **DEMO), loader)
    check = next(c for c in trainer.callbacks if isinstance(c, PlanCheck))
    assert check.result is not None, "the planned run was not checked"
    assert abs(check.result["plan/peak_difference"]) < 0.10, check.result
    assert check.result["plan/measured_peak_bytes"] > 0
    assert not _off_warnings(record)
    assert "shardwise plan check" in capsys.readouterr().out


def test_planted_misprediction_warns_and_names_the_term(demo_data):
    dataset, loader = demo_data
    deeper = LanguageModel(dataset.vocab_size, **dict(SMALL, nlayers=8))  # the planner fed a wrong model size
    wrong = plan(deeper, example_batch=next(iter(loader)), batch_size=4, accelerator="cpu", candidates=["ddp"])
    check = PlanCheck(Prediction.from_estimate(wrong.estimates[0], "cpu"))
    trainer = _trainer(callbacks=[check])
    with warnings.catch_warnings(record=True) as record:
        warnings.simplefilter("always")
        trainer.fit(LanguageModel(dataset.vocab_size, **SMALL), loader)
    (message,) = _off_warnings(record)
    assert check.result["plan/peak_difference"] < -0.10
    # Four times the layers: parameters, gradients and optimizer state all grow; the optimizer state most.
    assert "optimizer differ most" in message, message


def test_compare_names_the_largest_difference_and_gpu_falls_back_to_the_largest_term():
    pred = Prediction("x", allocated=100.0, reserved=110.0, breakdown=dict(parameters=10, optimizer=60, activations=30))
    diff, term, want, got = compare(pred, 150.0, dict(parameters=10, optimizer=60, activations=70, other=10), 0.1)
    assert diff == pytest.approx(0.5) and term == "activations" and (want, got) == (30, 80)
    assert compare(pred, 150.0, None, 0.1)[1] == "optimizer"  # no breakdown on CUDA: the largest predicted term

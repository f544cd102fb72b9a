"""A Lightning 2.x script changed only in its imports runs and behaves as under Lightning (issue 24).

port.py uses setup() to build its data, on_before_optimizer_step to log a gradient norm,
ReduceLROnPlateau on val_loss, EarlyStopping and a Callback subclass. The reference is the same
script run under Lightning 2.6.6 (tests/fixtures/lightning_port_reference.json): every epoch's
metrics as a callback saw them, the epoch EarlyStopping stopped at, the final learning rate
(ReduceLROnPlateau halved it twice) and the weights must match.
"""

from __future__ import annotations

import json
import os

import pytest
from lightning_compat import port

import shardwise

REFERENCE = json.load(open(os.path.join(os.path.dirname(__file__), "..", "fixtures", "lightning_port_reference.json")))
LIGHTNING = REFERENCE["single"]


def _assert_like_lightning(result, rel, per_rank=()):
    assert result["stopped_epoch"] == LIGHTNING["stopped_epoch"] > 0  # EarlyStopping stopped it, not max_epochs
    assert result["global_step"] == LIGHTNING["global_step"] and result["batches"] == LIGHTNING["batches"]
    assert result["wait_count"] == LIGHTNING["wait_count"]
    assert result["lr"] == pytest.approx(LIGHTNING["lr"], rel=1e-12) and result["lr"] < port.Regression().lr
    assert len(result["epochs"]) == len(LIGHTNING["epochs"])
    for mine, theirs in zip(result["epochs"], LIGHTNING["epochs"]):
        assert mine.keys() == theirs.keys()
        for name, value in theirs.items():
            if name in per_rank:
                continue
            assert mine[name] == (value if value is None else pytest.approx(value, rel=rel, abs=1e-7)), name
    assert result["weights"] == pytest.approx(LIGHTNING["weights"], rel=rel, abs=1e-6)


def test_the_ported_script_behaves_as_under_lightning():
    result = port.main()
    assert result["prepared"] == 1
    _assert_like_lightning(result, rel=1e-6)


def run_port_on_ranks():
    # The same global batches over two ranks: 8 + 8 training samples per step, 6 + 6 (then 4 + 4) per
    # validation batch, so the run is the one-process run up to float rounding.
    return port.main(batch_size=8, val_batch_size=6, devices=2, strategy="ddp", accelerator="cpu")


@pytest.mark.slow
def test_the_ported_script_under_two_processes_behaves_as_under_lightning():
    ranks = shardwise.launch(run_port_on_ranks, devices=2)
    assert [r["prepared"] for r in ranks] == [1, 0]  # prepare_data: local rank 0 only
    for result in ranks:  # every rank stops at the same epoch: EarlyStopping's decision is agreed
        _assert_like_lightning(result, rel=1e-4, per_rank=("train_loss_epoch",))
    # train_loss is logged without sync_dist: each rank's own mean, as in Lightning; together, the global one.
    for epoch, theirs in enumerate(LIGHTNING["epochs"]):
        mean = sum(r["epochs"][epoch]["train_loss_epoch"] for r in ranks) / 2
        assert mean == pytest.approx(theirs["train_loss_epoch"], rel=1e-4)

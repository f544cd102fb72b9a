"""Lightning's own examples, changed only by the package rename, give Lightning 2.6.6's numbers.

tests/lightning_compat/ports/ holds the scripts (each with a header naming where it came from and its
licence); port_harness.py runs them and reads the last Trainer's callback_metrics and weights;
tests/fixtures/lightning_ports_reference.json holds the same run under Lightning 2.6.6 / torch 2.13
(recorded by tests/fixtures/record_lightning_ports.py). One process is compared within 1e-5 relative;
DDP and FSDP on two processes (one launch) must run the script through.
"""

from __future__ import annotations

import json
import math
import os

import pytest
from port_harness import PORTS, run_port

import shardwise

REFERENCE = json.load(open(os.path.join(os.path.dirname(__file__), "..", "fixtures", "lightning_ports_reference.json")))


def _close(a: float, b: float) -> bool:
    return math.isclose(a, b, rel_tol=1e-5, abs_tol=1e-7)


# transformer.py shuffles its training loader (shuffle=True): shardwise replaces that sampler with its
# resumable one, whose order is not torch's RandomSampler's (docs/coming-from.md), so the batches differ:
# test_loss 7.046532 vs Lightning's 7.046696 after 3 steps (2.3e-5 relative). With shuffle=False in both
# runs (measured by editing a scratch copy) they agree: 7.0464493 vs 7.0464492, the same weights. strict:
# the day the orders agree, this marker must go.
ONE_PROCESS = [
    pytest.param(name, marks=pytest.mark.xfail(strict=True, reason="the shuffled loader's order differs, see above"))
    if name == "transformer"
    else name
    for name in sorted(PORTS)
]


@pytest.mark.parametrize("name", ONE_PROCESS)
def test_port_gives_lightnings_numbers_on_one_process(name, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)  # the scripts write into the working directory, as under Lightning
    got, want = run_port(name, accelerator="cpu"), REFERENCE[name]
    assert sorted(got["callback_metrics"]) == sorted(want["callback_metrics"])
    for key, value in want["callback_metrics"].items():
        assert _close(got["callback_metrics"][key], value), (key, got["callback_metrics"][key], value)
    assert got["global_step"] == want["global_step"]
    assert sorted(got["weights"]) == sorted(want["weights"])
    for key, values in want["weights"].items():
        assert all(_close(a, b) for a, b in zip(got["weights"][key], values)), key


def _on_two_ranks(folder: str) -> dict:
    out = {}
    for strategy in ("ddp", "fsdp"):
        os.makedirs(os.path.join(folder, strategy), exist_ok=True)
        os.chdir(os.path.join(folder, strategy))
        out[strategy] = {
            name: run_port(name, accelerator="cpu", devices=2, strategy=strategy)["global_step"] for name in PORTS
        }
    return out


def test_ports_run_under_ddp_and_fsdp_on_two_processes(tmp_path):
    steps = shardwise.launch(_on_two_ranks, str(tmp_path), devices=2)
    for strategy in ("ddp", "fsdp"):
        for name in PORTS:
            assert steps[0][strategy][name] == steps[1][strategy][name] == REFERENCE[name]["global_step"]

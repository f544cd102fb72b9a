"""Lightning's own examples, changed only by the package rename, give Lightning 2.6.6's numbers.

tests/lightning_compat/ports/ holds the scripts (each with a header naming where it came from and its
licence); port_harness.py runs them as `python <script>` would and reads the last Trainer's callback_metrics
after each of its fit / test / predict calls, its global step and its weights;
tests/fixtures/lightning_ports_reference.json holds the same runs under Lightning 2.6.6 / torch 2.13
(recorded by tests/fixtures/record_lightning_ports.py). One process is compared within 1e-5 relative; under
ddp and fsdp on two processes (one launch for all) each script must run to its end.
"""

from __future__ import annotations

import json
import math
import os

import pytest
from port_harness import PORTS, run_port
from rank_zero_case import rank_zero_runs

import shardwise

REFERENCE = json.load(open(os.path.join(os.path.dirname(__file__), "..", "fixtures", "lightning_ports_reference.json")))
# The FSDP guide on one process runs its own FSDPStrategy (activation checkpointing and units of its layers);
# Lightning refuses FSDP without CUDA, so its numbers are the same script's on one device (strategy "auto").
# autoencoder.py's ImageSampler callback is @rank_zero_only and runs the model's forward on rank 0 alone: under
# FSDP rank 1 joins the all-gather of each unit that forward goes through, as rank 0 names them
# (trainer/hooks.py), so the forward does not wait for a rank that never comes (Lightning waits forever there).
TWO_PROCESSES = [(s, name) for s in ("ddp", "fsdp") for name in PORTS]
# On two processes one batch of each loader is enough to run every hook and call of a script to its end.
ONE_BATCH = {f"limit_{stage}_batches": 1 for stage in ("train", "val", "test")}
STEPS_PER_BATCH = {"generative_adversarial_net": 2}  # manual optimisation: each optimizer's step counts


def _close(a: float, b: float) -> bool:
    return math.isclose(a, b, rel_tol=1e-5, abs_tol=1e-7)


@pytest.mark.parametrize("name", PORTS)
def test_port_gives_lightnings_numbers_on_one_process(name, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)  # the scripts write into the working directory, as under Lightning
    got, want = run_port(name, accelerator="cpu"), REFERENCE[name]
    assert sorted(got["callback_metrics"]) == sorted(want["callback_metrics"])  # the same calls, in order
    for stage, metrics in want["callback_metrics"].items():
        assert sorted(got["callback_metrics"][stage]) == sorted(metrics), stage
        for key, value in metrics.items():
            assert _close(got["callback_metrics"][stage][key], value), (stage, key, got["callback_metrics"][stage])
    assert got["global_step"] == want["global_step"]
    assert sorted(got["weights"]) == sorted(want["weights"])
    for key, values in want["weights"].items():
        assert all(_close(a, b) for a, b in zip(got["weights"][key], values)), key


def _on_two_ranks(folder: str) -> dict:
    out = {}
    for strategy, name in TWO_PROCESSES:
        os.makedirs(os.path.join(folder, strategy, name), exist_ok=True)  # both ranks make it
        os.chdir(os.path.join(folder, strategy, name))
        # The FSDP guide's own FSDPStrategy(auto_wrap_policy=..., activation_checkpointing_policy=...) is fsdp.
        extra = {} if (strategy, name) == ("fsdp", "fsdp_guide") else {"strategy": strategy}
        result = run_port(name, accelerator="cpu", devices=2, **ONE_BATCH, **extra)
        out[f"{strategy}/{name}"] = result["global_step"], sorted(result["callback_metrics"])
    out["rank_zero_hooks"] = rank_zero_runs()
    return out


@pytest.fixture(scope="module")
def two_ranks(tmp_path_factory):
    """One two-process launch for every two-process case of this file."""
    return shardwise.launch(_on_two_ranks, str(tmp_path_factory.mktemp("ports")), devices=2)


def test_ports_run_under_ddp_and_fsdp_on_two_processes(two_ranks):
    ranks = two_ranks
    for strategy, name in TWO_PROCESSES:
        # Every call of the script ran to its end on both ranks, each taking one batch's steps.
        want = STEPS_PER_BATCH.get(name, 1), sorted(REFERENCE[name]["callback_metrics"])
        assert ranks[0][f"{strategy}/{name}"] == ranks[1][f"{strategy}/{name}"] == want, (strategy, name)


# All-gathers counted on each rank around the marked callback hooks: Quiet's (no forward) at each batch end,
# Sampler's at each validation end (one forward) and each training epoch end, which follows validation (two
# forwards). FULL_SHARD gathers each unit a forward goes through (the root, its LayerNorm, and the two Linears),
# sharded again after it. SHARD_GRAD_OP left the Linears whole after validation's forwards, on every rank alike:
# the hook's forwards gather only the root, once each, and leave the Linears as they found them.
GATHERS = {
    "FULL_SHARD": {"on_train_batch_end": [0] * 4, "on_validation_epoch_end": [3, 3], "on_train_epoch_end": [6, 6]},
    "SHARD_GRAD_OP": {"on_train_batch_end": [0] * 4, "on_validation_epoch_end": [1, 1], "on_train_epoch_end": [2, 2]},
}
# After fit, a marked hook whose forward raises in the first Linear (the root and that Linear gathered), then
# one that samples: every unit gathered again, as rank 0 left them all sharded (the Linears whole under
# SHARD_GRAD_OP, as validation left them).
AFTER_ERROR = {"FULL_SHARD": ([2], [3]), "SHARD_GRAD_OP": ([1], [1])}


@pytest.mark.parametrize("sharding", GATHERS)
def test_rank_zero_only_hooks_run_their_forward_under_fsdp(two_ranks, sharding):
    import torch

    rank0, rank1 = (ranks["rank_zero_hooks"][sharding] for ranks in two_ranks)
    # Rank 0 ran the callback's and the module's hook once per epoch, rank 1 neither.
    assert len(rank0["module"]) == len(rank0["validation"]) == 2 and len(rank0["callback"]) == 3
    assert rank1["module"] == rank1["callback"] == rank1["validation"] == []
    # Quiet's hook ran no forward: it ran on rank 0 at each batch end and gathered nothing on either rank.
    assert rank0["quiet"] == [1, 2, 3, 4] and rank1["quiet"] == []
    # Rank 1 joined each all-gather of rank 0's forwards, and only those.
    broken, after = AFTER_ERROR[sharding]
    want = {**GATHERS[sharding], "broken_sample": broken, "sample_after_error": after}
    assert rank0["all_gathers"] == rank1["all_gathers"] == want
    assert "mat1 and mat2 shapes cannot be multiplied" in rank0["error"] and "error" not in rank1
    # Rank 0's forwards in the last epoch's hooks give what the trained model, whole, gives.
    (after_error,) = rank0["callback"][-1]  # sampled after fit, after the hook that raised
    assert torch.equal(after_error, rank0["validation"][-1])
    first, second = rank0["callback"][-2]
    assert torch.equal(first, second) and torch.equal(first, rank0["validation"][-1])
    assert torch.allclose(first, rank0["expected"], rtol=1e-5, atol=1e-6)
    assert torch.allclose(rank0["module"][-1], rank0["expected"], rtol=1e-5, atol=1e-6)
    # Training and validation around the hooks computed bit for bit what they compute without them, on both ranks.
    assert rank0["val_loss"] == rank0["val_loss_without_hooks"] and rank1["val_loss"] == rank1["val_loss_without_hooks"]
    for key, value in rank0["state_without_hooks"].items():
        assert torch.equal(rank0["state"][key], value), key
        assert torch.equal(rank1["state"][key], value), key

"""Expert parallel (ep) on the bundled GPT-MoE against one process: losses, weights, resume across layouts.

A tiny GPT-MoE (8 experts, top-2, 2 blocks) trains in fp32 with SGD and gradient clipping (one norm over the
experts' mesh and the others') on the same global batch of 8 sequences with accumulation 2, returning the
SUMMED cross-entropy plus the router losses (load balancing, coef 0.1, and z-loss) with `loss_weight` counting
the target tokens: 1 process; 2 processes at ep 2 (each rank holds 4 experts and reads its own 4 samples per
step); 4 processes at dp2 x ep2 (FSDP shards the experts over 2 ranks and the rest over 4); 4 processes at
sp2 x ep2 (Ulysses sequence parallel: each sp pair reads the same 2 samples per micro-batch and routes its half
of the sequence; the experts' gradients are summed over the sp ranks by their FSDP unit, the router losses
count each sp rank's slice as the replicated cross-entropy counts the whole sequence). Per-step losses
(aux included: the router losses are global, so they add the same amount at every layout) and the final
weights agree with one process within 1e-5 relative; SGD moves weights in proportion to the gradient, so an
expert gradient off by the ep factor would show. The ep 2 run checkpoints its blocks (activation
checkpointing: the token all-to-alls run again in the recomputation). Kill and resume: the dp2 x ep2 run,
checkpointing at step 2, has its 4 workers SIGKILLed at once after step 3 (checkpoint_kill_script.py); its
`last` checkpoint resumes under dp2 x ep2 (in the 4-process launch: steps 3-4 and
the final weights bitwise those of the uninterrupted run there), at ep 1 on 2 processes (in the 2-process
launch) and on one process (here) within 1e-5. The per-expert token counts the model keeps are the global
ones on every rank (they sum to tokens x top_k per layer). The dp2 x ep2 run's trained weights, written as a
Hugging Face Mixtral folder, load with AutoModelForCausalLM and give the GPT-MoE's logits within 1e-4.
"""

from __future__ import annotations

import json
import os
import signal
from typing import Any, Dict, List

import pytest
import torch
from checkpoint_kill_script import killed_expert_parallel_run

import shardwise
from shardwise.checkpoint import layout
from shardwise.distributed.launch import WorkerFailedError
from shardwise.models.gpt_moe import save_as_mixtral

from helpers.moe_runs import GLOBAL_BATCH, SAVE_AT, SEQ, STEPS, TinyMoE, data, train

KILL_AT = 3


def two_processes(killed: str) -> Dict[str, Any]:
    """ep 2 from scratch (with activation checkpointing: the all-to-alls run again in the recomputation), then
    the killed dp2 x ep2 run's last checkpoint resumed as plain FSDP (ep 1)."""
    return {"ep2": train(2, 2, ac=True), "resumed_ep1": train(2, 1, root=killed, ckpt_path="last")}


def four_processes(killed: str) -> Dict[str, Any]:
    """dp2 x ep2 uninterrupted, then the killed dp2 x ep2 run resumed from its last checkpoint, then sp2 x ep2
    (the sp pairs read the same samples and split their sequence; the ep pairs exchange tokens of one slice)."""
    return {
        "straight": train(4, 2),
        "resumed": train(4, 2, root=killed, ckpt_path="last"),
        "sp2xep2": train(4, 2, sp=2),
    }


def killed_dp2_ep2(root: str) -> Dict[str, Any]:
    """The dp2 x ep2 run (checkpoint at step SAVE_AT) with all 4 workers SIGKILLed after step KILL_AT: its
    per-step losses and the checkpoint it committed last."""
    with pytest.raises(WorkerFailedError) as failed:
        shardwise.launch(killed_expert_parallel_run, root, KILL_AT, devices=4)
    assert failed.value.exitcode == 128 + signal.SIGKILL, failed.value
    last = layout.latest_checkpoint(os.path.join(root, "checkpoints"))
    assert last is not None and layout.read_manifest(last)["global_step"] == SAVE_AT, last
    with open(os.path.join(root, "losses.jsonl")) as fh:
        losses = [float(json.loads(line)["loss"]) for line in fh if line.strip()]
    return {"losses": losses, "checkpoint": last}


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    killed = str(tmp_path_factory.mktemp("ep-killed"))
    out = {"one": train(1, 1), "killed": killed_dp2_ep2(killed)}
    out["four"] = shardwise.launch(four_processes, killed, devices=4)
    out["two"] = shardwise.launch(two_processes, killed, devices=2)
    out["one_resumed"] = train(1, 1, root=killed, ckpt_path="last")
    return out


def _rel(a: List[float], b: List[float]) -> float:
    assert len(a) == len(b) == STEPS, (a, b)
    return max(abs(x - y) / abs(y) for x, y in zip(a, b))


def _close_weights(got: Dict[str, torch.Tensor], want: Dict[str, torch.Tensor]) -> None:
    assert set(got) == set(want)
    for name, value in want.items():
        torch.testing.assert_close(got[name], value, rtol=1e-5, atol=1e-6, msg=name)


def test_ep2_and_dp2_ep2_match_one_process_with_accumulation_and_router_losses(runs):
    one = runs["one"]
    assert one["losses"][-1] < one["losses"][0]  # it learns
    four = runs["four"][0]
    for name, result in (("ep2", runs["two"][0]["ep2"]), ("dp2xep2", four["straight"]), ("sp2xep2", four["sp2xep2"])):
        assert _rel(result["losses"], one["losses"]) < 1e-5, (name, result["losses"], one["losses"])
        _close_weights(result["weights"], one["weights"])
        # the per-expert counts are global: the same on every layout, tokens x top_k per layer and step
        for got, want in zip(result["counts"], one["counts"]):
            assert torch.equal(got, want), name
            assert got.sum(1).tolist() == [GLOBAL_BATCH * SEQ * 2] * 2
    for ranks, key in ((runs["two"], "ep2"), (runs["four"], "straight"), (runs["four"], "sp2xep2")):  # same on all
        assert all(r[key]["losses"] == ranks[0][key]["losses"] for r in ranks)


def test_sigkilled_dp2_ep2_resumes_bitwise_and_at_ep1_and_one_process_close(runs):
    straight, resumed, killed = runs["four"][0]["straight"], runs["four"][0]["resumed"], runs["killed"]
    # the killed run did steps 1..KILL_AT (the same as the uninterrupted run's) and committed step SAVE_AT only
    assert killed["losses"] == straight["losses"][:KILL_AT], (killed["losses"], straight["losses"])
    assert resumed["losses"] == straight["losses"][SAVE_AT:]
    for name, value in straight["weights"].items():
        assert torch.equal(resumed["weights"][name], value), name
    for got in (runs["two"][0]["resumed_ep1"], runs["one_resumed"]):
        after = straight["losses"][SAVE_AT:]
        assert len(got["losses"]) == len(after)
        assert max(abs(x - y) / abs(y) for x, y in zip(got["losses"], after)) < 1e-5, (got["losses"], after)
        _close_weights(got["weights"], straight["weights"])


def test_the_trained_dp2_ep2_weights_export_to_a_folder_transformers_loads(runs, tmp_path):
    from transformers import AutoModelForCausalLM

    trained = {n[len("model.") :]: v for n, v in runs["four"][0]["straight"]["weights"].items()}
    module = TinyMoE()
    module.configure_model()
    module.model.load_state_dict(trained)
    save_as_mixtral(trained, module.model.config, str(tmp_path))
    exported = AutoModelForCausalLM.from_pretrained(str(tmp_path)).eval()
    ids = data().tensors[0][:2, :SEQ]
    with torch.no_grad():
        torch.testing.assert_close(exported(ids).logits, module.model.eval()(ids), rtol=1e-4, atol=1e-4)

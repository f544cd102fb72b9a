"""Expert parallel (ep) on the bundled GPT-MoE against one process: losses, weights, resume across layouts.

A tiny GPT-MoE (8 experts, top-2, 2 blocks) trains in fp32 with SGD and gradient clipping (one norm over the
experts' mesh and the others') on the same global batch of 8 sequences with accumulation 2, returning the
SUMMED cross-entropy plus the router losses (load balancing, coef 0.1, and z-loss) with `loss_weight` counting
the target tokens: 1 process; 2 processes at ep 2 (each rank holds 4 experts and reads its own 4 samples per
step); 4 processes at dp2 x ep2 (FSDP shards the experts over 2 ranks and the rest over 4). Per-step losses
(aux included: the router losses are global, so they add the same amount at every layout) and the final
weights agree with one process within 1e-5 relative; SGD moves weights in proportion to the gradient, so an
expert gradient off by the ep factor would show. The ep 2 run checkpoints its blocks (activation
checkpointing: the token all-to-alls run again in the recomputation). The dp2 x ep2 launch also saves a
checkpoint at step 2, resumes from it in the same processes (bitwise the same steps 3-4 and final weights as
the run that saved it), and the checkpoint resumes at ep 1 on 2 processes (in the 2-process launch) and on one
process (here) within 1e-5. The per-expert token counts the model keeps are the global ones on every rank
(they sum to tokens x top_k per layer). The dp2 x ep2 run's trained weights, written as a Hugging Face Mixtral
folder, load with AutoModelForCausalLM and give the GPT-MoE's logits within 1e-4.
"""

from __future__ import annotations

import os
from typing import Any, Dict, List

import pytest
import torch
from torch.utils.data import DataLoader, TensorDataset

import shardwise
from shardwise import FSDPStrategy, Trainer, TrainModule
from shardwise.callbacks import ModelCheckpoint
from shardwise.models import Block
from shardwise.models.gpt_moe import GPTMoE, gpt_moe_config, save_as_mixtral

from helpers.lm import token_data

STEPS, GLOBAL_BATCH, ACCUMULATE, SEQ = 4, 8, 2, 16
SAVE_AT = 2


class TinyMoE(TrainModule):
    def __init__(self) -> None:
        super().__init__()
        self.model = None

    def configure_model(self) -> None:
        if self.model is None:
            self.model = GPTMoE(
                gpt_moe_config(
                    "gpt-moe-tiny", vocab_size=64, block_size=32, router_aux_loss_coef=0.1, router_z_loss_coef=1e-3
                )
            )

    def loss_weight(self, batch) -> torch.Tensor:
        return torch.tensor(batch[0][:, 1:].numel())

    def training_step(self, batch, batch_idx):
        (tokens,) = batch
        logits = self.model(tokens[:, :-1])
        return self.model.loss(logits, tokens[:, 1:])

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1)


class Record:
    """Callback: each optimizer step's logged global loss, and the model's per-expert counts of the run."""

    def __init__(self) -> None:
        self.losses: List[float] = []
        self.counts: List[torch.Tensor] = []

    def on_train_batch_end(self, trainer, module, outputs, batch, batch_idx):
        if trainer.is_last_microbatch:
            self.losses.append(float(trainer.callback_metrics["train_loss"]))
            self.counts.append(module.model.expert_load.pop())


def data() -> TensorDataset:
    return token_data(STEPS * GLOBAL_BATCH, seq=SEQ + 1, vocab=64, seed=3)


def full_weights(module: TrainModule) -> Dict[str, torch.Tensor]:
    return {  # named as without activation checkpointing's wrapper
        n.replace("_checkpoint_wrapped_module.", ""): (p.full_tensor() if hasattr(p, "full_tensor") else p)
        .detach()
        .clone()
        for n, p in module.named_parameters()
    }


def train(
    devices: int, ep: int, root: str = "", save: bool = False, ckpt_path: Any = None, ac: bool = False
) -> Dict[str, Any]:
    shardwise.seed_everything(7)
    record = Record()
    callbacks: List[Any] = [record]
    if save:
        callbacks.append(ModelCheckpoint(dirpath=root, every_n_train_steps=SAVE_AT, save_top_k=-1))
    checkpointed = {Block} if ac else None
    strategy = (
        FSDPStrategy(auto_wrap_policy={Block}, activation_checkpointing_policy=checkpointed, ep_size=ep)
        if devices > 1
        else "single"
    )
    trainer = Trainer(
        accelerator="cpu",
        devices=devices,
        strategy=strategy,
        max_steps=STEPS,
        accumulate_grad_batches=ACCUMULATE,
        gradient_clip_val=1.0,  # the experts' gradients sit on a mesh of their own: one global norm across both
        callbacks=callbacks,
        enable_progress_bar=False,
        logger=False,
        enable_checkpointing=save,
        default_root_dir=root or None,
    )
    module = TinyMoE()
    per_rank = GLOBAL_BATCH // devices // ACCUMULATE
    trainer.fit(module, DataLoader(data(), batch_size=per_rank, shuffle=False), ckpt_path=ckpt_path)
    return {"losses": record.losses, "counts": record.counts, "weights": full_weights(module)}


def two_processes(checkpoint: str) -> Dict[str, Any]:
    """ep 2 from scratch (with activation checkpointing: the all-to-alls run again in the recomputation), then
    the dp2 x ep2 run's checkpoint resumed as plain FSDP (ep 1)."""
    return {"ep2": train(2, 2, ac=True), "resumed_ep1": train(2, 1, ckpt_path=checkpoint)}


def four_processes(root: str) -> Dict[str, Any]:
    """dp2 x ep2 saving every 3 steps, then its checkpoint resumed under dp2 x ep2 again."""
    straight = train(4, 2, root=root, save=True)
    return {"straight": straight, "resumed": train(4, 2, ckpt_path=_step(root, SAVE_AT))}


def _step(root: str, step: int) -> str:
    found = [os.path.join(root, f) for f in sorted(os.listdir(root)) if f"step={step}" in f]
    assert found, os.listdir(root)
    return found[0]


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    root = str(tmp_path_factory.mktemp("ep-checkpoints"))
    out = {"one": train(1, 1)}
    out["four"] = shardwise.launch(four_processes, root, devices=4)
    out["two"] = shardwise.launch(two_processes, _step(root, SAVE_AT), devices=2)
    out["one_resumed"] = train(1, 1, ckpt_path=_step(root, SAVE_AT))
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
    for name, result in (("ep2", runs["two"][0]["ep2"]), ("dp2xep2", runs["four"][0]["straight"])):
        assert _rel(result["losses"], one["losses"]) < 1e-5, (name, result["losses"], one["losses"])
        _close_weights(result["weights"], one["weights"])
        # the per-expert counts are global: the same on every layout, tokens x top_k per layer and step
        for got, want in zip(result["counts"], one["counts"]):
            assert torch.equal(got, want), name
            assert got.sum(1).tolist() == [GLOBAL_BATCH * SEQ * 2] * 2
    for ranks, key in ((runs["two"], "ep2"), (runs["four"], "straight")):  # every rank logs the same losses
        assert all(r[key]["losses"] == ranks[0][key]["losses"] for r in ranks)


def test_resume_under_dp2_ep2_is_bitwise_and_at_ep1_and_one_process_close(runs):
    straight, resumed = runs["four"][0]["straight"], runs["four"][0]["resumed"]
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

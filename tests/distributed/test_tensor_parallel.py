"""Tensor parallel (issue 22) against one process: the bundled GPT through the Trainer, a Hugging Face Llama
through its own tp_plan, and the refusals.

The Trainer trains a llama-tiny GPT (rotary, grouped-query attention, SwiGLU, untied head) in fp32 for 5
SGD steps with clipping on the same global batch of 8: one process; 2 processes at tp=2 (both ranks read
the same 8 samples); 4 processes at dp2 x tp2 (FSDP2 over dp after tp, 4 samples per data-parallel rank).
Per-step losses agree within 1e-5 relative. SGD moves the weights in proportion to the gradient, so a
gradient off by the tp or dp factor would show in the losses (Adam's normalisation would hide it).
The same launches then build a tiny Hugging Face Llama on the meta device, split it by its own tp_plan
(colwise / rowwise projections, vocabulary-split embedding, gathered lm_head) over the same mesh shape,
load the safetensors folder from rank 0 into the 1-D (tp) and 2-D (dp x tp) shards, and compare the loaded
weights, the logits and one backward's gradients with `from_pretrained` in this process. Each
configuration is one launch shared by its assertions.
"""

from __future__ import annotations

from typing import Any, Dict, List

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import Shard
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel
from torch.utils.data import DataLoader

import shardwise
from shardwise import FSDPStrategy, Trainer, TrainModule
from shardwise.distributed import ops
from shardwise.models import GPT, Block, gpt_config
from shardwise.strategies.tensor_parallel import apply_tensor_parallel

from helpers.hf import build_model_folder, chat_records
from helpers.lm import StepLosses, token_data

STEPS, GLOBAL_BATCH = 5, 8
LLAMA = dict(vocab_size=128, block_size=32)


class TinyLlama(TrainModule):
    def __init__(self) -> None:
        super().__init__()
        self.model = None

    def configure_model(self) -> None:
        if self.model is None:
            self.model = GPT(gpt_config("llama-tiny", **LLAMA))

    def training_step(self, batch):
        (tokens,) = batch
        logits = self.model(tokens[:, :-1])
        return F.cross_entropy(logits.reshape(-1, logits.size(-1)), tokens[:, 1:].reshape(-1))

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.5)


def train(devices: int, tp: int) -> List[float]:
    shardwise.seed_everything(7)
    recorder = StepLosses()
    strategy = FSDPStrategy(auto_wrap_policy={Block}, tp_size=tp) if devices > 1 else "single"
    trainer = Trainer(
        accelerator="cpu",
        devices=devices,
        strategy=strategy,
        max_steps=STEPS,
        gradient_clip_val=1.0,
        callbacks=[recorder],
        enable_progress_bar=False,
        logger=False,
        enable_checkpointing=False,
    )
    per_rank = GLOBAL_BATCH * tp // devices  # the tp ranks of one data-parallel group read the same samples
    trainer.fit(TinyLlama(), DataLoader(token_data(64, seq=17, vocab=128), batch_size=per_rank, shuffle=False))
    return recorder.losses


# ------------------------------------------------------------------ Hugging Face
def hf_batch() -> torch.Tensor:
    return torch.randint(0, 36, (2, 12), generator=torch.Generator().manual_seed(1))


def hf_forward_backward(model: nn.Module) -> Dict[str, Any]:
    out = model(input_ids=hf_batch(), labels=hf_batch())
    out.loss.backward()
    return {
        "logits": out.logits.detach(),
        "weights": {n: ops.full_tensor(p.detach()) for n, p in model.named_parameters()},
        "grads": {n: ops.full_tensor(p.grad) for n, p in model.named_parameters()},
        # Clipping's norm (Strategy.clip_gradients): one foreach over all gradients, so one mesh for all.
        "norm": ops.full_tensor(torch.nn.utils.get_total_norm([p.grad for p in model.parameters()])),
    }


def hf_tensor_parallel(path: str, dp: int, tp: int) -> Dict[str, Any]:
    """The HF Llama split by its own plan over (dp, tp), FSDP over dp, weights from rank 0's safetensors."""
    from torch.distributed.fsdp import fully_shard

    from shardwise.recipes import hf_model
    from shardwise.strategies.materialize import materialize_module

    if not dist.is_initialized():  # the Trainer's run before leaves its group up, for the launch's end
        dist.init_process_group("gloo")
    mesh = init_device_mesh("cpu", (dp, tp), mesh_dim_names=("dp", "tp"))
    folder = hf_model.inspect_model_folder(path)
    with torch.device("meta"):
        model = hf_model.build_meta_model(folder)
    apply_tensor_parallel(model, mesh["tp"])
    for layer in model.model.layers:
        fully_shard(layer, mesh=mesh["dp"])
    fully_shard(model, mesh=mesh["dp"])

    def load() -> None:
        hf_model.load_rank0_and_distribute(model, folder.path, folder.weight_files)
        hf_model.recompute_buffers(model)

    materialize_module(model, torch.device("cpu"), 0, load)
    result = hf_forward_backward(model)
    tp_dim = lambda p: p.device_mesh.mesh_dim_names.index("tp")  # noqa: E731
    result["split"] = sorted(n for n, p in model.named_parameters() if isinstance(p.placements[tp_dim(p)], Shard))
    result["meshes"] = {p.device_mesh.mesh_dim_names for p in model.parameters()}
    return result


class OwnPlan(nn.Module):
    """A model of the user's own with a tensor_parallel_plan; its norm is left whole (ReplicateParallel)."""

    tensor_parallel_plan = {"blocks.*.up": ColwiseParallel(), "blocks.*.down": RowwiseParallel()}

    def __init__(self, d: int = 8) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(
            nn.ModuleDict({"up": nn.Linear(d, 4 * d), "down": nn.Linear(4 * d, d)}) for _ in range(2)
        )
        self.norm = nn.LayerNorm(d)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            x = x + block["down"](F.gelu(block["up"](x)))
        return self.norm(x)


def own_plan_and_sequence_check(tp: int) -> Dict[str, Any]:
    """A user's plan applied to real (not meta) weights against an unsplit copy; the GPT's sequence check."""
    import copy

    mesh = init_device_mesh("cpu", (tp,), mesh_dim_names=("tp",))
    torch.manual_seed(0)
    whole = OwnPlan()
    split = copy.deepcopy(whole)
    apply_tensor_parallel(split, mesh)
    x = torch.randn(3, 5, 8, generator=torch.Generator().manual_seed(2))
    whole(x).square().sum().backward()
    y = split(x)
    y.square().sum().backward()
    grads = {
        n: (ops.full_tensor(p.grad) - dict(whole.named_parameters())[n].grad).abs().max()
        for n, p in split.named_parameters()
    }
    gpt = _meta_gpt()
    apply_tensor_parallel(gpt, mesh)
    try:
        gpt(torch.zeros(1, 2 * tp + 1, dtype=torch.long, device="meta"))
        sequence_error = None
    except ValueError as exc:
        sequence_error = str(exc)
    return {
        "out": float((y - whole(x)).abs().max()),
        "grads": max(grads.values()).item(),
        "sequence_error": sequence_error,
    }


def run_configuration(path: str, dp: int, tp: int) -> Dict[str, Any]:
    """One launch: the Trainer's GPT run, then the Hugging Face check on the same mesh shape."""
    losses = train(dp * tp, tp)
    result = {"losses": losses, "hf": hf_tensor_parallel(path, dp, tp)}
    if dp == 1:
        result["own"] = own_plan_and_sequence_check(tp)
    return result


@pytest.fixture(scope="module")
def hf_folder(tmp_path_factory):
    return build_model_folder(str(tmp_path_factory.mktemp("tp-llama")), chat_records(20))


@pytest.fixture(scope="module")
def reference(hf_folder):
    from transformers import AutoModelForCausalLM

    torch.manual_seed(0)
    hf = hf_forward_backward(AutoModelForCausalLM.from_pretrained(hf_folder, attn_implementation="sdpa"))
    return {"losses": train(1, 1), "hf": hf}


def _rel(a, b) -> float:
    return max(abs(x - y) / abs(y) for x, y in zip(a, b))


def _check_hf(got: Dict[str, Any], ref: Dict[str, Any]) -> None:
    for name, full in ref["weights"].items():
        assert torch.equal(got["weights"][name], full), name  # rank 0's bytes, exactly, in every shard
    assert got["logits"].shape == ref["logits"].shape  # whole logits on every rank (gathered lm_head)
    torch.testing.assert_close(got["logits"], ref["logits"], rtol=1e-5, atol=1e-5)
    for name, grad in ref["grads"].items():
        torch.testing.assert_close(got["grads"][name], grad, rtol=1e-4, atol=1e-6, msg=name)
    torch.testing.assert_close(got["norm"], ref["norm"], rtol=1e-5, atol=0)
    # The plan split the projections, the embedding and the head; the norms stayed whole on every tp rank.
    assert "model.layers.0.self_attn.q_proj.weight" in got["split"] and "lm_head.weight" in got["split"]
    assert "model.embed_tokens.weight" in got["split"] and "model.norm.weight" not in got["split"]
    assert got["meshes"] == {("dp", "tp")}  # the whole ones too (ReplicateParallel): one mesh for foreach kernels


@pytest.mark.parametrize("dp, tp", [(1, 2), pytest.param(2, 2, marks=pytest.mark.slow)], ids=["tp2", "dp2xtp2"])
def test_tensor_parallel_matches_one_process(reference, hf_folder, dp, tp):
    ranks = shardwise.launch(run_configuration, hf_folder, dp, tp, devices=dp * tp)
    losses = ranks[0]["losses"]
    assert len(losses) == STEPS and all(r["losses"] == losses for r in ranks)
    assert _rel(losses, reference["losses"]) < 1e-5, (losses, reference["losses"])
    assert reference["losses"][-1] < reference["losses"][0]
    for rank in ranks:
        _check_hf(rank["hf"], reference["hf"])
        if "own" in rank:  # tp only: a user's own plan on real weights, and the GPT's sequence check
            assert rank["own"]["out"] < 1e-6 and rank["own"]["grads"] < 1e-5, rank["own"]
            assert "sequence length 5 must be a multiple of tp_size=2" in rank["own"]["sequence_error"]


# ------------------------------------------------------------------ refusals (one process, a fake mesh)
class _Mesh:
    """apply_tensor_parallel's checks run before anything is split: a size is all they read."""

    def __init__(self, size: int) -> None:
        self._size = size

    def size(self) -> int:
        return self._size


def _meta_gpt(**changes) -> GPT:
    with torch.device("meta"):
        return GPT(gpt_config("llama-tiny", **{**LLAMA, **changes}))


def test_refusals_name_the_fix():
    with pytest.raises(ValueError, match="tie_embeddings=False"):
        apply_tensor_parallel(_meta_gpt(tie_embeddings=True), _Mesh(2))
    with pytest.raises(
        ValueError,
        match=r"tp_size=4 does not divide the model's 2 key/value heads.*split GPTConfig's 4 attention heads",
    ):
        apply_tensor_parallel(_meta_gpt(), _Mesh(4))
    with pytest.raises(ValueError, match="tensor_parallel_plan"):
        apply_tensor_parallel(nn.Sequential(nn.Linear(4, 4)), _Mesh(2))

    class Own(nn.Module):
        def __init__(self, plan):
            super().__init__()
            self.up, self.down = nn.Linear(4, 8), nn.Linear(8, 4)
            self.tensor_parallel_plan = plan

    with pytest.raises(ValueError, match=r"\['mlp.up'\] of Own match no submodule"):
        apply_tensor_parallel(Own({"mlp.up": ColwiseParallel(), "down": RowwiseParallel()}), _Mesh(2))
    with pytest.raises(ValueError, match="'packed_colwise', which shardwise does not translate"):
        apply_tensor_parallel(Own({"up": "packed_colwise"}), _Mesh(2))


def test_a_plan_method_is_handed_the_degree():
    """A model's own plan method that takes an argument gets the tp degree, so it can refuse a degree its
    shape cannot take before anything is split (the bundled GPT checks its heads this way)."""

    class Sized(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.up, self.down = nn.Linear(4, 6), nn.Linear(6, 4)

        def tensor_parallel_plan(self, tp: int):
            if 6 % tp:
                raise ValueError(f"Sized: its 6 hidden units do not split over tp_size={tp}")
            return {"up": ColwiseParallel(), "down": RowwiseParallel()}

    with pytest.raises(ValueError, match="do not split over tp_size=4"):
        apply_tensor_parallel(Sized(), _Mesh(4))
    with pytest.raises(ValueError, match=r"GPTConfig\(n_head, n_kv_head\)"):
        _meta_gpt().tensor_parallel_plan(4)  # the GPT's own plan, asked directly


def test_hugging_face_refusals(hf_folder, tmp_path):
    from shardwise.recipes import hf_model

    tied = build_model_folder(str(tmp_path / "tied"), chat_records(8), tie=True)
    with torch.device("meta"):
        model = hf_model.build_meta_model(hf_model.inspect_model_folder(tied))
    with pytest.raises(ValueError, match="tie_word_embeddings=True"):
        apply_tensor_parallel(model, _Mesh(2))
    with torch.device("meta"):
        model = hf_model.build_meta_model(hf_model.inspect_model_folder(hf_folder))
    with pytest.raises(ValueError, match=r"tp_size=4 does not divide the model's 2 key/value heads"):
        apply_tensor_parallel(model, _Mesh(4))

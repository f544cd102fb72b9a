"""The recipe's loader on hub-layout mixture-of-experts checkpoints that transformers' mapping cannot convert.

One process, no training: a tiny Mixtral saved with save_pretrained (experts one by one) whose
tensors are then edited. Experts of unequal shapes cannot be stacked by transformers' own
MergeModulelist: the loader refuses, naming the conversion and the checkpoint keys, before any
tensor is placed. A missing expert stacks into a tensor of the wrong shape: refused naming the fused
parameter and both shapes. A checkpoint already in the fused layout (what the module itself holds)
loads as it is, and the export writes it back in that layout, as save_pretrained does for a model
that was loaded from it.
"""

from __future__ import annotations

import os

import pytest
import torch

transformers = pytest.importorskip("transformers")

from safetensors.torch import load_file, save_file  # noqa: E402

from shardwise.recipes import hf_model  # noqa: E402


def _mixtral(path: str) -> str:
    config = transformers.MixtralConfig(
        vocab_size=32,
        hidden_size=16,
        intermediate_size=24,
        num_hidden_layers=1,
        num_attention_heads=2,
        num_key_value_heads=1,
        num_local_experts=4,
        num_experts_per_tok=2,
        max_position_embeddings=32,
    )
    torch.manual_seed(0)
    transformers.MixtralForCausalLM(config).save_pretrained(path)
    return path


def _load(path: str) -> torch.nn.Module:
    folder = hf_model.inspect_model_folder(path)
    with torch.device("meta"):
        model = hf_model.build_meta_model(folder)
    model.to_empty(device="cpu")
    hf_model.load_rank0_and_distribute(model, folder.path, folder.weight_files)
    hf_model.recompute_buffers(model)
    return model


def _edit(path: str, edit) -> None:
    weights = os.path.join(path, "model.safetensors")
    tensors = load_file(weights)
    edit(tensors)
    save_file(tensors, weights, metadata={"format": "pt"})


def test_experts_transformers_cannot_stack_are_refused_by_the_conversion(tmp_path):
    path = _mixtral(str(tmp_path / "mixtral"))
    key = "model.layers.0.block_sparse_moe.experts.1.w1.weight"
    _edit(path, lambda t: t.update({key: t[key][:20]}))
    with pytest.raises(hf_model.ModelFolderError) as err:
        _load(path)
    message = str(err.value)
    assert "conversion WeightConverter" in message and "experts.gate_up_proj" in message
    assert "experts.0.w1.weight" in message and "fails on the checkpoint's shapes" in message


def test_a_missing_expert_is_a_shape_mismatch_of_the_fused_parameter(tmp_path):
    path = _mixtral(str(tmp_path / "mixtral"))
    _edit(path, lambda t: [t.pop(k) for k in list(t) if ".experts.3." in k])
    with pytest.raises(
        hf_model.ModelFolderError, match=r"experts.gate_up_proj: checkpoint \[3, 48, 16\] vs model \[4, 48, 16\]"
    ):
        _load(path)


def test_a_fused_layout_checkpoint_loads_and_exports_in_its_own_layout(tmp_path):
    hub = _mixtral(str(tmp_path / "hub"))
    reference = transformers.AutoModelForCausalLM.from_pretrained(hub)
    fused = str(tmp_path / "fused")
    os.makedirs(fused)
    reference.config.save_pretrained(fused)
    save_file({k: v.contiguous() for k, v in reference.state_dict().items()}, os.path.join(fused, "model.safetensors"))
    model = _load(fused)
    probe = torch.tensor([[1, 5, 9, 3, 7]])
    assert torch.equal(model(probe).logits, reference(probe).logits)
    out = str(tmp_path / "out")
    hf_model.export_hf_folder(model, out, config=model.config)
    written = load_file(os.path.join(out, "model.safetensors"))
    assert "model.layers.0.mlp.experts.gate_up_proj" in written
    assert not any(".block_sparse_moe." in k for k in written)

"""FSDPStrategy takes what Lightning, Accelerate and torch's FSDP1 users pass (issue 12, item 1); no process needed."""

from __future__ import annotations

import warnings

import pytest
import torch
from torch import nn
from torch.distributed.fsdp import (
    BackwardPrefetch,
    CPUOffload,
    CPUOffloadPolicy,
    MixedPrecision,
    MixedPrecisionPolicy,
    ShardingStrategy,
    StateDictType,
)

from shardwise.strategies import FSDPStrategy, fsdp_compat


@pytest.fixture(autouse=True)
def _fresh_notes(monkeypatch):
    monkeypatch.setattr(fsdp_compat, "_noted", set())


@pytest.mark.parametrize(
    "given, name, reshard",
    [
        (ShardingStrategy.FULL_SHARD, "FULL_SHARD", True),
        (ShardingStrategy.SHARD_GRAD_OP, "SHARD_GRAD_OP", False),
        (ShardingStrategy.NO_SHARD, "NO_SHARD", True),
        (ShardingStrategy.HYBRID_SHARD, "HYBRID_SHARD", True),
        (ShardingStrategy._HYBRID_SHARD_ZERO2, "HYBRID_SHARD", False),
        ("shard_grad_op", "SHARD_GRAD_OP", False),
        (2, "SHARD_GRAD_OP", False),
        ("1", "FULL_SHARD", True),
    ],
)
def test_sharding_strategy_enum_strings_and_accelerate_numbers(given, name, reshard):
    s = FSDPStrategy(sharding_strategy=given)
    assert (s.sharding_strategy, s.reshard_after_forward) == (name, reshard)


def test_torch_objects_map_to_our_settings():
    s = FSDPStrategy(
        cpu_offload=CPUOffload(offload_params=True),
        state_dict_type=StateDictType.FULL_STATE_DICT,
        mixed_precision=MixedPrecision(param_dtype=torch.bfloat16, reduce_dtype=torch.float32),
        activation_checkpointing=[nn.TransformerEncoderLayer],
    )
    assert s.cpu_offload and s.state_dict_type == "full" and s._precision_arg == "bf16-mixed"
    assert s.activation_checkpointing_policy == [nn.TransformerEncoderLayer]
    assert not FSDPStrategy(cpu_offload=CPUOffload(offload_params=False)).cpu_offload
    assert FSDPStrategy(cpu_offload=CPUOffloadPolicy()).cpu_offload
    assert FSDPStrategy(state_dict_type="SHARDED_STATE_DICT").state_dict_type == "sharded"
    assert FSDPStrategy(mixed_precision=MixedPrecisionPolicy(param_dtype=torch.bfloat16))._precision_arg == "bf16-mixed"
    with pytest.raises(ValueError, match="LOCAL_STATE_DICT is FSDP1's flat-parameter format"):
        FSDPStrategy(state_dict_type=StateDictType.LOCAL_STATE_DICT)
    with pytest.raises(ValueError, match="pass one of them"):
        FSDPStrategy(precision="32-true", mixed_precision=MixedPrecision(param_dtype=torch.bfloat16))
    with pytest.warns(UserWarning, match="reduce_dtype=torch.bfloat16 is not honoured"):
        FSDPStrategy(mixed_precision=MixedPrecision(param_dtype=torch.bfloat16, reduce_dtype=torch.bfloat16))


def test_settings_fsdp2_has_no_use_for_are_accepted_and_said_once():
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for _ in range(3):  # e.g. built again on every rank and at each fit
            FSDPStrategy(
                use_orig_params=True,
                sync_module_states=True,
                backward_prefetch=BackwardPrefetch.BACKWARD_PRE,
                forward_prefetch=False,
                limit_all_gathers=True,
            )
    messages = [str(w.message) for w in caught]
    assert len(messages) == 5, messages
    assert all("is accepted and has nothing to do" in m for m in messages)
    assert any("use_orig_params=True" in m and "no flat parameter" in m for m in messages)
    assert any("sync_module_states=True" in m and "nothing to broadcast" in m for m in messages)
    assert all(w.filename == __file__ for w in caught)  # points at the user's line
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        FSDPStrategy()  # nothing passed, nothing said


def test_fsdp1_size_policy_does_not_enter_multihead_attention():
    # FSDP1's size-based policy never recurses into nn.MultiheadAttention: its forward reads
    # out_proj.weight directly, so an out_proj unit would never be gathered (mixed DTensor error).
    from functools import partial

    from torch.distributed.fsdp.wrap import size_based_auto_wrap_policy

    from shardwise.models import Transformer  # shardwise's demo model (shardwise.demos.Transformer is Lightning's)
    from shardwise.strategies.fsdp import select_units

    model = Transformer(vocab_size=50, nlayers=1, nhid=64, ninp=32, nhead=4)
    names = [n for n, _ in select_units(model, partial(size_based_auto_wrap_policy, min_num_params=1000))]
    assert "encoder_layers.0.self_attn" in names and not any(n.endswith("out_proj") for n in names), names


def test_integer_parameters_on_a_torch_whose_fully_shard_cannot_keep_them(monkeypatch):
    """QLoRA's uint8 codes: torch 2.11's fully_shard asks every shard for gradients, which integer tensors
    refuse (found on an H200). There they are left unsharded on one rank and refused by name on several."""
    from shardwise.strategies import fsdp_compat

    model = torch.nn.Linear(4, 4)
    codes = torch.nn.Parameter(torch.zeros(8, 1, dtype=torch.uint8), requires_grad=False)
    model.register_parameter("codes", codes)
    assert fsdp_compat.fsdp_keeps_integer_params()  # the torch this suite pins shards them
    assert fsdp_compat.integer_params_to_ignore(model, 4) == set()
    monkeypatch.setattr(fsdp_compat, "fsdp_keeps_integer_params", lambda: False)
    assert fsdp_compat.integer_params_to_ignore(model, 1) == {codes}
    assert fsdp_compat.integer_params_to_ignore(torch.nn.Linear(2, 2), 4) == set()
    with pytest.raises(RuntimeError, match=r"cannot shard integer parameters.*devices=1"):
        fsdp_compat.integer_params_to_ignore(model, 2)

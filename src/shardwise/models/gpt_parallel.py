"""The bundled GPT's own tensor-parallel plan: how its layers split over the ranks of a "tp" mesh.

The model owns its parallel plan, as torchtitan's models each carry a parallelize file: `GPT.tensor_parallel_plan(tp)`
returns `gpt_tensor_parallel_plan(self, tp)`, and the engine (strategies/tensor_parallel.py) applies it
like any module's own plan without knowing the GPT's class. The layout is Megatron's / torchtitan's:
q/k/v and gate/up column-wise, o/down row-wise, the norms sequence-parallel (the residual stream
between layers is split along the sequence over the tp ranks), the token embedding row-wise and the
head column-wise with its output gathered, so the loss sees whole logits on every rank. The degree is
checked against the shape before anything is allocated; the sequence length, which only the forward
knows, is checked by the embedding's style as the tokens arrive.
"""

from __future__ import annotations

from typing import Any, Dict, Tuple

from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import Replicate, Shard
from torch.distributed.tensor.parallel import (
    ColwiseParallel,
    ParallelStyle,
    PrepareModuleInput,
    RowwiseParallel,
    SequenceParallel,
)

__all__ = ["gpt_tensor_parallel_plan"]


class _SequenceCheck:
    """Forward pre-hook: the sequence-parallel norms need the sequence split evenly over the tp ranks."""

    def __init__(self, tp: int) -> None:
        self.tp = tp

    def __call__(self, module: nn.Module, args: Tuple[Any, ...]) -> None:
        idx = args[0] if args else None
        if idx is not None and idx.dim() >= 2 and idx.size(1) % self.tp:
            raise ValueError(
                f"tensor parallel: the sequence length {idx.size(1)} must be a multiple of tp_size={self.tp} "
                "(the norms between layers work on an equal share of the tokens on each rank). Pad or crop the "
                "sequences to a multiple of it."
            )


class _SequenceSplitEmbedding(RowwiseParallel):
    """The token embedding split by vocabulary rows, its output split along the sequence; it refuses a
    sequence the degree does not divide before the split would fail deep inside DTensor."""

    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        # Registered before the style's own input hook, so it sees the plain token ids.
        module.register_forward_pre_hook(_SequenceCheck(device_mesh.size()))
        return super()._apply(module, device_mesh)


def gpt_tensor_parallel_plan(model: nn.Module, tp: int) -> Dict[str, ParallelStyle]:
    """The plan of `model` (a GPT; paths relative to it) at degree `tp`, after checking the degree fits its shape."""
    from shardwise.strategies.tensor_parallel import check_heads

    cfg = model.config
    if cfg.tie_embeddings:
        raise ValueError(
            "tensor parallel: GPT(tie_embeddings=True) shares one weight between the token embedding (split "
            "by vocabulary rows) and the output head (split by output columns), which tensor parallel cannot "
            "lay out as one parameter. Build the model with tie_embeddings=False (gpt_config(name, "
            "tie_embeddings=False)), or train without tp."
        )
    check_heads(cfg.n_head, cfg.kv_heads, tp, "GPTConfig(n_head, n_kv_head)")
    # The residual stream between the layers is split along the sequence (dim 1): each norm runs on
    # its rank's tokens, and each attention / MLP gathers the sequence first (torchtitan's layout).
    plan: Dict[str, ParallelStyle] = {
        "wte": _SequenceSplitEmbedding(input_layouts=Replicate(), output_layouts=Shard(1))
    }
    if model.wpe is not None:  # learned positions: (T, D), or (B, T, D) from position ids
        plan["wpe"] = RowwiseParallel(input_layouts=Replicate(), output_layouts=Shard(-2))
    mlp_in = ["up_proj"] + (["gate_proj"] if cfg.mlp == "swiglu" else [])
    # Block.forward calls the attention with (x, rope, document_ids): the rotary tables and document
    # ids pass through untouched.
    extra = (None, None)
    plan.update(
        {
            "blocks.*.attn_norm": SequenceParallel(),
            "blocks.*.attn": PrepareModuleInput(
                input_layouts=(Shard(1), *extra), desired_input_layouts=(Replicate(), *extra)
            ),
            "blocks.*.attn.q_proj": ColwiseParallel(),
            "blocks.*.attn.k_proj": ColwiseParallel(),
            "blocks.*.attn.v_proj": ColwiseParallel(),
            "blocks.*.attn.o_proj": RowwiseParallel(output_layouts=Shard(1)),
            "blocks.*.mlp_norm": SequenceParallel(),
            "blocks.*.mlp": PrepareModuleInput(input_layouts=(Shard(1),), desired_input_layouts=(Replicate(),)),
            **{f"blocks.*.mlp.{name}": ColwiseParallel() for name in mlp_in},
            "blocks.*.mlp.down_proj": RowwiseParallel(output_layouts=Shard(1)),
            "norm": SequenceParallel(),
            # Gathered logits: the user's loss sees the whole vocabulary on every rank.
            "lm_head": ColwiseParallel(input_layouts=Shard(1), output_layouts=Replicate()),
        }
    )
    return plan

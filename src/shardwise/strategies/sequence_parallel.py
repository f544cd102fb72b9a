"""Ulysses-style sequence parallel, the engine's side: switch it on in a model over the sp mesh.

One sequence is split across the ranks of an sp group; around attention all-to-alls trade the
sequence split for a head split and back (the primitives live in `shardwise.ulysses`, which both the
bundled GPT and the Hugging Face path import; they are re-exported here, where the public API has
always named them). Activations outside attention shrink by the sp degree, which is what decides
whether a step fits at long sequence lengths.

`apply_sequence_parallel(module, sp_mesh)` asks the model instead of knowing its class: a module whose
class defines `enable_sequence_parallel(group)` (the bundled GPT does) switches itself on; a Hugging Face
model is handed to `sequence_parallel_hf.apply_hf_sequence_parallel`; anything else is refused.
"""

from __future__ import annotations

import sys
from typing import Any, List, Union

import torch.distributed as dist
from torch import nn

from shardwise.ulysses import (
    check_heads_divisible,
    document_ids_from_positions,
    gather_sequence,
    group_size,
    heads_to_sequence,
    sequence_to_heads,
    split_sequence,
    ulysses_attention,
)

__all__ = [
    "apply_sequence_parallel",
    "check_heads_divisible",
    "document_ids_from_positions",
    "gather_sequence",
    "group_size",
    "heads_to_sequence",
    "sequence_to_heads",
    "split_sequence",
    "ulysses_attention",
]


# ------------------------------------------------------------------ the strategy's entry point
def _is_hf_model(module: nn.Module) -> bool:
    # A PreTrainedModel exists only once transformers is imported; importing it here would cost seconds.
    if "transformers" not in sys.modules:
        return False
    from transformers import PreTrainedModel

    return isinstance(module, PreTrainedModel)


def _own_hooks(module: nn.Module) -> List[nn.Module]:
    """The outermost modules whose class defines `enable_sequence_parallel` (a module's hook covers its children).

    The class, not the instance: a PEFT wrapper forwards unknown attributes to the model it wraps, and
    must not be taken for the model itself."""
    found: List[str] = []
    modules = []
    for path, sub in module.named_modules():
        if any(path == p or path.startswith(p + ".") or p == "" for p in found):
            continue
        if callable(getattr(type(sub), "enable_sequence_parallel", None)):
            found.append(path)
            modules.append(sub)
    return modules


def apply_sequence_parallel(module: nn.Module, sp_mesh: Union[Any, dist.ProcessGroup]) -> None:
    """Switch on Ulysses sequence parallel over `sp_mesh` (a 1-D DeviceMesh or process group) in place.

    Each model inside `module` that carries its own hook, `enable_sequence_parallel(group)`, is switched
    on by it: the bundled GPT slices the sequence after the embedding and gathers it before the final
    norm, so it takes the full batch and returns full logits and the user's training_step and loss stay
    as they are. A Hugging Face model is handed to `apply_hf_sequence_parallel`. Call before
    activation checkpointing and fully_shard. Raises ValueError naming the fix when no model with an
    attention hook is found or the head counts do not divide.
    """
    own = _own_hooks(module)
    if own:
        for sub in own:
            sub.enable_sequence_parallel(sp_mesh)
        return
    hf = [m for m in module.modules() if _is_hf_model(m)]
    if hf:
        from shardwise.strategies.sequence_parallel_hf import apply_hf_sequence_parallel

        # The outermost PreTrainedModel owns the others (a causal LM holds its base model).
        apply_hf_sequence_parallel(hf[0], sp_mesh)
        return
    raise ValueError(
        f"sequence parallel (sp_size > 1) needs a model whose attention it can route through Ulysses "
        f"all-to-alls, and {type(module).__name__} contains none: use the bundled shardwise.models.GPT "
        f"(GPT-2 and Llama shapes), a Hugging Face causal LM (transformers PreTrainedModel) or a model whose "
        f"class defines enable_sequence_parallel(group) (routing its attention through "
        f"shardwise.ulysses.ulysses_attention), or set "
        f"sp_size=1 and split memory with FSDP (more dp_shard) or activation checkpointing instead"
    )

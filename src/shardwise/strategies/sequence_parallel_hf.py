"""Sequence parallel for Hugging Face causal LMs: their attention through Ulysses, and the batch split.

`apply_hf_sequence_parallel` registers one attention function with transformers' AttentionInterface and
switches the model to it (on the meta model, before FSDP2 shards it). Each sp rank then runs the model
on its slice of the sequence; the function hands Hugging Face's query / key / value to
`shardwise.ulysses.ulysses_attention`, which trades the sequence split for a head split, attends over
the whole sequence and trades back. The model never sees the whole sequence, so the boundaries of
packed documents cannot come from its local position ids: `split_batch` computes them once from the
FULL batch (Hugging Face's own rule: a document starts wherever the position ids do not go up by one,
and a padding mask, when there is one, takes its place) and passes them to the model as the keyword
`sp_document_ids`, which Hugging Face forwards to every attention call. A keyword rather than a global
context: activation checkpointing recomputes the layers during the backward, after any context has
been left, and it replays the keywords it was called with. The function refuses to run without them,
and registering a mask function under the same name stops Hugging Face from building a mask for the
local slice (a padding mask handed to the model directly is refused: `split_batch` folds it into the
document ids). What the function cannot honour is refused by name: attention dropout, flash-attention
kernels, head counts the degree does not divide, a sliding window shorter than the sequence,
soft-capping, a KV cache.
"""

from __future__ import annotations

import weakref
from typing import Any, Dict, Mapping, Optional, Tuple

import torch
import torch.nn.functional as F

from shardwise.strategies import degrees
from shardwise.ulysses import ulysses_attention

ATTENTION_NAME = "shardwise_ulysses"
DOCUMENT_IDS = "sp_document_ids"  # the keyword the model is called with: [batch, full sequence] document ids
BATCH_KEYS = ("input_ids", "labels", "position_ids", "attention_mask")

# id(config) -> (weak reference to the config, the sp process group, the sp degree). Keyed by the
# config every attention module carries: a process group cannot live in the config itself (configs are
# deep-copied and written to JSON).
_GROUPS: Dict[int, Tuple[Any, Any, int]] = {}


def _hf_models(model: torch.nn.Module) -> list:
    from transformers import PreTrainedModel

    return [m for m in model.modules() if isinstance(m, PreTrainedModel)]


def _configs(models: list) -> list:
    """Every config of the models and their sub-configs (a multimodal model's text config), once each."""
    seen: Dict[int, Any] = {}
    stack = [m.config for m in models]
    while stack:
        config = stack.pop()
        if config is None or id(config) in seen:
            continue
        seen[id(config)] = config
        stack.extend(getattr(config, key, None) for key in getattr(config, "sub_configs", {}) or {})
    return list(seen.values())


def check_hf_sequence_parallel(
    config: Any, sp: int, name: str = "the model", max_seq_len: Optional[int] = None
) -> None:
    """Raise naming the fix when the model's attention cannot run split over `sp` ranks.

    Usable before any worker starts (the recipe's checks call it with the folder's config); with
    `max_seq_len`, a sliding window shorter than the sequences is refused there too."""
    requested = getattr(config, "_attn_implementation", None) or "sdpa"
    if requested.startswith(("flash_attention", "flex_attention", "paged")) or "/" in requested:
        raise ValueError(
            f"sp_size={sp} with attn_implementation={requested!r}: sequence parallel runs its attention through "
            "torch's scaled_dot_product_attention (which uses flash kernels on GPUs that have them), with a "
            "document mask over the whole sequence; a variable-length flash-attention path is not implemented. "
            "Use attn_implementation='sdpa'."
        )
    heads = getattr(config, "num_attention_heads", None)
    kv_heads = getattr(config, "num_key_value_heads", None) or heads
    if heads is None:
        raise ValueError(f"sp_size={sp}: {name}'s config names no num_attention_heads; sequence parallel splits heads.")
    degrees.refuse(degrees.heads_problem(heads, kv_heads, 1, sp, name, fields=degrees.HF_HEAD_FIELDS))
    dropout = float(getattr(config, "attention_dropout", 0.0) or 0.0)
    if dropout:
        raise ValueError(
            f"sp_size={sp} with attention_dropout={dropout}: dropout inside sequence-parallel attention is not "
            "implemented (its random mask would differ from one device's). Set attention_dropout=0 in the config."
        )
    if getattr(config, "attn_logit_softcapping", None) or getattr(config, "final_attn_softcapping", None):
        raise ValueError(
            f"sp_size={sp}: {name} soft-caps its attention logits, which scaled_dot_product_attention cannot do. "
            "Use sp_size 1 (and more FSDP or tensor parallel) for this model."
        )
    window = getattr(config, "sliding_window", None)
    windowed = window and (not getattr(config, "layer_types", None) or "sliding_attention" in config.layer_types)
    if windowed and max_seq_len is not None and max_seq_len > window:
        raise ValueError(
            f"sp_size={sp} with max_seq_len={max_seq_len}: {name} attends within a sliding window of {window} "
            "tokens, which sequence parallel does not implement. Use max_seq_len <= "
            f"{window} (attention is then the same as causal), or sp_size 1."
        )
    if getattr(config, "is_causal", True) is False:
        raise ValueError(f"sp_size={sp}: {name} is configured for bidirectional attention; sp supports causal LMs.")


def apply_hf_sequence_parallel(model: torch.nn.Module, sp_mesh: Any) -> None:
    """Route every attention of the Hugging Face model(s) inside `model` through Ulysses over `sp_mesh`.

    Mutates in place (the config's attention implementation), returns None; call it on the meta model
    before sharding. Raises ValueError naming the fix when the model cannot be split this way."""
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface

    sp = sp_mesh.size()
    models = _hf_models(model)
    if not models:
        raise ValueError(
            f"sp_size={sp}: {type(model).__name__} holds no Hugging Face PreTrainedModel, so there is no attention "
            "hook to split the sequence with. Use the bundled GPT/Llama models or a transformers model."
        )
    top = models[0]
    if not type(top)._can_set_attn_implementation():
        raise ValueError(
            f"sp_size={sp}: {type(top).__name__}'s modeling code does not call its attention through transformers' "
            "AttentionInterface, so sequence parallel cannot replace it. Use sp_size 1 for this model, or a "
            "model class whose attention goes through ALL_ATTENTION_FUNCTIONS."
        )
    configs = _configs(models)
    for config in configs:
        if getattr(config, "num_attention_heads", None) is not None:
            check_hf_sequence_parallel(config, sp, type(top).__name__)
    AttentionInterface.register(ATTENTION_NAME, ulysses_hf_attention)
    AttentionMaskInterface.register(ATTENTION_NAME, no_local_mask)
    group = sp_mesh.get_group()
    for config in configs:
        key = id(config)
        _GROUPS[key] = (weakref.ref(config), group, sp)
        weakref.finalize(config, _GROUPS.pop, key, None)
    top.set_attn_implementation(ATTENTION_NAME)
    for m in models:  # a sub-model the propagation skipped would silently keep attending to its slice only
        if m.config._attn_implementation != ATTENTION_NAME:
            raise ValueError(
                f"sp_size={sp}: {type(m).__name__} inside {type(top).__name__} kept attn_implementation="
                f"{m.config._attn_implementation!r}. Use sp_size 1 for this model."
            )


def no_local_mask(
    batch_size: int,
    q_length: int,
    kv_length: int,
    q_offset: int = 0,
    kv_offset: int = 0,
    mask_function: Any = None,
    attention_mask: Optional[torch.Tensor] = None,
    **kwargs: Any,
) -> None:
    """The mask Hugging Face builds for the model's local slice: none (the documents come whole with the call)."""
    if attention_mask is not None and not bool(attention_mask.all()):
        raise ValueError(
            "sequence parallel: the model was called with a padding attention_mask on its slice of the sequence. "
            "Split the FULL batch with shardwise.strategies.sequence_parallel_hf.split_batch, which folds padding "
            f"into the `{DOCUMENT_IDS}` it passes, and call the model with its output."
        )
    return None


def ulysses_hf_attention(
    module: torch.nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: Optional[torch.Tensor],
    dropout: float = 0.0,
    scaling: Optional[float] = None,
    **kwargs: Any,
) -> Tuple[torch.Tensor, None]:
    """Hugging Face's attention call -> Ulysses over the sp group; returns ([B, S_local, H, D], None) as sdpa does."""
    entry = _GROUPS.get(id(getattr(module, "config", None)))
    if entry is None:
        raise RuntimeError(
            f"{type(module).__name__} uses attn_implementation={ATTENTION_NAME!r} but its config was not set up by "
            "apply_hf_sequence_parallel (no sp group known for it). Call it on the model that owns this layer."
        )
    _, group, sp = entry
    if DOCUMENT_IDS not in kwargs:
        raise ValueError(
            f"sequence parallel (sp={sp}): the model was called without `{DOCUMENT_IDS}`. Each sp rank runs a slice "
            "of the sequence and the attention needs the whole sequence's document boundaries: split the full "
            "batch with shardwise.strategies.sequence_parallel_hf.split_batch and call the model with its inputs."
        )
    if dropout:
        raise ValueError(
            f"sequence parallel: attention dropout {dropout} in training is not implemented; set attention_dropout=0."
        )
    if attention_mask is not None:
        raise ValueError("sequence parallel: a prepared attention mask reached the attention; see split_batch.")
    if kwargs.get("softcap"):
        raise ValueError("sequence parallel: attention soft-capping is not supported by the Ulysses attention.")
    batch, _, local, _ = query.shape
    if key.shape[2] != local:
        raise ValueError(
            "sequence parallel: keys longer than the queries (a KV cache, generation) are not supported; "
            "call the model with use_cache=False."
        )
    full = local * sp
    documents = kwargs[DOCUMENT_IDS]  # None: each row is one document (plain causal, no mask to build)
    if documents is not None and tuple(documents.shape) != (batch, full):
        raise ValueError(
            f"sequence parallel: `{DOCUMENT_IDS}` has shape {tuple(documents.shape)} but the model's slice of "
            f"{local} tokens x sp {sp} means {(batch, full)}. Call the model with split_batch's inputs, "
            "not with the full batch."
        )
    window = kwargs.get("sliding_window")
    if window is not None and full > window:
        raise ValueError(
            f"sequence parallel: the model's sliding window ({window} tokens) is shorter than the sequence ({full}); "
            "windowed attention is not implemented under sp. Use sequences of at most the window, or sp_size 1."
        )
    out = ulysses_attention(query, key, value, group, document_ids=documents, scale=scaling)
    return out.transpose(1, 2).contiguous(), None


def document_ids(position_ids: Optional[torch.Tensor], attention_mask: Optional[torch.Tensor] = None) -> torch.Tensor:
    """[B, S] document index of each token, matching what Hugging Face attends to on one device.

    Without a padding mask: a new document wherever the position ids do not go up by one (transformers'
    packed-sequence rule). With one, Hugging Face ignores the position ids and masks the padding: every
    real token is one document (so real tokens attend to each other exactly as there), and each padding
    token is a document of its own (it attends only to itself: no empty rows, and it never feeds a real
    token)."""
    if attention_mask is not None:
        seq = attention_mask.shape[-1]
        own = torch.arange(1, seq + 1, device=attention_mask.device).expand_as(attention_mask)
        return torch.where(attention_mask.bool(), torch.zeros_like(own), own)
    first = position_ids[:, :1] - 1
    return (torch.diff(position_ids, prepend=first, dim=-1) != 1).cumsum(-1)


def split_batch(
    batch: Mapping[str, torch.Tensor], sp_rank: int, sp_size: int, pad_id: int = 0
) -> Tuple[Dict[str, torch.Tensor], Optional[torch.Tensor]]:
    """This sp rank's share of a FULL batch: (the model's keyword inputs, the slice's next-token targets).

    The labels move to the next token before the split, so the last token of a slice is scored against
    the first of the next one. The inputs are the slice's input_ids and position_ids (made as 0..S-1
    when the batch has none, as Hugging Face does) and the whole sequence's `sp_document_ids` (None
    when the batch has neither position ids nor padding: one document per row). A padded
    batch (attention_mask) whose length the degree does not divide is padded further (label -100, a
    document per padding token); a batch without padding must already divide, which the recipe checks
    before training (max_seq_len a multiple of sp_size)."""
    unknown = sorted(set(batch) - set(BATCH_KEYS))
    if unknown:
        raise ValueError(
            f"sequence parallel: the batch has {unknown}, which split_batch does not know how to split "
            f"(it splits {list(BATCH_KEYS)}). Drop them or use sp_size 1."
        )
    ids = batch["input_ids"]
    rows, seq = ids.shape
    mask, positions, labels = batch.get("attention_mask"), batch.get("position_ids"), batch.get("labels")
    extra = (-seq) % sp_size
    if extra:
        if mask is None:
            raise ValueError(
                f"sequence parallel: the sequence length {seq} is not a multiple of sp_size={sp_size}. Set "
                f"max_seq_len to a multiple of {sp_size}."
            )
        ids = F.pad(ids, (0, extra), value=pad_id)
        mask = F.pad(mask, (0, extra), value=0)
        labels = F.pad(labels, (0, extra), value=-100) if labels is not None else None
        positions = F.pad(positions, (0, extra), value=0) if positions is not None else None
        seq += extra
    # Neither position ids nor padding: one document per row, and the attention needs no mask (an
    # [S, S] mask per row would cost S^2 bytes at every layer and keep SDPA off its flash kernel).
    documents = None if positions is None and mask is None else document_ids(positions, mask)
    if positions is None:
        positions = torch.arange(seq, device=ids.device).expand(rows, seq)
    elif positions.shape[0] != rows:
        positions = positions.expand(rows, seq)
    if documents is not None and documents.shape[0] != rows:
        documents = documents.expand(rows, seq)
    chunk = seq // sp_size
    part = slice(sp_rank * chunk, (sp_rank + 1) * chunk)
    inputs = {"input_ids": ids[:, part], "position_ids": positions[:, part], DOCUMENT_IDS: documents}
    targets = None
    if labels is not None:
        targets = F.pad(labels[:, 1:], (0, 1), value=-100)[:, part]
    return inputs, targets

"""What tensor- and sequence-parallel degrees can run with: one rule, one refusal text, for every caller.

The plan (`ParallelPlan._validate`, `ParallelPlan.mesh`), `FSDPStrategy`, the fine-tuning recipe
(`recipes/parallel.check_parallel`), the planner (`plan/parallel.degree_problem`) and the tp module ask
the same questions about tp and sp: is the degree a positive integer, does tp x sp divide the world, the
attention heads and key/value heads (each rank attends with whole heads: tp splits them, sp splits each
tp rank's share again), the sequence length, the sizes a tensor-parallel plan splits; and what the
dimensions cannot be combined with (an engine other than FSDP, CPU offload, torch.compile, adapters,
flash-attn's own kernels, tied embeddings). Each rule is a function that returns the refusal (None
when the degrees can run), worded with the caller's own spellings (`names`: "tp"/"sp" for a plan,
"tp_size"/"sp_size" for the flags), so a rule is changed in one place. Imports no torch: the CLI,
the recipe's config checks and the planner read it before anything is built.
"""

from __future__ import annotations

from typing import Any, List, Optional, Sequence

FLAGS = ("tp_size", "sp_size")  # how the Trainer's strategy, the recipe and the CLI spell the degrees
FIELDS = ("tp", "sp")  # how a ParallelPlan spells them
EP_FLAG, EP_FIELD = "ep_size", "ep"  # the expert-parallel degree: the Trainer's / recipe's spelling, a plan's


def said(tp: int, sp: int, names: Sequence[str] = FLAGS) -> str:
    """The degrees in effect as the user wrote them: "tp_size=2 x sp_size=4" (1 means off, left out)."""
    return " x ".join(f"{n}={v}" for n, v in zip(names, (tp, sp)) if v > 1) or f"{names[0]}=1 x {names[1]}=1"


def refuse(problem: Optional[str]) -> None:
    """Raise ValueError(problem) when there is one."""
    if problem:
        raise ValueError(problem)


def value_problem(name: str, value: Any) -> Optional[str]:
    """A degree that is not a positive integer."""
    if isinstance(value, int) and not isinstance(value, bool) and value >= 1:
        return None
    return f"{name}={value!r}: use a positive integer (1 switches that dimension off)."


def world_problem(world: int, tp: int, sp: int, names: Sequence[str] = FLAGS) -> Optional[str]:
    """tp x sp ranks share each batch, so their product must divide the world."""
    g = tp * sp
    if world % g == 0:
        return None
    return (
        f"{names[0]} x {names[1]} = {g} does not divide the {world} processes (the world size, devices x "
        f"num_nodes). Use devices a multiple of {g} per node, or smaller degrees."
    )


def node_problem(tp: int, sp: int, per_node: int, names: Sequence[str] = FLAGS) -> Optional[str]:
    """A tp x sp group communicates on every layer: it must sit inside one node."""
    g = tp * sp
    if per_node % g == 0:
        return None
    return (
        f"{said(tp, sp, names)}: the group of {g} devices must fit inside a node of {per_node} (its collectives "
        f"run on every layer, on the intra-node link); use degrees whose product divides {per_node}."
    )


def engine_problem(engine: str, tp: int, sp: int, names: Sequence[str] = FLAGS) -> Optional[str]:
    """Tensor and sequence parallel are dimensions of the FSDP engine's DeviceMesh; no other engine has one."""
    if tp * sp == 1 or engine == "fsdp":
        return None
    what = " and ".join(w for w, v in (("tensor", tp), ("sequence", sp)) if v > 1)
    why = (
        "(ZeRO partitions over the whole world and has no mesh to put it on)"
        if engine == "deepspeed"
        else f"(not {engine!r}): tensor and sequence parallel are dimensions of the FSDP strategy's mesh"
    )
    flags = ", ".join(f"{n}={v}" for n, v in zip(FLAGS, (tp, sp)) if v > 1)
    return (
        f"{said(tp, sp, names)} with engine {engine!r}: {what} parallel runs with FSDP only {why}. Use "
        f"strategy='fsdp' (FSDPStrategy(..., {flags}); shardwise finetune: --strategy fsdp), where NO_SHARD "
        "replicates the rest and HYBRID_SHARD shards inside a node."
    )


def offload_problem(tp: int, offload: bool, names: Sequence[str] = FLAGS) -> Optional[str]:
    """FSDP2's CPU offload takes no tensor-parallel (2-D DTensor) parameters."""
    if tp == 1 or not offload:
        return None
    return (
        f"{names[0]}={tp} with cpu_offload (CPU offload): FSDP2's offload does not support tensor-parallel "
        f"(2-D, DTensor on tp) parameters. Drop cpu_offload, or use sequence parallel ({FLAGS[1]}) or more FSDP "
        "ranks, which divide the memory without offload, instead of tp."
    )


def compile_problem(
    tp: int, sp: int, compiled: bool, flag: str = "compile", names: Sequence[str] = FLAGS
) -> Optional[str]:
    """The collectives inside a tp / sp block are not compiled and tested here."""
    if tp * sp == 1 or not compiled:
        return None
    what = "tensor" if tp > 1 else "sequence"
    return (
        f"{flag} with {said(tp, sp, names)}: torch.compile with {what} parallel is not supported here yet (its "
        f"collectives inside each block are not compiled and tested). Drop {flag}, or the tp / sp degree."
    )


def adapter_problem(tp: int, adapter: Optional[str], names: Sequence[str] = FLAGS) -> Optional[str]:
    """`adapter` (e.g. "lora_r=4 (LoRA)"): PEFT's layers and 4-bit weights are not split by a tp plan."""
    if tp == 1 or not adapter:
        return None
    return (
        f"{names[0]}={tp} with {adapter}: the tensor-parallel plan splits the base model's Linear layers, and "
        "PEFT's adapter layers (and bitsandbytes' 4-bit weights) are not split by it. Use sp_size or FSDP alone "
        "with adapters, or full fine-tuning with tp_size."
    )


def attention_problem(sp: int, implementation: Optional[str], names: Sequence[str] = FLAGS) -> Optional[str]:
    """Sequence parallel runs its attention through sdpa / eager, not flash-attn's own kernels."""
    if sp == 1 or implementation != "flash_attention_2":
        return None
    return (
        f"{names[1]}={sp} with attn_implementation='flash_attention_2': sequence parallel goes through the sdpa "
        "/ eager attention of transformers' attention interface here. Use attn_implementation='sdpa' (it "
        "dispatches to flash kernels on GPUs that have them)."
    )


def tied_problem(tp: int, tied: bool, model: str, names: Sequence[str] = FLAGS) -> Optional[str]:
    """Tensor parallel splits the embedding by vocabulary rows and the head by output columns."""
    if tp == 1 or not tied:
        return None
    return (
        f"{names[0]}={tp}: {model} ties its output head to its input embedding, and tensor parallel splits the "
        "two along different dimensions. Use sp_size or FSDP alone for this model, or untie them "
        "(tie_word_embeddings=False in config.json, GPTConfig(tie_embeddings=False))."
    )


def head_degrees(heads: int, kv_heads: int, other: int = 1) -> List[int]:
    """Degrees d for which d x `other` ranks split both head counts into whole heads."""
    return [d for d in range(1, heads + 1) if heads % (d * other) == 0 and kv_heads % (d * other) == 0]


# A Hugging Face config's names of the attention and key/value head counts.
HF_HEAD_FIELDS = ("num_attention_heads", "num_key_value_heads")


def heads_problem(
    heads: int,
    kv_heads: int,
    tp: int,
    sp: int,
    model: str,
    where: str = "",
    names: Sequence[str] = FLAGS,
    fields: Optional[Sequence[str]] = None,
) -> Optional[str]:
    """tp splits the attention and key/value heads, sp splits each tp rank's share again: tp x sp must divide both.

    `model`: the model's short name; `where`: where its head counts come from (a config.json); `fields`: the
    config's names of the two counts (a Hugging Face config's num_attention_heads / num_key_value_heads), named
    in the refusal so the user finds the number."""
    g = tp * sp
    if heads % g == 0 and kv_heads % g == 0:
        return None
    if tp > 1 and (heads % tp or kv_heads % tp):
        name, degree, other = names[0], tp, 1
    else:
        name, degree, other = names[1], sp, tp
    count, what = (kv_heads, "key/value heads") if heads % (degree * other) == 0 else (heads, "attention heads")
    source = where or model
    if fields:
        field = fields[1] if what == "key/value heads" else fields[0]
        source = f"{field}={count}" + (f" in {where}" if where else "")
    per = f" (per {names[0]}={tp} rank: {count // tp})" if other > 1 else ""
    return (
        f"{name}={degree} does not divide the model's {count} {what}{per} ({source}): {g} ranks must split "
        f"{model}'s {heads} attention heads and {kv_heads} key/value heads evenly, each rank attending with whole "
        f"heads. Use {name} in {head_degrees(heads, kv_heads, other)}."
    )


def sequence_problem(
    seq_len: int, tp: int, sp: int, seq_name: str = "seq_len", tp_slices: bool = True, names: Sequence[str] = FLAGS
) -> Optional[str]:
    """Each rank that splits a sequence holds an equal slice of it: sp (and with `tp_slices`, tp x sp) must divide it.

    tp_slices: whether the tp ranks hold slices too (the bundled GPT's sequence-parallel norms); a Hugging
    Face model under the recipe pads unpacked batches instead, so only sp counts there."""
    divisor = tp * sp if tp_slices else sp
    if seq_len % divisor == 0:
        return None
    label = f"{names[0]} x {names[1]}" if tp_slices else names[1]
    fit = seq_len - seq_len % divisor or divisor
    return (
        f"{said(tp if tp_slices else 1, sp, names)} does not divide {seq_name}={seq_len}: the sequence length "
        f"{seq_len} must be a multiple of {label} = {divisor} (every rank holds an equal slice of it). Use "
        f"{seq_name}={fit} (a multiple of {divisor})."
    )


def split_problem(tp: int, size_name: str, value: Any, names: Sequence[str] = FLAGS) -> Optional[str]:
    """A dimension the tensor-parallel plan splits into tp equal shares (intermediate size, vocabulary)."""
    if tp == 1 or not isinstance(value, int) or value % tp == 0:
        return None
    pad = ", or pad the vocabulary (resize_token_embeddings) to a multiple of it" if size_name == "vocab_size" else ""
    return (
        f"{names[0]}={tp} does not divide the model's {size_name}={value}: the tensor-parallel plan splits that "
        f"dimension into equal shares. Use a {names[0]} that divides {value}{pad}."
    )


def plan_problem(
    engine: str, tp: int, sp: int, offload: bool, compiled: bool, names: Sequence[str] = FIELDS
) -> Optional[str]:
    """Every rule a configuration alone decides (no model, no world): the first that refuses it."""
    for name, value in zip(names, (tp, sp)):
        problem = value_problem(name, value)
        if problem:
            return problem
    return (
        engine_problem(engine, tp, sp, names)
        or offload_problem(tp, offload, names)
        or compile_problem(tp, sp, compiled, names=names)
    )


# ---------------------------------------------------------------------- expert parallel
# ep splits the experts of a mixture-of-experts model over ep ranks carved out of the data-parallel shard
# ranks (torchtitan's layout): those ranks read different samples and exchange tokens by all-to-all.


def expert_degree_problem(ep: int, dp_shard: int, name: str = EP_FLAG) -> Optional[str]:
    """The ep ranks are carved out of the FSDP shard ranks: ep must divide dp_shard."""
    if ep == 1 or (dp_shard >= 1 and dp_shard % ep == 0):
        return None
    return (
        f"{name}={ep} does not divide the {dp_shard} data-parallel shard ranks: the expert-parallel ranks are "
        f"taken from the ranks FSDP shards over (the processes divided by tp x sp and by the replicas). Use a "
        f"world of a multiple of {ep} shard ranks, or an {name} that divides {dp_shard}."
    )


def experts_problem(
    ep: int, num_experts: Optional[int], model: str = "the model", name: str = EP_FLAG
) -> Optional[str]:
    """Each ep rank holds num_experts / ep whole experts."""
    if ep == 1 or num_experts is None:
        return None
    if num_experts < 1:
        return f"{name}={ep}: {model} has no experts (not a mixture-of-experts model). Leave {name} at 1."
    if num_experts % ep == 0:
        return None
    fits = [d for d in range(1, num_experts + 1) if num_experts % d == 0]
    return (
        f"{name}={ep} does not divide {model}'s {num_experts} experts: each expert-parallel rank holds an equal "
        f"number of whole experts. Use {name} in {fits}."
    )


def expert_engine_problem(engine: str, ep: int, name: str = EP_FLAG) -> Optional[str]:
    """Expert parallel is a dimension of the FSDP strategy's mesh."""
    if ep == 1 or engine == "fsdp":
        return None
    why = (
        "ZeRO partitions every parameter over the whole world and has no mesh dimension for experts"
        if (engine == "deepspeed")
        else f"engine {engine!r} has no device mesh to place experts on"
    )
    return (
        f"{name}={ep} with engine {engine!r}: expert parallel runs with FSDP only ({why}). Use strategy='fsdp' "
        f"(FSDPStrategy(..., ep_size={ep}); shardwise finetune: --strategy fsdp --ep_size {ep})."
    )


def expert_combination_problem(
    ep: int, tp: int = 1, sp: int = 1, offload: bool = False, compiled: bool = False, name: str = EP_FLAG
) -> Optional[str]:
    """What expert parallel is not combined with here: tp, CPU offload, torch.compile (sp composes: `sp` is
    kept in the signature for the callers that pass it)."""
    if ep == 1:
        return None
    if tp > 1:
        return (
            f"{name}={ep} with tp_size={tp}: expert parallel with tensor parallel is not supported (the experts "
            "would need a tensor-parallel plan of their own). Use ep_size with FSDP alone, or tp_size without "
            "ep_size."
        )
    if offload:
        return (
            f"{name}={ep} with cpu_offload (CPU offload): FSDP2's offload does not take the experts' two-dimensional "
            "(FSDP x ep) parameters. Drop cpu_offload; ep already divides the experts' memory by ep_size."
        )
    if compiled:
        return (
            f"compile with {name}={ep}: torch.compile with expert parallel is not supported here yet (the token "
            "all-to-all inside each block is not compiled and tested). Drop compile, or ep_size."
        )
    return None


def quantized_experts_problem(ep: int, what: str = "QLoRA (4-bit base weights)") -> Optional[str]:
    """bitsandbytes quantizes nn.Linear weights; stacked [experts, out, in] expert weights are no Linear."""
    if ep == 1:
        return None
    return (
        f"{EP_FLAG}={ep} with {what}: bitsandbytes quantizes nn.Linear layers, and the experts' weights are "
        "stacked three-dimensional tensors it cannot quantize or split over ep ranks. Use LoRA (16-bit base "
        "weights) with ep_size, or QLoRA without it."
    )


__all__ = [
    "FLAGS",
    "FIELDS",
    "said",
    "refuse",
    "value_problem",
    "world_problem",
    "node_problem",
    "engine_problem",
    "offload_problem",
    "compile_problem",
    "adapter_problem",
    "attention_problem",
    "tied_problem",
    "head_degrees",
    "heads_problem",
    "sequence_problem",
    "split_problem",
    "plan_problem",
    "EP_FLAG",
    "EP_FIELD",
    "expert_degree_problem",
    "experts_problem",
    "expert_engine_problem",
    "expert_combination_problem",
    "quantized_experts_problem",
]

"""Sequence and tensor parallel degrees for the planner: which ones a model allows, and the candidates they make.

Sequence parallel (Ulysses: each rank holds 1/sp of every sequence and
all-to-alls q, k, v and the attention output so that attention runs on 1/sp
of the heads over the whole sequence) and tensor parallel (column / row-wise
projections, 1/tp of every matmul) are mesh dimensions of the FSDP engine
(`ParallelPlan(engine="fsdp", tp=, sp=)`). A tp x sp group reads the same
sequences and splits their work, so the planner keeps the global batch fixed:
`batch_size` stays the sequences per device per step, and the data-parallel
rank of a group of g = tp x sp devices takes g x batch_size sequences per step
(`group_batch`), in micro-batches when they do not fit. Per-device compute is
then the same for every configuration and step times compare like for like.

A degree is refused (with the fix) when it cannot run the model: the group
must fit inside one node (its collectives are priced on the intra-node link),
and it must divide the attention heads, the key / value heads (each rank
attends with whole heads) and the sequence length (each sp rank, and each tp
rank of a sequence-parallel norm, holds an equal slice). `shardwise plan
--sp_size N --tp_size N` plans the FSDP configurations at those degrees. With
neither given, when nothing in the default comparison fits the device (at
long sequences activations, not weights, decide that), the planner searches
each degree alone that divides the devices per node (FSDP FULL_SHARD with and
without activation checkpointing; sequence parallel also with CPU offload),
for models that have the attention hook sp and tp need (the
bundled GPT / Llama shapes, Hugging Face causal LMs). A bundled GPT gathers
the sequence before its head, so every sp rank computes the whole sequence's
logits; a Hugging Face model is planned as the finetune recipe runs it: each
sp rank computes and scores its own slice.
"""

from __future__ import annotations

from dataclasses import replace
from typing import List, Optional, Sequence, Tuple

from shardwise.plan import moe
from shardwise.plan.candidates import Candidate
from shardwise.plan.errors import PlanError
from shardwise.plan.presets import ModelSpec, divisors
from shardwise.strategies import degrees
from shardwise.strategies.parallel import ParallelPlan

# Models whose attention the engines can split (strategies/sequence_parallel.py, tensor_parallel.py).
PARALLEL_KINDS = ("gpt", "hf")


def group_size(plan: ParallelPlan) -> int:
    """Devices that read the same sequences: tp x sp."""
    return plan.tp * plan.sp


def group_batch(plan: ParallelPlan, batch_size: int) -> int:
    """Sequences per step on one data-parallel rank of `plan` when every device's share is `batch_size`."""
    return batch_size * group_size(plan)


def degree_problem(spec: ModelSpec, seq_len: int, tp: int, sp: int, per_node: int) -> Optional[str]:
    """Why tp x sp cannot run `spec` at `seq_len` on nodes of `per_node` devices; None when it can.

    The rules are strategies/degrees.py's (the plan, the strategy and the recipe refuse with the same texts);
    whether the model has the attention hook sp and tp need is the planner's own question."""
    if tp * sp == 1:
        return None
    names = degrees.FIELDS
    if spec.kind not in PARALLEL_KINDS:
        return (
            f"{degrees.said(tp, sp, names)}: sequence and tensor parallel need a model with their attention hook (the "
            f"bundled GPT / Llama presets, a GPTConfig, a Hugging Face causal LM); {spec.name} is a {spec.kind} "
            "model. Plan it without --sp_size/--tp_size."
        )
    tied = spec.config.tie_embeddings if spec.kind == "gpt" else getattr(spec.config, "tie_word_embeddings", False)
    return (
        degrees.node_problem(tp, sp, per_node, names)
        or degrees.heads_problem(spec.heads, spec.kv_heads, tp, sp, spec.name, names=names)
        or degrees.tied_problem(tp, bool(tied), spec.name, names)
        or degrees.sequence_problem(seq_len, tp, sp, names=names)
    )


def searched_degrees(spec: ModelSpec, seq_len: int, per_node: int) -> Tuple[List[Tuple[int, int]], List[str]]:
    """Every (tp, sp) but (1, 1) that runs `spec` inside a node, and why the others do not (one line each)."""
    ok, skipped = [], []
    for g in divisors(per_node)[1:]:
        for tp in divisors(g):
            sp = g // tp
            problem = degree_problem(spec, seq_len, tp, sp, per_node)
            if problem is None:
                ok.append((tp, sp))
            elif spec.kind in PARALLEL_KINDS:
                skipped.append(problem)
    return ok, skipped


def with_parallel_degrees(
    cands: List[Candidate],
    spec: ModelSpec,
    seq_len: int,
    world: int,
    num_nodes: int,
    tp_size: Optional[int],
    sp_size: Optional[int],
    *,
    requested: bool,
) -> Tuple[List[Candidate], List[str]]:
    """The candidates at fixed degrees (tp_size / sp_size given), or plus the searched ones; and notes.

    requested: the user named the configurations (--only, candidates=, strategy=); then a
    configuration that cannot take the degrees is an error, not dropped. Candidates that
    already carry degrees (a user's strategy object, a ParallelPlan) are checked, not changed.
    """
    per_node = max(1, world // max(1, num_nodes))
    for size, flag in zip((tp_size, sp_size), degrees.FLAGS):
        problem = None if size is None else degrees.value_problem(flag, size)
        if problem:
            raise PlanError(problem)
    notes: List[str] = []
    for c in cands:  # degrees the user's own plans or strategy objects carry
        if group_size(c.plan) > 1 and tp_size is None and sp_size is None:
            problem = degree_problem(spec, seq_len, c.plan.tp, c.plan.sp, per_node)
            if problem:
                raise PlanError(problem)
    if tp_size is not None or sp_size is not None:
        tp, sp = tp_size or 1, sp_size or 1
        problem = degree_problem(spec, seq_len, tp, sp, per_node)
        if problem:
            raise PlanError(problem)
        if tp * sp == 1:
            return cands, notes
        return _at_degrees(cands, tp, sp, requested), notes
    return cands, notes


def search_parallel(
    spec: ModelSpec, seq_len: int, world: int, num_nodes: int, offload: bool
) -> Tuple[List[Candidate], List[str]]:
    """The sequence / tensor parallel candidates to try when nothing else fits, and what the search did.

    One dimension at a time (2-D groups only when asked for with both flags): FSDP FULL_SHARD with and
    without activation checkpointing at every degree that runs the model inside a node, and with
    sequence parallel also FULL_SHARD + CPU offload + AC (`offload`: when the target has offload).
    """
    per_node = max(1, world // max(1, num_nodes))
    if spec.kind not in PARALLEL_KINDS or per_node == 1:
        return [], []
    pairs, skipped = searched_degrees(spec, seq_len, per_node)
    pairs = [p for p in pairs if 1 in p]
    extra = []
    for tp, sp in sorted(pairs, key=lambda p: (p[0] > 1, p[0] * p[1])):
        for ac in (False, True):
            extra.append(Candidate(ParallelPlan("fsdp", tp=tp, sp=sp, ac="full" if ac else "none")))
        if offload and tp == 1:
            both = dict(offload_params=True, offload_optimizer=True)
            extra.append(Candidate(ParallelPlan("fsdp", sp=sp, ac="full", **both)))
    notes = []
    if pairs:
        said = ", ".join(_degrees_label(tp, sp) for tp, sp in pairs)
        notes.append(
            f"Nothing fit without sequence / tensor parallel, so these degrees were searched inside a node: {said} "
            "(FSDP FULL_SHARD with and without AC, sp also with offload + AC). A tp x sp group reads the same "
            "sequences: its data-parallel rank takes tp x sp times the per-device batch, so the global batch is "
            "the same in every row. --sp_size / --tp_size plan other degrees (2-D with both)."
        )
    elif skipped:
        notes.append(f"No sequence / tensor parallel degree runs this model inside a node: {skipped[0]}")
    return extra, notes


def with_expert_degrees(
    cands: List[Candidate], spec: ModelSpec, world: int, num_nodes: int, ep_size: Optional[int], *, requested: bool
) -> Tuple[List[Candidate], List[str]]:
    """The candidates with expert parallel: at `ep_size` when given, or plus the searched degrees for a MoE model.

    requested: the user named the configurations (then one that cannot take ep_size is an error). A user's
    strategy object keeps its own degree and is only checked."""
    facts = moe.moe_facts(spec)
    if ep_size is not None:
        problem = degrees.value_problem(degrees.EP_FLAG, ep_size)
        if problem:
            raise PlanError(problem)
    for c in cands:
        problem = moe.ep_problem(facts, spec.name, c.plan.ep, world, c.plan)
        if problem:
            raise PlanError(problem)
    if ep_size is not None and ep_size > 1:
        degrees_said = degrees.experts_problem(ep_size, facts.experts if facts else 0, spec.name)
        if degrees_said:  # the model itself cannot take the degree: no configuration can
            raise PlanError(degrees_said)
        out, skipped = [], []
        for c in cands:
            if c.strategy is not None:
                if c.plan.ep != ep_size:
                    raise PlanError(
                        f"Your strategy object runs ep {c.plan.ep}, but --ep_size asks for {ep_size}: give the "
                        "degree to the strategy (FSDPStrategy(ep_size=)) only."
                    )
                out.append(c)
                continue
            problem = moe.ep_problem(facts, spec.name, ep_size, world, c.plan)
            if problem is None:
                try:
                    out.append(replace(c, plan=replace(c.plan, ep=ep_size)))
                    continue
                except ValueError as exc:
                    problem = str(exc)
            if requested:
                raise PlanError(f"{c.config_label} at ep {ep_size}: {problem}")
            skipped.append(problem)  # a default configuration the degree does not combine with (DDP, ZeRO, offload)
        if not out:
            raise PlanError(f"No configuration runs ep {ep_size}: {skipped[-1] if skipped else 'none was given'}")
        return out, [f"{spec.name}: {facts.describe()}."]
    if ep_size is not None or requested or facts is None:
        return cands, []
    found = moe.searched_ep(facts, world, num_nodes)
    extra = []
    for ep in found:
        for ac in ("none", "full"):
            plan = ParallelPlan("fsdp", ep=ep, ac=ac)
            if moe.ep_problem(facts, spec.name, ep, world, plan) is None:
                extra.append(Candidate(plan))
    notes = [f"{spec.name}: {facts.describe()}."]
    if found:
        notes.append(
            "Expert parallel searched at ep "
            + ", ".join(str(e) for e in found)
            + " (FSDP FULL_SHARD with and without AC; --ep_size N plans the FSDP rows at one degree)."
        )
    return cands + [c for c in extra if c not in cands], notes


def _at_degrees(cands: Sequence[Candidate], tp: int, sp: int, requested: bool) -> List[Candidate]:
    out = []
    for c in cands:
        if c.strategy is not None:
            if (c.plan.tp, c.plan.sp) != (tp, sp):
                raise PlanError(
                    f"Your strategy object runs tp {c.plan.tp} x sp {c.plan.sp}, but --tp_size/--sp_size ask for tp "
                    f"{tp} x sp {sp}: give the degrees to the strategy (FSDPStrategy(tp_size=, sp_size=)) only."
                )
            out.append(c)
            continue
        try:
            plan = replace(c.plan, tp=tp, sp=sp)
        except ValueError as exc:
            if requested:
                raise PlanError(f"{c.config_label} at {_degrees_label(tp, sp)}: {exc}") from None
            continue  # a default configuration the degrees do not combine with (DDP, ZeRO, offload)
        out.append(replace(c, plan=plan))
    if not out:
        raise PlanError(f"No configuration runs {_degrees_label(tp, sp)}: sequence and tensor parallel are FSDP's.")
    return out


def _degrees_label(tp: int, sp: int) -> str:
    return " x ".join(f"{k} {v}" for k, v in (("tp", tp), ("sp", sp)) if v > 1) or "tp 1 x sp 1"


def replicated_flops(spec: ModelSpec, plan: ParallelPlan) -> float:
    """Training FLOPs per token a device repeats for its sp group: the bundled GPT gathers the sequence
    before its head, so each of the sp ranks computes the head and the loss of the group's every token
    (the Hugging Face path scores only its slice)."""
    if spec.kind != "gpt" or plan.sp == 1:
        return 0.0
    return (plan.sp - 1) * 6.0 * spec.hidden * spec.vocab_size / plan.tp


def layer_shape(spec: ModelSpec) -> Tuple[int, int, int]:
    """(hidden, key/value width, layers): what sequence / tensor parallel's collectives move per token."""
    return spec.hidden, spec.hidden * spec.kv_heads // max(1, spec.heads), spec.depth or 0


__all__ = [
    "PARALLEL_KINDS",
    "group_size",
    "group_batch",
    "degree_problem",
    "searched_degrees",
    "with_parallel_degrees",
    "with_expert_degrees",
    "search_parallel",
    "layer_shape",
    "replicated_flops",
]

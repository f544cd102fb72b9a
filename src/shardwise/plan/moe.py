"""Mixture-of-experts models in the planner: their facts, expert parallel's candidates, its costs.

A mixture-of-experts (MoE) layer holds E experts (SwiGLU MLPs stacked [E, ...] in transformers 5.x's
fused layout) of which each token uses top_k, so its parameters are many and its FLOPs few:
Qwen3-30B-A3B has 30.5B parameters and trains 3.3B per token. `moe_facts` reads E, top_k and the
expert's width from a Hugging Face config (Qwen3-MoE, Mixtral, Qwen2-MoE, ...) or the bundled GPT-MoE's
config; the presets `qwen3-30b-a3b` and `mixtral-8x7b` are built from their published config.json
values on the meta device (no download). Expert parallel (`ep`, strategies/expert_parallel.py's
layout, torchtitan's dp_shard x ep) splits every MoE layer's experts over ep ranks carved out of the
FSDP shard ranks; FSDP shards the rest over all shard ranks and the experts over shard / ep ranks, so
under FULL_SHARD a rank's expert state is the same 1/world of it at any ep (what changes is what a
layer gathers: E/ep experts, over shard/ep ranks, none at all when ep = shard). The token exchange is
an all-to-all of the routed rows (tokens x top_k x hidden), there and back in the forward and again
for their gradients in the backward, which the experts wait for. The memory of ep rows is traced with
the real engine (routing as balanced as it can be: every expert gets tokens x top_k / E rows);
dropless routing has no capacity limit, so a rank can receive more: `dispatch_bytes` gives the
expected and the worst case (every token of the ep group routed to this rank's experts), and the plan
says how much the worst case adds. ep is searched (FSDP FULL_SHARD with and without checkpointing at
every ep that divides the experts and the shard ranks) whenever the model has experts: it changes the
step time, not only whether a step fits.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace
from typing import Any, Dict, List, Optional, Sequence, Tuple

from shardwise.plan.errors import PlanError
from shardwise.strategies import degrees
from shardwise.strategies.parallel import ParallelPlan

# Published config.json values (Hugging Face hub: Qwen/Qwen3-30B-A3B, mistralai/Mixtral-8x7B-v0.1).
MOE_PRESETS: Dict[str, Tuple[str, Dict[str, Any]]] = {
    "qwen3-30b-a3b": (
        "Qwen3MoeConfig",
        dict(
            vocab_size=151936,
            hidden_size=2048,
            intermediate_size=6144,
            moe_intermediate_size=768,
            num_hidden_layers=48,
            num_attention_heads=32,
            num_key_value_heads=4,
            head_dim=128,
            num_experts=128,
            num_experts_per_tok=8,
            norm_topk_prob=True,
            decoder_sparse_step=1,
            mlp_only_layers=[],
            max_position_embeddings=40960,
            rope_theta=1000000.0,
            rms_norm_eps=1e-6,
            router_aux_loss_coef=0.001,
            tie_word_embeddings=False,
        ),
    ),
    "mixtral-8x7b": (
        "MixtralConfig",
        dict(
            vocab_size=32000,
            hidden_size=4096,
            intermediate_size=14336,
            num_hidden_layers=32,
            num_attention_heads=32,
            num_key_value_heads=8,
            num_local_experts=8,
            num_experts_per_tok=2,
            max_position_embeddings=32768,
            rope_theta=1000000.0,
            rms_norm_eps=1e-5,
            router_aux_loss_coef=0.02,
            tie_word_embeddings=False,
        ),
    ),
}
MOE_ALIASES = {"qwen3-30b": "qwen3-30b-a3b", "mixtral-8x7b-v0.1": "mixtral-8x7b", "mixtral": "mixtral-8x7b"}


def moe_preset_config(key: str) -> Any:
    """The transformers config of a MoE preset (raises PlanError without transformers)."""
    cls_name, values = MOE_PRESETS[key]
    try:
        import transformers
    except ImportError as exc:  # pragma: no cover - the extra is missing
        raise PlanError(f"The {key} preset is a Hugging Face model: pip install 'shardwise[hf]'.") from exc
    cfg = getattr(transformers, cls_name)(**values)
    cfg.architectures = [cls_name.replace("Config", "ForCausalLM")]
    return cfg


@dataclass(frozen=True)
class MoEFacts:
    """What expert parallel's accounting needs of a MoE model (counts at the model's full depth)."""

    experts: int  # routed experts per MoE layer
    top_k: int  # experts per token
    expert_ffn: int  # one expert's intermediate width
    hidden: int
    moe_layers: int  # layers with experts
    depth: int  # all layers
    matrices: int = 3  # gate, up, down

    @property
    def per_expert(self) -> int:
        return self.matrices * self.hidden * self.expert_ffn

    @property
    def layer_params(self) -> int:
        """One MoE layer's expert parameters (the router not included: it is dense)."""
        return self.experts * self.per_expert

    @property
    def expert_params(self) -> int:
        return self.moe_layers * self.layer_params

    @property
    def idle_params(self) -> int:
        """Expert parameters a token does not pass through: they hold memory but cost no FLOPs."""
        return self.moe_layers * (self.experts - self.top_k) * self.per_expert

    def describe(self) -> str:
        return (
            f"{self.moe_layers} MoE layers x {self.experts} experts (top-{self.top_k}, width {self.expert_ffn}): "
            f"{_count(self.expert_params)} expert parameters"
        )


def _count(n: int) -> str:
    return f"{n / 1e9:.2f}B" if n >= 1e9 else f"{n / 1e6:.2f}M"


def _first(cfg: Any, *keys: str) -> Any:
    for key in keys:
        value = getattr(cfg, key, None)
        if value is not None:
            return value
    return None


def moe_facts(spec: Any) -> Optional[MoEFacts]:
    """The spec's MoE facts, or None for a dense model (a spec of plan/presets.py)."""
    cfg = spec.config
    if spec.kind not in ("hf", "gpt") or cfg is None:
        return None
    experts = _first(cfg, "num_experts", "num_local_experts", "n_routed_experts", "n_experts", "moe_num_experts")
    top_k = _first(cfg, "num_experts_per_tok", "moe_top_k", "top_k", "n_experts_per_tok")
    if not experts or not top_k or int(experts) <= 1:
        return None
    width = _first(cfg, "moe_intermediate_size", "expert_size", "expert_ffn_size", "moe_ffn_size")
    width = width or _first(cfg, "intermediate_size") or spec.ffn
    depth = int(spec.depth or 1)
    return MoEFacts(
        experts=int(experts),
        top_k=int(top_k),
        expert_ffn=int(width),
        hidden=int(spec.hidden),
        moe_layers=sum(1 for i in range(depth) if is_moe_layer(cfg, i)),
        depth=depth,
    )


def is_moe_layer(cfg: Any, index: int) -> bool:
    """Whether layer `index` has experts: Qwen-MoE's decoder_sparse_step / mlp_only_layers, DeepSeek's dense first
    layers (first_k_dense_replace), every layer otherwise."""
    if index in (getattr(cfg, "mlp_only_layers", None) or []):
        return False
    if index < int(getattr(cfg, "first_k_dense_replace", 0) or 0):
        return False
    step = getattr(cfg, "decoder_sparse_step", None)
    return not step or (index + 1) % int(step) == 0


def idle_flops_per_token(facts: Optional[MoEFacts]) -> float:
    """Training FLOPs per token that 6 x parameters overcounts for a MoE model (the experts a token skips)."""
    return 0.0 if facts is None else 6.0 * facts.idle_params


# ------------------------------------------------------------------ degrees
def ep_problem(facts: Optional[MoEFacts], name: str, ep: int, world: int, plan: ParallelPlan) -> Optional[str]:
    """Why `plan` at expert-parallel degree `ep` cannot run `name` on `world` ranks (degrees.py's texts); None
    when it can."""
    if ep == 1:
        return None
    return (
        degrees.experts_problem(ep, facts.experts if facts else 0, name)
        or degrees.expert_engine_problem(plan.engine, ep)
        or degrees.expert_combination_problem(ep, plan.tp, plan.sp, plan.offload_params or plan.offload_optimizer)
        or degrees.expert_degree_problem(ep, _shard_ranks(plan, world))
    )


def _shard_ranks(plan: ParallelPlan, world: int) -> int:
    try:
        return replace(plan, ep=1).mesh(world).dp_shard
    except ValueError:
        return 1


def searched_ep(facts: Optional[MoEFacts], world: int, num_nodes: int) -> List[int]:
    """The ep degrees > 1 that divide the experts and the shard ranks of FULL_SHARD on `world` ranks."""
    if facts is None or world < 2:
        return []
    return [ep for ep in range(2, world + 1) if world % ep == 0 and facts.experts % ep == 0]


# ------------------------------------------------------------------ memory
def expert_rows_per_rank(facts: MoEFacts, ep: int, shard_ranks: int) -> int:
    """Experts of one layer whose parameters rank 0 holds a slice of, FSDP2's padding included: each ep rank
    holds E/ep experts and FSDP shards them over shard/ep ranks along the expert dimension."""
    efsdp = max(1, shard_ranks // ep)
    return math.ceil(facts.experts / ep / efsdp)


def dispatch_bytes(facts: MoEFacts, tokens: int, ep: int, act_bytes: int, checkpointed: bool) -> Tuple[float, float]:
    """(expected, worst) bytes of the routed rows a rank keeps for its experts' backward, over its MoE layers.

    tokens: this rank's tokens per micro-batch. Each MoE layer saves the rows it computes: their inputs
    (hidden), the gate / up output (2 x width) and the activation (width). Balanced routing sends every
    rank tokens x top_k rows; dropless routing's worst case sends it the whole ep group's (ep x as many).
    Checkpointed, one layer at a time is recomputed."""
    rows = tokens * facts.top_k
    per_row = (facts.hidden + 3 * facts.expert_ffn) * act_bytes
    layers = 1 if checkpointed else facts.moe_layers
    expected = layers * rows * per_row
    return float(expected), float(expected * ep)


def worst_case_notes(facts: Optional[MoEFacts], rows: Sequence[Any], seq_len: int, precision: str) -> List[str]:
    """What dropless routing's worst case adds to the ep rows (estimates of core.py): one line, or none."""
    if facts is None:
        return []
    act = 4 if precision in ("32-true", "64-true") else 2
    worst = []
    for e in rows:
        ep = e.candidate.plan.ep
        if ep > 1:
            tokens = e.candidate.micro_batch * seq_len
            expected, most = dispatch_bytes(facts, tokens, ep, act, e.candidate.plan.uses_ac)
            worst.append((most - expected, e.label))
    if not worst:
        return []
    extra, label = max(worst)
    return [
        "ep rows are planned with balanced routing (each expert gets tokens x top_k / experts rows). Routing is "
        "dropless, so an ep rank can receive more: in the worst case (every token of the ep group routed to its "
        f"experts) the routed rows it keeps add up to {_size(extra)} per device ({label}). The router's "
        "load-balancing loss keeps the load near balanced; the expert-load log shows it."
    ]


def _size(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{n:.1f} {unit}" if unit != "B" else f"{int(n)} B"
        n /= 1024
    return str(n)


# ------------------------------------------------------------------ communication
def expert_comm_bytes(
    facts: MoEFacts,
    plan: ParallelPlan,
    world: int,
    accumulation: int,
    tokens: int,
    gather_bytes: float,
    reduce_bytes: float,
    act_bytes: float,
) -> Tuple[float, float]:
    """(FSDP bytes saved on the experts, all-to-all bytes) each rank sends per step at `plan.ep`.

    FSDP prices every parameter as gathered and reduce-scattered over all shard ranks; under ep a layer's
    experts are E/ep of them, over shard/ep ranks (nothing moves when ep = shard): the difference is
    returned to subtract. The all-to-all sends this rank's routed rows (tokens x top_k x hidden) to the
    experts' ranks and the results back in the forward, and the gradients both ways in the backward
    (4 per MoE layer per micro-batch; checkpointing runs the forward's two again), all but 1/ep of them.
    """
    ep = plan.ep
    if ep <= 1 or plan.sharding == "NO_SHARD":
        return 0.0, 0.0
    shard = max(1, _shard_ranks(plan, world))
    gathers = (1 if plan.sharding == "SHARD_GRAD_OP" else 2) * accumulation
    scatters = accumulation
    x = float(facts.expert_params)
    full = (shard - 1) / shard * x * (gathers * gather_bytes + scatters * reduce_bytes)
    efsdp = max(1, shard // ep)
    under_ep = (efsdp - 1) / efsdp * x / ep * (gathers * gather_bytes + scatters * reduce_bytes)
    passes = 4 + (2 if plan.uses_ac else 0)
    a2a = accumulation * facts.moe_layers * passes * tokens * facts.top_k * facts.hidden * act_bytes * (ep - 1) / ep
    return full - under_ep, a2a


__all__ = [
    "MOE_PRESETS",
    "MOE_ALIASES",
    "MoEFacts",
    "moe_facts",
    "moe_preset_config",
    "is_moe_layer",
    "idle_flops_per_token",
    "ep_problem",
    "searched_ep",
    "expert_rows_per_rank",
    "dispatch_bytes",
    "worst_case_notes",
    "expert_comm_bytes",
]

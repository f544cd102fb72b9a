"""The bundled GPT with mixture-of-experts blocks: `GPTMoE`, `GPTMoEConfig`, `MoE`, `GPTExperts`.

Each block's MLP becomes a top-k router over `num_experts` SwiGLU experts (Mixtral's / Qwen3-MoE's shape:
softmax over the router logits, the k largest, optionally renormalised). The experts' weights are stacked
in the SAME layout as transformers 5.x fused experts (`gate_up_proj` [E, 2I, H], gate rows first,
`down_proj` [E, H, I]), so expert_parallel.experts_forward serves both. With norm_topk_prob, RMSNorm,
rotary positions and no biases the model is Mixtral's: `save_as_mixtral` writes a Hugging Face folder
that AutoModelForCausalLM loads (a renaming of the weights). Under expert parallel
(FSDPStrategy(ep_size=...)) the engine splits the stacked weights over the ep ranks and sets
`expert_group`; the experts then exchange tokens by all-to-all, the same arithmetic as on one process.
The router losses are computed once per forward over the global micro-batch
(expert_parallel.router_losses: one all-reduce of the token counts) and kept on the model
(`router_losses`); `loss(logits, targets)` returns the SUMMED cross-entropy plus
`router_aux_loss_coef x balance + router_z_loss_coef x z`, to pair with a TrainModule whose
`loss_weight(batch)` counts the target tokens: the Trainer then divides by the step's global token
count, so 1 process, ep ranks and dp x ep ranks take the same step from the same global batch. Under sequence
parallel the cross-entropy is every sp rank's whole (the logits are gathered) while each sp rank routes its
own slice, so the router losses are counted sp times too.
`expert_load` holds the per-expert token counts since callbacks/expert_load.py last read them.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace
from typing import Any, Optional

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from shardwise.expert_parallel import ExpertLoad, RouterLosses, experts_forward, router_losses
from shardwise.models.gpt import GPT, GPTConfig
from shardwise.ulysses import group_size

__all__ = [
    "GPTMoE",
    "GPTMoEConfig",
    "GPTExperts",
    "MoE",
    "Router",
    "MOE_PRESETS",
    "gpt_moe_config",
    "mixtral_config",
    "save_as_mixtral",
]

INIT_STD = 0.02  # GPT-2's N(0, 0.02), as the dense GPT's layers (residual projections scaled by depth)


@dataclass(frozen=True)
class GPTMoEConfig(GPTConfig):
    """GPTConfig plus the experts: `num_experts` per block, `top_k` of them per token, each with
    `moe_intermediate_size` (None: ffn_size / top_k, so a token's compute matches the dense MLP's)."""

    num_experts: int = 8
    top_k: int = 2
    moe_intermediate_size: Optional[int] = None
    norm_topk_prob: bool = True
    router_aux_loss_coef: float = 0.01
    router_z_loss_coef: float = 0.0

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.mlp != "swiglu":
            raise ValueError("GPTMoEConfig: the experts are SwiGLU (transformers' fused layout); use mlp='swiglu'.")
        if not 1 <= self.top_k <= self.num_experts:
            raise ValueError(f"top_k={self.top_k} must be between 1 and num_experts={self.num_experts}.")

    @property
    def expert_size(self) -> int:
        return self.moe_intermediate_size or max(1, self.ffn_size // self.top_k)

    def param_counts(self) -> dict[str, int]:
        """GPTConfig's counts with each block's MLP replaced by a router and the stacked experts."""
        counts = super().param_counts()
        d, f, b = self.n_embd, self.ffn_size, 1 if self.bias else 0
        dense = 2 * (d * f + b * f) + (f * d + b * d)
        experts = self.num_experts * 3 * d * self.expert_size
        per_block = counts["per_block"] - dense + d * self.num_experts + experts
        counts.update(per_block=per_block, blocks=self.n_layer * per_block, experts=self.n_layer * experts)
        return counts

    def num_params(self, non_embedding: bool = False) -> int:
        c = self.param_counts()
        if non_embedding:
            return c["blocks"] + c["final_norm"]
        return sum(v for k, v in c.items() if k not in ("per_block", "experts"))


class GPTExperts(nn.Module):
    """`num_experts` SwiGLU experts stacked in transformers' fused layout; routes its tokens itself."""

    routes_tokens_itself = True  # strategies/experts.py keeps this forward and sets expert_group

    def __init__(self, config: GPTMoEConfig) -> None:
        super().__init__()
        e, d, i = config.num_experts, config.n_embd, config.expert_size
        self.num_experts = e
        self.residual_std = INIT_STD / math.sqrt(2 * config.n_layer)
        self.gate_up_proj = nn.Parameter(torch.empty(e, 2 * i, d))
        self.down_proj = nn.Parameter(torch.empty(e, d, i))
        self.expert_group: Any = None  # the ep process group, set by apply_expert_parallel
        self.reset_parameters()

    def reset_parameters(self) -> None:
        nn.init.normal_(self.gate_up_proj, mean=0.0, std=INIT_STD)
        nn.init.normal_(self.down_proj, mean=0.0, std=self.residual_std)

    def forward(self, hidden: Tensor, top_k_index: Tensor, top_k_weights: Tensor) -> Tensor:
        return experts_forward(
            hidden,
            top_k_index,
            top_k_weights,
            self.gate_up_proj,
            self.down_proj,
            self.num_experts,
            F.silu,
            self.expert_group,
        )


class Router(nn.Linear):
    """The router's Linear (no bias), initialised N(0, 0.02) like the GPT's other layers."""

    def reset_parameters(self) -> None:
        nn.init.normal_(self.weight, mean=0.0, std=INIT_STD)


class MoE(nn.Module):
    """Router + experts in place of a block's MLP; keeps (router logits, top-k indices) for the losses."""

    def __init__(self, config: GPTMoEConfig) -> None:
        super().__init__()
        self.top_k, self.norm_topk_prob = config.top_k, config.norm_topk_prob
        self.router = Router(config.n_embd, config.num_experts, bias=False)
        self.experts = GPTExperts(config)
        self.routed: Optional[tuple[Tensor, Tensor]] = None

    def forward(self, x: Tensor) -> Tensor:
        h = x.reshape(-1, x.size(-1))
        logits = self.router(h)
        weights, index = logits.float().softmax(dim=-1).topk(self.top_k, dim=-1)
        if self.norm_topk_prob:
            weights = weights / weights.sum(dim=-1, keepdim=True)
        self.routed = (logits, index)  # (recomputation under checkpointing writes the same values again)
        return self.experts(h, index, weights.to(h.dtype)).view_as(x)


class GPTMoE(GPT):
    """GPT whose blocks route each token to `top_k` of `num_experts` experts: `forward(idx) -> logits`.

    After each forward, `router_losses` holds that micro-batch's global router losses (summed over this
    rank's tokens) and `expert_load` has counted its tokens per expert; `loss(logits, targets)` is the
    summed cross-entropy with the weighted router losses added. Tensor parallel is refused (the experts
    have no tensor-parallel plan); expert parallel is FSDPStrategy(ep_size=...)."""

    def __init__(self, config: GPTMoEConfig) -> None:
        super().__init__(config)
        self.moe_layers: list = []  # plain list: the blocks own the modules (and may be wrapped later)
        for block in self.blocks:
            block.mlp = MoE(config)
            self.moe_layers.append(block.mlp)
        self.router_losses: Optional[RouterLosses] = None
        self.expert_load = ExpertLoad()
        self.router_group: Any = None  # ranks reading different tokens for the counts' all-reduce (None: world)

    def tensor_parallel_plan(self, tp: int) -> dict:
        raise ValueError(
            f"tp_size={tp} with GPTMoE: the experts have no tensor-parallel plan. Use ep_size (expert parallel) "
            "with FSDP instead, or the dense GPT with tp_size."
        )

    def forward(self, idx: Tensor, position_ids: Tensor | None = None) -> Tensor:
        logits = super().forward(idx, position_ids)
        routed = [layer.routed for layer in self.moe_layers]
        for layer in self.moe_layers:
            layer.routed = None
        losses = router_losses(routed, self.config.num_experts, self.router_group)
        sp = group_size(self.sp_group)
        if sp > 1:
            # Under sequence parallel each sp rank routed its slice of the sequence, but the cross-entropy is
            # every sp rank's whole (the logits were gathered): the router losses count sp times as well, so
            # their share of the summed loss is one process's (the counts, all-reduced, are the true ones).
            losses = replace(losses, balance=losses.balance * sp, z=losses.z * sp)
        self.router_losses = losses
        if self.training:
            self.expert_load.add(self.router_losses.counts)
        return logits

    def loss(self, logits: Tensor, targets: Tensor, ignore_index: int = -100) -> Tensor:
        """Summed cross-entropy of `targets` plus the last forward's weighted router losses (summed per token)."""
        ce = F.cross_entropy(
            logits.reshape(-1, logits.size(-1)).float(), targets.reshape(-1), ignore_index=ignore_index, reduction="sum"
        )
        extra = self.router_losses
        if extra is None:
            return ce
        cfg = self.config
        return ce + cfg.router_aux_loss_coef * extra.balance + cfg.router_z_loss_coef * extra.z


MOE_PRESETS: dict[str, GPTMoEConfig] = {
    # Tiny shapes for tests and CPU demos (Llama-style attention, 8 experts, top-2).
    "gpt-moe-tiny": GPTMoEConfig(
        vocab_size=256,
        block_size=64,
        n_layer=2,
        n_head=4,
        n_kv_head=2,
        n_embd=64,
        norm="rmsnorm",
        mlp="swiglu",
        rope=True,
        bias=False,
        tie_embeddings=False,
        num_experts=8,
        top_k=2,
        moe_intermediate_size=32,
    ),
}


def gpt_moe_config(name: str, **changes: object) -> GPTMoEConfig:
    """Look up a GPT-MoE preset by name, optionally overriding fields."""
    if name not in MOE_PRESETS:
        raise ValueError(f"unknown GPT-MoE preset {name!r}; valid names: {', '.join(sorted(MOE_PRESETS))}")
    return replace(MOE_PRESETS[name], **changes)  # type: ignore[arg-type]


# GPTMoE name -> Mixtral name, per block ("{i}") and for the rest.
_MIXTRAL_BLOCK = {
    "attn_norm.weight": "input_layernorm.weight",
    "attn.q_proj.weight": "self_attn.q_proj.weight",
    "attn.k_proj.weight": "self_attn.k_proj.weight",
    "attn.v_proj.weight": "self_attn.v_proj.weight",
    "attn.o_proj.weight": "self_attn.o_proj.weight",
    "mlp_norm.weight": "post_attention_layernorm.weight",
    "mlp.router.weight": "mlp.gate.weight",
    "mlp.experts.gate_up_proj": "mlp.experts.gate_up_proj",
    "mlp.experts.down_proj": "mlp.experts.down_proj",
}


def mixtral_config(config: GPTMoEConfig) -> Any:
    """The transformers MixtralConfig of the same model; ValueError naming what Mixtral has not."""
    from transformers import MixtralConfig

    wanted = dict(norm="rmsnorm", rope=True, bias=False, tie_embeddings=False, norm_topk_prob=True)
    differs = [f"{k}={getattr(config, k)!r} (Mixtral: {v!r})" for k, v in wanted.items() if getattr(config, k) != v]
    if differs:
        raise ValueError(f"save_as_mixtral: this GPTMoEConfig is not Mixtral's shape: {', '.join(differs)}.")
    return MixtralConfig(
        vocab_size=config.vocab_size,
        hidden_size=config.n_embd,
        intermediate_size=config.expert_size,
        num_hidden_layers=config.n_layer,
        num_attention_heads=config.n_head,
        num_key_value_heads=config.kv_heads,
        head_dim=config.head_dim,
        max_position_embeddings=config.block_size,
        rms_norm_eps=config.norm_eps,
        num_local_experts=config.num_experts,
        num_experts_per_tok=config.top_k,
        router_aux_loss_coef=config.router_aux_loss_coef,
        rope_parameters={"rope_type": "default", "rope_theta": config.rope_theta},
        tie_word_embeddings=False,
        bos_token_id=None,
        eos_token_id=None,
    )


def save_as_mixtral(state: dict, config: GPTMoEConfig, folder: str) -> None:
    """Write GPTMoE weights (`state`: full tensors, names as GPTMoE.state_dict(), an optional prefix such as
    a TrainModule's "model." left out) as a Hugging Face Mixtral folder (config.json + safetensors)."""
    from transformers import MixtralForCausalLM

    renamed = {"model.embed_tokens.weight": state["wte.weight"], "model.norm.weight": state["norm.weight"]}
    renamed["lm_head.weight"] = state["lm_head.weight"]
    for i in range(config.n_layer):
        for ours, theirs in _MIXTRAL_BLOCK.items():
            renamed[f"model.layers.{i}.{theirs}"] = state[f"blocks.{i}.{ours}"]
    with torch.device("meta"):
        model = MixtralForCausalLM(mixtral_config(config))
    model.load_state_dict({k: v.detach().cpu().contiguous() for k, v in renamed.items()}, strict=True, assign=True)
    model.save_pretrained(folder)

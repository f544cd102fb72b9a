"""Mixture-of-experts Hugging Face models in the fine-tuning recipe: their facts, router losses, ep checks.

A transformers MoE config spells its experts differently per family (Qwen3-MoE `num_experts`, Mixtral
`num_local_experts`, both `num_experts_per_tok`; `router_aux_loss_coef`, and `router_z_loss_coef` where
the model has a z-loss); `moe_facts` reads them once. The recipe trains on a loss SUMMED over target
tokens that the Trainer divides by the step's global target tokens (recipes/causal_lm.py); the router's
load-balancing loss joins it the same way: `router_aux` asks the model for its router logits, and
`expert_parallel.router_losses` counts the tokens each expert got over every data-parallel rank (one
all-reduce of detached counts per micro-batch) and sums this rank's router probabilities, so the term
summed over ranks is the global micro-batch's, whatever the data-parallel / ep split. transformers' own
`aux_loss` is per rank (its counts are the rank's alone), which would make the step depend on the split.
`check_experts` refuses an `ep_size` the model folder cannot take, and `check_expert_adapters` LoRA adapters on
the stacked experts, before any worker starts.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Dict, Optional

import torch
import torch.nn.functional as F

from shardwise.expert_parallel import ExpertLoad, router_losses
from shardwise.strategies import degrees

EXPERT_FIELDS = ("num_experts", "num_local_experts", "n_routed_experts")  # how HF configs count experts


@dataclass(frozen=True)
class MoEFacts:
    """What the recipe needs of an MoE config: experts per layer, experts per token, loss coefficients."""

    num_experts: int
    top_k: int
    aux_coef: float
    z_coef: float


def moe_facts(config: Any, aux_coef: Optional[float] = None) -> Optional[MoEFacts]:
    """The config's MoE facts, or None for a dense model (no expert count, or no router output).

    The router losses train as transformers trains them: with the config's coefficients when its
    `output_router_logits` is true, not at all otherwise; `aux_coef` (the recipe's router_aux_loss_coef)
    sets the load-balancing coefficient instead, and a z-loss the config has then trains too."""
    experts = next((getattr(config, f) for f in EXPERT_FIELDS if isinstance(getattr(config, f, None), int)), 0)
    if experts < 2 or not hasattr(config, "output_router_logits"):
        return None
    on = aux_coef is not None or bool(getattr(config, "output_router_logits", False))
    own = float(getattr(config, "router_aux_loss_coef", 0.0) or 0.0)
    return MoEFacts(
        num_experts=int(experts),
        top_k=int(getattr(config, "num_experts_per_tok", 1) or 1),
        aux_coef=(own if aux_coef is None else float(aux_coef)) if on else 0.0,
        z_coef=float(getattr(config, "router_z_loss_coef", 0.0) or 0.0) if on else 0.0,
    )


def check_experts(cfg: Any, folder: Any, engine: str, world: int) -> None:
    """Refuse an ep_size the run cannot honour (the rules' texts are strategies/degrees.py's); ep_size 1 passes.

    `engine`: the strategy name's ("auto" when the name is auto); `world`: the run's processes."""
    ep = int(getattr(cfg, "ep_size", 1) or 1)
    degrees.refuse(degrees.value_problem(degrees.EP_FLAG, ep))
    if ep == 1:
        return
    if engine == "auto":
        raise ValueError(
            f"ep_size={ep} with strategy='auto': expert parallel is a dimension of the FSDP strategy's mesh, and "
            f"'auto' may choose another engine. Use --strategy fsdp --ep_size {ep}."
        )
    config = folder.config
    model = f"{type(config).__name__} ({getattr(folder, 'source', '') or cfg.model_path + '/config.json'})"
    facts = moe_facts(config)
    degrees.refuse(degrees.experts_problem(ep, facts.num_experts if facts else 0, model))
    degrees.refuse(degrees.expert_engine_problem(engine, ep))
    shard_ranks = world // max(1, cfg.tp_size * cfg.sp_size)
    if "hybrid" in str(cfg.strategy).lower() or "HYBRID" in str(cfg.sharding_strategy).upper():
        shard_ranks = 0  # the replicas split the world in a way only the launched mesh knows: FSDPStrategy checks
    if shard_ranks:
        degrees.refuse(degrees.expert_degree_problem(ep, shard_ranks))
    offload = bool(cfg.cpu_offload or "offload" in str(cfg.strategy).lower())
    degrees.refuse(degrees.expert_combination_problem(ep, cfg.tp_size, cfg.sp_size, offload, bool(cfg.torch_compile)))
    if cfg.load_in_4bit:
        degrees.refuse(degrees.quantized_experts_problem(ep))


def check_expert_adapters(model: Any, targets: Any) -> None:
    """Refuse LoRA adapters on a mixture-of-experts model's stacked experts (`model`: the meta model with the
    run's adapters injected, as the LoRA check built it). PEFT wraps a transformers experts module whole
    (its [experts, ...] weights under one adapter, moved to `base_layer`): the Hugging Face folder's expert
    weights no longer load by name, and under expert parallel one adapter would span experts that other
    ranks hold. Adapters on the attention (and the router) train as on a dense model, at any ep_size."""
    from shardwise.strategies.experts import find_experts

    if model is None:  # full fine-tuning
        return

    def plain(path: str) -> str:
        return ".".join(p for p in path.split(".") if p != "base_layer")

    experts = {plain(name) for name, _ in find_experts(model)}
    if not experts:
        return
    adapted = sorted({plain(n.split(".lora_")[0]) for n, _ in model.named_parameters() if ".lora_" in n} & experts)
    if adapted:
        shown = ", ".join(adapted[:2]) + (f" and {len(adapted) - 2} more" if len(adapted) > 2 else "")
        raise ValueError(
            f"lora_target_modules={targets!r} puts LoRA adapters on the stacked experts of this "
            f"mixture-of-experts model ({shown}): PEFT wraps each experts module whole, its [experts, ...] "
            "weights then do not load from the model folder, nor split over expert-parallel ranks. Name the "
            "attention projections instead, e.g. lora_target_modules: [q_proj, k_proj, v_proj, o_proj] "
            "('all-linear' includes the experts), or fine-tune every weight (lora_r 0)."
        )


def attach_expert_load(model: Any, facts: Optional[MoEFacts]) -> None:
    """Give an MoE model an `expert_load` (tokens per expert and layer, added by `router_aux` at each training
    micro-batch), so that the Trainer attaches an ExpertLoadMonitor that logs it; a dense model gets none."""
    if facts is not None and getattr(model, "expert_load", None) is None:
        model.expert_load = ExpertLoad()


def sp_router_mask(batch: Dict[str, torch.Tensor], sp_mesh: Any) -> Optional[torch.Tensor]:
    """Under sequence parallel: this rank's slice of the batch's attention mask (padded to a multiple of the
    sp degree as `split_batch` pads the sequence), for `router_aux`; None without sp or without a mask. The
    model's inputs under sp carry no mask (the padding is folded into document ids), and the router losses
    must leave the padding rows out as one process does."""
    mask = batch.get("attention_mask")
    if sp_mesh is None or mask is None:
        return None
    sp = sp_mesh.size()
    return F.pad(mask, (0, (-mask.shape[1]) % sp), value=0).chunk(sp, dim=1)[sp_mesh.get_local_rank()]


def router_aux(
    model: Any, outputs: Any, batch: Dict[str, torch.Tensor], facts: MoEFacts, mask: Optional[torch.Tensor] = None
) -> Optional[torch.Tensor]:
    """The router losses of one micro-batch as a SUMMED loss term (coef x balance [+ z coef x z-loss]), or None.

    `outputs.router_logits`: one [rows, experts] tensor per MoE layer (the model's own record). Padding rows
    (attention_mask 0) are left out, as transformers' `load_balancing_loss_func` leaves them out. The
    global counts, one row per layer, are added to `model.expert_load` when the model carries one
    (`attach_expert_load`: the per-expert token counts the Trainer's ExpertLoadMonitor logs)."""
    logits = getattr(outputs, "router_logits", None)
    if not logits or (facts.aux_coef == 0.0 and facts.z_coef == 0.0 and getattr(model, "expert_load", None) is None):
        return None
    # transformers' formula takes the layers together (its f and P average over every layer's rows before
    # they multiply), so the layers go in as one entry of rows_per_token = layers.
    rows = torch.cat([layer.reshape(-1, layer.shape[-1]) for layer in logits])
    # The experts each row chose, as the router chose them (top-k of the softmax, as HF's loss recomputes).
    top_k_index = torch.topk(rows.float().softmax(dim=-1), facts.top_k, dim=-1).indices
    mask = batch.get("attention_mask") if mask is None else mask  # `mask`: sp_router_mask's slice under sp
    mask = None if mask is None else mask.reshape(-1).repeat(len(logits))
    losses = router_losses([(rows, top_k_index)], facts.num_experts, mask=mask, rows_per_token=len(logits))
    load = getattr(model, "expert_load", None)
    if load is not None:
        load.add(losses.counts)
    term = losses.balance * facts.aux_coef
    if facts.z_coef:
        term = term + losses.z * facts.z_coef
    return term


__all__ = [
    "EXPERT_FIELDS",
    "MoEFacts",
    "moe_facts",
    "check_experts",
    "check_expert_adapters",
    "attach_expert_load",
    "sp_router_mask",
    "router_aux",
]

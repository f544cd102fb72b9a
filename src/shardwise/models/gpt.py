# A decoder-only GPT that covers both the minGPT / GPT-2 shape (LayerNorm,
# GELU MLP, learned positions, biases) and the Llama shape (RMSNorm, SwiGLU,
# rotary positions, grouped-query attention, no biases) from one `GPTConfig`,
# plus named presets with the published sizes and an analytic parameter count
# that the memory planner uses without building anything. `Block` is the unit
# strategies wrap and checkpoint (`auto_wrap_policy={Block}`). Like every model
# here it tolerates meta-device construction: each parameter and buffer is
# (re)initialised by its owning module's `reset_parameters()`, which touches only
# that module's own tensors, so a strategy can call it once per module after
# `to_empty()`. Projection names follow Hugging Face Llama (q_proj, ..., down_proj)
# and rotary uses the rotate-half layout, so converting weights is a renaming.
from __future__ import annotations

import math
from dataclasses import asdict, dataclass, replace
from typing import Literal

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from shardwise.sdpa import attention
from shardwise.ulysses import (
    check_heads_divisible,
    document_ids_from_positions,
    gather_sequence,
    group_size,
    split_sequence,
    ulysses_attention,
)

__all__ = ["GPT", "GPTConfig", "Block", "PRESETS", "gpt_config"]

# GPT-2's init: N(0, 0.02) everywhere, residual output projections scaled down
# by 1/sqrt(2 * n_layer) so the residual stream's variance does not grow with depth.
_INIT_STD = 0.02


@dataclass(frozen=True)
class GPTConfig:
    """Shape of a GPT. Frozen so the shared `PRESETS` cannot be edited by accident;
    derive variants with `dataclasses.replace(cfg, ...)` or `gpt_config(name, **changes)`.

    `n_kv_head` and `intermediate_size` may be None, meaning "derive from the
    other fields" (n_head; 4*n_embd for GELU, Llama's 8/3*n_embd rounded up to a
    multiple of 256 for SwiGLU). They stay None rather than being filled in, so
    `replace(cfg, n_embd=...)` keeps deriving correctly; read the resolved
    values from `kv_heads` and `ffn_size`.
    """

    vocab_size: int = 50257
    block_size: int = 1024
    n_layer: int = 12
    n_head: int = 12
    n_embd: int = 768
    n_kv_head: int | None = None
    norm: Literal["layernorm", "rmsnorm"] = "layernorm"
    mlp: Literal["gelu", "swiglu"] = "gelu"
    intermediate_size: int | None = None
    rope: bool = False
    rope_theta: float = 10000.0
    bias: bool = True
    tie_embeddings: bool = True
    norm_eps: float = 1e-5

    def __post_init__(self) -> None:
        if self.norm not in ("layernorm", "rmsnorm"):
            raise ValueError(f"norm must be 'layernorm' or 'rmsnorm', got {self.norm!r}")
        if self.mlp not in ("gelu", "swiglu"):
            raise ValueError(f"mlp must be 'gelu' or 'swiglu', got {self.mlp!r}")
        if self.n_embd % self.n_head != 0:
            raise ValueError(f"n_embd={self.n_embd} must be divisible by n_head={self.n_head}")
        if self.n_head % self.kv_heads != 0:
            raise ValueError(f"n_head={self.n_head} must be a multiple of n_kv_head={self.kv_heads}")
        if self.rope and self.head_dim % 2 != 0:
            raise ValueError(f"rotary embeddings need an even head dimension, got {self.head_dim}")

    @property
    def head_dim(self) -> int:
        return self.n_embd // self.n_head

    @property
    def kv_heads(self) -> int:
        return self.n_head if self.n_kv_head is None else self.n_kv_head

    @property
    def ffn_size(self) -> int:
        if self.intermediate_size is not None:
            return self.intermediate_size
        if self.mlp == "gelu":
            return 4 * self.n_embd
        hidden = int(2 * 4 * self.n_embd / 3)
        return 256 * math.ceil(hidden / 256)

    def param_counts(self) -> dict[str, int]:
        """Parameters per component, computed from the shape alone (nothing is built)."""
        d, kv_dim, f = self.n_embd, self.kv_heads * self.head_dim, self.ffn_size
        b = 1 if self.bias else 0
        norm = d * (2 if self.norm == "layernorm" and self.bias else 1)
        attention = (d * d + b * d) + 2 * (d * kv_dim + b * kv_dim) + (d * d + b * d)
        n_mats = 3 if self.mlp == "swiglu" else 2
        mlp = (n_mats - 1) * (d * f + b * f) + (f * d + b * d)
        return {
            "token_embedding": self.vocab_size * d,
            "position_embedding": 0 if self.rope else self.block_size * d,
            "per_block": 2 * norm + attention + mlp,
            "blocks": self.n_layer * (2 * norm + attention + mlp),
            "final_norm": norm,
            "lm_head": 0 if self.tie_embeddings else d * self.vocab_size,
        }

    def num_params(self, non_embedding: bool = False) -> int:
        """Total parameter count, counting a tied embedding once.

        `non_embedding=True` leaves out the token and position embeddings and
        the output head (the Kaplan et al. "N"); the minGPT preset names refer
        to this number.
        """
        c = self.param_counts()
        if non_embedding:
            return c["blocks"] + c["final_norm"]
        return sum(v for k, v in c.items() if k != "per_block")

    def to_dict(self) -> dict[str, object]:
        return asdict(self)


class _Linear(nn.Linear):
    """nn.Linear whose init is N(0, std) with zero bias (GPT-2 style)."""

    def __init__(self, in_features: int, out_features: int, bias: bool, std: float = _INIT_STD) -> None:
        # Set before nn.Linear.__init__, which calls reset_parameters().
        object.__setattr__(self, "std", std)
        super().__init__(in_features, out_features, bias=bias)

    def reset_parameters(self) -> None:
        nn.init.normal_(self.weight, mean=0.0, std=self.std)
        if self.bias is not None:
            nn.init.zeros_(self.bias)


class _Embedding(nn.Embedding):
    """nn.Embedding initialised N(0, 0.02) instead of PyTorch's N(0, 1)."""

    def reset_parameters(self) -> None:
        nn.init.normal_(self.weight, mean=0.0, std=_INIT_STD)


class RotaryEmbedding(nn.Module):
    """Holds the rotary cos/sin tables shared by every block.

    The tables are non-persistent buffers rebuilt by `reset_parameters()`: they
    are derived from the config, so checkpoints need not carry them, and a
    meta-device model gets them back after `to_empty()`.
    """

    def __init__(self, head_dim: int, max_len: int, theta: float) -> None:
        super().__init__()
        self.head_dim, self.max_len, self.theta = head_dim, max_len, theta
        self.register_buffer("cos", torch.empty(max_len, head_dim), persistent=False)
        self.register_buffer("sin", torch.empty(max_len, head_dim), persistent=False)
        self.reset_parameters()

    def reset_parameters(self) -> None:
        # float32 regardless of the buffer's dtype: angles at high positions
        # lose most of their precision if computed in bf16.
        device = self.cos.device
        inv_freq = 1.0 / (
            self.theta ** (torch.arange(0, self.head_dim, 2, device=device, dtype=torch.float32) / self.head_dim)
        )
        angles = torch.outer(torch.arange(self.max_len, device=device, dtype=torch.float32), inv_freq)
        # Rotate-half layout: the same frequency appears in both halves.
        angles = torch.cat([angles, angles], dim=-1)
        with torch.no_grad():
            self.cos.copy_(angles.cos())
            self.sin.copy_(angles.sin())

    def forward(self, seq_len: int, position_ids: Tensor | None = None) -> tuple[Tensor, Tensor]:
        if position_ids is not None:  # (B, T) -> tables (B, 1, T, head_dim), broadcast over heads
            return self.cos[position_ids].unsqueeze(1), self.sin[position_ids].unsqueeze(1)
        return self.cos[:seq_len], self.sin[:seq_len]


def _apply_rotary(x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
    # x: (B, heads, T, head_dim). Pairs element i with i + head_dim/2.
    half = x.size(-1) // 2
    rotated = torch.cat([-x[..., half:], x[..., :half]], dim=-1)
    return x * cos.to(x.dtype) + rotated * sin.to(x.dtype)


class CausalSelfAttention(nn.Module):
    def __init__(self, config: GPTConfig) -> None:
        super().__init__()
        d, kv_dim = config.n_embd, config.kv_heads * config.head_dim
        residual_std = _INIT_STD / math.sqrt(2 * config.n_layer)
        self.n_head, self.n_kv_head, self.head_dim = config.n_head, config.kv_heads, config.head_dim
        self.q_proj = _Linear(d, d, bias=config.bias)
        self.k_proj = _Linear(d, kv_dim, bias=config.bias)
        self.v_proj = _Linear(d, kv_dim, bias=config.bias)
        self.o_proj = _Linear(d, d, bias=config.bias, std=residual_std)
        # Set by GPT.enable_sequence_parallel: x then holds this rank's chunk of the sequence.
        self.sp_group: object | None = None

    def forward(self, x: Tensor, rope: tuple[Tensor, Tensor] | None, document_ids: Tensor | None = None) -> Tensor:
        B, T, _ = x.shape
        # -1 heads: under tensor parallel each rank's projections hold only its share of the heads.
        q = self.q_proj(x).view(B, T, -1, self.head_dim).transpose(1, 2)
        k = self.k_proj(x).view(B, T, -1, self.head_dim).transpose(1, 2)
        v = self.v_proj(x).view(B, T, -1, self.head_dim).transpose(1, 2)
        if rope is not None:
            q, k = _apply_rotary(q, *rope), _apply_rotary(k, *rope)
        if self.sp_group is not None or document_ids is not None:
            # All-to-all to whole heads over the full sequence and back (sp), and/or packed documents
            # kept apart by a block-diagonal causal mask.
            y = ulysses_attention(q, k, v, self.sp_group, document_ids=document_ids)
        else:
            # Shared k/v heads are broadcast by SDPA itself, unless that would send it to the math kernel
            # on a GPU (fp32), where sdpa.attention repeats them instead.
            y = attention(q, k, v, is_causal=True)
        return self.o_proj(y.transpose(1, 2).reshape(B, T, -1))


class MLP(nn.Module):
    def __init__(self, config: GPTConfig) -> None:
        super().__init__()
        d, f = config.n_embd, config.ffn_size
        residual_std = _INIT_STD / math.sqrt(2 * config.n_layer)
        self.swiglu = config.mlp == "swiglu"
        # gate_proj exists only for SwiGLU: silu(gate) * up replaces gelu(up).
        self.gate_proj = _Linear(d, f, bias=config.bias) if self.swiglu else None
        self.up_proj = _Linear(d, f, bias=config.bias)
        self.down_proj = _Linear(f, d, bias=config.bias, std=residual_std)

    def forward(self, x: Tensor) -> Tensor:
        if self.gate_proj is not None:
            h = F.silu(self.gate_proj(x)) * self.up_proj(x)
        else:
            h = F.gelu(self.up_proj(x), approximate="tanh")  # GPT-2's GELU
        return self.down_proj(h)


def _build_norm(config: GPTConfig) -> nn.Module:
    if config.norm == "rmsnorm":
        return nn.RMSNorm(config.n_embd, eps=config.norm_eps)
    return nn.LayerNorm(config.n_embd, eps=config.norm_eps, bias=config.bias)


class Block(nn.Module):
    """One pre-norm transformer layer; the unit of sharding and activation checkpointing."""

    def __init__(self, config: GPTConfig) -> None:
        super().__init__()
        self.attn_norm = _build_norm(config)
        self.attn = CausalSelfAttention(config)
        self.mlp_norm = _build_norm(config)
        self.mlp = MLP(config)

    def forward(
        self, x: Tensor, rope: tuple[Tensor, Tensor] | None = None, document_ids: Tensor | None = None
    ) -> Tensor:
        x = x + self.attn(self.attn_norm(x), rope, document_ids)
        return x + self.mlp(self.mlp_norm(x))


class GPT(nn.Module):
    """Decoder-only language model: `forward(idx: (B, T) long) -> logits (B, T, vocab)`.

    `forward(idx, position_ids=...)` trains on packed sequences: position ids restart at 0 at each
    document, positions (learned or rotary) follow them, and no token attends across documents.
    The model carries its own parallel plan, which the engines ask for instead of knowing its class:
    `tensor_parallel_plan(tp)` (models/gpt_parallel.py) is how its layers split over a tp mesh, and
    `enable_sequence_parallel(group)` (the hook `apply_sequence_parallel` calls) splits the sequence
    over an sp group inside the model: it still takes the full batch and returns full logits.

    No dropout: large-model pretraining (Llama) does not use it, and without
    it every strategy computes the same loss for the same seed.

    With `tie_embeddings` the output head reuses `wte.weight` directly in
    `forward` instead of sharing one Parameter between two modules, because
    `to_empty()` after a meta-device build replaces each module's parameters
    separately and would silently untie a shared Parameter.
    """

    def __init__(self, config: GPTConfig) -> None:
        super().__init__()
        self.config = config
        self.wte = _Embedding(config.vocab_size, config.n_embd)
        self.wpe = None if config.rope else _Embedding(config.block_size, config.n_embd)
        self.rotary = RotaryEmbedding(config.head_dim, config.block_size, config.rope_theta) if config.rope else None
        self.blocks = nn.ModuleList(Block(config) for _ in range(config.n_layer))
        self.norm = _build_norm(config)
        self.lm_head = None if config.tie_embeddings else _Linear(config.n_embd, config.vocab_size, bias=False)
        self.sp_group: object | None = None
        self.sp_tensor_parallel = 1  # the tp degree the sequence split composes with (set with sp_group)

    def tensor_parallel_plan(self, tp: int) -> dict:
        """Module-path pattern -> torch ParallelStyle at degree `tp`, for `apply_tensor_parallel`; raises
        ValueError naming the fix when the degree does not fit the heads or the embeddings are tied."""
        from shardwise.models.gpt_parallel import gpt_tensor_parallel_plan

        return gpt_tensor_parallel_plan(self, tp)

    def enable_sequence_parallel(self, group: object) -> None:
        """Split the sequence over `group` (a 1-D DeviceMesh or process group) from the next forward on.

        After tensor parallel (which splits the heads, and the residual stream along the sequence over
        the tp ranks), each tp rank's heads are divided again over the sp ranks.
        """
        # Tensor parallel, when applied (before this, and before fully_shard), made the embedding a
        # DTensor on the strategy's "tp" mesh.
        mesh = getattr(self.wte.weight, "device_mesh", None)
        names = (mesh.mesh_dim_names or ()) if mesh is not None else ()
        tp = mesh.size(names.index("tp")) if "tp" in names else 1
        check_heads_divisible(
            self.config.n_head // tp, self.config.kv_heads // tp, group_size(group), tensor_parallel=tp
        )
        self.sp_group, self.sp_tensor_parallel = group, tp
        for block in self.blocks:
            block.attn.sp_group = group

    def forward(self, idx: Tensor, position_ids: Tensor | None = None) -> Tensor:
        T = idx.size(1)
        if T > self.config.block_size:
            raise ValueError(f"sequence length {T} exceeds block_size={self.config.block_size}")
        if position_ids is not None and position_ids.shape != idx.shape:
            raise ValueError(f"position_ids {tuple(position_ids.shape)} must have the shape of idx {tuple(idx.shape)}")
        positions = torch.arange(T, device=idx.device) if position_ids is None else position_ids
        rope = self.rotary(T, position_ids) if self.rotary is not None else None
        # The whole sequence's documents: every sp rank's attention sees all of them after its all-to-all.
        document_ids = None if position_ids is None else document_ids_from_positions(position_ids)
        sp = self.sp_group
        if sp is not None:
            # From here to the gather each rank holds its contiguous chunk of the sequence: activations / sp.
            # Split before the embedding, so that tensor parallel's own split of the residual stream (over
            # the tp ranks, along the sequence) subdivides this chunk and its gathers restore it in order.
            tp = self.sp_tensor_parallel
            if tp > 1 and T % (group_size(sp) * tp):
                raise ValueError(
                    f"sequence length {T} is not divisible by sp_size x tp_size = {group_size(sp)} x {tp}: pad "
                    f"or pack the sequences to a multiple of {group_size(sp) * tp}"
                )
            idx, positions = split_sequence(idx, sp, dim=1), split_sequence(positions, sp, dim=-1)
            if rope is not None:
                rope = tuple(split_sequence(t, sp, dim=-2) for t in rope)
        x = self.wte(idx)
        if self.wpe is not None:
            x = x + self.wpe(positions)
        for block in self.blocks:
            x = block(x, rope, document_ids)
        if sp is not None and self.sp_tensor_parallel == 1:
            # Backward is a reduce-scatter SUM: see shardwise/ulysses.py for why not a slice.
            x = gather_sequence(x, sp, dim=1)
            sp = None
        x = self.norm(x)
        if self.lm_head is not None:
            logits = self.lm_head(x)
            # With tp the head's input is split over the tp ranks inside this rank's sp chunk: gather the
            # (tp-gathered) logits over sp instead, in sequence order.
            return logits if sp is None else gather_sequence(logits, sp, dim=1)
        return F.linear(x, self.wte.weight)

    def num_params(self, non_embedding: bool = False) -> int:
        """Counted from the built model; equals `config.num_params(non_embedding)`."""
        total = sum(p.numel() for p in self.parameters())
        if non_embedding:
            total -= self.wte.weight.numel()
            total -= self.wpe.weight.numel() if self.wpe is not None else 0
            total -= self.lm_head.weight.numel() if self.lm_head is not None else 0
        return total


def _llama(**shape: object) -> GPTConfig:
    llama_style = dict(norm="rmsnorm", mlp="swiglu", rope=True, bias=False, tie_embeddings=False, norm_eps=1e-5)
    return GPTConfig(**{**llama_style, **shape})  # type: ignore[arg-type]


def _mingpt(**shape: object) -> GPTConfig:
    # minGPT does not tie its output head to the token embedding.
    return GPTConfig(vocab_size=50257, block_size=1024, tie_embeddings=False, **shape)  # type: ignore[arg-type]


# Llama shapes are the published ones (Hugging Face config.json of the Meta
# checkpoints); their parameter counts here equal the released models' exactly.
PRESETS: dict[str, GPTConfig] = {
    # Names give the non-embedding size (blocks only), as the seed examples do.
    "mingpt-1.7b": _mingpt(n_layer=15, n_head=16, n_embd=3072),
    "mingpt-12.8b": _mingpt(n_layer=16, n_head=16, n_embd=8192),
    "mingpt-45b": _mingpt(n_layer=56, n_head=16, n_embd=8192),
    "llama-2-7b": _llama(
        vocab_size=32000, block_size=4096, n_layer=32, n_head=32, n_kv_head=32, n_embd=4096, intermediate_size=11008
    ),
    "llama-2-13b": _llama(
        vocab_size=32000, block_size=4096, n_layer=40, n_head=40, n_kv_head=40, n_embd=5120, intermediate_size=13824
    ),
    "llama-2-70b": _llama(
        vocab_size=32000, block_size=4096, n_layer=80, n_head=64, n_kv_head=8, n_embd=8192, intermediate_size=28672
    ),
    "llama-3-8b": _llama(
        vocab_size=128256,
        block_size=8192,
        n_layer=32,
        n_head=32,
        n_kv_head=8,
        n_embd=4096,
        intermediate_size=14336,
        rope_theta=500000.0,
    ),
    "llama-3-70b": _llama(
        vocab_size=128256,
        block_size=8192,
        n_layer=80,
        n_head=64,
        n_kv_head=8,
        n_embd=8192,
        intermediate_size=28672,
        rope_theta=500000.0,
    ),
    # Small shapes for tests and CPU demos; they still exercise every code path
    # (learned positions + tying for gpt-tiny; rotary, GQA, SwiGLU for llama-tiny).
    "gpt-tiny": GPTConfig(vocab_size=256, block_size=64, n_layer=2, n_head=4, n_embd=64),
    "llama-tiny": _llama(vocab_size=256, block_size=64, n_layer=2, n_head=4, n_kv_head=2, n_embd=64),
}


def gpt_config(name: str, **changes: object) -> GPTConfig:
    """Look up a preset by name, optionally overriding fields (e.g. vocab_size)."""
    if name not in PRESETS:
        raise ValueError(f"unknown GPT preset {name!r}; valid names: {', '.join(sorted(PRESETS))}")
    return replace(PRESETS[name], **changes)  # type: ignore[arg-type]

"""What the planner plans for: model presets, Hugging Face configs, user classes, as one `ModelSpec`.

The planner never needs weights, only a way to build the model on the meta
device at any depth, a batch of the right shape, the loss a training step
computes, and a few shape facts for the analytic parts (parameter counts, the
largest layer, FLOPs per token). A `ModelSpec` bundles exactly that for every
source `--model` accepts: a preset name (minGPT, Llama 2 / 3 and the seed's
demo Transformer), a path to a Hugging Face `config.json` (built with
`AutoModelForCausalLM.from_config` on meta, no download), or
`python:module.Class`. `LMModule` turns a spec into the `TrainModule` a user
would write, so the planner runs the same `configure_model` /
`training_step` / `configure_optimizers` the Trainer runs -- and the accuracy
benchmark trains that very module for real. Depth is a constructor argument
because the tracer builds 2- and 3-block versions and extrapolates.
"""

from __future__ import annotations

import copy
import importlib
import json
import os
from dataclasses import dataclass, field, replace
from typing import Any, Callable, Dict, List, Optional, Tuple

import torch
import torch.nn.functional as F
from torch import nn

from shardwise.losses import chunked_cross_entropy
from shardwise.models import GPT, PRESETS, Block, GPTConfig, Transformer, transformer_num_params
from shardwise.models.gpt_moe import MOE_PRESETS as GPT_MOE_PRESETS
from shardwise.models.gpt_moe import GPTMoE, GPTMoEConfig
from shardwise.module import TrainModule, attached_trainer
from shardwise.plan.adapters import apply_adapters
from shardwise.plan.errors import PlanError
from shardwise.plan.moe import MOE_ALIASES, MOE_PRESETS, idle_flops_per_token, moe_facts, moe_preset_config

# The seed's demo Transformer sizes; vocabulary is WikiText-2's (Lightning's default
# for the demo) and the sequence length is Lightning's WikiText2 block size.
TRANSFORMER_PRESETS: Dict[str, Dict[str, int]] = {
    "transformer-1b": dict(nlayers=32, nhid=4096, ninp=1024, nhead=64),
    "transformer-2b": dict(nlayers=64, nhid=4096, ninp=1024, nhead=64),
}
TRANSFORMER_VOCAB = 33278
TRANSFORMER_SEQ = 35
# Names a user types for the demo sizes.
_ALIASES = {
    "demo-1b": "transformer-1b",
    "demo-2b": "transformer-2b",
    "1b": "transformer-1b",
    "2b": "transformer-2b",
    "llama2-7b": "llama-2-7b",
    "llama2-13b": "llama-2-13b",
    "llama2-70b": "llama-2-70b",
    "llama3-8b": "llama-3-8b",
    "llama3-70b": "llama-3-70b",
}


# Hugging Face Llama 3.1 (LlamaForCausalLM, what `shardwise finetune` trains): the Llama 3 shapes with a
# 131072-token context, built from the published config values on meta (no download).
HF_PRESETS: Dict[str, Dict[str, Any]] = {
    "llama-3.1-8b": dict(hidden_size=4096, intermediate_size=14336, num_hidden_layers=32, num_attention_heads=32),
    "llama-3.1-70b": dict(hidden_size=8192, intermediate_size=28672, num_hidden_layers=80, num_attention_heads=64),
}
_LLAMA_31 = dict(
    vocab_size=128256,
    num_key_value_heads=8,
    max_position_embeddings=131072,
    rope_theta=500000.0,
    rms_norm_eps=1e-5,
    tie_word_embeddings=False,
)


def preset_names() -> List[str]:
    return (
        sorted(PRESETS)
        + sorted(GPT_MOE_PRESETS)
        + sorted(TRANSFORMER_PRESETS)
        + sorted(HF_PRESETS)
        + sorted(MOE_PRESETS)
    )


@dataclass
class ModelSpec:
    """A model the planner can build at any depth, with the facts the analytic parts need.

    kind: "gpt" | "transformer" | "hf" | "module" (a user's TrainModule, traced as is).
    depth: the number of repeated units in the real model (Transformer: encoder +
    decoder layer pairs); None when the model cannot be rebuilt at another depth.
    """

    name: str
    kind: str
    config: Any = None
    depth: Optional[int] = None
    block_classes: Tuple[Any, ...] = ()
    vocab_size: int = 0
    hidden: int = 0
    ffn: int = 0
    heads: int = 1
    kv_heads: int = 1
    default_seq_len: int = 1024
    module: Optional[TrainModule] = None  # kind == "module"
    example_batch: Any = None  # kind == "module": the user's batch at the full micro-batch size
    notes: List[str] = field(default_factory=list)
    adapters: Any = None  # plan/adapters.Adapters: LoRA / QLoRA fine-tuning of this model (None: full)

    # ------------------------------------------------------------- building
    def build(self, depth: Optional[int] = None) -> nn.Module:
        """The bare model at `depth` repeated units (call under an init context: meta device)."""
        depth = self.depth if depth is None else depth
        if self.kind == "gpt":  # the bundled GPT, or its mixture-of-experts variant
            return (GPTMoE if isinstance(self.config, GPTMoEConfig) else GPT)(replace(self.config, n_layer=depth))
        if self.kind == "transformer":
            return Transformer(vocab_size=self.vocab_size, **{**self.config, "nlayers": depth})
        if self.kind == "hf":
            from transformers import AutoModelForCausalLM

            from shardwise.plan.kernels import hf_attention_for_trace

            cfg = self.config.__class__.from_dict(self.config.to_dict())
            hf_attention_for_trace(cfg, self.config)  # flash-attention 2 is traced as SDPA's flash kernel
            _set_hf_depth(cfg, depth)
            return AutoModelForCausalLM.from_config(cfg)
        raise PlanError(f"{self.name}: a {self.kind} model cannot be rebuilt at another depth")

    def training_module(
        self,
        depth: Optional[int] = None,
        lr: float = 1e-4,
        foreach: Optional[bool] = None,
        optimizer: str = "adamw",
        fused: Optional[bool] = None,
    ) -> TrainModule:
        if self.kind == "module":
            return self.module
        return LMModule(self, depth=depth, lr=lr, foreach=foreach, optimizer=optimizer, fused=fused)

    def make_batch(self, batch_size: int, seq_len: int) -> Any:
        """A batch of token ids in the shape the spec's training_step takes (device: current default)."""
        if self.kind == "module":
            return _slice_batch(self.example_batch, batch_size)
        if self.kind == "transformer":
            x = torch.randint(0, self.vocab_size, (batch_size, seq_len))
            return x, torch.randint(0, self.vocab_size, (batch_size, seq_len))
        return (torch.randint(0, self.vocab_size, (batch_size, seq_len + 1)),)

    # ------------------------------------------------------------- facts
    def param_counts(self) -> Dict[str, int]:
        """total, per_block (one repeated unit), outside (embeddings, head, final norms), largest_layer."""
        if self.kind == "gpt":
            c = self.config.param_counts()
            outside = c["token_embedding"] + c["position_embedding"] + c["final_norm"] + c["lm_head"]
            largest = max(c["token_embedding"], c["lm_head"], self.hidden * self.ffn)
            return dict(
                total=self.config.num_params(), per_block=c["per_block"], outside=outside, largest_layer=largest
            )
        if self.kind == "transformer":
            sizes = {k: v for k, v in self.config.items() if k != "dropout"}  # dropout changes no count
            total = transformer_num_params(self.vocab_size, **sizes)
            zero = transformer_num_params(self.vocab_size, **{**sizes, "nlayers": 0})
            per = (total - zero) // self.config["nlayers"]
            return dict(total=total, per_block=per, outside=zero, largest_layer=self.vocab_size * self.hidden)
        if self.kind == "hf":
            return _hf_param_counts(self)
        probe = self.__dict__.get("probe", self.module)
        total = sum(p.numel() for p in probe.parameters())
        return dict(total=total, per_block=0, outside=total, largest_layer=_largest_layer(probe))

    def flops_per_token(self, seq_len: int) -> float:
        """Training FLOPs per token (forward + backward = 3x forward), with causal attention."""
        counts = self.param_counts()
        dense = 2.0 * counts["total"] - idle_flops_per_token(moe_facts(self)) / 3.0  # a token skips idle experts
        if self.kind == "transformer":  # decoder layers attend twice (self + cross)
            attn = 2.0 * 2 * self.depth * 3 * seq_len * self.hidden / 2
        else:
            attn = 2.0 * 2 * (self.depth or 1) * seq_len * self.hidden / 2
        return 3.0 * (dense + attn)


def _slice_batch(batch: Any, n: int) -> Any:
    """The batch with n rows: sliced, or repeated when it has fewer (values only need to be valid)."""
    if isinstance(batch, torch.Tensor):
        if batch.dim() == 0:
            return batch
        if batch.size(0) >= n:
            return batch[:n]
        return torch.cat([batch] * ceil_div(n, batch.size(0)))[:n]
    if isinstance(batch, (list, tuple)):
        return type(batch)(_slice_batch(b, n) for b in batch)
    if isinstance(batch, dict):
        return {k: _slice_batch(v, n) for k, v in batch.items()}
    return batch


def meta_copy(module: nn.Module) -> nn.Module:
    """A deep copy whose parameters and buffers are on the meta device (a 70B module costs nothing)."""
    memo: Dict[int, Any] = {}
    for t in list(module.parameters()) + list(module.buffers()):
        if id(t) not in memo:
            empty = torch.empty_like(t, device="meta")
            memo[id(t)] = nn.Parameter(empty, requires_grad=t.requires_grad) if isinstance(t, nn.Parameter) else empty
    return copy.deepcopy(module, memo)


def _largest_layer(module: nn.Module) -> int:
    return max((sum(p.numel() for p in m.parameters(recurse=False)) for m in module.modules()), default=0)


class LMModule(TrainModule):
    """The TrainModule a user writes for a causal LM: build in configure_model, CE loss, AdamW.

    The GPT path computes `F.cross_entropy` on float32 logits over the whole
    vocabulary -- the plain loss most training scripts use, whose logits, their
    float32 copy and its gradient are the ~10 bytes x batch x seq x vocab the
    planner must see. A Hugging Face model is planned as the finetune recipe
    trains it (recipes/causal_lm.py): the same `chunked_cross_entropy` call,
    which keeps no float32 copy of the logits. The demo Transformer path is the
    seed's `F.nll_loss(model(input, target), target.view(-1))`.
    """

    def __init__(
        self,
        spec: ModelSpec,
        depth: Optional[int] = None,
        lr: float = 1e-4,
        foreach: Optional[bool] = None,
        optimizer: str = "adamw",
        fused: Optional[bool] = None,
    ) -> None:
        super().__init__()
        self.spec, self.depth, self.lr, self.foreach, self.optimizer_name = spec, depth, lr, foreach, optimizer
        self.fused = fused
        self.model: Optional[nn.Module] = None
        self.sp_mesh: Any = None  # the planner's trace sets it; a Trainer run reads its strategy's

    def configure_model(self) -> None:
        if self.model is None:
            model = self.spec.build(self.depth)
            if self.spec.adapters is not None:
                model = apply_adapters(model, self.spec.adapters, self.spec.kind)
            self.model = model

    def training_step(self, batch: Any) -> torch.Tensor:
        if self.spec.kind == "transformer":
            inputs, target = batch
            return F.nll_loss(self.model(inputs, target), target.view(-1))
        (tokens,) = batch
        inputs, target = tokens[:, :-1], tokens[:, 1:]
        mesh = self._sp_mesh()
        if self.spec.kind == "hf" and mesh is not None:
            # Sequence parallel the recipe's way (sequence_parallel_hf.split_batch): each sp rank runs
            # and scores its slice of the sequence, whose targets are shifted before the split.
            from shardwise.strategies.sequence_parallel_hf import split_batch

            model_inputs, target = split_batch(
                {"input_ids": inputs, "labels": inputs}, mesh.get_local_rank(), mesh.size()
            )
            logits = self.model(**model_inputs, use_cache=False).logits
        elif self.spec.kind == "hf":
            logits = self.model(input_ids=inputs, use_cache=False).logits
        else:
            logits = self.model(inputs)
            return F.cross_entropy(logits.float().reshape(-1, logits.size(-1)), target.reshape(-1), ignore_index=-100)
        # The recipe's loss (CausalLMModule._summed_loss): the mean here, as the Trainer's division makes it there.
        return chunked_cross_entropy(logits, target, ignore_index=-100)

    def _sp_mesh(self) -> Any:
        """The sequence-parallel mesh: the one the planner's trace set, else the Trainer's strategy's."""
        if self.sp_mesh is not None:
            return self.sp_mesh
        trainer = attached_trainer(self)
        return getattr(trainer.strategy, "sp_mesh", None) if trainer is not None else None

    def configure_optimizers(self) -> torch.optim.Optimizer:
        # Only what trains: a LoRA model's frozen base is not the optimizer's (all of it otherwise).
        params = [p for p in self.parameters() if p.requires_grad]
        if self.optimizer_name == "sgd":
            return torch.optim.SGD(params, lr=self.lr, momentum=0.9, foreach=self.foreach, fused=self.fused)
        if self.optimizer_name == "adam":
            return torch.optim.Adam(params, lr=self.lr, foreach=self.foreach, fused=self.fused)
        return torch.optim.AdamW(params, lr=self.lr, weight_decay=0.0, foreach=self.foreach, fused=self.fused)


# ------------------------------------------------------------------ resolving --model
def resolve_model(model: Any, example_batch: Any = None) -> ModelSpec:
    """A preset name, a config.json / HF model dir, "python:module.Class", a GPTConfig, a TrainModule or a spec."""
    if isinstance(model, ModelSpec):
        return model
    if isinstance(model, LMModule):
        return replace(model.spec, depth=model.depth or model.spec.depth)
    if isinstance(model, TrainModule):
        if example_batch is None:
            raise PlanError(
                f"plan({type(model).__name__}(...)) needs example_batch=: the planner runs its "
                "training_step and cannot guess what it takes."
            )
        return _module_spec(type(model).__name__, model, example_batch=example_batch)

    if isinstance(model, GPTConfig):
        return gpt_spec("gpt", model)
    if isinstance(model, nn.Module):
        raise PlanError(
            "plan() takes a TrainModule (with example_batch=), a preset name, a GPTConfig or a path "
            f"to a Hugging Face config.json; got a bare {type(model).__name__}. Wrap it in a TrainModule."
        )
    if not isinstance(model, str):
        raise PlanError(f"Cannot plan for {model!r}: pass a preset name, a config.json path or python:module.Class.")
    if model.startswith("python:"):
        return _python_spec(model[len("python:") :])
    if os.path.exists(model) or model.endswith(".json"):
        return hf_spec(model)
    return preset_spec(model)


def preset_spec(name: str) -> ModelSpec:
    key = _ALIASES.get(name.lower().strip(), name.lower().strip())
    key = MOE_ALIASES.get(key, key)
    if key in MOE_PRESETS:  # Hugging Face mixture-of-experts models, from their published configs
        return hf_config_spec(key, moe_preset_config(key))
    if key in PRESETS or key in GPT_MOE_PRESETS:
        return gpt_spec(key, PRESETS.get(key) or GPT_MOE_PRESETS[key])
    if key in TRANSFORMER_PRESETS:
        return transformer_spec(key, TRANSFORMER_PRESETS[key])
    if key in HF_PRESETS:
        try:
            from transformers import LlamaConfig
        except ImportError as exc:  # pragma: no cover - the extra is missing
            raise PlanError(f"The {key} preset is a Hugging Face model: pip install 'shardwise[hf]'.") from exc
        return hf_config_spec(key, LlamaConfig(**_LLAMA_31, **HF_PRESETS[key]))
    raise PlanError(
        f"Unknown model preset {name!r}. Presets: {', '.join(preset_names())}; or give a path to a "
        "Hugging Face config.json, or python:module.Class."
    )


def gpt_spec(name: str, config: Any) -> ModelSpec:
    return ModelSpec(
        name=name,
        kind="gpt",
        config=config,
        depth=config.n_layer,
        block_classes=(Block,),
        vocab_size=config.vocab_size,
        hidden=config.n_embd,
        ffn=config.ffn_size,
        heads=config.n_head,
        kv_heads=config.kv_heads,
        default_seq_len=config.block_size,
    )


def transformer_spec(
    name: str, sizes: Dict[str, int], vocab_size: int = TRANSFORMER_VOCAB, seq_len: int = TRANSFORMER_SEQ
) -> ModelSpec:
    sizes = dict(sizes)
    return ModelSpec(
        name=name,
        kind="transformer",
        config=sizes,
        depth=sizes["nlayers"],
        block_classes=(nn.TransformerEncoderLayer, nn.TransformerDecoderLayer),
        vocab_size=vocab_size,
        hidden=sizes["ninp"],
        ffn=sizes["nhid"],
        heads=sizes["nhead"],
        kv_heads=sizes["nhead"],
        default_seq_len=seq_len,
    )


def _module_spec(name: str, module: TrainModule, example_batch: Any = None) -> ModelSpec:
    """A user's TrainModule, traced as is; its shape facts come from a configured meta copy."""
    probe = meta_copy(module)
    with torch.device("meta"):
        probe.configure_model()
    seq = 1
    first = next((t for t in _leaves(example_batch) if isinstance(t, torch.Tensor) and t.dim() >= 2), None)
    if first is not None:
        seq = int(first.size(1))
    spec = ModelSpec(
        name=name,
        kind="module",
        module=module,
        example_batch=example_batch,
        block_classes=_guess_blocks(probe),
        default_seq_len=seq,
    )
    spec.__dict__["probe"] = probe
    return spec


def _leaves(batch: Any) -> List[Any]:
    if isinstance(batch, (list, tuple)):
        return [x for b in batch for x in _leaves(b)]
    if isinstance(batch, dict):
        return [x for b in batch.values() for x in _leaves(b)]
    return [batch]


def _guess_blocks(module: nn.Module) -> Tuple[Any, ...]:
    """The classes of the largest nn.ModuleList's children: the repeated blocks, if any."""
    best: Optional[nn.ModuleList] = None
    for m in module.modules():
        if isinstance(m, nn.ModuleList) and len(m) > (len(best) if best is not None else 1):
            best = m
    return tuple({type(c) for c in best}) if best is not None else ()


# ------------------------------------------------------------------ Hugging Face configs
_DEPTH_KEYS = ("num_hidden_layers", "n_layer", "num_layers", "n_layers")


def _get(cfg: Any, *keys: str, default: Any = None) -> Any:
    for key in keys:
        value = getattr(cfg, key, None)
        if value is not None:
            return value
    return default


def _set_hf_depth(cfg: Any, depth: int) -> None:
    for key in _DEPTH_KEYS:
        if getattr(cfg, key, None) is not None:
            setattr(cfg, key, depth)
    # Per-layer lists (layer_types, sliding-window schedules) must keep their length in step.
    for key in ("layer_types",):
        value = getattr(cfg, key, None)
        if isinstance(value, list) and value:
            setattr(cfg, key, [value[i % len(value)] for i in range(depth)])


def hf_spec(path: str) -> ModelSpec:
    """A Hugging Face causal LM from its config.json (a file or a model directory); no weights are read."""
    file = os.path.join(path, "config.json") if os.path.isdir(path) else path
    if not os.path.isfile(file):
        raise PlanError(
            f"{path!r} is neither a preset nor an existing config.json. Presets: {', '.join(preset_names())}."
        )
    try:
        with open(file) as fh:
            raw = json.load(fh)
    except (OSError, json.JSONDecodeError) as exc:
        raise PlanError(f"{file}: not a readable JSON config ({exc}).") from exc
    try:
        from transformers import AutoConfig
        from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES
    except ImportError as exc:  # pragma: no cover - the extra is missing
        raise PlanError("Planning from a config.json needs transformers: pip install 'shardwise[hf]'.") from exc
    model_type = raw.get("model_type")
    architectures = raw.get("architectures") or []
    causal = model_type in MODEL_FOR_CAUSAL_LM_MAPPING_NAMES and (
        not architectures or any(a.endswith(("ForCausalLM", "LMHeadModel")) for a in architectures)
    )
    if not causal:
        raise PlanError(
            f"{file} describes a {model_type or 'model of unknown type'} "
            f"({', '.join(architectures) or 'no architectures'}), "
            "not a causal language model: the planner builds it with AutoModelForCausalLM. Use a *ForCausalLM config."
        )
    try:
        cfg = AutoConfig.for_model(**raw)
    except Exception as exc:
        raise PlanError(f"{file}: transformers cannot build a config from it ({exc}).") from exc
    return hf_config_spec(os.path.basename(os.path.dirname(os.path.abspath(file))) or file, cfg, file)


def hf_config_spec(name: str, cfg: Any, file: str = "") -> ModelSpec:
    """A Hugging Face causal LM from its (transformers) config object."""
    file = file or name
    depth = _get(cfg, *_DEPTH_KEYS)
    hidden = _get(cfg, "hidden_size", "n_embd", "d_model")
    if depth is None or hidden is None:
        raise PlanError(f"{file}: no layer count / hidden size found (num_hidden_layers, hidden_size).")
    heads = _get(cfg, "num_attention_heads", "n_head", default=1)
    spec = ModelSpec(
        name=name,
        kind="hf",
        config=cfg,
        depth=int(depth),
        vocab_size=int(_get(cfg, "vocab_size")),
        hidden=int(hidden),
        ffn=int(_get(cfg, "intermediate_size", "n_inner", "ffn_dim", default=4 * hidden) or 4 * hidden),
        heads=int(heads),
        kv_heads=int(_get(cfg, "num_key_value_heads", default=heads)),
        default_seq_len=int(_get(cfg, "max_position_embeddings", "n_positions", default=2048)),
    )
    spec.block_classes = tuple(_hf_block_names(spec))
    return spec


def _hf_block_names(spec: ModelSpec) -> List[str]:
    """The decoder-layer class names (`_no_split_modules`), read from a 1-layer meta build."""
    with torch.device("meta"):
        model = spec.build(1)
    names = list(getattr(model, "_no_split_modules", None) or [])
    if not names:
        lists = [m for m in model.modules() if isinstance(m, nn.ModuleList) and len(m)]
        names = [type(lists[0][0]).__name__] if lists else []
    return names


def _hf_param_counts(spec: ModelSpec) -> Dict[str, int]:
    cache = spec.__dict__.setdefault("_counts", {})
    if not cache:
        with torch.device("meta"):
            one, two = spec.build(1), spec.build(2)
        n1 = sum(p.numel() for p in one.parameters())
        n2 = sum(p.numel() for p in two.parameters())
        per = n2 - n1
        outside = n1 - per
        cache.update(
            total=outside + per * spec.depth, per_block=per, outside=outside, largest_layer=max(_largest_layer(one), 1)
        )
    return dict(cache)


# ------------------------------------------------------------------ python:module.Class
def _python_spec(target: str) -> ModelSpec:
    module_name, _, attr = target.rpartition(".")
    if not module_name:
        raise PlanError(f"python:{target}: write python:package.module.ClassName.")
    try:
        obj = getattr(importlib.import_module(module_name), attr)
    except (ImportError, AttributeError) as exc:
        raise PlanError(f"python:{target}: cannot import it ({exc}).") from exc
    instance = obj() if callable(obj) else obj
    if isinstance(instance, TrainModule):
        batch_fn = getattr(instance, "example_batch", None)
        if not callable(batch_fn):
            raise PlanError(
                f"python:{target} is a TrainModule; give it a method example_batch(batch_size, seq_len) "
                "returning one training batch, so the planner can run its training_step."
            )
        spec = _module_spec(attr, instance)
        spec.__dict__["batch_fn"] = batch_fn
        return spec

    if isinstance(instance, GPTConfig):
        return gpt_spec(attr, instance)
    raise PlanError(
        f"python:{target} gave a {type(instance).__name__}; it must be a TrainModule class (with "
        "example_batch(batch_size, seq_len)) or a GPTConfig."
    )


def spec_batch(spec: ModelSpec, batch_size: int, seq_len: int) -> Any:
    batch_fn: Optional[Callable[[int, int], Any]] = spec.__dict__.get("batch_fn")
    if batch_fn is not None:
        return batch_fn(batch_size, seq_len)
    return spec.make_batch(batch_size, seq_len)


def describe(spec: ModelSpec) -> str:
    total = spec.param_counts()["total"]
    size = f"{total / 1e9:.2f}B" if total >= 1e9 else f"{total / 1e6:.1f}M"
    depth = f", {spec.depth} blocks" if spec.depth else ""
    adapters = f", {spec.adapters.describe()}" if spec.adapters is not None else ""
    return f"{spec.name} ({size} parameters{depth}{adapters})"


def divisors(n: int) -> List[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def ceil_div(a: int, b: int) -> int:
    return -(-a // b)


__all__ = [
    "ModelSpec",
    "LMModule",
    "PlanError",
    "resolve_model",
    "preset_names",
    "preset_spec",
    "hf_spec",
    "gpt_spec",
    "transformer_spec",
    "TRANSFORMER_PRESETS",
    "spec_batch",
    "describe",
    "divisors",
    "ceil_div",
]

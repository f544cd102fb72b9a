"""Planning LoRA / QLoRA fine-tuning: which adapters the traced model gets, and what its frozen base costs.

The planner does not grow a second path for adapters. `Adapters` rides on
the `ModelSpec` (presets.py), and `LMModule.configure_model` applies it to
the model it builds, so the fake-tensor trace (trace.py) and the accuracy
benchmark's real runs (benchmarks/plan_measure.py) run the same wrapped
module under the same strategy code: PEFT's LoRA layers (through
shardwise.adapters when it is installed, else PEFT directly), and for QLoRA
bitsandbytes' NF4 layers first. A frozen parameter then gets no gradient and
no optimizer state in the trace by itself, and FSDP shards it as any other;
LoRA's extra activations (the A/B matmul inputs and outputs, the dropout
mask) and the activation gradients that still flow through the frozen
weights are traced, not estimated. What is arithmetic here: the NF4 storage
layout (`nf4_bytes`), used for the analytic parts (ZeRO, the fallback) and
the sanity checks, and the argument checks that run before anything is traced.
"""

from __future__ import annotations

import contextlib
import sys
from dataclasses import dataclass
from typing import Any, Iterator, List, Optional, Sequence, Tuple

from torch import nn

from shardwise.adapters import LoraOptions, apply_lora
from shardwise.adapters.quantize import fourbit_layers, quantize_to_4bit, quantize_weight, set_quant_state
from shardwise.plan.errors import PlanError

# PEFT's own default for Llama-style models (q_proj, v_proj), used for shardwise's GPT presets,
# whose module names are Llama's; Hugging Face configs get PEFT's default for their model type.
GPT_DEFAULT_TARGETS = ("q_proj", "v_proj")
# bitsandbytes' NF4 layout with double quantisation: 4 bits per weight, one 8-bit absmax per
# 64-weight block, one float32 absmax (and offset) per 256 such blocks.
NF4_BLOCK = 64
NF4_SECOND_BLOCK = 256


@dataclass(frozen=True)
class Adapters:
    """What the planner adds to the model: LoRA of rank `r` on `target_modules`, the base in NF4 or not."""

    r: int
    alpha: int = 16
    dropout: float = 0.0
    target_modules: Optional[Tuple[str, ...]] = None  # None: PEFT's default for the model type
    load_in_4bit: bool = False
    compute_dtype: str = "bfloat16"  # QLoRA: what the 4-bit weights are dequantised to (from the precision)

    def describe(self) -> str:
        targets = ",".join(self.target_modules) if self.target_modules else "PEFT's default modules"
        base = "NF4 base (double quantisation)" if self.load_in_4bit else "frozen base"
        return f"LoRA r={self.r} alpha={self.alpha} on {targets}, {base}"


def build_adapters(
    lora_r: int = 0,
    lora_alpha: int = 16,
    lora_dropout: float = 0.0,
    lora_target_modules: Optional[Sequence[str]] = None,
    load_in_4bit: bool = False,
) -> Optional[Adapters]:
    """The planner's adapter options from the recipe's flags (None: full fine-tuning); mistakes are a PlanError."""
    if isinstance(lora_r, bool) or not isinstance(lora_r, int) or lora_r < 0:
        raise PlanError(f"lora_r={lora_r!r}: the LoRA rank is a positive integer (e.g. 16), or 0 for full fine-tuning.")
    if not lora_r:
        if load_in_4bit:
            raise PlanError(
                "load_in_4bit=True needs LoRA: a 4-bit base cannot be trained itself. Add --lora_r 16 (QLoRA)."
            )
        if lora_target_modules:
            raise PlanError("lora_target_modules is set but lora_r=0 (full fine-tuning): add --lora_r 16.")
        return None
    if isinstance(lora_alpha, bool) or not isinstance(lora_alpha, (int, float)) or lora_alpha <= 0:
        raise PlanError(f"lora_alpha={lora_alpha!r}: use a positive number (commonly 2 x lora_r).")
    if not 0.0 <= float(lora_dropout) < 1.0:
        raise PlanError(f"lora_dropout={lora_dropout!r}: use a probability in [0, 1).")
    targets = None
    if lora_target_modules:
        targets = tuple(lora_target_modules.split(",") if isinstance(lora_target_modules, str) else lora_target_modules)
        targets = tuple(t.strip() for t in targets if t.strip()) or None
    return Adapters(
        r=int(lora_r), alpha=lora_alpha, dropout=float(lora_dropout), target_modules=targets, load_in_4bit=load_in_4bit
    )


def check_candidates(adapters: Optional[Adapters], cands: List[Any], requested: bool) -> Tuple[List[Any], List[str]]:
    """Adapters are planned under DDP and FSDP, which are traced: ZeRO's rows are arithmetic over every
    parameter as a trainable one (strategies/accounting.py), and DeepSpeed cannot partition 4-bit weights.
    Drop those rows (refuse them if asked for)."""
    if adapters is None:
        return cands, []
    ds = [c for c in cands if c.plan.engine == "deepspeed"]
    if not ds:
        return cands, []
    why = (
        "DeepSpeed casts and partitions bitsandbytes' packed 4-bit weights as if they were ordinary ones"
        if adapters.load_in_4bit
        else "its accounting does not yet separate frozen from trainable parameters"
    )
    if requested:
        raise PlanError(
            f"LoRA{' + load_in_4bit' if adapters.load_in_4bit else ''} is planned under DDP and FSDP only, not "
            f"{ds[0].config_label}: {why}. Plan fsdp or ddp."
        )
    return [c for c in cands if c.plan.engine != "deepspeed"], [f"Adapters: DeepSpeed ZeRO rows are left out ({why})."]


def compute_dtype_name(precision: str) -> str:
    """The dtype QLoRA dequantises to: the precision's compute dtype (float32 for 32-true)."""
    if precision in ("32-true", "64-true"):
        return "float32"
    return "float16" if precision.startswith("16") else "bfloat16"


def nf4_bytes(numel: int) -> float:
    """Bytes of `numel` weights in NF4 with double quantisation (bitsandbytes' Linear4bit)."""
    blocks = -(-numel // NF4_BLOCK)
    return numel / 2 + blocks + 4 * 2 * -(-blocks // NF4_SECOND_BLOCK)


def _targets(adapters: Adapters, model: nn.Module, kind: str) -> Optional[List[str]]:
    targets = list(adapters.target_modules) if adapters.target_modules else None
    if kind == "hf":
        return targets  # PEFT knows the model type (and what "all-linear" leaves out)
    if targets is None and kind != "gpt":
        raise PlanError(
            f"lora_target_modules is needed for a {kind} model: PEFT has no default for it. Name its "
            "nn.Linear modules (e.g. linear1,linear2), or all-linear."
        )
    if targets is None:
        return list(GPT_DEFAULT_TARGETS)
    if [t.lower() for t in targets] == ["all-linear"]:
        # As PEFT does for a Hugging Face model: every nn.Linear except the output head.
        return sorted({n.split(".")[-1] for n, m in model.named_modules() if isinstance(m, nn.Linear)} - {"lm_head"})
    return targets


def apply_adapters(model: nn.Module, adapters: Adapters, kind: str) -> nn.Module:
    """The model fine-tuned with `adapters`: the base quantised to NF4 (QLoRA) and frozen, LoRA layers on top."""
    if adapters.load_in_4bit:
        import torch

        _plain_linears(model)
        dtype = getattr(torch, adapters.compute_dtype)
        if not quantize_to_4bit(model, dtype):
            raise PlanError(f"load_in_4bit: {type(model).__name__} has no nn.Linear layer to quantise.")
    targets = _targets(adapters, model, kind)
    config = LoraOptions(r=adapters.r, alpha=adapters.alpha, dropout=adapters.dropout, target_modules=targets).to_peft()
    if kind != "hf":
        config.task_type = None  # a plain PeftModel: the causal-LM wrapper needs a transformers model
    try:
        return apply_lora(model, config)
    except ValueError as exc:  # target modules that match nothing
        raise PlanError(f"LoRA cannot be applied: {exc}") from exc


def _plain_linears(model: nn.Module) -> None:
    """nn.Linear subclasses (the GPT presets' `_Linear`, which only adds an init) as plain nn.Linear over the
    same parameters: bitsandbytes' swap takes exact nn.Linear layers, and a 4-bit weight's init is its loader's."""
    for parent in list(model.modules()):
        for name, child in list(parent.named_children()):
            if isinstance(child, nn.Linear) and type(child) is not nn.Linear:
                plain = nn.Linear(child.in_features, child.out_features, bias=child.bias is not None, device="meta")
                plain.weight, plain.bias = child.weight, child.bias
                setattr(parent, name, plain)


def fill_quant_states(model: nn.Module) -> int:
    """Give every 4-bit layer without one a quantisation state of its full shape; return how many.

    A meta-built QLoRA model has the packed codes' shape but no state until a loader
    quantises real weights (the recipe's, on rank 0). The planner's trace and the accuracy
    benchmark load none: a state quantised from a random full-size weight has the sizes a
    loaded one has (under fake tensors it costs nothing). The codes' values are left as set.
    """
    import torch
    from torch._subclasses.fake_tensor import unset_fake_temporarily

    functional = sys.modules["bitsandbytes"].functional
    with unset_fake_temporarily():
        # Double quantisation builds its 8-bit code table with .tolist(), which fake tensors cannot
        # answer: build it for real once (bitsandbytes caches it by name).
        functional.name2qmap.setdefault("dynamic", functional.create_dynamic_map())
    filled = 0
    for layer in fourbit_layers(model).values():
        if getattr(layer, "quant_state", None) is None:
            weight = torch.randn(layer.out_features, layer.in_features, device=_device_of(layer)) * 0.02
            set_quant_state(layer, quantize_weight(weight, layer)[1])
            filled += 1
    return filled


@contextlib.contextmanager
def fake_4bit_weights() -> Iterator[None]:
    """Let bitsandbytes' 4-bit forward run on fake weights (the planner's trace only).

    When the weight in place is a plain tensor (DDP's fake parameter, FSDP2's gathered one),
    bitsandbytes re-wraps it as a Params4bit carrying the module's quantisation state -- a
    Python wrapper, no memory -- which torch refuses for a fake tensor. Here the state is put
    on the tensor as an attribute instead; the forward reads it from there the same way.
    """
    modules = sys.modules["bitsandbytes"].nn.modules
    original = modules.fix_4bit_weight_quant_state_from_module

    def attach(module: nn.Module) -> None:
        if getattr(module.weight, "quant_state", None) is None:
            module.weight.quant_state = module.quant_state

    modules.fix_4bit_weight_quant_state_from_module = attach
    try:
        yield
    finally:
        modules.fix_4bit_weight_quant_state_from_module = original


def quant_state_bytes(model: nn.Module) -> int:
    """Bytes of the 4-bit layers' quantisation states: whole on every rank, beside the sharded codes."""
    total, seen = 0, set()
    for layer in fourbit_layers(model).values():
        state = getattr(layer, "quant_state", None)
        for t in _state_tensors(state):
            if id(t) not in seen:
                seen.add(id(t))
                total += t.numel() * t.element_size()
    return total


def _state_tensors(state: Any) -> List[Any]:
    import torch

    if state is None:
        return []
    out = [getattr(state, k, None) for k in ("absmax", "code", "offset")]
    out += _state_tensors(getattr(state, "state2", None))
    return [t for t in out if isinstance(t, torch.Tensor)]


def _device_of(layer: nn.Module) -> Any:
    weight = layer.weight
    local = getattr(weight, "to_local", None)
    return (local() if callable(local) else weight).device


__all__ = [
    "Adapters",
    "build_adapters",
    "apply_adapters",
    "check_candidates",
    "compute_dtype_name",
    "nf4_bytes",
    "GPT_DEFAULT_TARGETS",
]

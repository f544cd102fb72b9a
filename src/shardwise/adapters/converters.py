"""Model converters: changes to a built model before a strategy parallelises it, and a hook after each step.

A converter is any object with `convert(model) -> model` (it may change the model in place and
return it, or return a wrapper, as PEFT does) and, optionally, `post_optimizer_step(model)`. The
recipe builds the model on the meta device, runs its converters in order, then hands the result to
the strategy, so every engine shards what the converters made: QLoRA's base is quantised to NF4
first, then LoRA wraps it. torchtitan's model converters are the model for this seam: a new kind of
training (float8 linears, say) is one more converter in the list, with its per-step work (updating
scales) in the hook, instead of another branch in the recipe. `build_converters` reads the recipe's
flags; `convert_model` and `post_optimizer_step` run a list of converters.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, List, Optional, Protocol, Sequence, Union, runtime_checkable

import torch
from torch import nn

from shardwise.adapters.lora import LoraOptions, apply_lora, options_from
from shardwise.adapters.quantize import check_4bit_plan, compute_dtype_for, quantize_to_4bit

__all__ = [
    "LoraConverter",
    "ModelConverter",
    "NF4BaseConverter",
    "build_converters",
    "convert_model",
    "post_optimizer_step",
]


@runtime_checkable
class ModelConverter(Protocol):
    """Changes a built (possibly meta-device) model before it is parallelised; returns the model to use.

    A converter may also define `post_optimizer_step(model)`, run after each optimizer step on the
    model as trained (wrapped by the strategy)."""

    def convert(self, model: nn.Module) -> nn.Module: ...


@dataclass(frozen=True)
class NF4BaseConverter:
    """QLoRA's frozen base: every nn.Linear but the output head becomes a bitsandbytes NF4 layer computing
    in `compute_dtype`, its packed codes stored as uint8 (adapters/quantize.py)."""

    compute_dtype: torch.dtype

    def convert(self, model: nn.Module) -> nn.Module:
        quantize_to_4bit(model, self.compute_dtype)
        return model


@dataclass(frozen=True)
class LoraConverter:
    """LoRA adapters through PEFT (adapters/lora.py): returns the PeftModel; only the adapters train.
    `options`: a LoraOptions (the recipe's flags, for a causal LM) or a peft.LoraConfig."""

    options: Union[LoraOptions, Any]

    def convert(self, model: nn.Module) -> nn.Module:
        return apply_lora(model, self.options)


def build_converters(config: Any, plan: Optional[Callable[[], Any]] = None) -> List[ModelConverter]:
    """The converters a config with the recipe's adapter flags asks for (FinetuneConfig: lora_r, lora_alpha,
    lora_dropout, lora_target_modules, load_in_4bit, precision), in the order they apply.

    `plan` returns the strategy's ParallelPlan (strategies/parallel.py), known only once the strategy is
    built (strategy="auto"); it is called only when a 4-bit base is asked for, which refuses the plans
    it cannot run under, naming the fix. An empty list means full fine-tuning."""
    converters: List[ModelConverter] = []
    if getattr(config, "load_in_4bit", False):
        check_4bit_plan(plan() if plan is not None else None)
        converters.append(NF4BaseConverter(compute_dtype_for(config.precision)))
    lora = options_from(config)
    if lora is not None:
        converters.append(LoraConverter(lora))
    return converters


def convert_model(model: nn.Module, converters: Sequence[ModelConverter]) -> nn.Module:
    """`model` after each converter in turn (each gets what the one before returned)."""
    for converter in converters:
        if not callable(getattr(converter, "convert", None)):
            raise TypeError(
                f"model converter {converter!r} has no convert(model) method. A converter changes the model "
                "before it is parallelised: give it convert(model) -> model (and optionally "
                "post_optimizer_step(model))."
            )
        model = converter.convert(model)
        if not isinstance(model, nn.Module):
            raise TypeError(
                f"{type(converter).__name__}.convert returned {type(model).__name__}, not an nn.Module: return "
                "the converted model (the same object when it changes the model in place)."
            )
    return model


def post_optimizer_step(model: nn.Module, converters: Sequence[ModelConverter]) -> None:
    """Run the `post_optimizer_step(model)` of the converters that define one, in their order."""
    for converter in converters:
        hook = getattr(converter, "post_optimizer_step", None)
        if hook is not None:
            hook(model)

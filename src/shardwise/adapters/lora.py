"""LoRA through PEFT on models that are built on the meta device and sharded afterwards.

PEFT writes the adapter layers; this file makes them behave under the
strategies. `apply_lora` wraps a model (real or on the meta device) in a
`peft.PeftModel`. On the meta device PEFT's own initialisation writes
nothing, so the adapter weights are initialised later, after the strategy
has allocated the shards, by `init_lora_weights` (the recipe's init_weights
calls it after loading the base weights) or, for a module without an
init_weights hook, by the strategy's per-module reset: `apply_lora` gives
each adapter matrix a `reset_parameters` that runs PEFT's
`reset_lora_parameters` (A: Kaiming-uniform, B: zero). Either way every
matrix is drawn on a full-size CPU tensor under an RNG seeded from (seed,
the module's name) and each rank keeps its part, so the adapter starts the
same on every rank, under every strategy, at every world size -- the
property the FSDP / DDP / ZeRO parity tests rely on. `base_weight_name`
maps PEFT's parameter names back to the base model's checkpoint keys, for
the rank-0 weight loader. `check_lora` runs the PEFT wrapping on a meta
copy of the model up front, so an unknown target module is reported with
the names that do exist before any worker starts.
"""

from __future__ import annotations

import dataclasses
import functools
import re
import sys
from dataclasses import dataclass
from typing import Any, Callable, Dict, Iterator, List, Optional, Tuple, Union

import torch
from torch import nn
from torch.distributed.tensor import DTensor

from shardwise.adapters.quantize import fourbit_layers
from shardwise.seed import module_seed, rng_devices

ALL_LINEAR = "all-linear"  # PEFT's shorthand: every linear layer but the output layer
_PEFT_PREFIX = "base_model.model."
_ADAPTER_PART = re.compile(r"(^|\.)(lora_[A-Za-z_]+)(\.|$)")


@dataclass
class LoraOptions:
    """LoRA hyper-parameters, as the recipe's flags spell them (PEFT's names without the `lora_`).

    Args:
        r: rank of the adapter matrices (1 or more)
        alpha: scaling numerator: the update is scaled by alpha / r
        dropout: dropout probability on the adapter path
        target_modules: module names (PEFT's matching: the full name or its last parts), or
            ["all-linear"]; None: PEFT's default for the model type
    """

    r: int
    alpha: int = 16
    dropout: float = 0.0
    target_modules: Optional[List[str]] = None

    def to_peft(self) -> Any:
        """The `peft.LoraConfig(task_type="CAUSAL_LM", ...)` these options mean."""
        from peft import LoraConfig

        self.validate()
        targets: Any = list(self.target_modules) if self.target_modules is not None else None
        if targets is not None and ALL_LINEAR in targets:
            targets = ALL_LINEAR  # PEFT knows the shorthand only as a plain string
        return LoraConfig(
            task_type="CAUSAL_LM", r=self.r, lora_alpha=self.alpha, lora_dropout=self.dropout, target_modules=targets
        )

    def validate(self) -> None:
        """Raise ValueError naming the option for values PEFT would take but that cannot train."""
        if isinstance(self.r, bool) or not isinstance(self.r, int) or self.r < 1:
            raise ValueError(f"lora_r={self.r!r}: use a whole number of 1 or more (e.g. 8 or 16); 0 means no LoRA.")
        if isinstance(self.alpha, bool) or not isinstance(self.alpha, (int, float)) or not self.alpha > 0:
            raise ValueError(
                f"lora_alpha={self.alpha!r}: use a positive number (often 2 x lora_r); the adapter's update "
                "is scaled by lora_alpha / lora_r, so 0 would train nothing."
            )
        if not isinstance(self.dropout, (int, float)) or not 0.0 <= self.dropout < 1.0:
            raise ValueError(f"lora_dropout={self.dropout!r}: use a probability in [0, 1), e.g. 0.05.")
        targets = self.target_modules
        if targets is not None:
            if isinstance(targets, str) or not all(isinstance(t, str) and t for t in targets) or not targets:
                raise ValueError(
                    f"lora_target_modules={targets!r}: use a list of module names, e.g. [q_proj, v_proj], "
                    f"or [{ALL_LINEAR}]."
                )
            if ALL_LINEAR in targets and len(targets) > 1:
                raise ValueError(
                    f"lora_target_modules={targets!r}: {ALL_LINEAR} already names every linear layer; "
                    "give it alone, or list the module names without it."
                )


def _peft_config(options: Any) -> Any:
    from peft import LoraConfig

    if isinstance(options, LoraOptions):
        return options.to_peft()
    if isinstance(options, LoraConfig):
        return options
    raise TypeError(
        f"apply_lora takes a LoraOptions or a peft.LoraConfig, got {type(options).__name__}. "
        "For another PEFT method, wrap the model with peft.get_peft_model yourself in configure_model."
    )


def apply_lora(model: nn.Module, options: Union[LoraOptions, Any]) -> nn.Module:
    """Wrap `model` in a `peft.PeftModel` with LoRA adapters; works on a meta-device model.

    Returns the PeftModel: only the adapter weights require gradients. On a
    real model PEFT initialises the adapters (from the global RNG; DDP and
    DeepSpeed broadcast rank 0's values when they wrap it). On the meta device
    nothing is written until the strategy materialises the model: then each
    adapter matrix's `reset_parameters` (set here) or `init_lora_weights`
    gives every rank the same values.
    """
    from peft import PeftModel, get_peft_model

    if isinstance(model, PeftModel):
        raise ValueError(
            "apply_lora: the model is already a peft.PeftModel; pass the PeftModel as it is (shardwise trains "
            "it as built), or apply_lora to the base model."
        )
    config = _peft_config(options)
    kind = config.init_lora_weights
    on_meta = any(p.is_meta for p in model.parameters())
    if on_meta and kind not in (True, False, "gaussian"):
        raise ValueError(
            f"init_lora_weights={kind!r} computes the adapter from the base weights, which a meta-device "
            "model does not have yet. Use init_lora_weights=True (PEFT's default) or 'gaussian'."
        )
    try:
        wrapped = get_peft_model(model, config)
    except ValueError as exc:  # PEFT's "Target modules ... not found", "Please specify target_modules"
        raise ValueError(f"{exc} {module_name_hint(model)}") from exc
    for _, layer, adapter in lora_layers(wrapped):
        for child in _adapter_children(layer, adapter):
            # Instance attribute: the strategy's meta-device materialisation runs every module's
            # reset_parameters under a seeded RNG; nn.Linear's own would give lora_B random values.
            child.reset_parameters = functools.partial(_reset_adapter_child, layer, adapter, child, kind)
    return wrapped


def is_adapter_model(model: Any) -> bool:
    """True for a PeftModel, or a module that holds one (as an attribute or child) or holds PEFT adapter layers."""
    if not isinstance(model, nn.Module):
        return False
    if "peft" not in sys.modules:  # a model with PEFT layers was built by PEFT; importing it costs seconds
        return False
    try:
        from peft import PeftModel
        from peft.tuners.tuners_utils import BaseTunerLayer
    except ImportError:  # without PEFT nothing can be an adapter model
        return False
    return any(isinstance(m, (PeftModel, BaseTunerLayer)) for m in model.modules())


def full_numel(p: torch.Tensor) -> int:
    """Elements of the whole parameter: a DTensor's global size, a ZeRO-3 partition's ds_numel,
    a 4-bit parameter's unpacked size (bitsandbytes' quant_state shape)."""
    if hasattr(p, "ds_numel"):
        return int(p.ds_numel)
    state = getattr(p, "quant_state", None)
    if state is not None and getattr(state, "shape", None) is not None:
        return int(torch.Size(state.shape).numel())
    return int(p.numel())  # DTensor.numel() is already the global one


def count_parameters(module: nn.Module) -> Tuple[int, int]:
    """(trainable, total) parameter elements, at full size whether sharded (FSDP, ZeRO-3) or not; tied
    parameters once. A 4-bit weight (QLoRA) counts its layer's out x in weights, not its packed codes
    (two a byte, in a column of the storage dtype), sharded or not."""
    fourbit = fourbit_layers(module)
    trainable = total = 0
    for p in module.parameters():
        layer = fourbit.get(id(p))
        n = layer.out_features * layer.in_features if layer is not None else full_numel(p)
        total += n
        if p.requires_grad:
            trainable += n
    return trainable, total


def describe_parameters(trainable: int, total: int) -> str:
    """`trainable params: 1,024 || all params: 1,000,000 || trainable: 0.1024%` (PEFT's wording)."""
    share = 100.0 * trainable / total if total else 0.0
    return f"trainable params: {trainable:,} || all params: {total:,} || trainable: {share:.4f}%"


# ------------------------------------------------------------------ names
def base_weight_name(fqn: str) -> Optional[str]:
    """The base model's checkpoint key for a parameter name of a PeftModel; None for adapter weights.

    `base_model.model.model.layers.0.self_attn.q_proj.base_layer.weight` -> `model.layers.0.self_attn.q_proj.weight`;
    `...q_proj.lora_A.default.weight` -> None. Names of a plain model pass unchanged.
    """
    if _ADAPTER_PART.search(fqn):
        return None
    if fqn.startswith(_PEFT_PREFIX):
        fqn = fqn[len(_PEFT_PREFIX) :]
    return fqn.replace(".base_layer.", ".")


def lora_layers(model: nn.Module) -> Iterator[Tuple[str, nn.Module, str]]:
    """(module name, PEFT LoRA layer, adapter name) for every adapter with A/B matrices."""
    from peft.tuners.lora import LoraLayer

    for name, mod in model.named_modules():
        if isinstance(mod, LoraLayer):
            for adapter in list(getattr(mod, "lora_A", {}).keys()):
                yield name, mod, adapter


def _adapter_children(layer: nn.Module, adapter: str) -> List[nn.Module]:
    return [layer.lora_A[adapter], layer.lora_B[adapter]]


# ------------------------------------------------------------------ initialisation
def _is_zero3(p: torch.Tensor) -> bool:
    return hasattr(p, "ds_id")


def _full_shape(p: torch.Tensor) -> Tuple[int, ...]:
    return tuple(p.ds_shape) if _is_zero3(p) else tuple(p.shape)


def _write_part(param: torch.Tensor, full: torch.Tensor) -> None:
    """Copy this rank's part of `full` (a CPU tensor of the whole parameter) into `param`."""
    if isinstance(param, DTensor):
        from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

        shape, offset = compute_local_shape_and_global_offset(param.shape, param.device_mesh, param.placements)
        local = param._local_tensor
        local.copy_(full[tuple(slice(o, o + s) for o, s in zip(offset, shape))].reshape(local.shape))
    elif _is_zero3(param):
        # A ZeRO-3 partition: elements [i * n, (i + 1) * n) of the flattened tensor on the i-th rank of its group.
        import torch.distributed as dist

        part = param.ds_tensor.data.view(-1)
        group = getattr(param, "ds_process_group", None)
        index = dist.get_rank(group) if dist.is_initialized() else 0
        flat = full.reshape(-1)[index * part.numel() : (index + 1) * part.numel()]
        part[: flat.numel()].copy_(flat)
    else:
        param.copy_(full)


def _reset_adapter_child(layer: nn.Module, adapter: str, child: nn.Module, kind: Any = True) -> None:
    """PEFT's reset_lora_parameters(adapter, kind), keeping only what it writes into `child` (lora_A or lora_B).

    The sibling's parameters are swapped for scratch tensors while it runs: PEFT
    initialises A and B together, and the sibling is initialised on its own turn.
    `kind` False is PEFT's "no LoRA init": the nn.Linear default, B not zero.
    """
    if kind is False:
        nn.Linear.reset_parameters(child)
        return
    swapped = []
    for sibling in _adapter_children(layer, adapter):
        if sibling is child:
            continue
        for key, p in list(sibling._parameters.items()):
            if p is not None:
                swapped.append((sibling, key, p))
                sibling._parameters[key] = nn.Parameter(torch.empty(_full_shape(p)), requires_grad=p.requires_grad)
    try:
        layer.reset_lora_parameters(adapter, kind)
    finally:
        for sibling, key, p in swapped:
            sibling._parameters[key] = p


def _init_kind(model: nn.Module, adapter: str) -> Any:
    """The PeftModel's init_lora_weights for `adapter` (True, PEFT's default, when it holds no config)."""
    for mod in model.modules():
        config = getattr(mod, "peft_config", None)
        if isinstance(config, dict) and adapter in config:
            return getattr(config[adapter], "init_lora_weights", True)
    return True


@torch.no_grad()
def init_lora_weights(model: nn.Module, seed: int) -> int:
    """Initialise every LoRA A/B matrix as PEFT does, identically on every rank; return how many.

    For an init_weights hook after the base weights are loaded: each matrix
    is drawn on a full-size CPU tensor under an RNG seeded from (seed, its
    module name, wrappers stripped) and each rank keeps its part (a DTensor's
    shard, a ZeRO-3 partition, or the whole), so the values do not depend on
    the strategy or the world size, and match what the strategy's per-module
    reset would draw.
    """
    names = {id(m): n for n, m in model.named_modules()}
    count = 0
    for _, layer, adapter in lora_layers(model):
        for child in _adapter_children(layer, adapter):
            originals = {k: p for k, p in child._parameters.items() if p is not None}
            device = next(iter(originals.values())).device if originals else None
            with torch.random.fork_rng(devices=rng_devices(device)):
                torch.manual_seed(module_seed(seed, names[id(child)]))
                for key, p in originals.items():
                    child._parameters[key] = nn.Parameter(torch.empty(_full_shape(p)), requires_grad=p.requires_grad)
                try:
                    _reset_adapter_child(layer, adapter, child, _init_kind(model, adapter))
                    fresh = {k: child._parameters[k].detach() for k in originals}
                finally:
                    for key, p in originals.items():
                        child._parameters[key] = p
            for key, p in originals.items():
                _write_part(p, fresh[key])
                count += 1
    return count


# ------------------------------------------------------------------ up-front checks
def module_name_hint(model: nn.Module) -> str:
    """`Modules with weights in this model: down_proj, gate_proj, ...` (the last part of each name)."""
    leaves = sorted(
        {
            name.rsplit(".", 1)[-1]
            for name, mod in model.named_modules()
            if name and not list(mod.children()) and any(True for _ in mod.parameters(recurse=False))
        }
    )
    return f"Modules with weights in this model: {', '.join(leaves)} (or {ALL_LINEAR})."


def unmatched_targets(model: nn.Module, targets: Optional[List[str]]) -> List[str]:
    """The names in `targets` that match no module of `model` by PEFT's rule (the full name, or its last parts)."""
    if not targets or ALL_LINEAR in targets:
        return []
    names = [n for n, _ in model.named_modules() if n]
    return [t for t in targets if not any(n == t or n.endswith("." + t) for n in names)]


def check_lora(model: nn.Module, options: LoraOptions) -> Dict[str, int]:
    """Validate `options` against `model` (a meta-device model: nothing is allocated) by wrapping it.

    Raises ValueError naming the option and the fix; returns the parameter counts the run will have.
    Wraps `model` in place: pass a throwaway copy.
    """
    options.validate()
    missing = unmatched_targets(model, options.target_modules)
    if missing:
        raise ValueError(f"lora_target_modules: {missing} match no module of the model. {module_name_hint(model)}")
    wrapped = apply_lora(model, options)
    trainable, total = count_parameters(wrapped)
    if trainable == 0:
        raise ValueError(
            f"lora_target_modules={options.target_modules!r} adds no trainable parameter. {module_name_hint(model)}"
        )
    return {"trainable": trainable, "total": total}


def check_lora_config(config: Any, build_meta_model: Callable[[], nn.Module]) -> Optional[Dict[str, int]]:
    """The recipe's LoRA fields (lora_r, lora_alpha, lora_dropout, lora_target_modules) checked up front.

    `build_meta_model()` builds the architecture (no weights); it runs on the meta
    device, so nothing is allocated. Raises ValueError naming the field and the
    fix; a LoRA field set while lora_r is 0 is refused rather than ignored.
    Returns the run's parameter counts, or None for full fine-tuning.
    """
    options = options_from(config)
    if options is None:
        if config.lora_r != 0:
            raise ValueError(f"lora_r={config.lora_r!r}: use 1 or more for LoRA (e.g. 16), or 0 for full fine-tuning.")
        defaults = {f.name: f.default for f in dataclasses.fields(LoraOptions)}
        fields = ("alpha", "dropout", "target_modules")
        given = [f"lora_{n}" for n in fields if getattr(config, f"lora_{n}") != defaults[n]]
        if given:
            raise ValueError(f"{', '.join(given)} set but lora_r=0 (full fine-tuning): set lora_r (e.g. 16) too.")
        return None
    with torch.device("meta"):
        model = build_meta_model()
    return check_lora(model, options)


def options_from(config: Any) -> Optional[LoraOptions]:
    """The LoraOptions of a config with lora_r / lora_alpha / lora_dropout / lora_target_modules
    (the recipe's FinetuneConfig); None when lora_r is 0 (full fine-tuning)."""
    if not getattr(config, "lora_r", 0):
        return None
    return LoraOptions(
        r=config.lora_r,
        alpha=config.lora_alpha,
        dropout=config.lora_dropout,
        target_modules=list(config.lora_target_modules) if config.lora_target_modules is not None else None,
    )

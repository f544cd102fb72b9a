"""Tensor parallel: split each layer's weights over the ranks of the "tp" mesh dimension.

`apply_tensor_parallel(module, tp_mesh)` runs first in FSDPStrategy.setup_module, on the
meta-device model, before sequence parallel, activation checkpointing and `fully_shard`
(torchtitan's order): FSDP2 then shards the tensor-parallel DTensors again over the
data-parallel mesh, giving 2-D (dp x tp) parameters. The plan comes from the model; this
file knows no model class:
- a module with a `tensor_parallel_plan` attribute (a dict of module-path pattern ->
  torch ParallelStyle, or one of the Hugging Face style names below; or a method returning
  one, which is handed the degree when it takes an argument) gets exactly that; the bundled
  GPT carries its own (models/gpt_parallel.py: Megatron / torchtitan's layout);
- a Hugging Face model gets its own plan (`model.tp_plan`, or `_tp_plan` plus
  `config.base_model_tp_plan`), each style name translated to a torch ParallelStyle, and
  a name we have no translation for refused by name.
Everything is checked before anything is allocated: head and key/value-head counts and
every split dimension must divide by the degree, every plan entry must match a module,
and tied input/output embeddings are refused (the two layers would split the one weight
along different dimensions). Parameters no plan names stay whole on every tp rank; their
gradients are equal there because the layers around them produce replicated activations.
"""

from __future__ import annotations

import inspect
from fnmatch import fnmatch
from typing import Any, Dict, List, Mapping, Optional, Tuple

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Replicate, Shard, distribute_module, distribute_tensor
from torch.distributed.tensor.parallel import (
    ColwiseParallel,
    ParallelStyle,
    RowwiseParallel,
    parallelize_module,
)

from shardwise.strategies import degrees

__all__ = ["apply_tensor_parallel", "hf_plan", "translate_hf_style", "ReplicateParallel", "HF_STYLES"]

Plan = Dict[str, ParallelStyle]

# Hugging Face's tp_plan vocabulary (transformers.distributed.tensor_parallel) -> torch styles.
# Only styles with the same meaning in torch are here; the rest are refused by name.
HF_STYLES = {
    "colwise": lambda: ColwiseParallel(),
    "rowwise": lambda: RowwiseParallel(),
    "colwise_rep": lambda: ColwiseParallel(output_layouts=Replicate()),
    "colwise_gather_output": lambda: ColwiseParallel(output_layouts=Replicate()),
    "rowwise_rep": lambda: RowwiseParallel(input_layouts=Replicate()),
    "rowwise_split_input": lambda: RowwiseParallel(input_layouts=Replicate()),
    "embedding_rowwise": lambda: RowwiseParallel(input_layouts=Replicate(), output_layouts=Replicate()),
    "embedding_colwise": lambda: ColwiseParallel(output_layouts=Replicate()),
    "replicate": lambda: None,  # the whole weight on every rank: nothing to do
}


def translate_hf_style(name: str, where: str) -> Optional[ParallelStyle]:
    """The torch ParallelStyle for one Hugging Face tp_plan style name (None: leave the module whole)."""
    if not isinstance(name, str) or name not in HF_STYLES:
        raise ValueError(
            f"tensor parallel: the plan entry {where!r} has style {name!r}, which shardwise does not translate. "
            f"Supported Hugging Face styles: {', '.join(sorted(HF_STYLES))}. Give the model a "
            "`tensor_parallel_plan` attribute (module-path pattern -> torch ParallelStyle) instead, or train "
            "without tp (tp_size=1)."
        )
    return HF_STYLES[name]()


class ReplicateParallel(ParallelStyle):
    """A layer left whole on every tp rank, its own parameters made Replicate DTensors on the tp mesh.

    A plan splits only some layers (Hugging Face plans leave the norms whole). If the rest stayed
    plain tensors, FSDP2 would put them on the dp mesh and the split ones on (dp, tp), and every
    foreach kernel over all gradients (clipping's norm and scaling, the optimizers' foreach steps on
    GPUs) refuses tensors on different meshes. As Replicate DTensors they share the split layers'
    mesh; their inputs arrive replicated (every tp rank holds the same activations there) and their
    outputs leave as plain tensors, so the model's code around them is unchanged.
    """

    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        def own_params(name: str, sub: nn.Module, mesh: DeviceMesh) -> None:
            if sub is not module:
                return
            for key, p in list(sub._parameters.items()):
                if p is not None and not isinstance(p, DTensor):
                    replicated = distribute_tensor(p, mesh, [Replicate()], src_data_rank=None)
                    sub._parameters[key] = nn.Parameter(replicated, requires_grad=p.requires_grad)

        def inputs(sub: nn.Module, args: Any, mesh: DeviceMesh) -> Any:
            return tuple(
                DTensor.from_local(a, mesh, [Replicate()], run_check=False)
                if isinstance(a, torch.Tensor) and not isinstance(a, DTensor) and a.is_floating_point()
                else a
                for a in args
            )

        def outputs(sub: nn.Module, out: Any, mesh: DeviceMesh) -> Any:
            if isinstance(out, DTensor):
                return out.to_local()
            if isinstance(out, tuple):
                return tuple(o.to_local() if isinstance(o, DTensor) else o for o in out)
            return out

        return distribute_module(module, device_mesh, own_params, inputs, outputs)


def replicate_the_rest(module: nn.Module, tp_mesh: DeviceMesh) -> List[str]:
    """ReplicateParallel on every module that still owns plain parameters after the plans; their names."""
    done = []
    for path, sub in list(module.named_modules()):
        if any(p is not None and not isinstance(p, DTensor) for p in sub._parameters.values()):
            parallelize_module(sub, tp_mesh, ReplicateParallel())
            done.append(path)
    return done


# ------------------------------------------------------------------ plans
def hf_style_names(model: nn.Module) -> Dict[str, str]:
    """A Hugging Face model's own tp_plan (full module paths -> style names); empty when it has none."""
    plan = getattr(model, "tp_plan", None)  # transformers >= 5: the merged, prefixed plan
    if isinstance(plan, Mapping) and plan:
        return dict(plan)
    merged = dict(getattr(model, "_tp_plan", None) or {})
    base_plan = getattr(getattr(model, "config", None), "base_model_tp_plan", None) or {}
    prefix = getattr(model, "base_model_prefix", "")
    has_base = prefix and isinstance(getattr(model, prefix, None), nn.Module)
    for key, style in base_plan.items():
        merged.setdefault(f"{prefix}.{key}" if has_base else key, style)
    return merged


def hf_plan(model: nn.Module, tp: int) -> Plan:
    """A Hugging Face model's own plan as torch styles, after checking heads and tied embeddings."""
    names = hf_style_names(model)
    if not names:
        raise ValueError(
            f"tensor parallel: {type(model).__name__} has no tensor-parallel plan (no tp_plan, _tp_plan or "
            "config.base_model_tp_plan). Give it a `tensor_parallel_plan` attribute (module-path pattern -> "
            "torch ParallelStyle), or train without tp."
        )
    config = model.config
    text = getattr(config, "get_text_config", lambda: config)()
    heads = getattr(text, "num_attention_heads", None)
    if heads is not None:
        kv = getattr(text, "num_key_value_heads", None) or heads
        check_heads(heads, kv, tp, f"{type(config).__name__}(num_attention_heads, num_key_value_heads)")
    inputs, outputs = model.get_input_embeddings(), model.get_output_embeddings()
    if inputs is not None and outputs is not None and outputs.weight is inputs.weight:
        raise ValueError(
            f"tensor parallel: {type(model).__name__} ties its output head to its input embedding "
            "(config.tie_word_embeddings=True), and the two layers split that one weight along different "
            "dimensions. Train it without tp (FSDP or sequence parallel), or untie the weights."
        )
    plan: Plan = {}
    for key, name in names.items():
        style = translate_hf_style(name, key)
        if style is not None:
            plan[key] = style
    for parent in shared_input_parents(model, names):
        plan[parent] = SharedReplicatedInput()
    return plan


def shared_input_parents(model: nn.Module, names: Mapping[str, str]) -> List[str]:
    """Plan paths of modules (attention, MLP) whose parameters all sit in colwise / rowwise children.

    Each colwise child turns the same replicated input into a DTensor of its own, and in backward
    all-reduces its own partial input gradient: q, k, v, gate and up make five all-reduces per layer.
    Made a DTensor once at the parent, the partial gradients add up first and one all-reduce remains.
    """
    children: Dict[str, List[str]] = {}
    for key, name in names.items():
        if "." in key and name in ("colwise", "rowwise"):
            parent, child = key.rsplit(".", 1)
            children.setdefault(parent, []).append(child)
    found = []
    for parent, planned in children.items():
        paths = matching_modules(model, parent)
        modules = [model.get_submodule(path) for path in paths]
        if (
            paths
            and all(_params_only_in(m, planned) for m in modules)
            and any(names[f"{parent}.{c}"] == "colwise" for c in planned)
        ):
            found.append(parent)
    return found


def _params_only_in(module: nn.Module, children: List[str]) -> bool:
    if any(True for _ in module.parameters(recurse=False)):
        return False
    return all(name in children for name, child in module.named_children() if any(True for _ in child.parameters()))


class SharedReplicatedInput(ParallelStyle):
    """The module's first tensor input (positional, or `hidden_states=`) as one Replicate DTensor for its children."""

    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        def hook(sub: nn.Module, args: Tuple[Any, ...], kwargs: Dict[str, Any]) -> Tuple[Any, Dict[str, Any]]:
            def replicated(x: Any) -> Any:
                if isinstance(x, torch.Tensor) and not isinstance(x, DTensor):
                    return DTensor.from_local(x, device_mesh, [Replicate()], run_check=False)
                return x

            if args:
                return (replicated(args[0]), *args[1:]), kwargs
            if "hidden_states" in kwargs:
                kwargs = {**kwargs, "hidden_states": replicated(kwargs["hidden_states"])}
            return args, kwargs

        module.register_forward_pre_hook(hook, with_kwargs=True)
        return module


def check_heads(heads: int, kv_heads: int, tp: int, what: str) -> None:
    """Refuse a tp that does not split `what`'s heads into whole heads per rank (the rule is degrees.py's)."""
    degrees.refuse(degrees.heads_problem(heads, kv_heads, tp, 1, what.split("(")[0], what))


# ------------------------------------------------------------------ applying
def find_plans(module: nn.Module, tp: int) -> List[Tuple[str, nn.Module, Plan]]:
    """(path, submodule, plan) for each part of `module` that has a plan, outermost first."""
    found: List[Tuple[str, nn.Module, Plan]] = []
    for path, sub in module.named_modules():
        if any(path == p or path.startswith(p + ".") for p, _, _ in found if p):
            continue
        if found and found[0][0] == "":
            break  # the root's own plan covers everything
        own = getattr(type(sub), "tensor_parallel_plan", None) is not None or "tensor_parallel_plan" in vars(sub)
        if own:
            found.append((path, sub, user_plan(sub, tp)))
        elif _is_hf_model(sub) and hf_style_names(sub):
            found.append((path, sub, hf_plan(sub, tp)))
    return found


def _is_hf_model(module: nn.Module) -> bool:
    return hasattr(module, "config") and callable(getattr(module, "get_input_embeddings", None))


def user_plan(module: nn.Module, tp: int) -> Plan:
    """A module's own `tensor_parallel_plan` (a dict, or a method returning one): torch styles or HF names.

    A method that takes an argument gets the degree `tp`, so a model can check its shape against it
    before anything is split (the bundled GPT's head counts)."""
    raw = module.tensor_parallel_plan
    if callable(raw) and not isinstance(raw, Mapping):
        raw = raw(tp) if _takes_argument(raw) else raw()
    if not isinstance(raw, Mapping) or not raw:
        raise TypeError(
            f"{type(module).__name__}.tensor_parallel_plan must be a non-empty dict of module-path pattern -> "
            f"torch ParallelStyle (ColwiseParallel(), RowwiseParallel(), ...), got {raw!r}."
        )
    plan: Plan = {}
    for key, style in raw.items():
        if isinstance(style, str):
            style = translate_hf_style(style, key)
            if style is None:
                continue
        if not isinstance(style, ParallelStyle):
            raise TypeError(
                f"{type(module).__name__}.tensor_parallel_plan[{key!r}] is {style!r}; expected a torch "
                "ParallelStyle (torch.distributed.tensor.parallel.ColwiseParallel(), RowwiseParallel(), ...)."
            )
        plan[key] = style
    return plan


def _takes_argument(method: Any) -> bool:
    try:
        return bool(inspect.signature(method).parameters)
    except (TypeError, ValueError):  # a builtin without a signature: called as before, with none
        return False


def matching_modules(module: nn.Module, pattern: str) -> List[str]:
    """Paths of the submodules a plan key selects (fnmatch per path element, as parallelize_module)."""
    if pattern == "":
        return [""]
    parts = pattern.split(".")
    hits = []
    for path, _ in module.named_modules():
        names = path.split(".") if path else []
        if len(names) == len(parts) and all(fnmatch(n, p) for n, p in zip(names, parts)):
            hits.append(path)
    return hits


def apply_tensor_parallel(module: nn.Module, tp_mesh: DeviceMesh) -> None:
    """Split the model's layers over `tp_mesh` (1-D) in place, by the model's own plan (see the file's top).

    Raises ValueError naming the fix when no part of the model has a plan, a plan entry matches
    no module, or the degree does not divide a head count or a split dimension.
    """
    tp = tp_mesh.size()
    plans = find_plans(module, tp)
    if not plans:
        raise ValueError(
            f"tensor parallel: {type(module).__name__} contains no model with a tensor-parallel plan (shardwise "
            "knows the bundled GPT and Hugging Face models with a tp_plan). Give your model a "
            "`tensor_parallel_plan` attribute: a dict of module-path pattern -> torch ParallelStyle, e.g. "
            "{'layers.*.attn.qkv': ColwiseParallel(), 'layers.*.attn.out': RowwiseParallel()}; or set tp_size=1."
        )
    for path, sub, plan in plans:
        unmatched = [key for key in plan if not matching_modules(sub, key)]
        if unmatched:
            raise ValueError(
                f"tensor parallel: plan entr{'y' if len(unmatched) == 1 else 'ies'} {unmatched} of "
                f"{type(sub).__name__}{f' ({path})' if path else ''} match no submodule. Fix the module paths "
                "in the plan (patterns use '*' for one path element, e.g. 'layers.*.mlp.up_proj')."
            )
    for _, sub, plan in plans:
        parallelize_module(sub, tp_mesh, plan)
    replicate_the_rest(module, tp_mesh)
    check_divisible(module, tp_mesh)


def check_divisible(module: nn.Module, tp_mesh: DeviceMesh) -> None:
    """Every dimension the plan split must divide by the degree (uneven shards are not laid out here)."""
    tp, bad = tp_mesh.size(), []
    for name, p in module.named_parameters():
        if not isinstance(p, DTensor) or p.device_mesh != tp_mesh:
            continue
        for placement in p.placements:
            if isinstance(placement, Shard) and p.shape[placement.dim] % tp:
                bad.append(f"{name} {tuple(p.shape)} (dim {placement.dim})")
    if bad:
        raise ValueError(
            f"tensor parallel degree {tp} does not divide these split dimensions: {', '.join(bad[:6])}"
            f"{' ...' if len(bad) > 6 else ''}. Choose a tp_size that divides them (e.g. pad the vocabulary to a "
            "multiple of it)."
        )

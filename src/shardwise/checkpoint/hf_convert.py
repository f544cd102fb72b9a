"""Transformers' own weight-conversion mapping, applied one group of tensors at a time.

A hub checkpoint's layout is not always its transformers 5 module's: a
Mixtral on the hub stores `block_sparse_moe.experts.{i}.w1/w2/w3` per expert
while the module holds one fused `mlp.experts.gate_up_proj`; `from_pretrained`
converts with the architecture's mapping (transformers' conversion_mapping.py:
renamings, and converters that stack, concatenate or split tensors), and
`save_pretrained` applies the mapping backwards. This module runs that same
mapping, never a copy of it, for loaders and writers that never hold the whole
model: `plan_load` says, from the checkpoint's names and shapes alone, which
checkpoint tensors make each model tensor (a group: one expert list, one
renamed tensor) and with what shape, so a loader checks the whole checkpoint
before any tensor moves; `convert_group` builds one group's model tensors from
its sources; `export_groups` and `revert_group` do the same backwards for a
writer. A group holds at most one fused tensor and its sources, never the model.
What transformers itself cannot convert (an operation that fails on the
checkpoint's shapes) is refused by the name of that conversion.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass, field
from typing import Any, Callable, Dict, Iterable, Iterator, List, Optional, Sequence, Tuple

import torch
from torch import nn


class ConversionError(ValueError):
    """A checkpoint tensor group that transformers' conversion mapping cannot turn into the model's tensors."""


def pretrained_model(model: nn.Module) -> Optional[nn.Module]:
    """The transformers `PreTrainedModel` that is `model` or inside it (a PeftModel's base), else None."""
    try:
        from transformers import PreTrainedModel
    except ImportError:  # no transformers: nothing to convert
        return None
    return next((m for m in model.modules() if isinstance(m, PreTrainedModel)), None)


def _split(transforms: Iterable[Any]) -> Tuple[List[Any], List[Any]]:
    from transformers.core_model_loading import WeightConverter, WeightRenaming

    transforms = list(transforms)
    return (
        [t for t in transforms if isinstance(t, WeightRenaming)],
        [t for t in transforms if isinstance(t, WeightConverter)],
    )


def load_transforms(model: nn.Module) -> List[Any]:
    """The transforms `from_pretrained` applies for `model`'s architecture (fresh objects: they record use)."""
    base = pretrained_model(model)
    if base is None:
        return []
    from transformers.conversion_mapping import get_model_conversion_mapping

    return list(get_model_conversion_mapping(base))


@dataclass
class LoadGroup:
    """Checkpoint tensors that make one or more model tensors together."""

    target: str  # the first model name the group's sources rename to (transformers' grouping key)
    sources: List[Tuple[str, str]] = field(default_factory=list)  # (source pattern, checkpoint key), in order
    converter: Any = None  # a WeightConverter (template: copied per use); None for a plain rename
    outputs: Dict[str, List[int]] = field(default_factory=dict)  # model name -> shape, in convert's order


@dataclass
class LoadPlan:
    groups: List[LoadGroup]
    unexpected: List[str]  # checkpoint keys no model name takes
    used: List[Any]  # the transforms that matched a checkpoint key (recorded on the model for the export)


def _natural_key(name: str) -> Any:
    from transformers.core_model_loading import dot_natural_key

    return dot_natural_key(name)


def plan_load(model: nn.Module, shapes: Dict[str, List[int]], model_names: Iterable[str]) -> LoadPlan:
    """Group the checkpoint's keys (`shapes`: key -> shape, headers only) as `from_pretrained` would.

    Each group's outputs (model names and shapes) come from running its
    converter on meta tensors of the checkpoint's shapes: nothing is read, and
    every rank computes the same plan from the same header list.
    """
    from transformers.core_model_loading import rename_source_key

    base = pretrained_model(model)
    transforms = load_transforms(model)
    renamings, converters = _split(transforms)
    by_pattern = {p: c for c in converters for p in c.source_patterns}
    names = {n: True for n in model_names}
    prefix = getattr(base, "base_model_prefix", None) if base is not None else None
    groups: Dict[str, LoadGroup] = {}
    unexpected: List[str] = []
    for key in sorted(shapes, key=_natural_key):  # transformers' order: the order experts are stacked in
        target, pattern = rename_source_key(key, renamings, converters, prefix, names)
        if target not in names and key in names:  # transformers keeps a key the model already has
            target, pattern = key, None
        if target not in names:
            unexpected.append(key)
            continue
        group = groups.setdefault(target, LoadGroup(target, converter=by_pattern.get(pattern)))
        group.sources.append((pattern or key, key))
    for group in groups.values():
        group.outputs = _output_shapes(group, shapes, base)
    used = [t for t in transforms if t.was_used()]
    return LoadPlan(list(groups.values()), unexpected, used)


def _describe(group: LoadGroup) -> str:
    keys = [k for _, k in group.sources]
    more = f" and {len(keys) - 2} more" if len(keys) > 2 else ""
    return (
        f"transformers' conversion {type(group.converter).__name__}({group.converter.source_patterns} -> "
        f"{group.converter.target_patterns}) of {keys[:2]}{more} into {group.target!r}"
    )


def _output_shapes(group: LoadGroup, shapes: Dict[str, List[int]], base: Any) -> Dict[str, List[int]]:
    if group.converter is None:
        return {group.target: list(shapes[group.sources[0][1]])}
    meta = {key: torch.empty(shapes[key], device="meta") for _, key in group.sources}
    try:
        out = convert_group(group, lambda key: meta[key], base)
    except Exception as exc:  # transformers' own operation failed on these shapes
        raise ConversionError(
            f"{_describe(group)} fails on the checkpoint's shapes: {exc}. The checkpoint does not hold what its "
            "config.json describes; re-save it with save_pretrained from a model that loads, or fix config.json."
        ) from exc
    return {name: list(t.shape) for name, t in out.items()}


def convert_group(group: LoadGroup, read: Callable[[str], torch.Tensor], base: Any) -> Dict[str, torch.Tensor]:
    """The model tensors of `group`, made from its sources (`read(key)` gives one checkpoint tensor).

    A plain rename returns the tensor itself; a converter runs transformers'
    operations on the sources, read one at a time as the operation asks.
    """
    if group.converter is None:
        return {group.target: read(group.sources[0][1])}
    converter = copy.deepcopy(group.converter)
    for pattern, key in group.sources:
        # A callable is transformers' "synchronous loading" form: read when the converter materialises it.
        converter.add_tensor(group.target, key, pattern, lambda key=key: read(key))
    config = getattr(base, "config", None)
    out = converter.convert(group.target, model=base, config=config)
    return {name: (t[0] if isinstance(t, list) else t) for name, t in out.items()}


# ------------------------------------------------------------------ export
def save_transforms(model: nn.Module) -> List[Any]:
    """What `save_pretrained` reverts for `model`: the transforms its load used (recorded by the
    loader as transformers records them), else the architecture's mapping without the legacy
    renamings and prefix changes (a model built from its config)."""
    base = pretrained_model(model)
    if base is None:
        return []
    used = getattr(base, "_weight_conversions", None)
    if used is not None:
        return list(used)
    from transformers.conversion_mapping import get_model_conversion_mapping
    from transformers.core_model_loading import PrefixChange

    return [t for t in get_model_conversion_mapping(base, add_legacy=False) if not isinstance(t, PrefixChange)]


@dataclass
class ExportGroup:
    """Model tensors written together under the hub's names."""

    members: List[Tuple[str, str]]  # (model name, source pattern), in the order the reverse converter collects
    converter: Any = None  # a reversed WeightConverter (template); None: `name` is the one member's hub name
    name: str = ""  # the hub name (rename) or the converter's grouping key


def export_groups(model: nn.Module, names: Sequence[str]) -> Tuple[List[ExportGroup], List[Any]]:
    """Group the model's tensor names (in writing order) as save_pretrained's reverse mapping does.

    Returns the groups, in the order of each group's first member, and the
    reversed renamings (applied to a converter's outputs)."""
    from transformers.core_model_loading import apply_converters, apply_renamings

    reversed_ = [t.reverse_transform() for t in save_transforms(model)[::-1]]
    renamings, converters = _split(reversed_)
    by_pattern = {p: c for c in converters for p in c.source_patterns}
    groups: Dict[str, ExportGroup] = {}
    for name in names:
        renamed, pattern = apply_converters(name, converters)
        if pattern is None:
            hub = apply_renamings(name, renamings)
            groups[f"rename:{name}"] = ExportGroup([(name, name)], None, hub)
            continue
        group = groups.setdefault(f"convert:{renamed}", ExportGroup([], by_pattern[pattern], renamed))
        group.members.append((name, pattern))
    return list(groups.values()), renamings


def revert_group(
    group: ExportGroup, tensors: Dict[str, torch.Tensor], renamings: List[Any], base: Any
) -> Dict[str, torch.Tensor]:
    """The hub tensors of `group` from its members' full tensors (`tensors`: model name -> tensor)."""
    if group.converter is None:
        ((name, _),) = group.members
        return {group.name: tensors[name]}
    from transformers.core_model_loading import apply_renamings

    converter = copy.deepcopy(group.converter)
    for name, pattern in group.members:
        converter.add_tensor(group.name, name, pattern, tensors[name])
    out = converter.convert(group.name, model=base, config=getattr(base, "config", None))
    result = {}
    for target, t in out.items():
        t = t[0] if isinstance(t, list) else t
        # A split's pieces are views of one tensor: safetensors refuses tensors that share memory.
        result[apply_renamings(target, renamings)] = t.clone(memory_format=torch.contiguous_format)
    return result


def revert_stream(
    model: nn.Module, names: Sequence[str], items: Iterable[Tuple[str, torch.Tensor]]
) -> Iterator[Tuple[str, torch.Tensor]]:
    """(hub name, tensor) for a stream of full (model name, tensor) pairs: what `shardwise convert`
    writes. `names` are every name the stream will hold; a group is converted when its last member
    arrives, so only unfinished groups are held."""
    groups, renamings = export_groups(model, names)
    base = pretrained_model(model)
    group_of = {name: group for group in groups for name, _ in group.members}
    pending: Dict[int, Dict[str, torch.Tensor]] = {}
    for name, tensor in items:
        group = group_of[name]
        got = pending.setdefault(id(group), {})
        got[name] = tensor
        if len(got) == len(group.members):
            del pending[id(group)]
            yield from revert_group(group, got, renamings, base).items()

"""Hugging Face causal LMs into and out of a sharded model, holding at most one tensor beyond the shards.

Every rank builds the model in the strategy's init context (meta device, or
deepspeed.zero.Init), the strategy allocates only the local shards, and only
global rank 0 reads the safetensors files: tensor by tensor it cuts out the
slice each rank owns (a DTensor's placements, or a ZeRO-3 partition's flat
range) and sends it, in bounded pieces. A broadcast of full tensors
(`set_model_state_dict(broadcast_from_rank0=True)`) would put every full
tensor on every rank: GBs for a 128k-token embedding. Non-persistent buffers
(RoPE's `inv_freq`) are recomputed by the model's own initialiser. Export
gathers one tensor at a time into checkpoint/hf_shards.py's writer on rank 0
and adds the config and tokenizer files, so `from_pretrained` loads the folder.
"""

from __future__ import annotations

import contextlib
import copy
import os
import shutil
import sys
import warnings
from dataclasses import dataclass, field
from typing import Any, Dict, Iterator, List, Optional, Sequence, Tuple

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor import DTensor, Replicate

from shardwise.adapters.lora import base_weight_name, is_adapter_model
from shardwise.adapters.quantize import fourbit_layers, place_4bit
from shardwise.checkpoint import hf_convert
from shardwise.checkpoint.hf_shards import (
    SAFE_INDEX,
    SAFE_SINGLE,
    SafetensorsReader,
    ShardWriter,
    read_safetensors_plan,
    weight_files,
)
from shardwise.distributed import ops
from shardwise.fqn import canonical_name
from shardwise.memory import current_rss_bytes, peak_rss_bytes, reset_peak_rss
from shardwise.strategies.materialize import mesh_coordinate, shard_slices

TOKENIZER_FILES = (
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "tokenizer.model",
    "vocab.json",
    "merges.txt",
    "added_tokens.json",
    "chat_template.jinja",
    "chat_template.json",
)


class ModelFolderError(ValueError):
    """The model folder cannot be loaded (missing config or weights, unsupported format)."""


@dataclass
class ModelFolder:
    path: str
    config: Any
    weight_files: List[str]
    has_tokenizer: bool
    max_positions: Optional[int]
    no_split_modules: List[str] = field(default_factory=list)
    #: where the config came from, for messages ("" : `path`/config.json; pretrain: its preset, file or hub id)
    source: str = ""


def _max_positions(config: Any) -> Optional[int]:
    for name in ("max_position_embeddings", "n_positions", "max_sequence_length", "seq_length"):
        value = getattr(config, name, None)
        if isinstance(value, int) and value > 0:
            return value
    return None


def inspect_model_folder(path: str) -> ModelFolder:
    """Check a local HF folder has a config and safetensors weights; raise ModelFolderError otherwise."""
    path = os.fspath(path)
    if not os.path.isdir(path):
        raise ModelFolderError(
            f"model path {path!r} is not a folder. Give a hub model id (org/name: downloaded into the Hugging "
            "Face cache) or a local Hugging Face model folder (config.json + *.safetensors + tokenizer files)."
        )
    present = sorted(os.listdir(path))
    if "config.json" not in present:
        raise ModelFolderError(
            f"{path!r} has no config.json, so the architecture is unknown. Files there: "
            f"{present or 'none'}. Save the model with save_pretrained()."
        )
    if SAFE_INDEX in present:
        files = weight_files(path)
        missing = [f for f in files if f not in present]
        if missing:
            raise ModelFolderError(f"{path!r}: {SAFE_INDEX} lists {missing} but those files are missing.")
    elif SAFE_SINGLE in present:
        files = [SAFE_SINGLE]
    else:
        other = [f for f in present if f.endswith((".bin", ".pt", ".pth", ".ckpt", ".h5", ".msgpack"))]
        hint = (
            f" It has {other}: convert them to safetensors first (load once with from_pretrained and "
            "save_pretrained(safe_serialization=True))."
            if other
            else ""
        )
        raise ModelFolderError(
            f"{path!r} has a config.json but no weights ({SAFE_SINGLE} or {SAFE_INDEX}).{hint} Files there: {present}."
        )
    from transformers import AutoConfig

    config = AutoConfig.from_pretrained(path)
    has_tok = any(f in present for f in ("tokenizer.json", "tokenizer.model", "vocab.json"))
    return ModelFolder(path, config, files, has_tok, _max_positions(config))


def build_meta_model(
    folder: ModelFolder, attn_implementation: str = "sdpa", dtype: Optional[torch.dtype] = None
) -> nn.Module:
    """The architecture in the strategy's init context; no weights read.

    That context is the meta device (FSDP, DDP, ZeRO 0-2) or
    deepspeed.zero.Init (ZeRO-3), which partitions each parameter as it is
    created. Transformers' own weight init cannot run on those partitions
    (it indexes rows), and the weights are loaded afterwards anyway, so under
    zero.Init it is skipped, as `from_pretrained` does under ZeRO-3; the
    embeddings are still tied.
    """
    from transformers import AutoModelForCausalLM

    zero_init = _zero_init_active()
    if zero_init:
        from transformers.initialization import no_init_weights
    with no_init_weights() if zero_init else contextlib.nullcontext():
        model = AutoModelForCausalLM.from_config(
            folder.config, attn_implementation=attn_implementation, dtype=dtype or torch.get_default_dtype()
        )
    if zero_init:
        model.tie_weights()  # part of the init no_init_weights skipped
    folder.no_split_modules = no_split_module_names(model)
    return model


def _zero_init_active() -> bool:
    if "deepspeed" not in sys.modules:
        return False
    from deepspeed.runtime.zero import partition_parameters

    return partition_parameters.zero_init_context > 0


def model_block_names(config: Any) -> List[str]:
    """`_no_split_modules` of the causal-LM class for `config`, read from the class (no model built).

    The strategy needs the block names as its wrap policy before
    `configure_model` runs, so they come from the class attribute.
    """
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING

    try:
        cls = MODEL_FOR_CAUSAL_LM_MAPPING[type(config)]
    except KeyError as exc:
        raise ModelFolderError(
            f"{type(config).__name__} has no causal-LM class in transformers "
            f"(model_type={getattr(config, 'model_type', None)!r})."
        ) from exc
    return sorted(getattr(cls, "_no_split_modules", None) or [])


def no_split_module_names(model: nn.Module) -> List[str]:
    """The model's transformer-block class names (`_no_split_modules`): FSDP's natural units."""
    names = getattr(model, "_no_split_modules", None) or []
    return sorted(names)


# ------------------------------------------------------------------ buffers
def _non_persistent_buffer_owners(model: nn.Module) -> List[Tuple[str, nn.Module]]:
    return [(name, mod) for name, mod in model.named_modules() if mod._non_persistent_buffers_set]


@torch.no_grad()
def recompute_buffers(model: nn.Module) -> List[str]:
    """Recompute buffers that no checkpoint holds (RoPE inv_freq ...) after to_empty().

    HF models know how to compute them: `PreTrainedModel._init_weights(module)`
    fills e.g. the rotary embedding's inv_freq from the config. A module that
    also owns weights (Gemma 3's scaled embedding and its embed_scale) is
    initialised with meta stand-ins lent for its parameters, so the call never
    touches a loaded (sharded) weight. Returns the names it could not handle;
    the strategy's uninitialised-tensor check then names them.
    """
    init = getattr(model, "_init_weights", None)
    if not callable(init):
        return [name for name, _ in _non_persistent_buffer_owners(model)]
    for _, mod in _non_persistent_buffer_owners(model):
        own = {k: p for k, p in mod._parameters.items() if p is not None}
        try:
            for k, p in own.items():
                stand_in = torch.empty(full_shape(p), dtype=p.dtype, device="meta")
                mod._parameters[k] = nn.Parameter(stand_in, p.requires_grad)
            init(mod)
        finally:
            mod._parameters.update(own)
    return []


# ------------------------------------------------------------------ slicing
def is_zero3_param(t: torch.Tensor) -> bool:
    """A parameter partitioned by DeepSpeed ZeRO-3 (built under deepspeed.zero.Init)."""
    return hasattr(t, "ds_id")


def full_shape(t: torch.Tensor) -> torch.Size:
    """The unsharded shape: a DTensor's global shape, a ZeRO-3 parameter's ds_shape."""
    return t.ds_shape if is_zero3_param(t) else t.shape


# ------------------------------------------------------------------ reading
def _targets(model: nn.Module) -> Dict[int, Tuple[List[str], torch.Tensor]]:
    """Every parameter and persistent buffer, keyed by identity, with all its (canonical) names."""
    found: Dict[int, Tuple[List[str], torch.Tensor]] = {}
    for prefix, mod in model.named_modules(remove_duplicate=False):
        for kind in ("_parameters", "_buffers"):
            for name, t in getattr(mod, kind).items():
                if t is None or (kind == "_buffers" and name in mod._non_persistent_buffers_set):
                    continue
                fqn = canonical_name(f"{prefix}.{name}" if prefix else name)
                names, _ = found.setdefault(id(t), ([], t))
                if fqn not in names:
                    names.append(fqn)
    return found


@dataclass
class LoadReport:
    tensors: int = 0
    bytes_read: int = 0
    rss_before: int = 0  # RSS when loading started (the shards are already allocated)
    peak_before: int = 0  # the RSS high-water mark before loading (since the last reset)
    peak_growth: int = 0  # peak RSS during loading minus rss_before
    end_growth: int = 0
    unexpected: List[str] = field(default_factory=list)


@torch.no_grad()
def load_rank0_and_distribute(model: nn.Module, path: str, files: Sequence[str]) -> LoadReport:
    """Fill `model`'s (possibly sharded) tensors from safetensors read by global rank 0 only.

    Every rank must call it (it communicates). The work is split so that an
    error in the checkpoint (missing key, wrong shape) is found on all ranks
    from the broadcast header plan, before any tensor moves: no rank is left
    waiting in a send that never comes.
    """
    rank = ops.rank()
    report = LoadReport(rss_before=current_rss_bytes(), peak_before=peak_rss_bytes())
    reset_peak_rss()  # VmHWM from here on is the loading phase's own peak
    header = ops.broadcast_object(read_safetensors_plan(path, files) if rank == 0 else None)
    file_of = {key: fname for fname, key, _ in header}
    # A PeftModel's base weights are the checkpoint's under other names (base_model.model. ...
    # .base_layer.); its adapter weights are not in the checkpoint (adapters.init_lora_weights fills them).
    rename = base_weight_name if is_adapter_model(model) else (lambda name: name)
    tensor_of: Dict[str, torch.Tensor] = {}
    for names, tensor in _targets(model).values():
        for name in filter(None, map(rename, names)):
            tensor_of.setdefault(name, tensor)
    # Transformers' conversion mapping groups the checkpoint's tensors into the model's (hub MoE
    # experts into fused ones); every rank plans from the same header, so all find an error together.
    try:
        plan = hf_convert.plan_load(model, {key: shape for _, key, shape in header}, tensor_of)
    except hf_convert.ConversionError as exc:
        raise ModelFolderError(f"{path!r}: {exc}") from exc
    quantized = fourbit_layers(model)  # QLoRA: checkpoint weights quantised as they are placed
    made = {name: (group, shape) for group in plan.groups for name, shape in group.outputs.items()}
    place_as: Dict[int, str] = {}  # id(tensor) -> the output that fills it
    missing, mismatched = [], []
    for names, tensor in _targets(model).values():
        names = [n for n in map(rename, names) if n is not None]
        if not names:
            continue
        name = next((n for n in names if n in made), None)
        if name is None:
            missing.append(names[0])
            continue
        shape = made[name][1]
        layer = quantized.get(id(tensor))
        expected = [layer.out_features, layer.in_features] if layer is not None else list(full_shape(tensor))
        if expected != shape:
            mismatched.append(f"{name}: checkpoint {shape} vs model {expected}")
        place_as[id(tensor)] = name
    if missing or mismatched:
        raise ModelFolderError(
            f"{path!r} does not match the architecture in its config.json: "
            + (f"missing {len(missing)} tensor(s) {missing[:8]}; " if missing else "")
            + (f"shape mismatch {mismatched[:8]}" if mismatched else "")
        )
    wanted = set(place_as.values())
    groups = [g for g in plan.groups if wanted & set(g.outputs)]
    report.unexpected = sorted(plan.unexpected + [k for g in plan.groups if g not in groups for _, k in g.sources])
    position = {key: i for i, (_, key, _) in enumerate(header)}
    groups.sort(key=lambda g: min(position[k] for _, k in g.sources))  # file by file: sequential reads
    last_use = {file_of[k]: i for i, g in enumerate(groups) for _, k in g.sources}
    base, scratch = hf_convert.pretrained_model(model), _Scratch()
    with SafetensorsReader(path, file_of) if rank == 0 else contextlib.nullcontext() as reader:
        for i, group in enumerate(groups):
            outputs = hf_convert.convert_group(group, reader.read, base) if rank == 0 else {}
            for name in group.outputs:
                if name not in wanted:
                    continue
                tensor, full = tensor_of[name], outputs.pop(name, None)
                if id(tensor) in quantized:  # quantised on rank 0; the packed codes travel like any weight
                    place_4bit(tensor, full, quantized[id(tensor)], lambda t, f: _place(t, f, rank, scratch))
                else:
                    _place(tensor, full, rank, scratch)
                del full
                report.tensors += 1
            del outputs
            if reader is not None:
                reader.close_unused(i, last_use)
                report.bytes_read = reader.bytes_read
    if base is not None:
        base._weight_conversions = plan.used  # what save_pretrained (and our export) reverts, as transformers keeps it
    report.peak_growth = peak_rss_bytes() - report.rss_before
    report.end_growth = current_rss_bytes() - report.rss_before
    if report.unexpected and rank == 0:
        warnings.warn(
            f"{len(report.unexpected)} checkpoint tensor(s) not used by the model: {report.unexpected[:8]}",
            stacklevel=2,
        )
    return report


# A slice travels in pieces of at most this many bytes, so a receiving rank's
# scratch space is bounded however large one tensor (a 128k-token embedding) is.
# Pieces travel on ops.collective_device(), not where the shard lives: under
# cpu_offload the shards are CPU tensors while the group may be NCCL's.
CHUNK_BYTES = 16 * 2**20


def _row_chunks(shape: Sequence[int], element_size: int) -> List[slice]:
    rows = shape[0] if shape else 1
    row_bytes = max(1, element_size * (int(torch.Size(shape[1:]).numel()) if len(shape) > 1 else 1))
    step = max(1, CHUNK_BYTES // row_bytes)
    return [slice(i, min(i + step, rows)) for i in range(0, rows, step)]


class _Scratch:
    """One reusable receive buffer per (dtype, device): fresh buffers per piece would
    pile up in the allocator's heap and show as RSS growth."""

    def __init__(self) -> None:
        self.buffers: Dict[Tuple[torch.dtype, torch.device], torch.Tensor] = {}

    def get(self, shape: Sequence[int], dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        n = int(torch.Size(shape).numel())
        buf = self.buffers.get((dtype, device))
        if buf is None or buf.numel() < n:
            elements = max(n, CHUNK_BYTES // torch.empty((), dtype=dtype).element_size())
            buf = self.buffers[(dtype, device)] = torch.empty(elements, dtype=dtype, device=device)
        return buf[:n].view(list(shape))


def _place(tensor: torch.Tensor, full: Optional[torch.Tensor], rank: int, scratch: _Scratch) -> None:
    """Rank 0 holds `full`; every rank ends with its own part of it in `tensor`.

    For a DTensor, rank 0 sends slices only to the first replica (mesh
    coordinate 0 on every Replicate dimension); each slice then spreads over
    its replicate group by broadcast. Under HYBRID_SHARD on N nodes, rank 0
    sends the model once instead of N times, and the cross-node copies travel
    from every rank of node 0 in parallel.

    A ZeRO-3 parameter (partitioned by deepspeed.zero.Init) is filled the
    same way, without gathering it: its partition on the i-th rank of its
    group is elements [i * n, (i + 1) * n) of the flattened tensor (n =
    `ds_tensor.numel()`, the last partition zero-padded), so rank 0 sends each
    rank exactly its range, in pieces of at most CHUNK_BYTES. Gathering
    instead (`GatheredParameters(modifier_rank=0)`) would put the whole
    parameter on every rank (twice over with gloo's all-gather), which for a
    large vocabulary is the biggest tensor in the model.

    Under dp x tp every parameter is a 2-D DTensor (tensor_parallel.py keeps even the layers it
    leaves whole on the tp mesh), and shard_slices follows FSDP2's strided dp-over-tp layout.
    """
    if is_zero3_param(tensor):
        _place_zero3(tensor, full, scratch)
        return
    if isinstance(tensor, DTensor):
        local = tensor._local_tensor
        mesh, placements = tensor.device_mesh, tensor.placements
        replicated = [d for d, p in enumerate(placements) if isinstance(p, Replicate)]
        coord = mesh_coordinate(mesh, rank)
        shape = [s.stop - s.start for s in shard_slices(tensor.shape, mesh.shape, coord, placements)]
        if rank == 0:
            full = full.to(dtype=local.dtype)
            for dst in mesh.mesh.flatten().tolist():
                dst_coord = mesh_coordinate(mesh, dst)
                if any(dst_coord[d] != 0 for d in replicated):
                    continue
                part = full[shard_slices(tensor.shape, mesh.shape, dst_coord, placements)]
                if part.numel() == 0:
                    continue
                if dst == 0:
                    local.copy_(part.reshape(local.shape))
                    continue
                for rows in _row_chunks(part.shape, part.element_size()):
                    dist.send(part[rows].contiguous().to(ops.collective_device()), dst=dst)
        if 0 in shape:
            return
        view = local.view(shape)
        if rank != 0 and all(coord[d] == 0 for d in replicated):
            for rows in _row_chunks(shape, local.element_size()):
                # Received into a small scratch piece, then copied: copy_ also marks
                # the tensor as written for the strategy's initialisation check.
                piece = scratch.get([rows.stop - rows.start, *shape[1:]], local.dtype, ops.collective_device())
                dist.recv(piece, src=0)
                view[rows].copy_(piece)
        for d in replicated:
            # After the broadcasts along earlier replicated dims, the member
            # with coordinate 0 on this one holds the right values.
            src_coord = list(coord)
            src_coord[d] = 0
            src = int(mesh.mesh[tuple(src_coord)])
            group = mesh.get_group(d)
            for rows in _row_chunks(shape, local.element_size()):
                if rank == src:
                    dist.broadcast(view[rows].to(ops.collective_device()), src=src, group=group)
                else:
                    piece = scratch.get([rows.stop - rows.start, *shape[1:]], local.dtype, ops.collective_device())
                    dist.broadcast(piece, src=src, group=group)
                    view[rows].copy_(piece)
        return
    # A plain tensor is replicated (DDP, single device, buffers under FSDP).
    if rank == 0:
        tensor.copy_(full.to(dtype=tensor.dtype))
    if ops.world_size() > 1:
        device = ops.collective_device()
        buf = (
            tensor.contiguous().to(device)
            if rank == 0
            else torch.empty(tensor.shape, dtype=tensor.dtype, device=device)
        )
        dist.broadcast(buf, src=0)
        if rank != 0:
            tensor.copy_(buf)


def _place_zero3(param: torch.Tensor, full: Optional[torch.Tensor], scratch: _Scratch) -> None:
    """Write this rank's ZeRO-3 partition of `full` (held by global rank 0) into `param.ds_tensor`."""
    part = param.ds_tensor.data.view(-1)
    n, numel = part.numel(), int(param.ds_numel)
    group = getattr(param, "ds_process_group", None)
    members = (
        [dist.get_global_rank(group, i) for i in range(dist.get_world_size(group))] if ops.world_size() > 1 else [0]
    )
    step = max(1, CHUNK_BYTES // part.element_size())
    rank = ops.rank()
    if len(members) != ops.world_size():
        # Partitioned over a subgroup (MiCS, hierarchical partitioning): every
        # group needs its own copy, so let DeepSpeed gather and re-partition.
        import deepspeed

        with deepspeed.zero.GatheredParameters([param], modifier_rank=0):
            if rank == 0:
                param.data.copy_(full.to(dtype=param.dtype).view(param.data.shape))
        return

    def bounds(index: int) -> Tuple[int, int]:  # the flat range the index-th member holds (unpadded)
        return index * n, min((index + 1) * n, numel)

    if rank == 0:
        flat = full.to(dtype=part.dtype).reshape(-1)
        for index, dst in enumerate(members):
            lo, hi = bounds(index)
            if dst == 0:
                part[: max(0, hi - lo)].copy_(flat[lo:hi])
                continue
            for start in range(lo, hi, step):
                dist.send(flat[start : min(start + step, hi)].contiguous().to(ops.collective_device()), dst=dst)
        return
    lo, hi = bounds(members.index(rank))
    for start in range(lo, hi, step):
        stop = min(start + step, hi)
        piece = scratch.get([stop - start], part.dtype, ops.collective_device())
        dist.recv(piece, src=0)
        part[start - lo : stop - lo].copy_(piece)


# ------------------------------------------------------------------ export
def export_items(model: nn.Module, config: Any) -> List[Tuple[str, torch.Tensor]]:
    """(name, tensor) pairs to save, one name per tensor, tied copies left out as save_pretrained does."""
    tied = set()
    if getattr(config, "tie_word_embeddings", False):
        tied_keys = getattr(model, "_tied_weights_keys", None) or {}
        tied = set(tied_keys.keys() if isinstance(tied_keys, dict) else tied_keys)
    items = []
    for names, tensor in _targets(model).values():
        keep = [n for n in names if n not in tied] or names
        items.append((keep[0], tensor))
    return items


@contextlib.contextmanager
def gathered(tensor: torch.Tensor) -> Iterator[torch.Tensor]:
    """The full tensor while the block runs (a collective for sharded tensors: every rank, same order).

    A DTensor is all-gathered into a new tensor (on the collective device,
    then back where its shard lives: CPU under cpu_offload); a ZeRO-3 parameter is
    gathered in place by DeepSpeed and re-partitioned when the block ends, so
    the value must be copied before then; a plain tensor is itself.
    """
    if isinstance(tensor, DTensor):
        yield ops.full_tensor(tensor)
    elif is_zero3_param(tensor):
        import deepspeed

        with deepspeed.zero.GatheredParameters([tensor], modifier_rank=None):
            yield tensor.data
    else:
        yield tensor


@torch.no_grad()
def export_hf_folder(
    model: nn.Module,
    out_dir: str,
    *,
    config: Any,
    tokenizer: Any = None,
    source_dir: Optional[str] = None,
    max_shard_size: int = 5 * 2**30,
    dtype: Optional[torch.dtype] = None,
    tensors: Optional[Sequence[Tuple[str, Any]]] = None,
) -> Optional[str]:
    """Write a Hugging Face folder from a (sharded) model; every rank calls it, rank 0 writes.

    One tensor is all-gathered at a time; rank 0 keeps the current shard
    (at most `max_shard_size` bytes) and writes it before starting the next.
    `tensors`: (key, tensor or function returning a context that yields the full
    tensor) pairs to write instead of `export_items(model, config)` -- the LoRA
    merge (recipes/lora_export.py); every rank enters them in the same order.
    Returns out_dir on rank 0, None elsewhere.
    """
    rank = ops.rank()
    items = export_items(model, config) if tensors is None else tensors
    # save_pretrained's reverse conversion mapping: fused MoE experts are written per expert, as on the hub.
    groups, renamings = hf_convert.export_groups(model, [name for name, _ in items])
    source_of, base = dict(items), hf_convert.pretrained_model(model)
    writer = ShardWriter(out_dir, max_shard_size) if rank == 0 else None
    first_dtype = None
    for group in groups:
        values: Dict[str, torch.Tensor] = {}
        for name, _ in group.members:
            # A tensor of the model, or (lora_export.py) a function giving a context that yields the full tensor.
            source = source_of[name]
            own = isinstance(source, torch.Tensor)
            with gathered(source) if own else source() as full:  # a collective: every rank, same order
                if writer is not None:
                    value = full.detach().to("cpu", dtype=dtype or full.dtype).contiguous()
                    if value.data_ptr() == full.data_ptr() and not (own and isinstance(source, DTensor)):
                        value = value.clone()  # never alias a live (or soon re-partitioned) tensor
                    values[name] = value
                    first_dtype = first_dtype or (full.dtype if full.is_floating_point() else None)
                del full
        if writer is not None:
            for hub_name, value in hf_convert.revert_group(group, values, renamings, base).items():
                writer.add(hub_name, value)
    if writer is None:
        ops.barrier()
        return None
    writer.close()
    write_model_files(out_dir, config, dtype or first_dtype, source_dir, tokenizer)
    ops.barrier()
    return out_dir


def write_model_files(
    out_dir: str, config: Any, dtype: Optional[torch.dtype], source_dir: Optional[str] = None, tokenizer: Any = None
) -> List[str]:
    """What `from_pretrained` needs beside the weights: config.json (its dtype the weights' `dtype`),
    and from `source_dir` generation_config.json and the tokenizer files (or `tokenizer`, saved).
    The recipe's export and `shardwise convert` of a recipe checkpoint (recipes/convert.py)
    both write them here. Returns the files written."""
    config = copy.deepcopy(config)
    if dtype is not None:
        config.dtype = dtype
    config.save_pretrained(out_dir)
    copied = [os.path.join(out_dir, "config.json")]
    names = ["generation_config.json"] + ([] if tokenizer is not None else list(TOKENIZER_FILES))
    for fname in names if source_dir else []:
        if os.path.exists(os.path.join(source_dir, fname)):
            shutil.copy2(os.path.join(source_dir, fname), out_dir)
            copied.append(os.path.join(out_dir, fname))
    if tokenizer is not None:
        copied += [p for p in tokenizer.save_pretrained(out_dir) if os.path.exists(p)]
    return copied

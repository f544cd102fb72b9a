"""`shardwise convert CKPT OUT`: any shardwise checkpoint -> consolidated weights.

The output is what the rest of the ecosystem loads: a folder in Hugging
Face's layout (`model.safetensors`, split into shards with an index when
larger than --max-shard-size; hf_shards.py), or, when OUT ends in
`.safetensors` / `.pt` / `.pth` / `.bin`, that one file. --format torch writes
torch files instead of safetensors.

An adapter checkpoint (LoRA: the trainable weights only, checkpoint/adapters.py)
becomes a PEFT adapter folder (`adapter_config.json` +
`adapter_model.safetensors`, what `peft.PeftModel.from_pretrained` loads), or,
given `base_model` (the base's Hugging Face folder), the base with the adapter
merged in by PEFT, as a Hugging Face folder. A file OUT still gets its raw tensors.

A full checkpoint of the fine-tuning recipe (`shardwise finetune`) becomes the
Hugging Face folder the recipe's own export writes: names without the recipe
module's `model.` prefix, tied copies left out, config.json, generation config
and tokenizer files from the base model folder the checkpoint records (or
`base_model`, which wins; checkpoint/recipe_folder.py). A file OUT gets all
its tensors, prefix removed.

Tensors are read from the checkpoint one at a time (reader.py; small ones a
few together) and cast on their own, so a folder's peak memory is about one
shard plus one tensor. A single file has to be held whole before it is
written, so it is refused up front when the host cannot hold it.
"""

from __future__ import annotations

import json
import os
import tempfile
from typing import Dict, Iterator, List, Optional, Tuple

import torch

from shardwise.checkpoint import adapters, recipe_folder
from shardwise.checkpoint.formats import available_host_bytes
from shardwise.checkpoint.hf_shards import ShardWriter, save_durably
from shardwise.checkpoint.reader import CheckpointReader, TensorInfo, open_checkpoint
from shardwise.dtypes import cast_dtype
from shardwise.memory import parse_bytes


def _cast_dtype(info: TensorInfo, dtype: Optional[torch.dtype]) -> torch.dtype:
    return dtype if dtype is not None and info.dtype.is_floating_point else info.dtype


def _out_info(info: TensorInfo, dtype: Optional[torch.dtype]) -> TensorInfo:
    return TensorInfo(info.name, info.shape, _cast_dtype(info, dtype))


def _groups(infos: List[TensorInfo], budget: int) -> List[List[TensorInfo]]:
    """Consecutive tensors grouped so that each read holds about `budget` bytes (a large one alone)."""
    groups: List[List[TensorInfo]] = [[]]
    size = 0
    for info in infos:
        if groups[-1] and size + info.nbytes > budget:
            groups.append([])
            size = 0
        groups[-1].append(info)
        size += info.nbytes
    return groups


def read_cast(
    reader: CheckpointReader, infos: List[TensorInfo], dtype: Optional[torch.dtype], read_budget: int = 0
) -> Iterator[Tuple[str, torch.Tensor]]:
    """(name, tensor) for every tensor of `infos`, in order, floating ones cast to `dtype`."""
    for group in _groups(infos, read_budget):
        tensors = reader.read([i.name for i in group])
        for info in group:
            yield info.name, tensors.pop(info.name).to(_cast_dtype(info, dtype)).contiguous()


def write_safetensors(
    path: str,
    reader: CheckpointReader,
    infos: List[TensorInfo],
    dtype: Optional[torch.dtype],
    metadata: Optional[Dict[str, str]] = None,
    read_budget: int = 0,
) -> int:
    """Write `infos` from `reader` into one safetensors file; returns the bytes of tensor data written."""
    tensors = dict(read_cast(reader, infos, dtype, read_budget))
    save_durably("safetensors", tensors, path, metadata)
    return sum(t.numel() * t.element_size() for t in tensors.values())


def _adapter_outputs(
    reader: CheckpointReader,
    infos: List[TensorInfo],
    adapter: Dict,
    out: str,
    cast: Optional[torch.dtype],
    max_shard_size: str,
    base_model: Optional[str],
    quiet: bool,
) -> List[str]:
    """An adapter checkpoint as a PEFT adapter folder, or merged into `base_model` (adapters.py)."""
    tensors = dict(read_cast(reader, infos, None if base_model else cast))  # adapters are small
    if base_model is None:
        written = adapters.write_adapter_folder(tensors, adapter, out)
    else:
        with tempfile.TemporaryDirectory(prefix="shardwise-adapter-") as tmp:
            adapters.write_adapter_folder(tensors, adapter, tmp)
            written = adapters.merge_into_base(base_model, tmp, out, cast, max_shard_size)
    if not quiet:
        kind = f"merged into {base_model}" if base_model else "a PEFT adapter folder"
        print(f"converted {reader.path} (adapter checkpoint, step {reader.manifest.get('global_step')}) -> {kind}:")
        for path in written:
            print(f"  {path}")
    return written


def convert(
    ckpt: str,
    out: str,
    dtype: str = "keep",
    max_shard_size: str = "5GB",
    fmt: Optional[str] = None,
    quiet: bool = False,
    base_model: Optional[str] = None,
) -> List[str]:
    """Write the model weights of checkpoint `ckpt` to `out`; returns the files written.

    `base_model`: for an adapter checkpoint, the base model's folder: `out` becomes the merged model;
    for a full checkpoint of the fine-tuning recipe, the folder it fine-tuned: its config and tokenizer
    files go beside the weights, so `from_pretrained(out)` loads them."""
    cast = cast_dtype(dtype)
    reader = open_checkpoint(ckpt)
    infos = reader.tensors()
    max_bytes = parse_bytes(max_shard_size)
    suffix = os.path.splitext(out)[1].lower()
    single_file = suffix in (".safetensors", ".pt", ".pth", ".bin")
    adapter = reader.manifest.get(adapters.ADAPTER_KEY)
    state = reader.trainer_state()  # read once (a sharded checkpoint reads and verifies a file for it)
    recipe = not adapter and recipe_folder.is_recipe_checkpoint(state, infos)
    if base_model is not None and (not (adapter or recipe) or single_file):
        raise ValueError(
            "--base_model merges an adapter checkpoint into its base, or gives a fine-tuning recipe "
            "checkpoint its config, written as a folder: "
            + (f"give a folder as OUT, not {out!r}." if adapter or recipe else f"{reader.path} is neither.")
        )
    if adapter and not single_file:
        return _adapter_outputs(reader, infos, adapter, out, cast, max_shard_size, base_model, quiet)
    fmt = fmt or ("torch" if suffix in (".pt", ".pth", ".bin") else "safetensors")
    if fmt not in ("safetensors", "torch"):
        raise ValueError(f"--format {fmt!r}: use safetensors or torch.")
    names = {i.name: i.name for i in infos}  # checkpoint name -> name written
    config = None
    if recipe and single_file:
        names = {i.name: i.name[len(recipe_folder.PREFIX) :] for i in infos}
    elif recipe:  # refused before anything is written when the folder could not load
        base_model, config = recipe_folder.base_config(state, reader.path, base_model)
        kept = recipe_folder.hf_names(infos, config, base_model)
        infos, names = [i for i, _ in kept], {i.name: name for i, name in kept}
    total_bytes = sum(_out_info(i, cast).nbytes for i in infos)
    # Small tensors are read in groups (one DCP request each costs a few ms),
    # never more bytes at once than the largest tensor or 4 MiB.
    budget = max(max((i.nbytes for i in infos), default=0), 4 * 2**20)
    meta = {"shardwise_step": str(reader.manifest.get("global_step", "")), "shardwise_format": reader.format}
    written: List[str] = []
    if single_file:
        available = available_host_bytes()
        if available is not None and total_bytes > available:
            raise ValueError(
                f"one file of {total_bytes / 2**30:.1f} GiB must be held in memory to be written, and "
                f"this host has {available / 2**30:.1f} GiB available: give a folder as OUT (shards of "
                "--max-shard-size, one at a time)."
            )
        os.makedirs(os.path.dirname(os.path.abspath(out)), exist_ok=True)
        save_durably(fmt, {names[n]: t for n, t in read_cast(reader, infos, cast, budget)}, out, meta)
        written.append(out)
    else:
        writer = ShardWriter(out, max_bytes, fmt, meta)
        for name, tensor in read_cast(reader, infos, cast, budget):
            writer.add(names[name], tensor)
        written += writer.close()
        if config is not None:
            from shardwise.recipes.hf_model import write_model_files

            floating = next((i.dtype for i in infos if i.dtype.is_floating_point), None)
            written += write_model_files(out, config, cast or floating, source_dir=base_model)
        hparams = state.get("hyper_parameters") or {}
        if hparams:
            try:
                text = json.dumps(hparams, indent=2, default=str)
                with open(os.path.join(out, "hparams.json"), "w") as fh:
                    fh.write(text)
                written.append(os.path.join(out, "hparams.json"))
            except (TypeError, ValueError):
                pass
    if not quiet:
        kind = f"{reader.format}, fine-tuning recipe" if recipe else reader.format
        print(
            f"converted {reader.path} ({kind}, step {reader.manifest.get('global_step')}) -> "
            f"{len(infos)} tensors, {total_bytes / 1e6:.1f} MB:"
        )
        for path in written:
            print(f"  {path}")
    return written

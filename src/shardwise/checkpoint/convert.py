"""`shardwise convert CKPT OUT`: any shardwise checkpoint -> consolidated weights.

The output is what the rest of the ecosystem loads: `model.safetensors`
(split into `model-0000i-of-0000n.safetensors` + `model.safetensors.index.json`
when larger than --max-shard-size, Hugging Face's layout), or a torch file
with --format torch. OUT ending in `.safetensors` / `.pt` / `.pth` / `.bin`
is written as that single file; anything else is a directory.

Safetensors output streams: the format is an 8-byte header length, a JSON
header with every tensor's dtype, shape and byte range, then the raw bytes.
All shapes are known from the checkpoint's metadata before any tensor is
read, so the header is written first and each tensor is then read, cast and
appended on its own (reader.py reads one tensor at a time from a full file or
a sharded directory). Peak memory stays near the largest tensor. The torch
format cannot be appended to, so it holds one output shard at a time.
"""
from __future__ import annotations

import argparse
import json
import os
import struct
import sys
from typing import Dict, List, Optional, Sequence

import torch

from shardwise.checkpoint.reader import CheckpointReader, TensorInfo, open_checkpoint
from shardwise.memory import parse_bytes

DTYPES = {"keep": None, "fp32": torch.float32, "float32": torch.float32, "bf16": torch.bfloat16,
          "bfloat16": torch.bfloat16, "fp16": torch.float16, "float16": torch.float16}
_SAFETENSORS_DTYPE = {
    torch.float64: "F64", torch.float32: "F32", torch.float16: "F16", torch.bfloat16: "BF16",
    torch.int64: "I64", torch.int32: "I32", torch.int16: "I16", torch.int8: "I8", torch.uint8: "U8",
    torch.bool: "BOOL", torch.uint16: "U16", torch.uint32: "U32", torch.uint64: "U64",
    torch.float8_e4m3fn: "F8_E4M3", torch.float8_e5m2: "F8_E5M2", torch.complex64: "C64",
}


def _cast_dtype(info: TensorInfo, dtype: Optional[torch.dtype]) -> torch.dtype:
    return dtype if dtype is not None and info.dtype.is_floating_point else info.dtype


def _out_info(info: TensorInfo, dtype: Optional[torch.dtype]) -> TensorInfo:
    return TensorInfo(info.name, info.shape, _cast_dtype(info, dtype))


def plan_shards(infos: List[TensorInfo], max_bytes: int) -> List[List[TensorInfo]]:
    """Greedy split in checkpoint order; a tensor larger than max_bytes gets a shard of its own."""
    shards: List[List[TensorInfo]] = [[]]
    size = 0
    for info in infos:
        if shards[-1] and size + info.nbytes > max_bytes:
            shards.append([])
            size = 0
        shards[-1].append(info)
        size += info.nbytes
    return shards


def _batches(infos: List[TensorInfo], budget: int) -> List[List[TensorInfo]]:
    """Group consecutive tensors so that each read holds about `budget` bytes (small tensors together)."""
    return plan_shards(infos, budget)


def write_safetensors(path: str, reader: CheckpointReader, infos: List[TensorInfo],
                      dtype: Optional[torch.dtype], metadata: Optional[Dict[str, str]] = None,
                      read_budget: int = 0) -> int:
    """Stream `infos` from `reader` into one safetensors file; returns the bytes of tensor data written."""
    header: Dict[str, object] = {"__metadata__": {"format": "pt", **(metadata or {})}}
    offset = 0
    for info in infos:
        out = _out_info(info, dtype)
        if out.dtype not in _SAFETENSORS_DTYPE:
            raise ValueError(f"{info.name}: dtype {out.dtype} has no safetensors equivalent; use --format torch.")
        header[info.name] = {"dtype": _SAFETENSORS_DTYPE[out.dtype], "shape": list(info.shape),
                             "data_offsets": [offset, offset + out.nbytes]}
        offset += out.nbytes
    encoded = json.dumps(header, separators=(",", ":")).encode()
    encoded += b" " * (-len(encoded) % 8)  # the data section starts 8-byte aligned
    tmp = path + ".partial"
    with open(tmp, "wb") as fh:
        fh.write(struct.pack("<Q", len(encoded)))
        fh.write(encoded)
        for group in _batches(infos, read_budget):
            tensors = reader.read([i.name for i in group])
            for info in group:
                tensor = tensors.pop(info.name)
                tensor = tensor.to(_cast_dtype(info, dtype)).contiguous()
                if tensor.numel():
                    fh.write(tensor.reshape(-1).view(torch.uint8).numpy().data)
                del tensor
        fh.flush()
        os.fsync(fh.fileno())
    os.replace(tmp, path)
    return offset


def write_torch(path: str, reader: CheckpointReader, infos: List[TensorInfo], dtype: Optional[torch.dtype]) -> int:
    tensors = reader.read([i.name for i in infos])
    state = {i.name: tensors.pop(i.name).to(_cast_dtype(i, dtype)).contiguous() for i in infos}
    total = sum(t.numel() * t.element_size() for t in state.values())
    tmp = path + ".partial"
    torch.save(state, tmp)
    os.replace(tmp, path)
    return total


def convert(ckpt: str, out: str, dtype: str = "keep", max_shard_size: str = "5GB", fmt: Optional[str] = None,
            quiet: bool = False) -> List[str]:
    """Write the model weights of checkpoint `ckpt` to `out`; returns the files written."""
    if dtype not in DTYPES:
        raise ValueError(f"--dtype {dtype!r}: use one of {', '.join(DTYPES)}.")
    cast = DTYPES[dtype]
    reader = open_checkpoint(ckpt)
    infos = reader.tensors()
    max_bytes = parse_bytes(max_shard_size)
    suffix = os.path.splitext(out)[1].lower()
    single_file = suffix in (".safetensors", ".pt", ".pth", ".bin")
    fmt = fmt or ("torch" if suffix in (".pt", ".pth", ".bin") else "safetensors")
    if fmt not in ("safetensors", "torch"):
        raise ValueError(f"--format {fmt!r}: use safetensors or torch.")
    largest = max((i.nbytes for i in infos), default=0)
    # Small tensors are read in groups (one DCP request each costs a few ms),
    # never more bytes at once than the largest tensor or 4 MiB.
    budget = max(largest, 4 * 2**20)
    meta = {"shardwise_step": str(reader.manifest.get("global_step", "")),
            "shardwise_format": reader.format}
    written: List[str] = []
    if single_file:
        os.makedirs(os.path.dirname(os.path.abspath(out)), exist_ok=True)
        if fmt == "safetensors":
            write_safetensors(out, reader, infos, cast, meta, budget)
        else:
            write_torch(out, reader, infos, cast)
        written.append(out)
    else:
        os.makedirs(out, exist_ok=True)
        shards = plan_shards([_out_info(i, cast) for i in infos], max_bytes)
        by_name = {i.name: i for i in infos}
        base, ext = ("model", ".safetensors") if fmt == "safetensors" else ("pytorch_model", ".bin")
        weight_map: Dict[str, str] = {}
        total = 0
        for index, shard in enumerate(shards, start=1):
            name = f"{base}{ext}" if len(shards) == 1 else f"{base}-{index:05d}-of-{len(shards):05d}{ext}"
            target = os.path.join(out, name)
            originals = [by_name[i.name] for i in shard]
            if fmt == "safetensors":
                total += write_safetensors(target, reader, originals, cast, meta, budget)
            else:
                total += write_torch(target, reader, originals, cast)
            weight_map.update({i.name: name for i in shard})
            written.append(target)
        if len(shards) > 1:
            index_path = os.path.join(out, f"{base}{ext}.index.json")
            with open(index_path, "w") as fh:
                json.dump({"metadata": {"total_size": total}, "weight_map": weight_map}, fh, indent=2)
            written.append(index_path)
        hparams = reader.trainer_state().get("hyper_parameters") or {}
        if hparams:
            try:
                text = json.dumps(hparams, indent=2, default=str)
                with open(os.path.join(out, "hparams.json"), "w") as fh:
                    fh.write(text)
                written.append(os.path.join(out, "hparams.json"))
            except (TypeError, ValueError):
                pass
    if not quiet:
        total_bytes = sum(_out_info(i, cast).nbytes for i in infos)
        print(f"converted {reader.path} ({reader.format}, step {reader.manifest.get('global_step')}) -> "
              f"{len(infos)} tensors, {total_bytes / 1e6:.1f} MB:")
        for path in written:
            print(f"  {path}")
    return written


def main(argv: Optional[Sequence[str]] = None) -> int:
    # argparse rather than jsonargparse: the documented flags are dashed
    # (--max-shard-size), which jsonargparse's function CLI cannot spell.
    parser = argparse.ArgumentParser(prog="shardwise convert", description=__doc__.split("\n\n")[0])
    parser.add_argument("ckpt", help="a checkpoint (file or directory), or a checkpoint directory (uses its last)")
    parser.add_argument("out", help="output directory, or a .safetensors / .pt / .bin file")
    parser.add_argument("--dtype", default="keep", choices=sorted(DTYPES), help="cast floating tensors")
    parser.add_argument("--max-shard-size", "--max_shard_size", default="5GB",
                        help="split larger outputs into shards with an index (directory output only)")
    parser.add_argument("--format", dest="fmt", choices=("safetensors", "torch"), default=None,
                        help="output format (default: from OUT's suffix, else safetensors)")
    args = parser.parse_args(list(sys.argv[1:] if argv is None else argv))
    from shardwise.checkpoint.errors import CheckpointError

    try:
        convert(args.ckpt, args.out, dtype=args.dtype, max_shard_size=args.max_shard_size, fmt=args.fmt)
    except (CheckpointError, ValueError) as exc:
        print(f"shardwise convert: {exc}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())

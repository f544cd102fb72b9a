"""`shardwise convert CKPT OUT`: a checkpoint's model weights as safetensors or one torch file.

Reads any checkpoint shardwise wrote (full, sharded, DeepSpeed), one tensor at a
time, so a model larger than host memory converts into a folder of shards. An
adapter (LoRA) checkpoint becomes a PEFT adapter folder, or with --base_model
the base model with the adapter merged in. A full checkpoint of the fine-tuning
recipe becomes a Hugging Face folder that from_pretrained loads, its config and
tokenizer files taken from the base model folder the checkpoint records (or
--base_model, when it has moved).
"""

from __future__ import annotations

from typing import Any, Literal, Optional

from jsonargparse import ArgumentParser

from shardwise.dtypes import CAST_CHOICES


def parser() -> ArgumentParser:
    p = ArgumentParser(description="Write a checkpoint's model weights as safetensors or one torch file.")
    p.add_argument("ckpt", help="a checkpoint (file or directory), or a checkpoint directory (uses its last)")
    p.add_argument("out", help="output directory, or a .safetensors / .pt / .bin file")
    p.add_argument("--dtype", type=str, default="keep", choices=CAST_CHOICES, help="cast floating tensors")
    p.add_argument(
        "--max_shard_size",
        type=str,
        default="5GB",
        help="split larger outputs into shards with an index (directory output only)",
    )
    p.add_argument(
        "--format",
        type=Optional[Literal["safetensors", "torch"]],
        default=None,
        help="output format (default: from OUT's suffix, else safetensors)",
    )
    p.add_argument(
        "--base_model",
        type=Optional[str],
        default=None,
        help=(
            "the base model's Hugging Face folder: for an adapter checkpoint OUT becomes the merged model; for a "
            "fine-tuning recipe checkpoint its config and tokenizer files go beside the weights (default: the folder "
            "the checkpoint records)"
        ),
    )
    return p


def run(cfg: Any) -> int:
    from shardwise.recipes.convert import convert

    convert(
        cfg.ckpt, cfg.out, dtype=cfg.dtype, max_shard_size=cfg.max_shard_size, fmt=cfg.format, base_model=cfg.base_model
    )
    return 0

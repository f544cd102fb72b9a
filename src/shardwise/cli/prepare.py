"""`shardwise prepare`: tokenise corpora once, with all cores, into memory-mapped token shards.

    shardwise prepare web.jsonl books.parquet --out corpora/web --tokenizer meta-llama/Llama-3.1-8B
    shardwise prepare hf:allenai/c4:validation --out corpora/c4 --tokenizer ./tok --num_proc 16

Inputs are JSON lines (`--text_key`, default "text"), text files with one
document per line, Parquet, a folder written by datasets' save_to_disk, or
`hf:NAME[:SPLIT]`. Run again with the same arguments after an interruption:
finished chunks are kept and the rest is tokenised (shardwise.corpus.prepare).
"""

from __future__ import annotations

from typing import Any, Optional

from jsonargparse import ActionConfigFile, ArgumentParser


def parser() -> ArgumentParser:
    p = ArgumentParser(description="Tokenise corpora into memory-mapped token shards (resumable).")
    p.add_argument("--config", action=ActionConfigFile, help="YAML file with any of the options below")
    p.add_argument("inputs", type=str, nargs="+", help="jsonl / txt / parquet files, datasets folders, hf:NAME")
    p.add_argument("--out", type=str, required=True, help="the corpus folder (shards, index.json)")
    p.add_argument("--tokenizer", type=str, required=True, help="a Hugging Face tokenizer: a folder or a hub name")
    p.add_argument("--text_key", type=str, default="text", help="the text field of a record")
    p.add_argument("--num_proc", type=Optional[int], default=None, help="worker processes (default: every core)")
    p.add_argument("--chunk_mb", type=int, default=64, help="MiB of a text input per chunk (the unit of resuming)")
    p.add_argument("--append_eos", type=bool, default=True, help="end every document with the EOS token")
    return p


def run(cfg: Any) -> int:
    from shardwise.corpus import prepare

    index = prepare(
        list(cfg.inputs),
        cfg.out,
        cfg.tokenizer,
        text_key=cfg.text_key,
        num_proc=cfg.num_proc,
        chunk_bytes=cfg.chunk_mb * 2**20,
        append_eos=cfg.append_eos,
    )
    print(
        f"{cfg.out}: {index['tokens']:,} tokens in {index['documents']:,} documents, "
        f"{len(index['shards'])} shards of {index['dtype']}"
    )
    return 0

"""The fine-tuning recipe's tokenised-data cache, built through the corpus pipeline's workers.

Records go through corpus/prepare.py's pool (`encode_chunks`: forked workers,
one chunk of the input at a time, streamed in batches to disk, so memory does
not grow with the data set): each record becomes one document of token ids in
the smallest dtype that holds the vocabulary, an empty one included so that
document i is record i, and with assistant-only or completion-only loss one
mask byte per token. What the splits are is then a few integers per document:
the documents of each split in training order (`<split>.docs.npy`, the held-out
records drawn as datasets' `train_test_split` draws them) and, packed, their
running token count (`<split>.cum.npy`). Labels and position ids are not
stored: packing.py derives them from the tokens, the mask and the document
boundaries when an item is read. The loss-token counts of the summary are
taken from the masks one shard at a time. The build writes `<entry>.partial`
and renames it into place; an interrupted build continues from the chunks it
finished. data.py decides what is built (the encoder, the sources) and who
builds it; this module builds.
"""

from __future__ import annotations

import json
import os
import shutil
from typing import Any, Callable, Dict, List, Optional, Tuple

import numpy as np

from shardwise.corpus.prepare import (
    FORMAT_VERSION,
    INDEX,
    PLAN,
    Chunk,
    Encoder,
    encode_chunks,
    plan_chunks,
    register_rows,
    rows_of,
    token_dtype,
)
from shardwise.recipes import data_formats

MAX_CHUNK_BYTES = 16 * 2**20  # a worker's unit of work: its shard's mask counts are read whole
MIN_CHUNK_BYTES = 2**20


def is_json_lines(path: str) -> bool:
    """A .jsonl, or a .json holding one object per line (not one array): read by byte ranges, no copy."""
    lower = path.lower()
    if lower.endswith(".jsonl"):
        return True
    if not lower.endswith(".json"):
        return False
    with open(path, "rb") as fh:
        head = fh.read(4096).lstrip()
    return head[:1] == b"{"


def record_sources(
    path: str, split: Optional[str], eval_split: Optional[str], hf_cache: str, name: str
) -> Tuple[str, Optional[str], List[str], Any]:
    """(train input, eval input or None, the record fields, the first record) for plan_chunks.

    JSON lines and Parquet files are read where they are (byte ranges, row groups); anything else (CSV, a JSON
    array, a compressed file, a hub-style folder, a save_to_disk folder) through datasets, as row slices."""
    kind = data_formats.source_kind(path)
    data_formats.pick_splits(path, split, eval_split)  # a split named that a single file has not is refused here
    if (kind == "json" and is_json_lines(path)) or kind == "parquet":
        return path, None, data_formats.columns(path), data_formats.first_record(path)
    train, evaluation = data_formats.load_splits(path, hf_cache, split, eval_split)
    first = train[0] if len(train) else {}
    sources = register_rows(f"{name}-train", train), None
    if evaluation is not None and len(evaluation):
        sources = sources[0], register_rows(f"{name}-eval", evaluation)
    return sources[0], sources[1], list(train.column_names), first


def _plan(partial: str, sources: List[str], workers: int) -> List[Chunk]:
    """The chunks, planned once per entry (a continued build keeps the first plan whatever its num_proc)."""
    plan_path = os.path.join(partial, PLAN)
    if os.path.exists(plan_path):
        with open(plan_path) as fh:
            return [Chunk(**c) for c in json.load(fh)["chunks"]]
    size = sum(os.path.getsize(s) for s in sources if not s.startswith("rows:") and os.path.isfile(s))
    chunk_bytes = int(min(MAX_CHUNK_BYTES, max(MIN_CHUNK_BYTES, size // (4 * workers) + 1)))
    rows = sum(rows_of(s) for s in sources if s.startswith("rows:"))
    chunk_rows = int(min(50_000, max(1_000, rows // (4 * workers) + 1)))
    chunks = plan_chunks(sources, chunk_bytes, chunk_rows)
    with open(plan_path + ".tmp", "w") as fh:
        json.dump({"chunks": [c.__dict__ for c in chunks]}, fh)
    os.replace(plan_path + ".tmp", plan_path)
    return chunks


def _documents(partial: str, shards: List[Dict[str, Any]]) -> Tuple[np.ndarray, np.ndarray]:
    """Every document's first token in the stream of all shards, and its length (int64 each)."""
    starts, lengths, offset = [], [], 0
    for shard in shards:
        local = np.load(os.path.join(partial, shard["name"] + ".starts.npy"))
        starts.append(local + offset)
        lengths.append(np.diff(np.append(local, shard["tokens"])))
        offset += shard["tokens"]
    if not starts:
        return np.zeros(0, np.int64), np.zeros(0, np.int64)
    return np.concatenate(starts), np.concatenate(lengths)


def flag_counts(folder: str, shards: List[Dict[str, Any]], lo: np.ndarray, hi: np.ndarray) -> int:
    """Mask bytes set in the stream ranges [lo, hi) (each inside one shard), summed: one shard's mask read at a
    time with np.fromfile, not mapped, so the process's resident memory stays one shard's."""
    keep = hi > lo
    lo, hi = lo[keep], hi[keep]
    if not len(lo):
        return 0
    sizes = [s["tokens"] for s in shards]
    offsets = np.concatenate([[0], np.cumsum(sizes, dtype=np.int64)])
    which = np.searchsorted(offsets, lo, side="right") - 1
    total = 0
    for i in np.unique(which):
        mask = np.fromfile(os.path.join(folder, shards[i]["name"] + ".mask"), dtype=np.uint8)
        running = np.concatenate([[0], np.cumsum(mask, dtype=np.int64)])
        del mask
        mine = which == i
        total += int((running[hi[mine] - offsets[i]] - running[lo[mine] - offsets[i]]).sum())
    return total


def _split_orders(n_train: int, n_all: int, ratio: float, seed: int, path: str) -> Dict[str, np.ndarray]:
    """Each split's records in training order: the source's own eval split after its train records, else
    `ratio` of them held out by datasets' train_test_split's draw (the first n_eval of a seeded permutation)."""
    if n_all > n_train:
        return {"train": np.arange(n_train), "eval": np.arange(n_train, n_all)}
    if ratio > 0 and n_train > 1:
        n_eval = max(1, int(round(n_train * ratio)))
        if n_eval >= n_train:
            raise ValueError(
                f"eval_split_ratio={ratio} holds out {n_eval} of the {n_train} records of {path!r}, leaving none "
                "to train on; lower eval_split_ratio."
            )
        permutation = np.random.default_rng(seed).permutation(n_train)
        return {"train": permutation[n_eval:], "eval": permutation[:n_eval]}
    return {"train": np.arange(n_train)}


def build(
    folder: str,
    spec: Any,
    encoder: Encoder,
    sources: Tuple[str, Optional[str]],
    vocab_size: int,
    head: Dict[str, Any],
    counted: Optional[str],
    num_proc: Optional[int] = None,
    report: Optional[Callable[[Dict[str, Any]], None]] = None,
) -> Dict[str, Any]:
    """Encode the records of `sources` (train, eval or None), split, write the entry `folder`; return its summary.

    `head` starts the summary; `counted` names the loss-token count (completion_tokens / assistant_tokens) when
    the encoder gives masks. `report(progress)` hears the tokens done, the input done and the phase."""
    report = report or (lambda progress: None)
    partial = f"{folder}.partial"
    os.makedirs(partial, exist_ok=True)
    try:
        return _build(folder, partial, spec, encoder, sources, vocab_size, head, counted, num_proc, report)
    except Exception:
        shutil.rmtree(partial, ignore_errors=True)  # the data's fault: nothing to continue from
        raise


def _build(folder, partial, spec, encoder, sources, vocab_size, head, counted, num_proc, report):
    inputs = [s for s in sources if s is not None]
    workers = max(1, num_proc or len(os.sched_getaffinity(0)))
    chunks = _plan(partial, inputs, workers)
    dtype = token_dtype(vocab_size)

    def tokenising(tokens: int, done: int, total: int) -> None:
        report({"phase": "tokenising", "tokens": tokens, "done": done, "total": total})

    shards = encode_chunks(chunks, partial, encoder, dtype, workers, on_progress=tokenising)
    report({"phase": "splitting", "tokens": sum(s["tokens"] for s in shards)})
    index = {
        "format_version": FORMAT_VERSION,
        "inputs": inputs,
        "vocab_size": vocab_size,
        "dtype": dtype,
        "shards": shards,
        "tokens": sum(s["tokens"] for s in shards),
        "documents": sum(s["documents"] for s in shards),
    }
    with open(os.path.join(partial, INDEX), "w") as fh:
        json.dump(index, fh)
    starts, lengths = _documents(partial, shards)
    np.save(os.path.join(partial, "docs.npy"), np.append(starts, index["tokens"]))  # and the stream's end
    n_train = sum(s["documents"] for s, c in zip(shards, chunks) if c.source == inputs[0])
    orders = _split_orders(n_train, len(starts), spec.eval_split_ratio, spec.seed, spec.path)
    masked = bool(shards) and all(s["masked"] for s in shards if s["tokens"])
    block, summary = spec.max_seq_len, dict(head)
    for name, order in orders.items():
        if not len(order):
            continue
        docs = order[lengths[order] > 0]
        tokens = int(lengths[docs].sum())
        if spec.packing:
            cum = np.concatenate([[0], np.cumsum(lengths[docs])]).astype(np.int64)
            examples = tokens // block
            if examples == 0:
                raise ValueError(
                    f"the dataset has {tokens} tokens, fewer than one block of max_seq_len={block}; "
                    "lower max_seq_len or add data."
                )
            np.save(os.path.join(partial, f"{name}.cum.npy"), cum)
        else:
            docs = docs[lengths[docs] > 1]
            examples = len(docs)
        np.save(os.path.join(partial, f"{name}.docs.npy"), docs.astype(np.int64))
        summary[name] = {"records": int(len(order)), "tokens": tokens, "examples": int(examples)}
        if masked and counted:
            lo, hi = _target_ranges(starts, lengths, docs, cum if spec.packing else None, block)
            summary[name][counted] = flag_counts(partial, shards, *lo) - flag_counts(partial, shards, *hi)
    if "train" not in summary:
        raise ValueError(f"dataset {spec.path!r} produced no training examples.")
    if counted and summary["train"].get(counted, 1) == 0:
        what = counted.split("_")[0]
        raise ValueError(
            f"the training examples of {spec.path!r} hold no {what} tokens to train on (none in the records, or "
            f"every one cut off by max_seq_len={block}). Check the data, raise max_seq_len, or turn "
            f"{what}_only_loss off."
        )
    with open(os.path.join(partial, "summary.json"), "w") as fh:
        json.dump(summary, fh, indent=2)
    os.remove(os.path.join(partial, PLAN))
    try:
        os.rename(partial, folder)
    except OSError:  # another node's rank built it first: theirs is identical
        shutil.rmtree(partial, ignore_errors=True)
    report({"phase": "done", "tokens": index["tokens"]})
    return summary


def _target_ranges(starts, lengths, docs, cum, block):
    """((lo, hi) ranges whose set mask bytes are loss tokens, (lo, hi) ranges of ones counted there that are
    not): a token is a loss token when flagged, not its document's first, and (packed) not a row's first."""
    first = starts[docs]
    if cum is None:  # one example per document, cut at `block`
        return (first + 1, first + np.minimum(lengths[docs], block)), (first[:0], first[:0])
    end = (int(cum[-1]) // block) * block  # the dropped partial block's tokens are in no example
    inside = np.minimum(cum[1:], end) - cum[:-1]  # each document's tokens before the end
    used = inside > 0
    loss = (first[used] + 1, first[used] + inside[used])
    rows = np.arange(block, end, block, dtype=np.int64)  # every row's first position after the first row
    k = np.searchsorted(cum, rows, side="right") - 1
    inner = cum[k] != rows  # a row starting inside a document: its first token was counted above
    at = first[k[inner]] + rows[inner] - cum[k[inner]]
    return loss, (at, at + 1)

"""`prepare`: tokenise a corpus once, with all cores, into memory-mapped token shards with an index.

The inputs (JSON lines, text with one document per line, Parquet, or a
Hugging Face dataset: a folder `save_to_disk` wrote or `hf:NAME[:SPLIT]`) are
cut into chunks -- byte ranges of a text file aligned to lines, Parquet row
groups, contiguous slices of a dataset -- and a pool of worker processes
tokenises one chunk at a time, streaming it in batches of documents to its own
shard file. Memory per worker is one batch of documents, whatever the corpus
size. A shard is the chunk's token ids back to back in the smallest unsigned
dtype that holds the vocabulary (`<chunk>.tokens`), the offset of each
document's start in it (`<chunk>.starts.npy`), and a small JSON record written
last: a chunk whose record exists is done and is never tokenised again, so an
interrupted run, started again with the same arguments, continues. The plan
(the chunks) is written first and a re-run with other inputs or another
tokenizer is refused. `index.json`, written at the end, is what
`TokenCorpus` (shards.py) reads.
"""

from __future__ import annotations

import json
import multiprocessing
import os
import sys
import time
from concurrent.futures import ProcessPoolExecutor, as_completed
from dataclasses import asdict, dataclass
from typing import Any, Dict, Iterator, List, Optional, Sequence

import numpy as np

INDEX, PLAN = "index.json", "plan.json"
FORMAT_VERSION = 1
_BATCH_DOCS = 512  # documents tokenised per tokenizer call: the worker's memory, whatever the chunk


@dataclass(frozen=True)
class Chunk:
    """One unit of work: part of one input, tokenised by one worker into one shard."""

    name: str  # the shard's file stem
    source: str  # the input (a path or hf:NAME[:SPLIT])
    kind: str  # "jsonl" | "text" | "parquet" | "hf"
    start: int  # byte offset (jsonl/text), row group (parquet), row (hf)
    end: int  # exclusive
    size: int  # bytes (jsonl/text) or rows: the progress line's measure


def _kind(source: str) -> str:
    if source.startswith("hf:") or (os.path.isdir(source) and os.path.exists(os.path.join(source, "state.json"))):
        return "hf"
    lower = source.lower()
    for ext, kind in ((".jsonl", "jsonl"), (".json", "jsonl"), (".parquet", "parquet"), (".txt", "text")):
        if lower.endswith(ext):
            return kind
    raise ValueError(
        f"prepare cannot read {source!r}: give .jsonl / .json (JSON lines), .txt (one document per line), "
        ".parquet, a folder written by datasets' save_to_disk, or hf:NAME[:SPLIT] for a Hugging Face dataset."
    )


def _hf_dataset(source: str) -> Any:
    import datasets

    if not source.startswith("hf:"):
        return datasets.load_from_disk(source)
    name, _, split = source[3:].partition(":")
    return datasets.load_dataset(name, split=split or "train")


def plan_chunks(sources: Sequence[str], chunk_bytes: int, chunk_rows: int) -> List[Chunk]:
    """The chunks of all inputs, in input order (the corpus's token order)."""
    chunks: List[Chunk] = []
    for i, source in enumerate(sources):
        kind = _kind(source)
        if kind != "hf" and not os.path.exists(source):
            raise FileNotFoundError(f"prepare: input {source!r} does not exist.")
        if kind in ("jsonl", "text"):
            size = os.path.getsize(source)
            bounds = list(range(0, size, chunk_bytes)) + [size]
            parts = [(a, b, b - a) for a, b in zip(bounds, bounds[1:])]
        elif kind == "parquet":
            import pyarrow.parquet as pq

            meta = pq.ParquetFile(source).metadata
            parts = [(g, g + 1, meta.row_group(g).num_rows) for g in range(meta.num_row_groups)]
        else:
            rows = len(_hf_dataset(source))
            bounds = list(range(0, rows, chunk_rows)) + [rows]
            parts = [(a, b, b - a) for a, b in zip(bounds, bounds[1:])]
        chunks += [Chunk(f"{i:04d}-{j:06d}", source, kind, a, b, n) for j, (a, b, n) in enumerate(parts)]
    return chunks


def _lines(path: str, start: int, end: int) -> Iterator[bytes]:
    """The lines that begin in [start, end): a line belongs to the chunk its first byte is in."""
    with open(path, "rb") as f:
        if start > 0:
            f.seek(start - 1)
            if f.read(1) != b"\n":
                f.readline()  # the line in progress belongs to the previous chunk
        while f.tell() < end:
            line = f.readline()
            if not line:
                return
            yield line


def _documents(chunk: Chunk, text_key: str) -> Iterator[str]:
    if chunk.kind in ("jsonl", "text"):
        for number, line in enumerate(_lines(chunk.source, chunk.start, chunk.end)):
            if not line.strip():
                continue
            if chunk.kind == "text":
                yield line.decode("utf-8").rstrip("\n")
                continue
            record = json.loads(line)
            if text_key not in record:
                raise ValueError(
                    f"{chunk.source}: a record (bytes {chunk.start}-{chunk.end}) has no {text_key!r} field "
                    f"(it has {sorted(record)}): pass text_key= (--text_key) naming the text field."
                )
            yield record[text_key]
    elif chunk.kind == "parquet":
        import pyarrow.parquet as pq

        table = pq.ParquetFile(chunk.source).read_row_group(chunk.start, columns=[text_key])
        yield from table.column(text_key).to_pylist()
    else:
        data = _hf_dataset(chunk.source)
        for row in range(chunk.start, chunk.end, _BATCH_DOCS):
            yield from data[row : min(row + _BATCH_DOCS, chunk.end)][text_key]


# ------------------------------------------------------------------ the workers
_TOKENIZER: Any = None


def _load_tokenizer(name: str) -> Any:
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(name)


def _init_worker(tokenizer: str) -> None:
    global _TOKENIZER
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")  # one process per core already
    _TOKENIZER = _load_tokenizer(tokenizer)


def _batches(docs: Iterator[str]) -> Iterator[List[str]]:
    batch: List[str] = []
    for doc in docs:
        batch.append(doc)
        if len(batch) == _BATCH_DOCS:
            yield batch
            batch = []
    if batch:
        yield batch


def tokenize_chunk(chunk: Chunk, out_dir: str, text_key: str, dtype: str, append_eos: bool) -> Dict[str, Any]:
    """Tokenise one chunk into its shard (in a worker); returns its record."""
    tok = _TOKENIZER
    eos = [tok.eos_token_id] if append_eos and tok.eos_token_id is not None else []
    base = os.path.join(out_dir, chunk.name)
    tokens, starts = 0, []
    with open(base + ".tokens.tmp", "wb") as f:
        for batch in _batches(_documents(chunk, text_key)):
            ids = tok(batch, add_special_tokens=False)["input_ids"]
            for doc in ids:
                if doc or eos:
                    starts.append(tokens)
                    tokens += len(doc) + len(eos)
            flat = np.fromiter((t for doc in ids for t in doc + eos), dtype=dtype)
            f.write(flat.tobytes())
    np.save(base + ".starts.tmp.npy", np.asarray(starts, dtype=np.int64))
    os.replace(base + ".tokens.tmp", base + ".tokens")
    os.replace(base + ".starts.tmp.npy", base + ".starts.npy")
    record = {"name": chunk.name, "tokens": tokens, "documents": len(starts), "size": chunk.size}
    with open(base + ".json.tmp", "w") as f:
        json.dump(record, f)
    os.replace(base + ".json.tmp", base + ".json")  # the chunk is done once this exists
    return record


# ------------------------------------------------------------------ the driver
def _token_dtype(vocab_size: int) -> str:
    if vocab_size <= 2**16:
        return "uint16"
    if vocab_size <= 2**32:
        return "uint32"
    raise ValueError(f"a vocabulary of {vocab_size} tokens does not fit 32 bits.")


def _format_eta(seconds: float) -> str:
    seconds = int(seconds)
    return f"{seconds // 3600}h{seconds // 60 % 60:02d}m" if seconds >= 3600 else f"{seconds // 60}m{seconds % 60:02d}s"


class _Progress:
    """One line on stderr: chunks, tokens, tokens/s and the ETA (by input bytes or rows done)."""

    def __init__(self, total_size: int, enabled: bool) -> None:
        self.total, self.enabled, self.started = total_size, enabled, time.monotonic()
        self.size = self.tokens = self.chunks = 0
        self.tty, self.shown = sys.stderr.isatty(), 0.0  # a log file gets a line every 10 s, not every chunk

    def update(self, record: Dict[str, Any], of: int) -> None:
        self.size += record["size"]
        self.tokens += record["tokens"]
        self.chunks += 1
        if not self.enabled:
            return
        elapsed = max(time.monotonic() - self.started, 1e-9)
        rate = self.tokens / elapsed
        eta = elapsed * (self.total - self.size) / max(self.size, 1)
        last = self.chunks == of
        if not (self.tty or last or elapsed - self.shown >= 10):
            return
        self.shown = elapsed
        sys.stderr.write(
            f"{chr(13) if self.tty else ''}prepare: {self.chunks}/{of} chunks, {self.tokens:,} tokens, "
            f"{rate:,.0f} tokens/s, ETA {_format_eta(eta)}   {chr(10) if last or not self.tty else ''}"
        )
        sys.stderr.flush()


def prepare(
    inputs: Sequence[str],
    out_dir: str,
    tokenizer: str,
    text_key: str = "text",
    num_proc: Optional[int] = None,
    chunk_bytes: int = 64 * 2**20,
    chunk_rows: int = 100_000,
    append_eos: bool = True,
    progress: bool = True,
) -> Dict[str, Any]:
    """Tokenise `inputs` into token shards in `out_dir`; returns the index (also written as index.json).

    tokenizer: a Hugging Face tokenizer (a local folder or a hub name) each worker loads.
    num_proc: worker processes (default: every core this process may use).
    append_eos: end each document with the tokenizer's EOS token (packed documents stay told apart).
    A re-run with the same arguments continues an interrupted one; finished chunks are not tokenised again.
    """
    if isinstance(inputs, str):
        inputs = [inputs]
    if not inputs:
        raise ValueError("prepare needs at least one input file or dataset.")
    os.makedirs(out_dir, exist_ok=True)
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")  # set before any use: the workers are processes
    vocab = len(_load_tokenizer(tokenizer))
    settings = {
        "format_version": FORMAT_VERSION,
        "inputs": [os.path.abspath(s) if not s.startswith("hf:") else s for s in inputs],
        "tokenizer": tokenizer,
        "vocab_size": vocab,
        "dtype": _token_dtype(vocab),
        "text_key": text_key,
        "append_eos": append_eos,
    }
    plan_path = os.path.join(out_dir, PLAN)
    if os.path.exists(plan_path):
        with open(plan_path) as f:
            plan = json.load(f)
        changed = [k for k in settings if plan["settings"].get(k) != settings[k]]
        if changed:
            raise ValueError(
                f"{out_dir} holds a corpus prepared with other settings ({', '.join(changed)}: "
                f"{[plan['settings'].get(k) for k in changed]} there, {[settings[k] for k in changed]} now). "
                "Prepare into a new folder, or delete this one to start over."
            )
        chunks = [Chunk(**c) for c in plan["chunks"]]
    else:
        chunks = plan_chunks(settings["inputs"], chunk_bytes, chunk_rows)
        with open(plan_path + ".tmp", "w") as f:
            json.dump({"settings": settings, "chunks": [asdict(c) for c in chunks]}, f)
        os.replace(plan_path + ".tmp", plan_path)
    records: Dict[str, Dict[str, Any]] = {}
    for chunk in chunks:
        done = os.path.join(out_dir, chunk.name + ".json")
        if os.path.exists(done):
            with open(done) as f:
                records[chunk.name] = json.load(f)
    todo = [c for c in chunks if c.name not in records]
    meter = _Progress(sum(c.size for c in todo), progress)
    workers = max(1, min(num_proc or len(os.sched_getaffinity(0)), len(todo) or 1))
    jobs = [(c, out_dir, text_key, settings["dtype"], append_eos) for c in todo]
    if todo:
        _init_worker(tokenizer)
    if todo and workers == 1:
        for job in jobs:
            records[job[0].name] = record = tokenize_chunk(*job)
            meter.update(record, len(todo))
    elif todo:
        # fork where there is one (as datasets.map): the workers start in milliseconds with the tokenizer loaded
        # above; a spawned worker would import torch and transformers first. A worker that dies fails the run
        # (BrokenProcessPool) instead of hanging it; chunks finished before a failure stay done.
        method = "fork" if "fork" in multiprocessing.get_all_start_methods() else "spawn"
        init = (None, ()) if method == "fork" else (_init_worker, (tokenizer,))
        with ProcessPoolExecutor(
            workers, mp_context=multiprocessing.get_context(method), initializer=init[0], initargs=init[1]
        ) as pool:
            for future in as_completed([pool.submit(tokenize_chunk, *job) for job in jobs]):
                record = future.result()
                records[record["name"]] = record
                meter.update(record, len(todo))
    index = {
        **settings,
        "shards": [records[c.name] for c in chunks],
        "tokens": sum(records[c.name]["tokens"] for c in chunks),
        "documents": sum(records[c.name]["documents"] for c in chunks),
    }
    with open(os.path.join(out_dir, INDEX + ".tmp"), "w") as f:
        json.dump(index, f)
    os.replace(os.path.join(out_dir, INDEX + ".tmp"), os.path.join(out_dir, INDEX))
    return index

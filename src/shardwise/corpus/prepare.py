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
`TokenCorpus` (shards.py) reads. `encode_chunks` is the same pool for any
encoder of records (the fine-tuning recipe's chat, prompt/completion and text
records): it keeps one entry per record, empty ones included, and a per-token
loss mask (`<chunk>.mask`, one byte a token) when the encoder gives one.
"""

from __future__ import annotations

import itertools
import json
import multiprocessing
import os
import sys
import time
from concurrent.futures import FIRST_COMPLETED, ProcessPoolExecutor, wait
from dataclasses import asdict, dataclass
from typing import Any, Callable, Dict, Iterator, List, Optional, Sequence, Tuple

import numpy as np

INDEX, PLAN = "index.json", "plan.json"
FORMAT_VERSION = 1
_BATCH_DOCS = 512  # documents tokenised per tokenizer call: the worker's memory, whatever the chunk
TEXT_LINE = "\0line"  # the column a .txt input's lines are read into


@dataclass(frozen=True)
class Chunk:
    """One unit of work: part of one input, tokenised by one worker into one shard."""

    name: str  # the shard's file stem
    source: str  # the input (a path or hf:NAME[:SPLIT])
    kind: str  # "jsonl" | "text" | "parquet" | "hf"
    start: int  # byte offset (jsonl/text), row group (parquet), row (hf)
    end: int  # exclusive
    size: int  # bytes (jsonl/text) or rows: the progress line's measure
    first: int = -1  # the chunk's first record's number in its input; -1: known only by counting (jsonl/text)


_ROWS: Dict[str, Any] = {}  # "rows:NAME" inputs: datasets objects handed in by the caller (register_rows)


def register_rows(name: str, dataset: Any) -> str:
    """An in-memory (or memory-mapped) datasets.Dataset as an input, read by row slices; returns its source name."""
    _ROWS[name] = dataset
    return f"rows:{name}"


def rows_of(source: str) -> int:
    """The records of a "rows:" or "hf:" input."""
    return len(_hf_dataset(source))


def _kind(source: str) -> str:
    if source.startswith("rows:"):
        return "rows"
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

    if source.startswith("rows:"):
        return _ROWS[source[5:]]
    if not source.startswith("hf:"):
        return datasets.load_from_disk(source)
    name, _, split = source[3:].partition(":")
    return datasets.load_dataset(name, split=split or "train")


def plan_chunks(sources: Sequence[str], chunk_bytes: int, chunk_rows: int) -> List[Chunk]:
    """The chunks of all inputs, in input order (the corpus's token order)."""
    chunks: List[Chunk] = []
    for i, source in enumerate(sources):
        kind = _kind(source)
        if kind not in ("hf", "rows") and not os.path.exists(source):
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
        firsts = (
            [-1] * len(parts) if kind in ("jsonl", "text") else list(itertools.accumulate([0] + [n for *_, n in parts]))
        )
        chunks += [Chunk(f"{i:04d}-{j:06d}", source, kind, a, b, n, firsts[j]) for j, (a, b, n) in enumerate(parts)]
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


def _columns(rows: List[Dict[str, Any]]) -> Dict[str, List[Any]]:
    """Records as columns (datasets' batch layout): a field a record lacks is None there."""
    keys = dict.fromkeys(k for row in rows for k in row)
    return {k: [row.get(k) for row in rows] for k in keys}


def record_batches(chunk: Chunk) -> Iterator[Tuple[int, int, Dict[str, List[Any]]]]:
    """(number of the batch's first record within the chunk, records, the records as columns), a batch of
    at most _BATCH_DOCS records at a time: the reader's memory, whatever the chunk. A text line is {TEXT_LINE: line}."""
    at = 0
    if chunk.kind in ("jsonl", "text"):
        rows: List[Any] = []
        for line in _lines(chunk.source, chunk.start, chunk.end):
            if not line.strip():
                continue
            if chunk.kind == "text":
                rows.append({TEXT_LINE: line.decode("utf-8").rstrip("\n")})
            else:
                record = json.loads(line)
                if not isinstance(record, dict):
                    raise ValueError(
                        f"{chunk.source}: a line (bytes {chunk.start}-{chunk.end}) is a JSON {type(record).__name__}, "
                        "not an object of fields: each line must be one record."
                    )
                rows.append(record)
            if len(rows) == _BATCH_DOCS:
                yield at, len(rows), _columns(rows)
                at, rows = at + len(rows), []
        if rows:
            yield at, len(rows), _columns(rows)
    elif chunk.kind == "parquet":
        import pyarrow.parquet as pq

        table = pq.ParquetFile(chunk.source).read_row_group(chunk.start)
        for at in range(0, table.num_rows, _BATCH_DOCS):
            part = table.slice(at, _BATCH_DOCS)
            yield at, part.num_rows, part.to_pydict()
    else:
        data = _hf_dataset(chunk.source)
        for row in range(chunk.start, chunk.end, _BATCH_DOCS):
            stop = min(row + _BATCH_DOCS, chunk.end)
            yield row - chunk.start, stop - row, data[row:stop]


def _records_before(chunk: Chunk) -> int:
    """The records of the chunk's input before it (JSON lines and text: counted only when asked, for a message)."""
    if chunk.first >= 0:
        return chunk.first
    return sum(1 for line in _lines(chunk.source, 0, chunk.start) if line.strip())


# ------------------------------------------------------------------ the workers
class RecordError(ValueError):
    """A record an encoder cannot read (encode_chunk names the input it is in)."""


def _load_tokenizer(name: str) -> Any:
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(name)


class TextEncoder:
    """prepare's encoder: each record's `text_key` (a .txt input's line), tokenised, with EOS when asked;
    empty documents are dropped (a pre-training stream keeps no record numbers)."""

    def __init__(self, tokenizer: Any, text_key: str, append_eos: bool) -> None:
        self.tokenizer, self.text_key = tokenizer, text_key
        self.eos = [tokenizer.eos_token_id] if append_eos and tokenizer.eos_token_id is not None else []

    def __call__(self, columns: Dict[str, List[Any]], count: int, first: int) -> List[Tuple[List[int], None]]:
        texts = columns.get(TEXT_LINE) or columns.get(self.text_key) or [None] * count
        for j, text in enumerate(texts):
            if text is None:
                fields = sorted(k for k, v in columns.items() if v[j] is not None)
                raise RecordError(
                    f"record {first + j} has no {self.text_key!r} field (it has {fields}): pass text_key= "
                    "(--text_key) naming the text field."
                )
        ids = self.tokenizer(texts, add_special_tokens=False)["input_ids"]
        return [(doc + self.eos, None) for doc in ids if doc or self.eos]


Encoded = List[Tuple[Sequence[int], Optional[Any]]]  # per record: its token ids, and its loss mask or None
Encoder = Callable[[Dict[str, List[Any]], int, int], Encoded]  # (columns, records, first record's number)
_ENCODER: Optional[Encoder] = None
_COUNTER: Any = None  # tokens written by every worker so far (a shared integer: the progress while chunks run)


def _init_encoder(encoder: Encoder, counter: Any) -> None:
    global _ENCODER, _COUNTER
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    _ENCODER, _COUNTER = encoder, counter


def _worker_init(encoder: Optional[Encoder], counter: Any) -> None:
    """A pool worker: the encoder set (spawn; a forked worker has it already); Ctrl-C is the parent's to handle."""
    import signal

    signal.signal(signal.SIGINT, signal.SIG_IGN)  # the terminal sends it to every worker too
    if encoder is not None:
        _init_encoder(encoder, counter)


def _stop_pool(pool: ProcessPoolExecutor) -> None:
    """Cancel what is queued and end the workers at once (the chunks they were encoding stay unfinished)."""
    processes = list((getattr(pool, "_processes", None) or {}).values())  # no public way before Python 3.14
    pool.shutdown(wait=False, cancel_futures=True)
    for process in processes:
        if process.is_alive():
            process.terminate()
    for process in processes:
        process.join(timeout=10)


def encode_chunk(chunk: Chunk, out_dir: str, dtype: str) -> Dict[str, Any]:
    """Encode one chunk's records into its shard (in a worker): one document per record, an empty one included,
    so document i of the input is record i; with masks, `<chunk>.mask` holds one byte per token. Returns its record."""
    base = os.path.join(out_dir, chunk.name)
    tokens, starts, masked = 0, [], None
    with open(base + ".tokens.tmp", "wb") as f, open(base + ".mask.tmp", "wb") as m:
        for at, count, columns in record_batches(chunk):
            first = (chunk.first if chunk.first >= 0 else 0) + at
            try:
                docs = _ENCODER(columns, count, first)  # type: ignore[misc]
            except RecordError as exc:
                raise RecordError(f"{chunk.source} (bytes {chunk.start}-{chunk.end}): {exc}") from None
            except ValueError:
                if chunk.first >= 0:
                    raise
                _ENCODER(columns, count, _records_before(chunk) + at)  # the same error, its record numbered in the file
                raise
            lengths = [len(ids) for ids, _ in docs]
            starts += list(itertools.accumulate([tokens] + lengths[:-1])) if docs else []
            n = sum(lengths)
            tokens += n
            f.write(np.fromiter(itertools.chain.from_iterable(ids for ids, _ in docs), dtype=dtype, count=n).tobytes())
            masked = docs[0][1] is not None if docs and masked is None else masked
            if masked:
                m.write(np.concatenate([np.asarray(flags, dtype=np.uint8) for _, flags in docs]).tobytes())
            if _COUNTER is not None:
                with _COUNTER.get_lock():
                    _COUNTER.value += n
    np.save(base + ".starts.tmp.npy", np.asarray(starts, dtype=np.int64))
    os.replace(base + ".tokens.tmp", base + ".tokens")
    os.replace(base + ".starts.tmp.npy", base + ".starts.npy")
    if masked:
        os.replace(base + ".mask.tmp", base + ".mask")
    else:
        os.remove(base + ".mask.tmp")
    record = {
        "name": chunk.name,
        "tokens": tokens,
        "documents": len(starts),
        "size": chunk.size,
        "masked": bool(masked),
    }
    with open(base + ".json.tmp", "w") as f:
        json.dump(record, f)
    os.replace(base + ".json.tmp", base + ".json")  # the chunk is done once this exists
    return record


def encode_chunks(
    chunks: Sequence[Chunk],
    out_dir: str,
    encoder: Encoder,
    dtype: str,
    num_proc: Optional[int] = None,
    on_progress: Optional[Callable[[int, int, int], None]] = None,
    on_chunk: Optional[Callable[[Dict[str, Any]], None]] = None,
) -> List[Dict[str, Any]]:
    """Encode `chunks` into shards in `out_dir` with `num_proc` workers (default: every core this process may
    use); finished chunks (their record exists) are not encoded again. `on_progress(tokens, size done, size
    total)` is called about once a second and after each chunk, `on_chunk(record)` after each chunk.
    Returns the chunks' records, in order."""
    records: Dict[str, Dict[str, Any]] = {}
    for chunk in chunks:
        done = os.path.join(out_dir, chunk.name + ".json")
        if os.path.exists(done):
            with open(done) as f:
                records[chunk.name] = json.load(f)
    todo = [c for c in chunks if c.name not in records]
    workers = max(1, min(num_proc or len(os.sched_getaffinity(0)), len(todo) or 1))
    method = "fork" if "fork" in multiprocessing.get_all_start_methods() else "spawn"
    counter = multiprocessing.get_context(method).Value("q", sum(r["tokens"] for r in records.values()))
    total, size = sum(c.size for c in chunks), sum(r["size"] for r in records.values())

    def report(record: Optional[Dict[str, Any]] = None) -> None:
        if record is not None and on_chunk is not None:
            on_chunk(record)
        if on_progress is not None:
            on_progress(int(counter.value), size, total)

    _init_encoder(encoder, counter)
    if workers == 1:
        for chunk in todo:
            records[chunk.name] = record = encode_chunk(chunk, out_dir, dtype)
            size += chunk.size
            report(record)
    elif todo:
        # fork, as prepare: the workers inherit the encoder (and its tokenizer) set above; a dead worker fails the
        # run (BrokenProcessPool), and chunks finished before a failure stay done.
        init = (_worker_init, (None, None)) if method == "fork" else (_worker_init, (encoder, counter))
        pool = ProcessPoolExecutor(
            workers, mp_context=multiprocessing.get_context(method), initializer=init[0], initargs=init[1]
        )
        try:
            pending = {pool.submit(encode_chunk, c, out_dir, dtype) for c in todo}
            while pending:
                finished, pending = wait(pending, timeout=1.0, return_when=FIRST_COMPLETED)
                for future in finished:
                    record = future.result()
                    records[record["name"]] = record
                    size += record["size"]
                    report(record)
                report()
        except BaseException:
            # Ctrl-C, a signal or a failed chunk: stop now. Leaving the pool's block would wait for every chunk
            # still queued. A chunk cut short has no record, so a run started again encodes it afresh.
            _stop_pool(pool)
            raise
        pool.shutdown()
    _init_encoder(None, None)  # type: ignore[arg-type]
    return [records[c.name] for c in chunks]


# ------------------------------------------------------------------ the driver
def token_dtype(vocab_size: int) -> str:
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
    tok = _load_tokenizer(tokenizer)
    vocab = len(tok)
    settings = {
        "format_version": FORMAT_VERSION,
        "inputs": [os.path.abspath(s) if not s.startswith("hf:") else s for s in inputs],
        "tokenizer": tokenizer,
        "vocab_size": vocab,
        "dtype": token_dtype(vocab),
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
    todo = [c for c in chunks if not os.path.exists(os.path.join(out_dir, c.name + ".json"))]
    meter = _Progress(sum(c.size for c in todo), progress)
    encoder = TextEncoder(tok, text_key, append_eos)
    shards = encode_chunks(
        chunks, out_dir, encoder, settings["dtype"], num_proc, on_chunk=lambda r: meter.update(r, len(todo))
    )
    records = {r["name"]: r for r in shards}
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

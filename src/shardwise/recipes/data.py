"""Chat / text records -> token blocks for causal-LM fine-tuning, tokenised once and cached on disk.

Records come from a local jsonl / json / parquet file or a `save_to_disk`
folder; chat messages are rendered with the tokenizer's chat template, or
else with the tagged format (`<|system|> ... <|endoftext|> <|prompter|> ...`).
With packing, documents share fixed-length blocks without leaking into each
other: each document's first label is -100, and under `packing="attention"`
(the default) position ids restart per document, which Hugging Face models
turn into a block-diagonal mask; `packing="loss"` masks only the boundary
labels. Global rank 0 writes the token arrays to a cache folder keyed by
everything that changes them; the other ranks memory-map the same files.
`DataOptions` are the recipe's data options as the user gives them;
`FinetuneData` is the DataModule that hands them to the Trainer, which runs
its `prepare_data` (the tokenisation) before any rank reads the cache.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
from dataclasses import asdict, dataclass
from typing import Any, Dict, List, Optional, Sequence, Tuple

import numpy as np
import torch
from torch.utils.data import DataLoader, Dataset

from shardwise.distributed import ops
from shardwise.distributed.env import detect_env, is_global_zero
from shardwise.module import DataModule

CACHE_VERSION = 1
CHAT_FORMATS = ("auto", "tags", "tokenizer", "none")
PACKING_MODES = ("attention", "loss")
ROLE_TAGS = {"system": "<|system|>", "user": "<|prompter|>", "assistant": "<|assistant|>"}
END_TAG = "<|endoftext|>"
_ROLE_ALIASES = {"human": "user", "prompter": "user", "gpt": "assistant", "bot": "assistant", "model": "assistant"}
_AUTO_FIELDS = ("messages", "conversations", "text", "content")


class DatasetFieldError(ValueError):
    """The requested text field is not in the dataset (the message lists the fields that are)."""


@dataclass
class DataOptions:
    """The fine-tuning recipe's data options (`FinetuneConfig.data`; on the command line
    `--data.max_seq_len` or, as before they were nested, `--max_seq_len`).

    Args:
        dataset: .jsonl / .json / .parquet file, or a folder written by datasets' save_to_disk
        dataset_text_field: record field with text or chat messages
            (default: first of messages, conversations, text, content)
        chat_template_format: auto (the tokenizer's template, else tags) | tags
            (<|system|>/<|prompter|>/<|assistant|>) | tokenizer | none (text used as is)
        max_seq_len: tokens per example / packed block
        packing: concatenate documents into max_seq_len blocks
        packing_mode: attention (no attention across documents) | loss (only boundary labels masked)
        add_special_tokens: let the tokenizer add its BOS/EOS
        append_concat_token: end every document with EOS
        eval_split_ratio: held-out fraction when the dataset has no test / validation split
        cache_dir: tokenised-data cache (default <output_dir>/tokenized)
        per_device_train_batch_size: examples per process per micro-batch
        per_device_eval_batch_size: examples per process per eval batch
        dataloader_num_workers: DataLoader worker processes
    """

    dataset: str = ""
    dataset_text_field: Optional[str] = None
    chat_template_format: str = "auto"
    max_seq_len: int = 2048
    packing: bool = True
    packing_mode: str = "attention"
    add_special_tokens: bool = False
    append_concat_token: bool = True
    eval_split_ratio: float = 0.05
    cache_dir: Optional[str] = None
    per_device_train_batch_size: int = 1
    per_device_eval_batch_size: int = 1
    dataloader_num_workers: int = 0

    def spec(self, text_field: str, seed: int) -> "DataSpec":
        """What decides the token arrays: these options with the text field resolved and the split's seed."""
        return DataSpec(
            path=os.path.abspath(self.dataset),
            text_field=text_field,
            chat_template_format=self.chat_template_format,
            max_seq_len=self.max_seq_len,
            packing=self.packing,
            packing_mode=self.packing_mode,
            add_special_tokens=self.add_special_tokens,
            append_eos=self.append_concat_token,
            eval_split_ratio=self.eval_split_ratio,
            seed=seed,
        )


@dataclass(frozen=True)
class DataSpec:
    """Everything that decides the token arrays; its hash names the cache entry."""

    path: str
    text_field: Optional[str] = None
    chat_template_format: str = "auto"
    max_seq_len: int = 2048
    packing: bool = True
    packing_mode: str = "attention"
    add_special_tokens: bool = False
    append_eos: bool = True
    eval_split_ratio: float = 0.05
    seed: int = 42


# ------------------------------------------------------------------ records
def _kind(path: str) -> str:
    if os.path.isdir(path):
        return "disk"
    lower = path.lower()
    if lower.endswith((".jsonl", ".json", ".jsonl.gz", ".json.gz")):
        return "json"
    if lower.endswith(".parquet"):
        return "parquet"
    raise ValueError(
        f"dataset {path!r}: use a .jsonl/.json file, a .parquet file, or a folder written by "
        "datasets' save_to_disk (no hub names: shardwise does not download)."
    )


def dataset_columns(path: str) -> List[str]:
    """The record fields, read cheaply (first line / schema / saved features) for up-front checks."""
    if not os.path.exists(path):
        raise FileNotFoundError(f"dataset {path!r} does not exist.")
    kind = _kind(path)
    if kind == "json" and not path.endswith(".gz"):
        with open(path) as fh:
            for line in fh:
                if line.strip():
                    first = json.loads(line) if path.endswith("jsonl") else None
                    if first is None:  # a .json array / object: let datasets read it
                        break
                    return list(first)
    if kind == "parquet":
        import pyarrow.parquet as pq

        return list(pq.read_schema(path).names)
    return list(_load_splits(path, None)[0].column_names)


def _load_splits(path: str, cache_dir: Optional[str]) -> Tuple[Any, Optional[Any]]:
    """(train, eval or None): a `datasets` folder may carry its own test / validation split."""
    import datasets

    kind = _kind(path)
    if kind == "disk":
        loaded = datasets.load_from_disk(path)
        if isinstance(loaded, datasets.DatasetDict):
            train = loaded["train"] if "train" in loaded else loaded[list(loaded)[0]]
            evaluation = next((loaded[s] for s in ("test", "validation", "eval") if s in loaded), None)
            return train, evaluation
        return loaded, None
    builder = "json" if kind == "json" else "parquet"
    return datasets.load_dataset(builder, data_files=path, split="train", cache_dir=cache_dir), None


def resolve_text_field(columns: Sequence[str], text_field: Optional[str], path: str) -> str:
    if text_field is None:
        for name in _AUTO_FIELDS:
            if name in columns:
                return name
        raise DatasetFieldError(
            f"dataset {path!r} has none of the usual text fields {list(_AUTO_FIELDS)}; "
            f"its fields are {list(columns)}. Set dataset_text_field."
        )
    if text_field not in columns:
        raise DatasetFieldError(
            f"dataset_text_field={text_field!r} is not a field of {path!r}; its fields are {list(columns)}."
        )
    return text_field


# --------------------------------------------------------------- formatting
def _normalise_messages(value: Any) -> List[Dict[str, str]]:
    out = []
    for msg in value:
        if not isinstance(msg, dict):
            raise ValueError(f"a chat message must be a dict with role/content, got {msg!r}")
        role = msg.get("role", msg.get("from"))
        content = msg.get("content", msg.get("value"))
        role = _ROLE_ALIASES.get(str(role).lower(), str(role).lower())
        if role not in ROLE_TAGS:
            raise ValueError(f"unknown chat role {role!r}; expected system / user / assistant.")
        out.append({"role": role, "content": "" if content is None else str(content)})
    return out


def format_tags(messages: Sequence[Dict[str, str]]) -> str:
    """The tagged chat format (used when the tokenizer has no chat template), one `<|endoftext|>` per turn."""
    return " ".join(f"{ROLE_TAGS[m['role']]} {m['content']} {END_TAG}" for m in messages)


def resolve_chat_format(chat_template_format: str, tokenizer: Any) -> str:
    if chat_template_format not in CHAT_FORMATS:
        raise ValueError(f"chat_template_format={chat_template_format!r}: use one of {CHAT_FORMATS}.")
    if chat_template_format == "auto":
        return "tokenizer" if getattr(tokenizer, "chat_template", None) else "tags"
    if chat_template_format == "tokenizer" and not getattr(tokenizer, "chat_template", None):
        raise ValueError(
            "chat_template_format='tokenizer' but the tokenizer has no chat_template; "
            "use 'tags' (the <|system|>/<|prompter|>/<|assistant|> format) or 'auto'."
        )
    return chat_template_format


def record_text(value: Any, chat_format: str, tokenizer: Any) -> str:
    if isinstance(value, str):
        return value  # already formatted text: used as is whatever the chat format
    if chat_format == "none":
        raise ValueError(
            "chat_template_format='none' needs a plain-text field, but the field holds "
            f"{type(value).__name__}; use 'auto', 'tags' or 'tokenizer' for chat messages."
        )
    messages = _normalise_messages(value)
    if chat_format == "tokenizer":
        return tokenizer.apply_chat_template(messages, tokenize=False)
    return format_tags(messages)


# ------------------------------------------------------------------ packing
def pack_documents(docs: Sequence[Sequence[int]], block: int, mode: str) -> Dict[str, np.ndarray]:
    """Concatenate documents into [N, block] arrays; the last, partial block is dropped.

    Labels are -100 at every document's first token; position ids restart
    at each document (mode "attention") or count through the block ("loss").
    Position ids also restart at every block, so a document cut by a block
    boundary never exceeds `block` positions.
    """
    if mode not in PACKING_MODES:
        raise ValueError(f"packing_mode={mode!r}: use one of {PACKING_MODES}.")
    lengths = np.fromiter((len(d) for d in docs), dtype=np.int64, count=len(docs))
    total = int(lengths.sum())
    n = total // block
    if n == 0:
        raise ValueError(
            f"the dataset has {total} tokens, fewer than one block of max_seq_len={block}; "
            "lower max_seq_len or add data."
        )
    flat = np.fromiter((t for d in docs for t in d), dtype=np.int32, count=total)[: n * block]
    starts = np.zeros(total, dtype=bool)
    starts[np.concatenate([[0], np.cumsum(lengths)[:-1]])] = True
    starts = starts[: n * block]
    labels = np.where(starts, -100, flat).astype(np.int32)
    if mode == "attention":
        # position = distance to the most recent document start, restarted at each block
        idx = np.arange(n * block)
        last_start = np.maximum.accumulate(np.where(starts | (idx % block == 0), idx, 0))
        positions = (idx - last_start).astype(np.int32)
    else:
        positions = np.tile(np.arange(block, dtype=np.int32), n)
    return {
        "input_ids": flat.reshape(n, block),
        "labels": labels.reshape(n, block),
        "position_ids": positions.reshape(n, block),
    }


def truncate_documents(docs: Sequence[Sequence[int]], block: int) -> Dict[str, np.ndarray]:
    """Unpacked: one example per document, cut at `block` tokens, stored flat with offsets."""
    cut = [list(d[:block]) for d in docs if len(d) > 1]
    lengths = np.array([len(d) for d in cut], dtype=np.int64)
    flat = np.fromiter((t for d in cut for t in d), dtype=np.int32, count=int(lengths.sum()))
    return {"tokens": flat, "offsets": np.concatenate([[0], np.cumsum(lengths)]).astype(np.int64)}


# -------------------------------------------------------------------- cache
def _file_fingerprint(path: str) -> List[Any]:
    if os.path.isdir(path):
        return sorted(
            [f, os.path.getsize(os.path.join(path, f)), int(os.path.getmtime(os.path.join(path, f)))]
            for f in os.listdir(path)
            if os.path.isfile(os.path.join(path, f))
        )
    return [os.path.getsize(path), int(os.path.getmtime(path))]


def _tokenizer_fingerprint(tokenizer: Any) -> str:
    backend = getattr(tokenizer, "backend_tokenizer", None)
    text = backend.to_str() if backend is not None else repr(sorted(tokenizer.get_vocab().items()))
    text += repr(getattr(tokenizer, "chat_template", None))
    return hashlib.sha256(text.encode()).hexdigest()


def cache_key(spec: DataSpec, tokenizer: Any) -> str:
    blob = json.dumps(
        {
            "v": CACHE_VERSION,
            "spec": asdict(spec),
            "data": _file_fingerprint(spec.path),
            "tok": _tokenizer_fingerprint(tokenizer),
        },
        sort_keys=True,
        default=str,
    )
    return hashlib.sha256(blob.encode()).hexdigest()[:16]


def _tokenize(dataset: Any, field: str, chat_format: str, tokenizer: Any, spec: DataSpec) -> List[List[int]]:
    eos = tokenizer.eos_token_id
    docs: List[List[int]] = []
    batch = 256
    for start in range(0, len(dataset), batch):
        rows = dataset[start : start + batch][field]
        texts = [record_text(v, chat_format, tokenizer) for v in rows]
        encoded = tokenizer(texts, add_special_tokens=spec.add_special_tokens)["input_ids"]
        for ids in encoded:
            if spec.append_eos and eos is not None and (not ids or ids[-1] != eos):
                ids = list(ids) + [eos]
            if ids:
                docs.append(list(ids))
    return docs


def build_cache(spec: DataSpec, tokenizer: Any, folder: str) -> Dict[str, Any]:
    """Tokenise, split, pack and write the arrays to `folder` (atomically); return the summary."""
    train, evaluation = _load_splits(spec.path, os.path.join(os.path.dirname(folder), "hf_datasets"))
    field = resolve_text_field(train.column_names, spec.text_field, spec.path)
    chat_format = resolve_chat_format(spec.chat_template_format, tokenizer)
    if evaluation is None and spec.eval_split_ratio > 0 and len(train) > 1:
        n_eval = max(1, int(round(len(train) * spec.eval_split_ratio)))
        split = train.train_test_split(test_size=n_eval, seed=spec.seed, shuffle=True)
        train, evaluation = split["train"], split["test"]
    tmp = f"{folder}.tmp-{os.getpid()}"
    shutil.rmtree(tmp, ignore_errors=True)
    os.makedirs(tmp)
    summary: Dict[str, Any] = {"spec": asdict(spec), "text_field": field, "chat_format": chat_format}
    for name, part in (("train", train), ("eval", evaluation)):
        if part is None or len(part) == 0:
            continue
        docs = _tokenize(part, field, chat_format, tokenizer, spec)
        arrays = (
            pack_documents(docs, spec.max_seq_len, spec.packing_mode)
            if spec.packing
            else truncate_documents(docs, spec.max_seq_len)
        )
        for key, arr in arrays.items():
            np.save(os.path.join(tmp, f"{name}.{key}.npy"), arr)
        examples = arrays["input_ids"].shape[0] if spec.packing else len(arrays["offsets"]) - 1
        summary[name] = {"records": len(part), "tokens": int(sum(len(d) for d in docs)), "examples": int(examples)}
    if "train" not in summary:
        raise ValueError(f"dataset {spec.path!r} produced no training examples.")
    with open(os.path.join(tmp, "summary.json"), "w") as fh:
        json.dump(summary, fh, indent=2)
    try:
        os.rename(tmp, folder)
    except OSError:  # another node's rank built it first: theirs is identical
        shutil.rmtree(tmp, ignore_errors=True)
    return summary


# ----------------------------------------------------------------- datasets
class PackedBlocks(Dataset):
    """Fixed-length blocks; every item is a dict of int64 tensors of length max_seq_len."""

    def __init__(self, folder: str, split: str, attention_boundaries: bool) -> None:
        self.arrays = {
            k: np.load(os.path.join(folder, f"{split}.{k}.npy"), mmap_mode="r")
            for k in ("input_ids", "labels", "position_ids")
        }
        self.attention_boundaries = attention_boundaries

    def __len__(self) -> int:
        return int(self.arrays["input_ids"].shape[0])

    def __getitem__(self, i: int) -> Dict[str, torch.Tensor]:
        item = {k: torch.from_numpy(np.asarray(v[i], dtype=np.int64)) for k, v in self.arrays.items()}
        if not self.attention_boundaries:
            item.pop("position_ids")  # plain causal attention across the block
        return item


class Examples(Dataset):
    """One (truncated) document per item; `pad_collate` pads a batch."""

    def __init__(self, folder: str, split: str) -> None:
        self.tokens = np.load(os.path.join(folder, f"{split}.tokens.npy"), mmap_mode="r")
        self.offsets = np.load(os.path.join(folder, f"{split}.offsets.npy"))

    def __len__(self) -> int:
        return len(self.offsets) - 1

    def __getitem__(self, i: int) -> torch.Tensor:
        return torch.from_numpy(np.asarray(self.tokens[self.offsets[i] : self.offsets[i + 1]], dtype=np.int64))


class PadCollate:
    """Right-pad to the longest sequence in the batch; padding gets label -100 and attention 0."""

    def __init__(self, pad_id: int) -> None:
        self.pad_id = pad_id

    def __call__(self, batch: List[torch.Tensor]) -> Dict[str, torch.Tensor]:
        longest = max(len(x) for x in batch)
        ids = torch.full((len(batch), longest), self.pad_id, dtype=torch.long)
        mask = torch.zeros((len(batch), longest), dtype=torch.long)
        for row, x in enumerate(batch):
            ids[row, : len(x)] = x
            mask[row, : len(x)] = 1
        return {"input_ids": ids, "attention_mask": mask, "labels": ids.masked_fill(mask == 0, -100)}


@dataclass
class PreparedData:
    train: Dataset
    eval: Optional[Dataset]
    collate: Any
    summary: Dict[str, Any]
    folder: str


def build_on_rank0(spec: DataSpec, tokenizer: Any, cache_dir: str) -> str:
    """Global rank 0 builds the cache entry unless it exists; every rank gets the entry's folder."""
    folder = os.path.join(cache_dir, cache_key(spec, tokenizer))
    if is_global_zero() and not os.path.exists(folder):
        os.makedirs(cache_dir, exist_ok=True)
        build_cache(spec, tokenizer, folder)
    return folder


def load_prepared(spec: DataSpec, tokenizer: Any, cache_dir: str) -> PreparedData:
    """After rank 0's build (and a barrier): build it again on a node that cannot see it, then load it.

    Collective: every rank calls it.
    """
    env = detect_env()
    folder = os.path.join(cache_dir, cache_key(spec, tokenizer))
    if not os.path.exists(folder) and (env.local_rank if env is not None else 0) == 0:
        os.makedirs(cache_dir, exist_ok=True)  # this node does not share rank 0's disk
        build_cache(spec, tokenizer, folder)
    ops.barrier("tokenised-cache-per-node")
    with open(os.path.join(folder, "summary.json")) as fh:
        summary = json.load(fh)
    has_eval = "eval" in summary
    if spec.packing:
        boundaries = spec.packing_mode == "attention"
        train: Dataset = PackedBlocks(folder, "train", boundaries)
        evaluation = PackedBlocks(folder, "eval", boundaries) if has_eval else None
        collate = None
    else:
        train = Examples(folder, "train")
        evaluation = Examples(folder, "eval") if has_eval else None
        pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else (tokenizer.eos_token_id or 0)
        collate = PadCollate(pad)
    return PreparedData(train, evaluation, collate, summary, folder)


def prepare_data(spec: DataSpec, tokenizer: Any, cache_dir: str) -> PreparedData:
    """Build the cache on global rank 0 (then on any node that cannot see it), load it everywhere."""
    build_on_rank0(spec, tokenizer, cache_dir)
    ops.barrier("tokenised-cache")
    return load_prepared(spec, tokenizer, cache_dir)


class FinetuneData(DataModule):
    """The recipe's data for the Trainer, which calls prepare_data on each node's local rank 0 behind a
    barrier, then setup on every rank, then the loaders.

    prepare_data tokenises on global rank 0 only, so a cache folder every node
    shares is built once; setup builds it again where a node cannot see it
    (load_prepared) and memory-maps it. The eval loader exists only with
    `evaluate` (the recipe's eval_steps).
    """

    def __init__(self, options: DataOptions, spec: DataSpec, tokenizer: Any, cache_dir: str, evaluate: bool) -> None:
        self.options, self.spec, self.tokenizer, self.cache_dir = options, spec, tokenizer, cache_dir
        self.evaluate = evaluate
        self.prepared: Optional[PreparedData] = None

    def prepare_data(self) -> None:
        build_on_rank0(self.spec, self.tokenizer, self.cache_dir)

    def setup(self, stage: str) -> None:
        self.prepared = load_prepared(self.spec, self.tokenizer, self.cache_dir)

    def _loader(self, dataset: Dataset, batch_size: int, shuffle: bool) -> DataLoader:
        return DataLoader(
            dataset,
            batch_size=batch_size,
            shuffle=shuffle,
            collate_fn=self.prepared.collate,
            num_workers=self.options.dataloader_num_workers,
        )

    def train_dataloader(self) -> DataLoader:
        return self._loader(self.prepared.train, self.options.per_device_train_batch_size, shuffle=True)

    def val_dataloader(self) -> Optional[DataLoader]:
        if not self.evaluate or self.prepared.eval is None:
            return None
        return self._loader(self.prepared.eval, self.options.per_device_eval_batch_size, shuffle=False)

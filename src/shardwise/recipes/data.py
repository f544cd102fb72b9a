"""Chat / text records -> token blocks for causal-LM fine-tuning, tokenised once and cached on disk.

Records come from a local jsonl / json / parquet file or a `save_to_disk`
folder; chat messages are rendered with the tokenizer's chat template, or
else with the tagged format (`<|system|> ... <|endoftext|> <|prompter|> ...`).
With packing, documents share fixed-length blocks without leaking into each
other: each document's first label is -100, and under `packing="attention"`
(the default) position ids restart per document, which Hugging Face models
turn into a block-diagonal mask; `packing="loss"` masks only the boundary
labels (packing.py). With `assistant_only_loss` only the assistant turns
are labels (assistant_spans.py). Global rank 0 writes the token arrays to a
cache folder keyed by everything that changes them; the other ranks
memory-map the same files.
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
from shardwise.recipes import assistant_spans
from shardwise.recipes.packing import (  # PACKING_MODES and the packers are read from here too
    PACKING_MODES,  # noqa: F401
    pack_documents,
    target_tokens,
    truncate_documents,
)

CACHE_VERSION = 1
CHAT_FORMATS = ("auto", "tags", "tokenizer", "none")
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
        assistant_only_loss: train on the assistant turns of chat data only (as TRL's option): the
            system and user turns and the assistant's turn headers get label -100
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
    assistant_only_loss: bool = False

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
            assistant_only_loss=self.assistant_only_loss,
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
    assistant_only_loss: bool = False


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


def check_assistant_only_loss(options: DataOptions, text_field: str) -> None:
    """Up front (the recipe's validate_config): refuse assistant_only_loss where the data has no turns."""
    if options.assistant_only_loss:
        path, first = options.dataset, None
        if options.chat_template_format != "none":
            if path.endswith(".jsonl"):
                with open(path) as fh:
                    first = json.loads(next(line for line in fh if line.strip())).get(text_field)
            elif _kind(path) == "parquet":
                import pyarrow.parquet as pq

                first = pq.ParquetFile(path).read_row_group(0, columns=[text_field]).column(0)[0].as_py()
            else:
                first = _load_splits(path, None)[0][0][text_field]
        assistant_spans.check_value(first, options.chat_template_format, text_field)


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
    return format_tags_with_spans(messages)[0]


def format_tags_with_spans(messages: Sequence[Dict[str, str]]) -> Tuple[str, List[Tuple[int, int]]]:
    """The tagged text and its assistant spans: each assistant turn after its tag, through its end tag."""
    pieces = [(ROLE_TAGS[m["role"]], f" {m['content']} {END_TAG}", m["role"] == "assistant") for m in messages]
    return assistant_spans.join_with_spans(pieces)


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


def record_text_and_spans(value: Any, chat_format: str, tokenizer: Any, field: str, record: int) -> Tuple[str, list]:
    """record_text and the character spans of its assistant turns (assistant_only_loss)."""
    assistant_spans.check_value(value, chat_format, field, record)
    messages = _normalise_messages(value)
    if chat_format == "tokenizer":
        text = tokenizer.apply_chat_template(messages, tokenize=False)
        return text, assistant_spans.template_spans(messages, tokenizer, text, record)
    return format_tags_with_spans(messages)


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
    fields = asdict(spec)
    if not fields["assistant_only_loss"]:
        del fields["assistant_only_loss"]  # off: the key of caches written before the option existed
    blob = json.dumps(
        {
            "v": CACHE_VERSION,
            "spec": fields,
            "data": _file_fingerprint(spec.path),
            "tok": _tokenizer_fingerprint(tokenizer),
        },
        sort_keys=True,
        default=str,
    )
    return hashlib.sha256(blob.encode()).hexdigest()[:16]


def _tokenize(
    dataset: Any, field: str, chat_format: str, tokenizer: Any, spec: DataSpec
) -> Tuple[List[List[int]], Optional[List[np.ndarray]]]:
    """The documents' token ids and, with assistant_only_loss, which of their tokens are targets."""
    eos = tokenizer.eos_token_id
    only_assistant = spec.assistant_only_loss
    docs: List[List[int]] = []
    targets: List[np.ndarray] = []
    batch = 256
    for start in range(0, len(dataset), batch):
        rows = dataset[start : start + batch][field]
        if only_assistant:
            rendered = [record_text_and_spans(v, chat_format, tokenizer, field, start + j) for j, v in enumerate(rows)]
            texts = [text for text, _ in rendered]
            encoded = tokenizer(texts, add_special_tokens=spec.add_special_tokens, return_offsets_mapping=True)
            flags = [
                assistant_spans.token_targets(o, spans) for o, (_, spans) in zip(encoded["offset_mapping"], rendered)
            ]
        else:
            texts = [record_text(v, chat_format, tokenizer) for v in rows]
            encoded = tokenizer(texts, add_special_tokens=spec.add_special_tokens)
        for j, ids in enumerate(encoded["input_ids"]):
            ids = list(ids)
            flag = flags[j] if only_assistant else None
            if spec.append_eos and eos is not None and (not ids or ids[-1] != eos):
                ids.append(eos)
                if flag is not None:  # the EOS ends an answer when the document ends inside one
                    flag = np.append(flag, bool(flag[-1]) if len(flag) else False)
            if ids:
                docs.append(ids)
                if flag is not None:
                    targets.append(flag)
    return docs, (targets if only_assistant else None)


def build_cache(spec: DataSpec, tokenizer: Any, folder: str) -> Dict[str, Any]:
    """Tokenise, split, pack and write the arrays to `folder` (atomically); return the summary."""
    train, evaluation = _load_splits(spec.path, os.path.join(os.path.dirname(folder), "hf_datasets"))
    field = resolve_text_field(train.column_names, spec.text_field, spec.path)
    chat_format = resolve_chat_format(spec.chat_template_format, tokenizer)
    if spec.assistant_only_loss:
        assistant_spans.check_tokenizer(tokenizer)
        if len(train):
            assistant_spans.check_value(train[0][field], chat_format, field, 0)
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
        docs, targets = _tokenize(part, field, chat_format, tokenizer, spec)
        arrays = (
            pack_documents(docs, spec.max_seq_len, spec.packing_mode, targets)
            if spec.packing
            else truncate_documents(docs, spec.max_seq_len, targets)
        )
        for key, arr in arrays.items():
            np.save(os.path.join(tmp, f"{name}.{key}.npy"), arr)
        examples = arrays["input_ids"].shape[0] if spec.packing else len(arrays["offsets"]) - 1
        summary[name] = {"records": len(part), "tokens": int(sum(len(d) for d in docs)), "examples": int(examples)}
        if targets is not None:
            summary[name]["assistant_tokens"] = target_tokens(arrays, spec.packing)
    if "train" not in summary:
        raise ValueError(f"dataset {spec.path!r} produced no training examples.")
    if spec.assistant_only_loss and summary["train"]["assistant_tokens"] == 0:
        shutil.rmtree(tmp, ignore_errors=True)
        raise ValueError(
            f"assistant_only_loss: the training examples of {spec.path!r} hold no assistant tokens to train on "
            f"(no assistant turns, or every one cut off by max_seq_len={spec.max_seq_len}). Check the data's "
            "roles, raise max_seq_len, or turn assistant_only_loss off."
        )
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
    """One (truncated) document per item; `PadCollate` pads a batch. An item is its token ids, or with
    assistant_only_loss a dict of input_ids and labels (-100 where the token is not a target)."""

    def __init__(self, folder: str, split: str) -> None:
        self.tokens = np.load(os.path.join(folder, f"{split}.tokens.npy"), mmap_mode="r")
        self.offsets = np.load(os.path.join(folder, f"{split}.offsets.npy"))
        targets = os.path.join(folder, f"{split}.targets.npy")
        self.targets = np.load(targets, mmap_mode="r") if os.path.exists(targets) else None

    def __len__(self) -> int:
        return len(self.offsets) - 1

    def __getitem__(self, i: int) -> Any:
        where = slice(self.offsets[i], self.offsets[i + 1])
        ids = torch.from_numpy(np.asarray(self.tokens[where], dtype=np.int64))
        if self.targets is None:
            return ids
        keep = torch.from_numpy(np.array(self.targets[where], dtype=bool))  # a copy: the map is read-only
        return {"input_ids": ids, "labels": ids.masked_fill(~keep, -100)}


class PadCollate:
    """Right-pad to the longest sequence in the batch; padding gets label -100 and attention 0."""

    def __init__(self, pad_id: int) -> None:
        self.pad_id = pad_id

    def __call__(self, batch: List[Any]) -> Dict[str, torch.Tensor]:
        items = [x if isinstance(x, dict) else {"input_ids": x, "labels": x} for x in batch]
        longest = max(len(x["input_ids"]) for x in items)
        ids = torch.full((len(batch), longest), self.pad_id, dtype=torch.long)
        labels = torch.full((len(batch), longest), -100, dtype=torch.long)
        mask = torch.zeros((len(batch), longest), dtype=torch.long)
        for row, x in enumerate(items):
            n = len(x["input_ids"])
            ids[row, :n], labels[row, :n], mask[row, :n] = x["input_ids"], x["labels"], 1
        return {"input_ids": ids, "attention_mask": mask, "labels": labels}


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

    def __init__(
        self,
        options: DataOptions,
        spec: DataSpec,
        tokenizer: Any,
        cache_dir: str,
        evaluate: bool,
        pin_memory: bool = False,
    ) -> None:
        self.options, self.spec, self.tokenizer, self.cache_dir = options, spec, tokenizer, cache_dir
        self.evaluate = evaluate
        # On CUDA: batches in page-locked memory, so the copy to the GPU (move_to_device) is
        # asynchronous instead of a host wait per micro-batch.
        self.pin_memory = pin_memory
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
            pin_memory=self.pin_memory,
        )

    def train_dataloader(self) -> DataLoader:
        return self._loader(self.prepared.train, self.options.per_device_train_batch_size, shuffle=True)

    def val_dataloader(self) -> Optional[DataLoader]:
        if not self.evaluate or self.prepared.eval is None:
            return None
        return self._loader(self.prepared.eval, self.options.per_device_eval_batch_size, shuffle=False)

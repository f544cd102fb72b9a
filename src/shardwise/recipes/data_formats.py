"""The data shapes users bring to `shardwise finetune`: where the records are, which splits, which fields.

A dataset is a `.jsonl`/`.json`/`.csv`/`.parquet` file, a folder written by
datasets' `save_to_disk`, or a hub-style data folder (`data/train-*.parquet`,
`data/test-*.parquet`, what a hub snapshot holds), whose file names give the
splits (`train_sft`, `test_sft` ...). Records are plain text, chat messages
(any role the chat template knows, `tool` included; ChatML for a tokenizer
without a template, `chat_template_format='chatml'`), prompt/completion pairs
(strings, or lists of messages: TRL's prompt-completion type, trained on the
completion only) or Alpaca's instruction/input/output, which becomes a
prompt/completion pair through `ALPACA_PROMPT` / `ALPACA_PROMPT_NO_INPUT`
(axolotl's `alpaca` type). Everything here is read before any worker starts,
so an empty file or a malformed line is refused with the file and line
number instead of a traceback inside a worker; data.py tokenises what these
functions load.
"""

from __future__ import annotations

import csv
import json
import os
from typing import Any, Dict, List, Optional, Sequence, Tuple

PROMPT_COMPLETION = "prompt+completion"  # pseudo text fields: the record shape, named in the cache key
ALPACA = "instruction+input+output"
AUTO_FIELDS = ("messages", "conversations", "text", "content")
ALPACA_PROMPT = (
    "Below is an instruction that describes a task, paired with an input that provides further context. "
    "Write a response that appropriately completes the request.\n\n"
    "### Instruction:\n{instruction}\n\n### Input:\n{input}\n\n### Response:\n"
)
ALPACA_PROMPT_NO_INPUT = (
    "Below is an instruction that describes a task. "
    "Write a response that appropriately completes the request.\n\n"
    "### Instruction:\n{instruction}\n\n### Response:\n"
)
CHATML = (
    "{% for message in messages %}{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + "
    "'\\n' }}{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)
CHATML_TOKENS = ("<|im_start|>", "<|im_end|>")
EVAL_SPLITS = ("test", "validation", "eval")
_FILE_SUFFIXES = (".jsonl", ".json", ".jsonl.gz", ".json.gz", ".parquet", ".csv")
_SAVED_MARKERS = ("dataset_dict.json", "state.json", "dataset_info.json")


class DatasetFieldError(ValueError):
    """The requested text field is not in the dataset (the message lists the fields that are)."""


class DataFileError(ValueError):
    """A dataset file that cannot be read as records: empty, or a malformed line (named with its number)."""


# ------------------------------------------------------------------ sources
def source_kind(path: str) -> str:
    """disk (save_to_disk) | folder (hub-style data files) | json | parquet | csv."""
    if os.path.isdir(path):
        return "disk" if any(os.path.exists(os.path.join(path, m)) for m in _SAVED_MARKERS) else "folder"
    lower = path.lower()
    if lower.endswith((".jsonl", ".json", ".jsonl.gz", ".json.gz")):
        return "json"
    if lower.endswith(".parquet"):
        return "parquet"
    if lower.endswith(".csv"):
        return "csv"
    raise ValueError(
        f"dataset {path!r}: use a .jsonl/.json/.csv/.parquet file, a folder of such files (a hub snapshot: "
        "data/train-*.parquet ...), or a folder written by datasets' save_to_disk."
    )


def folder_splits(path: str) -> Dict[str, List[str]]:
    """A hub-style folder's splits and their files, as `datasets.load_dataset(folder)` would find them."""
    import datasets

    try:
        files = datasets.load_dataset_builder(path).config.data_files or {}
    except Exception as exc:  # no data file datasets recognises
        raise ValueError(
            f"dataset folder {path!r} holds no data files datasets can read ({exc}); expected e.g. "
            "data/train-00000-of-00001.parquet, train.jsonl, or a save_to_disk folder."
        ) from exc
    return {str(split): [str(f) for f in names] for split, names in files.items()}


def available_splits(path: str) -> Optional[List[str]]:
    """The source's split names, or None for a single file (one unnamed split)."""
    kind = source_kind(path)
    if kind == "folder":
        return sorted(folder_splits(path))
    if kind == "disk":
        import datasets

        loaded = datasets.load_from_disk(path)
        return list(loaded) if isinstance(loaded, datasets.DatasetDict) else None
    return None


def eval_split_for(train_split: str, splits: Sequence[str]) -> Optional[str]:
    """The held-out split that goes with `train_split`: test_sft for train_sft, else test / validation / eval."""
    candidates = [train_split.replace("train", name) for name in EVAL_SPLITS if "train" in train_split]
    return next((s for s in [*candidates, *EVAL_SPLITS] if s in splits and s != train_split), None)


def pick_splits(path: str, split: Optional[str], eval_split: Optional[str]) -> Tuple[Optional[str], Optional[str]]:
    """(train split, eval split or None) by name, checked against the source (None for a single file).

    A source with one split (a file, or a folder holding only train files) has no eval split to name: an
    eval split asked for there is held out of it instead (eval_split_ratio), as for the recipe's
    `--splits train,test` on data that has only a train split."""
    splits = available_splits(path)
    if not splits or len(splits) == 1:
        only = splits[0] if splits else None
        if split not in (None, "train", only):
            raise ValueError(
                f"dataset_split={split!r}, but {path!r} has "
                + (f"one split only, {only!r}" if only else "no named splits (one file)")
                + "; drop dataset_split, or give a folder whose files name the splits (data/train_sft-*.parquet ...)."
            )
        return only, None
    train = split or ("train" if "train" in splits else splits[0])
    if train not in splits:
        raise ValueError(f"dataset_split={train!r} is not a split of {path!r}; its splits are {splits}.")
    if eval_split is not None and eval_split not in splits:
        raise ValueError(
            f"eval split {eval_split!r} is not a split of {path!r}; its splits are {splits}. Name one of "
            "them (--splits train,test / --eval_split), or set eval_split_ratio to hold records out."
        )
    return train, eval_split or eval_split_for(train, splits)


def _split_files(path: str, split: Optional[str]) -> List[str]:
    kind = source_kind(path)
    if kind == "folder":
        return folder_splits(path)[split]
    return [path] if kind != "disk" else []


# ------------------------------------------------------------------ checks
def check_file(path: str) -> None:
    """Refuse an empty file or a malformed JSON line, naming the file and the line (before any worker starts)."""
    if not os.path.isfile(path) or path.endswith(".gz"):
        return
    if os.path.getsize(path) == 0:
        raise DataFileError(f"dataset {path!r} is empty (0 bytes): no records to train on. Point at the data file.")
    kind = source_kind(path)
    records = 0
    if kind == "json":
        with open(path, encoding="utf-8") as fh:
            head = fh.read(1).lstrip() or fh.read(4096).lstrip()[:1]
        if path.lower().endswith(".json") and head == "[":  # one JSON array: read whole
            try:
                with open(path, encoding="utf-8") as fh:
                    records = len(json.load(fh))
            except json.JSONDecodeError as exc:
                raise DataFileError(f"dataset {path!r} line {exc.lineno} is not valid JSON: {exc.msg}.") from exc
        else:
            records = _check_json_lines(path)
    elif kind == "csv":
        with open(path, newline="", encoding="utf-8") as fh:
            rows = csv.reader(fh)
            header = next(rows, None)
            records = 1 if header and next(rows, None) is not None else 0
    elif kind == "parquet":
        import pyarrow.parquet as pq

        records = pq.ParquetFile(path).metadata.num_rows
    if records == 0:
        raise DataFileError(f"dataset {path!r} holds no records (only blank lines or a header); add records.")


def _check_json_lines(path: str) -> int:
    records = 0
    with open(path, encoding="utf-8") as fh:
        for number, line in enumerate(fh, start=1):
            if not line.strip():
                continue
            try:
                value = json.loads(line)
            except json.JSONDecodeError as exc:
                raise DataFileError(
                    f"dataset {path!r} line {number} is not valid JSON ({exc.msg} at column {exc.colno}): "
                    f"{line.strip()[:80]!r}. Fix or delete that line (one JSON object per line)."
                ) from exc
            if not isinstance(value, dict):
                raise DataFileError(
                    f"dataset {path!r} line {number} is a JSON {type(value).__name__}, not an object of fields: "
                    f'{line.strip()[:80]!r}. Each line must be one record, e.g. {{"messages": [...]}}.'
                )
            records += 1
    return records


def check_source(path: str, split: Optional[str], eval_split: Optional[str]) -> None:
    """Every file the run reads, checked: exists, not empty, no malformed line."""
    if not os.path.exists(path):
        raise FileNotFoundError(f"dataset {path!r} does not exist.")
    train, evaluation = pick_splits(path, split, eval_split)
    for name in {train, evaluation} - {None} if source_kind(path) == "folder" else [None]:
        for file in _split_files(path, name):
            check_file(file)


def columns(path: str, split: Optional[str] = None) -> List[str]:
    """The record fields, read cheaply (first record / header / schema / saved features)."""
    if not os.path.exists(path):
        raise FileNotFoundError(f"dataset {path!r} does not exist.")
    kind = source_kind(path)
    if kind == "folder":
        train, _ = pick_splits(path, split, None)
        return columns(folder_splits(path)[train][0])
    if kind == "json" and not path.endswith(".gz"):
        with open(path, encoding="utf-8") as fh:
            for line in fh:
                if line.strip():
                    try:
                        first = json.loads(line)
                    except json.JSONDecodeError:  # a pretty-printed .json: datasets reads it below
                        break
                    if isinstance(first, dict):
                        return list(first)
                    break
    if kind == "csv":
        with open(path, newline="", encoding="utf-8") as fh:
            return list(next(csv.reader(fh), []))
    if kind == "parquet":
        import pyarrow.parquet as pq

        return list(pq.read_schema(path).names)
    return list(load_splits(path, None, split, None)[0].column_names)


def first_record(path: str, split: Optional[str] = None) -> Dict[str, Any]:
    """The first record, read cheaply (a line, a row group, a CSV row) for up-front checks."""
    kind = source_kind(path)
    if kind == "folder":
        return first_record(folder_splits(path)[pick_splits(path, split, None)[0]][0])
    if kind == "json" and path.lower().endswith(".jsonl"):
        with open(path, encoding="utf-8") as fh:
            return json.loads(next(line for line in fh if line.strip()))
    if kind == "csv":
        with open(path, newline="", encoding="utf-8") as fh:
            return next(csv.DictReader(fh))
    if kind == "parquet":
        import pyarrow.parquet as pq

        return pq.ParquetFile(path).read_row_group(0).slice(0, 1).to_pylist()[0]
    return load_splits(path, None, split, None)[0][0]


def load_splits(
    path: str, cache_dir: Optional[str], split: Optional[str], eval_split: Optional[str]
) -> Tuple[Any, Any]:
    """(train, eval or None) as `datasets` objects; eval is the source's own split when it has one."""
    import datasets

    kind = source_kind(path)
    train_name, eval_name = pick_splits(path, split, eval_split)
    if kind == "disk":
        loaded = datasets.load_from_disk(path)
        if isinstance(loaded, datasets.DatasetDict):
            return loaded[train_name], (loaded[eval_name] if eval_name else None)
        return loaded, None
    if kind == "folder":
        files = folder_splits(path)
        builder = source_kind(files[train_name][0])
        wanted = {n: files[n] for n in (train_name, eval_name) if n}
        loaded = datasets.load_dataset(builder, data_files=wanted, cache_dir=cache_dir)
        return loaded[train_name], (loaded[eval_name] if eval_name else None)
    return datasets.load_dataset(kind, data_files=path, split="train", cache_dir=cache_dir), None


# ------------------------------------------------------------------ fields
def resolve_text_field(names: Sequence[str], text_field: Optional[str], path: str) -> str:
    """The field the text comes from, or the record shape: PROMPT_COMPLETION / ALPACA."""
    if text_field is None:
        if "prompt" in names and "completion" in names:
            return PROMPT_COMPLETION  # TRL's prompt-completion type wins, as in SFTTrainer
        for name in AUTO_FIELDS:
            if name in names:
                return name
        if "instruction" in names and "output" in names:
            return ALPACA
        raise DatasetFieldError(
            f"dataset {path!r} has none of the usual text fields {list(AUTO_FIELDS)}, nor prompt/completion "
            f"nor instruction/output; its fields are {list(names)}. Set dataset_text_field."
        )
    needed = {PROMPT_COMPLETION: ["prompt", "completion"], ALPACA: ["instruction", "output"]}.get(
        text_field, [text_field]
    )
    missing = [n for n in needed if n not in names]
    if missing:
        raise DatasetFieldError(
            f"dataset_text_field={text_field!r} is not a field of {path!r}; its fields are {list(names)}."
        )
    return text_field


def alpaca_prompt(instruction: Any, extra: Any) -> str:
    """Alpaca's prompt (axolotl's `alpaca` type); the record's `output` is the completion."""
    if extra is None or str(extra).strip() == "":
        return ALPACA_PROMPT_NO_INPUT.format(instruction=instruction)
    return ALPACA_PROMPT.format(instruction=instruction, input=extra)


def pairs(rows: Dict[str, List[Any]], shape: str) -> List[Tuple[Any, Any]]:
    """(prompt, completion) per record of a batch of PROMPT_COMPLETION or ALPACA rows."""
    if shape == ALPACA:
        extras = rows.get("input") or [None] * len(rows["instruction"])
        return [(alpaca_prompt(i, x), str(o)) for i, x, o in zip(rows["instruction"], extras, rows["output"])]
    out = list(zip(rows["prompt"], rows["completion"]))
    for prompt, completion in out:
        if isinstance(prompt, str) != isinstance(completion, str):
            raise ValueError(
                f"a prompt/completion record mixes text and messages (prompt {type(prompt).__name__}, completion "
                f"{type(completion).__name__}): give both as text, or both as lists of role/content messages."
            )
    return out


def common_prefix(a: Sequence[int], b: Sequence[int]) -> int:
    """Leading tokens `a` and `b` share: where a completion starts when the prompt's last token merges with it."""
    n = 0
    for x, y in zip(a, b):
        if x != y:
            break
        n += 1
    return n


# ------------------------------------------------------------------ ChatML
def check_chatml_room(chat_template_format: str, tokenizer_dir: str, config: Any) -> None:
    """Up front: ChatML's markers, added to a tokenizer without a template, need rows in the embedding."""
    if chat_template_format != "chatml":
        return
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(tokenizer_dir)
    if getattr(tokenizer, "chat_template", None):
        return
    missing = chatml_missing_tokens(tokenizer)
    text_config = config.get_text_config() if hasattr(config, "get_text_config") else config
    rows = getattr(text_config, "vocab_size", None)
    if missing and rows is not None and len(tokenizer) + len(missing) > rows:
        raise ValueError(
            f"chat_template_format='chatml': the tokenizer has no chat template and lacks ChatML's markers "
            f"{missing}, and the model's {rows} embedding rows leave no room to add them ({len(tokenizer)} "
            "tokens already). Use a tokenizer with a chat template (chat_template_format='tokenizer'), the "
            "tagged format ('tags'), or text records ('none')."
        )


def chatml_missing_tokens(tokenizer: Any) -> List[str]:
    """ChatML's markers the tokenizer lacks (chat_template_format='chatml' adds them as special tokens)."""
    vocab = tokenizer.get_vocab()
    return [t for t in CHATML_TOKENS if t not in vocab]


def apply_chatml(tokenizer: Any) -> None:
    """chat_template_format='chatml': a tokenizer with no chat template gets ChatML and its two markers."""
    if getattr(tokenizer, "chat_template", None):
        return  # the tokenizer's own template, as the model was trained with it
    missing = chatml_missing_tokens(tokenizer)
    if missing:
        tokenizer.add_tokens(missing, special_tokens=True)
    tokenizer.chat_template = CHATML

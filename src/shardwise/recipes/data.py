"""Chat / text records -> token blocks for causal-LM fine-tuning, tokenised once and cached on disk.

Records come from a local file or folder (data_formats.py: the shapes
users bring, checked before any worker starts); chat messages are rendered
with the tokenizer's chat template, ChatML, or else with the tagged format
(`<|system|> ... <|endoftext|> <|prompter|> ...`); prompt/completion records
train on the completion only, as TRL's SFTTrainer.
With packing, documents share fixed-length blocks without leaking into each
other: each document's first label is -100, and under `packing="attention"`
(the default) position ids restart per document, which Hugging Face models
turn into a block-diagonal mask; `packing="loss"` masks only the boundary
labels (packing.py). With `assistant_only_loss` only the assistant turns
are labels (assistant_spans.py). Global rank 0 writes the token arrays to a
cache folder keyed by everything that changes them (under HF_HOME unless
cache_dir says otherwise, so runs share it; a lock keeps two concurrent
runs from building one entry twice); the other ranks memory-map the files.
`DataOptions` are the recipe's data options as the user gives them;
`FinetuneData` is the DataModule that hands them to the Trainer, which runs
its `prepare_data` (the tokenisation) before any rank reads the cache.
"""

from __future__ import annotations

import functools
import hashlib
import json
import os
from dataclasses import asdict, dataclass
from typing import Any, Dict, List, Optional, Sequence, Tuple

import numpy as np
from torch.utils.data import DataLoader, Dataset

from shardwise.checkpoint.lock import waiting_lock
from shardwise.distributed import ops
from shardwise.distributed.env import detect_env, is_global_zero
from shardwise.module import DataModule
from shardwise.recipes import assistant_spans, data_formats, data_wait, token_cache
from shardwise.recipes.data_formats import (  # read from here too
    ALPACA,
    CHATML,  # noqa: F401
    PROMPT_COMPLETION,
    DatasetFieldError,  # noqa: F401
    apply_chatml,
    check_chatml_room,  # noqa: F401
    resolve_text_field,
)
from shardwise.recipes.packing import (  # PACKING_MODES, the packers and the datasets are read from here too
    PACKING_MODES,  # noqa: F401
    Examples,
    PackedBlocks,
    PadCollate,
    pack_documents,  # noqa: F401
    target_tokens,  # noqa: F401
    truncate_documents,  # noqa: F401
)

CACHE_VERSION = 2  # 2: token shards + masks (token_cache.py); 1 stored labels and positions
CHAT_FORMATS = ("auto", "tags", "tokenizer", "chatml", "none")
ROLE_TAGS = {"system": "<|system|>", "user": "<|prompter|>", "assistant": "<|assistant|>"}
END_TAG = "<|endoftext|>"
_ROLE_ALIASES = {"human": "user", "prompter": "user", "gpt": "assistant", "bot": "assistant", "model": "assistant"}
DEFAULT_EVAL_SPLIT_RATIO = 0.05  # held out when evaluation is asked for and the data has no eval split


@dataclass
class DataOptions:
    """The fine-tuning recipe's data options (`FinetuneConfig.data`; on the command line
    `--data.max_seq_len` or, as before they were nested, `--max_seq_len`).

    Args:
        dataset: .jsonl / .json / .csv / .parquet file, a folder of them as a hub snapshot lays them out
            (data/train-*.parquet, data/test-*.parquet), or a folder written by datasets' save_to_disk
        dataset_text_field: record field with text or chat messages (default: prompt+completion when the
            records have both, else the first of messages, conversations, text, content, else
            instruction+input+output, Alpaca's fields)
        dataset_split: the split trained on (default: train, else the only one)
        eval_split: the split evaluated on (default: the one that goes with dataset_split -- test_sft for
            train_sft -- else test / validation / eval when the data has one)
        chat_template_format: auto (the tokenizer's template, else tags) | tags
            (<|system|>/<|prompter|>/<|assistant|>) | tokenizer | chatml (the tokenizer's template, else
            ChatML) | none (text used as is; messages by the tokenizer's own template)
        max_seq_len: tokens per example / packed block
        packing: concatenate documents into max_seq_len blocks
        packing_mode: attention (no attention across documents) | loss (only boundary labels masked)
        add_special_tokens: let the tokenizer add its BOS/EOS
        append_concat_token: end every document with EOS (default: plain text and completions that do not
            end with it, as TRL; never after a chat rendering, whose template ends each turn itself)
        eval_split_ratio: held-out fraction when the dataset has no eval split (default: 0.05 when
            evaluation is asked for -- eval_steps, eval_strategy or an eval split named -- else 0: every
            record is trained on)
        cache_dir: tokenised-data cache (default $HF_HOME/shardwise/tokenized), shared by runs
        per_device_train_batch_size: examples per process per micro-batch
        per_device_eval_batch_size: examples per process per eval batch
        dataloader_num_workers: DataLoader worker processes
        assistant_only_loss: train on the assistant turns of chat data only (as TRL's option): the
            system and user turns and the assistant's turn headers get label -100
        completion_only_loss: with prompt/completion (or Alpaca) records, train on the completion only
            (TRL's option; default true)
        dataset_num_proc: processes that tokenise the data set (default: every core this process may use;
            the tokens are the same for any number)
    """

    dataset: str = ""
    dataset_text_field: Optional[str] = None
    dataset_split: Optional[str] = None
    eval_split: Optional[str] = None
    chat_template_format: str = "auto"
    max_seq_len: int = 2048
    packing: bool = True
    packing_mode: str = "attention"
    add_special_tokens: bool = False
    append_concat_token: Optional[bool] = None
    eval_split_ratio: Optional[float] = None
    cache_dir: Optional[str] = None
    per_device_train_batch_size: int = 1
    per_device_eval_batch_size: int = 1
    dataloader_num_workers: int = 0
    assistant_only_loss: bool = False
    completion_only_loss: bool = True
    dataset_num_proc: Optional[int] = None

    def spec(self, text_field: str, seed: int, evaluate: bool = False) -> "DataSpec":
        """What decides the token arrays: these options with the text field resolved and the split's seed;
        `evaluate`: evaluation was asked for, so records are held out where the data has no eval split."""
        ratio = self.eval_split_ratio
        if ratio is None:
            ratio = DEFAULT_EVAL_SPLIT_RATIO if (evaluate or self.eval_split) else 0.0
        return DataSpec(
            path=os.path.abspath(self.dataset),
            text_field=text_field,
            chat_template_format=self.chat_template_format,
            max_seq_len=self.max_seq_len,
            packing=self.packing,
            packing_mode=self.packing_mode,
            add_special_tokens=self.add_special_tokens,
            append_eos=self.append_concat_token,
            eval_split_ratio=ratio,
            seed=seed,
            assistant_only_loss=self.assistant_only_loss,
            split=self.dataset_split,
            eval_split=self.eval_split,
            completion_only_loss=self.completion_only_loss,
        )


@dataclass(frozen=True)
class DataSpec:
    """Everything that decides the token arrays; its hash names the cache entry (with the data's
    fingerprint and `revision`, a hub data set's resolved commit, when there is one)."""

    path: str
    text_field: Optional[str] = None
    chat_template_format: str = "auto"
    max_seq_len: int = 2048
    packing: bool = True
    packing_mode: str = "attention"
    add_special_tokens: bool = False
    append_eos: Optional[bool] = None
    eval_split_ratio: float = 0.0
    seed: int = 42
    assistant_only_loss: bool = False
    split: Optional[str] = None
    eval_split: Optional[str] = None
    completion_only_loss: bool = True
    revision: Optional[str] = None


# ------------------------------------------------------------------ records
def dataset_columns(path: str, split: Optional[str] = None) -> List[str]:
    """The record fields, read cheaply (first line / header / schema / saved features) for up-front checks."""
    return data_formats.columns(path, split)


def _load_splits(path: str, cache_dir: Optional[str], split: Optional[str] = None, eval_split: Optional[str] = None):
    return data_formats.load_splits(path, cache_dir, split, eval_split)


def check_assistant_only_loss(options: DataOptions, text_field: str) -> None:
    """Up front (the recipe's validate_config): refuse assistant_only_loss where the data has no turns."""
    if options.assistant_only_loss:
        check_assistant_only_pairs(text_field)
        first = None
        if options.chat_template_format != "none":
            first = data_formats.first_record(options.dataset, options.dataset_split).get(text_field)
        assistant_spans.check_value(first, options.chat_template_format, text_field)


# --------------------------------------------------------------- formatting
def _normalise_messages(value: Any, any_role: bool = False) -> List[Dict[str, Any]]:
    """role/content messages (ShareGPT's from/value too). `any_role`: a chat template renders them, so a
    role such as `tool` and keys such as `tool_calls` are left to it; the tagged format has three roles."""
    out = []
    for msg in value:
        if not isinstance(msg, dict):
            raise ValueError(f"a chat message must be a dict with role/content, got {msg!r}")
        role = msg.get("role", msg.get("from"))
        content = msg.get("content", msg.get("value"))
        role = _ROLE_ALIASES.get(str(role).lower(), str(role).lower())
        if not any_role and role not in ROLE_TAGS:
            raise ValueError(
                f"chat role {role!r} has no tag in the tagged format (system / user / assistant); a tokenizer "
                "chat template renders any role: use chat_template_format='tokenizer' (or 'chatml')."
            )
        rest = {k: v for k, v in msg.items() if k not in ("role", "from", "content", "value")} if any_role else {}
        out.append({"role": role, "content": "" if content is None else str(content), **rest})
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
    has_template = bool(getattr(tokenizer, "chat_template", None))
    if chat_template_format == "auto":
        return "tokenizer" if has_template else "tags"
    if chat_template_format == "chatml":
        apply_chatml(tokenizer)
        return "tokenizer"
    if chat_template_format == "tokenizer" and not has_template:
        raise ValueError(
            "chat_template_format='tokenizer' but the tokenizer has no chat_template; use 'chatml', 'tags' "
            "(the <|system|>/<|prompter|>/<|assistant|> format) or 'auto'."
        )
    return chat_template_format


def record_text(value: Any, chat_format: str, tokenizer: Any, generation_prompt: bool = False) -> str:
    if isinstance(value, str):
        return value  # already formatted text: used as is whatever the chat format
    if chat_format == "none" and not getattr(tokenizer, "chat_template", None):
        raise ValueError(
            "chat_template_format='none' uses text as it is and messages with the tokenizer's own chat "
            f"template, but the field holds {type(value).__name__} and the tokenizer has no template; use "
            "'chatml' or 'tags' for chat messages."
        )
    if chat_format in ("tokenizer", "none"):
        messages = _normalise_messages(value, any_role=True)
        return tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=generation_prompt)
    return format_tags(_normalise_messages(value))


def record_text_and_spans(value: Any, chat_format: str, tokenizer: Any, field: str, record: int) -> Tuple[str, list]:
    """record_text and the character spans of its assistant turns (assistant_only_loss)."""
    assistant_spans.check_value(value, chat_format, field, record)
    if chat_format == "tokenizer":
        messages = _normalise_messages(value, any_role=True)
        text = tokenizer.apply_chat_template(messages, tokenize=False)
        return text, assistant_spans.template_spans(messages, tokenizer, text, record)
    return format_tags_with_spans(_normalise_messages(value))


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
    later = ("split", "eval_split", "revision", "append_eos")  # unset: the key as before the option existed
    fields = {k: v for k, v in asdict(spec).items() if v is not None or k not in later}
    if not fields["assistant_only_loss"]:
        del fields["assistant_only_loss"]  # off: the key of caches written before the option existed
    if fields["completion_only_loss"]:
        del fields["completion_only_loss"]
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


def _ids_and_offsets(tokenizer: Any, texts: List[str], add: bool) -> Tuple[List[List[int]], List[Any]]:
    """Token ids and character offsets of `texts`: from the Rust tokenizer directly when the call would not
    change its settings (no truncation or padding set on it, special tokens split as the wrapper splits them),
    skipping the wrapper's per-record conversion (a sixth of the call's time); else through the wrapper."""
    backend = getattr(tokenizer, "_tokenizer", None)
    direct = (
        backend is not None
        and backend.truncation is None
        and backend.padding is None
        and backend.encode_special_tokens == bool(getattr(tokenizer, "split_special_tokens", False))
    )
    if not direct:
        encoded = tokenizer(texts, add_special_tokens=add, return_offsets_mapping=True)
        return encoded["input_ids"], encoded["offset_mapping"]
    encodings = backend.encode_batch(texts, add_special_tokens=add)
    return [e.ids for e in encodings], [e.offsets for e in encodings]


def _render(
    rows: Dict[str, List[Any]], field: str, chat_format: str, tokenizer: Any, spec: DataSpec, start: int
) -> Tuple[Any, List[bool], Optional[List[np.ndarray]]]:
    """One batch of records: (encoded, is-chat per record, target flags per token or None).

    Prompt/completion (and Alpaca) records are tokenised as TRL does: the prompt alone (a conversation's
    with its generation prompt) and prompt + completion, the completion starting where the two part."""
    add = spec.add_special_tokens
    if field in (PROMPT_COMPLETION, ALPACA):
        prompts, texts, chat = [], [], []
        for prompt, completion in data_formats.pairs(rows, field):
            is_chat = not isinstance(prompt, str)
            if is_chat and chat_format == "tags":
                prompts.append(record_text(prompt, chat_format, tokenizer))
            else:
                prompts.append(record_text(prompt, chat_format, tokenizer, generation_prompt=True))
            texts.append(
                record_text(list(prompt) + list(completion), chat_format, tokenizer) if is_chat else prompt + completion
            )
            chat.append(is_chat)
        encoded = tokenizer(texts, add_special_tokens=add)
        prompt_ids = tokenizer(prompts, add_special_tokens=add)["input_ids"]
        flags = [
            np.arange(len(ids)) >= data_formats.common_prefix(p, ids)
            for p, ids in zip(prompt_ids, encoded["input_ids"])
        ]
        return encoded, chat, (flags if spec.completion_only_loss else None)
    values = rows[field]
    chat = [not isinstance(v, str) for v in values]
    if spec.assistant_only_loss:
        rendered = [record_text_and_spans(v, chat_format, tokenizer, field, start + j) for j, v in enumerate(values)]
        ids, offsets = _ids_and_offsets(tokenizer, [t for t, _ in rendered], add)
        flags = [assistant_spans.token_targets(o, spans) for o, (_, spans) in zip(offsets, rendered)]
        return {"input_ids": ids}, chat, flags
    return tokenizer([record_text(v, chat_format, tokenizer) for v in values], add_special_tokens=add), chat, None


class RecordEncoder:
    """A batch of records (as columns) -> per record its token ids and, with assistant_only_loss or
    completion-only prompt/completion records, which of its tokens are targets: what each corpus worker
    runs (corpus/prepare.py's encode_chunks; forked workers inherit it with its tokenizer).

    EOS ends a document where append_eos says; unset, as TRL: after plain text and a text completion that
    do not end with it, never after a chat rendering (the template already ends each turn)."""

    def __init__(self, tokenizer: Any, field: str, chat_format: str, spec: DataSpec) -> None:
        self.tokenizer, self.field, self.chat_format, self.spec = tokenizer, field, chat_format, spec
        needed = {PROMPT_COMPLETION: ("prompt", "completion"), ALPACA: ("instruction", "output")}
        self.needed = needed.get(field, (field,))

    def __call__(self, rows: Dict[str, List[Any]], count: int, first: int) -> List[Tuple[List[int], Any]]:
        for name in self.needed:  # a field no record of the batch has: None for each, as datasets reads it
            rows.setdefault(name, [None] * count)
        encoded, chat, flags = _render(rows, self.field, self.chat_format, self.tokenizer, self.spec, first)
        eos = self.tokenizer.eos_token_id
        out = []
        for j, ids in enumerate(encoded["input_ids"]):
            ids = ids if isinstance(ids, list) else list(ids)
            flag = flags[j] if flags is not None else None
            append = self.spec.append_eos if self.spec.append_eos is not None else not chat[j]
            if append and eos is not None and (not ids or ids[-1] != eos):
                ids.append(eos)
                if flag is not None:  # the EOS ends an answer when the document ends inside one
                    flag = np.append(flag, bool(flag[-1]) if len(flag) else False)
            out.append((ids, flag))
        return out


def build_cache(
    spec: DataSpec, tokenizer: Any, folder: str, num_proc: Optional[int] = None, report: Any = None
) -> Dict[str, Any]:
    """Tokenise (num_proc worker processes, default every core), split and write the entry `folder`
    (token_cache.py: renamed into place when complete); return the summary. `report(progress)` hears how far."""
    hf_cache = os.path.join(os.path.dirname(folder), "hf_datasets")  # only for what datasets must read
    train, evaluation, names, first = token_cache.record_sources(
        spec.path, spec.split, spec.eval_split, hf_cache, os.path.basename(folder)
    )
    field = resolve_text_field(names, spec.text_field, spec.path)
    chat_format = resolve_chat_format(spec.chat_template_format, tokenizer)
    pairs = field in (PROMPT_COMPLETION, ALPACA)
    if spec.assistant_only_loss:
        check_assistant_only_pairs(field)
        assistant_spans.check_tokenizer(tokenizer)
        if first:
            assistant_spans.check_value(first.get(field), chat_format, field, 0)
    masks = spec.assistant_only_loss or (pairs and spec.completion_only_loss)
    counted = ("completion_tokens" if pairs else "assistant_tokens") if masks else None
    head = {"spec": asdict(spec), "text_field": field, "chat_format": chat_format}
    encoder = RecordEncoder(tokenizer, field, chat_format, spec)
    return token_cache.build(
        folder, spec, encoder, (train, evaluation), len(tokenizer), head, counted, num_proc, report
    )


def check_assistant_only_pairs(field: str) -> None:
    if field in (PROMPT_COMPLETION, ALPACA):
        raise assistant_spans.AssistantSpanError(
            f"assistant_only_loss with {field} records: they train on the completion only already "
            "(completion_only_loss); turn assistant_only_loss off."
        )


def default_cache_dir() -> str:
    """Where tokenised data is cached when cache_dir is unset: beside Hugging Face's own caches, shared by
    runs (never inside output_dir, which is uploaded and exported)."""
    from huggingface_hub import constants

    return os.path.join(constants.HF_HOME, "shardwise", "tokenized")


def _entry_lock(cache_dir: str, key: str):
    """Held while one entry is built: a second run with the same data waits, then finds it built (it
    checks for the entry before building, and builds write a private folder renamed into place)."""
    return waiting_lock(os.path.join(cache_dir, f".{key}.lock"))


# ----------------------------------------------------------------- datasets
@dataclass
class PreparedData:
    train: Dataset
    eval: Optional[Dataset]
    collate: Any
    summary: Dict[str, Any]
    folder: str


def _entry(spec: DataSpec, tokenizer: Any, cache_dir: str) -> Tuple[str, str]:
    if spec.chat_template_format == "chatml":
        apply_chatml(tokenizer)  # before the key: the template is part of it
    key = cache_key(spec, tokenizer)
    return key, os.path.join(cache_dir, key)


def _build_if_missing(
    spec: DataSpec, tokenizer: Any, cache_dir: str, num_proc: Optional[int] = None, report: Any = None
) -> str:
    key, folder = _entry(spec, tokenizer, cache_dir)
    if not os.path.exists(folder):
        with _entry_lock(cache_dir, key):
            if not os.path.exists(folder):  # another run may have built it while this one waited
                build_cache(spec, tokenizer, folder, num_proc, report)
    return folder


def build_on_rank0(spec: DataSpec, tokenizer: Any, cache_dir: str, num_proc: Optional[int] = None) -> str:
    """Global rank 0 builds the cache entry unless it exists; every rank gets the entry's folder."""
    if is_global_zero():
        return _build_if_missing(spec, tokenizer, cache_dir, num_proc)
    return _entry(spec, tokenizer, cache_dir)[1]


def _load(spec: DataSpec, tokenizer: Any, folder: str) -> PreparedData:
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


def load_prepared(spec: DataSpec, tokenizer: Any, cache_dir: str, num_proc: Optional[int] = None) -> PreparedData:
    """After rank 0's build (and a barrier): build it again on a node that cannot see it, then load it.

    Collective: every rank calls it.
    """
    env = detect_env()
    key, folder = _entry(spec, tokenizer, cache_dir)
    if not os.path.exists(folder) and (env.local_rank if env is not None else 0) == 0:
        _build_if_missing(spec, tokenizer, cache_dir, num_proc)  # this node does not share rank 0's disk
    ops.barrier("tokenised-cache-per-node")
    return _load(spec, tokenizer, folder)


def prepare_data(spec: DataSpec, tokenizer: Any, cache_dir: str, num_proc: Optional[int] = None) -> PreparedData:
    """Build the cache on global rank 0 (then on any node that cannot see it), load it everywhere."""
    build_on_rank0(spec, tokenizer, cache_dir, num_proc)
    ops.barrier("tokenised-cache")
    return load_prepared(spec, tokenizer, cache_dir, num_proc)


_GENERATIONS: Dict[str, int] = {}  # builds of an entry coordinated so far by this process (store keys stay fresh)


def prepare_waiting(
    spec: DataSpec, tokenizer: Any, cache_dir: str, num_proc: Optional[int] = None, stall_s: float = 1800.0
) -> PreparedData:
    """prepare_data for a running process group, with no collective that times out while the data is tokenised:
    global rank 0 builds while every other rank waits on its progress in the store (data_wait.py), then local
    rank 0 of a node that cannot see the entry builds it while that node's ranks wait. Collective."""
    import torch.distributed as dist
    from torch.distributed import distributed_c10d

    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() == 1:
        return prepare_data(spec, tokenizer, cache_dir, num_proc)
    env, rank = detect_env(), dist.get_rank()
    store = distributed_c10d._get_default_store()
    key, folder = _entry(spec, tokenizer, cache_dir)
    _GENERATIONS[key] = generation = _GENERATIONS.get(key, 0) + 1
    base = f"shardwise/tokenised/{key}/{generation}"
    build = functools.partial(_build_if_missing, spec, tokenizer, cache_dir, num_proc)
    board = data_wait.Board(store, f"{base}/global", os.path.join(cache_dir, f".{key}.progress.json"))
    if rank == 0:
        data_wait.run_posting(board, "global rank 0", lambda report: build(report))
    else:
        data_wait.wait_for(board, "global rank 0", f"rank {rank}", stall_s)
    node_rank, local_rank = (env.node_rank, env.local_rank) if env is not None else (0, rank)
    node = data_wait.Board(store, f"{base}/node{node_rank}")
    who = f"local rank 0 of node {node_rank}"
    if local_rank == 0:
        if rank == 0:
            node.post({"phase": "done"})
        else:  # builds only where this node does not see rank 0's entry
            data_wait.run_posting(node, who, lambda report: build(report))
    else:
        data_wait.wait_for(node, who, f"rank {rank}", stall_s)
    return _load(spec, tokenizer, folder)


class FinetuneData(DataModule):
    """The recipe's data for the Trainer, which calls prepare_data on each node's local rank 0 behind a
    barrier, then setup on every rank, then the loaders.

    One process: prepare_data tokenises. Several: prepare_data does nothing
    (the Trainer's barrier after it would time out under a long tokenisation)
    and setup tokenises on global rank 0 while the other ranks wait on its
    progress (prepare_waiting), so a cache folder every node shares is built
    once; a node that cannot see it builds its own. Every rank then
    memory-maps it. The eval loader exists only with `evaluate` (the recipe's
    eval_steps).
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
        if detect_env() is None or not detect_env().is_distributed:
            build_on_rank0(self.spec, self.tokenizer, self.cache_dir, self.options.dataset_num_proc)

    def setup(self, stage: str) -> None:
        strategy = getattr(getattr(self, "trainer", None), "strategy", None)
        stall_s = float(getattr(strategy, "timeout_s", 1800.0))
        num_proc = self.options.dataset_num_proc
        self.prepared = prepare_waiting(self.spec, self.tokenizer, self.cache_dir, num_proc, stall_s)

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

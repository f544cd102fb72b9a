"""Which tokens of a chat record are the assistant's: the targets of `assistant_only_loss` (data.py).

The loss covers what the model must generate -- each assistant turn's
content and the marker that ends the turn -- and nothing it is given: the
system and user turns, and the assistant's own turn header (`<|assistant|>`,
`<|im_start|>assistant`), which at inference is the prompt. The spans are
found as characters of the rendered text, then mapped onto the tokens
through the fast tokenizer's offsets, so the token ids are exactly those of
the unmasked run. The tagged format builds its text piece by piece and knows
its spans. A tokenizer chat template with `{% generation %}` markers says
them itself (transformers' assistant mask, as TRL uses it); any other
template is rendered prefix by prefix: the assistant turn `i` starts where
the conversation up to `i` with the generation prompt ends, and stops where
the conversation through `i` ends. A template that does not render a
conversation as the concatenation of its turns (one that rewrites earlier
turns, for example) gives no such spans and is refused, naming the record.
"""

from __future__ import annotations

import itertools
import re
from typing import Any, Dict, List, Optional, Sequence, Tuple

import numpy as np

Span = Tuple[int, int]  # [start, end) characters of the rendered text
GENERATION_MARK = re.compile(r"\{%-?\s*generation\s*-?%\}")
FIX = "use chat_template_format='tags', or a chat template with {% generation %} markers around the assistant turns"


class AssistantSpanError(ValueError):
    """The assistant turns of a record cannot be told apart from the rest (the message says why and the fix)."""


def join_with_spans(pieces: Sequence[Tuple[str, str, bool]], sep: str = " ") -> Tuple[str, List[Span]]:
    """`sep.join(header + body)` of (header, body, is_target) pieces, and the spans of the target bodies."""
    parts: List[str] = []
    spans: List[Span] = []
    at = 0
    for i, (header, body, target) in enumerate(pieces):
        if i:
            parts.append(sep)
            at += len(sep)
        parts.append(header + body)
        if target:
            spans.append((at + len(header), at + len(header) + len(body)))
        at += len(header) + len(body)
    return "".join(parts), spans


def template_source(tokenizer: Any) -> str:
    template = getattr(tokenizer, "chat_template", None)
    if isinstance(template, dict):  # named templates: apply_chat_template uses the default one
        template = template.get("default", next(iter(template.values()), None))
    return template or ""


def template_spans(messages: List[Dict[str, str]], tokenizer: Any, text: str, record: int) -> List[Span]:
    """The assistant spans of `text`, the tokenizer template's rendering of `messages` (record number `record`)."""
    if GENERATION_MARK.search(template_source(tokenizer)):
        return _marked_spans(messages, tokenizer, text, record)
    spans: List[Span] = []
    for i, message in enumerate(messages):
        if message["role"] != "assistant":
            continue
        if i == 0:
            raise AssistantSpanError(
                f"assistant_only_loss: record {record} starts with an assistant turn, so the chat template "
                f"cannot be asked where that turn's answer begins (no conversation precedes it); {FIX}."
            )
        prompt = tokenizer.apply_chat_template(messages[:i], tokenize=False, add_generation_prompt=True)
        through = tokenizer.apply_chat_template(messages[: i + 1], tokenize=False)
        if not (through.startswith(prompt) and text.startswith(through)):
            raise AssistantSpanError(
                f"assistant_only_loss: the chat template does not render record {record} as the concatenation "
                f"of its turns (the conversation up to turn {i} is not a prefix of the whole), so its assistant "
                f"turns cannot be found; {FIX}."
            )
        if len(through) > len(prompt):
            spans.append((len(prompt), len(through)))
    return spans


def _marked_spans(messages: List[Dict[str, str]], tokenizer: Any, text: str, record: int) -> List[Span]:
    """The template's own {% generation %} spans, as characters (transformers marks them per token)."""
    out = tokenizer.apply_chat_template(
        messages,
        tokenize=True,
        return_dict=True,
        return_assistant_tokens_mask=True,
        tokenizer_kwargs={"return_offsets_mapping": True},
    )
    # One span per marked token: the same text tokenized the same way maps each onto itself.
    spans = [(int(a), int(b)) for flag, (a, b) in zip(out["assistant_masks"], out["offset_mapping"]) if flag and b > a]
    if spans and spans[-1][1] > len(text):
        raise AssistantSpanError(
            f"assistant_only_loss: the chat template's generation markers of record {record} point past its "
            f"rendered text; {FIX}."
        )
    return spans


def token_targets(offsets: Sequence[Sequence[int]], spans: Sequence[Span]) -> np.ndarray:
    """Per token: does it overlap an assistant span? (Added special tokens have empty offsets: never.)"""
    if not len(offsets):
        return np.zeros(0, dtype=bool)
    flat = itertools.chain.from_iterable(offsets)  # pairs read flat: np.asarray of tuples is 2-3x slower
    bounds = np.fromiter(flat, dtype=np.int64, count=2 * len(offsets)).reshape(-1, 2)
    starts, ends = bounds[:, 0], bounds[:, 1]
    targets = np.zeros(len(bounds), dtype=bool)
    for a, b in spans:
        targets |= (starts < b) & (ends > a) & (ends > starts)
    return targets


def check_tokenizer(tokenizer: Any) -> None:
    """The token offsets need a fast (Rust) tokenizer."""
    if not getattr(tokenizer, "is_fast", False):
        raise AssistantSpanError(
            f"assistant_only_loss needs a fast tokenizer (character offsets of each token), but "
            f"{type(tokenizer).__name__} is a slow one. Save the tokenizer with its tokenizer.json "
            "(AutoTokenizer.from_pretrained(..., use_fast=True).save_pretrained(folder)), or turn "
            "assistant_only_loss off."
        )


def check_value(value: Any, chat_format: str, field: str, record: Optional[int] = None) -> None:
    """Refuse what has no turns: plain text, or chat_template_format='none'."""
    where = f"record {record}'s " if record is not None else ""
    if chat_format == "none":
        raise AssistantSpanError(
            "assistant_only_loss needs chat turns, but chat_template_format='none' uses the text as it is, "
            "with no turns to tell the assistant's from the rest. Use chat_template_format='auto', 'tags' or "
            "'tokenizer' with a field of chat messages, or turn assistant_only_loss off."
        )
    if isinstance(value, str):
        raise AssistantSpanError(
            f"assistant_only_loss needs chat messages (a list of role/content dicts), but {where}field "
            f"{field!r} holds text, whose turns cannot be found reliably. Point dataset_text_field at a field "
            "of messages, or turn assistant_only_loss off."
        )

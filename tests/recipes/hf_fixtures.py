"""Tiny Hugging Face fixtures built locally: a Llama with random weights, a word-level tokenizer, chat data.

Nothing is downloaded. The chat data is learnable (each question has one
fixed answer), so a few dozen steps visibly lower the loss.
"""
from __future__ import annotations

import json
import os
import random
from typing import Dict, List, Optional

SPECIALS = ["<unk>", "<pad>", "<s>", "<|endoftext|>", "<|system|>", "<|prompter|>", "<|assistant|>"]
COLOURS = ["red", "green", "blue", "yellow", "black", "white", "orange", "purple"]
THINGS = ["sky", "grass", "sea", "sun", "night", "snow", "carrot", "plum", "leaf", "cloud", "coal", "lemon"]


def chat_records(n: int = 240, seed: int = 0) -> List[Dict]:
    rng = random.Random(seed)
    answer = {t: COLOURS[i % len(COLOURS)] for i, t in enumerate(THINGS)}
    records = []
    for _ in range(n):
        thing = rng.choice(THINGS)
        messages = [
            {"role": "system", "content": "you are a helpful assistant"},
            {"role": "user", "content": f"what colour is the {thing} ?"},
            {"role": "assistant", "content": f"the {thing} is {answer[thing]} ."},
        ]
        if rng.random() < 0.5:
            messages += [{"role": "user", "content": "are you sure ?"},
                         {"role": "assistant", "content": f"yes , the {thing} is {answer[thing]} ."}]
        records.append({"messages": messages, "id": len(records)})
    return records


def write_jsonl(path: str, records: List[Dict]) -> str:
    with open(path, "w") as fh:
        for r in records:
            fh.write(json.dumps(r) + "\n")
    return path


def build_tokenizer(texts: List[str]):
    from tokenizers import Tokenizer, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.WordLevel(unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.train_from_iterator(texts, trainers.WordLevelTrainer(special_tokens=SPECIALS))
    return PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="<unk>", pad_token="<pad>", bos_token="<s>",
                                   eos_token="<|endoftext|>", model_max_length=128)


def build_model_folder(path: str, records: Optional[List[Dict]] = None, *, hidden: int = 64, layers: int = 2,
                       heads: int = 4, kv_heads: int = 2, intermediate: int = 128, max_positions: int = 128,
                       tie: bool = False, seed: int = 0, vocab_pad: int = 0, dtype=None) -> str:
    """Save a random-weight Llama and its tokenizer to `path` (what a downloaded checkpoint looks like)."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    records = records if records is not None else chat_records()
    texts = [m["content"] for r in records for m in r["messages"]]
    tokenizer = build_tokenizer(texts)
    config = LlamaConfig(vocab_size=len(tokenizer) + vocab_pad, hidden_size=hidden, intermediate_size=intermediate,
                         num_hidden_layers=layers, num_attention_heads=heads, num_key_value_heads=kv_heads,
                         max_position_embeddings=max_positions, tie_word_embeddings=tie,
                         bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id,
                         pad_token_id=tokenizer.pad_token_id)
    torch.manual_seed(seed)
    model = LlamaForCausalLM(config)
    if dtype is not None:
        model = model.to(dtype)
    os.makedirs(path, exist_ok=True)
    model.save_pretrained(path)
    tokenizer.save_pretrained(path)
    return path

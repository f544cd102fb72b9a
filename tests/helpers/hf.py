"""Tiny Hugging Face fixtures built locally: a Llama with random weights, a word-level tokenizer, chat data,
and the command line of the fine-tuning recipe users copy (its train.py flags and Accelerate FSDP config).

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
            messages += [
                {"role": "user", "content": "are you sure ?"},
                {"role": "assistant", "content": f"yes , the {thing} is {answer[thing]} ."},
            ]
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
    return PreTrainedTokenizerFast(
        tokenizer_object=tok,
        unk_token="<unk>",
        pad_token="<pad>",
        bos_token="<s>",
        eos_token="<|endoftext|>",
        model_max_length=128,
    )


def build_model_folder(
    path: str,
    records: Optional[List[Dict]] = None,
    *,
    hidden: int = 64,
    layers: int = 2,
    heads: int = 4,
    kv_heads: int = 2,
    intermediate: int = 128,
    max_positions: int = 128,
    tie: bool = False,
    seed: int = 0,
    vocab_pad: int = 0,
    dtype=None,
) -> str:
    """Save a random-weight Llama and its tokenizer to `path` (what a downloaded checkpoint looks like)."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    records = records if records is not None else chat_records()
    texts = [m["content"] for r in records for m in r["messages"]]
    tokenizer = build_tokenizer(texts)
    config = LlamaConfig(
        vocab_size=len(tokenizer) + vocab_pad,
        hidden_size=hidden,
        intermediate_size=intermediate,
        num_hidden_layers=layers,
        num_attention_heads=heads,
        num_key_value_heads=kv_heads,
        max_position_embeddings=max_positions,
        tie_word_embeddings=tie,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
    )
    torch.manual_seed(seed)
    model = LlamaForCausalLM(config)
    if dtype is not None:
        model = model.to(dtype)
    os.makedirs(path, exist_ok=True)
    model.save_pretrained(path)
    tokenizer.save_pretrained(path)
    return path


# What `accelerate config` writes for the two-node Llama recipe (FSDP, bf16, 2 x 8 GPUs).
ACCELERATE_FSDP_YAML = """\
compute_environment: LOCAL_MACHINE
debug: false
distributed_type: FSDP
downcast_bf16: 'no'
fsdp_config:
  fsdp_auto_wrap_policy: TRANSFORMER_BASED_WRAP
  fsdp_backward_prefetch_policy: BACKWARD_PRE
  fsdp_cpu_ram_efficient_loading: true
  fsdp_forward_prefetch: false
  fsdp_offload_params: false
  fsdp_sharding_strategy: 1
  fsdp_state_dict_type: SHARDED_STATE_DICT
  fsdp_sync_module_states: true
  fsdp_use_orig_params: true
machine_rank: 0
main_training_function: main
mixed_precision: bf16
num_machines: {machines}
num_processes: {processes}
rdzv_backend: static
same_network: true
tpu_env: []
tpu_use_cluster: false
tpu_use_sudo: false
use_cpu: false
"""


def seed_records(n=40):
    """The recipe's dataset shape: one `content` string per conversation, already formatted."""
    out = []
    for r in chat_records(n):
        tags = {"system": "<|system|>", "user": "<|prompter|>", "assistant": "<|assistant|>"}
        out.append({"content": " ".join(f"{tags[m['role']]} {m['content']} <|endoftext|>" for m in r["messages"])})
    return out


def train_args(model, data, output_dir, *, max_steps=2, eval_steps=1, save_steps=2, logging_steps=1, max_seq_len=32):
    """train.py's flags exactly as the recipe prints them; only model, data, paths and sizes scaled down."""
    return [
        "--seed",
        "100",
        "--model_name",
        model,
        "--dataset_name",
        data,
        "--chat_template_format",
        "none",
        "--add_special_tokens",
        "False",
        "--append_concat_token",
        "False",
        "--splits",
        "train,test",
        "--max_seq_len",
        str(max_seq_len),
        "--max_steps",
        str(max_steps),
        "--logging_steps",
        str(logging_steps),
        "--log_level",
        "info",
        "--eval_steps",
        str(eval_steps),
        "--save_steps",
        str(save_steps),
        "--logging_strategy",
        "steps",
        "--evaluation_strategy",
        "steps",
        "--save_strategy",
        "steps",
        "--push_to_hub",
        "--hub_private_repo",
        "True",
        "--hub_strategy",
        "every_save",
        "--bf16",
        "True",
        "--packing",
        "True",
        "--learning_rate",
        "5e-5",
        "--lr_scheduler_type",
        "cosine",
        "--weight_decay",
        "0.01",
        "--warmup_ratio",
        "0.03",
        "--max_grad_norm",
        "1.0",
        "--output_dir",
        output_dir,
        "--per_device_train_batch_size",
        "1",
        "--per_device_eval_batch_size",
        "1",
        "--gradient_accumulation_steps",
        "1",
        "--gradient_checkpointing",
        "True",
        "--use_reentrant",
        "False",
        "--dataset_text_field",
        "content",
        "--use_flash_attn",
        "True",
        "--ddp_timeout",
        "5400",
        "--optim",
        "paged_adamw_32bit",
    ]


def gather_trained_weights(module):
    """after_fit hook (runs on every rank): the trained model's full tensors, on rank 0."""
    import torch.distributed as dist
    from torch.distributed.tensor import DTensor

    from shardwise.fqn import canonical_name

    out = {}
    for name, p in module.model.named_parameters():
        full = p.full_tensor() if isinstance(p, DTensor) else p
        out[canonical_name(name)] = full.detach().cpu().clone()
    return out if not dist.is_initialized() or dist.get_rank() == 0 else None

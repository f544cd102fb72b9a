# The flags of the SFT recipe users copy (PEFT's train.py, TRL's SFTConfig) reach the options they mean:
# --max_length, --use_gradient_checkpointing, --use_peft_lora, --use_4bit_quantization, --chat_template_format
# chatml, --eval_strategy / --save_strategy epoch|steps|no and --splits; two spellings of one option with
# different values are refused by name.
from __future__ import annotations

import pytest

from shardwise.cli.finetune import parser as build_parser
from shardwise.recipes import finetune as F
from shardwise.recipes.finetune import FinetuneConfig
from shardwise.recipes.hf_args import translate_argv


def config(*argv):
    translated, _ = translate_argv(list(argv))
    ns = build_parser().parse_args(translated)
    return FinetuneConfig(**{k: v for k, v in ns.as_dict().items() if k != "config"})


def test_the_recipes_flags_map_to_our_options():
    cfg = config(
        "--max_length", "512",
        "--use_gradient_checkpointing", "True",
        "--use_4bit_quantization", "True",
        "--use_peft_lora", "True",
        "--chat_template_format", "chatml",
        "--splits", "train_sft,test_sft",
        "--eval_strategy", "epoch",
        "--save_strategy", "epoch",
    )  # fmt: skip
    assert cfg.data.max_seq_len == 512 and cfg.gradient_checkpointing and cfg.load_in_4bit
    assert cfg.lora_r == 64  # the recipe's own default when --lora_r is not given
    assert cfg.data.chat_template_format == "chatml"
    assert (cfg.data.dataset_split, cfg.data.eval_split) == ("train_sft", "test_sft")
    assert (cfg.eval_strategy, cfg.save_strategy) == ("epoch", "epoch")
    assert config("--use_peft_lora", "True", "--lora_r", "8").lora_r == 8
    assert config("--use_peft_lora", "False", "--lora_r", "8").lora_r == 0  # the recipe ignores lora_r then
    assert config("--evaluation_strategy", "no").eval_strategy == "no"
    assert (
        config("--splits", "train").data.dataset_split == "train"
        and config("--splits", "train").data.eval_split is None
    )
    # the same value under both names is no conflict
    assert config("--max_length", "64", "--max_seq_len", "64").data.max_seq_len == 64


def test_two_spellings_with_different_values_are_refused_by_name():
    with pytest.raises(ValueError, match="--max_length 512 and --max_seq_len 1024 both set max_seq_len"):
        translate_argv(["--max_length", "512", "--max_seq_len", "1024"])
    with pytest.raises(ValueError, match="--gradient_checkpointing false and --use_gradient_checkpointing true"):
        translate_argv(["--gradient_checkpointing", "false", "--use_gradient_checkpointing", "True"])


def test_epoch_and_no_strategies_set_the_cadence():
    by_epoch = F._callbacks(FinetuneConfig(save_strategy="epoch", output_dir="o"))
    assert [(c.every_n_epochs, bool(c.every_n_train_steps)) for c in by_epoch] == [(1, False)]
    assert F._callbacks(FinetuneConfig(save_strategy="no", save_steps=5)) == []
    steps = F._callbacks(FinetuneConfig(save_steps=5))
    assert [c.every_n_train_steps for c in steps] == [5]
    assert F._evaluates(FinetuneConfig(eval_strategy="epoch"))
    assert not F._evaluates(FinetuneConfig(eval_strategy="no", eval_steps=5))
    assert F._evaluates(FinetuneConfig(eval_steps=5)) and not F._evaluates(FinetuneConfig())

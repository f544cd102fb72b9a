"""`shardwise pretrain`: a Hugging Face causal LM from scratch on prepared corpora (recipes/pretrain.py).

    shardwise pretrain --model llama-3.1-8b --data corpora/web:0.7,corpora/code:0.3 --seq_length 4096 \
        --global_batch_size 512 --micro_batch_size 2 --max_steps 20000 --save_steps 500 --devices 8

The options are the fields of `PretrainConfig`, as flags or in a YAML file (`--config run.yaml`); `--data`
is also a YAML list there. Bad input (a corpus not prepared, a tokenizer larger than the model's
vocabulary, a sequence longer than its positions, a weight that is not positive) is refused before any
worker starts.
"""

from __future__ import annotations

from typing import Any

from jsonargparse import ActionConfigFile, ArgumentParser


def parser() -> ArgumentParser:
    from shardwise.recipes.pretrain import PretrainConfig

    p = ArgumentParser(description="Pre-train a Hugging Face causal LM from scratch on prepared corpora.")
    p.add_argument("--config", action=ActionConfigFile, help="YAML file with any of the options below")
    p.add_class_arguments(PretrainConfig, fail_untyped=False)
    return p


def run(cfg: Any) -> int:
    from shardwise.recipes.pretrain import PretrainConfig, pretrain

    pretrain(PretrainConfig(**{k: v for k, v in cfg.as_dict().items() if k != "config"}))
    return 0

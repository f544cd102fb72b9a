"""`shardwise finetune`: the fine-tuning recipe (recipes/finetune.py) from a YAML config and flags.

The options are the fields of `FinetuneConfig`; its nested data options
(`DataOptions`) are `--data.<name>` or, as before they were nested, plain
`--<name>` (`--max_seq_len`), and either spelling works in a YAML config
too. The flags of the Hugging Face recipe (`--per_device_train_batch_size`, `--fsdp_config`, an Accelerate
config, ...) are also accepted and translated to ours (recipes/hf_args.py),
with a note for each one that changes meaning.
"""

from __future__ import annotations

import dataclasses
import sys
import typing
from typing import Any, List

import docstring_parser
from jsonargparse import ActionConfigFile, ArgumentParser


def parser() -> ArgumentParser:
    from shardwise.recipes.finetune import FinetuneConfig

    p = ArgumentParser(description="Fine-tune a local Hugging Face causal LM (full fine-tuning, 1 to N nodes).")
    p.add_argument("--config", action=ActionConfigFile, help="YAML file with any of the options below")
    p.add_class_arguments(FinetuneConfig, fail_untyped=False, skip={"data"})
    add_data_options(p)
    return p


def add_data_options(p: ArgumentParser) -> None:
    """DataOptions as `--data.<name>`, each with its flat name as an alias (jsonargparse maps a flat
    key in a YAML config through the alias as well), so configs written before the nesting still parse."""
    from shardwise.recipes.data import DataOptions

    docs = {d.arg_name: d.description for d in docstring_parser.parse(DataOptions.__doc__ or "").params}
    hints = typing.get_type_hints(DataOptions)
    group = p.add_argument_group("Data options (FinetuneConfig.data: --data.<name>, or --<name> as before)")
    for f in dataclasses.fields(DataOptions):
        group.add_argument(f"--data.{f.name}", f"--{f.name}", type=hints[f.name], default=f.default, help=docs[f.name])


def translate(argv: List[str]) -> List[str]:
    """The Hugging Face recipe's flags in our names; the notes go to stderr once (rank 0)."""
    from shardwise.distributed.env import is_global_zero
    from shardwise.recipes.hf_args import translate_argv

    if "--profile_steps" in argv:  # START END, as two words: jsonargparse takes a tuple as one ("[3,5]")
        at = argv.index("--profile_steps") + 1
        if len(argv) >= at + 2 and all(word.isdigit() for word in argv[at : at + 2]):
            argv = argv[:at] + [f"[{argv[at]},{argv[at + 1]}]"] + argv[at + 2 :]
    argv = _target_modules_as_list(argv)
    argv, notes = translate_argv(argv)
    if is_global_zero():
        for note in notes:
            print(f"shardwise finetune: note: {note}", file=sys.stderr)
    return argv


def _target_modules_as_list(argv: List[str]) -> List[str]:
    """`--lora_target_modules all-linear` or `q_proj,v_proj` (PEFT's spelling, unquoted) as the list
    jsonargparse expects; `[q_proj,v_proj]` passes unchanged."""
    out = list(argv)
    for i, word in enumerate(out[:-1]):
        value = out[i + 1]
        if word == "--lora_target_modules" and not value.startswith(("[", "-")) and value.lower() != "null":
            out[i + 1] = "[" + ",".join(v.strip() for v in value.split(",") if v.strip()) + "]"
    return out


def run(cfg: Any) -> int:
    from shardwise.distributed.env import is_global_zero
    from shardwise.recipes.finetune import FinetuneConfig, finetune

    result = finetune(FinetuneConfig(**{k: v for k, v in cfg.as_dict().items() if k != "config"}))
    if result is not None and result.losses and is_global_zero():
        print(
            f"[finetune] done: {len(result.losses)} steps, final loss {result.losses[-1]['loss']:.4f}; "
            f"Hugging Face folder in {result.output_dir}"
        )
    return 0

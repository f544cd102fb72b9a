"""A full fine-tuning recipe checkpoint (`shardwise finetune`) as a Hugging Face folder that loads.

The recipe's TrainModule (recipes/causal_lm.py) holds the Hugging Face model
as `self.model`, so its checkpoints name every tensor `model.<the HF name>`
and hold no config. `shardwise convert` recognises such a checkpoint by what
the recipe module itself stores in it (its loss history, under
causal_lm.HISTORY_KEY) together with every tensor carrying that prefix, never
by the names alone. The names lose the prefix; tied copies (lm_head.weight
under tie_word_embeddings) are left out as save_pretrained leaves them out
(hf_model.export_items on the architecture built on the meta device from the
base config), and every name and shape is checked against that architecture
before anything is written. The config comes from the base model folder the
checkpoint records (the recipe module stores its --model_path), or from
--base_model, which wins (a moved folder; checkpoints written before the
folder was recorded); config.json, the generation config and tokenizer files
are then written as the recipe's own export writes them
(hf_model.write_model_files).
"""

from __future__ import annotations

import os
from typing import Any, Dict, List, Optional, Tuple

import torch

from shardwise.checkpoint.reader import TensorInfo

PREFIX = "model."  # the recipe module's attribute holding the Hugging Face model


def is_recipe_checkpoint(state: Dict[str, Any], infos: List[TensorInfo]) -> bool:
    """A full checkpoint (its trainer state, its tensors) written by the fine-tuning recipe's module (adapter
    checkpoints are not asked)."""
    if not infos or not all(i.name.startswith(PREFIX) for i in infos):
        return False  # cheap test first: a plain module's checkpoint never imports the recipe
    from shardwise.recipes.causal_lm import HISTORY_KEY

    return HISTORY_KEY in state


def base_config(state: Dict[str, Any], path: str, base_model: Optional[str]) -> Tuple[str, Any]:
    """(the model folder the run fine-tuned, its config): --base_model, else the folder the checkpoint at `path`
    records in its trainer `state`; an error naming --base_model when neither holds a config.json."""
    from shardwise.recipes.causal_lm import HISTORY_KEY

    recorded = (state.get(HISTORY_KEY) or {}).get("model_path")
    fix = (
        "give the folder the run fine-tuned (its --model_path) with --base_model: convert takes config.json, "
        "generation_config.json and the tokenizer files from there; or give OUT as a .safetensors file for the "
        "weights alone."
    )
    folder = base_model or recorded
    if folder is None:
        raise ValueError(
            f"{path} is a fine-tuning recipe checkpoint: it holds the weights but no config.json, and it "
            f"does not record its base model folder (written before shardwise recorded it), so the folder would "
            f"not load with from_pretrained. {fix}"
        )
    if not os.path.isfile(os.path.join(folder, "config.json")):
        which = (
            f"--base_model {folder!r}" if base_model else f"the base model folder the checkpoint records, {folder!r},"
        )
        raise ValueError(f"{which} has no config.json (missing or moved?). {fix}")
    from transformers import AutoConfig

    return folder, AutoConfig.from_pretrained(folder)


def hf_names(infos: List[TensorInfo], config: Any, base_model: str) -> List[Tuple[TensorInfo, str]]:
    """(checkpoint tensor, its Hugging Face name) for every tensor save_pretrained would write, in checkpoint
    order; the checkpoint must hold exactly the architecture of `config` (tied copies aside)."""
    from transformers import AutoModelForCausalLM

    from shardwise.recipes.hf_model import export_items

    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config)
    expected = {name: list(t.shape) for name, t in export_items(model, config)}
    every = set(model.state_dict())  # tied copies under each of their names
    by_name = {i.name[len(PREFIX) :]: i for i in infos}
    missing = sorted(set(expected) - set(by_name))
    unknown = sorted(set(by_name) - every)
    shapes = [
        f"{n}: {list(by_name[n].shape)} vs {s}"
        for n, s in expected.items()
        if n in by_name and list(by_name[n].shape) != s
    ]
    if missing or unknown or shapes:
        raise ValueError(
            f"the checkpoint does not hold the architecture of {os.path.join(base_model, 'config.json')}: "
            + (f"missing {missing[:6]}; " if missing else "")
            + (f"not in that model {unknown[:6]}; " if unknown else "")
            + (f"shapes (checkpoint vs config) {shapes[:6]}; " if shapes else "")
            + "give --base_model the folder the run fine-tuned (its --model_path)."
        )
    return [(info, name) for name, info in by_name.items() if name in expected]

"""Adapter checkpoints: only the trainable weights and their optimizer state, and the base they belong to.

When the module a run trains is an adapter model (`shardwise.adapters.is_adapter_model`:
a `peft.PeftModel`, or a module holding one), every checkpoint the run saves
is an adapter checkpoint, automatically: the model part holds the trainable
parameters only (LoRA's A and B matrices, and whatever else trains), the
optimizers' state is the same as always (it exists for trainable parameters
only), and the rest -- RNG, loop position, schedulers, callbacks -- is
unchanged, so resuming is as exact as for a full checkpoint, at the same or
another world size, in the "full" and "sharded" formats alike. The frozen
base weights are not saved: the resumed run loads them from the base model
again, as the first run did. The manifest records which base that was
(`adapter.base`): the base's config, the names and sizes of its weight files
with a sha256 of each file's first and last MiB (reading 2 MiB a file, not
the model), and the names and sizes of the frozen parameters. A resume
compares them with the running model and refuses another base by name
(`check_resume`). A Trainer whose model has frozen parameters but no PEFT
adapter keeps saving full checkpoints. `record` is also what `shardwise
inspect` and `shardwise convert` read: the PEFT config and where the
PeftModel sits in the module, so an adapter checkpoint converts to a PEFT
adapter folder without the model (`write_adapter_folder`; merging it into
the base, which needs transformers, is recipes/convert.py's).
"""

from __future__ import annotations

import dataclasses
import functools
import hashlib
import json
import os
from typing import Any, Dict, List, Optional, Set, Tuple

import torch
from torch import nn
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict
from torch.nn.parallel import DistributedDataParallel

from shardwise.adapters.lora import count_parameters, full_numel, is_adapter_model
from shardwise.checkpoint.errors import CheckpointMismatchError
from shardwise.fqn import canonical_name

ADAPTER_KEY = "adapter"  # in the manifest (state["shardwise"]): present for adapter checkpoints only
SAMPLE_BYTES = 2**20  # hashed at each end of every base weight file
_WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth", ".index.json")
# Config fields that say how the base is run here, not which base it is.
_RUN_FIELDS = {
    "_name_or_path",
    "name_or_path",
    "transformers_version",
    "dtype",
    "torch_dtype",
    "_attn_implementation",
    "_attn_implementation_autoset",
    "attn_implementation",
    "use_cache",
    "quantization_config",
    "_commit_hash",
}


def _plain(value: Any) -> Any:
    """JSON-safe copy: sets become sorted lists, enums and other objects their string."""
    return json.loads(json.dumps(value, default=lambda v: sorted(v) if isinstance(v, (set, frozenset)) else str(v)))


def _peft_model(module: nn.Module) -> Tuple[str, Optional[nn.Module]]:
    """(name of the PeftModel inside `module` with a trailing dot, or "", the PeftModel or None)."""
    try:
        from peft import PeftModel
    except ImportError:
        return "", None
    for name, sub in module.named_modules():
        if isinstance(sub, PeftModel):
            name = canonical_name(name)
            return (name + "." if name else ""), sub
    return "", None


def _base_config(module: nn.Module, peft_model: Optional[nn.Module]) -> Dict[str, Any]:
    base = peft_model.get_base_model() if peft_model is not None else module
    config = next((m.config for m in base.modules() if hasattr(getattr(m, "config", None), "to_dict")), None)
    if config is None:
        return {}
    return {k: v for k, v in _plain(config.to_dict()).items() if k not in _RUN_FIELDS}


def _base_folder(module: nn.Module, peft_model: Optional[nn.Module]) -> Optional[str]:
    candidates = []
    if peft_model is not None:
        candidates += [c.base_model_name_or_path for c in peft_model.peft_config.values()]
    candidates += [getattr(getattr(m, "config", None), "_name_or_path", None) for m in module.modules()]
    return next((c for c in candidates if isinstance(c, str) and c and os.path.isdir(c)), None)


@functools.lru_cache(maxsize=8)
def _sampled(path: str, size: int, mtime: float) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as fh:
        digest.update(fh.read(SAMPLE_BYTES))
        if size > SAMPLE_BYTES:
            fh.seek(max(SAMPLE_BYTES, size - SAMPLE_BYTES))
            digest.update(fh.read(SAMPLE_BYTES))
    return digest.hexdigest()


def weight_files(folder: str) -> Dict[str, List[Any]]:
    """{file name: [size, sha256 of its first and last MiB]} of the weight files in a model folder."""
    out: Dict[str, List[Any]] = {}
    for name in sorted(os.listdir(folder)):
        path = os.path.join(folder, name)
        if name.endswith(_WEIGHT_SUFFIXES) and os.path.isfile(path):
            stat = os.stat(path)
            out[name] = [stat.st_size, _sampled(path, stat.st_size, stat.st_mtime)]
    return out


def _frozen_digest(module: nn.Module) -> str:
    digest = hashlib.sha256()
    for name, param in module.named_parameters():
        if not param.requires_grad:
            digest.update(f"{canonical_name(name)}:{full_numel(param)};".encode())
    return digest.hexdigest()


def record(module: Any) -> Optional[Dict[str, Any]]:
    """The manifest's `adapter` entry for a run training `module`; None when it is not an adapter model."""
    if module is None or not is_adapter_model(module):
        return None
    prefix, peft_model = _peft_model(module)
    folder = _base_folder(module, peft_model)
    trainable, total = count_parameters(module)
    configs = {} if peft_model is None else {k: _plain(c.to_dict()) for k, c in peft_model.peft_config.items()}
    return {
        "peft_prefix": prefix if peft_model is not None else None,
        "peft_config": configs,
        "trainable_parameters": trainable,
        "total_parameters": total,
        "base": {
            "name_or_path": folder,
            "config": _base_config(module, peft_model),
            "weight_files": weight_files(folder) if folder else None,
            "frozen_parameters": _frozen_digest(module),
        },
    }


def differences(saved: Dict[str, Any], running: Dict[str, Any]) -> List[str]:
    """What differs between the recorded base and the running model's: config fields, weight files, frozen
    parameters (an empty list: the same base)."""
    out = []
    a, b = saved.get("config") or {}, running.get("config") or {}
    keys = sorted(k for k in set(a) | set(b) if a.get(k) != b.get(k))
    if keys:
        out.append("config " + ", ".join(f"{k}: {a.get(k)!r} -> {b.get(k)!r}" for k in keys[:6]))
    files_a, files_b = saved.get("weight_files"), running.get("weight_files")
    if files_a and files_b and files_a != files_b:
        changed = sorted(k for k in set(files_a) | set(files_b) if files_a.get(k) != files_b.get(k))
        out.append(f"weight files {changed[:6]} differ (names, sizes or contents)")
    if saved.get("frozen_parameters") != running.get("frozen_parameters") and not keys:
        out.append("the frozen parameters' names or sizes differ")
    return out


def check_resume(path: str, manifest: Dict[str, Any], module: Any) -> None:
    """Refuse (CheckpointMismatchError) to resume an adapter checkpoint onto a model without the adapter,
    or onto another base than the one it was trained on. A full checkpoint passes unchanged."""
    saved = manifest.get(ADAPTER_KEY)
    if not saved:
        return
    running = record(module)
    base = saved["base"].get("name_or_path") or "its base model"
    if running is None:
        raise CheckpointMismatchError(
            f"{path} is an adapter checkpoint (trained on {base}): it holds the adapter weights only, and the "
            "running model has no adapter. Build the model with the same adapter (e.g. --lora_r with the run's "
            "LoRA options, or peft.get_peft_model in configure_model) to resume it."
        )
    problems = differences(saved["base"], running["base"])
    if problems:
        raise CheckpointMismatchError(
            f"{path} is an adapter checkpoint trained on another base model ({base}) than the running one "
            f"({running['base'].get('name_or_path') or 'built in configure_model'}): {'; '.join(problems)}. "
            "Resume with the base model it was trained on; the adapter means nothing on another base."
        )


# ------------------------------------------------------------------ the model part of a checkpoint
def is_adapter_checkpoint(manifest: Dict[str, Any]) -> bool:
    return bool((manifest or {}).get(ADAPTER_KEY))


def saved_keys(model: nn.Module) -> Set[str]:
    """State-dict keys an adapter checkpoint holds: the trainable parameters, and the persistent buffers of
    modules that own one (a trained copy of a whole module, modules_to_save)."""
    root = model.module if isinstance(model, DistributedDataParallel) else model
    keys: Set[str] = set()
    for prefix, mod in root.named_modules():
        trains = False
        for name, param in mod.named_parameters(recurse=False):
            if param.requires_grad:
                trains = True
                keys.add(canonical_name(f"{prefix}.{name}" if prefix else name))
        if trains:
            skip = getattr(mod, "_non_persistent_buffers_set", set())
            for name, _ in mod.named_buffers(recurse=False):
                if name not in skip:
                    keys.add(canonical_name(f"{prefix}.{name}" if prefix else name))
    return keys


def model_state(model: nn.Module, options: Optional[StateDictOptions], trainable_only: bool) -> Dict[str, Any]:
    """get_model_state_dict(model, options), restricted to `saved_keys` for an adapter checkpoint.

    Frozen parameters are left out before anything is gathered (ignore_frozen_params), so a "full"
    save of an adapter never gathers the base weights."""
    options = options or StateDictOptions()
    if not trainable_only:
        return get_model_state_dict(model, options=options)
    state = get_model_state_dict(model, options=dataclasses.replace(options, ignore_frozen_params=True))
    keep = saved_keys(model)
    return {k: v for k, v in state.items() if k in keep}


def load_options(options: Optional[StateDictOptions], trainable_only: bool) -> StateDictOptions:
    """set_model_state_dict's options for a checkpoint's model part: not strict for an adapter checkpoint,
    whose frozen weights come from the base (the names and shapes it does hold were compared first)."""
    options = options or StateDictOptions()
    return dataclasses.replace(options, strict=False) if trainable_only else options


# ------------------------------------------------------------------ shardwise convert
def _checkpoint_key_to_peft(adapter: Dict[str, Any]) -> Tuple[str, str, Any]:
    """(prefix of the PeftModel's keys in the checkpoint, adapter name, PEFT config); ValueError when the
    checkpoint cannot become one PEFT adapter folder."""
    configs = adapter.get("peft_config") or {}
    if adapter.get("peft_prefix") is None or len(configs) != 1:
        raise ValueError(
            f"This adapter checkpoint holds {len(configs)} PEFT adapter config(s) (a PEFT adapter folder holds "
            "one, and a model with adapter layers but no PeftModel has none): convert it to plain weights "
            "instead, with a .safetensors file as OUT."
        )
    from peft.config import PeftConfig

    name, config = next(iter(configs.items()))
    config = PeftConfig.from_peft_type(**config)
    config.inference_mode = True
    return adapter["peft_prefix"], name, config


def peft_key(key: str, adapter_name: str, peft_type: Any) -> str:
    """A PeftModel state-dict key as PEFT's adapter files spell it (the adapter name removed, by PEFT's rule)."""
    from peft.mapping import PEFT_TYPE_TO_TUNER_MAPPING

    tuner = PEFT_TYPE_TO_TUNER_MAPPING.get(peft_type)
    remove = getattr(tuner, "_remove_adapter_name_from_key", None)
    return remove(key, adapter_name) if remove is not None else key.replace(f".{adapter_name}", "")


def write_adapter_folder(tensors: Dict[str, torch.Tensor], adapter: Dict[str, Any], out: str) -> List[str]:
    """A PEFT adapter folder (adapter_config.json + adapter_model.safetensors) at `out` from an adapter
    checkpoint's model tensors (`tensors`, keyed as in the checkpoint) and its manifest entry."""
    from safetensors.torch import save_file

    prefix, name, config = _checkpoint_key_to_peft(adapter)
    state = {peft_key(k[len(prefix) :], name, config.peft_type): v for k, v in tensors.items() if k.startswith(prefix)}
    os.makedirs(out, exist_ok=True)
    config.save_pretrained(out)
    path = os.path.join(out, "adapter_model.safetensors")
    save_file(state, path, metadata={"format": "pt"})
    return [os.path.join(out, "adapter_config.json"), path]

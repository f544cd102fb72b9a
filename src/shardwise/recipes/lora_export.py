"""A trained adapter out of a (sharded) run: a PEFT adapter folder, or the base with the adapter merged in.

`export_adapter` writes what `peft.PeftModel.from_pretrained(base, folder)`
loads: `adapter_config.json` and `adapter_model.safetensors`, by PEFT's own
`save_pretrained` on global rank 0, from adapter tensors all-gathered one at
a time (they are a few MB, so rank 0 holds them all). `export_merged` writes
a Hugging Face folder that `transformers.AutoModelForCausalLM.from_pretrained`
loads without PEFT: it walks the base model's tensors in order, as the full
export does (recipes/hf_model.export_hf_folder, one tensor at a time, rank 0
writes), and for each weight under a LoRA layer it gathers that weight and
the layer's adapter matrices -- one layer, never the whole model -- and rank 0
adds PEFT's own `get_delta_weight` for every active adapter, computed on the
gathered copies (`torch.func.functional_call` lends them to the layer for the
call; the training model is not touched). A 4-bit base weight (QLoRA) is
dequantised by bitsandbytes first, so the merged folder holds ordinary
floating weights. Every rank calls both functions (they communicate); both
return the folder on every rank. It sits with the recipe (it was
adapters/export.py) because it writes through the recipe's Hugging Face
export; `shardwise.adapters.export` still names it.
"""

from __future__ import annotations

import contextlib
import copy
import os
from typing import Any, Callable, Dict, Iterator, List, Optional, Tuple

import torch
from torch import nn

from shardwise.adapters.lora import base_weight_name, lora_layers
from shardwise.checkpoint.errors import CheckpointWriteError
from shardwise.checkpoint.integrity import write_error
from shardwise.distributed import ops
from shardwise.fqn import canonical_name
from shardwise.recipes.hf_model import export_hf_folder, export_items, gathered

ADAPTER_FILES = ("adapter_config.json", "adapter_model.safetensors")
MERGED_DIR = "merged"  # the recipe's merged folder, inside output_dir


def find_peft_model(model: nn.Module) -> Any:
    """The `peft.PeftModel` that is `model` or inside it (a TrainModule's attribute); ValueError if none."""
    from peft import PeftModel

    for module in model.modules():
        if isinstance(module, PeftModel):
            return module
    raise ValueError(
        f"{type(model).__name__} holds no peft.PeftModel: export_adapter / export_merged export a LoRA model "
        "(shardwise.adapters.apply_lora or peft.get_peft_model). For a fully trained model use "
        "shardwise.recipes.hf_model.export_hf_folder."
    )


def _adapter_tensors(peft_model: nn.Module) -> List[Tuple[str, torch.Tensor]]:
    """(name in peft_model.named_parameters(), tensor) of everything PEFT may save: adapter matrices and
    whatever trains (modules_to_save, LoRA biases). PEFT's get_peft_model_state_dict picks its own from
    these. The names are the model's own, wrapper prefixes (activation checkpointing) included: PEFT
    finds the adapter keys by walking the model's modules, so a stripped name matches nothing."""
    out = []
    for name, param in peft_model.named_parameters():
        canonical = canonical_name(name)
        if param.requires_grad or base_weight_name(canonical) is None or ".modules_to_save." in canonical:
            out.append((name, param))
    return out


def lora_matrix_count(peft_model: nn.Module, adapter: str) -> int:
    """How many LoRA matrices (A and B of every targeted layer) `adapter` has in the model."""
    return 2 * sum(1 for _, _, name in lora_layers(peft_model) if name == adapter)


def _write_adapter(peft_model: Any, folder: str, state: Dict[str, torch.Tensor]) -> None:
    """PEFT's selection of `state` (keys as the model names its parameters) for each adapter, keyed as PEFT's
    own files are (wrapper prefixes removed), written with its config: what PEFT's save_pretrained writes.
    Refuses (ValueError) to write fewer tensors than the adapter has LoRA matrices: PEFT's loader only
    warns about missing keys, and the folder would hold an untrained adapter."""
    from peft import get_peft_model_state_dict
    from safetensors.torch import save_file

    for adapter, config in peft_model.peft_config.items():
        selected = get_peft_model_state_dict(
            peft_model, state_dict=state, adapter_name=adapter, save_embedding_layers=False
        )
        selected = {canonical_name(k): v.contiguous() for k, v in selected.items()}
        matrices = lora_matrix_count(peft_model, adapter)
        lora_keys = [k for k in selected if ".lora_A." in k or ".lora_B." in k]
        if len(lora_keys) < matrices:
            raise ValueError(
                f"export_adapter: adapter {adapter!r} has {matrices} LoRA matrices, but only {len(lora_keys)} "
                f"of them matched PEFT's adapter keys ({len(state)} tensors gathered): the folder would load as an "
                "untrained adapter. This is a bug in shardwise's export (a module wrapper renaming the "
                "parameters); please report it with the model's wrapping (FSDP, activation checkpointing)."
            )
        out = folder if adapter == "default" else os.path.join(folder, adapter)
        os.makedirs(out, exist_ok=True)
        config = copy.copy(config)
        config.inference_mode = True
        # The weights through a temporary name, then the config: a kill or a full disk midway never leaves
        # a cut weights file, nor a config beside weights of an earlier export.
        weights = os.path.join(out, ADAPTER_FILES[1])
        partial = os.path.join(out, f".{ADAPTER_FILES[1]}.partial")
        try:
            save_file(selected, partial, metadata={"format": "pt"})
            os.replace(partial, weights)
        finally:
            if os.path.exists(partial):
                os.unlink(partial)
        config.save_pretrained(out)


@torch.no_grad()
def export_adapter(model: nn.Module, folder: str) -> str:
    """Write the PEFT adapter folder of `model` (a PeftModel, or a module holding one) to `folder`.

    Collective: every rank calls it; global rank 0 writes. The tensors keep the
    dtype they were trained in. Returns `folder` on every rank. Raises
    ValueError, on every rank, rather than write an adapter with fewer tensors
    than the model has LoRA matrices.
    """
    peft_model = find_peft_model(model)
    rank0 = ops.rank() == 0
    state: Dict[str, torch.Tensor] = {}
    for name, tensor in _adapter_tensors(peft_model):
        with gathered(tensor) as full:  # a collective: every rank, same order
            if rank0:
                state[name] = full.detach().to("cpu").clone()
    error = None
    if rank0:
        try:
            # The base embedding is not saved beside the adapter (the vocabulary is the base model's).
            _write_adapter(peft_model, folder, state)
        except ValueError as exc:
            error = (str(exc), None)
        except OSError as exc:  # a full disk, a read-only folder: named, and raised on every rank
            named = write_error(exc, folder)
            error = (str(named), named.errno)
    error = ops.broadcast_object(error)  # every rank raises, none waits in a later collective
    if error:
        raise ValueError(error[0]) if error[1] is None else CheckpointWriteError(error[0], error[1], folder)
    return folder


# ------------------------------------------------------------------ merged
def dequantize_weight(module: nn.Module, full: torch.Tensor) -> torch.Tensor:
    """A gathered base weight in floating point: a bitsandbytes 4-bit weight is dequantised with its
    quant_state (QLoRA); any other weight is returned as it is."""
    weight = getattr(module, "weight", None)
    state = getattr(weight, "quant_state", None) or getattr(module, "quant_state", None)
    if state is None or full.is_floating_point() and tuple(full.shape) == tuple(getattr(state, "shape", ())):
        return full
    import bitsandbytes.functional as bnbf

    return bnbf.dequantize_4bit(full.to(state.absmax.device), state).to(full.device)


class _DeltaOf(nn.Module):
    """Calls PEFT's `get_delta_weight(adapter)` on `layer`; run through functional_call with gathered tensors."""

    def __init__(self, layer: nn.Module, adapter: str) -> None:
        super().__init__()
        self.layer, self.adapter = layer, adapter

    def forward(self) -> torch.Tensor:
        return self.layer.get_delta_weight(self.adapter)


def _merge_adapters(layer: nn.Module) -> List[str]:
    """The adapters of `layer` a merge adds: active, not merged already; a variant PEFT merges
    differently (DoRA) is refused."""
    if getattr(layer, "disable_adapters", False):
        return []
    merged = set(getattr(layer, "merged_adapters", []) or [])
    names = [a for a in layer.active_adapters if a in layer.lora_A and a not in merged]
    variants = [a for a in names if a in (getattr(layer, "lora_variant", None) or {})]
    if variants:
        raise NotImplementedError(
            f"export_merged: adapter(s) {variants} use a LoRA variant (e.g. DoRA), whose merge is not a plain "
            "sum of weights; export the adapter folder (export_adapter) and merge it with PEFT's "
            "merge_and_unload() in one process instead."
        )
    return names


@contextlib.contextmanager
def _merged(layer: nn.Module, weight: torch.Tensor, dequantize: Callable[..., torch.Tensor]) -> Iterator[torch.Tensor]:
    """The full base `weight` of LoRA `layer` with its adapters added (on rank 0; elsewhere the
    gathered base). Every rank gathers the weight and the layer's adapter tensors, in the same order."""
    adapters = _merge_adapters(layer)
    own = [(canonical_name(n), p) for n, p in layer.named_parameters() if not n.startswith("base_layer.")]
    with contextlib.ExitStack() as stack:
        full = stack.enter_context(gathered(weight))
        lent = {f"layer.{name}": stack.enter_context(gathered(p)) for name, p in own}
        if ops.rank() != 0:
            yield full
            return
        full = dequantize(layer.get_base_layer(), full)
        merged = full.detach().to("cpu", torch.float32, copy=True)
        lent = {k: v.detach().to("cpu") for k, v in lent.items()}
        for adapter in adapters:
            delta = torch.func.functional_call(_DeltaOf(layer, adapter), lent, (), strict=False)
            merged += delta.to(torch.float32).reshape(merged.shape)
        yield merged.to(full.dtype)


@contextlib.contextmanager
def _dequantized(module: nn.Module, tensor: torch.Tensor, dequantize: Callable[..., torch.Tensor]):
    """A module's full weight, dequantised on rank 0 (a 4-bit weight that no adapter targets)."""
    with gathered(tensor) as full:
        yield dequantize(module, full) if ops.rank() == 0 else full


def _merged_name(name: str) -> Optional[str]:
    """The base model's key for a tensor of the PEFT-wrapped base model; None for what a merge drops
    (adapter matrices, a modules_to_save wrapper's original copy)."""
    if ".original_module." in name:
        return None
    if ".modules_to_save." in name:
        head, tail = name.split(".modules_to_save.", 1)
        name = f"{head}.{tail.split('.', 1)[1]}"
    return base_weight_name(name)


def merged_items(peft_model: nn.Module, config: Any, dequantize: Callable[..., torch.Tensor]) -> List[Tuple[str, Any]]:
    """(base model key, tensor or context-manager factory) pairs for export_hf_folder's `tensors`."""
    base_model = peft_model.get_base_model()
    owners = {id(layer.get_base_layer().weight): layer for _, layer, _ in lora_layers(base_model)}
    plain = {id(m.weight): m for m in base_model.modules() if isinstance(getattr(m, "weight", None), torch.Tensor)}
    items: List[Tuple[str, Any]] = []
    for name, tensor in export_items(base_model, config):
        key = _merged_name(name)
        if key is None:
            continue
        layer = owners.get(id(tensor))
        if layer is not None:
            items.append((key, lambda layer=layer, tensor=tensor: _merged(layer, tensor, dequantize)))
        elif id(tensor) in plain and dequantize is not None:
            owner = plain[id(tensor)]
            items.append((key, lambda owner=owner, tensor=tensor: _dequantized(owner, tensor, dequantize)))
        else:
            items.append((key, tensor))
    return items


def plain_config(config: Any) -> Any:
    """A copy of the base model's config without the quantisation settings: the merged weights are plain."""
    config = copy.deepcopy(config)
    if hasattr(config, "quantization_config"):
        delattr(config, "quantization_config")
    return config


@torch.no_grad()
def export_merged(
    model: nn.Module,
    folder: str,
    config: Any = None,
    tokenizer: Any = None,
    *,
    source_dir: Optional[str] = None,
    max_shard_size: int = 5 * 2**30,
    dtype: Optional[torch.dtype] = None,
    dequantize: Callable[[nn.Module, torch.Tensor], torch.Tensor] = dequantize_weight,
) -> str:
    """Write the base model with the LoRA adapter merged in as a Hugging Face folder at `folder`.

    `model`: a PeftModel or a module holding one (sharded or not). `config`:
    the base model's config (default: the one the PeftModel's base holds);
    `tokenizer` or `source_dir` (the base folder) supplies the tokenizer
    files. `dtype`: of the written weights (default: the base weights' own;
    a 4-bit base's compute dtype is float32 unless given). Collective: every
    rank calls it, rank 0 writes. Returns `folder` on every rank.
    """
    peft_model = find_peft_model(model)
    config = plain_config(config if config is not None else peft_model.get_base_model().config)
    items = merged_items(peft_model, config, dequantize)
    export_hf_folder(
        peft_model.get_base_model(),
        folder,
        config=config,
        tokenizer=tokenizer,
        source_dir=source_dir,
        max_shard_size=max_shard_size,
        dtype=dtype,
        tensors=items,
    )
    return folder


# ------------------------------------------------------------------ the recipe's export
def check_merge(config: Any) -> None:
    """`merge` (FinetuneConfig) needs LoRA: refused up front, not ignored, for full fine-tuning."""
    if getattr(config, "merge", False) and not getattr(config, "lora_r", 0):
        raise ValueError(
            "merge=True merges a LoRA adapter into the base weights, but lora_r=0 (full fine-tuning) trains "
            "no adapter: the exported folder already holds every trained weight. Drop merge, or set lora_r."
        )


def export_lora(
    model: nn.Module,
    output_dir: str,
    *,
    merge: bool,
    config: Any,
    tokenizer: Any = None,
    source_dir: Optional[str] = None,
    max_shard_size: int = 5 * 2**30,
    dtype: Optional[torch.dtype] = None,
) -> List[str]:
    """The LoRA recipe's outputs: the PEFT adapter folder (and the tokenizer) in `output_dir`, and with
    `merge` the merged Hugging Face folder in `output_dir/merged` (in `dtype`, default the base's).
    Collective; returns the folders written."""
    written = [export_adapter(model, output_dir)]
    if tokenizer is not None and ops.rank() == 0:
        tokenizer.save_pretrained(output_dir)
    if merge:
        folder = os.path.join(output_dir, MERGED_DIR)
        written.append(
            export_merged(
                model,
                folder,
                config,
                tokenizer,
                source_dir=source_dir,
                max_shard_size=max_shard_size,
                dtype=dtype,
            )
        )
    return written

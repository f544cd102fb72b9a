"""`shardwise convert CKPT OUT`: any shardwise checkpoint -> consolidated weights, the recipe's included.

The output is what the rest of the ecosystem loads: a folder in Hugging
Face's layout (`model.safetensors`, split into shards with an index when
larger than --max-shard-size; checkpoint/hf_shards.py), or, when OUT ends in
`.safetensors` / `.pt` / `.pth` / `.bin`, that one file. --format torch writes
torch files instead of safetensors. The writing is checkpoint/convert.py's;
this command decides the names and what goes beside the weights, which
needs the fine-tuning recipe, transformers and PEFT -- hence it sits here,
with the recipe, not in checkpoint/.

An adapter checkpoint (LoRA: the trainable weights only, checkpoint/adapters.py)
becomes a PEFT adapter folder (`adapter_config.json` +
`adapter_model.safetensors`, what `peft.PeftModel.from_pretrained` loads), or,
given `base_model` (the base's Hugging Face folder), the base with the adapter
merged in by PEFT, as a Hugging Face folder (`merge_into_base`). A file OUT
still gets its raw tensors.

A full checkpoint of the fine-tuning recipe (`shardwise finetune`) becomes the
Hugging Face folder the recipe's own export writes. The recipe's TrainModule
(recipes/causal_lm.py) holds the Hugging Face model as `self.model`, so its
checkpoints name every tensor `model.<the HF name>` and hold no config. Such a
checkpoint is recognised by what the recipe module itself stores in it (its
loss history, under causal_lm.HISTORY_KEY) together with every tensor carrying
that prefix, never by the names alone. The names lose the prefix; tied copies
(lm_head.weight under tie_word_embeddings) are left out as save_pretrained
leaves them out (hf_model.export_items on the architecture built on the meta
device from the base config), and every name and shape is checked against
that architecture before anything is written. The config comes from the base
model folder the checkpoint records (the recipe module stores its
--model_path), or from `base_model`, which wins (a moved folder; checkpoints
written before the folder was recorded); config.json, the generation config
and tokenizer files are then written as the recipe's own export writes them
(hf_model.write_model_files). A file OUT gets all its tensors, prefix removed.
"""

from __future__ import annotations

import errno
import os
import shutil
import tempfile
from typing import Any, Callable, Dict, Iterator, List, Optional, Tuple

import torch

from shardwise.checkpoint import adapters, hf_convert
from shardwise.checkpoint.convert import read_cast, write_weights
from shardwise.checkpoint.errors import CheckpointWriteError
from shardwise.checkpoint.integrity import write_error
from shardwise.checkpoint.reader import CheckpointReader, TensorInfo, open_checkpoint
from shardwise.dtypes import cast_dtype
from shardwise.memory import parse_bytes
from shardwise.recipes.causal_lm import HISTORY_KEY
from shardwise.recipes.hf_model import export_items, write_model_files
from shardwise.sysmem import available_host_bytes

PREFIX = "model."  # the recipe module's attribute holding the Hugging Face model


def is_recipe_checkpoint(state: Dict[str, Any], infos: List[TensorInfo]) -> bool:
    """A full checkpoint (its trainer state, its tensors) written by the fine-tuning recipe's module (adapter
    checkpoints are not asked)."""
    if not infos or not all(i.name.startswith(PREFIX) for i in infos):
        return False
    return HISTORY_KEY in state


def base_config(state: Dict[str, Any], path: str, base_model: Optional[str]) -> Tuple[str, Any]:
    """(the model folder the run fine-tuned, its config): --base_model, else the folder the checkpoint at `path`
    records in its trainer `state`; an error naming --base_model when neither holds a config.json."""
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


def hub_layout(config: Any, names: List[str]) -> Callable[[Iterator[Tuple[str, Any]]], Iterator[Tuple[str, Any]]]:
    """The stream of (model name, tensor) as save_pretrained writes it: transformers' conversion mapping
    reverted (a Mixtral's fused experts written one by one, as on the hub), one group at a time."""
    from transformers import AutoModelForCausalLM

    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config)
    return lambda stream: hf_convert.revert_stream(model, names, stream)


def merge_into_base(base_model: str, adapter_dir: str, out: str, dtype: Any, max_shard_size: str) -> List[str]:
    """The base model at `base_model` (a local Hugging Face folder) with the adapter at `adapter_dir` merged
    in by PEFT's merge_and_unload, saved by transformers at `out`: one process, the base held in host memory."""
    from peft import PeftModel
    from transformers import AutoModelForCausalLM, AutoTokenizer

    files = adapters.weight_files(base_model) if os.path.isdir(base_model) else {}
    needed, available = sum(size for size, _ in files.values()), available_host_bytes()
    if not files:
        raise ValueError(f"--base_model {base_model!r} is not a local Hugging Face model folder with weights.")
    if available is not None and needed > available:
        raise ValueError(
            f"Merging holds the base model ({needed / 2**30:.1f} GiB) in host memory, and this host has "
            f"{available / 2**30:.1f} GiB available: convert to the adapter folder (no --base_model) here, and "
            "merge on a larger host or with `shardwise finetune --merge` on the training machines."
        )
    base = AutoModelForCausalLM.from_pretrained(base_model, dtype=dtype or "auto")
    merged = PeftModel.from_pretrained(base, adapter_dir).merge_and_unload()
    merged.save_pretrained(out, max_shard_size=max_shard_size)
    try:
        AutoTokenizer.from_pretrained(base_model).save_pretrained(out)
    except (OSError, ValueError):  # a base folder without a tokenizer: the weights are still complete
        pass
    return sorted(os.path.join(out, f) for f in os.listdir(out))


def _adapter_outputs(
    reader: CheckpointReader,
    infos: List[TensorInfo],
    adapter: Dict,
    out: str,
    cast: Optional[torch.dtype],
    max_shard_size: str,
    base_model: Optional[str],
    quiet: bool,
    shown_as: Optional[str] = None,
) -> List[str]:
    """An adapter checkpoint as a PEFT adapter folder, or merged into `base_model` (adapters.py)."""
    tensors = dict(read_cast(reader, infos, None if base_model else cast))  # adapters are small
    if base_model is None:
        written = adapters.write_adapter_folder(tensors, adapter, out)
    else:
        with tempfile.TemporaryDirectory(prefix="shardwise-adapter-") as tmp:
            adapters.write_adapter_folder(tensors, adapter, tmp)
            written = merge_into_base(base_model, tmp, out, cast, max_shard_size)
    if not quiet:
        kind = f"merged into {base_model}" if base_model else "a PEFT adapter folder"
        print(f"converted {reader.path} (adapter checkpoint, step {reader.manifest.get('global_step')}) -> {kind}:")
        for path in written:
            print(f"  {_shown(path, out, shown_as)}")
    return written


def convert(
    ckpt: str,
    out: str,
    dtype: str = "keep",
    max_shard_size: str = "5GB",
    fmt: Optional[str] = None,
    quiet: bool = False,
    base_model: Optional[str] = None,
) -> List[str]:
    """Write the model weights of checkpoint `ckpt` to `out`; returns the files written.

    `base_model`: for an adapter checkpoint, the base model's folder or hub id: `out` becomes the merged model;
    for a full checkpoint of the fine-tuning recipe, the folder it fine-tuned: its config and tokenizer
    files go beside the weights, so `from_pretrained(out)` loads them.

    A new folder is written under a hidden temporary name beside it and renamed into place at the end, so
    a convert killed midway leaves no folder at `out` (nor weights without their config); a file is
    written through a temporary name of its own. An existing folder is updated file by file, each whole."""
    try:
        if os.path.splitext(out)[1].lower() in _FILE_SUFFIXES or os.path.lexists(out):
            return _convert(ckpt, out, dtype, max_shard_size, fmt, quiet, base_model)
        final = os.path.abspath(out)
        stage = os.path.join(os.path.dirname(final), f".{os.path.basename(final)}.tmp-{os.getpid()}")
        try:
            written = _convert(ckpt, stage, dtype, max_shard_size, fmt, quiet, base_model, shown_as=final)
            os.rename(stage, final)
        except BaseException:
            shutil.rmtree(stage, ignore_errors=True)
            raise
        return [final + path[len(stage) :] for path in written]
    except OSError as exc:  # a full disk, a read-only folder: the errno in words, where, and the fix
        if isinstance(exc, CheckpointWriteError) or exc.errno not in _WRITE_ERRNOS:
            raise
        raise write_error(exc, out) from exc


_WRITE_ERRNOS = (errno.ENOSPC, errno.EDQUOT, errno.EROFS, errno.EACCES, errno.EPERM)


_FILE_SUFFIXES = (".safetensors", ".pt", ".pth", ".bin")


def _shown(path: str, out: str, shown_as: Optional[str]) -> str:
    """A path inside the temporary folder as it is named once renamed into place."""
    return shown_as + path[len(out) :] if shown_as and path.startswith(out) else path


def _convert(
    ckpt: str,
    out: str,
    dtype: str,
    max_shard_size: str,
    fmt: Optional[str],
    quiet: bool,
    base_model: Optional[str],
    shown_as: Optional[str] = None,
) -> List[str]:
    if base_model is not None:  # a hub model id: its snapshot in the Hugging Face cache (a local folder as given)
        from shardwise.recipes.hub import resolve_model

        base_model = resolve_model(base_model)
    cast = cast_dtype(dtype)
    reader = open_checkpoint(ckpt)
    infos = reader.tensors()
    max_bytes = parse_bytes(max_shard_size)
    suffix = os.path.splitext(out)[1].lower()
    single_file = suffix in (".safetensors", ".pt", ".pth", ".bin")
    adapter = reader.manifest.get(adapters.ADAPTER_KEY)
    state = reader.trainer_state()  # read once (a sharded checkpoint reads and verifies a file for it)
    recipe = not adapter and is_recipe_checkpoint(state, infos)
    if base_model is not None and (not (adapter or recipe) or single_file):
        raise ValueError(
            "--base_model merges an adapter checkpoint into its base, or gives a fine-tuning recipe "
            "checkpoint its config, written as a folder: "
            + (f"give a folder as OUT, not {out!r}." if adapter or recipe else f"{reader.path} is neither.")
        )
    if adapter and not single_file:
        return _adapter_outputs(reader, infos, adapter, out, cast, max_shard_size, base_model, quiet, shown_as)
    fmt = fmt or ("torch" if suffix in (".pt", ".pth", ".bin") else "safetensors")
    if fmt not in ("safetensors", "torch"):
        raise ValueError(f"--format {fmt!r}: use safetensors or torch.")
    names = {i.name: i.name for i in infos}  # checkpoint name -> name written
    config, regroup = None, None
    if recipe and single_file:
        names = {i.name: i.name[len(PREFIX) :] for i in infos}
    elif recipe:  # refused before anything is written when the folder could not load
        base_model, config = base_config(state, reader.path, base_model)
        kept = hf_names(infos, config, base_model)
        infos, names = [i for i, _ in kept], {i.name: name for i, name in kept}
        regroup = hub_layout(config, [name for _, name in kept])

    def model_files() -> List[str]:
        """config.json, the generation config and the tokenizer files, as the recipe's export writes them."""
        floating = next((i.dtype for i in infos if i.dtype.is_floating_point), None)
        return write_model_files(out, config, cast or floating, source_dir=base_model)

    written, total_bytes = write_weights(
        reader,
        infos,
        out,
        names=names,
        cast=cast,
        fmt=fmt,
        max_bytes=max_bytes,
        single_file=single_file,
        state=state,
        model_files=model_files if config is not None else None,
        regroup=regroup,
    )
    if not quiet:
        kind = f"{reader.format}, fine-tuning recipe" if recipe else reader.format
        print(
            f"converted {reader.path} ({kind}, step {reader.manifest.get('global_step')}) -> "
            f"{len(infos)} tensors, {total_bytes / 1e6:.1f} MB:"
        )
        for path in written:
            print(f"  {_shown(path, out, shown_as)}")
    return written

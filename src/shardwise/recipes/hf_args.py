"""Hugging Face TrainingArguments flags and Accelerate FSDP config files, read as `shardwise finetune` options.

`translate_argv` turns an `accelerate launch ... train.py --bf16 True
--evaluation_strategy steps ...` argument list into ours before jsonargparse
sees it: renamed flags are renamed, `--fsdp_config` / `--config_file` is
mapped key by key, and every name it cannot honour yields one note saying
why, so nothing is dropped silently. Our own spellings pass through, so the
two can be mixed. Every name has a row in docs/coming-from.md (tests/helpers/coming_from.py).
"""

from __future__ import annotations

import dataclasses
import json
import os
from typing import Any, Dict, List, Optional, Sequence, Tuple

import torch
import yaml

from shardwise.recipes.finetune import DATA_OPTIONS, FinetuneConfig
from shardwise.strategies.fsdp_compat import NOTHING_TO_DO, sharding_strategy_name, state_dict_type_name

# Same meaning, another name (HF TrainingArguments / the seed script -> FinetuneConfig).
RENAMED = {
    "model_name": "model_path",
    "model_name_or_path": "model_path",
    "dataset_name": "dataset",
    "model_revision": "revision",  # TRL's ModelConfig
    "dataset_config_name": "dataset_config",  # transformers' run_clm.py
    "ddp_timeout": "timeout_s",
    "config": "config",
    # The flags of the PEFT SFT recipe (its train.py) and TRL's SFTConfig.
    "max_length": "max_seq_len",
    "use_gradient_checkpointing": "gradient_checkpointing",
    "use_4bit_quantization": "load_in_4bit",
    "evaluation_strategy": "eval_strategy",
}
RECIPE_LORA_R = 64  # the PEFT SFT recipe's lora_r when --use_peft_lora comes without one
# HF flags with no effect here, and why (one note each when passed).
NOT_HONOURED = {
    "log_level": "shardwise prints rank 0's progress lines; set the Python logging level yourself for more",
    "log_level_replica": "only rank 0 prints progress",
    "report_to": "shardwise logs to TensorBoard (CSV without tensorboard installed) in output_dir/shardwise_logs",
    "do_train": "shardwise finetune always trains",
    "do_eval": "evaluation runs when eval_steps is set",
}
# The launcher's business (accelerate launch / yaml): give them to `shardwise launch`.
LAUNCHER_KEYS = (
    "machine_rank",
    "main_process_ip",
    "main_process_port",
    "rdzv_backend",
    "same_network",
    "gpu_ids",
    "num_cpu_threads_per_process",
)
# Accelerate yaml keys that describe the environment and change nothing.
DESCRIPTIVE_KEYS = (
    "compute_environment",
    "main_training_function",
    "debug",
    "downcast_bf16",
    "tpu_env",
    "tpu_use_cluster",
    "tpu_use_sudo",
    "enable_cpu_affinity",
    "dynamo_config",
)
TRUE = ("1", "true", "yes", "on")


def _bool(value: Any) -> bool:
    return str(value).strip().lower() in TRUE


def _pairs(argv: Sequence[str]) -> List[Tuple[str, Optional[str]]]:
    """`--name value`, `--name=value` and bare `--flag` (HF's store_true), in order."""
    out: List[Tuple[str, Optional[str]]] = []
    i = 0
    argv = list(argv)
    while i < len(argv):
        token = argv[i]
        if not token.startswith("--"):
            out.append(("", token))  # positional: left for jsonargparse to refuse
            i += 1
            continue
        name = token[2:]
        if "=" in name:
            name, value = name.split("=", 1)
            out.append((name, value))
            i += 1
        elif i + 1 < len(argv) and not argv[i + 1].startswith("--"):
            out.append((name, argv[i + 1]))
            i += 2
        else:
            out.append((name, None))
            i += 1
    return out


def _has_cuda() -> bool:
    return torch.cuda.is_available()


def translate_argv(argv: Sequence[str]) -> Tuple[List[str], List[str]]:
    """(argv in our names, notes): HF / Accelerate spellings mapped; each unhonoured one named once."""
    ours = {f.name for f in dataclasses.fields(FinetuneConfig)} | set(DATA_OPTIONS)  # the data options' flat names
    values: List[Tuple[str, Any]] = []  # (our field, value), later ones win
    notes: List[str] = []
    parallelism: Dict[str, Any] = {}  # accelerate launch's --parallelism_config_* flags
    pairs = _pairs(argv)
    _refuse_conflicts(pairs, ours)
    peft_off = False
    # The config file first, so the command line overrides it (as accelerate launch does).
    for name, value in pairs:
        if name in ("fsdp_config", "config_file"):
            if value is None:
                raise ValueError(f"--{name} needs a path to an Accelerate / FSDP config file.")
            file_values, file_notes = read_accelerate_config(value)
            values += list(file_values.items())
            notes += file_notes
    for name, value in pairs:
        flag = name.replace("-", "_")
        if flag in ("fsdp_config", "config_file"):
            continue
        if not flag:
            values.append(("", value))
        elif flag in ours or flag == "config":
            values.append((flag, "true" if value is None else value))
        elif flag in RENAMED:
            values.append((RENAMED[flag], "true" if value is None else value))
        elif flag == "use_peft_lora":
            given = any(n.replace("-", "_") in ("lora_r", "data.lora_r") for n, _ in pairs)
            if value is not None and not _bool(value):
                peft_off = True  # the recipe ignores the LoRA options without it: set last, over any --lora_r
            elif not given:
                values.append(("lora_r", RECIPE_LORA_R))
        elif flag in ("bf16", "fp16"):
            if value is None or _bool(value):
                values.append(("precision", "bf16-mixed" if flag == "bf16" else "16-mixed"))
        elif flag in ("bf16_full_eval", "fp16_full_eval"):
            if value is None or _bool(value):
                notes.append(f"--{flag}: evaluation runs in the training precision; not honoured.")
        elif flag == "use_flash_attn":
            if value is None or _bool(value):
                if _has_cuda():
                    values.append(("attn_implementation", "flash_attention_2"))
                else:
                    notes.append(
                        "--use_flash_attn True: flash-attn kernels are CUDA-only and no GPU is visible; "
                        "using attn_implementation=sdpa (which uses flash kernels on GPUs that have them)."
                    )
        elif flag == "use_reentrant":
            if value is None or _bool(value):
                notes.append(
                    "--use_reentrant True: shardwise checkpoints activations non-reentrantly (reentrant "
                    "checkpointing does not compose with FSDP's hooks); not honoured."
                )
        elif flag == "logging_strategy":
            values += _interval_strategy(flag, value, notes)
        elif flag == "splits":
            values += _splits(value)
        elif flag == "fsdp":
            file_values, file_notes = _fsdp_flag(value or "")
            values += list(file_values.items())
            notes += file_notes
        elif flag.startswith(PARALLELISM_PREFIX) or flag == "use_parallelism_config":
            if flag != "use_parallelism_config":
                parallelism[flag] = value
        elif flag == "num_processes":
            values.append(("_num_processes", value))
        elif flag == "num_machines":
            values.append(("num_nodes", value))
        elif flag in NOT_HONOURED:
            notes.append(f"--{flag}: {NOT_HONOURED[flag]}; not honoured.")
        elif flag in LAUNCHER_KEYS:
            notes.append(
                f"--{flag}: a launcher setting; pass it to `shardwise launch` (--node-rank, --master-addr, "
                "--master-port); not used by shardwise finetune."
            )
        else:
            values.append((flag, value))  # unknown: jsonargparse names it and lists the valid options
    if peft_off:
        values.append(("lora_r", 0))
    if parallelism:
        mapped, mapped_notes = map_parallelism_config(parallelism, "--parallelism_config_*")
        values += list(mapped.items())
        notes += mapped_notes
    return _emit(values), notes


def _interval_strategy(flag: str, value: Optional[str], notes: List[str]) -> List[Tuple[str, Any]]:
    kind = str(value or "steps").strip().lower()
    if kind == "steps":
        return []  # logging_steps is a step interval already
    raise ValueError(f"--{flag} {value}: shardwise finetune logs every --logging_steps N optimizer steps; use steps.")


def _splits(value: Optional[str]) -> List[Tuple[str, Any]]:
    """`--splits "train,test"`: the split trained on, then the one evaluated on."""
    names = [s.strip() for s in str(value or "").split(",") if s.strip()]
    if not names or len(names) > 2:
        raise ValueError(
            f"--splits {value!r}: name the split trained on and optionally the one evaluated on, e.g. "
            "--splits train,test (or --dataset_split train_sft --eval_split test_sft)."
        )
    return [("dataset_split", names[0])] + ([("eval_split", names[1])] if len(names) == 2 else [])


def _refuse_conflicts(pairs: Sequence[Tuple[str, Optional[str]]], ours: Any) -> None:
    """Two spellings of one option with different values (--max_length 512 --max_seq_len 1024): refused by name.
    One flag given twice is not a conflict: the later wins, as on any command line."""
    seen: Dict[str, Tuple[str, str]] = {}
    for name, value in pairs:
        flag = name.replace("-", "_")
        field = RENAMED.get(flag, flag) if flag not in ours else flag
        if not flag or field not in ours:
            continue
        said = str("true" if value is None else value).strip().lower()
        if field in seen and seen[field][0] != flag and seen[field][1] != said:
            raise ValueError(
                f"--{seen[field][0]} {seen[field][1]} and --{flag} {said} both set {field}, to different values; "
                "give one of them."
            )
        seen[field] = (flag, said)


def _fsdp_flag(value: str) -> Tuple[Dict[str, Any], List[str]]:
    """TrainingArguments' `--fsdp "full_shard auto_wrap offload"`."""
    out: Dict[str, Any] = {"strategy": "fsdp"}
    notes: List[str] = []
    for word in value.replace(",", " ").split():
        word = word.lower()
        if word in ("full_shard", "shard_grad_op", "hybrid_shard", "no_shard"):
            out["sharding_strategy"] = word.upper()
        elif word == "hybrid_shard_zero2":
            out["sharding_strategy"] = "HYBRID_SHARD"
            out["strategy_options"] = {"reshard_after_forward": False}
        elif word == "offload":
            out["cpu_offload"] = True
        elif word != "auto_wrap":  # auto_wrap by the model's blocks is what we always do
            raise ValueError(
                f"--fsdp {value!r}: unknown word {word!r}; use full_shard, shard_grad_op, "
                "hybrid_shard, no_shard, offload, auto_wrap."
            )
    return out, notes


def read_accelerate_config(path: str) -> Tuple[Dict[str, Any], List[str]]:
    """Our options from an Accelerate config yaml (or a TrainingArguments fsdp_config json/yaml)."""
    if not os.path.isfile(path):
        raise FileNotFoundError(f"FSDP config file {path!r} does not exist.")
    with open(path) as fh:
        raw = yaml.safe_load(fh) or {}  # JSON is YAML too
    if not isinstance(raw, dict):
        raise ValueError(f"{path}: expected a mapping of Accelerate / FSDP settings.")
    return map_accelerate_config(raw, source=os.path.basename(path))


def map_accelerate_config(raw: Dict[str, Any], source: str = "config") -> Tuple[Dict[str, Any], List[str]]:
    out: Dict[str, Any] = {}
    notes: List[str] = []
    options: Dict[str, Any] = {}
    top = {k: v for k, v in raw.items() if k != "fsdp_config"}
    fsdp = dict(raw.get("fsdp_config") or {})
    if "fsdp_config" not in raw:  # a TrainingArguments fsdp_config: only FSDP keys, maybe without the prefix
        fsdp, top = (
            {k: v for k, v in raw.items() if k.startswith("fsdp_") or k not in _TOP_KEYS},
            {k: v for k, v in raw.items() if k in _TOP_KEYS},
        )
    kind = str(top.pop("distributed_type", "FSDP" if fsdp else "NO")).upper()
    if kind == "FSDP":
        out["strategy"] = "fsdp"
    elif kind in ("MULTI_GPU", "MULTI_CPU"):
        out["strategy"] = "ddp"
    elif kind == "NO":
        out["strategy"] = "single"
    elif kind == "DEEPSPEED":
        ds = top.pop("deepspeed_config", {}) or {}
        stage = int(ds.get("zero_stage", 2))
        offload = str(ds.get("offload_optimizer_device", "none")).lower() == "cpu"
        out["strategy"] = f"deepspeed_stage_{stage}" + ("_offload" if offload and stage in (2, 3) else "")
    else:
        raise ValueError(
            f"{source}: distributed_type {kind!r} is not supported; use FSDP, DEEPSPEED, MULTI_GPU, MULTI_CPU or NO."
        )
    if "mixed_precision" in top:
        mp = str(top.pop("mixed_precision")).lower()
        out["precision"] = {"bf16": "bf16-mixed", "fp16": "16-mixed", "no": "32-true", "fp8": "fp8"}.get(mp, mp)
        if out["precision"] == "fp8":
            raise ValueError(f"{source}: mixed_precision fp8 is not supported; use bf16.")
    if _bool(top.pop("use_cpu", False)):
        out["accelerator"] = "cpu"
    machines = int(top.pop("num_machines", 1) or 1)
    out["num_nodes"] = machines
    if "num_processes" in top:
        out["_num_processes"] = top.pop("num_processes")
    launcher = [k for k in LAUNCHER_KEYS if k in top]
    for key in launcher:
        top.pop(key)
    if launcher and machines > 1:
        notes.append(
            f"{source}: {', '.join(launcher)} are the launcher's; pass them to `shardwise launch` "
            "(--node-rank, --master-addr, --master-port) on each node."
        )
    for key in DESCRIPTIVE_KEYS:
        top.pop(key, None)
    for key in ("fsdp_version",):
        top.pop(key, None)
    if "parallelism_config" in top:
        mapped, mapped_notes = map_parallelism_config(top.pop("parallelism_config") or {}, source)
        options.update(mapped.pop("strategy_options", {}))
        out.update(mapped)
        notes += mapped_notes
    for key in sorted(top):
        notes.append(f"{source}: {key} is not understood by shardwise finetune; ignored.")
    # The fsdp_config section, with or without the fsdp_ prefix.
    fsdp = {(k[5:] if k.startswith("fsdp_") else k): v for k, v in fsdp.items()}
    if str(fsdp.pop("version", 2)) == "1":
        notes.append(
            f"{source}: fsdp_version 1 asks for FSDP1; shardwise runs FSDP2 (fully_shard) with the same settings."
        )
    if "sharding_strategy" in fsdp:
        name, reshard = sharding_strategy_name(fsdp.pop("sharding_strategy"))
        out["sharding_strategy"] = name
        if reshard is not None:
            options["reshard_after_forward"] = reshard
    if "reshard_after_forward" in fsdp:  # FSDP2's own spelling (Accelerate with fsdp_version 2)
        value = fsdp.pop("reshard_after_forward")
        if isinstance(value, str) and value.lower() not in TRUE + ("false", "0", "no", "off"):
            name, reshard = sharding_strategy_name(value)
            out["sharding_strategy"] = name
            options["reshard_after_forward"] = name != "SHARD_GRAD_OP" if reshard is None else reshard
        else:
            options["reshard_after_forward"] = _bool(value)
    policy = str(fsdp.pop("auto_wrap_policy", "TRANSFORMER_BASED_WRAP")).upper()
    layers = fsdp.pop("transformer_layer_cls_to_wrap", None)
    min_params = fsdp.pop("min_num_params", None)
    if policy == "TRANSFORMER_BASED_WRAP":
        if layers:
            out["auto_wrap_policy"] = [
                s.strip() for s in (layers if isinstance(layers, list) else str(layers).split(",")) if s.strip()
            ]
    elif policy in ("SIZE_BASED_WRAP", "NO_WRAP"):
        notes.append(
            f"{source}: fsdp_auto_wrap_policy {policy}"
            + (f" (min_num_params={min_params})" if min_params else "")
            + " is not honoured: the recipe shards by the model's transformer blocks (its "
            "_no_split_modules, or fsdp_transformer_layer_cls_to_wrap)."
        )
    else:
        raise ValueError(f"{source}: fsdp_auto_wrap_policy {policy!r}; use TRANSFORMER_BASED_WRAP.")
    if "offload_params" in fsdp:
        out["cpu_offload"] = _bool(fsdp.pop("offload_params"))
    if "state_dict_type" in fsdp:
        out["state_dict_type"] = state_dict_type_name(fsdp.pop("state_dict_type"))
    if "activation_checkpointing" in fsdp:
        out["gradient_checkpointing"] = _bool(fsdp.pop("activation_checkpointing"))
    for key, theirs in (
        ("cpu_ram_efficient_loading", "cpu_ram_efficient_loading"),
        ("sync_module_states", "sync_module_states"),
        ("use_orig_params", "use_orig_params"),
        ("forward_prefetch", "forward_prefetch"),
        ("backward_prefetch", "backward_prefetch"),
        ("backward_prefetch_policy", "backward_prefetch"),
        ("limit_all_gathers", "limit_all_gathers"),
    ):
        if key in fsdp:
            value = fsdp.pop(key)
            notes.append(f"{source}: fsdp_{key}={value} has nothing to do here: {NOTHING_TO_DO[theirs]}.")
    for key in sorted(fsdp):
        notes.append(f"{source}: fsdp_{key} is not understood by shardwise finetune; ignored.")
    if options:
        out["strategy_options"] = options
    return out, notes


PARALLELISM_PREFIX = "parallelism_config_"


def map_parallelism_config(raw: Dict[str, Any], source: str) -> Tuple[Dict[str, Any], List[str]]:
    """Accelerate's ParallelismConfig (yaml `parallelism_config:` or `--parallelism_config_*`) as our options.

    tp_size and sp_size (Accelerate's DeepSpeed ALST Ulysses) are ours; cp_size (torch's context parallel,
    ring attention) becomes sp_size with a note: the same split of the sequence, computed with Ulysses'
    all-to-all. The data-parallel sizes follow from the process count; dp_replicate_size > 1 is
    HYBRID_SHARD over a (replicate, shard) mesh.
    """
    if not isinstance(raw, dict):
        raise ValueError(f"{source}: parallelism_config must be a mapping of parallelism_config_* settings.")
    sizes = {(k[len(PARALLELISM_PREFIX) :] if k.startswith(PARALLELISM_PREFIX) else k): v for k, v in raw.items()}
    out: Dict[str, Any] = {}
    notes: List[str] = []

    def size(key: str) -> int:
        value = sizes.pop(key, None)
        return 1 if value in (None, "") else int(value)

    tp, sp, cp = size("tp_size"), size("sp_size"), size("cp_size")
    replicate, shard = size("dp_replicate_size"), size("dp_shard_size")
    if sp > 1 and cp > 1:
        raise ValueError(
            f"{source}: parallelism_config has both sp_size={sp} and cp_size={cp}; shardwise splits the sequence "
            "once (sp_size). Set one of them."
        )
    if cp > 1:
        notes.append(
            f"{source}: cp_size={cp} (torch context parallel) runs as sp_size={cp}: shardwise splits the sequence "
            "with Ulysses' all-to-all around attention, keeping packed documents apart; same losses, other collectives."
        )
        sp = cp
    for key, ours in (("tp_size", tp), ("sp_size", sp)):
        if ours > 1:
            out[key] = ours
    if replicate > 1:
        out["sharding_strategy"] = "HYBRID_SHARD"
        out["strategy_options"] = {"device_mesh": [replicate, shard]}
    backend = str(sizes.pop("sp_backend", "deepspeed") or "deepspeed")
    if sp > 1 and backend != "deepspeed":
        notes.append(f"{source}: sp_backend={backend}: shardwise's own Ulysses runs instead.")
    for key in ("cp_backend", "cp_comm_strategy", "sp_seq_length", "sp_seq_length_is_variable"):
        if key in sizes:
            notes.append(
                f"{source}: {PARALLELISM_PREFIX}{key}={sizes.pop(key)} has nothing to do here: shardwise's sequence "
                "parallel is Ulysses (all-to-all) on every batch length the degree divides."
            )
    attn = sizes.pop("sp_attn_implementation", None)
    if attn is not None:
        out["attn_implementation"] = attn
    for key in sorted(sizes):
        notes.append(f"{source}: {PARALLELISM_PREFIX}{key} is not understood by shardwise finetune; ignored.")
    return out, notes


# Top-level Accelerate keys (outside its fsdp_config section).
_TOP_KEYS = (
    "distributed_type",
    "mixed_precision",
    "num_machines",
    "num_processes",
    "use_cpu",
    "deepspeed_config",
    *LAUNCHER_KEYS,
    *DESCRIPTIVE_KEYS,
)


def _emit(values: List[Tuple[str, Any]]) -> List[str]:
    """Back to an argument list for jsonargparse; accelerate's total num_processes becomes devices per node."""
    merged: Dict[str, Any] = {}
    positional: List[str] = []
    options: Dict[str, Any] = {}
    for key, value in values:
        if key == "":
            positional.append(value)
        elif key == "strategy_options":
            options.update(json.loads(value) if isinstance(value, str) else value)
        else:
            merged.pop(key, None)
            merged[key] = value
    if options:
        merged["strategy_options"] = options
    processes = merged.pop("_num_processes", None)
    if processes is not None:
        nodes = int(merged.get("num_nodes", 1) or 1)
        total = int(processes)
        if total % nodes:
            raise ValueError(f"num_processes={total} is not a multiple of num_machines={nodes}.")
        merged.setdefault("devices", total // nodes)
    argv: List[str] = list(positional)
    for key, value in merged.items():
        if value is None:
            argv += [f"--{key}", "null"]
        elif isinstance(value, (dict, list, bool)):
            argv += [f"--{key}", json.dumps(value)]
        else:
            argv += [f"--{key}", str(value)]
    return argv

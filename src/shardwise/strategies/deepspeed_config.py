"""The DeepSpeed config a run uses: the user's config, filled (never overridden) by shardwise's settings.

DeepSpeed reads one JSON config; shardwise has its own arguments for the same
things (ZeRO stage, offload, precision, accumulation, clipping, the
DataLoader's batch size). `build_config` merges them by one rule: a value the
user's config sets wins, a value it leaves out (or writes as "auto", as
Hugging Face's configs do) is filled from shardwise, and when both are set
and disagree the error names both. It is a pure function, called from the
strategy's constructor and again as the Trainer's settings arrive, so every
contradiction surfaces in the user's process before a worker starts.
"""

from __future__ import annotations

import copy
import importlib
import json
import os
import shutil
from typing import Any, Dict, List, Optional, Tuple, Union

import torch

STAGES = (0, 1, 2, 3)


class DeepSpeedConfigError(ValueError):
    """The DeepSpeed configuration is invalid or contradicts the Trainer's settings."""


def load_config(config: Union[None, str, os.PathLike, Dict[str, Any]]) -> Dict[str, Any]:
    """A private deep copy of a config dict, or the parsed JSON file at `config`."""
    if config is None:
        return {}
    if isinstance(config, dict):
        return copy.deepcopy(config)
    if isinstance(config, (str, os.PathLike)):
        path = os.fspath(config)
        if not os.path.isfile(path):
            raise DeepSpeedConfigError(f"DeepSpeed config file {path!r} does not exist.")
        with open(path) as fh:
            try:
                return json.load(fh)
            except json.JSONDecodeError as exc:
                raise DeepSpeedConfigError(f"DeepSpeed config {path!r} is not valid JSON: {exc}") from exc
    raise TypeError(f"config must be a dict or a path to a DeepSpeed JSON file, got {type(config).__name__}.")


def _unset(value: Any) -> bool:
    # Hugging Face's DeepSpeed configs write "auto" for "let the trainer decide".
    return value is None or value == "auto"


def _section(cfg: Dict[str, Any], key: str) -> Dict[str, Any]:
    value = cfg.get(key)
    if value is None:
        value = cfg[key] = {}
    if not isinstance(value, dict):
        raise DeepSpeedConfigError(f"DeepSpeed config {key!r} must be an object, got {value!r}.")
    return value


def reconcile(section: Dict[str, Any], key: str, ours: Any, path: str, ours_name: str) -> Any:
    """The config's value for `key` if it has one, else ours; a disagreement is an error naming both."""
    theirs = section.get(key)
    if _unset(theirs):
        if ours is None:
            section.pop(key, None)
            return None
        section[key] = ours
        return ours
    if ours is not None and theirs != ours:
        raise DeepSpeedConfigError(
            f"The DeepSpeed config sets {path}={theirs!r} but {ours_name}={ours!r}. "
            "Set it in one place (the config wins only where shardwise has no value of its own)."
        )
    return theirs


def offload_enabled(section: Dict[str, Any], key: str) -> Optional[bool]:
    """Whether zero_optimization[key] (offload_param / offload_optimizer) offloads; None when unset."""
    entry = section.get(key)
    if entry is None:
        return None
    device = entry.get("device", "none") if isinstance(entry, dict) else entry
    return str(device).lower() not in ("none", "")


def cpu_adam_problem() -> Optional[str]:
    """Why DeepSpeedCPUAdam cannot run here, or None when its C++ op is built or buildable."""
    from deepspeed.ops.op_builder import CPUAdamBuilder

    builder = CPUAdamBuilder()
    try:
        importlib.import_module(builder.absolute_name())
        return None  # installed prebuilt (DS_BUILD_CPU_ADAM=1)
    except ImportError:
        pass
    if not builder.is_compatible(verbose=False):
        return "DeepSpeed reports its cpu_adam op as incompatible with this machine"
    try:
        # Here, not at the top: torch.utils.cpp_extension imports setuptools (~40 ms), and this
        # module is imported with shardwise; only a diagnosis of DeepSpeed's CPU Adam build needs it.
        from torch.utils.cpp_extension import verify_ninja_availability

        verify_ninja_availability()
    except RuntimeError:
        return "ninja is not installed (pip install ninja), so the op cannot be compiled"
    if shutil.which(os.environ.get("CXX", "c++")) is None:
        return "no C++ compiler (c++ / $CXX) is on PATH, so the op cannot be compiled"
    return None


def build_config(
    user_config: Dict[str, Any],
    args: Dict[str, Any],
    precision: Optional[str] = None,
    loop: Optional[Dict[str, Any]] = None,
    world_size: Optional[int] = None,
) -> Dict[str, Any]:
    """User config + strategy arguments + precision + loop settings -> DeepSpeed's config (or an error).

    `precision` (a shardwise precision name), `loop` (accumulate_grad_batches,
    gradient_clip_val, micro_batch_size) and `world_size` are checked only once known.
    """
    cfg = copy.deepcopy(user_config)
    zero = _section(cfg, "zero_optimization")
    stage = reconcile(zero, "stage", args["stage"], "zero_optimization.stage", "stage")
    stage = 2 if stage is None else stage
    if stage not in STAGES:
        raise DeepSpeedConfigError(
            f"ZeRO stage={stage!r} does not exist. Stages: 0 (plain data parallel), 1 (shard optimizer "
            "state), 2 (+ gradients), 3 (+ parameters)."
        )
    zero["stage"] = stage
    pin = torch.cuda.is_available()  # pinned host memory only helps device copies
    for arg, key, ok in (
        ("offload_optimizer", "offload_optimizer", stage >= 1),
        ("offload_parameters", "offload_param", stage == 3),
    ):
        theirs, ours = offload_enabled(zero, key), args[arg]
        if theirs is not None and ours is not None and theirs != ours:
            raise DeepSpeedConfigError(
                f"The DeepSpeed config sets zero_optimization.{key}.device="
                f"{zero[key].get('device')!r} but {arg}={ours!r}; set it in one place."
            )
        if ours and theirs is None:
            zero[key] = {"device": "cpu", "pin_memory": pin}
        if (theirs or ours) and not ok:
            need = "stage 3 (only stage 3 shards parameters)" if key == "offload_param" else "stage 1, 2 or 3"
            raise DeepSpeedConfigError(f"{arg}=True needs ZeRO {need}, but stage={stage}.")
    ac = cfg.get("activation_checkpointing") or {}
    for arg in ("partition_activations", "cpu_checkpointing", "contiguous_memory_optimization"):
        reconcile(ac, arg, args[arg], f"activation_checkpointing.{arg}", arg)
    if ac.get("contiguous_memory_optimization") and not ac.get("partition_activations"):
        raise DeepSpeedConfigError(
            "contiguous_memory_optimization=True works only together with "
            "partition_activations=True (DeepSpeed packs the partitioned activations)."
        )
    if ac:
        cfg["activation_checkpointing"] = ac
    _reconcile_precision(cfg, precision)
    _reconcile_loop(cfg, loop or {}, world_size)
    # Fill the rest quietly: allow any torch optimizer, and keep DeepSpeed's
    # periodic stdout reports and timers out of the user's progress bar.
    for key, value in (
        ("zero_allow_untested_optimizer", True),
        ("steps_per_print", 2**31 - 1),
        ("wall_clock_breakdown", False),
    ):
        cfg.setdefault(key, value)
    return cfg


def precision_from_config(user_config: Dict[str, Any]) -> Optional[str]:
    """The precision a config's own bf16 / fp16 section asks for ("bf16-mixed", "16-mixed"), or None.

    When the config is the one place the user set precision (no precision= on the strategy or the
    Trainer), it is the run's precision, instead of a contradiction with the default "32-true".
    """
    for section, name in (("bf16", "bf16-mixed"), ("fp16", "16-mixed")):
        enabled = (user_config.get(section) or {}).get("enabled")
        if not _unset(enabled) and bool(enabled):
            return name
    return None


def _reconcile_precision(cfg: Dict[str, Any], name: Optional[str]) -> None:
    if name is None:
        return
    if name == "64-true":
        raise DeepSpeedConfigError("precision='64-true' is not supported by DeepSpeed; use '32-true' or bf16.")
    want = {"32-true": None, "bf16-mixed": "bf16", "bf16-true": "bf16", "16-mixed": "fp16", "16-true": "fp16"}[name]
    for section in ("bf16", "fp16"):
        enabled = (cfg.get(section) or {}).get("enabled")
        enabled = None if _unset(enabled) else bool(enabled)
        if enabled is not None and enabled != (section == want):
            raise DeepSpeedConfigError(
                f"The DeepSpeed config sets {section}.enabled={enabled} but the "
                f"Trainer's precision={name!r}; set precision in one place."
            )
        if section == want:
            _section(cfg, section)["enabled"] = True  # fp16: DeepSpeed's dynamic loss scaling by default


def _reconcile_loop(cfg: Dict[str, Any], loop: Dict[str, Any], world_size: Optional[int]) -> None:
    reconcile(
        cfg,
        "gradient_accumulation_steps",
        loop.get("accumulate_grad_batches"),
        "gradient_accumulation_steps",
        "Trainer(accumulate_grad_batches)",
    )
    reconcile(
        cfg, "gradient_clipping", loop.get("gradient_clip_val"), "gradient_clipping", "Trainer(gradient_clip_val)"
    )
    if "gradient_clip_val" in loop and _unset(cfg.get("gradient_clipping")):
        # No clipping was asked for, and DeepSpeed clips at norm 1.0 when the key is
        # absent: an unclipped run would take smaller steps than under DDP or FSDP.
        cfg["gradient_clipping"] = 0.0
    micro = reconcile(
        cfg,
        "train_micro_batch_size_per_gpu",
        loop.get("micro_batch_size"),
        "train_micro_batch_size_per_gpu",
        "the DataLoader's batch_size",
    )
    if micro is None:  # a hand-written loop that never said: DeepSpeed only uses it for reporting
        micro = cfg["train_micro_batch_size_per_gpu"] = 1
    gas = cfg.setdefault("gradient_accumulation_steps", 1)
    total = cfg.get("train_batch_size")
    expected = micro * gas * (world_size or 1)
    if _unset(total):
        cfg.pop("train_batch_size", None)
    elif world_size is not None and total != expected:  # the world size is known from connect() on
        raise DeepSpeedConfigError(
            f"The DeepSpeed config sets train_batch_size={total} but micro-batch {micro} x accumulation "
            f"{gas} x world size {world_size} = {expected}. Remove train_batch_size or make them agree."
        )


# DeepSpeed's size limits (in elements) are absolute numbers chosen for ~10B-parameter
# models: buckets are allocated whole (2 GB per rank in fp32 at stage 3) and ZeRO-3
# keeps up to max_live_parameters gathered, so for a small model they mean "allocate
# gigabytes of buffers" and "never re-shard", hiding what ZeRO saves.
SIZE_DEFAULTS = {
    "reduce_bucket_size": 5e8,
    "allgather_bucket_size": 5e8,
    "stage3_prefetch_bucket_size": 5e7,
    "stage3_max_live_parameters": 1e9,
    "stage3_max_reuse_distance": 1e9,
}


def size_limits(numels: List[int], user_zero: Optional[Dict[str, Any]] = None) -> Dict[str, int]:
    """The size limits shardwise fills in for a model whose parameters have `numels` elements.

    Each of SIZE_DEFAULTS the user's zero_optimization section leaves unset is
    capped at 1/8 of the model, never below its largest parameter or 2**20: a
    small model keeps the proportions a large one gets, and models past ~8e9
    parameters keep DeepSpeed's defaults. (The memory planner uses this too.)
    """
    numels = list(numels) or [1]
    cap = max(max(numels), sum(numels) // 8, 2**20)
    user_zero = user_zero or {}
    # DeepSpeed accepts the stage-3 keys with or without their "stage3_" prefix.
    return {
        key: int(min(default, cap))
        for key, default in SIZE_DEFAULTS.items()
        if _unset(user_zero.get(key)) and _unset(user_zero.get(key.replace("stage3_", "")))
    }


# Lightning's DeepSpeedStrategy keyword arguments that are config keys under another name: the argument,
# then the config path it sets (section, key); "aio" is DeepSpeed's NVMe I/O section.
LIGHTNING_KEYS = {
    "allgather_bucket_size": ("zero_optimization", "allgather_bucket_size"),
    "reduce_bucket_size": ("zero_optimization", "reduce_bucket_size"),
    "allgather_partitions": ("zero_optimization", "allgather_partitions"),
    "reduce_scatter": ("zero_optimization", "reduce_scatter"),
    "overlap_comm": ("zero_optimization", "overlap_comm"),
    "contiguous_gradients": ("zero_optimization", "contiguous_gradients"),
    "sub_group_size": ("zero_optimization", "sub_group_size"),
    "zero_allow_untested_optimizer": (None, "zero_allow_untested_optimizer"),
    "logging_batch_size_per_gpu": (None, "train_micro_batch_size_per_gpu"),
    "synchronize_checkpoint_boundary": ("activation_checkpointing", "synchronize_checkpoint_boundary"),
    "block_size": ("aio", "block_size"),
    "queue_depth": ("aio", "queue_depth"),
    "single_submit": ("aio", "single_submit"),
    "overlap_events": ("aio", "overlap_events"),
    "thread_count": ("aio", "thread_count"),
    # fp16's dynamic loss scaling (only meaningful with precision 16-mixed / 16-true)
    "loss_scale": ("fp16", "loss_scale"),
    "initial_scale_power": ("fp16", "initial_scale_power"),
    "loss_scale_window": ("fp16", "loss_scale_window"),
    "hysteresis": ("fp16", "hysteresis"),
    "min_loss_scale": ("fp16", "min_loss_scale"),
}
# ... that configure an offload target: they need offload_parameters / offload_optimizer on.
OFFLOAD_KEYS = {
    "offload_params_device": ("offload_param", "device"),
    "params_buffer_count": ("offload_param", "buffer_count"),
    "params_buffer_size": ("offload_param", "buffer_size"),
    "max_in_cpu": ("offload_param", "max_in_cpu"),
    "offload_optimizer_device": ("offload_optimizer", "device"),
    "optimizer_buffer_count": ("offload_optimizer", "buffer_count"),
    "pin_memory": (None, "pin_memory"),  # both offload targets
    "nvme_path": (None, "nvme_path"),  # both offload targets
}
# Their values in Lightning's signature: passed with nothing offloaded, they are what Lightning ignores too.
OFFLOAD_DEFAULTS = {
    "offload_params_device": "cpu",
    "params_buffer_count": 5,
    "params_buffer_size": 100_000_000,
    "max_in_cpu": 1_000_000_000,
    "offload_optimizer_device": "cpu",
    "optimizer_buffer_count": 4,
    "pin_memory": False,
    "nvme_path": "/local_nvme",
}
# ... that shardwise does not honour, with the reason (refused by name unless left at Lightning's default).
REFUSED = {
    "remote_device": (None, "ZeRO-3 builds where offload_parameters says (the device, or 'cpu'); set that"),
    "load_full_weights": (
        False,
        "fit(ckpt_path=...) resumes a DeepSpeed checkpoint; load consolidated weights in "
        "TrainModule.init_weights, or convert with `shardwise convert`",
    ),
    "exclude_frozen_parameters": (False, "checkpoints hold every parameter (their manifest lists each one)"),
    "accelerator": (None, "pass Trainer(accelerator=...)"),
    "parallel_devices": (None, "pass Trainer(devices=...)"),
    "cluster_environment": (None, "shardwise reads the launcher's environment (torchrun, SLURM, shardwise launch)"),
    "precision_plugin": (None, "pass Trainer(precision=...) or precision= here"),
    "process_group_backend": (None, "the backend follows the device (NCCL on CUDA, gloo on CPU)"),
}


def lightning_options(
    options: Dict[str, Any],
    config: Dict[str, Any],
    offload_parameters: Optional[bool],
    offload_optimizer: Optional[bool],
) -> Tuple[Dict[str, Any], Optional[float]]:
    """Lightning's DeepSpeedStrategy keyword arguments -> (the config with them set, Lightning's `timeout` in s).

    Each is written where DeepSpeed reads it; one the config already sets to another value is an error
    naming both (set it in one place), one shardwise does not honour is refused with the reason, and an
    unknown name lists the valid ones.
    """
    cfg = copy.deepcopy(config)
    timeout = options.pop("timeout", None)
    if "zero_optimization" in options:  # Lightning's switch for ZeRO as a whole: off is stage 0
        enabled = options.pop("zero_optimization")
        if not enabled:
            reconcile(_section(cfg, "zero_optimization"), "stage", 0, "zero_optimization.stage", "zero_optimization")
    unknown = [k for k in options if k not in LIGHTNING_KEYS and k not in OFFLOAD_KEYS and k not in REFUSED]
    if unknown:
        raise TypeError(
            f"DeepSpeedStrategy got unknown argument(s) {sorted(unknown)}. Lightning's names it takes: "
            f"{', '.join(sorted([*LIGHTNING_KEYS, *OFFLOAD_KEYS, 'zero_optimization', 'timeout']))}; refused: "
            f"{', '.join(sorted(REFUSED))}."
        )
    for name, value in options.items():
        if name in REFUSED:
            default, why = REFUSED[name]
            if value != default:
                raise DeepSpeedConfigError(f"DeepSpeedStrategy({name}={value!r}) is not supported: {why}.")
        elif name in LIGHTNING_KEYS:
            section, key = LIGHTNING_KEYS[name]
            target = cfg if section is None else _section(cfg, section)
            reconcile(target, key, value, f"{section + '.' if section else ''}{key}", name)
    # The devices first: the other offload keys default the device to "cpu".
    for name, value in sorted(options.items(), key=lambda item: OFFLOAD_KEYS.get(item[0], (None, ""))[1] != "device"):
        if name not in OFFLOAD_KEYS:
            continue
        target, key = OFFLOAD_KEYS[name]
        targets = [target] if target else ["offload_param", "offload_optimizer"]
        wanted = {"offload_param": offload_parameters, "offload_optimizer": offload_optimizer}
        on = [t for t in targets if wanted[t] or offload_enabled(cfg.get("zero_optimization") or {}, t)]
        if not on and value == OFFLOAD_DEFAULTS[name]:
            continue
        if not on:
            switch = "offload_parameters" if target == "offload_param" else "offload_optimizer"
            raise DeepSpeedConfigError(
                f"DeepSpeedStrategy({name}={value!r}) configures an offload target, but nothing is offloaded: "
                f"pass {switch if target else 'offload_parameters or offload_optimizer'}=True."
            )
        for t in on:
            section = _section(_section(cfg, "zero_optimization"), t)
            if key != "device":
                section.setdefault("device", "cpu")
            reconcile(section, key, value, f"zero_optimization.{t}.{key}", name)
    if timeout is not None and not isinstance(timeout, (int, float)):
        timeout = timeout.total_seconds()  # Lightning passes a datetime.timedelta
    return cfg, timeout

"""`shardwise plan`: the memory planner from the command line.

    shardwise plan --model llama-2-70b --devices 8 --num-nodes 2 --device-memory 80GiB \\
        --precision bf16-mixed --batch-size 1 --seq-len 2048 [--cpu-memory 1TiB] [--json] [--plot plan.png]
    shardwise plan --model llama-3-8b --devices 8 --device-memory 80GiB --seq-len 131072 [--sp_size 8 --tp_size 1]

The signature of `plan_command` is the option schema (its docstring gives the
help texts). Mistakes the user can fix -- an unknown preset, a config.json that
is not a causal LM, an unparsable memory size, a layout the sharding cannot
split -- are a PlanError (a ValueError): one line, exit status 2.
"""

from __future__ import annotations

import json as _json
from typing import Any, List, Optional

from jsonargparse import ArgumentParser


def plan_command(
    model: str,
    devices: int = 1,
    num_nodes: int = 1,
    device_memory: Optional[str] = None,
    precision: str = "bf16-mixed",
    batch_size: int = 1,
    seq_len: Optional[int] = None,
    cpu_memory: Optional[str] = None,
    only: Optional[str] = None,
    accelerator: str = "cuda",
    gpu: str = "a100",
    interconnect: str = "nvlink",
    network: str = "infiniband",
    reserved_factor: Optional[float] = None,
    deepspeed_config: Optional[str] = None,
    all_micro_batches: bool = False,
    all: bool = False,
    json: bool = False,
    plot: Optional[str] = None,
    workers: Optional[int] = None,
    optimizer: str = "adamw",
    foreach: Optional[bool] = None,
    fused: Optional[bool] = None,
    paged_resident: float = 0.0,
    expandable_segments: Optional[bool] = None,
    strategy: Optional[str] = None,
    lora_r: int = 0,
    lora_alpha: int = 16,
    lora_dropout: float = 0.0,
    lora_target_modules: Optional[List[str]] = None,
    load_in_4bit: bool = False,
    headroom: float = 0.1,
    optimizer_variants: bool = True,
    sp_size: Optional[int] = None,
    tp_size: Optional[int] = None,
    ep_size: Optional[int] = None,
    revision: Optional[str] = None,
) -> int:
    """Predict per-device memory for each training configuration and pick the fastest that fits.

    Args:
        model: a preset (see --help for the list), a hub model id (org/name: only its config.json is
            downloaded), a path to a Hugging Face config.json or model directory (no weights are read),
            or python:module.Class (a TrainModule with example_batch(batch_size, seq_len), or a GPTConfig).
        devices: devices per node.
        num_nodes: number of nodes.
        device_memory: memory per device, e.g. 80GiB, 40GB, 24576MiB.
        precision: 32-true, bf16-mixed, 16-mixed, bf16-true, 16-true.
        batch_size: sequences per device per optimizer step (split into micro-batches with
            gradient accumulation when the whole batch does not fit).
        seq_len: tokens per sequence (default: the model's context length).
        cpu_memory: host memory per node, e.g. 1TiB (checked against offload and loading needs).
        only: comma-separated configurations to plan, e.g. ddp,fsdp_ac,deepspeed_stage_3_offload.
        accelerator: cuda (plan for GPUs) or cpu.
        gpu: a100, h100, h200, a10g, l4, v100 (step-time model only).
        interconnect: nvlink, nvlink4, pcie4, pcie5 (inside a node).
        network: infiniband, ib-ndr, efa, ethernet (across nodes).
        reserved_factor: a flat reserved / allocated ratio instead of the allocator model.
        deepspeed_config: a DeepSpeed JSON config whose zero_optimization buckets to use.
        all_micro_batches: evaluate every micro-batch split, not only when the whole batch does not fit.
        all: show every evaluated row in the table.
        json: print the plan as JSON instead of a table.
        plot: write a PNG bar chart of the breakdown per configuration to this path.
        workers: processes tracing in parallel (default: 2 on machines with 2+ cores).
        optimizer: adamw, adam, sgd, adamw_fused, adamw_foreach, adamw_forloop, paged_adamw_32bit,
            paged_adamw_8bit, adamw_8bit.
        foreach: the optimizer's foreach setting (default: PyTorch's on the target, true on cuda).
        fused: the optimizer's fused setting.
        paged_resident: fraction of a paged optimizer's state resident on the device (default 0).
        expandable_segments: the CUDA allocator setting (default: PYTORCH_CUDA_ALLOC_CONF, else off).
        strategy: plan exactly this strategy: a name (fsdp, ddp, fsdp_shard_grad_op, deepspeed_stage_3,
            ...) or python:module.attr (a Strategy object or a ParallelPlan, or a function returning one).
        lora_r: plan LoRA fine-tuning of this rank (0: full fine-tuning): a frozen base, adapter
            gradients and optimizer state only.
        lora_alpha: LoRA's scaling numerator.
        lora_dropout: dropout on the LoRA input (its mask is saved for backward).
        lora_target_modules: modules that get adapters, PEFT's names (e.g. q_proj,v_proj, or
            all-linear); default: PEFT's for the model type (q_proj,v_proj for the Llama presets).
        load_in_4bit: QLoRA: the frozen base in NF4 with double quantisation (needs --lora_r).
        headroom: fraction of device (and host) memory a configuration must leave free to fit (0 to judge
            against the whole device).
        optimizer_variants: when nothing fits or a faster configuration misses, also plan 8-bit / paged
            AdamW and say which changes the verdict.
        sp_size: plan the FSDP configurations with sequence parallel of this degree (Ulysses; 1: off).
            With neither --sp_size nor --tp_size, the full comparison also searches the degrees that
            divide the devices per node, the attention heads and the sequence length.
        tp_size: plan the FSDP configurations with tensor parallel of this degree (1: off).
        ep_size: plan the FSDP configurations of a mixture-of-experts model with expert parallel of this degree
            (1: off). Without it, a model with experts is also planned at every degree that divides its experts
            and the devices (FSDP FULL_SHARD with and without checkpointing).
        revision: a hub model id's revision: a branch, tag or commit hash (default: main).
    """
    from shardwise.plan.core import plan
    from shardwise.plan.errors import PlanError
    from shardwise.plan.report import plot as plot_png
    from shardwise.plan.report import print_table, to_json

    ds_config = None
    if deepspeed_config is not None:
        try:
            with open(deepspeed_config) as fh:
                ds_config = _json.load(fh)
        except (OSError, ValueError) as exc:
            raise PlanError(f"--deepspeed-config {deepspeed_config}: {exc}") from exc
    strategy_obj = _strategy(strategy) if strategy else None
    from shardwise.recipes.hub import resolve_model

    resolved = resolve_model(model, revision, config_only=True)  # a hub id: its config.json; anything else as given
    if resolved != model and not json:
        print(f"{model} (revision {revision or 'main'}): {resolved}")
    model = resolved
    result = plan(
        model,
        batch_size=batch_size,
        seq_len=seq_len,
        devices=devices,
        num_nodes=num_nodes,
        device_memory=device_memory,
        precision=precision,
        cpu_memory=cpu_memory,
        candidates=[c for c in only.split(",") if c.strip()] if only else None,
        accelerator=accelerator,
        gpu=gpu,
        interconnect=interconnect,
        network=network,
        reserved_factor=reserved_factor,
        deepspeed_config=ds_config,
        all_micro_batches=all_micro_batches,
        workers=workers,
        optimizer=optimizer,
        foreach=foreach,
        fused=fused,
        paged_resident=paged_resident,
        expandable_segments=expandable_segments,
        strategy=strategy_obj,
        lora_r=lora_r,
        lora_alpha=lora_alpha,
        lora_dropout=lora_dropout,
        lora_target_modules=lora_target_modules,
        load_in_4bit=load_in_4bit,
        headroom=headroom,
        optimizer_variants=optimizer_variants,
        tp_size=tp_size,
        sp_size=sp_size,
        ep_size=ep_size,
    )
    if json:
        print(to_json(result))
    else:
        print_table(result, show_all=all)
    if plot:
        plot_png(result, plot, show_all=all)
        if not json:
            print(f"wrote {plot}")
    return 0


def _strategy(value: str) -> object:
    """--strategy: a name (a ParallelPlan of strategies/names.py), or python:module.attr naming a Strategy or
    a ParallelPlan (or a function returning one)."""
    from shardwise.plan.errors import PlanError

    if not value.startswith("python:"):
        return value
    import importlib

    module_name, _, attr = value[len("python:") :].rpartition(".")
    try:
        obj = getattr(importlib.import_module(module_name), attr)
    except (ImportError, AttributeError, ValueError) as exc:
        raise PlanError(f"--strategy {value}: cannot import it ({exc}).") from exc
    from shardwise.strategies import ParallelPlan, Strategy

    return obj if isinstance(obj, (Strategy, ParallelPlan)) else obj()


def parser() -> ArgumentParser:
    from shardwise.plan.presets import preset_names

    p = ArgumentParser(
        description="Predict per-device memory for each training configuration and pick the "
        "fastest that fits. Presets: " + ", ".join(preset_names()) + "."
    )
    p.add_function_arguments(plan_command, as_group=False)
    return p


def run(cfg: Any) -> int:
    return plan_command(**cfg.as_dict())

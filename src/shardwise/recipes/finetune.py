"""`shardwise finetune`: full fine-tuning of a local Hugging Face causal LM, one process to many nodes.

The recipe of the Llama-2-70B FSDP write-up, as one config: a
`FinetuneConfig` dataclass is both the Python API (`finetune(config)`) and
the CLI schema (`shardwise finetune --config run.yaml --learning_rate 1e-5`,
parsed by jsonargparse from the dataclass); its data options are one nested
`DataOptions` (data.py). Everything that can be checked without a GPU or a
second process -- the model folder, the dataset field, the sequence length
against the model's positions, flash attention / paged AdamW without CUDA --
is checked first, in the process the user started, before any worker or
weight exists. The run itself is the Trainer's ordinary road: a TrainModule
(causal_lm.py) and a DataModule (data.FinetuneData, which tokenises in
`prepare_data`). The model is built on the meta device, sharded by the FSDP
strategy with the model's own `_no_split_modules` as the wrap (and
activation-checkpointing) units, and its `init_weights` hook streams the
pretrained weights from rank 0 into the shards (hf_model.py). The DeepSpeed
strategies work the same way: ZeRO-1/2 materialise like DDP; at ZeRO-3 the
model is built under zero.Init and the loader writes each rank's partitions
directly (the module declares `init_weights_partitioned`, so the strategy
does not gather the whole model for the hook). `strategy_options` are
further arguments of the strategy's class, checked against its signature up
front. Intermediate checkpoints are the strategy's own (`save_steps`); the
final model is exported as a consolidated Hugging Face folder in
`output_dir`, one tensor at a time.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import math
import os
from dataclasses import dataclass, field
from typing import Any, Callable, Dict, List, Optional, Tuple, Union

import torch

from shardwise.adapters.lora import check_lora_config
from shardwise.adapters.quantize import check_4bit_config
from shardwise.callbacks.profiling import check_profile_steps
from shardwise.distributed.env import detect_env, resolve_accelerator, resolve_devices
from shardwise.distributed.launch import launch
from shardwise.dtypes import DTYPES, cast_dtype
from shardwise.flops import check_peak
from shardwise.memory import parse_bytes
from shardwise.precision import build_precision
from shardwise.recipes.causal_lm import build_module
from shardwise.recipes.data import (
    CHAT_FORMATS,
    PACKING_MODES,
    DataOptions,
    FinetuneData,
    check_assistant_only_loss,
    check_chatml_room,
    dataset_columns,
    default_cache_dir,
    resolve_text_field,
)
from shardwise.recipes.data_formats import check_source
from shardwise.recipes.hf_model import build_meta_model, export_hf_folder, inspect_model_folder
from shardwise.recipes.hub import (
    HubUpload,
    PushCheckpoints,
    check_push_options,
    dataset_path,
    is_hub_id,
    push_export,
    resolve_dataset,
    resolve_model,
    resolve_tokenizer,
    snapshot_commit,
)
from shardwise.recipes.lora_export import check_merge, export_lora
from shardwise.recipes.moe import check_expert_adapters
from shardwise.recipes.parallel import build_recipe_strategy
from shardwise.seed import seed_everything
from shardwise.trainer import Trainer

LR_SCHEDULERS = ("cosine", "linear", "constant")
ATTN_IMPLEMENTATIONS = ("sdpa", "eager", "flash_attention_2")
OPTIMIZERS = ("adamw", "adamw_torch", "adamw_torch_fused", "paged_adamw_32bit")
INTERVAL_STRATEGIES = ("steps", "epoch", "no")
DATA_OPTIONS = tuple(f.name for f in dataclasses.fields(DataOptions))


@dataclass
class FinetuneConfig:
    """Options of `shardwise finetune` (named as in the Hugging Face Llama FSDP recipe where it has one).

    In Python the data options are one `DataOptions` (`FinetuneConfig(data=DataOptions(max_seq_len=64))`);
    flags, YAML keys and the dict `finetune()` takes name them flat (`--max_seq_len 64`, `max_seq_len: 64`)
    or nested (`--data.max_seq_len 64`, `data: {max_seq_len: 64}`).

    Args:
        model_path: a hub model id (org/name: its safetensors, config and tokenizer files are downloaded
            once into the Hugging Face cache) or a local Hugging Face folder (config.json, *.safetensors,
            tokenizer files)
        revision: the model's hub revision: a branch, tag or commit hash (default: main)
        dataset_config: a hub data set's config: the subfolder of the repo to read
        dataset_revision: the data set's hub revision (default: main)
        hub_token: the token for private or gated repos and for uploads (default: HF_TOKEN, or the one
            `hf auth login` stored)
        tokenizer_path: tokenizer folder (default: model_path)
        data: the dataset and how it becomes token blocks and batches (DataOptions)
        max_steps: optimizer steps (-1: num_train_epochs)
        num_train_epochs: epochs when max_steps is -1
        logging_steps: print / log the loss every n optimizer steps
        eval_steps: evaluate every n optimizer steps
        save_steps: sharded, resumable checkpoint every n optimizer steps
        eval_strategy: steps (every eval_steps) | epoch (at each epoch's end) | no
        save_strategy: steps (every save_steps) | epoch (at each epoch's end) | no
        save_total_limit: step checkpoints kept (besides last)
        precision: 32-true | bf16-mixed | bf16-true | 16-mixed (CUDA) ...
        learning_rate: peak learning rate
        lr_scheduler_type: cosine | linear | constant (after linear warm-up)
        warmup_ratio: fraction of the steps spent warming up
        weight_decay: AdamW weight decay (not applied to biases and norms)
        adam_beta1: AdamW beta1
        adam_beta2: AdamW beta2
        adam_epsilon: AdamW epsilon
        max_grad_norm: clip gradients to this global norm (null: no clipping)
        gradient_accumulation_steps: micro-batches per optimizer step
        gradient_checkpointing: non-reentrant activation checkpointing on the decoder layers
        attn_implementation: sdpa | eager | flash_attention_2 (CUDA + flash-attn)
        optim: adamw (fused on CUDA) | adamw_torch | adamw_torch_fused |
            paged_adamw_32bit (CUDA + bitsandbytes)
        seed: random seed (data order, eval split, dropout)
        output_dir: where the Hugging Face folder, checkpoints and logs go
        resume_from_checkpoint: checkpoint path, or last
        export_dtype: dtype of the exported weights (default: as trained)
        max_shard_size: largest exported safetensors file, e.g. 5GB
        accelerator: auto | cpu | cuda
        devices: processes per node (auto: what the launcher started, else one per GPU, else 1)
        num_nodes: nodes (one shardwise launch / srun task each)
        strategy: auto, or a strategy name: fsdp | fsdp_shard_grad_op | fsdp_no_shard | fsdp_hybrid_shard |
            fsdp_cpu_offload | ddp | single | deepspeed | deepspeed_stage_1 | deepspeed_stage_2 |
            deepspeed_stage_2_offload | deepspeed_stage_3 | deepspeed_stage_3_offload
        strategy_options: more keyword arguments of the chosen strategy's class (FSDPStrategy,
            DeepSpeedStrategy, DDPStrategy), e.g. {limit_all_gathers: true} or {offload_optimizer: true}
        sharding_strategy: FULL_SHARD | SHARD_GRAD_OP | HYBRID_SHARD | NO_SHARD
        auto_wrap_policy: FSDP unit class names (default: the model's _no_split_modules)
        cpu_offload: offload parameters, gradients and optimizer state to host memory (CUDA)
        state_dict_type: sharded | full intermediate checkpoints
        enable_progress_bar: show the progress bar
        timeout_s: collective timeout in seconds
        peak_tflops: the device's dense peak TFLOP/s for MFU (default: the built-in table by GPU name)
        profile_steps: START END: torch.profiler traces of these optimizer steps in <output_dir>/profiles
        torch_compile: torch.compile each decoder layer (after checkpointing, before sharding; not DeepSpeed)
        tp_size: tensor-parallel degree: each decoder layer's projections split over this many ranks by
            the model's own tp_plan (FSDP; divides the attention and key/value heads)
        sp_size: sequence-parallel degree (Ulysses): each sample's sequence split over this many ranks
            (FSDP; divides the attention and key/value heads and max_seq_len)
        ep_size: expert-parallel degree for a mixture-of-experts model: its experts split over this many
            ranks, which read different samples and trade tokens by all-to-all (FSDP; divides the experts
            and the data-parallel ranks)
        router_aux_loss_coef: a mixture-of-experts model's load-balancing loss coefficient, trained over the
            global batch (default: the model config's, trained when its output_router_logits is true)
        lora_r: LoRA rank through PEFT (0: full fine-tuning, every weight trained)
        lora_alpha: LoRA scaling numerator (PEFT's lora_alpha)
        lora_dropout: dropout on the LoRA path
        lora_target_modules: PEFT's target_modules: module names, or all-linear
            (default: PEFT's choice for the model type)
        load_in_4bit: QLoRA: base weights frozen in 4-bit NF4 (bitsandbytes, double quantisation),
            computed in the precision's dtype; needs lora_r > 0
        merge: with LoRA, also export the adapter merged into the base weights as a Hugging Face folder
        push_to_hub: upload the exported folder (or the adapter folder) to the hub from global rank 0, in the
            background, once it is written and verified
        hub_model_id: the repo uploaded to, name or org/name (default: the output_dir's name)
        hub_private_repo: create the repo private
        hub_strategy: end (the final export) | every_save (also each save_steps checkpoint, into
            last-checkpoint/ of the repo)
    """

    # What to train on
    model_path: str = ""
    revision: Optional[str] = None
    tokenizer_path: Optional[str] = None
    dataset_config: Optional[str] = None
    dataset_revision: Optional[str] = None
    hub_token: Optional[str] = None
    data: DataOptions = field(default_factory=DataOptions)
    # How long, how often
    max_steps: int = -1
    num_train_epochs: int = 1
    logging_steps: int = 10
    eval_steps: Optional[int] = None
    save_steps: Optional[int] = None
    eval_strategy: str = "steps"
    save_strategy: str = "steps"
    save_total_limit: int = 1
    # Optimisation
    precision: str = "bf16-mixed"
    learning_rate: float = 5e-5
    lr_scheduler_type: str = "cosine"
    warmup_ratio: float = 0.0
    weight_decay: float = 0.0
    adam_beta1: float = 0.9
    adam_beta2: float = 0.999
    adam_epsilon: float = 1e-8
    max_grad_norm: Optional[float] = 1.0
    gradient_accumulation_steps: int = 1
    gradient_checkpointing: bool = False
    attn_implementation: str = "sdpa"
    optim: str = "adamw"
    seed: int = 42
    output_dir: str = "finetune-output"
    resume_from_checkpoint: Optional[str] = None
    export_dtype: Optional[str] = None
    max_shard_size: str = "5GB"
    # Trainer and strategy
    accelerator: str = "auto"
    devices: Union[int, str] = "auto"
    num_nodes: int = 1
    strategy: str = "fsdp"
    strategy_options: Optional[Dict[str, Any]] = None
    sharding_strategy: str = "FULL_SHARD"
    auto_wrap_policy: Optional[List[str]] = None
    cpu_offload: bool = False
    state_dict_type: str = "sharded"
    enable_progress_bar: bool = False
    timeout_s: float = 1800.0
    peak_tflops: Optional[float] = None
    profile_steps: Optional[Tuple[int, int]] = None
    torch_compile: bool = False
    tp_size: int = 1
    sp_size: int = 1
    ep_size: int = 1
    router_aux_loss_coef: Optional[float] = None
    # Adapters (LoRA / QLoRA through PEFT and bitsandbytes)
    lora_r: int = 0
    lora_alpha: int = 16
    lora_dropout: float = 0.0
    lora_target_modules: Optional[List[str]] = None
    load_in_4bit: bool = False
    merge: bool = False
    # Upload (opt-in)
    push_to_hub: bool = False
    hub_model_id: Optional[str] = None
    hub_private_repo: bool = False
    hub_strategy: str = "end"

    def __post_init__(self) -> None:
        if isinstance(self.data, dict):  # parsed from a command line or a YAML file
            unknown = sorted(set(self.data) - set(DATA_OPTIONS))
            if unknown:
                raise ValueError(f"unknown data option(s) {unknown}; valid: {sorted(DATA_OPTIONS)}")
            self.data = DataOptions(**self.data)


def _refuse_flat_data_options(init: Any) -> Any:
    """FinetuneConfig's __init__, refusing a data option named at the top level with where it goes.

    Flags, YAML keys and the dict finetune() takes may name data options flat; in Python they would
    otherwise meet a bare "unexpected keyword argument". functools.wraps keeps the signature that the
    command line (jsonargparse) reads."""

    @functools.wraps(init)
    def checked(self: Any, *args: Any, **kwargs: Any) -> None:
        flat = [k for k in kwargs if k in DATA_OPTIONS]
        if flat:
            said = ", ".join(f"{k}={kwargs[k]!r}" for k in flat)
            raise TypeError(
                f"FinetuneConfig({said}): in Python the data options go in one DataOptions: "
                f"FinetuneConfig(data=DataOptions({said})). (Flags, YAML keys and the dict finetune() takes "
                "may name them flat.)"
            )
        init(self, *args, **kwargs)

    return checked


FinetuneConfig.__init__ = _refuse_flat_data_options(FinetuneConfig.__init__)


@dataclass
class FinetuneResult:
    output_dir: str
    losses: List[Dict[str, float]] = field(default_factory=list)  # per optimizer step, global mean
    eval_losses: List[Dict[str, float]] = field(default_factory=list)
    load: Dict[str, Any] = field(default_factory=dict)  # rank-0 loading report of this rank
    data: Dict[str, Any] = field(default_factory=dict)
    parameters: Dict[str, int] = field(default_factory=dict)  # {"trainable": n, "total": n}, full sizes
    extra: Any = None  # what finetune(after_fit=...) returned on this rank


# ------------------------------------------------------------------ checks
def _has_cuda(cfg: FinetuneConfig) -> bool:
    return cfg.accelerator in ("auto", "cuda") and torch.cuda.is_available()


def validate_config(cfg: FinetuneConfig) -> Dict[str, Any]:
    """Every check that needs no worker; raises ValueError (or a subclass) with the fix."""

    data = cfg.data
    if not cfg.model_path:
        raise ValueError("model_path is required: a hub model id (org/name) or a local Hugging Face model folder.")
    if not data.dataset:
        raise ValueError(
            "dataset is required: a hub data set id (org/name), a .jsonl / .parquet file or a datasets folder."
        )
    hub_repo = check_push_options(cfg.push_to_hub, cfg.hub_model_id, cfg.hub_strategy, cfg.output_dir)
    # Hub ids become snapshot folders in the Hugging Face cache (downloaded once per cache); local paths stay.
    model_dir = resolve_model(cfg.model_path, cfg.revision, cfg.hub_token)
    snapshot = resolve_dataset(data.dataset, cfg.dataset_revision, cfg.dataset_config, cfg.hub_token)
    if snapshot is not None:
        data = dataclasses.replace(data, dataset=dataset_path(snapshot.path))
    folder = inspect_model_folder(model_dir)
    tok_dir = resolve_tokenizer(cfg.tokenizer_path, cfg.revision, cfg.hub_token) if cfg.tokenizer_path else model_dir
    if cfg.tokenizer_path is None and not folder.has_tokenizer:
        raise ValueError(
            f"{cfg.model_path!r} has no tokenizer files (tokenizer.json / tokenizer.model); "
            "save the tokenizer there or set tokenizer_path."
        )
    if data.max_seq_len < 2:
        raise ValueError(f"max_seq_len={data.max_seq_len}: use at least 2.")
    if folder.max_positions is not None and data.max_seq_len > folder.max_positions:
        raise ValueError(
            f"max_seq_len={data.max_seq_len} exceeds the model's maximum of {folder.max_positions} "
            f"positions (max_position_embeddings in {cfg.model_path}/config.json). Lower max_seq_len."
        )
    check_source(data.dataset, data.dataset_split, data.eval_split)  # empty, a malformed line, no such split
    columns = dataset_columns(data.dataset, data.dataset_split)
    text_field = resolve_text_field(columns, data.dataset_text_field, data.dataset)
    check_assistant_only_loss(data, text_field)  # no turns (plain text, chat_template_format none): refused
    check_chatml_room(data.chat_template_format, tok_dir, folder.config)
    for name in ("eval_strategy", "save_strategy"):
        if getattr(cfg, name) not in INTERVAL_STRATEGIES:
            raise ValueError(f"{name}={getattr(cfg, name)!r}: use one of {INTERVAL_STRATEGIES}.")
    if data.chat_template_format not in CHAT_FORMATS:
        raise ValueError(f"chat_template_format={data.chat_template_format!r}: use one of {CHAT_FORMATS}.")
    if data.packing_mode not in PACKING_MODES:
        raise ValueError(f"packing_mode={data.packing_mode!r}: use one of {PACKING_MODES}.")
    if cfg.lr_scheduler_type not in LR_SCHEDULERS:
        raise ValueError(f"lr_scheduler_type={cfg.lr_scheduler_type!r}: use one of {LR_SCHEDULERS}.")
    if not 0.0 <= cfg.warmup_ratio < 1.0:
        raise ValueError(f"warmup_ratio={cfg.warmup_ratio}: use a fraction in [0, 1).")
    if cfg.max_steps == 0 or cfg.max_steps < -1:
        raise ValueError(f"max_steps={cfg.max_steps}: use a positive number, or -1 for num_train_epochs.")
    for name, value in (
        ("per_device_train_batch_size", data.per_device_train_batch_size),
        ("per_device_eval_batch_size", data.per_device_eval_batch_size),
        ("gradient_accumulation_steps", cfg.gradient_accumulation_steps),
        ("logging_steps", cfg.logging_steps),
    ):
        if value < 1:
            raise ValueError(f"{name}={value}: use 1 or more.")
    if cfg.attn_implementation not in ATTN_IMPLEMENTATIONS:
        raise ValueError(f"attn_implementation={cfg.attn_implementation!r}: use one of {ATTN_IMPLEMENTATIONS}.")
    if cfg.attn_implementation == "flash_attention_2":
        import torch

        # Names only here ("cuda": no device check); the device checks come with build_precision below.
        if build_precision(cfg.precision, "cuda").compute_dtype not in (torch.float16, torch.bfloat16):
            raise ValueError(
                f"attn_implementation='flash_attention_2' with precision={cfg.precision!r}: flash-attn "
                "has fp16 / bf16 kernels only, so the first forward would fail. Use "
                "precision='bf16-mixed' (or 'bf16-true'), or keep the precision and use "
                "attn_implementation='sdpa', which runs in float32."
            )
        if not _has_cuda(cfg):
            raise ValueError(
                "attn_implementation='flash_attention_2' needs a CUDA GPU (its kernels are CUDA-only) "
                "and none is available here. Use attn_implementation='sdpa', which runs everywhere "
                "and dispatches to flash kernels on GPUs that support them."
            )
        major, minor = torch.cuda.get_device_capability()
        if major < 8:
            raise ValueError(
                f"attn_implementation='flash_attention_2' needs compute capability 8.0 or newer "
                f"(Ampere: A100, A10, RTX 30xx; Hopper), but {torch.cuda.get_device_name()} is "
                f"{major}.{minor}. Use attn_implementation='sdpa' (its memory-efficient kernel runs "
                "here), and precision='16-mixed': this GPU has no fast bf16."
            )
        try:
            import flash_attn  # noqa: F401
        except ImportError as exc:
            raise ValueError(
                "attn_implementation='flash_attention_2' needs the flash-attn package "
                "(pip install flash-attn --no-build-isolation), or use 'sdpa'."
            ) from exc
    if cfg.optim not in OPTIMIZERS:
        raise ValueError(f"optim={cfg.optim!r}: use one of {OPTIMIZERS}.")
    if cfg.optim == "paged_adamw_32bit":
        # On CPU bitsandbytes runs its 32-bit AdamW without paging (the state already lives
        # in host memory); under FSDP it steps on the local shards (strategies/local_optim.py).
        try:
            import bitsandbytes  # noqa: F401
        except ImportError as exc:
            raise ValueError(
                "optim='paged_adamw_32bit' needs the bitsandbytes package (pip install "
                "bitsandbytes), or use optim='adamw'."
            ) from exc
    if cfg.optim == "adamw_torch_fused" and not _has_cuda(cfg):
        raise ValueError("optim='adamw_torch_fused' is the CUDA fused kernel; use optim='adamw' here.")
    if cfg.export_dtype is not None and cfg.export_dtype not in DTYPES:
        raise ValueError(f"export_dtype={cfg.export_dtype!r}: use one of {', '.join(DTYPES)}.")
    build_precision(cfg.precision, "cuda" if _has_cuda(cfg) else "cpu")
    check_peak(cfg.peak_tflops, "--peak_tflops")
    check_profile_steps(cfg.profile_steps)
    strategy = build_recipe_strategy(cfg, folder)  # unknown names, unknown or conflicting strategy_options: fail here
    check_4bit_config(cfg, strategy)  # load_in_4bit: LoRA, bitsandbytes, precision, no ZeRO-3 / offload
    built: list = []  # the meta model the LoRA check wraps: no adapter on an MoE model's stacked experts
    check_lora_config(cfg, lambda: built.append(build_meta_model(folder, cfg.attn_implementation)) or built[-1])
    check_expert_adapters(built[0] if built else None, cfg.lora_target_modules)
    check_merge(cfg)
    return {
        "folder": folder,
        "tokenizer_dir": tok_dir,
        "text_field": text_field,
        "strategy": strategy,
        "data": data,  # cfg.data with a hub id replaced by its snapshot
        "dataset_revision": snapshot.commit if snapshot is not None else snapshot_commit(data.dataset),
        "hub_repo": hub_repo,
    }


# ------------------------------------------------------------------ running
_build_strategy = build_recipe_strategy  # the name tests and benchmarks/finetune_loading.py import


def _evaluates(cfg: FinetuneConfig) -> bool:
    return cfg.eval_strategy == "epoch" or (cfg.eval_strategy == "steps" and bool(cfg.eval_steps))


def _callbacks(cfg: FinetuneConfig) -> List[Any]:
    by_epoch = cfg.save_strategy == "epoch"
    if cfg.save_strategy == "no" or not (cfg.save_steps or by_epoch):
        return []
    try:
        from shardwise.callbacks import ModelCheckpoint
    except ImportError as exc:  # the checkpoint layer ships separately
        raise RuntimeError(
            "save_steps needs shardwise.callbacks.ModelCheckpoint, which this installation "
            "lacks; drop save_steps or update shardwise."
        ) from exc
    return [
        ModelCheckpoint(
            dirpath=os.path.join(cfg.output_dir, "checkpoints"),
            every_n_train_steps=None if by_epoch else cfg.save_steps,
            every_n_epochs=1 if by_epoch else None,
            save_top_k=cfg.save_total_limit,
        )
    ]


def _steps_per_epoch(n_examples: int, world: int, cfg: FinetuneConfig) -> int:
    per_rank = math.ceil(n_examples / world)  # DistributedSampler pads to equal shares
    batches = math.ceil(per_rank / cfg.data.per_device_train_batch_size)
    return max(1, math.ceil(batches / cfg.gradient_accumulation_steps))


def _run(cfg: FinetuneConfig, after_fit: Optional[Callable[[Any], Any]] = None) -> FinetuneResult:
    """One worker's whole run (every rank executes it)."""
    from transformers import AutoTokenizer

    checked = validate_config(cfg)
    folder = checked["folder"]
    seed_everything(cfg.seed)
    callbacks = _callbacks(cfg)
    upload = HubUpload(checked["hub_repo"], cfg.hub_private_repo, cfg.hub_token) if cfg.push_to_hub else None
    if upload is not None and cfg.hub_strategy == "every_save" and callbacks:  # before the ModelCheckpoint
        every = cfg.save_steps if cfg.save_strategy == "steps" else 0
        callbacks.insert(0, PushCheckpoints(upload, callbacks[-1], every))
    trainer = Trainer(
        accelerator=cfg.accelerator,
        devices=cfg.devices,
        num_nodes=cfg.num_nodes,
        strategy=checked["strategy"],  # the run's one plan, built and checked by validate_config
        precision=cfg.precision,
        max_steps=cfg.max_steps,
        max_epochs=None if cfg.max_steps > 0 else cfg.num_train_epochs,
        accumulate_grad_batches=cfg.gradient_accumulation_steps,
        gradient_clip_val=cfg.max_grad_norm,
        log_every_n_steps=cfg.logging_steps,
        val_check_interval=(
            cfg.eval_steps * cfg.gradient_accumulation_steps
            if cfg.eval_steps and cfg.eval_strategy == "steps"
            else None
        ),
        callbacks=callbacks,
        enable_checkpointing=bool(callbacks),
        enable_progress_bar=cfg.enable_progress_bar,
        default_root_dir=cfg.output_dir,
        peak_tflops=cfg.peak_tflops,
        profile_steps=cfg.profile_steps,
        compile=cfg.torch_compile,
    )
    # The Trainer joins the process group (strategy.setup_environment), runs the data module's prepare_data
    # (the tokenisation: rank 0 writes the cache) behind a barrier, then its setup on every rank.
    tokenizer = AutoTokenizer.from_pretrained(checked["tokenizer_dir"])
    data = FinetuneData(
        checked["data"],
        # The resolved commit of a hub data set joins the cache key: a new revision re-tokenises, the same never.
        dataclasses.replace(
            checked["data"].spec(checked["text_field"], cfg.seed, _evaluates(cfg)), revision=checked["dataset_revision"]
        ),
        tokenizer,
        cache_dir=cfg.data.cache_dir or default_cache_dir(),
        evaluate=_evaluates(cfg),
        pin_memory=trainer.accelerator == "cuda",
    )

    def total_steps() -> int:  # the schedule's length: known once the data and the process group are set up
        if cfg.max_steps > 0:
            return cfg.max_steps
        # Samples are split over the data-parallel ranks only (the strategy's mesh says how many there are):
        # the ranks of a tp or sp group read the same ones.
        shares = trainer.strategy.data_parallel_size
        return cfg.num_train_epochs * _steps_per_epoch(len(data.prepared.train), shares, cfg)

    module = build_module(cfg, folder, total_steps)
    trainer.fit(module, datamodule=data, ckpt_path=cfg.resume_from_checkpoint)
    # The consolidated Hugging Face folder, gathered one tensor at a time; for LoRA the PEFT adapter
    # folder instead, plus with merge the merged model in output_dir/merged (recipes/lora_export.py).
    export_dtype = cast_dtype(cfg.export_dtype)
    export = functools.partial(export_lora, merge=cfg.merge) if cfg.lora_r else export_hf_folder
    export(
        module.model,
        cfg.output_dir,
        config=folder.config,
        tokenizer=tokenizer,
        source_dir=folder.path,
        max_shard_size=parse_bytes(cfg.max_shard_size),
        dtype=export_dtype,
    )
    if upload is not None and trainer.is_global_zero:
        push_export(upload, cfg.output_dir, adapter=bool(cfg.lora_r))  # verified first, then in the background
    else:
        upload = None
    result = FinetuneResult(
        output_dir=os.path.abspath(cfg.output_dir),
        losses=module.history,
        eval_losses=module.eval_history,
        load=dataclasses.asdict(module.load_report) if module.load_report else {},
        data=data.prepared.summary,
        parameters=dict(module.parameter_counts),
        extra=after_fit(module) if after_fit is not None else None,
    )
    if trainer.is_global_zero:
        with open(os.path.join(cfg.output_dir, "finetune_history.json"), "w") as fh:
            json.dump({k: v for k, v in dataclasses.asdict(result).items() if k != "extra"}, fh, indent=2)
    trainer.strategy.teardown()
    if upload is not None:
        upload.wait()  # the process ends when the upload does (training finished while it ran)
    return result


def finetune(
    config: Union[FinetuneConfig, Dict[str, Any], str], after_fit: Optional[Callable[[Any], Any]] = None
) -> FinetuneResult:
    """Fine-tune and export; returns global rank 0's result (losses per step, eval losses, load report).

    `config`: a FinetuneConfig, a dict of its fields, or a YAML file path.
    Called in a plain process with devices > 1 it starts the workers itself
    (one node); under `shardwise launch`, torchrun or srun it is one rank.
    `after_fit(module)` runs on every rank after the export, with the trained
    TrainModule (its `.model` is the sharded HF model); its return value is
    `result.extra`. It must be a module-level function for multi-process runs.
    """

    cfg = coerce_config(config)
    checked = validate_config(cfg)  # before any worker starts; hub ids are downloaded here
    # The workers get the snapshot folders the hub ids resolved to: they read the same files and never ask the hub.
    if any(is_hub_id(name) for name in (cfg.model_path, cfg.tokenizer_path, cfg.data.dataset)):
        local = {"model_path": checked["folder"].path, "data": checked["data"], "dataset_config": None}
        cfg = dataclasses.replace(cfg, tokenizer_path=cfg.tokenizer_path and checked["tokenizer_dir"], **local)
    if detect_env() is None:
        devices = resolve_devices(cfg.devices, resolve_accelerator(cfg.accelerator))
        if cfg.num_nodes > 1:
            raise RuntimeError(
                f"num_nodes={cfg.num_nodes}: start one launcher per node, e.g. `shardwise launch "
                f"--nnodes {cfg.num_nodes} --node-rank <i> --nproc-per-node {devices} "
                "--master-addr <node 0> shardwise finetune --config ...` (examples/slurm/)."
            )
        if devices > 1:
            return launch(_run, cfg, after_fit, devices=devices)[0]
    return _run(cfg, after_fit)


def coerce_config(config: Union[FinetuneConfig, Dict[str, Any], str]) -> FinetuneConfig:
    """`finetune()`'s config: a FinetuneConfig as it is, or one from a dict of options or a YAML file, whose
    data options are flat (`max_seq_len: 64`, as the flags name them) or under `data`."""
    if isinstance(config, FinetuneConfig):
        return config
    if isinstance(config, (str, os.PathLike)):
        import yaml

        with open(config) as fh:
            config = yaml.safe_load(fh) or {}
    names = {f.name for f in dataclasses.fields(FinetuneConfig)} | set(DATA_OPTIONS)  # flat data options too
    unknown = sorted(set(config) - names)
    if unknown:
        raise ValueError(f"unknown finetune option(s) {unknown}; valid: {sorted(names)}")
    options = {k: v for k, v in config.items() if k not in DATA_OPTIONS}
    data = options.get("data") or {}
    data = dataclasses.asdict(data) if isinstance(data, DataOptions) else dict(data)
    # The same names flat, as flags and YAML keys have them: a flat one overrides the same one in `data`.
    options["data"] = {**data, **{k: v for k, v in config.items() if k in DATA_OPTIONS}}
    return FinetuneConfig(**options)

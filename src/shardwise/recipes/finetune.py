"""`shardwise finetune`: full fine-tuning of a local Hugging Face causal LM, one process to many nodes.

The recipe of the Llama-2-70B FSDP write-up, as one config: a
`FinetuneConfig` dataclass is both the Python API (`finetune(config)`) and
the CLI schema (`shardwise finetune --config run.yaml --learning_rate 1e-5`,
parsed by jsonargparse from the dataclass). Everything that can be checked
without a GPU or a second process -- the model folder, the dataset field,
the sequence length against the model's positions, flash attention / paged
AdamW without CUDA -- is checked first, in the process the user started,
before any worker or weight exists. The run itself is an ordinary
TrainModule under the Trainer: the model is built on the meta device,
sharded by the FSDP strategy with the model's own `_no_split_modules` as
the wrap (and activation-checkpointing) units, and its `init_weights` hook
streams the pretrained weights from rank 0 into the shards
(hf_model.py). The DeepSpeed strategies work the same way: ZeRO-1/2
materialise like DDP; at ZeRO-3 the model is built under zero.Init and the
loader writes each rank's partitions directly (the module declares
`init_weights_partitioned`, so the strategy does not gather the whole model
for the hook). `strategy_options` are further arguments of the strategy's
class, checked against its signature up front. Intermediate checkpoints are
the strategy's own (`save_steps`); the final model is exported as a
consolidated Hugging Face folder in `output_dir`, one tensor at a time.
"""

from __future__ import annotations

import dataclasses
import functools
import inspect
import json
import math
import os
import time
from dataclasses import dataclass, field
from typing import Any, Callable, Dict, List, Optional, Union

import torch
from torch.utils.data import DataLoader

from shardwise.distributed import ops
from shardwise.distributed.env import detect_env, resolve_accelerator, resolve_devices
from shardwise.distributed.launch import launch
from shardwise.dtypes import DTYPES, cast_dtype
from shardwise.memory import parse_bytes
from shardwise.module import TrainModule
from shardwise.precision import build_precision
from shardwise.recipes import hf_model
from shardwise.recipes.data import (
    CHAT_FORMATS,
    PACKING_MODES,
    DataSpec,
    dataset_columns,
    prepare_data,
    resolve_text_field,
)
from shardwise.recipes.hf_model import export_hf_folder, inspect_model_folder, model_block_names
from shardwise.seed import seed_everything
from shardwise.strategies import DDPStrategy, FSDPStrategy, SingleDeviceStrategy
from shardwise.strategies.base import Strategy
from shardwise.strategies.names import STRATEGIES, resolve
from shardwise.trainer import Trainer

LR_SCHEDULERS = ("cosine", "linear", "constant")
ATTN_IMPLEMENTATIONS = ("sdpa", "eager", "flash_attention_2")
OPTIMIZERS = ("adamw", "adamw_torch", "adamw_torch_fused", "paged_adamw_32bit")


@dataclass
class FinetuneConfig:
    """Options of `shardwise finetune` (named as in the Hugging Face Llama FSDP recipe where it has one).

    Args:
        model_path: local Hugging Face folder: config.json, *.safetensors, tokenizer files
        dataset: .jsonl / .json / .parquet file, or a folder written by datasets' save_to_disk
        tokenizer_path: tokenizer folder (default: model_path)
        dataset_text_field: record field with text or chat messages
            (default: first of messages, conversations, text, content)
        chat_template_format: auto (the tokenizer's template, else tags) | tags
            (<|system|>/<|prompter|>/<|assistant|>) | tokenizer | none (text used as is)
        max_seq_len: tokens per example / packed block
        packing: concatenate documents into max_seq_len blocks
        packing_mode: attention (no attention across documents) | loss (only boundary labels masked)
        add_special_tokens: let the tokenizer add its BOS/EOS
        append_concat_token: end every document with EOS
        eval_split_ratio: held-out fraction when the dataset has no test / validation split
        cache_dir: tokenised-data cache (default <output_dir>/tokenized)
        max_steps: optimizer steps (-1: num_train_epochs)
        num_train_epochs: epochs when max_steps is -1
        logging_steps: print / log the loss every n optimizer steps
        eval_steps: evaluate every n optimizer steps
        save_steps: sharded, resumable checkpoint every n optimizer steps
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
        per_device_train_batch_size: examples per process per micro-batch
        per_device_eval_batch_size: examples per process per eval batch
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
        dataloader_num_workers: DataLoader worker processes
        enable_progress_bar: show the progress bar
        timeout_s: collective timeout in seconds
    """

    # What to train on
    model_path: str = ""
    dataset: str = ""
    tokenizer_path: Optional[str] = None
    dataset_text_field: Optional[str] = None
    chat_template_format: str = "auto"
    max_seq_len: int = 2048
    packing: bool = True
    packing_mode: str = "attention"
    add_special_tokens: bool = False
    append_concat_token: bool = True
    eval_split_ratio: float = 0.05
    cache_dir: Optional[str] = None
    # How long, how often
    max_steps: int = -1
    num_train_epochs: int = 1
    logging_steps: int = 10
    eval_steps: Optional[int] = None
    save_steps: Optional[int] = None
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
    per_device_train_batch_size: int = 1
    per_device_eval_batch_size: int = 1
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
    dataloader_num_workers: int = 0
    enable_progress_bar: bool = False
    timeout_s: float = 1800.0


@dataclass
class FinetuneResult:
    output_dir: str
    losses: List[Dict[str, float]] = field(default_factory=list)  # per optimizer step, global mean
    eval_losses: List[Dict[str, float]] = field(default_factory=list)
    load: Dict[str, Any] = field(default_factory=dict)  # rank-0 loading report of this rank
    data: Dict[str, Any] = field(default_factory=dict)
    extra: Any = None  # what finetune(after_fit=...) returned on this rank


# ------------------------------------------------------------------ checks
def _has_cuda(cfg: FinetuneConfig) -> bool:
    return cfg.accelerator in ("auto", "cuda") and torch.cuda.is_available()


def validate_config(cfg: FinetuneConfig) -> Dict[str, Any]:
    """Every check that needs no worker; raises ValueError (or a subclass) with the fix."""

    if not cfg.model_path:
        raise ValueError("model_path is required: a local Hugging Face model folder.")
    if not cfg.dataset:
        raise ValueError("dataset is required: a .jsonl / .parquet file or a datasets save_to_disk folder.")
    folder = inspect_model_folder(cfg.model_path)
    tok_dir = cfg.tokenizer_path or cfg.model_path
    if cfg.tokenizer_path is None and not folder.has_tokenizer:
        raise ValueError(
            f"{cfg.model_path!r} has no tokenizer files (tokenizer.json / tokenizer.model); "
            "save the tokenizer there or set tokenizer_path."
        )
    if cfg.max_seq_len < 2:
        raise ValueError(f"max_seq_len={cfg.max_seq_len}: use at least 2.")
    if folder.max_positions is not None and cfg.max_seq_len > folder.max_positions:
        raise ValueError(
            f"max_seq_len={cfg.max_seq_len} exceeds the model's maximum of {folder.max_positions} "
            f"positions (max_position_embeddings in {cfg.model_path}/config.json). Lower max_seq_len."
        )
    columns = dataset_columns(cfg.dataset)
    text_field = resolve_text_field(columns, cfg.dataset_text_field, cfg.dataset)
    if cfg.chat_template_format not in CHAT_FORMATS:
        raise ValueError(f"chat_template_format={cfg.chat_template_format!r}: use one of {CHAT_FORMATS}.")
    if cfg.packing_mode not in PACKING_MODES:
        raise ValueError(f"packing_mode={cfg.packing_mode!r}: use one of {PACKING_MODES}.")
    if cfg.lr_scheduler_type not in LR_SCHEDULERS:
        raise ValueError(f"lr_scheduler_type={cfg.lr_scheduler_type!r}: use one of {LR_SCHEDULERS}.")
    if not 0.0 <= cfg.warmup_ratio < 1.0:
        raise ValueError(f"warmup_ratio={cfg.warmup_ratio}: use a fraction in [0, 1).")
    if cfg.max_steps == 0 or cfg.max_steps < -1:
        raise ValueError(f"max_steps={cfg.max_steps}: use a positive number, or -1 for num_train_epochs.")
    for name in (
        "per_device_train_batch_size",
        "per_device_eval_batch_size",
        "gradient_accumulation_steps",
        "logging_steps",
    ):
        if getattr(cfg, name) < 1:
            raise ValueError(f"{name}={getattr(cfg, name)}: use 1 or more.")
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
    _build_strategy(cfg, folder)  # unknown names, unknown or conflicting strategy_options: fail here
    return {"folder": folder, "tokenizer_dir": tok_dir, "text_field": text_field}


# --------------------------------------------------------------- schedule
def lr_lambda(total_steps: int, warmup_steps: int, kind: str):
    """Multiplier of the peak learning rate at optimizer step `s` (linear warm-up, then `kind`)."""

    def fn(step: int) -> float:
        if step < warmup_steps:
            return step / max(1, warmup_steps)
        if kind == "constant":
            return 1.0
        progress = min(1.0, (step - warmup_steps) / max(1, total_steps - warmup_steps))
        if kind == "linear":
            return 1.0 - progress
        return 0.5 * (1.0 + math.cos(math.pi * progress))

    return fn


# --------------------------------------------------------------- the module
def build_module(cfg: FinetuneConfig, folder: Any, total_steps: int) -> Any:
    """The recipe's TrainModule (the class is defined on first use, so the CLI imports no torch)."""
    return _module_class()(cfg, folder, total_steps)


@functools.lru_cache(maxsize=None)
def _module_class():
    class CausalLMModule(TrainModule):
        """A pretrained causal LM: built on meta, weights streamed from rank 0, HF loss."""

        # Under ZeRO-3 the loader writes the partitions itself (hf_model._place);
        # the strategy must not gather the whole model for it.
        init_weights_partitioned = True

        def __init__(self, cfg: FinetuneConfig, folder: Any, total_steps: int) -> None:
            super().__init__()
            self.cfg, self.folder, self.total_steps = cfg, folder, total_steps
            self.model = None
            self.history: List[Dict[str, float]] = []
            self.eval_history: List[Dict[str, float]] = []
            self.load_report: Any = None
            self._window: List[torch.Tensor] = []
            # (step, lr, this rank's window mean on the device) until the next log line:
            # reading a loss back to the host every step would stall the device queue.
            self._unsynced: List[Any] = []
            self._eval_sum = torch.zeros(2)
            self._lr = cfg.learning_rate
            self._t0 = time.time()

        def configure_model(self) -> None:
            if self.model is None:
                self.model = hf_model.build_meta_model(self.folder, self.cfg.attn_implementation)

        def init_weights(self) -> None:
            # Called by the strategy after the shards are allocated (materialize.py):
            # rank 0 reads, every rank receives its slices; then the computed buffers.
            self.load_report = hf_model.load_rank0_and_distribute(
                self.model, self.folder.path, self.folder.weight_files
            )
            hf_model.recompute_buffers(self.model)

        def _loss(self, batch: Dict[str, torch.Tensor]) -> torch.Tensor:
            # No KV cache in training; without one, position ids that restart
            # per document become a block-diagonal mask (data.py).
            return self.model(**batch, use_cache=False).loss

        def on_train_start(self) -> None:
            self._t0 = time.time()

        def training_step(self, batch: Dict[str, torch.Tensor], batch_idx: int) -> torch.Tensor:
            loss = self._loss(batch)
            self.log("train_loss", loss, prog_bar=True)
            return loss

        def validation_step(self, batch: Dict[str, torch.Tensor], batch_idx: int) -> None:
            loss = self._loss(batch)
            self._eval_sum = self._eval_sum.to(loss.device)
            self._eval_sum += torch.stack([loss.detach().float(), torch.ones((), device=loss.device)])
            self.log("val_loss", loss, sync_dist=True)

        def on_validation_epoch_start(self) -> None:
            self._eval_sum = torch.zeros(2)

        def on_validation_epoch_end(self) -> None:
            total = ops.reduce(self._eval_sum.clone(), "sum")
            if total[1] > 0:
                entry = {"step": self.trainer.global_step, "eval_loss": float(total[0] / total[1])}
                self.eval_history.append(entry)
                if self.trainer.is_global_zero:
                    print(f"[finetune] step {entry['step']}: eval_loss {entry['eval_loss']:.4f}", flush=True)

        def on_train_batch_start(self, batch: Any, batch_idx: int) -> None:
            if not self._window:
                self._lr = self.trainer.optimizers[0].param_groups[0]["lr"]

        def on_train_batch_end(self, outputs: Any, batch: Any, batch_idx: int) -> None:
            loss = outputs["loss"] if isinstance(outputs, dict) else outputs
            self._window.append(loss.detach().float())
            if not self.trainer.is_last_microbatch:
                return
            step = self.trainer.global_step
            self._unsynced.append((step, self._lr, torch.stack(self._window).mean()))
            self._window = []
            if step % self.cfg.logging_steps == 0 or step == 1:
                self._sync_history()
                entry = self.history[-1]
                if self.trainer.is_global_zero:
                    rate = step / max(1e-9, time.time() - self._t0)
                    print(
                        f"[finetune] step {step}: loss {entry['loss']:.4f} lr {entry['lr']:.3g} ({rate:.2f} steps/s)",
                        flush=True,
                    )

        def on_train_end(self) -> None:
            self._sync_history()

        def _sync_history(self) -> None:
            """Move the losses since the last log line into history: one all-reduce, one host read.

            Each is the mean over the accumulation window and over all ranks: the loss of the
            whole global batch, comparable across world sizes and layouts. Every rank calls this
            at the same steps (log steps and the end of training), so the collectives match.
            """
            if not self._unsynced:
                return
            means = ops.reduce(torch.stack([m for _, _, m in self._unsynced]), "mean").tolist()
            self.history.extend(
                {"step": step, "loss": loss, "lr": lr} for (step, lr, _), loss in zip(self._unsynced, means)
            )
            self._unsynced = []

        def configure_optimizers(self) -> Any:
            cfg = self.cfg
            decay, no_decay = [], []
            for p in self.parameters():
                if p.requires_grad:
                    # Biases and norm weights (1-D) are not decayed, as in the Hugging Face Trainer.
                    # A ZeRO-3 partition is flat: judge by the parameter's full shape.
                    (decay if len(hf_model.full_shape(p)) >= 2 else no_decay).append(p)
            # No empty group: DeepSpeed drops those, and the LR scheduler would then
            # have more learning rates than the engine's optimizer has groups.
            groups = [
                g
                for g in (
                    {"params": decay, "weight_decay": cfg.weight_decay},
                    {"params": no_decay, "weight_decay": 0.0},
                )
                if g["params"]
            ]
            kwargs = dict(lr=cfg.learning_rate, betas=(cfg.adam_beta1, cfg.adam_beta2), eps=cfg.adam_epsilon)
            on_cuda = self.device.type == "cuda"
            if cfg.optim == "paged_adamw_32bit":
                import bitsandbytes as bnb

                optimizer = bnb.optim.PagedAdamW32bit(groups, **kwargs)
            else:
                fused = on_cuda and cfg.optim in ("adamw", "adamw_torch_fused")
                optimizer = torch.optim.AdamW(groups, fused=fused or None, **kwargs)
            warmup = math.ceil(self.total_steps * cfg.warmup_ratio)
            schedule = torch.optim.lr_scheduler.LambdaLR(
                optimizer, lr_lambda(self.total_steps, warmup, cfg.lr_scheduler_type)
            )
            return {"optimizer": optimizer, "lr_scheduler": {"scheduler": schedule, "interval": "step"}}

    return CausalLMModule


# ------------------------------------------------------------------ running
def recipe_strategies() -> tuple:
    """Every `strategy` name the recipe takes: "auto" and the strategy table's names (strategies/names.py)."""
    return ("auto", *STRATEGIES)


def _strategy_options(cfg: FinetuneConfig, cls: Any, owned: Dict[str, str], fixed: Dict[str, Any]) -> Dict[str, Any]:
    """Check `cfg.strategy_options` against `cls`'s constructor; return them as keyword arguments.

    `owned`: constructor arguments the recipe sets from its own fields (key ->
    field), which are refused here so that one value has one place. `fixed`:
    what the strategy name already implies (deepspeed_stage_3 -> stage=3);
    an option may repeat it but not contradict it.
    """

    if not isinstance(cfg.strategy_options or {}, dict):
        raise ValueError(
            f"strategy_options must be a mapping of {cls.__name__} arguments, "
            f"got {type(cfg.strategy_options).__name__}."
        )
    options = dict(cfg.strategy_options or {})
    valid = [
        n
        for n, p in inspect.signature(cls.__init__).parameters.items()
        if n != "self" and p.kind not in (p.VAR_KEYWORD, p.VAR_POSITIONAL)
    ]
    for key, value in options.items():
        if key in owned:
            raise ValueError(
                f"strategy_options[{key!r}]: the recipe sets {cls.__name__}'s {key} from its own "
                f"option {owned[key]!r}; set {owned[key]}: {value!r} instead of putting it in "
                "strategy_options."
            )
        if key not in valid:
            allowed = [n for n in valid if n not in owned]
            raise ValueError(
                f"strategy_options[{key!r}] is not an argument of {cls.__name__} "
                f"(strategy={cfg.strategy!r}). Valid: {', '.join(allowed)}."
            )
        if key in fixed and fixed[key] != value:
            raise ValueError(
                f"strategy_options[{key!r}]={value!r} contradicts strategy={cfg.strategy!r}, which "
                f"means {key}={fixed[key]!r}. Use strategy='deepspeed' with the options, or drop it."
            )
    return options


def _build_strategy(cfg: FinetuneConfig, folder: Any) -> Any:
    """The strategy object for `cfg` (also run by validate_config, so every mistake surfaces up front)."""

    if cfg.strategy.lower().strip() == "auto":
        name, kind, implied = "auto", "auto", {}
    else:
        try:
            named = resolve(cfg.strategy)
        except ValueError:
            raise ValueError(
                f"strategy={cfg.strategy!r} is not a fine-tuning strategy. Valid: {', '.join(recipe_strategies())}."
            ) from None
        name, kind, implied = named.name, named.kind, named.options
    blocks = model_block_names(folder.config)
    owned = {"precision": "precision", "timeout_s": "timeout_s"}
    checkpointing = {}
    if cfg.gradient_checkpointing:
        owned["activation_checkpointing_policy"] = "gradient_checkpointing"
        checkpointing["activation_checkpointing_policy"] = list(cfg.auto_wrap_policy or blocks)
        if not checkpointing["activation_checkpointing_policy"]:
            raise ValueError(
                f"{type(folder.config).__name__} declares no _no_split_modules, so there is no "
                "decoder layer to checkpoint; set auto_wrap_policy to the block class name(s)."
            )
    if kind == "fsdp":
        # A name like fsdp_hybrid_shard fixes what the recipe's own field would otherwise say.
        sharding = implied.get("sharding_strategy", cfg.sharding_strategy)
        offload = implied.get("cpu_offload", cfg.cpu_offload)
        for field_name, value in (("sharding_strategy", sharding), ("cpu_offload", offload)):
            if getattr(cfg, field_name) not in (value, FinetuneConfig.__dataclass_fields__[field_name].default):
                raise ValueError(
                    f"{field_name}={getattr(cfg, field_name)!r} contradicts strategy={cfg.strategy!r}, "
                    f"which means {field_name}={value!r}. Use strategy='fsdp' with {field_name}, "
                    "or drop it."
                )
        wrap = cfg.auto_wrap_policy or blocks
        if not wrap:
            raise ValueError(
                f"{type(folder.config).__name__} declares no _no_split_modules, so there is no "
                "transformer block to shard by; set auto_wrap_policy to the block class name(s)."
            )
        owned.update({k: k for k in ("auto_wrap_policy", "sharding_strategy", "cpu_offload", "state_dict_type")})
        options = _strategy_options(cfg, FSDPStrategy, owned, {})
        return FSDPStrategy(
            auto_wrap_policy=list(wrap),
            sharding_strategy=sharding,
            cpu_offload=offload,
            state_dict_type=cfg.state_dict_type,
            timeout_s=cfg.timeout_s,
            **checkpointing,
            **options,
        )
    if kind == "deepspeed":
        from shardwise.strategies.deepspeed import DeepSpeedStrategy

        fsdp_only = [
            f
            for f, default in (("sharding_strategy", "FULL_SHARD"), ("state_dict_type", "sharded"))
            if getattr(cfg, f) != default
        ]
        if fsdp_only:
            raise ValueError(
                f"{', '.join(fsdp_only)} configure FSDP; strategy={cfg.strategy!r} does not use "
                "them. Remove them (DeepSpeed's ZeRO stage comes from the strategy name)."
            )
        owned["cpu_offload"] = "cpu_offload"
        # 'deepspeed' alone leaves the stage to strategy_options / the DeepSpeed config (default 2).
        fixed = {} if name == "deepspeed" else implied
        options = _strategy_options(cfg, DeepSpeedStrategy, owned, fixed)
        return DeepSpeedStrategy(
            **{**fixed, **options},
            cpu_offload=True if cfg.cpu_offload else None,
            timeout_s=cfg.timeout_s,
            **checkpointing,
        )
    if cfg.gradient_checkpointing:
        raise ValueError(
            "gradient_checkpointing is applied by the FSDP or DeepSpeed strategy here; "
            "use strategy='fsdp' or a deepspeed one."
        )
    if kind == "ddp":
        return DDPStrategy(timeout_s=cfg.timeout_s, **_strategy_options(cfg, DDPStrategy, owned, {}))
    if cfg.strategy_options:
        raise ValueError(
            f"strategy_options={cfg.strategy_options!r}: strategy={cfg.strategy!r} takes no options; "
            "choose fsdp, ddp or a deepspeed strategy to pass them."
        )
    return "auto" if name == "auto" else SingleDeviceStrategy()


def _callbacks(cfg: FinetuneConfig) -> List[Any]:
    if not cfg.save_steps:
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
            every_n_train_steps=cfg.save_steps,
            save_top_k=cfg.save_total_limit,
        )
    ]


def _steps_per_epoch(n_examples: int, world: int, cfg: FinetuneConfig) -> int:
    per_rank = math.ceil(n_examples / world)  # DistributedSampler pads to equal shares
    batches = math.ceil(per_rank / cfg.per_device_train_batch_size)
    return max(1, math.ceil(batches / cfg.gradient_accumulation_steps))


def _run(cfg: FinetuneConfig, after_fit: Optional[Callable[[Any], Any]] = None) -> FinetuneResult:
    """One worker's whole run (every rank executes it)."""
    from transformers import AutoTokenizer

    checked = validate_config(cfg)
    folder = checked["folder"]
    seed_everything(cfg.seed)
    callbacks = _callbacks(cfg)
    trainer = Trainer(
        accelerator=cfg.accelerator,
        devices=cfg.devices,
        num_nodes=cfg.num_nodes,
        strategy=_build_strategy(cfg, folder),
        precision=cfg.precision,
        max_steps=cfg.max_steps,
        max_epochs=None if cfg.max_steps > 0 else cfg.num_train_epochs,
        accumulate_grad_batches=cfg.gradient_accumulation_steps,
        gradient_clip_val=cfg.max_grad_norm,
        log_every_n_steps=cfg.logging_steps,
        val_check_interval=(cfg.eval_steps * cfg.gradient_accumulation_steps if cfg.eval_steps else None),
        callbacks=callbacks,
        enable_checkpointing=bool(callbacks),
        enable_progress_bar=cfg.enable_progress_bar,
        default_root_dir=cfg.output_dir,
    )
    # Join the process group now (the base contract's part only; the strategy
    # builds its mesh later in fit) so the tokenised-data cache can be built by
    # rank 0 while the other ranks wait at a barrier.
    Strategy.setup_environment(trainer.strategy)
    tokenizer = AutoTokenizer.from_pretrained(checked["tokenizer_dir"])
    spec = DataSpec(
        path=os.path.abspath(cfg.dataset),
        text_field=checked["text_field"],
        chat_template_format=cfg.chat_template_format,
        max_seq_len=cfg.max_seq_len,
        packing=cfg.packing,
        packing_mode=cfg.packing_mode,
        add_special_tokens=cfg.add_special_tokens,
        append_eos=cfg.append_concat_token,
        eval_split_ratio=cfg.eval_split_ratio,
        seed=cfg.seed,
    )
    data = prepare_data(spec, tokenizer, cfg.cache_dir or os.path.join(cfg.output_dir, "tokenized"))
    train_loader = DataLoader(
        data.train,
        batch_size=cfg.per_device_train_batch_size,
        shuffle=True,
        collate_fn=data.collate,
        num_workers=cfg.dataloader_num_workers,
    )
    eval_loader = (
        DataLoader(
            data.eval,
            batch_size=cfg.per_device_eval_batch_size,
            shuffle=False,
            collate_fn=data.collate,
            num_workers=cfg.dataloader_num_workers,
        )
        if data.eval is not None and cfg.eval_steps
        else None
    )
    world = trainer.devices * trainer.num_nodes
    total = cfg.max_steps if cfg.max_steps > 0 else cfg.num_train_epochs * _steps_per_epoch(len(data.train), world, cfg)
    module = build_module(cfg, folder, total)
    ckpt = cfg.resume_from_checkpoint
    trainer.fit(module, train_loader, eval_loader, ckpt_path=ckpt)
    # The consolidated Hugging Face folder, gathered one tensor at a time.
    export_dtype = cast_dtype(cfg.export_dtype)
    export_hf_folder(
        module.model,
        cfg.output_dir,
        config=folder.config,
        tokenizer=tokenizer,
        source_dir=cfg.model_path,
        max_shard_size=parse_bytes(cfg.max_shard_size),
        dtype=export_dtype,
    )
    result = FinetuneResult(
        output_dir=os.path.abspath(cfg.output_dir),
        losses=module.history,
        eval_losses=module.eval_history,
        load=dataclasses.asdict(module.load_report) if module.load_report else {},
        data=data.summary,
        extra=after_fit(module) if after_fit is not None else None,
    )
    if trainer.is_global_zero:
        with open(os.path.join(cfg.output_dir, "finetune_history.json"), "w") as fh:
            json.dump({k: v for k, v in dataclasses.asdict(result).items() if k != "extra"}, fh, indent=2)
    trainer.strategy.teardown()
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
    validate_config(cfg)  # before any worker starts
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
    if isinstance(config, FinetuneConfig):
        return config
    if isinstance(config, (str, os.PathLike)):
        import yaml

        with open(config) as fh:
            config = yaml.safe_load(fh) or {}
    names = {f.name for f in dataclasses.fields(FinetuneConfig)}
    unknown = sorted(set(config) - names)
    if unknown:
        raise ValueError(f"unknown finetune option(s) {unknown}; valid: {sorted(names)}")
    return FinetuneConfig(**config)

"""`shardwise pretrain`: a Hugging Face causal LM trained from scratch on prepared corpora, as one command.

A `PretrainConfig` dataclass is the Python API (`pretrain(config)`) and the
CLI schema (jsonargparse reads it, as for `shardwise finetune`). The model is
an architecture only: a Hugging Face preset of the planner (plan/presets.py),
a config.json (a file or its folder) or a hub id (its config.json alone is
downloaded). It is built on the meta device by the fine-tuning recipe's own
module (causal_lm.CausalLMModule, here without its weight loader), and the
strategy replays the construction's own initialisation on every rank
(strategies/init_replay.py), each rank keeping its slice: the same weights at
any world size and under any strategy, bitwise those of building the model
eagerly with the same seed. The data are corpora `shardwise prepare` wrote,
mixed by weight and packed by `corpus.PackedMixture`, whose one global
position makes a checkpoint resume exactly, on any number of ranks; a slice
at the end of each corpus (its weight's share of `eval_samples`) is held out
for evaluation. Everything that can be checked in the process the user
started -- the corpora, their tokenizer against the model's vocabulary, the
sequence length against its positions, the batch split, the parallel
degrees -- is checked there, before any worker starts. The run logs the loss,
tokens/s and MFU, and each step's batch fingerprint; the end is a Hugging
Face folder in `output_dir` that `from_pretrained` loads.
"""

from __future__ import annotations

import dataclasses
import json
import os
import time
from dataclasses import dataclass, field
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple, Union

import torch
from torch.utils.data import DataLoader, default_collate

from shardwise.callbacks.fingerprint import BatchFingerprint
from shardwise.corpus.mixture import PackedMixture
from shardwise.corpus.shards import TokenCorpus
from shardwise.distributed.env import detect_env, is_global_zero, resolve_accelerator, resolve_devices
from shardwise.distributed.launch import launch
from shardwise.dtypes import DTYPES, cast_dtype
from shardwise.flops import check_peak
from shardwise.memory import parse_bytes
from shardwise.precision import build_precision
from shardwise.recipes.causal_lm import CausalLMModule
from shardwise.recipes.data import DataOptions
from shardwise.recipes.finetune import FinetuneConfig
from shardwise.recipes.hf_model import ModelFolder, export_hf_folder
from shardwise.recipes.hub import is_hub_id, resolve_model, resolve_tokenizer
from shardwise.recipes.parallel import build_recipe_strategy, recipe_world_size
from shardwise.recipes.pretrain_data import HeldOut, parse_data, split_corpora
from shardwise.seed import seed_everything
from shardwise.strategies import names
from shardwise.trainer import Trainer

HISTORY_FILE = "pretrain_history.json"
POSITION_FIELDS = ("max_position_embeddings", "n_positions", "max_sequence_length", "seq_length")


@dataclass
class PretrainConfig:
    """Options of `shardwise pretrain`.

    Args:
        model: the architecture: a Hugging Face preset (llama-3.1-8b, llama-3.1-70b), a config.json (the file or
            its folder), or a hub model id (only its config.json is downloaded). No weights are read.
        config_overrides: config fields to change, e.g. {num_hidden_layers: 16, vocab_size: 32000}
        data: prepared corpora (`shardwise prepare`) with mixture weights: "web:0.7,code:0.3", a list of
            "path:weight" strings or {path, weight} mappings, or a mapping {path: weight}; a path without a
            weight weighs 1
        tokenizer: the tokenizer saved with the model (default: the one the corpora were prepared with)
        seq_length: tokens per packed sample
        global_batch_size: samples per optimizer step, over all data-parallel ranks
        micro_batch_size: samples per rank and forward pass (the rest of the global batch is accumulated)
        max_steps: optimizer steps
        eval_every: evaluate on the held-out samples every n optimizer steps (null: never)
        eval_samples: samples held out of the corpora for evaluation, each corpus its weight's share
        logging_steps: print the loss every n optimizer steps
        save_steps: sharded, resumable checkpoint every n optimizer steps (null: none)
        save_total_limit: step checkpoints kept (besides last)
        resume_from_checkpoint: a checkpoint path, or last
        precision: bf16-true | bf16-mixed | 32-true ... (default: bf16-true on a GPU, 32-true on CPU)
        learning_rate: peak learning rate
        warmup_steps: linear warm-up steps before the cosine decay
        weight_decay: AdamW weight decay (not applied to biases and norms)
        adam_beta1: AdamW beta1
        adam_beta2: AdamW beta2
        adam_epsilon: AdamW epsilon
        max_grad_norm: clip gradients to this global norm (null: no clipping)
        gradient_checkpointing: activation checkpointing of every decoder layer
        torch_compile: torch.compile each decoder layer
        attn_implementation: sdpa | eager | flash_attention_2
        seed: random seed (initialisation, mixture order)
        output_dir: where the Hugging Face folder, checkpoints, fingerprints and logs go
        export_dtype: dtype of the exported weights (default: as trained)
        max_shard_size: largest exported safetensors file, e.g. 5GB
        accelerator: auto | cpu | cuda
        devices: processes per node (auto: what the launcher started, else one per GPU, else 1)
        num_nodes: nodes (one shardwise launch / srun task each)
        strategy: fsdp | fsdp_shard_grad_op | fsdp_hybrid_shard | fsdp_no_shard | ddp | single
        strategy_options: more keyword arguments of the strategy's class, e.g. {limit_all_gathers: true}
        sharding_strategy: FULL_SHARD | SHARD_GRAD_OP | HYBRID_SHARD | NO_SHARD
        tp_size: tensor-parallel degree (FSDP; divides the attention and key/value heads)
        sp_size: sequence-parallel degree (FSDP; divides the heads and seq_length)
        ep_size: expert-parallel degree of a mixture-of-experts architecture (FSDP; divides its experts and the
            data-parallel ranks: each holds experts / ep_size of every layer's experts)
        device_memory: the device's memory (e.g. 80GB, or auto): the planner checks the run fits before it starts
        peak_tflops: the device's dense peak TFLOP/s for MFU (default: the built-in table by GPU name)
        timeout_s: collective timeout in seconds
        enable_progress_bar: show the progress bar
    """

    model: str = ""
    config_overrides: Optional[Dict[str, Any]] = None
    data: Union[str, List[Any], Dict[str, float], None] = None
    tokenizer: Optional[str] = None
    seq_length: int = 2048
    global_batch_size: int = 8
    micro_batch_size: int = 1
    max_steps: int = 1000
    eval_every: Optional[int] = None
    eval_samples: int = 0
    logging_steps: int = 10
    save_steps: Optional[int] = None
    save_total_limit: int = 1
    resume_from_checkpoint: Optional[str] = None
    precision: Optional[str] = None
    learning_rate: float = 3e-4
    warmup_steps: int = 0
    weight_decay: float = 0.1
    adam_beta1: float = 0.9
    adam_beta2: float = 0.95
    adam_epsilon: float = 1e-8
    max_grad_norm: Optional[float] = 1.0
    gradient_checkpointing: bool = False
    torch_compile: bool = False
    attn_implementation: str = "sdpa"
    seed: int = 42
    output_dir: str = "pretrain-output"
    export_dtype: Optional[str] = None
    max_shard_size: str = "5GB"
    accelerator: str = "auto"
    devices: Union[int, str] = "auto"
    num_nodes: int = 1
    strategy: str = "fsdp"
    strategy_options: Optional[Dict[str, Any]] = None
    sharding_strategy: str = "FULL_SHARD"
    tp_size: int = 1
    sp_size: int = 1
    ep_size: int = 1
    device_memory: Optional[str] = None
    peak_tflops: Optional[float] = None
    timeout_s: float = 1800.0
    enable_progress_bar: bool = False


@dataclass
class PretrainResult:
    output_dir: str
    losses: List[Dict[str, float]] = field(default_factory=list)  # per optimizer step, global mean
    eval_losses: List[Dict[str, float]] = field(default_factory=list)
    parameters: int = 0
    tokens_per_step: int = 0
    tokens_per_s: float = 0.0  # this run's trained tokens over its training time (all ranks)
    extra: Any = None  # what pretrain(after_fit=...) returned on this rank


# ------------------------------------------------------------------ the model
def resolve_architecture(cfg: PretrainConfig) -> Tuple[Any, str]:
    """(the transformers config, where it came from) for `cfg.model`, with `config_overrides` applied."""
    from transformers import AutoConfig

    from shardwise.plan.errors import PlanError
    from shardwise.plan.presets import HF_PRESETS, preset_spec

    name = (cfg.model or "").strip()
    if not name:
        raise ValueError(
            f"model: name the architecture: a preset ({', '.join(sorted(HF_PRESETS))}), a config.json path, "
            "or a hub model id."
        )
    if os.path.isfile(name) or os.path.isdir(name):
        file = os.path.join(name, "config.json") if os.path.isdir(name) else name
        if not os.path.isfile(file):
            raise ValueError(f"model {name!r} is a folder without config.json; give the config.json of the model.")
        with open(file) as fh:
            config = AutoConfig.for_model(**json.load(fh))
        source = file
    elif is_hub_id(name) and not name.lower().startswith("llama-"):
        folder = resolve_model(name, config_only=True)
        config, source = AutoConfig.from_pretrained(folder), f"{name} (hub)"
    else:
        try:
            spec = preset_spec(name)
        except PlanError as exc:
            raise ValueError(str(exc)) from None
        if spec.kind != "hf":
            raise ValueError(
                f"model {name!r} is one of the planner's own (non Hugging Face) presets; pretrain builds Hugging "
                f"Face architectures: use {', '.join(sorted(HF_PRESETS))}, a config.json or a hub model id."
            )
        config, source = spec.config.__class__.from_dict(spec.config.to_dict()), f"preset {name}"
    for key, value in (cfg.config_overrides or {}).items():
        if not hasattr(config, key):
            raise ValueError(f"config_overrides: {type(config).__name__} has no field {key!r}.")
        setattr(config, key, value)
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING

    if type(config) not in MODEL_FOR_CAUSAL_LM_MAPPING:
        raise ValueError(
            f"{source}: {type(config).__name__} has no causal-LM class in transformers; pretrain trains "
            "*ForCausalLM architectures."
        )
    return config, source


class PretrainModule(CausalLMModule):
    """The fine-tuning recipe's module without its weight loader: the model's own initialisation, replayed by
    the strategy on every rank (init_weights None: strategies/materialize.py then replays the construction)."""

    init_weights = None  # type: ignore[assignment]
    init_weights_partitioned = False
    log_prefix = "pretrain"

    def __init__(self, recipe: FinetuneConfig, folder: ModelFolder, total_steps: int, mixture: PackedMixture) -> None:
        super().__init__(recipe, folder, total_steps)
        self.mixture = mixture
        self.train_started, self.first_step = time.time(), 0

    def on_fit_start(self) -> None:
        # The mixture's place among the ranks that read different samples (a tp / sp group reads the same).
        strategy = self.trainer.strategy
        self.mixture.dp_rank, self.mixture.dp_size = strategy.data_parallel_rank, strategy.data_parallel_size

    def on_train_start(self) -> None:
        self._t0 = self.train_started = time.time()
        self.first_step = self.trainer.global_step  # 0, or the step a resumed run continues after
        if self.trainer.is_global_zero:
            total = self.parameter_counts.get("total", 0)
            print(f"[pretrain] {total:,} parameters, initialised from seed {self.cfg.seed}", flush=True)


def collate(samples: List[Dict[str, torch.Tensor]]) -> Dict[str, torch.Tensor]:
    """The mixture's samples as a batch of model inputs: `sample_id` is left out (sequence parallel splits every
    tensor of a batch along the sequence, and the fingerprint hashes the rows of input_ids)."""
    return default_collate([{k: v for k, v in sample.items() if k != "sample_id"} for sample in samples])


# ------------------------------------------------------------------ checks
def _has_cuda(cfg: PretrainConfig) -> bool:
    return cfg.accelerator in ("auto", "cuda") and torch.cuda.is_available()


def recipe_view(cfg: PretrainConfig, model_dir: str) -> FinetuneConfig:
    """The same run in the fine-tuning recipe's options, which the shared module and strategy flags read."""
    # The module warms up for ceil(max_steps * warmup_ratio) steps; half a step under warmup_steps keeps the
    # product's rounding from adding one.
    ratio = (cfg.warmup_steps - 0.5) / cfg.max_steps if cfg.warmup_steps > 0 else 0.0
    return FinetuneConfig(
        model_path=model_dir,
        data=DataOptions(max_seq_len=cfg.seq_length, packing=True, per_device_train_batch_size=cfg.micro_batch_size),
        max_steps=cfg.max_steps,
        logging_steps=cfg.logging_steps,
        save_steps=cfg.save_steps,
        save_total_limit=cfg.save_total_limit,
        precision=cfg.precision or "32-true",
        learning_rate=cfg.learning_rate,
        lr_scheduler_type="cosine",
        warmup_ratio=ratio,
        weight_decay=cfg.weight_decay,
        adam_beta1=cfg.adam_beta1,
        adam_beta2=cfg.adam_beta2,
        adam_epsilon=cfg.adam_epsilon,
        max_grad_norm=cfg.max_grad_norm,
        gradient_checkpointing=cfg.gradient_checkpointing,
        attn_implementation=cfg.attn_implementation,
        seed=cfg.seed,
        output_dir=cfg.output_dir,
        accelerator=cfg.accelerator,
        devices=cfg.devices,
        num_nodes=cfg.num_nodes,
        strategy=cfg.strategy,
        strategy_options=cfg.strategy_options,
        sharding_strategy=cfg.sharding_strategy,
        timeout_s=cfg.timeout_s,
        peak_tflops=cfg.peak_tflops,
        torch_compile=cfg.torch_compile,
        tp_size=cfg.tp_size,
        sp_size=cfg.sp_size,
        ep_size=cfg.ep_size,
    )


def validate_config(cfg: PretrainConfig) -> Dict[str, Any]:
    """Every check that needs no worker; returns what the run needs. Raises ValueError naming the fix."""
    if cfg.precision is None:
        cfg = dataclasses.replace(cfg, precision="bf16-true" if _has_cuda(cfg) else "32-true")
    for name in ("seq_length", "global_batch_size", "micro_batch_size", "max_steps", "logging_steps"):
        if getattr(cfg, name) < 1:
            raise ValueError(f"{name}={getattr(cfg, name)}: use 1 or more.")
    if cfg.seq_length < 2:
        raise ValueError(f"seq_length={cfg.seq_length}: use at least 2 (a token and the one it predicts).")
    for name in ("eval_every", "save_steps"):
        value = getattr(cfg, name)
        if value is not None and value < 1:
            raise ValueError(f"{name}={value}: use 1 or more, or leave it unset.")
    if cfg.eval_samples < 0:
        raise ValueError(f"eval_samples={cfg.eval_samples}: use 0 or more.")
    if cfg.eval_every and not cfg.eval_samples:
        raise ValueError(f"eval_every={cfg.eval_every} evaluates on held-out samples: set eval_samples (e.g. 64).")
    if not 0 <= cfg.warmup_steps < cfg.max_steps:
        raise ValueError(f"warmup_steps={cfg.warmup_steps}: use 0 up to max_steps - 1 ({cfg.max_steps - 1}).")
    if cfg.export_dtype is not None and cfg.export_dtype not in DTYPES:
        raise ValueError(f"export_dtype={cfg.export_dtype!r}: use one of {', '.join(DTYPES)}.")
    try:
        key = names.key_of(cfg.strategy)[0]
    except ValueError:
        key = None
    if key is not None and names.TABLE[key]["engine"] == "deepspeed":
        raise ValueError(
            f"strategy={cfg.strategy!r}: pretrain runs on fsdp (and its variants), ddp or single; ZeRO-3's "
            "partitioned construction would skip the model's own initialisation. Use strategy='fsdp'."
        )
    corpora = parse_data(cfg.data)
    vocabs, tokenizers = {}, set()
    for path, _ in corpora:
        corpus = TokenCorpus(path)  # missing or unfinished: FileNotFoundError naming `shardwise prepare`
        vocabs[path] = corpus.vocab_size
        tokenizers.add(str(corpus.index.get("tokenizer")))
    if len(set(vocabs.values())) > 1 or len(tokenizers) > 1:
        raise ValueError(
            f"data: the corpora were prepared with different tokenizers ({sorted(tokenizers)}, vocabularies "
            f"{vocabs}); prepare every corpus with the tokenizer the model trains with."
        )
    config, source = resolve_architecture(cfg)
    vocab = max(vocabs.values())
    if vocab > int(getattr(config, "vocab_size", 0) or 0):
        raise ValueError(
            f"the corpora's tokenizer has {vocab} tokens but the model ({source}) has vocab_size="
            f"{config.vocab_size}: token ids past it have no embedding. Set config_overrides: "
            f"{{vocab_size: {vocab}}} (or more, e.g. a multiple of 64)."
        )
    positions = next((v for k in POSITION_FIELDS if isinstance(v := getattr(config, k, None), int) and v > 0), None)
    if positions is not None and cfg.seq_length > positions:
        raise ValueError(
            f"seq_length={cfg.seq_length} exceeds the model's maximum of {positions} positions "
            f"({source}). Lower seq_length, or set config_overrides: {{max_position_embeddings: {cfg.seq_length}}}."
        )
    tokenizer_name = cfg.tokenizer or next(iter(tokenizers))
    tokenizer_dir = tokenizer_name if os.path.isdir(tokenizer_name) else None
    if tokenizer_dir is None and is_hub_id(tokenizer_name):
        tokenizer_dir = resolve_tokenizer(tokenizer_name)
    if tokenizer_dir is None:
        raise ValueError(
            f"tokenizer {tokenizer_name!r} (the corpora's) is neither a folder nor a hub id: pass --tokenizer "
            "with the tokenizer's folder, which the exported model is saved with."
        )
    # Parallel degrees, batch split and strategy flags, through the fine-tuning recipe's own checks.
    world = recipe_world_size(cfg)
    replicas = max(1, world // max(1, cfg.tp_size * cfg.sp_size))
    per_step = cfg.micro_batch_size * replicas
    if cfg.global_batch_size % per_step:
        raise ValueError(
            f"global_batch_size={cfg.global_batch_size} is not a multiple of micro_batch_size x data-parallel "
            f"ranks = {cfg.micro_batch_size} x {replicas}: choose a global batch that splits evenly "
            f"(e.g. {per_step * max(1, round(cfg.global_batch_size / per_step))})."
        )
    build_precision(cfg.precision, "cuda" if _has_cuda(cfg) else "cpu")
    check_peak(cfg.peak_tflops, "--peak_tflops")
    folder = ModelFolder(cfg.output_dir, config, [], False, positions, source=source)
    recipe = dataclasses.replace(
        recipe_view(cfg, cfg.output_dir), gradient_accumulation_steps=cfg.global_batch_size // per_step
    )
    strategy = build_recipe_strategy(recipe, folder)
    train, held_out = split_corpora(corpora, cfg.seq_length, cfg.eval_samples)
    PackedMixture(dict(train), cfg.seq_length, seed=cfg.seed)  # a corpus too small for one sample: refused here
    return {
        "cfg": cfg,
        "config": config,
        "folder": folder,
        "recipe": recipe,
        "strategy": strategy,
        "train": train,
        "held_out": held_out,
        "tokenizer_dir": tokenizer_dir,
    }


# ------------------------------------------------------------------ running
def _run(
    cfg: PretrainConfig, after_fit: Optional[Callable[[Any], Any]] = None, callbacks: Sequence[Any] = ()
) -> PretrainResult:
    """One worker's whole run (every rank executes it)."""
    from transformers import AutoTokenizer

    from shardwise.callbacks import ModelCheckpoint

    checked = validate_config(cfg)
    cfg, recipe, folder = checked["cfg"], checked["recipe"], checked["folder"]
    seed_everything(cfg.seed)
    saves = (
        [
            ModelCheckpoint(
                dirpath=os.path.join(cfg.output_dir, "checkpoints"),
                every_n_train_steps=cfg.save_steps,
                save_top_k=cfg.save_total_limit,
            )
        ]
        if cfg.save_steps
        else []
    )
    trainer = Trainer(
        accelerator=cfg.accelerator,
        devices=cfg.devices,
        num_nodes=cfg.num_nodes,
        strategy=checked["strategy"],
        precision=cfg.precision,
        max_steps=cfg.max_steps,
        accumulate_grad_batches=recipe.gradient_accumulation_steps,
        gradient_clip_val=cfg.max_grad_norm,
        log_every_n_steps=cfg.logging_steps,
        val_check_interval=cfg.eval_every * recipe.gradient_accumulation_steps if cfg.eval_every else None,
        num_sanity_val_steps=0,
        callbacks=[BatchFingerprint(), *callbacks, *saves],
        enable_checkpointing=bool(saves),
        enable_progress_bar=cfg.enable_progress_bar,
        default_root_dir=cfg.output_dir,
        peak_tflops=cfg.peak_tflops,
        compile=cfg.torch_compile,
        device_memory=cfg.device_memory,
    )
    mixture = PackedMixture(dict(checked["train"]), cfg.seq_length, seed=cfg.seed)
    train = DataLoader(mixture, batch_size=cfg.micro_batch_size, collate_fn=collate)
    val = None
    if cfg.eval_every:
        held = HeldOut(checked["held_out"], cfg.seq_length, cfg.eval_samples, cfg.seed)
        val = DataLoader(held, batch_size=cfg.micro_batch_size, shuffle=False, collate_fn=collate)
    module = PretrainModule(recipe, folder, cfg.max_steps, mixture)
    if is_global_zero():  # the architecture beside the checkpoints: `shardwise convert` reads it from there
        os.makedirs(cfg.output_dir, exist_ok=True)
        checked["config"].save_pretrained(cfg.output_dir)
    trainer.fit(module, train, val, ckpt_path=cfg.resume_from_checkpoint)
    # tokens/s of the steps this run trained (a resumed run: those after its checkpoint), before the export
    seconds, trained = time.time() - module.train_started, trainer.global_step - module.first_step
    tokenizer = AutoTokenizer.from_pretrained(checked["tokenizer_dir"])
    export_hf_folder(
        module.model,
        cfg.output_dir,
        config=checked["config"],
        tokenizer=tokenizer,
        max_shard_size=parse_bytes(cfg.max_shard_size),
        dtype=cast_dtype(cfg.export_dtype),
    )
    tokens_per_step = cfg.global_batch_size * cfg.seq_length
    result = PretrainResult(
        output_dir=os.path.abspath(cfg.output_dir),
        losses=module.history,
        eval_losses=module.eval_history,
        parameters=int(module.parameter_counts.get("total", 0)),
        tokens_per_step=tokens_per_step,
        tokens_per_s=trained * tokens_per_step / max(seconds, 1e-9),
        extra=after_fit(module) if after_fit is not None else None,
    )
    if trainer.is_global_zero:
        with open(os.path.join(cfg.output_dir, HISTORY_FILE), "w") as fh:
            json.dump({k: v for k, v in dataclasses.asdict(result).items() if k != "extra"}, fh, indent=2)
        last = result.losses[-1]["loss"] if result.losses else float("nan")
        print(
            f"[pretrain] done: step {cfg.max_steps}, loss {last:.4f}, {result.tokens_per_s:,.0f} tokens/s; "
            f"Hugging Face folder in {result.output_dir}",
            flush=True,
        )
    trainer.strategy.teardown()
    return result


def pretrain(
    config: Union[PretrainConfig, Dict[str, Any], str],
    after_fit: Optional[Callable[[Any], Any]] = None,
    callbacks: Sequence[Any] = (),
) -> PretrainResult:
    """Pre-train and export; returns global rank 0's result (losses per step, eval losses, tokens/s).

    `config`: a PretrainConfig, a dict of its fields, or a YAML file path. Called in a plain process with
    devices > 1 it starts the workers itself (one node); under `shardwise launch`, torchrun or srun it is
    one rank. `after_fit(module)` runs on every rank after the export, with the trained module (its `.model`
    is the sharded Hugging Face model); its return value is `result.extra`. `callbacks` join the Trainer's
    (before the checkpoint callback). Both must be importable (module-level) for multi-process runs.
    """
    cfg = coerce_config(config)
    checked = validate_config(cfg)  # before any worker starts
    cfg = checked["cfg"]  # the precision resolved here, so every worker uses the same
    if detect_env() is None:
        devices = resolve_devices(cfg.devices, resolve_accelerator(cfg.accelerator))
        if cfg.num_nodes > 1:
            raise RuntimeError(
                f"num_nodes={cfg.num_nodes}: start one launcher per node, e.g. `shardwise launch --nnodes "
                f"{cfg.num_nodes} --node-rank <i> --nproc-per-node {devices} --master-addr <node 0> "
                "shardwise pretrain --config ...`."
            )
        if devices > 1:
            return launch(_run, cfg, after_fit, tuple(callbacks), devices=devices)[0]
    return _run(cfg, after_fit, tuple(callbacks))


def coerce_config(config: Union[PretrainConfig, Dict[str, Any], str]) -> PretrainConfig:
    """A PretrainConfig as it is, or one from a dict of options or a YAML file."""
    if isinstance(config, PretrainConfig):
        return config
    if isinstance(config, (str, os.PathLike)):
        import yaml

        with open(config) as fh:
            config = yaml.safe_load(fh) or {}
    valid = {f.name for f in dataclasses.fields(PretrainConfig)}
    unknown = sorted(set(config) - valid)
    if unknown:
        raise ValueError(f"unknown pretrain option(s) {unknown}; valid: {sorted(valid)}")
    return PretrainConfig(**config)

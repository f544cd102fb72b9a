"""The Trainer: the training loop, top to bottom.

Set-up (in this order, every step commented where it matters):
environment -> strategy -> configure_model under the strategy's init context
-> strategy wraps / shards / materialises -> optimizers on the wrapped
parameters -> data loaders with distributed, resumable sampling -> restore a
checkpoint -> loop. The loop accumulates micro-batches (communicating only on
the last one), clips, steps, logs, validates and checkpoints. Everything that
differs between one device, DDP, FSDP and DeepSpeed is a strategy method;
nothing here knows which strategy runs.
"""

from __future__ import annotations

import inspect
import math
import os
import signal
import sys
import threading
import types
import warnings
from typing import Any, Dict, Iterable, List, Optional, Sequence, Tuple, Union

import torch
from torch import nn
from torch.distributed.tensor import DTensor

from shardwise import health
from shardwise import step as shared_step  # looked up at call time, like the planner's trace
from shardwise.callbacks import ModelCheckpoint, RichProgressBar
from shardwise.checkpoint import load_training_checkpoint, save_training_checkpoint
from shardwise.checkpoint.rng import capture_rng_states, restore_rng_states
from shardwise.distributed import ops, preempt
from shardwise.distributed.device import move_to_device
from shardwise.distributed.env import detect_env, resolve_accelerator, resolve_devices
from shardwise.distributed.launch import launch_script
from shardwise.distributed.progress import mark as mark_progress
from shardwise.loggers import CSVLogger
from shardwise.metrics import MetricStore, settle
from shardwise.module import TrainModule
from shardwise.plan.advice import check_before_fit
from shardwise.state import TrainState
from shardwise.strategies import Strategy, build_strategy
from shardwise.strategies.materialize import watch_meta_writes

_MAX_EPOCHS_DEFAULT = 1000  # Lightning's default when neither max_epochs nor max_steps is set


def _length(loader: Any) -> float:
    """len(loader), or infinity for loaders without one (an IterableDataset without __len__)."""
    try:
        return float(len(loader))
    except TypeError:
        return float("inf")


def _describe_empty(loader: Any) -> str:
    dataset = getattr(loader, "dataset", None)
    try:
        size = f"its dataset has {len(dataset)} samples"
    except TypeError:
        size = "its dataset yields no samples"
    batch = getattr(loader, "batch_size", None)
    drop = " and drop_last=True drops a final partial batch" if getattr(loader, "drop_last", False) else ""
    share = ""
    sampler = getattr(loader, "sampler", None)
    if getattr(sampler, "num_replicas", 1) > 1:
        share = f" ({sampler.num_replicas} ranks share it)"
    return f"{size}{share}, batch size {batch}{drop}."


def _limit(limit: Union[int, float, None], available: float) -> float:
    if limit is None:
        return available
    if isinstance(limit, float) and limit <= 1.0:
        if math.isinf(available):
            raise ValueError("A fractional limit_*_batches needs a DataLoader with a length.")
        return int(available * limit)
    return min(int(limit), available)


# Lightning 1.x spelled the strategy as an accelerator ("ddp") or a plugin.
_LEGACY_ACCELERATORS = {"ddp", "ddp_spawn", "ddp2", "dp", "fsdp", "deepspeed"}


def _lightning_spellings(
    accelerator: Any, devices: Any, strategy: Any, gpus: Optional[int], plugins: Any
) -> Tuple[Any, Any, Any]:
    """Map the older Lightning arguments the seeds' scripts use onto ours; say so once each."""
    if accelerator == "gpu":
        accelerator = "cuda"
    if isinstance(accelerator, str) and accelerator in _LEGACY_ACCELERATORS:
        name = "ddp" if accelerator in ("ddp_spawn", "ddp2", "dp") else accelerator
        if strategy not in ("auto", None, name):
            raise ValueError(
                f"accelerator={accelerator!r} (Lightning 1.x for strategy={name!r}) contradicts "
                f"strategy={strategy!r}; pass only strategy=."
            )
        warnings.warn(
            f"Trainer(accelerator={accelerator!r}) is Lightning 1.x for strategy={name!r}; using that.", stacklevel=3
        )
        accelerator, strategy = "auto", name
    if gpus is not None:
        if devices not in ("auto", gpus):
            raise ValueError(
                f"Trainer(gpus={gpus}, devices={devices!r}): gpus= is the older name of devices= "
                "with accelerator='cuda'; pass only devices=."
            )
        warnings.warn(
            f"Trainer(gpus={gpus}) is the older spelling of Trainer(accelerator='cuda', devices={gpus}).", stacklevel=3
        )
        accelerator, devices = ("cuda" if accelerator == "auto" else accelerator), gpus
    for plugin in plugins if isinstance(plugins, (list, tuple)) else [plugins] if plugins is not None else []:
        if isinstance(plugin, (str, Strategy)):
            if strategy not in ("auto", None) and strategy is not plugin:
                raise ValueError(
                    f"plugins={plugin!r} selects the strategy, and so does strategy={strategy!r}: pass only strategy=."
                )
            strategy = plugin  # DeepSpeedPlugin(...) is DeepSpeedStrategy(...); 'deepspeed_stage_3' a name
        else:
            raise TypeError(
                f"plugins={plugin!r}: shardwise takes a strategy (name or object) there, as Lightning "
                "1.x did for DeepSpeedPlugin; precision and cluster plugins are Trainer arguments "
                "(precision=..., num_nodes=...)."
            )
    return accelerator, devices, strategy


def _is_datamodule(obj: Any) -> bool:
    """A LightningDataModule-style object: it makes loaders, it is not one."""
    return obj is not None and callable(getattr(obj, "train_dataloader", None)) and not hasattr(obj, "__iter__")


def _check_refit(module: TrainModule, trainer: "Trainer") -> set:
    """A module trained by another Trainer: the ids of its trained parameters, or an error if it is sharded."""
    previous = getattr(module, "_trainer", None)
    if previous is None or previous is trainer:
        return set()
    params = list(module.parameters())
    if any(isinstance(p, DTensor) or hasattr(p, "ds_id") for p in params) or getattr(previous.strategy, "name", "") in (
        "fsdp",
        "deepspeed",
    ):
        raise RuntimeError(
            f"This {type(module).__name__} was already set up and trained by another Trainer's "
            f"{type(previous.strategy).__name__}: its parameters are sharded for that run's process group. "
            "To train further, call fit() again on the same Trainer (it continues from the trained weights, "
            "with a larger max_steps / max_epochs), or save a checkpoint and fit a fresh module with "
            "ckpt_path=..."
        )
    return {id(p) for p in params if not p.is_meta}


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _check_arguments(**args: Any) -> None:
    """Refuse impossible loop settings when the Trainer is built, naming the argument and its range."""

    def bad(name: str, allowed: str) -> None:
        raise ValueError(f"Trainer({name}={args[name]!r}): {allowed}.")

    if args["max_epochs"] is not None and (not _is_int(args["max_epochs"]) or args["max_epochs"] < -1):
        bad("max_epochs", "use a non-negative integer, -1 for no limit, or None for the default")
    if not _is_int(args["max_steps"]) or args["max_steps"] < -1:
        bad("max_steps", "use a non-negative integer, or -1 for no limit")
    if not _is_int(args["accumulate_grad_batches"]) or args["accumulate_grad_batches"] < 1:
        bad("accumulate_grad_batches", "use a whole number of micro-batches, 1 or more")
    clip = args["gradient_clip_val"]
    if clip is not None and (
        isinstance(clip, bool) or not isinstance(clip, (int, float)) or not clip > 0 or math.isinf(clip)
    ):
        bad("gradient_clip_val", "use a positive, finite number, or None for no clipping")
    for name in ("limit_train_batches", "limit_val_batches"):
        value = args[name]
        if value is None:
            continue
        if (
            isinstance(value, bool)
            or not isinstance(value, (int, float))
            or (isinstance(value, float) and not 0.0 <= value <= 1.0)
            or (_is_int(value) and value < 0)
        ):
            bad(
                name,
                "use a fraction of the loader between 0.0 and 1.0, a number of batches (0 or more), or None for all",
            )
    interval = args["val_check_interval"]
    if interval is not None and (
        isinstance(interval, bool)
        or not isinstance(interval, (int, float))
        or (isinstance(interval, float) and not 0.0 < interval <= 1.0)
        or (_is_int(interval) and interval < 1)
    ):
        bad(
            "val_check_interval",
            "use a fraction of the epoch in (0.0, 1.0], a number of batches (1 or more), "
            "or None to validate at epoch ends",
        )
    if not _is_int(args["check_val_every_n_epoch"]) or args["check_val_every_n_epoch"] < 1:
        bad("check_val_every_n_epoch", "use a whole number of epochs, 1 or more")
    if not _is_int(args["log_every_n_steps"]) or args["log_every_n_steps"] < 1:
        bad("log_every_n_steps", "use a whole number of steps, 1 or more")


def _signal_numbers(names: Optional[Sequence[Union[str, int]]]) -> List[int]:
    out = []
    for name in names or ():
        try:
            out.append(int(name) if isinstance(name, int) else int(getattr(signal, str(name).upper())))
        except (AttributeError, ValueError):
            raise ValueError(
                f"preemption_signals: {name!r} is not a signal; use names such as 'SIGTERM', "
                "'SIGUSR1', or None to keep the default signal handling."
            ) from None
    return out


def _takes_batch_idx(fn: Any) -> bool:
    params = [
        p
        for p in inspect.signature(fn).parameters.values()
        if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD, p.VAR_POSITIONAL)
    ]
    return len(params) >= 2 or any(p.kind == p.VAR_POSITIONAL for p in params)


class Trainer:
    def __init__(
        self,
        accelerator: str = "auto",
        devices: Union[int, str] = "auto",
        num_nodes: int = 1,
        strategy: Union[str, Strategy] = "auto",
        precision: Union[str, int] = "32-true",
        max_epochs: Optional[int] = None,
        max_steps: int = -1,
        limit_train_batches: Union[int, float, None] = None,
        limit_val_batches: Union[int, float, None] = None,
        val_check_interval: Union[int, float, None] = None,
        check_val_every_n_epoch: int = 1,
        accumulate_grad_batches: int = 1,
        gradient_clip_val: Optional[float] = None,
        gradient_clip_algorithm: str = "norm",
        log_every_n_steps: int = 50,
        callbacks: Optional[List[Any]] = None,
        logger: Any = True,
        enable_progress_bar: bool = True,
        enable_checkpointing: bool = True,
        default_root_dir: Optional[str] = None,
        deterministic: bool = False,
        device_memory: Union[None, str, int] = None,
        preemption_signals: Optional[Sequence[Union[str, int]]] = ("SIGTERM", "SIGINT", "SIGUSR1"),
        non_finite: str = "error",
        timeout_s: Optional[float] = None,
        gpus: Optional[int] = None,
        plugins: Any = None,
    ) -> None:
        # Everything is validated here, in the process the user started,
        # before any worker is spawned or any weight allocated.
        accelerator, devices, strategy = _lightning_spellings(accelerator, devices, strategy, gpus, plugins)
        self.accelerator = resolve_accelerator(accelerator)
        env = detect_env()
        if env is not None and devices == "auto":
            devices = env.local_world_size
        self.devices = resolve_devices(devices, self.accelerator)
        if not isinstance(num_nodes, int) or num_nodes < 1:
            raise ValueError(f"num_nodes={num_nodes!r}: use a positive integer.")
        self.num_nodes = num_nodes
        self.strategy = build_strategy(strategy, world_size=self.devices * num_nodes)
        self.strategy.connect(
            self.accelerator, precision, num_nodes=num_nodes, devices=self.devices, timeout_s=timeout_s
        )
        # Known device memory ("80GiB", or "auto" on CUDA) lets fit() consult the memory planner:
        # strategy="auto" becomes its choice, and a run predicted not to fit warns first.
        self.device_memory = device_memory
        _check_arguments(
            max_epochs=max_epochs,
            max_steps=max_steps,
            limit_train_batches=limit_train_batches,
            limit_val_batches=limit_val_batches,
            val_check_interval=val_check_interval,
            check_val_every_n_epoch=check_val_every_n_epoch,
            accumulate_grad_batches=accumulate_grad_batches,
            gradient_clip_val=gradient_clip_val,
            log_every_n_steps=log_every_n_steps,
        )
        if gradient_clip_algorithm not in ("norm", "value"):
            raise ValueError(f"gradient_clip_algorithm={gradient_clip_algorithm!r}: use 'norm' or 'value'.")
        self.max_epochs = max_epochs if max_epochs is not None else (_MAX_EPOCHS_DEFAULT if max_steps == -1 else -1)
        self.max_steps = max_steps
        self.limit_train_batches = limit_train_batches
        self.limit_val_batches = limit_val_batches
        self.val_check_interval = val_check_interval
        self.check_val_every_n_epoch = check_val_every_n_epoch
        self.accumulate_grad_batches = accumulate_grad_batches
        self.gradient_clip_val = gradient_clip_val
        self.gradient_clip_algorithm = gradient_clip_algorithm
        self.log_every_n_steps = max(1, log_every_n_steps)
        self.default_root_dir = os.fspath(default_root_dir or os.getcwd())
        self.deterministic = deterministic
        self.enable_checkpointing = enable_checkpointing
        # A preemption signal (SLURM's --signal, a scheduler's SIGTERM) ends the run
        # cleanly: the step in progress finishes, the run saves and exits with
        # PREEMPTED_EXIT_CODE (75) so a job script knows to resubmit.
        self.preemption_signals = _signal_numbers(preemption_signals)
        self.preempted: Optional[str] = None  # the signal's name once the run stopped for it
        self._preempt_flag: Any = None
        self._preemption_agreed: Optional[bool] = None  # set by this step's health check
        # A NaN/inf loss or gradient: 'error' stops at that step naming the rank and
        # tensor, 'skip' drops the step (as GradScaler does), 'warn' only reports it.
        if non_finite not in ("error", "skip", "warn", "off"):
            raise ValueError(
                f"non_finite={non_finite!r}: use 'error' (stop, the default), 'skip' (drop the step), "
                "'warn' (report and continue) or 'off'."
            )
        if non_finite == "skip" and self.strategy.name == "deepspeed":
            raise ValueError(
                "non_finite='skip' is not available with DeepSpeed: its engine takes every step. Use "
                "'error' or 'warn', or fp16 precision, whose loss scaling skips overflowing steps."
            )
        self.non_finite = non_finite
        self.nonfinite_step: Optional[int] = None  # the first step with a non-finite value (never saved after it)
        self._window_losses: List[Tuple[int, torch.Tensor]] = []
        self.callbacks = self._default_callbacks(list(callbacks or []), enable_progress_bar, enable_checkpointing)
        self.loggers = self._build_loggers(logger)
        self.state = TrainState()
        self.metrics = MetricStore()
        self.should_stop = False
        self.validating = False
        self.is_last_microbatch = False
        self.num_training_batches: float = float("inf")
        self.num_val_batches: float = 0
        self.model: Optional[nn.Module] = None
        self.module: Optional[TrainModule] = None  # the TrainModule being trained; `model` is its wrapped form
        self.train_dataloader: Any = None
        self.val_dataloaders: Any = None
        self._set_up = False

    @property
    def lightning_module(self) -> Optional[TrainModule]:
        """Lightning's name for `module`, kept so Lightning code and callbacks run unchanged."""
        return self.module

    # ---------------------------------------------------------------- wiring
    def _default_callbacks(self, callbacks: List[Any], progress: bool, checkpointing: bool) -> List[Any]:
        if progress and not any(hasattr(c, "is_progress_bar") for c in callbacks):
            callbacks.append(RichProgressBar())
        if checkpointing and not any(isinstance(c, ModelCheckpoint) for c in callbacks):
            callbacks.append(ModelCheckpoint())
        return callbacks

    def _build_loggers(self, logger: Any) -> List[Any]:
        if logger is True:
            return [CSVLogger(self.default_root_dir)]
        if logger in (False, None):
            return []
        return list(logger) if isinstance(logger, (list, tuple)) else [logger]

    def _call(self, hook: str, *args: Any, **kwargs: Any) -> None:
        """Duck-typed callbacks: call `hook` on every callback that defines it, then the module's."""
        for callback in self.callbacks:
            fn = getattr(callback, hook, None)
            if callable(fn):
                fn(self, self.module, *args, **kwargs)

    def _call_module(self, hook: str, *args: Any) -> Any:
        module = self.module
        fn = getattr(module, hook, None)
        if not callable(fn):
            return None
        object.__setattr__(module, "_current_hook", hook)
        mark_progress(hook, self.state.global_step)  # what this rank does, if it ever hangs
        return fn(*args)

    # ------------------------------------------------------------ properties
    @property
    def global_step(self) -> int:
        return self.state.global_step

    @property
    def fit_loop(self) -> Any:
        """Lightning's `trainer.fit_loop.total_batch_idx` (batches over the whole run), which LR warm-up code reads."""
        per_epoch = self.num_training_batches if math.isfinite(self.num_training_batches) else 0
        return types.SimpleNamespace(total_batch_idx=int(self.state.epoch * per_epoch + self.state.batch_idx))

    @property
    def current_epoch(self) -> int:
        return self.state.epoch

    @property
    def batch_idx(self) -> int:
        return self.state.batch_idx

    @property
    def world_size(self) -> int:
        return self.strategy.world_size

    @property
    def global_rank(self) -> int:
        return self.strategy.global_rank

    @property
    def local_rank(self) -> int:
        return self.strategy.local_rank

    @property
    def is_global_zero(self) -> bool:
        return self.strategy.is_global_zero

    @property
    def callback_metrics(self) -> Dict[str, float]:
        return self.metrics.callback_metrics

    @property
    def progress_bar_metrics(self) -> Dict[str, float]:
        return self.metrics.progress_bar_metrics

    @property
    def logged_metrics(self) -> Dict[str, float]:
        return self.metrics.logged_metrics

    @property
    def logger(self) -> Any:
        return self.loggers[0] if self.loggers else None

    @property
    def log_dir(self) -> Optional[str]:
        return getattr(self.logger, "log_dir", None) or self.default_root_dir

    @property
    def optimizers(self) -> List[torch.optim.Optimizer]:
        return self.strategy.optimizers

    def print(self, *args: Any, **kwargs: Any) -> None:
        """print() on global rank 0 only."""
        if self.strategy.is_global_zero:
            print(*args, **kwargs)

    def log_metrics(self, metrics: Dict[str, float], step: Optional[int] = None) -> None:
        if not self.strategy.is_global_zero or not metrics:
            return
        metrics = settle(dict(metrics))
        for logger in self.loggers:
            logger.log_metrics(metrics, step=self.global_step if step is None else step)

    # ----------------------------------------------------------------- launch
    def _launch_if_needed(self) -> None:
        """Become the supervisor of `devices` workers, or check the launcher's world."""
        world = self.devices * self.num_nodes
        env = detect_env()
        if env is None:
            if world == 1:
                return
            if self.num_nodes > 1:
                raise RuntimeError(
                    f"num_nodes={self.num_nodes} needs one launcher per node: run `shardwise launch --nnodes "
                    f"{self.num_nodes} --node-rank <i> --nproc-per-node {self.devices} ...`, torchrun, or srun."
                )
            if "pytest" in sys.modules or "ipykernel" in sys.modules:
                raise RuntimeError(
                    "Trainer(devices>1) re-runs the program in each worker, which is not possible from a "
                    "test runner or notebook. Wrap the training in a function and run it with "
                    "`shardwise.launch(fn, devices=N)`."
                )
            launch_script(self.devices)  # never returns: the workers run the script
        if env.world_size != world:
            raise RuntimeError(
                f"The launcher started {env.world_size} processes but Trainer(devices={self.devices}, "
                f"num_nodes={self.num_nodes}) expects {world}. Make them agree (devices='auto' follows the launcher)."
            )

    # -------------------------------------------------------------------- set-up
    def _setup(self, module: TrainModule, need_train_data: bool = True) -> None:
        if self._set_up and self.module is module:
            if need_train_data and self._resolved_data[0] is None:  # a fit after validate()
                self._resolve_data(module, need_train_data=True)
            self._call("setup", stage="fit")  # a second fit: callbacks take their resources again
            return
        if not isinstance(module, TrainModule):
            raise TypeError(f"fit() takes a shardwise.TrainModule, got {type(module).__name__}.")
        strategy = self.strategy
        strategy.setup_environment()
        if self.deterministic:
            torch.use_deterministic_algorithms(True, warn_only=True)
        trained = _check_refit(module, self)
        self.module = module
        module._attach(self)
        self._resolve_data(module, need_train_data)
        self._call("setup", stage="fit")
        # 1. configure_model under the strategy's init context (meta device),
        # 2. the strategy wraps, shards and materialises it.
        with strategy.module_init_context(), watch_meta_writes() as writes:
            try:
                self._call_module("configure_model")
            except RuntimeError as exc:
                if "from_pretrained" in str(exc) and "meta" in str(exc):
                    raise RuntimeError(
                        "configure_model() calls from_pretrained, but configure_model builds on the meta device "
                        "so that no rank holds the whole model before it is sharded. Build the architecture "
                        "there (AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(path))) and load "
                        "the weights in TrainModule.init_weights(), or use `shardwise finetune`, which streams "
                        "them from rank 0 into the shards."
                    ) from exc
                raise
        writes.check()  # a custom init on the meta device would be silently replaced
        if trained and not trained <= {id(p) for p in module.parameters()}:
            raise RuntimeError(
                f"configure_model() rebuilt the layers of a {type(module).__name__} that was already trained, "
                "which would silently start again from fresh weights. configure_model runs at every fit: "
                "guard it (`if self.model is None: self.model = ...`) to continue from the trained weights."
            )
        self.model = strategy.setup_module(module)
        params = list(module.parameters())
        if not any(p.requires_grad for p in params):
            raise ValueError(
                f"{type(module).__name__} has no trainable parameters after configure_model()"
                + (
                    " (every parameter has requires_grad=False)."
                    if params
                    else ": no layer was registered. Assign layers to attributes of the module (self.model = ...), "
                    "in __init__ or configure_model; layers kept in plain lists or dicts are not registered "
                    "(use nn.ModuleList / nn.ModuleDict)."
                )
            )
        # 3. optimizers on the wrapped (possibly sharded) parameters.
        optimizers, schedulers = self._parse_optimizers(self._call_module("configure_optimizers"))
        for opt in optimizers:
            strategy.setup_optimizer(opt)
        strategy.lr_schedulers = schedulers
        self._set_up = True

    def _resolve_data(self, module: TrainModule, need_train_data: bool = True) -> None:
        """In the workers, with the process group up: the loaders from the datamodule or the module's hooks.

        validate() passes need_train_data=False: it must not build (or require) training data.
        """
        train, val, datamodule = getattr(self, "_data_sources", (None, None, None))
        if datamodule is not None:
            if self.strategy.local_rank == 0 and callable(getattr(datamodule, "prepare_data", None)):
                datamodule.prepare_data()  # once per node, before any rank reads what it prepares
            self.strategy.barrier("prepare_data")
            if callable(getattr(datamodule, "setup", None)):
                datamodule.setup("fit")
            owner = datamodule
        else:
            owner = module
        if train is None and need_train_data and callable(getattr(owner, "train_dataloader", None)):
            train = owner.train_dataloader()
        if val is None and callable(getattr(owner, "val_dataloader", None)):
            val = owner.val_dataloader()
        self._resolved_data = (train, val)
        if train is not None and getattr(train, "batch_size", None) is not None:
            # The loader is known only now; DeepSpeed's config takes its micro-batch size.
            self.strategy.configure_training(
                accumulate_grad_batches=self.accumulate_grad_batches,
                gradient_clip_val=self.gradient_clip_val,
                gradient_clip_algorithm=self.gradient_clip_algorithm,
                micro_batch_size=train.batch_size,
            )

    def _setup_loggers(self) -> None:
        """After any restore: a resumed run's loggers continue the saved run's version."""
        strategy = self.strategy
        for logger in self.loggers:
            # Rank 0 picks the next free version_<n> (or the restored one); the
            # others adopt it so log_dir names the same folder on every rank.
            if hasattr(logger, "_version"):
                logger._version = strategy.broadcast(logger.version if strategy.is_global_zero else None)
            if strategy.is_global_zero and hasattr(logger, "log_hyperparams"):
                logger.log_hyperparams(dict(self.module.hparams))

    def _parse_optimizers(self, config: Any) -> Tuple[List[torch.optim.Optimizer], List[Dict[str, Any]]]:
        def scheduler_entry(s: Any) -> Dict[str, Any]:
            entry = dict(s) if isinstance(s, dict) else {"scheduler": s}
            entry.setdefault("interval", "epoch")
            entry.setdefault("frequency", 1)
            if entry["interval"] not in ("step", "epoch"):
                raise ValueError(f"lr_scheduler interval must be 'step' or 'epoch', got {entry['interval']!r}")
            return entry

        if config is None:
            raise ValueError("configure_optimizers() returned None; return an optimizer.")
        if isinstance(config, torch.optim.Optimizer):
            return [config], []
        if isinstance(config, dict):
            scheds = config.get("lr_scheduler")
            return [config["optimizer"]], ([scheduler_entry(scheds)] if scheds is not None else [])
        if isinstance(config, (list, tuple)):
            if len(config) == 2 and isinstance(config[0], (list, tuple)):
                return list(config[0]), [scheduler_entry(s) for s in config[1]]
            if all(isinstance(o, dict) for o in config):
                opts, scheds = [], []
                for c in config:
                    o, s = self._parse_optimizers(c)
                    opts += o
                    scheds += s
                return opts, scheds
            return list(config), []
        raise TypeError(
            f"configure_optimizers() returned {type(config).__name__}; return an optimizer, "
            "a dict {'optimizer', 'lr_scheduler'}, or ([optimizers], [schedulers])."
        )

    # ------------------------------------------------------------------- fit
    def fit(
        self,
        module: TrainModule,
        train_dataloaders: Optional[Iterable] = None,
        val_dataloaders: Optional[Iterable] = None,
        ckpt_path: Optional[str] = None,
        datamodule: Any = None,
    ) -> None:
        """Train. Data as in Lightning: loaders here, a `datamodule` (also as the second positional
        argument), or the module's own train_dataloader() / val_dataloader() methods."""
        if datamodule is None and _is_datamodule(train_dataloaders):
            train_dataloaders, datamodule = None, train_dataloaders  # fit(model, dm)
        if datamodule is not None and (train_dataloaders is not None or val_dataloaders is not None):
            raise ValueError(
                "fit() takes either dataloaders or a datamodule, not both: pass the loaders through "
                "the datamodule's train_dataloader() / val_dataloader()."
            )
        if datamodule is not None and not callable(getattr(datamodule, "train_dataloader", None)):
            raise TypeError(f"datamodule={type(datamodule).__name__} has no train_dataloader() method.")
        if train_dataloaders is None and datamodule is None and not callable(getattr(module, "train_dataloader", None)):
            raise TypeError(
                "fit() needs training data: fit(module, train_loader), fit(module, datamodule=dm), or a "
                f"train_dataloader() method on {type(module).__name__}."
            )
        self._data_sources = (train_dataloaders, val_dataloaders, datamodule)
        if self.device_memory is not None:  # before any worker starts (see shardwise/plan/advice.py)
            check_before_fit(self, module, train_dataloaders)
        # Before any worker starts: a strategy whose engine owns accumulation,
        # clipping and the micro-batch size (DeepSpeed) checks them against its
        # own configuration now, so a contradiction fails in the user's process.
        self.strategy.configure_training(
            accumulate_grad_batches=self.accumulate_grad_batches,
            gradient_clip_val=self.gradient_clip_val,
            gradient_clip_algorithm=self.gradient_clip_algorithm,
            micro_batch_size=getattr(self._data_sources[0], "batch_size", None),
        )  # the planner may re-batch
        self._launch_if_needed()
        previous_handlers = self._install_preemption()
        try:
            self._setup(module)
            train_dataloaders, val_dataloaders = self._resolved_data
            self.train_dataloader = self.strategy.setup_dataloader(train_dataloaders)
            self.val_dataloaders = (
                self.strategy.setup_dataloader(val_dataloaders, shuffle=False) if val_dataloaders is not None else None
            )
            if ckpt_path is not None:
                self._restore(ckpt_path)
            self._setup_loggers()
            self._call("on_fit_start")
            self._call("on_train_start")
            self._call_module("on_train_start")
            self._fit_loop()
            self._call_module("on_train_end")
            self._call("on_train_end")
            self._call("on_fit_end")
            for logger in self.loggers:
                if self.strategy.is_global_zero and hasattr(logger, "finalize"):
                    logger.finalize("success")
        except BaseException as exc:
            self._call("on_exception", exc)
            for logger in self.loggers:
                if self.strategy.is_global_zero and hasattr(logger, "finalize"):
                    logger.finalize("failed")
            raise
        finally:
            self._call("teardown", stage="fit")
            datamodule = self._data_sources[2]
            if datamodule is not None and callable(getattr(datamodule, "teardown", None)):
                datamodule.teardown("fit")
            for sig, handler in previous_handlers.items():
                signal.signal(sig, handler)
        if self.preempted is not None:
            saved = [getattr(cb, "last_model_path", "") for cb in self.callbacks if hasattr(cb, "last_model_path")]
            where = f"saved {saved[0]}" if saved and saved[0] else "no checkpoint (checkpointing is off)"
            preempt.exit_preempted(f"{self.preempted} at step {self.global_step}: {where}")

    def _install_preemption(self) -> Dict[int, Any]:
        """Turn the preemption signals into a flag the loop reads between optimizer steps."""
        if not self.preemption_signals or threading.current_thread() is not threading.main_thread():
            return {}
        previous = {sig: signal.getsignal(sig) for sig in self.preemption_signals}
        self._preempt_flag = preempt.install(self.preemption_signals)
        self._preempt_flag.signal = None  # a flag left from an earlier fit in this process
        self._preempt_flag.count = 0
        return previous

    def _preemption_requested(self) -> bool:
        """Whether any rank was signalled; all ranks agree, so they stop after the same step."""
        flag = self._preempt_flag
        if flag is None:
            return False
        requested, self._preemption_agreed = self._preemption_agreed, None
        if requested is None:  # no health check this step (non_finite="off"): agree here
            requested = flag.requested
            if self.world_size > 1:
                requested = bool(self.strategy.reduce(float(requested), "max").item())
        if requested and self.preempted is None:
            self.preempted = flag.signal_name or "a preemption signal (on another rank)"
        return requested

    def _restore(self, ckpt_path: str) -> None:
        load_training_checkpoint(self, ckpt_path)

    def save_checkpoint(self, path: str) -> str:
        """Save everything needed to resume, in the strategy's format; returns the path.

        Call it on every rank (it is collective). The checkpoint appears at
        `path` atomically, once every rank has written its part."""
        return save_training_checkpoint(self, path)

    def _done(self) -> bool:
        return self.should_stop or (self.max_steps != -1 and self.global_step >= self.max_steps)

    def _fit_loop(self) -> None:
        state = self.state
        loader = self.train_dataloader
        length = _length(loader)
        if length == 0:
            raise ValueError(
                f"The train DataLoader is empty: {_describe_empty(loader)} Nothing can be trained; "
                "check the dataset's path and filters, and the batch size against the dataset size."
            )
        self.num_training_batches = _limit(self.limit_train_batches, length)
        if self.num_training_batches == 0:
            raise ValueError(
                f"limit_train_batches={self.limit_train_batches!r} leaves none of the train "
                f"DataLoader's {int(length)} batches: raise it, or leave it None for all."
            )
        step_fn = self.module.training_step
        pass_idx = _takes_batch_idx(step_fn)
        if self._preemption_requested():  # signalled during set-up or a restore: no step has started
            self.should_stop = True
        while not self._done() and (self.max_epochs == -1 or state.epoch < self.max_epochs):
            sampler = getattr(loader, "sampler", None)
            if hasattr(sampler, "set_epoch"):
                sampler.set_epoch(state.epoch)
            if hasattr(sampler, "set_start_index"):
                # Mid-epoch resume: skip consumed batches by index, without loading them
                # (0 at a fresh epoch: the position is TrainState's, never the sampler's).
                sampler.set_start_index(state.batch_idx * (loader.batch_size or 1))
            self._call("on_train_epoch_start")
            self._call_module("on_train_epoch_start")
            self.model.train()
            started_at = state.batch_idx
            for batch in self._epoch_iterator(loader):
                if state.batch_idx >= self.num_training_batches or self._done():
                    break
                self._train_batch(batch, pass_idx)
            if started_at == 0 and state.batch_idx == 0 and not self._done():
                # A loader without a length that yields nothing would loop over empty epochs forever.
                raise ValueError(
                    f"The train DataLoader yielded no batch in epoch {state.epoch}: "
                    f"{_describe_empty(loader)} Check the dataset (an IterableDataset must yield "
                    "samples on every rank, every epoch)."
                )
            if self._done() and state.batch_idx < self.num_training_batches:
                break  # stopped mid-epoch by max_steps; the epoch is not over
            # End of epoch: a partial accumulation window still steps.
            state.in_epoch_end = True  # a checkpoint saved from here on resumes at the next epoch
            self._call_module("on_train_epoch_end")
            epoch_metrics = self.metrics.finish_epoch()
            self.log_metrics(epoch_metrics)
            self._step_schedulers("epoch")
            if (
                self.val_dataloaders is not None
                and self.val_check_interval is None
                and (state.epoch + 1) % self.check_val_every_n_epoch == 0
            ):
                self._run_validation()
            self._call("on_train_epoch_end")
            state.in_epoch_end = False
            state.epoch += 1
            state.batch_idx = 0
            if self._preemption_requested():
                # Signalled during epoch-end work: stop before the next epoch's first step.
                self.should_stop = True

    def _epoch_iterator(self, loader: Iterable) -> Any:
        """iter(loader), re-applying a checkpoint's RNG states at the point the saved run was at.

        A checkpoint captures the generators right after an optimizer step.
        Creating a DataLoader iterator draws a seed from torch's generator: the
        saved run drew it before a mid-epoch checkpoint and after an
        end-of-epoch one, so the resumed run restores after, respectively
        before, creating its iterator, and then draws the same numbers.
        """
        pending, self.state.pending_rng = self.state.pending_rng, None
        if pending is not None and self.state.batch_idx == 0:
            restore_rng_states(pending)
        iterator = iter(loader)
        if pending is not None and self.state.batch_idx > 0:
            restore_rng_states(pending)
        return iterator

    def _train_batch(self, batch: Any, pass_idx: bool) -> None:
        strategy, state, module = self.strategy, self.state, self.module
        batch_idx = state.batch_idx
        batch = move_to_device(batch, strategy.root_device)
        self._call("on_train_batch_start", batch, batch_idx)
        if self._call_module("on_train_batch_start", batch, batch_idx) == -1:
            self.should_stop = True  # Lightning's convention: -1 ends the epoch and the run
            return
        window = self.accumulate_grad_batches
        last_in_epoch = batch_idx + 1 >= self.num_training_batches
        self.is_last_microbatch = (batch_idx + 1) % window == 0 or last_in_epoch
        args = (batch, batch_idx) if pass_idx else (batch,)
        object.__setattr__(module, "_current_hook", "training_step")
        mark_progress("training_step", state.global_step)

        def before_backward(loss: torch.Tensor) -> None:
            if not loss.requires_grad:
                raise RuntimeError(
                    f"training_step returned a loss that does not require grad (step {state.global_step}, "
                    f"batch {batch_idx}): nothing can be trained from it. It was computed under "
                    "torch.no_grad() or from detached tensors, or every parameter has requires_grad=False. "
                    "Return the loss computed from the model's output; return None to skip a batch."
                )
            self._window_losses.append((batch_idx, loss.detach()))  # checked at the step, no sync here
            mark_progress("backward", state.global_step)

        # The step's core is shared with the memory planner's trace (step.py). Non-final
        # micro-batches skip what can wait (DDP's all-reduce; FSDP's replica all-reduce).
        output, _ = shared_step.forward_backward(
            strategy, self.model, args, window=window, last=self.is_last_microbatch, before_backward=before_backward
        )
        state.batch_idx += 1
        if self.is_last_microbatch:
            mark_progress("optimizer_step", state.global_step)
            self._optimizer_step()
        step_logs = self.metrics.record(module._drain_logs())
        if self.is_last_microbatch and (state.global_step % self.log_every_n_steps == 0 or state.global_step == 1):
            self.log_metrics({**step_logs, "epoch": float(state.epoch)})
        self._call_module("on_train_batch_end", output, batch, batch_idx)
        self._call("on_train_batch_end", output, batch, batch_idx)
        if self.val_dataloaders is not None and self._val_due(state.batch_idx):
            self._run_validation()
        if self.is_last_microbatch and self._preemption_requested():
            self.should_stop = True  # ModelCheckpoint saves this step in on_train_end

    def _optimizer_step(self) -> None:
        strategy = self.strategy
        losses, self._window_losses = self._window_losses, []

        def before_step(i: int, optimizer: torch.optim.Optimizer) -> bool:
            self._call("on_before_optimizer_step", optimizer)
            if i == 0 and self.non_finite != "off" and not self._healthy(losses):
                return self.non_finite != "skip"  # skip: every optimizer's gradients are dropped, no step
            return True

        # Clip, step and zero each optimizer: the same core the memory planner traces (step.py).
        shared_step.optimizer_update(
            strategy,
            self.model,
            strategy.optimizers,
            gradient_clip_val=self.gradient_clip_val,
            gradient_clip_algorithm=self.gradient_clip_algorithm,
            before_step=before_step,
        )
        self.state.global_step += 1
        self._step_schedulers("step")

    def _healthy(self, losses: List[Tuple[int, torch.Tensor]]) -> bool:
        """Whether this step's losses and gradients are finite on every rank; acts on non_finite if not."""
        flags = [~torch.isfinite(torch.stack([t.float().reshape(()) for _, t in losses])).any()] if losses else []
        # With fp16 loss scaling, inf gradients are the scaler's overflow signal (it skips the step
        # and lowers the scale): only the loss is this check's business then.
        scaled = getattr(self.strategy, "grad_scaler", None) is not None
        grad_flag = None if scaled else health.nonfinite_norm_flag([p.grad for p in self.strategy._grads(self.model)])
        if grad_flag is not None:
            flags.append(grad_flag.to(flags[0].device) if flags else grad_flag)
        # One read-back for the step: the verdict, agreed across ranks in the same all-reduce that
        # agrees on a preemption signal (_preemption_requested uses it instead of its own).
        local = torch.stack(flags).any().float() if flags else torch.zeros(())
        signalled = self._preempt_flag is not None and self._preempt_flag.requested
        both = torch.stack([local, torch.tensor(float(signalled), device=local.device)])
        if self.world_size > 1:
            both = self.strategy.reduce(both, "max")
        bad, self._preemption_agreed = (v > 0 for v in both.tolist())
        if not bad:
            return True
        step = self.global_step + 1
        found = health.first_nonfinite(self.model, [(i, float(t)) for i, t in losses])
        reports = ops.all_gather_object(found)
        named = [f"rank {r}: {what}" for r, what in enumerate(reports) if what]
        what = "; ".join(named) or "a non-finite value on another rank"
        if self.nonfinite_step is None:
            self.nonfinite_step = step
        if self.non_finite == "error":
            raise health.NonFiniteError(
                f"Non-finite values at optimizer step {step} (epoch {self.current_epoch}): {what}. The step was not "
                "taken and nothing after the last checkpoint was saved. Lower the learning rate, clip gradients "
                "(gradient_clip_val), check the data of that batch, or use bf16 instead of fp16; "
                "Trainer(non_finite='skip') skips such steps, 'warn' only reports them."
            )
        action = "skipped" if self.non_finite == "skip" else "taken anyway (non_finite='warn')"
        warnings.warn(f"Non-finite values at optimizer step {step}: {what}. The step was {action}.", stacklevel=2)
        return False

    def _step_schedulers(self, interval: str) -> None:
        counter = self.global_step if interval == "step" else self.current_epoch + 1
        for entry in self.strategy.lr_schedulers:
            if entry["interval"] == interval and counter % entry["frequency"] == 0:
                monitor = entry.get("monitor")
                if monitor is not None:
                    if monitor not in self.callback_metrics:
                        raise KeyError(
                            f"lr_scheduler monitors {monitor!r}, which was never logged. "
                            f"Logged: {sorted(self.callback_metrics)}"
                        )
                    entry["scheduler"].step(self.callback_metrics[monitor])
                else:
                    entry["scheduler"].step()

    def _val_due(self, batches_done: int) -> bool:
        interval = self.val_check_interval
        if interval is None:
            return False
        if not isinstance(interval, int) and not self.is_last_microbatch:
            return False  # a float interval validates only between optimizer steps, never mid-window
        if isinstance(interval, float) and interval <= 1.0:
            every = max(1, int(self.num_training_batches * interval))
        else:
            every = int(interval)  # every N training batches, as in Lightning
        return batches_done % every == 0

    # -------------------------------------------------------------- validation
    def validate(
        self,
        module: Optional[TrainModule] = None,
        dataloaders: Optional[Iterable] = None,
        ckpt_path: Optional[str] = None,
    ) -> List[Dict[str, float]]:
        """Run validation_step over `dataloaders` (or fit's); return the epoch metrics."""
        self._launch_if_needed()
        module = module or self.module
        if module is None:
            raise ValueError("validate() needs a module (or a previous fit()).")
        self._setup(module, need_train_data=False)
        if dataloaders is None and self.val_dataloaders is None:
            dataloaders = self._resolved_data[1]  # the module's or datamodule's val_dataloader()
        if dataloaders is not None:
            self.val_dataloaders = self.strategy.setup_dataloader(dataloaders, shuffle=False)
        if self.val_dataloaders is None:
            raise ValueError("validate() needs dataloaders (none were given here or to fit()).")
        if ckpt_path is not None:
            self._restore(ckpt_path)
        self._setup_loggers()
        return [self._run_validation()]

    @torch.no_grad()
    def _run_validation(self) -> Dict[str, float]:
        module, strategy = self.module, self.strategy
        if not callable(getattr(module, "validation_step", None)):
            return {}
        loader = self.val_dataloaders
        length = _length(loader)
        self.num_val_batches = _limit(self.limit_val_batches, length)
        if self.num_val_batches == 0:
            return {}
        self.validating = True
        # Validation draws from the generators too (its DataLoader's seed, user
        # code); run it on a copy so that training's random stream, and so a
        # resumed run, does not depend on when or how often validation runs.
        self.state.rng_outside_validation = capture_rng_states()
        was_training = self.model.training
        self.model.eval()
        # Validation epochs keep their own accumulators, apart from training's.
        train_epoch, self.metrics._epoch = self.metrics._epoch, {}
        self._call("on_validation_start")
        self._call_module("on_validation_epoch_start")
        pass_idx = _takes_batch_idx(module.validation_step)
        try:
            for batch_idx, batch in enumerate(loader):
                if batch_idx >= self.num_val_batches:
                    break
                batch = move_to_device(batch, strategy.root_device)
                object.__setattr__(module, "_current_hook", "validation_step")
                mark_progress("validation_step", self.state.global_step)
                with strategy.autocast():
                    args = (batch, batch_idx) if pass_idx else (batch,)
                    output = strategy.call(self.model, "validation_step", *args)
                self.metrics.record(module._drain_logs())
                self._call("on_validation_batch_end", output, batch, batch_idx)
            self._call_module("on_validation_epoch_end")
            self.metrics.record(module._drain_logs())
            results = self.metrics.finish_epoch(suffix=False)
            self.log_metrics(results)
            self._call("on_validation_epoch_end")
            self._call("on_validation_end")
        finally:
            self.metrics._epoch = train_epoch
            restore_rng_states(self.state.rng_outside_validation)
            self.state.rng_outside_validation = None
            self.validating = False
            self.model.train(was_training)
        return results

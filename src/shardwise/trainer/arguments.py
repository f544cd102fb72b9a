"""What the Trainer is given, checked before anything runs: its arguments and fit()'s data.

Every check names the argument, the value and the range it must be in, and
runs in the process the user started, before a worker is spawned or a weight
allocated. Lightning 1.x spellings the seeds' scripts still use
(`accelerator="ddp"`, `gpus=`, `plugins=`) are mapped onto today's arguments
here, with a warning that says the new spelling, so the loop only ever sees
one form.
"""

from __future__ import annotations

import math
import signal
import warnings
from typing import Any, List, Optional, Sequence, Tuple, Union

import torch

from shardwise.callbacks import ModelSummary
from shardwise.strategies import Strategy

MAX_EPOCHS_DEFAULT = 1000  # Lightning's default when neither max_epochs nor max_steps is set

# Lightning 1.x spelled the strategy as an accelerator ("ddp") or a plugin.
LEGACY_ACCELERATORS = {"ddp", "ddp_spawn", "ddp2", "dp", "fsdp", "deepspeed"}

NON_FINITE_MODES = ("error", "skip", "warn", "off")


def lightning_spellings(
    accelerator: Any, devices: Any, strategy: Any, gpus: Optional[int], plugins: Any
) -> Tuple[Any, Any, Any]:
    """Map the older Lightning arguments the seeds' scripts use onto ours; say so once each."""
    if accelerator == "gpu":
        accelerator = "cuda"
    if isinstance(accelerator, str) and accelerator in LEGACY_ACCELERATORS:
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


def is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def check_num_nodes(num_nodes: Any) -> int:
    if not isinstance(num_nodes, int) or num_nodes < 1:
        raise ValueError(f"num_nodes={num_nodes!r}: use a positive integer.")
    return num_nodes


def check_arguments(**args: Any) -> None:
    """Refuse impossible loop settings when the Trainer is built, naming the argument and its range."""

    def bad(name: str, allowed: str) -> None:
        raise ValueError(f"Trainer({name}={args[name]!r}): {allowed}.")

    if args["max_epochs"] is not None and (not is_int(args["max_epochs"]) or args["max_epochs"] < -1):
        bad("max_epochs", "use a non-negative integer, -1 for no limit, or None for the default")
    if not is_int(args["max_steps"]) or args["max_steps"] < -1:
        bad("max_steps", "use a non-negative integer, or -1 for no limit")
    if not is_int(args["accumulate_grad_batches"]) or args["accumulate_grad_batches"] < 1:
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
            or (is_int(value) and value < 0)
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
        or (is_int(interval) and interval < 1)
    ):
        bad(
            "val_check_interval",
            "use a fraction of the epoch in (0.0, 1.0], a number of batches (1 or more), "
            "or None to validate at epoch ends",
        )
    if not is_int(args["check_val_every_n_epoch"]) or args["check_val_every_n_epoch"] < 1:
        bad("check_val_every_n_epoch", "use a whole number of epochs, 1 or more")
    if not is_int(args["log_every_n_steps"]) or args["log_every_n_steps"] < 1:
        bad("log_every_n_steps", "use a whole number of steps, 1 or more")
    if args["gradient_clip_algorithm"] not in ("norm", "value"):
        raise ValueError(f"gradient_clip_algorithm={args['gradient_clip_algorithm']!r}: use 'norm' or 'value'.")


def signal_numbers(names: Optional[Sequence[Union[str, int]]]) -> List[int]:
    """preemption_signals=("SIGTERM", ...) -> signal numbers, refusing a name that is not a signal."""
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


def check_non_finite(non_finite: str, strategy: Strategy) -> str:
    """non_finite='error' | 'skip' | 'warn' | 'off', and whether this strategy can honour it."""
    if non_finite not in NON_FINITE_MODES:
        raise ValueError(
            f"non_finite={non_finite!r}: use 'error' (stop, the default), 'skip' (drop the step), "
            "'warn' (report and continue) or 'off'."
        )
    if non_finite == "skip" and not strategy.can_skip_step:
        raise ValueError(
            f"non_finite='skip' is not available with {type(strategy).__name__.replace('Strategy', '')}: its "
            "engine takes every step. Use 'error' or 'warn', or fp16 precision, whose loss scaling skips "
            "overflowing steps."
        )
    return non_finite


def lightning_extras(
    benchmark: Optional[bool],
    deterministic: bool,
    inference_mode: bool,
    use_distributed_sampler: bool,
    profiler: Any,
    barebones: bool,
    reload_dataloaders_every_n_epochs: int,
    enable_autolog_hparams: bool,
    model_registry: Optional[str],
) -> bool:
    """Lightning's Trainer arguments shardwise has no loop option for: their defaults (what a saved
    Lightning config spells out) change nothing; benchmark is applied; inference_mode either way gives the
    same numbers; the others are refused naming what to use. Returns enable_autolog_hparams."""
    if benchmark and deterministic:
        raise ValueError(
            "Trainer(benchmark=True, deterministic=True): cuDNN's autotuner picks kernels by timing, which is "
            "not deterministic; drop one."
        )
    if benchmark is not None or deterministic:  # as Lightning: None keeps torch's setting unless deterministic
        torch.backends.cudnn.benchmark = bool(benchmark)
    if not isinstance(inference_mode, bool):
        raise ValueError(f"Trainer(inference_mode={inference_mode!r}): use True or False.")
    refusals = [
        ("use_distributed_sampler", use_distributed_sampler, use_distributed_sampler is not True,
         "the training loader's sampler is replaced by a distributed, resumable one unless it is already a "
         "DistributedSampler or a custom sampler, which are kept: set yours on the DataLoader"),
        ("profiler", profiler, profiler is not None,
         "use Trainer(profile_steps=(first, last)) for torch.profiler traces of those optimizer steps"),
        ("barebones", barebones, bool(barebones),
         "turn the extras off one by one: logger=False, enable_progress_bar=False, enable_checkpointing=False, "
         "throughput=False"),
        ("reload_dataloaders_every_n_epochs", reload_dataloaders_every_n_epochs, reload_dataloaders_every_n_epochs != 0,
         "the loaders are built once per fit; vary the data inside the dataset, by the epoch the sampler's "
         "set_epoch or trainer.current_epoch gives"),
        ("model_registry", model_registry, model_registry is not None,
         "shardwise uploads nothing at the end of fit; push the exported folder yourself"),
    ]  # fmt: skip
    for name, value, refused, instead in refusals:
        if refused:
            raise ValueError(f"Trainer({name}={value!r}) is not supported: {instead}.")
    return bool(enable_autolog_hparams)


def lightning_callbacks(callbacks: Any, enable_model_summary: Optional[bool]) -> List[Any]:
    """Trainer(callbacks=...) as Lightning takes it (a list, or one callback object), with a ModelSummary
    added for enable_model_summary=True and removed for False (None, the default here: as given)."""
    if callbacks is None:
        callbacks = []
    elif not isinstance(callbacks, (list, tuple)):
        if isinstance(callbacks, (str, bytes, dict)) or isinstance(callbacks, type):
            raise TypeError(
                f"Trainer(callbacks={callbacks!r}): pass a callback object or a list of them "
                "(an instance such as EarlyStopping(monitor='val_loss'), not a class or a name)."
            )
        callbacks = [callbacks]
    callbacks = list(callbacks)
    if enable_model_summary not in (None, True, False):
        raise ValueError(f"Trainer(enable_model_summary={enable_model_summary!r}): use True, False or None.")
    if enable_model_summary is False:
        callbacks = [c for c in callbacks if not isinstance(c, ModelSummary)]
    elif enable_model_summary and not any(isinstance(c, ModelSummary) for c in callbacks):
        callbacks.append(ModelSummary())
    return callbacks


def check_eval_data(stage: str, dataloaders: Any, datamodule: Any) -> Tuple[Any, Any]:
    """validate()'s data as Lightning takes it: loaders, `datamodule=`, or a datamodule in the loaders' place."""
    if datamodule is None and is_datamodule(dataloaders):
        dataloaders, datamodule = None, dataloaders  # trainer.validate(model, dm)
    if dataloaders is not None and datamodule is not None:
        raise ValueError(f"{stage}() takes either dataloaders or a datamodule, not both.")
    return dataloaders, datamodule


def is_datamodule(obj: Any) -> bool:
    """A LightningDataModule-style object: it makes loaders, it is not one."""
    return obj is not None and callable(getattr(obj, "train_dataloader", None)) and not hasattr(obj, "__iter__")


def check_fit_data(module: Any, train_dataloaders: Any, val_dataloaders: Any, datamodule: Any) -> Tuple[Any, Any]:
    """fit()'s data arguments as Lightning takes them; returns (train_dataloaders, datamodule).

    A datamodule may come as the second positional argument (`fit(model, dm)`).
    """
    if datamodule is None and is_datamodule(train_dataloaders):
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
    return train_dataloaders, datamodule


COMPILED_METHODS = ("forward", "training_step", "validation_step", "test_step", "predict_step")


def unwrap_compiled(module: Any) -> Any:
    """`torch.compile(module)` -> the TrainModule inside, its forward and steps compiled, as Lightning takes it.

    torch.compile returns an OptimizedModule wrapping the module; the Trainer needs the TrainModule itself
    (its hooks, its parameters to shard), so it takes the original back and compiles the methods the loop
    runs with the same compiler settings (the wrapper's dynamo context), which is what Lightning does.
    """
    original = getattr(module, "_orig_mod", None)
    context = getattr(module, "dynamo_ctx", None)
    if original is None or context is None:
        return module
    for name in COMPILED_METHODS:
        fn = getattr(original, name, None)
        if callable(fn) and not hasattr(fn, "_torchdynamo_orig_callable"):  # not compiled twice
            setattr(original, name, context(fn))
    return original

"""Set-up, in the order the Trainer runs it: launch, build the model, its optimizers, loggers.

- `launch_if_needed`: with devices > 1 and no launcher, this process becomes
  the supervisor of one worker per device (it never returns); under a
  launcher, the launcher's world must be the one the Trainer was given.
- `build_model`: configure_model under the strategy's init context (the meta
  device for FSDP / ZeRO-3), then the strategy wraps, shards and materialises
  it. A module trained by another Trainer, a custom init the meta device
  would discard, or rebuilt layers are refused here, each with its fix.
- `parse_optimizers`: configure_optimizers' return, in any of Lightning's
  shapes, as (optimizers, scheduler entries), built on the wrapped parameters.
- `default_callbacks` / `build_loggers` / `setup_loggers`: the progress bar,
  checkpointing, throughput monitor, profiler (when asked), out-of-memory
  report and CSV logger a Trainer has unless told otherwise, and one
  log version agreed by every rank.
"""

from __future__ import annotations

import dataclasses
import os
import sys
from typing import Any, Callable, Dict, List, Optional, Tuple

import torch
from torch import nn
from torch.distributed.tensor import DTensor

from shardwise import flops
from shardwise.adapters.lora import full_numel
from shardwise.callbacks import ModelCheckpoint, RichProgressBar
from shardwise.callbacks.profiling import OutOfMemoryReport, ProfileSteps, check_profile_steps
from shardwise.callbacks.throughput import ThroughputMonitor
from shardwise.distributed import context
from shardwise.distributed.env import detect_env, is_global_zero
from shardwise.distributed.launch import launch_script
from shardwise.loggers import build_default_logger
from shardwise.module import attached_trainer
from shardwise.strategies.materialize import watch_meta_writes
from shardwise.trainer.hooks import is_plateau


def launch_if_needed(devices: int, num_nodes: int, plan_choice: Optional[Dict[str, Any]] = None) -> None:
    """Become the supervisor of `devices` workers, or check the launcher's world.

    plan_choice: the memory planner's choice for strategy='auto', passed to the workers in
    their launch context so that they apply it instead of planning again.
    """
    world = devices * num_nodes
    env = detect_env()
    if env is None:
        if world == 1:
            return
        if num_nodes > 1:
            raise RuntimeError(
                f"num_nodes={num_nodes} needs one launcher per node: run `shardwise launch --nnodes "
                f"{num_nodes} --node-rank <i> --nproc-per-node {devices} ...`, torchrun, or srun."
            )
        if "pytest" in sys.modules or "ipykernel" in sys.modules:
            raise RuntimeError(
                "Trainer(devices>1) re-runs the program in each worker, which is not possible from a "
                "test runner or notebook. Wrap the training in a function and run it with "
                "`shardwise.launch(fn, devices=N)`."
            )
        launch = context.current().replace(plan_choice=plan_choice) if plan_choice is not None else None
        launch_script(devices, context=launch)  # never returns: the workers run the script
    if env.world_size != world:
        raise RuntimeError(
            f"The launcher started {env.world_size} processes but Trainer(devices={devices}, "
            f"num_nodes={num_nodes}) expects {world}. Make them agree (devices='auto' follows the launcher)."
        )


def check_refit(module: Any, trainer: Any) -> set:
    """A module trained by another Trainer: the ids of its trained parameters, or an error if it is sharded."""
    previous = attached_trainer(module)
    if previous is None or previous is trainer:
        return set()
    params = list(module.parameters())
    if previous.strategy.is_sharded or any(isinstance(p, DTensor) for p in params):
        raise RuntimeError(
            f"This {type(module).__name__} was already set up and trained by another Trainer's "
            f"{type(previous.strategy).__name__}: its parameters are sharded for that run's process group. "
            "To train further, call fit() again on the same Trainer (it continues from the trained weights, "
            "with a larger max_steps / max_epochs), or save a checkpoint and fit a fresh module with "
            "ckpt_path=..."
        )
    return {id(p) for p in params if not p.is_meta}


def build_model(strategy: Any, module: Any, configure_model: Callable[[], Any], trained: set) -> nn.Module:
    """1. configure_model under the strategy's init context (meta device), 2. the strategy wraps,
    shards and materialises it. Returns the wrapped model; `trained` are the ids of parameters
    an earlier fit trained (check_refit), which configure_model must not replace."""
    with strategy.module_init_context(), watch_meta_writes() as writes:
        try:
            configure_model()
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
    model = strategy.setup_module(module)
    params = list(module.parameters())
    if not any(p.requires_grad for p in params):
        raise ValueError(
            f"{type(module).__name__} has no trainable parameters after configure_model()"
            + (
                f": the trainable parameter count is 0 of {sum(full_numel(p) for p in params):,} "
                "(every parameter has requires_grad=False; with adapters: the LoRA target modules matched "
                "nothing, or the adapter was loaded for inference, is_trainable=False)."
                if params
                else ": no layer was registered. Assign layers to attributes of the module (self.model = ...), "
                "in __init__ or configure_model; layers kept in plain lists or dicts are not registered "
                "(use nn.ModuleList / nn.ModuleDict)."
            )
        )
    return model


def parse_optimizers(config: Any) -> Tuple[List[torch.optim.Optimizer], List[Dict[str, Any]]]:
    """configure_optimizers' return -> (optimizers, scheduler entries with interval and frequency)."""

    def scheduler_entry(s: Any, monitor: Optional[str] = None) -> Dict[str, Any]:
        entry = dict(s) if isinstance(s, dict) else {"scheduler": s}
        if monitor is not None:  # Lightning's {"optimizer": ..., "lr_scheduler": s, "monitor": "val_loss"}
            entry.setdefault("monitor", monitor)
        entry.setdefault("interval", "epoch")
        entry.setdefault("frequency", 1)
        if entry["interval"] not in ("step", "epoch"):
            raise ValueError(f"lr_scheduler interval must be 'step' or 'epoch', got {entry['interval']!r}")
        if is_plateau(entry) and not entry.get("monitor"):
            raise ValueError(
                f"{type(entry['scheduler']).__name__} steps on a metric, so it needs one to monitor: return "
                '{"optimizer": opt, "lr_scheduler": {"scheduler": sched, "monitor": "val_loss"}}.'
            )
        return entry

    if config is None:
        raise ValueError("configure_optimizers() returned None; return an optimizer.")
    if isinstance(config, torch.optim.Optimizer):
        return [config], []
    if isinstance(config, dict):
        scheds = config.get("lr_scheduler")
        return [config["optimizer"]], ([scheduler_entry(scheds, config.get("monitor"))] if scheds is not None else [])
    if isinstance(config, (list, tuple)):
        if len(config) == 2 and isinstance(config[0], (list, tuple)):
            return list(config[0]), [scheduler_entry(s) for s in config[1]]
        if all(isinstance(o, dict) for o in config):
            opts, scheds = [], []
            for c in config:
                o, s = parse_optimizers(c)
                opts += o
                scheds += s
            return opts, scheds
        return list(config), []
    raise TypeError(
        f"configure_optimizers() returned {type(config).__name__}; return an optimizer, "
        "a dict {'optimizer', 'lr_scheduler'}, or ([optimizers], [schedulers])."
    )


def default_callbacks(
    callbacks: Optional[List[Any]],
    progress: bool,
    checkpointing: bool,
    throughput: Any = True,
    peak: Any = None,
    profile_steps: Any = None,
) -> List[Any]:
    """The user's callbacks plus a progress bar and ModelCheckpoint unless they have one or turned it off; a
    ThroughputMonitor (before the bar, which shows what it measured) unless throughput=False or the user has
    one; ProfileSteps when profile_steps is given; the out-of-memory report always."""
    callbacks = list(callbacks or [])
    if not isinstance(throughput, bool):
        raise ValueError(f"Trainer(throughput={throughput!r}): use True (tokens/s, TFLOP/s, MFU) or False.")
    if not throughput and peak is not None:
        raise ValueError(
            f"Trainer(peak_tflops={peak!r}) is the peak MFU is measured against, and throughput=False turns the "
            "measurement off: drop one of them."
        )
    mine = [c for c in callbacks if isinstance(c, ThroughputMonitor)]
    if throughput and not mine:
        callbacks.append(ThroughputMonitor(flops.check_peak(peak)))
    elif peak is not None and any(c.peak_tflops not in (None, peak) for c in mine):
        raise ValueError(f"Trainer(peak_tflops={peak!r}) contradicts the ThroughputMonitor's peak_tflops: give one.")
    for monitor in mine:
        monitor.peak_tflops = monitor.peak_tflops if peak is None else flops.check_peak(peak)
    if profile_steps is not None:
        callbacks.append(ProfileSteps(*check_profile_steps(profile_steps)))
    callbacks.append(OutOfMemoryReport())
    if progress and not any(hasattr(c, "is_progress_bar") for c in callbacks):
        callbacks.append(RichProgressBar())
    if checkpointing and not any(isinstance(c, ModelCheckpoint) for c in callbacks):
        callbacks.append(ModelCheckpoint())
    return callbacks


def build_loggers(logger: Any, default_root_dir: str) -> List[Any]:
    """Trainer(logger=True | False | None | a logger | [loggers]) -> the list of loggers."""
    if logger is True:
        return [build_default_logger(default_root_dir)]  # TensorBoard if installed, else CSV
    if logger in (False, None):
        return []
    return list(logger) if isinstance(logger, (list, tuple)) else [logger]


def setup_loggers(loggers: List[Any], strategy: Any, hparams: Dict[str, Any]) -> None:
    """After any restore: a resumed run's loggers continue the saved run's version."""
    for logger in loggers:
        # Rank 0 picks the next free version_<n> (or the restored one); the
        # others adopt it so log_dir names the same folder on every rank
        # (loggers whose version can be set: VersionedLogDir's do).
        version = getattr(type(logger), "version", None)
        if isinstance(version, property) and version.fset is not None:
            logger.version = strategy.broadcast(logger.version if strategy.is_global_zero else None)
        if strategy.is_global_zero and hasattr(logger, "log_hyperparams"):
            logger.log_hyperparams(dict(hparams))
        if strategy.is_global_zero and hasattr(logger, "log_run_config"):  # the trackers (W&B, MLflow)
            logger.log_run_config(run_config(strategy))


def run_config(strategy: Any) -> Dict[str, Any]:
    """The resolved configuration a tracker records beside the hyper-parameters: the strategy's label, the
    world size, the mesh degrees it resolved to, and every field of its ParallelPlan."""
    plan = strategy.parallel_plan
    fields = {f.name: getattr(plan, f.name) for f in dataclasses.fields(plan)}
    blocks = fields.get("blocks")
    if blocks is not None:  # classes by name (a tracker shows text)
        fields["blocks"] = sorted(getattr(b, "__name__", str(b)) for b in blocks)
    config: Dict[str, Any] = {"strategy": plan.label, "world_size": strategy.world_size, "plan": fields}
    try:
        config["mesh"] = dataclasses.asdict(plan.mesh(strategy.world_size, getattr(strategy, "num_nodes", 1)))
    except ValueError:
        pass  # a plan the world cannot be laid out for has failed set-up long before; nothing to add
    return config


def finalize_loggers(loggers: List[Any], strategy: Any, status: str) -> None:
    """On global rank 0: tell every logger the run ended ("success" or "failed")."""
    for logger in loggers:
        if strategy.is_global_zero and hasattr(logger, "finalize"):
            logger.finalize(status)


def checkpoint_search_dirs(trainer: Any) -> List[str]:
    """Where fit(ckpt_path="last") looks: the checkpoint callbacks' directories, then the default one."""
    dirs = [cb.resolve_dirpath(trainer) for cb in trainer.callbacks if hasattr(cb, "resolve_dirpath")]
    return dirs + [os.path.join(trainer.default_root_dir, "checkpoints")]


def configure_training(trainer: Any, micro_batch_size: Optional[int]) -> None:
    """A strategy whose engine owns accumulation, clipping and the micro-batch size (DeepSpeed) takes them."""
    trainer.strategy.configure_training(
        accumulate_grad_batches=trainer.accumulate_grad_batches,
        gradient_clip_val=trainer.gradient_clip_val,
        gradient_clip_algorithm=trainer.gradient_clip_algorithm,
        micro_batch_size=micro_batch_size,
    )


def apply_plan(trainer: Any, decision: Any, train_loader: Any) -> Tuple[Any, Optional[Dict[str, Any]]]:
    """Take the memory planner's decision (plan/advice.FitDecision): its strategy and accumulation on the
    Trainer, its re-batched loader returned. Also returns the choice the workers apply instead of
    planning again (None: no choice)."""
    if decision is None:
        return train_loader, None
    if decision.strategy is not None:
        decision.strategy.configure_compile(trainer.strategy.compile_options)  # Trainer(compile=) carries over
        trainer.strategy = decision.strategy
    if decision.accumulate_grad_batches is not None:
        trainer.accumulate_grad_batches = decision.accumulate_grad_batches
    if decision.message and is_global_zero():
        print(decision.message)
    if getattr(decision, "check", None) is not None:  # the plan checked against this run (plan/runcheck.py)
        trainer.callbacks.append(decision.check)
    loader = decision.train_dataloader if decision.train_dataloader is not None else train_loader
    return loader, decision.plan_choice

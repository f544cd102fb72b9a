"""TrainModule: the one class a user writes.

The hooks are the ones Lightning users know (configure_model,
configure_optimizers, training_step, validation_step, on_* hooks, self.log).
The module holds no trainer internals: `self.trainer` is a reference set
while a Trainer runs it, and `self.log` only appends to a buffer that the
Trainer drains after each step (reducing across ranks when asked). What the
Trainer does to a module goes through the functions at the end of this file
(`attach`, `attached_trainer`, `enter_hook`, `drain_logs`), not through
members a user's subclass could collide with.

Optional hook `init_weights(self)`: when defined, it replaces the default
initialisation after the model is materialised from the meta device (see
strategies/materialize.py). Define it when your layers need an init scheme
their own `reset_parameters` does not express.

Optional hook `loss_weight(self, batch) -> int | Tensor`: when defined,
`training_step` returns a SUMMED loss (e.g. cross-entropy with
reduction="sum" over the target tokens) and `loss_weight` says how many items
that sum covers (e.g. `(labels != -100).sum()`), for the batch as the loader
yields it. The Trainer then divides by the step's global weight -- the sum of
`loss_weight` over every micro-batch of the optimizer step on every rank --
so the gradient is that of the mean over the whole global batch, the same
for any batch size, accumulation and number of ranks (trainer/weighting.py;
the Trainer logs that mean as "train_loss"). Without it the loss is a mean and
each micro-batch's mean counts the same, as in Lightning.
"""

from __future__ import annotations

import functools
import inspect
from dataclasses import dataclass
from typing import Any, Dict, List, Optional

import torch
import torch.distributed as dist
from torch import nn
from torch.utils.data import DataLoader, IterableDataset

from shardwise.metrics import is_metric, metric_step_value
from shardwise.module_hooks import EPOCH_ONLY_HOOKS, LOG_LEVELS, ModuleHooks
from shardwise.module_weights import load_from_checkpoint, record_hyperparameters
from shardwise.utilities import AttributeDict


@dataclass
class LoggedValue:
    name: str
    value: torch.Tensor
    prog_bar: bool
    on_step: bool
    on_epoch: bool
    sync_dist: bool
    reduce_fx: str
    batch_size: Optional[int]
    logger: bool = True  # False: callback_metrics and the progress bar only, never the loggers
    metric: Any = None  # a torchmetrics Metric: value is its last forward's; the epoch value is its compute()


class TrainModule(ModuleHooks, nn.Module):
    """Base class for training code: subclass it and implement training_step."""

    #: False: training_step runs backward and steps the optimizers itself (Lightning's manual
    #: optimization: self.optimizers(), self.manual_backward(loss), opt.step(), opt.zero_grad()).
    automatic_optimization: bool = True

    def __init__(self) -> None:
        super().__init__()
        object.__setattr__(self, "_trainer", None)
        object.__setattr__(self, "_log_buffer", [])
        object.__setattr__(self, "_current_hook", "training_step")
        object.__setattr__(self, "hparams", AttributeDict())
        object.__setattr__(self, "_log_hyperparams", True)

    # ----------------------------------------------------------- user hooks
    def configure_model(self) -> None:
        """Build large layers here: it runs on the meta device under FSDP / ZeRO-3. Keep it idempotent."""

    def configure_optimizers(self) -> Any:
        """Return an optimizer; or (optimizers, schedulers); or a dict with "optimizer" and "lr_scheduler"."""
        raise NotImplementedError(f"{type(self).__name__} must implement configure_optimizers()")

    def training_step(self, batch: Any, batch_idx: int) -> Any:
        raise NotImplementedError(f"{type(self).__name__} must implement training_step(batch[, batch_idx])")

    # validation_step is looked up with getattr: defining it enables validation.
    # So is loss_weight(batch) (see the module docstring): defining it makes training_step's loss a sum.

    # Every other Lightning hook (setup, on_fit_start, on_before_optimizer_step, optimizer_step, ...)
    # has Lightning's default in ModuleHooks (module_hooks.py); trainer/lightning_hooks.py says when each runs.

    # ------------------------------------------------------------ accessors
    @property
    def trainer(self) -> Any:
        if self._trainer is None:
            raise RuntimeError(
                f"{type(self).__name__} is not attached to a Trainer yet (call trainer.fit(module, ...))."
            )
        return self._trainer

    @property
    def global_step(self) -> int:
        return self.trainer.global_step

    @property
    def current_epoch(self) -> int:
        return self.trainer.current_epoch

    @property
    def device(self) -> torch.device:
        for tensor in self.parameters():
            return tensor.device
        return torch.device("cpu")

    @property
    def global_rank(self) -> int:
        """This process's rank among all processes (0 without a Trainer, as in Lightning)."""
        return self._trainer.global_rank if self._trainer is not None else 0

    @property
    def local_rank(self) -> int:
        """This process's rank on its node (0 without a Trainer)."""
        return self._trainer.local_rank if self._trainer is not None else 0

    @property
    def on_gpu(self) -> bool:
        return self.device.type == "cuda"

    @property
    def logger(self) -> Any:
        """The Trainer's first logger (None without one), to write to it directly: `self.logger.experiment`."""
        return self._trainer.logger if self._trainer is not None else None

    @property
    def loggers(self) -> List[Any]:
        return list(self._trainer.loggers) if self._trainer is not None else []

    def all_gather(self, data: Any, group: Any = None, sync_grads: bool = False) -> Any:
        """Every rank's `data` (a tensor, a number, or lists / tuples / dicts of them), stacked along a new
        first dimension of size world_size; unchanged on one process, as in Lightning. Collective: call it
        on every rank. sync_grads=True lets gradients flow back through the gather."""
        if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size(group) == 1:
            return data
        return _gather_collection(data, group, sync_grads, self.device)

    # ------------------------------------------------------------ weights
    @classmethod
    def load_from_checkpoint(
        cls,
        checkpoint_path: str,
        map_location: Any = None,
        hparams_file: Optional[str] = None,
        strict: bool = True,
        **kwargs: Any,
    ) -> Any:
        """A module built from the checkpoint's hyperparameters (`kwargs` override them) with its weights,
        on the CPU (or `map_location`); full, sharded and DeepSpeed checkpoints (module_weights.py)."""
        if hparams_file is not None:
            raise TypeError(
                "load_from_checkpoint(hparams_file=...) is not supported: the hyperparameters are read from the "
                "checkpoint; pass the ones to change as keyword arguments."
            )
        return load_from_checkpoint(cls, checkpoint_path, map_location, strict, **kwargs)

    def gathered(self) -> Any:
        """`with module.gathered(): module.model(x)`: after fit under FSDP (or ZeRO-3), every parameter
        whole on every rank for the block, so any submodule can be called directly. Collective: enter it
        on every rank. A no-op where parameters are not sharded."""
        return self.trainer.strategy.gathered(self.trainer.model)

    # ---------------------------------------------------- optimizers (trainer/manual.py)
    def optimizers(self, use_pl_optimizer: bool = True) -> Any:
        """The optimizer (or the list of them) configure_optimizers returned; its step() and zero_grad()
        go through the Trainer's strategy (use_pl_optimizer=False: the bare torch optimizers)."""
        return self.trainer.optimization.optimizers(use_pl_optimizer)

    def lr_schedulers(self) -> Any:
        """The LR scheduler (or the list of them), None without one. Manual optimization steps them itself."""
        return self.trainer.optimization.lr_schedulers()

    def manual_backward(self, loss: torch.Tensor, *args: Any, **kwargs: Any) -> None:
        """Manual optimization's loss.backward(): through the strategy (loss scaling, sharded gradients)."""
        if args:
            raise TypeError(
                "manual_backward(loss, **kwargs): pass torch's backward options by name (retain_graph=...)."
            )
        self.trainer.optimization.backward(loss, **kwargs)

    def clip_gradients(
        self, optimizer: Any, gradient_clip_val: Optional[float] = None, gradient_clip_algorithm: Optional[str] = None
    ) -> Any:
        """Clip the gradients `optimizer` steps, across shards ("norm", the default, or "value")."""
        return self.trainer.optimization.clip_gradients(optimizer, gradient_clip_val, gradient_clip_algorithm)

    def toggle_optimizer(self, optimizer: Any) -> None:
        """Until untoggle_optimizer, only `optimizer`'s parameters require grad (a GAN's alternating steps)."""
        self.trainer.optimization.toggle(optimizer)

    def untoggle_optimizer(self, optimizer: Any) -> None:
        self.trainer.optimization.untoggle(optimizer)

    def toggled_optimizer(self, optimizer: Any) -> Any:
        """`with self.toggled_optimizer(opt): ...`: toggle_optimizer for the block."""
        return self.trainer.optimization.toggled(optimizer)

    def print(self, *args: Any, **kwargs: Any) -> None:
        self.trainer.print(*args, **kwargs)

    def freeze(self) -> None:
        """No parameter requires grad, and eval mode (inference with a trained module, as Lightning's)."""
        for param in self.parameters():
            param.requires_grad = False
        self.eval()

    def unfreeze(self) -> None:
        """Every parameter requires grad again, and train mode."""
        for param in self.parameters():
            param.requires_grad = True
        self.train()

    def save_hyperparameters(
        self, *args: Any, ignore: Any = None, frame: Any = None, logger: bool = True, **values: Any
    ) -> None:
        """Record hyperparameters in `self.hparams`, saved in checkpoints (load_from_checkpoint rebuilds
        the module with them) and sent to the loggers unless logger=False. Lightning's signature: no
        arguments: every __init__ argument; names ("lr", "layers"): those arguments; one dict or
        argparse Namespace: its items; ignore: a name or list of names to leave out. Keyword arguments
        (shardwise's older form) are recorded as given."""
        record_hyperparameters(self, args, ignore, frame, values)
        object.__setattr__(self, "_log_hyperparams", bool(logger))

    # -------------------------------------------------------------- logging
    def log(
        self,
        name: str,
        value: Any,
        prog_bar: bool = False,
        on_step: Optional[bool] = None,
        on_epoch: Optional[bool] = None,
        sync_dist: bool = False,
        reduce_fx: str = "mean",
        batch_size: Optional[int] = None,
        logger: bool = True,
        rank_zero_only: bool = False,
    ) -> None:
        """Record a metric. Defaults as in Lightning: per step in training, per epoch in validation.

        logger=False keeps the value from the loggers; callbacks (callback_metrics) and the progress
        bar (prog_bar=True) still get it. The hook that runs decides the defaults (module_hooks.LOG_LEVELS).
        rank_zero_only=True: logged from global rank 0 alone, so never reduced across ranks (a
        collective only one rank joins would wait forever); as in Lightning, do not monitor it.
        """
        if rank_zero_only:
            sync_dist = False
        hook = self._current_hook
        if hook in LOG_LEVELS:
            levels = LOG_LEVELS[hook]
            if levels is None:
                raise RuntimeError(
                    f"self.log({name!r}) inside {hook}: nothing receives a value logged there (no training "
                    "step or epoch is open), as in Lightning. Log from training_step, validation_step or an "
                    "on_*_epoch_end / on_*_batch_end hook, or write to the logger directly (self.logger)."
                )
            if on_step and hook in EPOCH_ONLY_HOOKS:
                raise ValueError(f"self.log({name!r}, on_step=True) inside {hook}, which runs once per epoch.")
        else:  # a hook Lightning does not log from: by its name, training per step, the rest per epoch
            in_training = hook.startswith("train") or hook.startswith("on_train")
            levels = (in_training, not in_training)
        on_step = levels[0] if on_step is None else on_step
        on_epoch = levels[1] if on_epoch is None else on_epoch
        if reduce_fx not in ("mean", "sum", "max", "min"):
            raise ValueError(f"log({name!r}): reduce_fx must be mean, sum, max or min, got {reduce_fx!r}")
        metric = None
        if is_metric(value):  # Lightning: its last forward's batch value per step, its own compute() per epoch
            metric, value = value, metric_step_value(name, value)
        if isinstance(value, torch.Tensor):
            if value.numel() != 1:
                raise ValueError(f"log({name!r}) needs a scalar; got a tensor of shape {tuple(value.shape)}")
            value = value.detach().float().reshape(())
        elif metric is None:
            value = torch.tensor(float(value))
        self._log_buffer.append(
            LoggedValue(name, value, prog_bar, on_step, on_epoch, sync_dist, reduce_fx, batch_size, logger, metric)
        )

    def log_dict(self, metrics: Dict[str, Any], **kwargs: Any) -> None:
        for name, value in metrics.items():
            self.log(name, value, **kwargs)


class DataModule:
    """Data in one place, as Lightning's LightningDataModule: `trainer.fit(module, datamodule=dm)`.

    prepare_data() runs once per node before any rank reads what it prepares
    (downloads, tokenisation to disk); setup(stage) on every rank; then the
    loaders. Any object with these methods works: subclassing is optional.
    `self.trainer` is set before prepare_data (so setup can divide a global
    batch by `self.trainer.world_size`); `save_hyperparameters()` records
    __init__'s arguments in `self.hparams`; `state_dict()` is saved in
    checkpoints and given back to `load_state_dict()` on resume.
    """

    prepare_data_per_node: bool = True
    trainer: Any = None  # also for a subclass whose __init__ does not call super().__init__()

    def __init__(self) -> None:
        self.trainer = None

    @property
    def hparams(self) -> AttributeDict:
        if "_hparams" not in self.__dict__:
            self._hparams = AttributeDict()
        return self._hparams

    def save_hyperparameters(
        self, *args: Any, ignore: Any = None, frame: Any = None, logger: bool = True, **values: Any
    ) -> None:
        """As TrainModule.save_hyperparameters: __init__'s arguments (or the names, dict or Namespace given)."""
        record_hyperparameters(self, args, ignore, frame, values)
        self._log_hyperparams = bool(logger)

    @classmethod
    def from_datasets(
        cls,
        train_dataset: Any = None,
        val_dataset: Any = None,
        test_dataset: Any = None,
        predict_dataset: Any = None,
        batch_size: int = 1,
        num_workers: int = 0,
        **datamodule_kwargs: Any,
    ) -> "DataModule":
        """A datamodule whose loaders read these datasets (a dataset, or a list / dict of them), the training
        one shuffled, as Lightning's; batch_size and num_workers also reach __init__ where it takes them."""

        def loaders(datasets: Any, shuffle: bool = False) -> Any:
            if isinstance(datasets, dict):
                return {k: loaders(v, shuffle) for k, v in datasets.items()}
            if isinstance(datasets, (list, tuple)):
                return [loaders(v, shuffle) for v in datasets]
            shuffle = shuffle and not isinstance(datasets, IterableDataset)
            return DataLoader(datasets, batch_size=batch_size, shuffle=shuffle, num_workers=num_workers)

        params = inspect.signature(cls.__init__).parameters
        takes_all = any(p.kind is p.VAR_KEYWORD for p in params.values())
        sizes = {"batch_size": batch_size, "num_workers": num_workers}
        sizes = {k: v for k, v in sizes.items() if takes_all or k in params}
        datamodule = cls(**datamodule_kwargs, **sizes)
        for name, datasets, shuffle in (
            ("train_dataloader", train_dataset, True),
            ("val_dataloader", val_dataset, False),
            ("test_dataloader", test_dataset, False),
            ("predict_dataloader", predict_dataset, False),
        ):
            if datasets is not None:
                setattr(datamodule, name, functools.partial(loaders, datasets, shuffle))
        return datamodule

    def prepare_data(self) -> None: ...

    def setup(self, stage: str) -> None: ...

    def train_dataloader(self) -> Any:
        raise NotImplementedError(f"{type(self).__name__} must implement train_dataloader()")

    def teardown(self, stage: str) -> None: ...

    def state_dict(self) -> Dict[str, Any]:
        """What a checkpoint saves of this datamodule (nothing by default, as in Lightning)."""
        return {}

    def load_state_dict(self, state_dict: Dict[str, Any]) -> None:
        """Given what state_dict() returned when a checkpoint was saved, when fit resumes from it."""


# What the Trainer (and the planner's trace) does to a module, as functions rather than members.
def attach(module: TrainModule, trainer: Any) -> None:
    """Make `trainer` the module's `self.trainer` (set when a Trainer sets the module up)."""
    object.__setattr__(module, "_trainer", trainer)


def attached_trainer(module: TrainModule) -> Any:
    """The Trainer the module is attached to, or None."""
    return getattr(module, "_trainer", None)


def enter_hook(module: TrainModule, hook: str) -> str:
    """Record which hook runs now (`self.log` takes its per-step / per-epoch defaults from it); return the previous."""
    previous = module._current_hook
    object.__setattr__(module, "_current_hook", hook)
    return previous


def hyperparameters_to_log(module: Any, datamodule: Any = None) -> Dict[str, Any]:
    """The module's and the datamodule's hparams, merged, for the loggers (as Lightning logs them); an
    owner that called save_hyperparameters(logger=False) contributes none. A name both record with
    different values is an error: the logged run would say one of them."""
    merged: Dict[str, Any] = {}
    for owner in (module, datamodule):
        if owner is None or not getattr(owner, "_log_hyperparams", True):
            continue
        values = dict(getattr(owner, "hparams", {}) or {})
        clash = sorted(k for k in values.keys() & merged.keys() if not _same(merged[k], values[k]))
        if clash:
            raise ValueError(
                f"The module and the datamodule both record the hyperparameters {clash} with different values; "
                "the loggers could show only one. Rename one, or leave it out (save_hyperparameters(ignore=...))."
            )
        merged.update(values)
    return merged


def _same(a: Any, b: Any) -> bool:
    try:
        return a is b or bool(a == b)
    except (RuntimeError, TypeError, ValueError):  # tensors and arrays with several elements
        return False


def _gather_collection(data: Any, group: Any, sync_grads: bool, device: torch.device) -> Any:
    """all_gather over a collection: each tensor (or number) stacked over the ranks, containers rebuilt."""
    if isinstance(data, dict):
        return type(data)((k, _gather_collection(v, group, sync_grads, device)) for k, v in data.items())
    if isinstance(data, (list, tuple)):
        gathered = [_gather_collection(v, group, sync_grads, device) for v in data]
        return type(data)(*gathered) if hasattr(data, "_fields") else type(data)(gathered)
    if isinstance(data, (int, float, bool)):
        data = torch.tensor(data, device=device)
    if not isinstance(data, torch.Tensor):
        return data
    tensor = data.contiguous()
    if sync_grads:
        return _AllGatherGrad.apply(tensor, group)
    out = [torch.empty_like(tensor) for _ in range(dist.get_world_size(group))]
    dist.all_gather(out, tensor, group=group)
    return torch.stack(out)


class _AllGatherGrad(torch.autograd.Function):
    """all_gather whose backward sums every rank's gradient of the stack and hands each rank its own row."""

    @staticmethod
    def forward(ctx: Any, tensor: torch.Tensor, group: Any) -> torch.Tensor:
        ctx.group = group
        out = [torch.empty_like(tensor) for _ in range(dist.get_world_size(group))]
        dist.all_gather(out, tensor, group=group)
        return torch.stack(out)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> Any:
        grad = grad.contiguous()
        dist.all_reduce(grad, op=dist.ReduceOp.SUM, group=ctx.group)
        return grad[dist.get_rank(ctx.group)], None


def drain_logs(module: TrainModule) -> List[LoggedValue]:
    """What `self.log` recorded since the last call, in order; the buffer is empty after."""
    logs = list(module._log_buffer)
    module._log_buffer.clear()
    return logs

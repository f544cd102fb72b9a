"""`trainer.test(...)` and `trainer.predict(...)`: test_step / predict_step over their loaders, no gradients.

Both take their data as Lightning does -- `dataloaders` (one loader, a list or
a dict of them, or a datamodule), `datamodule=`, or the datamodule's / the
module's test_dataloader() / predict_dataloader() -- and run under every
strategy through the same `strategy.call` as training (FSDP gathers each unit,
DeepSpeed runs its engine). Hooks run in Lightning's order (lightning_hooks.py
lists them): the model-mode hook, on_*_start, on_*_epoch_start, per batch the
transfer hooks, on_*_batch_start, the step, on_*_batch_end; then on_*_epoch_end
and on_*_end; `setup` / `teardown` get stage "test" / "predict".

What they return, on each rank, as in Lightning:
- test: a list with one dict per loader of the epoch metrics logged in it
  (with several loaders, metrics logged in a loader's steps are named
  `name/dataloader_idx_<i>`; those logged outside any loader are in every
  dict). The test loaders are split across ranks like validation's: padded
  to the same number of batches per rank, so a few samples may count twice
  (log with sync_dist=True for a metric over every rank).
- predict: this rank's predictions, a list of predict_step's outputs per
  batch (a list of such lists with several loaders), or None with
  return_predictions=False. Unlike test, each sample is predicted exactly
  once: rank r gets samples r, r + W, r + 2W, ... of each loader (W ranks),
  in order. Where every rank must run the same number of forward passes
  (sharded parameters are gathered collectively), a rank with one batch fewer
  repeats a forward on its last batch and discards it, calling no hook.
"""

from __future__ import annotations

import inspect
import math
from typing import Any, Callable, Dict, Iterator, List, Optional, Sequence, Tuple

import torch
from torch.utils.data import BatchSampler, DataLoader, IterableDataset, RandomSampler, Sampler, SequentialSampler

from shardwise.data import rebuild
from shardwise.distributed.progress import mark as mark_progress
from shardwise.module import TrainModule, drain_logs, enter_hook
from shardwise.trainer import lightning_hooks
from shardwise.trainer.arguments import is_datamodule, unwrap_compiled
from shardwise.trainer.hooks import call_module
from shardwise.trainer.loaders import length, limit

STEPS = {"test": "test_step", "predict": "predict_step"}
LOADERS = {"test": "test_dataloader", "predict": "predict_dataloader"}


class RankShare(Sampler):
    """This rank's samples of a dataset without padding: r, r + W, r + 2W, ... (predict's split)."""

    def __init__(self, size: int, num_replicas: int, rank: int) -> None:
        self.indices = list(range(rank, size, num_replicas))

    def __iter__(self) -> Iterator[int]:
        return iter(self.indices)

    def __len__(self) -> int:
        return len(self.indices)


def split_for_predict(loader: Any, strategy: Any) -> Any:
    """The loader with this rank's unpadded share (RankShare), in order; other loaders as the strategy splits them."""
    plain = (
        isinstance(loader, DataLoader)
        and not isinstance(loader.dataset, IterableDataset)
        and type(loader.batch_sampler) is BatchSampler
        and isinstance(loader.sampler, (SequentialSampler, RandomSampler))
    )
    if not plain:
        return strategy.setup_dataloader(loader, shuffle=False)
    share = RankShare(len(loader.dataset), strategy.data_parallel_size, strategy.data_parallel_rank)
    return rebuild(loader, sampler=share)


def as_list(loaders: Any) -> List[Any]:
    """One loader, a list / tuple of them, or a dict of them (in its order) -> a list."""
    if isinstance(loaders, dict):
        return list(loaders.values())
    if isinstance(loaders, (list, tuple)):
        return list(loaders)
    return [loaders]


def check_entry(stage: str, trainer: Any, model: Any, dataloaders: Any, datamodule: Any) -> Tuple[Any, Any, Any]:
    """test() / predict()'s arguments as Lightning takes them -> (module, dataloaders, datamodule)."""
    if datamodule is None and is_datamodule(dataloaders):
        dataloaders, datamodule = None, dataloaders  # trainer.test(model, dm)
    if dataloaders is not None and datamodule is not None:
        raise ValueError(f"{stage}() takes either dataloaders or a datamodule, not both.")
    module = unwrap_compiled(model) if model is not None else trainer.module
    if module is None:
        raise ValueError(f"{stage}() needs a module: trainer.{stage}(module, ...), or call it after fit().")
    if not isinstance(module, TrainModule):
        raise TypeError(f"{stage}() takes a shardwise.TrainModule, got {type(module).__name__}.")
    step = STEPS[stage]
    if stage == "test" and not callable(getattr(module, step, None)):
        raise TypeError(f"test() needs {type(module).__name__}.test_step(batch, batch_idx).")
    return module, dataloaders, datamodule


def find_loaders(stage: str, trainer: Any, dataloaders: Any, datamodule: Any) -> List[Any]:
    """The stage's loaders: given, else the datamodule's, else the module's <stage>_dataloader()."""
    if dataloaders is None:
        hook = LOADERS[stage]
        owner = datamodule if datamodule is not None else trainer.datamodule
        if owner is not None and callable(getattr(owner, hook, None)):
            dataloaders = getattr(owner, hook)()
        else:
            dataloaders = call_module(trainer, hook)
    if dataloaders is None:
        raise ValueError(
            f"{stage}() has no data: pass dataloaders=..., a datamodule with {LOADERS[stage]}(), or define "
            f"{LOADERS[stage]}() on {type(trainer.module).__name__}."
        )
    return as_list(dataloaders)


def resolve_ckpt_path(trainer: Any, ckpt_path: str, configure_optimizers: Callable[[bool], None]) -> str:
    """test / predict(ckpt_path=...): the path ("best": the checkpoint callback's best model; "last" and paths
    as fit resolves them), with the optimizers built, since a training checkpoint is restored whole (its
    optimizer state included) through the same verified path as a resume."""
    if ckpt_path == "best":
        best = [getattr(cb, "best_model_path", "") for cb in trainer.callbacks if hasattr(cb, "best_model_path")]
        if not best or not best[0]:
            raise ValueError(
                'ckpt_path="best" needs a ModelCheckpoint that saved a checkpoint in this process (after fit); '
                "pass the checkpoint's path instead."
            )
        ckpt_path = best[0]
    if type(trainer.module).configure_optimizers is TrainModule.configure_optimizers:
        raise TypeError(
            f"{trainer.stage}(ckpt_path=...) restores a training checkpoint, optimizer state included, which needs "
            f"{type(trainer.module).__name__}.configure_optimizers(). Define it, or load the weights with "
            f"{type(trainer.module).__name__}.load_from_checkpoint(path) and pass that module."
        )
    configure_optimizers(True)
    return ckpt_path


def run(
    trainer: Any,
    stage: str,
    model: Any,
    dataloaders: Any,
    datamodule: Any,
    ckpt_path: Optional[str],
    enter: Callable[[str, Any, Any, Optional[str]], None],
    verbose: bool = True,
    return_predictions: Optional[bool] = None,
) -> Any:
    """trainer.test / trainer.predict: set up for `stage` (enter: the Trainer's set-up), run, tear down."""
    module, dataloaders, datamodule = check_entry(stage, trainer, model, dataloaders, datamodule)
    enter(stage, module, datamodule, ckpt_path)
    with lightning_hooks.running(trainer, stage), torch.no_grad():  # on_exception if it fails; teardown(stage)
        loaders = find_loaders(stage, trainer, dataloaders, datamodule)
        if stage == "test":
            return run_test(trainer, loaders, verbose)
        predictions = run_predict(trainer, loaders)
    return predictions if return_predictions is not False else None


def _step_args(step: Any, batch: Any, batch_idx: int, dataloader_idx: Optional[int]) -> tuple:
    """(batch, batch_idx[, dataloader_idx]) as the step's signature takes them (Lightning passes the index
    of the loader only with several loaders)."""
    params = [
        p
        for p in inspect.signature(step).parameters.values()
        if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD, p.VAR_POSITIONAL)
    ]
    varargs = any(p.kind == p.VAR_POSITIONAL for p in params)
    args: tuple = (batch,)
    if varargs or len(params) >= 2:
        args += (batch_idx,)
    if dataloader_idx is not None:
        if not (varargs or len(params) >= 3):
            raise TypeError(
                f"{step.__name__}(batch, batch_idx) runs over several dataloaders here: take a third "
                "argument, dataloader_idx (as in Lightning)."
            )
        args += (dataloader_idx,)
    return args


def _record(trainer: Any, batch: Any, suffix: str) -> None:
    """What the step logged, under `name/dataloader_idx_<i>` when several loaders run (Lightning's names)."""
    logs = drain_logs(trainer.module)
    for item in logs:
        item.name += suffix
    trainer.metrics.record(logs, batch=batch)


def _call_step(trainer: Any, stage: str, batch: Any, batch_idx: int, dataloader_idx: Optional[int]) -> Any:
    module, strategy = trainer.module, trainer.strategy
    step = getattr(module, STEPS[stage], None)
    enter_hook(module, STEPS[stage])
    mark_progress(STEPS[stage], trainer.state.global_step)
    with strategy.autocast():
        if step is None:  # Lightning's default predict_step: the module's forward on the batch
            return strategy.call(trainer.model, "forward", batch)
        return strategy.call(trainer.model, STEPS[stage], *_step_args(step, batch, batch_idx, dataloader_idx))


def run_test(trainer: Any, loaders: List[Any], verbose: bool) -> List[Dict[str, float]]:
    strategy, several = trainer.strategy, len(loaders) > 1
    loaders = [strategy.setup_dataloader(loader, shuffle=False) for loader in loaders]
    trainer.testing = True
    trainer.metrics.clear()  # test()'s callback_metrics are its own, as in Lightning
    call_module(trainer, "on_test_model_eval")
    try:
        with trainer.metrics.separate_epoch():
            lightning_hooks.call_both(trainer, "on_test_start")
            lightning_hooks.call_both(trainer, "on_test_epoch_start")
            for index, loader in enumerate(loaders):
                dataloader_idx = index if several else None
                extra = (index,) if several else ()
                suffix = f"/dataloader_idx_{index}" if several else ""
                count = limit(getattr(trainer, "limit_test_batches", None), length(loader))
                for batch_idx, batch in enumerate(loader):
                    if batch_idx >= count:
                        break
                    batch = lightning_hooks.transfer_batch(trainer, strategy.precision.convert_input(batch), index)
                    lightning_hooks.call_both(trainer, "on_test_batch_start", batch, batch_idx, *extra)
                    output = _call_step(trainer, "test", batch, batch_idx, dataloader_idx)
                    _record(trainer, batch, suffix)
                    lightning_hooks.call_both(trainer, "on_test_batch_end", output, batch, batch_idx, *extra)
                    _record(trainer, batch, suffix)
            results = lightning_hooks.end_epoch(trainer, "on_test_epoch_end")  # `name_epoch` as validation's
            lightning_hooks.call_both(trainer, "on_test_end")
    finally:
        trainer.testing = False
        call_module(trainer, "on_test_model_train")
    per_loader = split_results(results, len(loaders))
    if verbose and strategy.is_global_zero:
        print(format_results(per_loader))
    return per_loader


def split_results(results: Dict[str, float], count: int) -> List[Dict[str, float]]:
    """One dict per loader: its own `name/dataloader_idx_<i>` metrics, and those logged outside any loader."""
    if count == 1:
        return [dict(results)]
    out = []
    for index in range(count):
        own = f"/dataloader_idx_{index}"
        out.append({k: v for k, v in results.items() if "/dataloader_idx_" not in k or k.endswith(own)})
    return out


def format_results(per_loader: Sequence[Dict[str, float]]) -> str:
    """The metrics as a table: one row per metric, one column per loader."""
    names = sorted({k for d in per_loader for k in d})
    headers = ["Test metric"] + [f"DataLoader {i}" for i in range(len(per_loader))]
    rows = [[name] + [f"{d[name]:.6g}" if name in d else "" for d in per_loader] for name in names]
    widths = [max(len(r[i]) for r in [headers] + rows) for i in range(len(headers))]
    line = "-" * (sum(widths) + 3 * (len(widths) - 1))
    fmt = "   ".join(f"{{:<{w}}}" for w in widths)
    return "\n".join([line, fmt.format(*headers), line, *(fmt.format(*r) for r in rows), line])


def run_predict(trainer: Any, loaders: List[Any]) -> List[Any]:
    strategy, module, several = trainer.strategy, trainer.module, len(loaders) > 1
    loaders = [split_for_predict(loader, strategy) for loader in loaders]
    trainer.predicting = True
    trainer.metrics.clear()  # nothing is logged in predict: callback_metrics are empty after it, as in Lightning
    modes = [(m, m.training) for m in trainer.model.modules()]
    call_module(trainer, "on_predict_model_eval")
    all_predictions: List[List[Any]] = []
    try:
        lightning_hooks.call_both(trainer, "on_predict_start")
        lightning_hooks.call_both(trainer, "on_predict_epoch_start")
        for index, loader in enumerate(loaders):
            dataloader_idx = index if several else None
            extra = (index,) if several else ()
            count = limit(getattr(trainer, "limit_predict_batches", None), length(loader))
            most = _most_batches(trainer, count)  # agreed before any forward: the ranks' collectives must pair
            predictions: List[Any] = []
            last = None
            for batch_idx, batch in enumerate(loader):
                if batch_idx >= count:
                    break
                batch = lightning_hooks.transfer_batch(trainer, strategy.precision.convert_input(batch), index)
                lightning_hooks.call_both(trainer, "on_predict_batch_start", batch, batch_idx, *extra)
                output = _call_step(trainer, "predict", batch, batch_idx, dataloader_idx)
                drain_logs(module)  # self.log is refused in predict hooks; nothing to record
                lightning_hooks.call_both(trainer, "on_predict_batch_end", output, batch, batch_idx, *extra)
                predictions.append(output)
                last = batch
            _even_out(trainer, loader, len(predictions), most, last, dataloader_idx)
            all_predictions.append(predictions)
        lightning_hooks.call_both(trainer, "on_predict_epoch_end")
        lightning_hooks.call_both(trainer, "on_predict_end")
    finally:
        trainer.predicting = False
        for submodule, training in modes:
            submodule.training = training
    return all_predictions if several else all_predictions[0]


def _most_batches(trainer: Any, count: float) -> float:
    """The most batches any rank runs over this loader, where sharded parameters make forwards collective."""
    strategy = trainer.strategy
    if strategy.world_size == 1 or not strategy.is_sharded or math.isinf(count):
        return count  # a loader without a length: its ranks must yield equally many batches themselves
    return float(strategy.reduce(torch.tensor(float(count)), "max"))


def _even_out(trainer: Any, loader: Any, done: int, most: float, last: Any, dataloader_idx: Optional[int]) -> None:
    """Sharded engines gather parameters in every forward: a rank with fewer batches than the most any rank
    runs repeats forwards on its last batch (outputs discarded, no hooks) so that every rank's collectives pair."""
    strategy = trainer.strategy
    if math.isinf(most) or done >= most:
        return
    if last is None:  # this rank got no sample at all (fewer samples than ranks): any batch of the loader will do
        source = loader.dataset if isinstance(loader, DataLoader) else None
        if source is None or len(source) == 0:
            raise RuntimeError("predict(): a rank has no batch to run while others do, and its loader is empty.")
        last = loader.collate_fn([source[0]])
        last = lightning_hooks.transfer_batch(trainer, strategy.precision.convert_input(last), dataloader_idx or 0)
    for _ in range(int(most) - done):
        _call_step(trainer, "predict", last, done, dataloader_idx)
        drain_logs(trainer.module)

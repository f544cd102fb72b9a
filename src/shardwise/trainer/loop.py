"""The Trainer: the training loop, top to bottom.

Set-up (in this order, every step commented where it matters): environment -> strategy -> configure_model
under the strategy's init context -> strategy wraps / shards / materialises -> optimizers on the wrapped
parameters -> data loaders with distributed, resumable sampling -> restore a checkpoint -> loop. The loop
accumulates micro-batches (communicating only on the last one), clips, steps, logs, validates and
checkpoints. Everything that differs between one device, DDP, FSDP and DeepSpeed is a strategy method;
nothing here knows which strategy runs. (The package's __init__ says what the modules beside it do.)
"""

from __future__ import annotations

import functools
import os
import signal
from typing import Any, Dict, Iterable, List, Optional, Sequence, Tuple, Union

import torch
from torch import nn

import shardwise.trainer.options as options  # the first-hour Lightning options
from shardwise import step as shared_step  # looked up at call time, like the planner's trace
from shardwise.callbacks.expert_load import attach_monitor
from shardwise.checkpoint import load_training_checkpoint, save_training_checkpoint
from shardwise.checkpoint.training import TrainingStates
from shardwise.distributed import faults
from shardwise.distributed.env import detect_env, resolve_accelerator, resolve_devices
from shardwise.distributed.progress import mark as mark_progress
from shardwise.metrics import MetricStore, settle
from shardwise.module import TrainModule, attach, drain_logs, enter_hook
from shardwise.plan.advice import check_before_fit
from shardwise.seed import apply_cublas_workspace_config
from shardwise.state import TrainState
from shardwise.strategies import Strategy, build_strategy
from shardwise.trainer import (
    arguments,
    automatic,
    datamodules,
    evaluation,
    lightning_hooks,
    loaders,
    nonfinite,
    setup,
    weighting,
)
from shardwise.trainer.attributes import TrainerAttributes
from shardwise.trainer.hooks import call_callbacks, call_module, takes_batch_idx, update_lr_schedulers
from shardwise.trainer.manual import UserOptimization
from shardwise.trainer.preemption import PreemptionWatch
from shardwise.trainer.validation import run_validation, validation_due, validation_due_at_epoch_end


class Trainer(TrainerAttributes):
    """Train a TrainModule on one device or many; the strategy says how (see shardwise.strategies)."""

    def __init__(
        self,
        accelerator: str = "auto",
        devices: Union[int, str] = "auto",
        num_nodes: int = 1,
        strategy: Union[str, Strategy] = "auto",
        precision: Union[str, int, None] = None,  # None: the strategy's, else "32-true"
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
        callbacks: Union[List[Any], Any, None] = None,  # a list, or one callback object
        logger: Any = True,
        enable_progress_bar: bool = True,
        enable_checkpointing: bool = True,
        enable_model_summary: Optional[bool] = None,  # None: no summary unless a ModelSummary is given
        sync_batchnorm: bool = False,  # BatchNorm -> SyncBatchNorm when processes share a batch
        default_root_dir: Optional[str] = None,
        deterministic: bool = False,
        device_memory: Union[None, str, int] = None,
        preemption_signals: Optional[Sequence[Union[str, int]]] = ("SIGTERM", "SIGINT", "SIGUSR1"),
        non_finite: str = "error",
        timeout_s: Optional[float] = None,
        throughput: bool = True,  # tokens/s, TFLOP/s and MFU at the log steps (callbacks/throughput.py)
        peak_tflops: Optional[float] = None,  # the device's peak for MFU; None: shardwise.flops' table
        profile_steps: Optional[Tuple[int, int]] = None,  # torch.profiler traces of these optimizer steps
        # The first-hour Lightning options (options.py says what each does here):
        fast_dev_run: Union[bool, int] = False,
        num_sanity_val_steps: Optional[int] = None,  # None: 0 (Lightning: 2)
        overfit_batches: Union[int, float] = 0.0,
        max_time: options.MaxTime = None,
        min_epochs: Optional[int] = None,
        min_steps: Optional[int] = None,
        detect_anomaly: bool = False,
        limit_test_batches: Union[int, float, None] = None,
        limit_predict_batches: Union[int, float, None] = None,
        gpus: Optional[int] = None,
        plugins: Any = None,
        compile: Any = None,  # torch.compile: True (each repeated block), "model", CompileOptions (options.py)
        # Lightning's remaining arguments, so its scripts and saved CLI configs port; their defaults change
        # nothing, other values are honoured or refused by name (arguments.lightning_extras):
        benchmark: Optional[bool] = None,
        inference_mode: bool = True,
        use_distributed_sampler: bool = True,
        profiler: Any = None,
        barebones: bool = False,
        reload_dataloaders_every_n_epochs: int = 0,
        enable_autolog_hparams: bool = True,
        model_registry: Optional[str] = None,
    ) -> None:
        # Everything is validated here, in the process the user started,
        # before any worker is spawned or any weight allocated.
        accelerator, devices, strategy = arguments.lightning_spellings(accelerator, devices, strategy, gpus, plugins)
        if deterministic:  # before any CUDA work here, and in the environment the workers inherit
            apply_cublas_workspace_config()
        self.accelerator = resolve_accelerator(accelerator)
        env = detect_env()
        if env is not None and devices == "auto":
            devices = env.local_world_size
        self.devices = resolve_devices(devices, self.accelerator)
        self.num_nodes = arguments.check_num_nodes(num_nodes)
        self.strategy = build_strategy(strategy, world_size=self.devices * num_nodes)
        self.strategy.connect(
            self.accelerator, precision, num_nodes=num_nodes, devices=self.devices, timeout_s=timeout_s
        )
        # Known device memory ("80GiB", or "auto" on CUDA) lets fit() consult the memory planner:
        # strategy="auto" becomes its choice, and a run predicted not to fit warns first.
        self.device_memory = device_memory
        arguments.check_arguments(
            max_epochs=max_epochs,
            max_steps=max_steps,
            limit_train_batches=limit_train_batches,
            limit_val_batches=limit_val_batches,
            val_check_interval=val_check_interval,
            check_val_every_n_epoch=check_val_every_n_epoch,
            accumulate_grad_batches=accumulate_grad_batches,
            gradient_clip_val=gradient_clip_val,
            gradient_clip_algorithm=gradient_clip_algorithm,
            log_every_n_steps=log_every_n_steps,
        )
        default_epochs = arguments.MAX_EPOCHS_DEFAULT if max_steps == -1 and max_time is None else -1
        self.max_epochs = max_epochs if max_epochs is not None else default_epochs
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
        self.preemption_signals = arguments.signal_numbers(preemption_signals)
        self._preemption = PreemptionWatch(self.preemption_signals)
        # A NaN/inf loss or gradient: 'error' stops at that step naming the rank and
        # tensor, 'skip' drops the step (as GradScaler does), 'warn' only reports it.
        self.non_finite = arguments.check_non_finite(non_finite, self.strategy)
        self.nonfinite_step: Optional[int] = None  # the first step with a non-finite value (never saved after it)
        self.health = nonfinite.StepCheck(self.non_finite, self._preemption)  # its verdicts, read when needed
        self._window_losses: List[Tuple[int, torch.Tensor]] = []
        # Set by fit() for a module that defines loss_weight: its summed losses are normalised over the
        # global batch of each step (weighting.py); None keeps the mean loss of each micro-batch.
        self.weighting: Optional[weighting.StepWeighting] = None
        callbacks = arguments.lightning_callbacks(callbacks, enable_model_summary)
        self.callbacks = setup.default_callbacks(callbacks, enable_progress_bar, enable_checkpointing, throughput,
                                                 peak_tflops, profile_steps)  # fmt: skip
        self.sync_batchnorm = bool(sync_batchnorm)
        self.loggers = setup.build_loggers(logger, self.default_root_dir)
        self.state = TrainState()
        self.metrics = MetricStore()
        self.optimization = UserOptimization(self)  # self.optimizers(), manual optimization (manual.py)
        self.should_stop = False
        self.stage: Optional[str] = None  # the entry point running: "fit", "validate", ... (Lightning's state.fn)
        self.validating = False
        self.testing = False  # inside test() / predict() (Lightning's trainer.testing / .predicting)
        self.predicting = False
        self.is_last_microbatch = False
        self.num_training_batches: float = float("inf")
        self.num_val_batches: float = 0
        self.model: Optional[nn.Module] = None
        self.module: Optional[TrainModule] = None  # the TrainModule being trained; `model` is its wrapped form
        self.train_dataloader: Any = None
        self.val_dataloaders: Any = None
        self._data_sources: Tuple[Any, Any, Any] = (None, None, None)  # fit()'s (train, val, datamodule)
        self._resolved_data: Tuple[Any, Any] = (None, None)  # the loaders they gave, in the workers
        self._set_up = False
        options.apply(self, fast_dev_run, num_sanity_val_steps, overfit_batches, max_time, min_epochs, min_steps,
                      detect_anomaly, limit_test_batches, limit_predict_batches, compile)  # fmt: skip
        self.enable_autolog_hparams = arguments.lightning_extras(
            benchmark, deterministic, inference_mode, use_distributed_sampler, profiler, barebones,
            reload_dataloaders_every_n_epochs, enable_autolog_hparams, model_registry,
        )  # fmt: skip

    # ------------------------------------------------------------ reporting
    @property
    def preempted(self) -> Optional[str]:
        """The signal's name once the run stopped for a preemption signal, else None."""
        return self._preemption.preempted

    @property
    def datamodule(self) -> Any:
        """The datamodule given to fit() (Lightning's trainer.datamodule), or None."""
        return self._data_sources[2]

    @property
    def estimated_stepping_batches(self) -> Union[int, float]:
        """The optimizer steps fit will take (OneCycleLR's total_steps); valid from configure_optimizers on."""
        return options.estimated_stepping_batches(self, self.train_dataloader or self._resolved_data[0])

    def print(self, *args: Any, **kwargs: Any) -> None:
        """print() on global rank 0 only (also before set-up: see is_global_zero)."""
        if self.is_global_zero:
            print(*args, **kwargs)

    def log_metrics(self, metrics: Dict[str, float], step: Optional[int] = None) -> None:
        if not self.strategy.is_global_zero or not metrics:
            return
        metrics = settle(dict(metrics))
        for logger in self.loggers:
            logger.log_metrics(metrics, step=self.global_step if step is None else step)

    # -------------------------------------------------------------------- set-up
    def _setup(self, module: TrainModule, need_train_data: bool = True, stage: Optional[str] = None) -> None:
        stage = stage or ("fit" if need_train_data else "validate")
        if self._set_up and self.module is module:
            lightning_hooks.prepare_and_setup(self, stage)  # every fit / validate sets up again, as in Lightning
            if need_train_data and self._resolved_data[0] is None:  # a fit after validate()
                self._resolve_data(module, need_train_data=True)
            self._configure_optimizers(need_train_data)
            return
        if not isinstance(module, TrainModule):
            raise TypeError(f"fit() takes a shardwise.TrainModule, got {type(module).__name__}.")
        strategy = self.strategy
        strategy.setup_environment()
        if self.deterministic:
            torch.use_deterministic_algorithms(True, warn_only=True)
        trained = setup.check_refit(module, self)
        self.module = module
        attach(module, self)
        # Every Lightning hook is called or refused (lightning_hooks.HOOKS): refused ones stop here.
        lightning_hooks.configure_callbacks(self)
        lightning_hooks.refuse_unsupported(self, module, self.callbacks, self.datamodule)
        lightning_hooks.prepare_and_setup(self, stage)  # prepare_data, setup(stage): datamodule, callbacks, module
        if stage in ("fit", "validate"):  # test / predict ask for their own loaders (evaluation.py)
            self._resolve_data(module, need_train_data)
        self.model = setup.build_model(strategy, module, lambda: options.configure_model(self, module), trained)
        attach_monitor(self.callbacks, module)  # a mixture-of-experts model's tokens per expert, logged
        self._set_up = True
        self._configure_optimizers(need_train_data)

    def _configure_optimizers(self, need_train_data: bool) -> None:
        """Optimizers on the wrapped (possibly sharded) parameters, once: for fit, as in Lightning, and for
        any stage where the strategy's engine is built with its optimizer (DeepSpeed)."""
        strategy = self.strategy
        if strategy.optimizers or not (need_train_data or lightning_hooks.engine_owns_step(strategy)):
            return
        optimizers, schedulers = setup.parse_optimizers(call_module(self, "configure_optimizers"))
        self.optimization.check(self.module, optimizers)  # several need manual optimization; what manual refuses
        for opt in optimizers:
            strategy.setup_optimizer(opt)
        strategy.lr_schedulers = schedulers

    def _resolve_data(self, module: TrainModule, need_train_data: bool) -> None:
        train, val, datamodule = self._data_sources  # its prepare_data and setup ran: lightning_hooks
        self._resolved_data = loaders.resolve_data(
            (train, val, None), datamodule or module, self.strategy, need_train_data
        )
        train = self._resolved_data[0]
        if train is not None and getattr(train, "batch_size", None) is not None:
            setup.configure_training(self, train.batch_size)  # the loader is known only now (DeepSpeed's config)

    # ------------------------------------------------------------------- fit
    def fit(
        self,
        model: TrainModule,
        train_dataloaders: Optional[Iterable] = None,
        val_dataloaders: Optional[Iterable] = None,
        datamodule: Any = None,
        ckpt_path: Optional[str] = None,
    ) -> None:
        """Train. Data as in Lightning: loaders here, a `datamodule` (also as the second positional
        argument), or the module's own train_dataloader() / val_dataloader() methods. Lightning's
        signature: fit(model, train_dataloaders, val_dataloaders, datamodule, ckpt_path)."""
        module = arguments.unwrap_compiled(model)  # torch.compile(module): the TrainModule, its steps compiled
        train_dataloaders, datamodule = arguments.check_fit_data(module, train_dataloaders, val_dataloaders, datamodule)
        self.stage = "fit"
        self._data_sources = (train_dataloaders, val_dataloaders, datamodule)
        plan_choice = None
        if self.device_memory is not None:  # before any worker starts (see shardwise/plan/advice.py)
            decision = check_before_fit(self, module, train_dataloaders)
            train_dataloaders, plan_choice = setup.apply_plan(self, decision, train_dataloaders)
            self._data_sources = (train_dataloaders, val_dataloaders, datamodule)
        # Before any worker starts: a strategy whose engine owns accumulation,
        # clipping and the micro-batch size (DeepSpeed) checks them against its
        # own configuration now, so a contradiction fails in the user's process.
        setup.configure_training(self, getattr(self._data_sources[0], "batch_size", None))  # after any re-batching
        setup.launch_if_needed(self.devices, self.num_nodes, plan_choice)
        previous_handlers = self._preemption.install()
        try:
            self._setup(module)
            train_dataloaders, val_dataloaders = self._resolved_data
            self.train_dataloader = self.strategy.setup_dataloader(train_dataloaders, options.train_shuffle(self))
            self.val_dataloaders = (
                self.strategy.setup_dataloader(val_dataloaders, shuffle=False) if val_dataloaders is not None else None
            )
            if ckpt_path is not None:
                self._restore(ckpt_path)
            setup.setup_loggers(self.loggers, self.strategy, self.logged_hyperparameters)
            lightning_hooks.call_both(self, "on_fit_start")
            options.before_training(self)  # the sanity check; max_time's clock; detect_anomaly
            lightning_hooks.call_both(self, "on_train_start")
            self._fit_loop()
            self.health.resolve(self, "at the end of fit")  # the last step's verdict, before fit ends
            lightning_hooks.call_both(self, "on_train_end")
            lightning_hooks.call_both(self, "on_fit_end")
            setup.finalize_loggers(self.loggers, self.strategy, "success")
        except BaseException as exc:
            faults.note_failure(exc)  # where it failed, before teardown's hooks move this rank's progress
            lightning_hooks.on_exception(self, exc)
            setup.finalize_loggers(self.loggers, self.strategy, "failed")
            raise
        finally:
            options.after_fit(self)
            lightning_hooks.teardown(self, "fit")
            for sig, handler in previous_handlers.items():
                signal.signal(sig, handler)
        self._preemption.exit_if_preempted(self.global_step, self.callbacks)  # saved, exit 75 for the job script

    def _preemption_requested(self) -> bool:
        return self._preemption.requested(self.strategy)

    def _states(self) -> TrainingStates:
        """What a checkpoint saves and restores besides the model and optimizers, handed over explicitly."""
        return TrainingStates(
            strategy=self.strategy,
            train_state=self.state,
            loader=self.train_dataloader,
            callbacks=self.callbacks + datamodules.datamodule_states(self.datamodule),  # its state beside theirs
            loggers=self.loggers,
            callback_metrics=self.metrics.callback_metrics,
            module=self.module,
            callback_hook=functools.partial(call_callbacks, self),
        )

    def _restore(self, ckpt_path: str) -> None:
        load_training_checkpoint(self._states(), ckpt_path, setup.checkpoint_search_dirs(self))

    def save_checkpoint(self, path: str, wait: bool = True) -> Any:
        """Save everything needed to resume, in the strategy's format; returns the path. Collective: call it on
        every rank; the checkpoint appears at `path` atomically once every rank has written its part. wait=False
        returns the PendingCheckpoint, whose commit() every rank runs later (ModelCheckpoint's async saves)."""
        self.health.resolve(self)  # a step's health verdict still unread is read first: NaN is never saved
        return save_training_checkpoint(self._states(), path, wait=wait)

    def _done(self) -> bool:
        stop = self.should_stop and options.can_stop(self)  # not before min_epochs / min_steps
        return stop or (self.max_steps != -1 and self.global_step >= self.max_steps)

    # ------------------------------------------------------------------ loop
    def _fit_loop(self) -> None:
        state = self.state
        loader = self.train_dataloader
        self.num_training_batches = loaders.batches_to_train(loader, self.limit_train_batches, self.val_check_interval)
        pass_idx, window = takes_batch_idx(self.module.training_step), self.accumulate_grad_batches
        self.weighting = weighting.maybe_build(self.module, self.strategy, loader)  # the loader: its repeats
        loaders.announce_order(loader, weighted=self.weighting is not None)
        if self._preemption_requested():  # signalled during set-up or a restore: no step has started
            self.should_stop = True
        while not self._done() and (self.max_epochs == -1 or state.epoch < self.max_epochs):
            loaders.position_sampler(loader, state)  # this epoch's order; a mid-epoch resume skips by index
            call_callbacks(self, "on_train_epoch_start")
            call_module(self, "on_train_epoch_start")
            self.model.train()
            started_at = state.batch_idx
            done = lambda: state.batch_idx >= self.num_training_batches or self._done()  # noqa: E731
            # done() is asked before each batch is drawn, so a stateful loader is never a batch ahead of its save.
            batches = loaders.epoch_iterator(loader, state, done)  # a checkpoint's RNG states at the saved point
            if self.weighting is not None:  # each window's batches taken together: the step's weight first
                batches = self.weighting.batches(batches, state, window, self.num_training_batches, done)
            for batch in batches:
                if state.batch_idx >= self.num_training_batches or self._done():
                    break
                self._train_batch(batch, pass_idx)
            if started_at == 0 and state.batch_idx == 0 and not self._done():
                raise loaders.empty_epoch_error(loader, state.epoch)
            if self._done() and state.batch_idx < self.num_training_batches:
                break  # stopped mid-epoch by max_steps; the epoch is not over
            # End of epoch: a partial accumulation window still steps.
            state.in_epoch_end = True  # a checkpoint saved from here on resumes at the next epoch
            self.health.resolve(self, "at the epoch's end")  # before validation and the epoch's values
            if validation_due_at_epoch_end(self):
                run_validation(self)
            # on_train_epoch_end, the epoch's metrics, ReduceLROnPlateau on what validation logged.
            lightning_hooks.end_train_epoch(self)
            state.in_epoch_end = False
            state.epoch += 1
            state.batch_idx = 0
            if self._preemption_requested():
                # Signalled during epoch-end work: stop before the next epoch's first step.
                self.should_stop = True

    def _train_batch(self, batch: Any, pass_idx: bool) -> None:
        strategy, state, module = self.strategy, self.state, self.module
        batch_idx = state.batch_idx
        if batch_idx == 0:  # ranks that must read the same samples (sp/tp groups) do: checked once an epoch
            strategy.check_batch(batch)
        batch = lightning_hooks.transfer_batch(self, strategy.precision.convert_input(batch))
        call_callbacks(self, "on_train_batch_start", batch, batch_idx)
        if call_module(self, "on_train_batch_start", batch, batch_idx) == -1:
            self.should_stop = True  # Lightning's convention: -1 ends the epoch and the run
            return
        window = self.accumulate_grad_batches
        last_in_epoch = batch_idx + 1 >= self.num_training_batches
        self.is_last_microbatch = (batch_idx + 1) % window == 0 or last_in_epoch
        args = (batch, batch_idx) if pass_idx else (batch,)
        enter_hook(module, "training_step")
        mark_progress("training_step", state.global_step)

        def before_backward(loss: torch.Tensor) -> None:
            automatic.check_trainable(loss, state.global_step, batch_idx)
            self._window_losses.append((batch_idx, loss.detach()))  # checked at the step, no sync here
            if self.weighting is not None:
                self.weighting.add(loss)
            automatic.before_backward(self, loss, batch_idx, window, scale)  # zero-grad, on_before_backward hooks
            mark_progress("backward", state.global_step)

        # The step's core is shared with the memory planner's trace (step.py). Non-final
        # micro-batches skip what can wait (DDP's all-reduce; FSDP's replica all-reduce).
        # A summed loss (loss_weight) is scaled to its share of the step's global mean.
        scale = self.weighting.loss_scale if self.weighting is not None else None

        def micro_batch() -> Any:  # training_step and its backward: on a window's last, optimizer_step's closure
            last = self.is_last_microbatch
            output, loss = shared_step.forward_backward(
                strategy, self.model, args, window=window, last=last, before_backward=before_backward, loss_scale=scale
            )
            automatic.after_backward(self, loss)
            state.batch_idx += 1
            return output

        if module.automatic_optimization:  # through the module's optimizer_step on a window's last (automatic.py)
            output = automatic.run(self, micro_batch, batch_idx, self._optimizer_step)
        else:  # manual optimization: training_step runs its own backward passes and steps (manual.py)
            output = self.optimization.training_step(args)
            state.batch_idx += 1
        step_logs = self.metrics.record(drain_logs(module), batch=batch)
        log_due = self.is_last_microbatch and (
            state.global_step % self.log_every_n_steps == 0 or state.global_step == 1
        )
        if self.is_last_microbatch and self.weighting is not None:  # the step's global mean loss
            step_logs.update(self.metrics.record(self.weighting.logs(log_due)))
        # Schedulers, on_train_batch_end, then the step's values to the loggers with what it logged.
        lightning_hooks.end_train_batch(self, output, batch, batch_idx, step_logs if log_due else None)
        if self.val_dataloaders is not None and validation_due(self, state.batch_idx):
            self.health.resolve(self, "before validation")
            run_validation(self)
        if self.is_last_microbatch:
            update_lr_schedulers(self, "step", plateau=True)  # after any validation this step ran, as Lightning
        if self.is_last_microbatch and self._preemption_requested():
            self.should_stop = True  # ModelCheckpoint saves this step in on_train_end
        if self.is_last_microbatch and options.out_of_time(self):
            self.should_stop = True  # max_time: every rank stops after this same step

    def _optimizer_step(self) -> None:
        strategy = self.strategy
        losses, self._window_losses = self._window_losses, []

        def before_step(i: int, optimizer: torch.optim.Optimizer) -> bool:
            call_callbacks(self, "on_before_optimizer_step", optimizer)
            call_module(self, "on_before_optimizer_step", optimizer)
            # The step's health verdict, read a step later unless needed now (nonfinite.py); False: 'skip' it.
            if i == 0 and not self.health.check(self, losses):  # under 'off' the preemption vote alone
                return False  # skip: every optimizer's gradients are dropped, no step
            automatic.clip(self, optimizer)  # the module's configure_gradient_clipping, with our clip settings
            return True

        # Step and zero each optimizer (clipped in before_step): the core the memory planner traces (step.py).
        shared_step.optimizer_update(strategy, self.model, strategy.optimizers, before_step=before_step)
        self.state.global_step += 1

    # ------------------------------------------------------- test and predict (evaluation.py)
    def test(self, model=None, dataloaders=None, ckpt_path=None, verbose=True, datamodule=None) -> List[Dict]:
        """test_step over the test loaders (given, or test_dataloader()); one dict of epoch metrics per loader."""
        return evaluation.run(self, "test", model, dataloaders, datamodule, ckpt_path, self._enter_stage, verbose)

    def predict(self, model=None, dataloaders=None, datamodule=None, return_predictions=None, ckpt_path=None) -> Any:
        """predict_step over the predict loaders; this rank's predictions per batch (a list per loader if several)."""
        return evaluation.run(
            self, "predict", model, dataloaders, datamodule, ckpt_path, self._enter_stage, True, return_predictions
        )

    def _enter_stage(self, stage: str, module: TrainModule, datamodule: Any, ckpt_path: Optional[str]) -> None:
        """Set up test / predict: the world, the model (built once), a checkpoint's weights, the loggers."""
        setup.launch_if_needed(self.devices, self.num_nodes)
        self.stage = stage
        if datamodule is not None:
            self._data_sources = (None, None, datamodule)
        self._setup(module, need_train_data=False, stage=stage)
        if ckpt_path is not None:
            self._restore(evaluation.resolve_ckpt_path(self, ckpt_path, self._configure_optimizers))
        setup.setup_loggers(self.loggers, self.strategy, self.logged_hyperparameters)

    # -------------------------------------------------------------- validation
    def validate(
        self,
        model: Optional[TrainModule] = None,
        dataloaders: Optional[Iterable] = None,
        ckpt_path: Optional[str] = None,
        verbose: bool = True,
        datamodule: Any = None,
    ) -> List[Dict[str, float]]:
        """Run validation_step over `dataloaders` (or the datamodule's, or fit's); return the epoch metrics."""
        setup.launch_if_needed(self.devices, self.num_nodes)
        self.stage = "validate"
        dataloaders, datamodule = arguments.check_eval_data("validate", dataloaders, datamodule)
        if datamodule is not None:
            self._data_sources = (None, None, datamodule)
        module = arguments.unwrap_compiled(model) if model is not None else self.module
        if module is None:
            raise ValueError("validate() needs a module (or a previous fit()).")
        fresh = not (self._set_up and self.module is module)
        self._setup(module, need_train_data=False)
        if dataloaders is None and datamodule is not None:  # its setup ran in _setup; its loader, not fit's
            dataloaders = self._resolved_data[1] if fresh else datamodule.val_dataloader()
        if dataloaders is None and self.val_dataloaders is None:
            dataloaders = self._resolved_data[1]  # the module's or datamodule's val_dataloader()
        if dataloaders is not None:
            self.val_dataloaders = self.strategy.setup_dataloader(dataloaders, shuffle=False)
        if self.val_dataloaders is None:
            raise ValueError("validate() needs dataloaders (none were given here or to fit()).")
        if ckpt_path is not None:  # a training checkpoint, optimizers included ("best" as test() takes it)
            self._restore(evaluation.resolve_ckpt_path(self, ckpt_path, self._configure_optimizers))
        setup.setup_loggers(self.loggers, self.strategy, self.logged_hyperparameters)
        with lightning_hooks.running(self, "validate"):  # on_exception if it fails, teardown("validate")
            return [run_validation(self)]

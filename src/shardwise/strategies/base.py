"""The small contract every strategy fulfils -- also the low-level API.

A strategy owns everything that differs between one device, DDP, FSDP and
DeepSpeed: process-group setup, where `configure_model` builds (meta device
or not), how the model is wrapped, precision, backward, gradient sync during
accumulation, clipping, the optimizer step and its checkpoint format. The
Trainer only calls these methods, so a user who prefers a hand-written loop
can call them too (see docs/scaling.md, "Without the Trainer"):

    strategy = FSDPStrategy(auto_wrap_policy={Block})
    strategy.setup_environment()
    with strategy.module_init_context():
        model = GPT(config)
    model = strategy.setup_module(model)
    optimizer = strategy.setup_optimizer(torch.optim.AdamW(model.parameters()))
    for batch in strategy.setup_dataloader(loader):
        batch = shardwise.move_to_device(batch, strategy.root_device)
        with strategy.autocast():
            loss = model(batch)
        strategy.backward(loss)
        strategy.clip_gradients(model, optimizer, max_norm=1.0)
        strategy.optimizer_step(optimizer)
        optimizer.zero_grad()
"""

from __future__ import annotations

import atexit
import contextlib
import datetime
import random
import sys
import warnings
from contextvars import ContextVar
from dataclasses import replace
from typing import Any, Callable, Dict, Iterator, List, Optional, Tuple, Union

import torch
import torch.distributed as dist
from torch import nn
from torch._guards import active_fake_mode
from torch.distributed.fsdp.wrap import enable_wrap

from shardwise.checkpoint.formats import load_model_and_optimizers, save_model_and_optimizers
from shardwise.data import distribute_dataloader
from shardwise.distributed import context, faults, ops
from shardwise.distributed.env import (
    DistEnv,
    backend_for,
    detect_env,
    device_for,
    resolve_accelerator,
    set_cpu_threads,
    single_process_env,
    tune_cpu_allocator,
)
from shardwise.precision import Precision, build_precision
from shardwise.strategies.compile import RecompileWatch, apply_compile, build_compile_options, compile_mode
from shardwise.strategies.experts import clip_norm_by_mesh
from shardwise.strategies.materialize import has_meta_tensors, materialize_module
from shardwise.strategies.parallel import ParallelPlan

# Set while configure_model runs, so `shardwise.wrap(m)` reaches the strategy.
_ACTIVE_WRAP: ContextVar[Optional[Callable[[nn.Module], nn.Module]]] = ContextVar("shardwise_wrap", default=None)


def wrap(module: nn.Module) -> nn.Module:
    """Shard `module` as its own FSDP unit when called inside `configure_model` under FSDP.

    A no-op under every other strategy, so a model that wraps by hand runs
    unchanged on one device or with DDP.
    """
    fn = _ACTIVE_WRAP.get()
    return fn(module) if fn is not None else module


def global_seed() -> int:
    """The seed every rank agrees on (seed_everything's, else rank 0's random draw)."""
    if context.current().seed is not None:  # launched workers get the launching process's
        return context.current().seed
    return context.update(seed=ops.broadcast_object(random.randint(0, 2**31 - 1))).seed


def _leave_process_group(failing: bool = False) -> None:
    """Leave together, then destroy. A rank that tears its transport down while a peer still talks to
    it can abort in C++ ("terminate called without an active exception"), seen when one rank left
    while another was still writing a file; a barrier first makes every rank leave at once. Not when
    `failing`: the peers may be stuck in a collective, and the error must surface now."""
    if dist.is_available() and dist.is_initialized():
        if not failing:
            try:
                ops.barrier("exit", timeout_s=60.0)
            except Exception:  # a peer is gone already: nothing to wait for
                pass
        dist.destroy_process_group()


def generation_store(env: DistEnv, timeout_s: float) -> dist.Store:
    """The rendezvous store of `env` (the elastic agent's, or one rank 0 serves) under a prefix of its own for
    each process group this rank creates on it. The agent's store outlives a process group, and a second fit
    in the same workers names its groups as the first did (torch counts from 0 again), so gloo read the first
    generation's stale peer addresses and hung. Each rank counts its generations in the store (a restarted
    worker continues the count): every rank of one generation agrees on the prefix, no older key is read."""
    url = f"tcp://{env.master_addr}:{env.master_port}?rank={env.global_rank}&world_size={env.world_size}"
    store, _, _ = next(dist.rendezvous(url, timeout=datetime.timedelta(seconds=timeout_s)))
    store.set_timeout(datetime.timedelta(seconds=timeout_s))
    generation = store.add(f"shardwise/generations/rank{env.global_rank}", 1)
    return dist.PrefixStore(f"shardwise/generation{generation}", store)


def _destroy_process_group() -> None:
    """At exit. Python sets sys.last_value before the atexit handlers after an uncaught exception."""
    _leave_process_group(failing=getattr(sys, "last_value", None) is not None)


class Strategy:
    """Base class: one device, no communication. Subclasses override what differs."""

    name = "single"
    #: build configure_model on the meta device and materialise after wrapping
    init_on_meta = True
    #: create a private process group of one when no launcher started this process
    #: (FSDP2's device mesh and DeepSpeed's comm layer cannot run without one)
    needs_process_group = False
    # Capabilities the Trainer asks about instead of checking which strategy runs:
    #: parameters, gradients or optimizer state are partitioned across ranks (FSDP, every ZeRO
    #: stage), so a module set up by this strategy cannot move to another run's strategy
    is_sharded = False
    #: a step with non-finite values can be dropped (Trainer(non_finite="skip")); False where an
    #: engine takes every step itself
    can_skip_step = True

    def __init__(
        self, precision: Union[str, Precision, None] = None, timeout_s: float = 1800.0, compile: Any = None
    ) -> None:
        self._precision_arg = precision
        self.precision: Optional[Precision] = None
        self.timeout_s = timeout_s
        self.accelerator = "cpu"
        self.env: DistEnv = single_process_env()
        self.root_device = torch.device("cpu")
        self.module: Optional[nn.Module] = None
        self.optimizers: List[torch.optim.Optimizer] = []
        self.lr_schedulers: List[Dict[str, Any]] = []
        self.grad_scaler: Optional[torch.amp.GradScaler] = None
        self._owns_process_group = False
        # Materialisation mode: None = allocate and initialise (training); a FakeTensorMode =
        # fake tensors of the same shapes and shards under it (planning; setup_fake_environment).
        self.fake_mode: Any = None
        # torch.compile per block (compile.py): options, the compiled modules' names, the recompile watch.
        self.compile_options = build_compile_options(compile)
        self.compiled: List[str] = []
        self.recompile_watch: Optional[RecompileWatch] = None
        self._parameters_of: Optional[Tuple[nn.Module, List[nn.Parameter]]] = None  # see _grads

    @property
    def parallel_plan(self) -> ParallelPlan:
        """This strategy described as a ParallelPlan; `build_strategy(plan)` gives an equivalent strategy
        for the named configurations (strategies/names.py). Subclasses add their engine's options."""
        precision = getattr(self._precision_arg, "name", self._precision_arg)
        return ParallelPlan(engine=self.name, precision=precision, compile=compile_mode(self.compile_options))

    def configure_compile(self, value: Any, source: str = "compile") -> None:
        """Receive `compile=` (the strategy's own, or the Trainer's: `source` names it) before set-up.

        Refused here, before any worker starts, where the engine cannot compile (ParallelPlan's checks) or
        where the Trainer and the strategy ask for different things."""
        options = build_compile_options(value, source)
        if options is None:
            return
        if self.compile_options is not None and self.compile_options != options:
            raise ValueError(
                f"The strategy was given compile={self.compile_options!r} but {source}={value!r}; set it in one place."
            )
        replace(self.parallel_plan, compile=options.mode)  # the plan refuses what the engine cannot compile
        self.compile_options = options

    def apply_compile(self, module: nn.Module, units: Any = None) -> None:
        """torch.compile the blocks (or networks) in place: after activation checkpointing, before sharding.
        Not while planning: the planner traces the eager model under fake tensors."""
        if self.compile_options is None or self.fake_mode is not None:
            return
        self.compiled = apply_compile(module, self.compile_options, units)
        self.recompile_watch = RecompileWatch(self.compile_options.max_recompiles, rank=self.global_rank)

    # ------------------------------------------------------------------ set-up
    def connect(
        self,
        accelerator: str = "auto",
        precision: Union[str, Precision, None] = None,
        num_nodes: int = 1,
        devices: int = 1,
        timeout_s: Optional[float] = None,
    ) -> None:
        """Receive the Trainer's settings (accelerator, precision, layout, collective timeout) before setup."""
        self.accelerator = resolve_accelerator(accelerator)
        if timeout_s is not None:  # Trainer(timeout_s=...) wins over the strategy's default
            if isinstance(timeout_s, bool) or not isinstance(timeout_s, (int, float)) or timeout_s <= 0:
                raise ValueError(
                    f"timeout_s={timeout_s!r}: use a positive number of seconds (how long a "
                    "collective waits for a rank that stopped responding before the run fails)."
                )
            self.timeout_s = float(timeout_s)
        if precision is not None and self._precision_arg is not None:
            mine = build_precision(self._precision_arg, self.accelerator).name
            theirs = build_precision(precision, self.accelerator).name
            if mine != theirs:
                # Where the strategy's came from, when not its own precision= (a MixedPrecision object).
                source = getattr(self, "precision_source", None)
                raise ValueError(
                    f"The strategy was given precision={mine!r}{f' (by {source})' if source else ''} but the "
                    f"Trainer precision={theirs!r}; set it in one place (leave Trainer(precision=...) out to "
                    "use the strategy's)."
                )
        self.precision = build_precision(precision or self._precision_arg or "32-true", self.accelerator)
        self.num_nodes = num_nodes
        self.devices = devices

    def configure_training(
        self,
        accumulate_grad_batches: int = 1,
        gradient_clip_val: Optional[float] = None,
        gradient_clip_algorithm: str = "norm",
        micro_batch_size: Optional[int] = None,
    ) -> None:
        """Receive the loop's settings before launch; a no-op unless the engine owns them.

        DeepSpeed's engine does accumulation, clipping and sizes its buffers by
        the micro-batch, so it must know them before it is built (and can
        refuse a contradiction with its own config before any worker starts).
        """

    def setup_environment(self) -> None:
        """Join (or create) the process group and pick this rank's device."""
        if self.precision is None:
            self.connect()
        self.env = detect_env() or single_process_env()
        self.root_device = device_for(self.accelerator, self.env.local_rank)
        if self.root_device.type == "cuda":
            torch.cuda.set_device(self.root_device)
        else:
            set_cpu_threads(self.env.local_world_size)
            tune_cpu_allocator()
        if self.env.is_distributed:
            # Every rank keeps a progress record and records its own uncaught
            # exception, so a launcher can name the rank that failed first or
            # stopped responding (distributed/faults.py).
            faults.install_worker(collective_timeout_s=self.timeout_s)
            faults.apply_collective_timeout(self.timeout_s)  # also for groups made later (ZeRO, hybrid shard)
        if not dist.is_initialized():
            if self.env.is_distributed:
                faults.maybe_check_collectives(self.name)
                self._init_process_group(
                    self.env.global_rank,
                    self.env.world_size,
                    store=generation_store(self.env, self.timeout_s),
                )
            elif self.needs_process_group:
                # A world of one rendezvous with itself: an in-process store, no port. (A tcp://
                # rendezvous under torch's elastic agent, which sets TORCHELASTIC_USE_AGENT_STORE,
                # would wait for the agent's store at that address instead of serving one.)
                self._init_process_group(0, 1, store=dist.HashStore())
        self.grad_scaler = self.precision.grad_scaler(self.root_device)

    def _init_process_group(
        self, rank: int, world_size: int, init_method: Optional[str] = None, store: Optional[dist.Store] = None
    ) -> None:
        """The one place shardwise creates the default process group (and destroys it at exit)."""
        dist.init_process_group(
            backend=backend_for(self.root_device.type),
            rank=rank,
            world_size=world_size,
            timeout=datetime.timedelta(seconds=self.timeout_s),
            init_method=init_method,
            store=store,
            # NCCL bound to this rank's GPU: communicators are created eagerly on it,
            # and mesh subgroups / point-to-point pairs split from it instead of each
            # building its own (the recipe's loader would otherwise add W-1 on rank 0).
            device_id=self.root_device if self.root_device.type == "cuda" else None,
        )
        self._owns_process_group = True
        atexit.register(_destroy_process_group)

    def setup_fake_environment(self, env: DistEnv, fake_mode: Any) -> None:
        """Instead of setup_environment, for the memory planner: be rank `env.global_rank` of `env`'s world
        without joining it, and materialise fake tensors under `fake_mode` instead of allocating.

        Everything else -- setup_module's wrapping, sharding and checkpointing, the
        steps -- then runs the code training runs. Collectives need a process group:
        the planner creates a fake one (torch's "fake" backend) before calling this.
        No device is selected, no thread count changed, no fault handler installed.
        """
        if self.precision is None:
            self.connect()
        self.env = env
        self.root_device = device_for(self.accelerator, env.local_rank)
        self.fake_mode = fake_mode

    # ------------------------------------------------------------ properties
    @property
    def world_size(self) -> int:
        return self.env.world_size

    @property
    def global_rank(self) -> int:
        return self.env.global_rank

    @property
    def local_rank(self) -> int:
        return self.env.local_rank

    @property
    def node_rank(self) -> int:
        return self.env.node_rank

    @property
    def is_global_zero(self) -> bool:
        return self.env.global_rank == 0

    @property
    def data_parallel_size(self) -> int:
        """How many ranks read different samples (the sampler's replicas): the world, less the ranks of a
        sequence- or tensor-parallel group, which read the same samples (FSDPStrategy)."""
        return self.world_size

    @property
    def data_parallel_rank(self) -> int:
        """This rank's index among the `data_parallel_size` readers of different samples."""
        return self.global_rank

    def check_batch(self, batch: Any) -> None:
        """Called on each epoch's first batch: a strategy whose ranks must read the same samples checks
        that they do (FSDPStrategy under sp/tp). Every rank reads its own share here: nothing to check."""

    @property
    def gradient_sum_scale(self) -> float:
        """The factor that turns this strategy's gradients into a plain sum over ranks and micro-batches.

        Multiply each micro-batch's loss by it before `backward`, and the gradient
        left at the optimizer step is the sum of every rank's and every micro-batch's
        own gradient: it undoes the averaging the strategy does itself. DDP, FSDP
        (the reduce-scatter and a replica all-reduce both average) and every ZeRO
        stage average over the data-parallel world, so it is that world's size; the
        micro-batches of a window add up (`backward` never divides by the window;
        DeepSpeedStrategy keeps its engine from dividing by the accumulation count).
        The Trainer multiplies a summed loss by it divided by the step's global weight
        (TrainModule.loss_weight), which gives the gradient of the global mean. A
        strategy that averages otherwise overrides it.
        """
        return float(self.world_size)

    # ------------------------------------------------------------------ model
    @contextlib.contextmanager
    def module_init_context(self) -> Iterator[None]:
        """Where configure_model builds: the meta device, in the storage dtype."""
        dtype_ctx = self.precision.default_dtype() if self.precision.casts_module else contextlib.nullcontext()
        device_ctx = torch.device("meta") if self.init_on_meta else self.root_device
        token = _ACTIVE_WRAP.set(self._manual_wrap)
        try:
            # torch.distributed.fsdp.wrap.wrap() is a silent no-op outside its
            # enable_wrap context: make it mean shardwise.wrap, as the guides use it.
            with dtype_ctx, device_ctx, enable_wrap(wrapper_cls=self._torch_wrap):
                yield
        finally:
            _ACTIVE_WRAP.reset(token)

    def _torch_wrap(self, module: nn.Module, **overrides: Any) -> nn.Module:
        if overrides:
            warnings.warn(
                f"wrap(..., {', '.join(overrides)}=...) inside configure_model: shardwise shards the "
                "module as its own unit with the strategy's settings; per-unit overrides are ignored.",
                stacklevel=3,
            )
        return self._manual_wrap(module)

    def _manual_wrap(self, module: nn.Module) -> nn.Module:
        return module

    def materialize(self, module: nn.Module, device: Optional[torch.device] = None) -> None:
        """Allocate and initialise meta tensors on `device` (default: this rank's): the same weights under any strategy.

        In fake mode (setup_fake_environment) every tensor becomes a fake one of the same
        shape instead: nothing is allocated and no initialisation runs.
        """
        if self.fake_mode is not None:
            with self.fake_mode if active_fake_mode() is not self.fake_mode else contextlib.nullcontext():
                module.to_empty(device=device or self.root_device)
            return
        if has_meta_tensors(module):
            init_weights = getattr(module, "init_weights", None)
            materialize_module(
                module, device or self.root_device, global_seed(), init_weights if callable(init_weights) else None
            )

    def _prepare(self, module: nn.Module) -> nn.Module:
        """Shared first step: the storage dtype for the true precisions (64-true, bf16-true, 16-true), then device."""
        if self.precision.casts_module and not has_meta_tensors(module):
            module = module.to(self.precision.param_dtype)
        return module

    def setup_module(self, module: nn.Module) -> nn.Module:
        module = self._prepare(module)
        self.materialize(module)
        if self.fake_mode is None:  # fake tensors are made on root_device and cannot be swapped by .to
            module = module.to(self.root_device)
        self.apply_compile(module)  # then DDP replicates it (ddp.py)
        self.module = module
        return module

    def setup_optimizer(self, optimizer: torch.optim.Optimizer) -> torch.optim.Optimizer:
        self._parameters_of = None  # a model being set up (again): its parameters are listed anew
        self.optimizers.append(optimizer)
        return optimizer

    def setup_dataloader(self, dataloader, shuffle: Optional[bool] = None, seed: Optional[int] = None):
        return distribute_dataloader(
            dataloader,
            self.data_parallel_size,
            self.data_parallel_rank,
            seed=global_seed() if seed is None else seed,
            shuffle=shuffle,
        )

    # ------------------------------------------------------------------ steps
    def autocast(self) -> contextlib.AbstractContextManager:
        return self.precision.autocast(self.root_device)

    def call(self, model: nn.Module, method: str, *args: Any, **kwargs: Any) -> Any:
        """Run `module.<method>(*args)` through `model.__call__`, so wrappers' hooks fire.

        FSDP gathers parameters and DDP prepares gradient sync in forward
        hooks; a training_step that calls submodules directly would bypass
        the root's hooks. Redirecting forward once makes the step look like
        a forward call to every wrapper.
        """
        inner = self.unwrap(model)
        original = inner.forward
        own = inner.__dict__.get("forward")  # an instance's own forward (torch.compile's) stays after the call

        def redirected(*a: Any, **k: Any) -> Any:
            inner.forward = original  # restore before the user's code runs
            return getattr(inner, method)(*a, **k)

        inner.forward = redirected
        try:
            return model(*args, **kwargs)
        finally:
            if own is not None:
                inner.forward = own
            else:
                inner.__dict__.pop("forward", None)

    def unwrap(self, model: nn.Module) -> nn.Module:
        return model

    def backward(self, loss: torch.Tensor, model: Optional[nn.Module] = None) -> None:
        if self.grad_scaler is not None:
            loss = self.grad_scaler.scale(loss)
        loss.backward()

    def no_backward_sync(self, model: nn.Module, enabled: bool) -> contextlib.AbstractContextManager:
        """Skip gradient communication for a non-final micro-batch."""
        return contextlib.nullcontext()

    # Manual optimization (TrainModule.automatic_optimization = False; trainer/manual.py): training_step
    # runs its own backward passes and optimizer steps, possibly several per batch.
    def manual_model(self, model: nn.Module) -> nn.Module:
        """What a manually optimizing training_step runs through: the wrapped model (its hooks gather shards)."""
        return model

    def gathered(self, model: nn.Module) -> contextlib.AbstractContextManager:
        """Every parameter of `model` whole on this rank for the block, so that any submodule can be called
        directly (TrainModule.gathered, for inference after fit); a no-op unless parameters are sharded."""
        return contextlib.nullcontext()

    def manual_backward(self, loss: torch.Tensor, model: nn.Module, **kwargs: Any) -> None:
        """`self.manual_backward(loss, **kwargs)`: the backward of automatic mode; keyword arguments
        (retain_graph=True) go to torch's backward."""
        if not kwargs:
            self.backward(loss, model)
            return
        if self.grad_scaler is not None:
            loss = self.grad_scaler.scale(loss)
        loss.backward(**kwargs)

    def _grads(self, model: nn.Module) -> List[torch.Tensor]:
        # A set-up model's parameters, listed once per set-up: walking the module tree at every step costs more.
        if self._parameters_of is None or self._parameters_of[0] is not model:
            self._parameters_of = (model, list(model.parameters()))
        return [p for p in self._parameters_of[1] if p.grad is not None]

    def gradients(self, model: nn.Module) -> List[torch.Tensor]:
        """This rank's gradient tensors (its shards, where sharded), e.g. to check them for NaN/inf."""
        return [p.grad for p in self._grads(model)]

    def clip_gradients(
        self,
        model: nn.Module,
        optimizer: torch.optim.Optimizer,
        max_norm: Optional[float] = None,
        max_value: Optional[float] = None,
    ) -> Optional[torch.Tensor]:
        """Clip by global norm (or value); return the total norm before clipping."""
        if self.grad_scaler is not None:
            self.grad_scaler.unscale_(optimizer)
        params = self._grads(model)
        if max_value is not None:
            torch.nn.utils.clip_grad_value_(params, max_value)
        if max_norm is None:
            return None
        return clip_norm_by_mesh(params, max_norm, self._full_norm)  # experts (ep) sit on a mesh of their own

    def _full_norm(self, total: torch.Tensor) -> torch.Tensor:
        return total

    def optimizer_step(self, optimizer: torch.optim.Optimizer) -> bool:
        """Step; return False when the fp16 scaler skipped it because of inf/nan."""
        if self.recompile_watch is not None:  # warns once if a compiled block keeps recompiling
            self.recompile_watch.step()
        if self.grad_scaler is None:
            optimizer.step()
            return True
        scale = self.grad_scaler.get_scale()
        self.grad_scaler.step(optimizer)
        self.grad_scaler.update()
        return self.grad_scaler.get_scale() >= scale

    # ------------------------------------------------------------ collectives
    def reduce(self, value: Any, op: str = "mean") -> torch.Tensor:
        return ops.reduce(value, op, device=self.root_device if self.accelerator == "cuda" else None)

    def barrier(self, name: str = "") -> None:
        ops.barrier(name)

    def broadcast(self, obj: Any, src: int = 0) -> Any:
        return ops.broadcast_object(obj, src)

    # ------------------------------------------------------------ checkpoints
    # The contract between a strategy and shardwise.checkpoint (which owns
    # everything else: paths, temporary names, the atomic rename, `last`,
    # pruning, trainer progress, RNG, callbacks; see checkpoint/layout.py).
    #
    # checkpoint_format: the name recorded in the checkpoint's manifest and
    #   used to pick a reader. Built in: "full" (one torch file: the
    #   consolidated model under "state_dict", optimizers under
    #   "optimizer_states" keyed by parameter name, plus the trainer state at
    #   the top level) and "sharded" (a directory: torch.distributed.checkpoint
    #   files, one per rank, + trainer_state.pt + shardwise.json). A strategy
    #   with its own engine format (e.g. "deepspeed") names it here.
    #
    # save_checkpoint(path, state): called on EVERY rank at the same point in
    #   the loop (it may run collectives). `path` is a temporary name that does
    #   not exist yet; write there and nowhere else: a file (rank 0 writes it)
    #   or a directory (any rank may write into it). Never rename or delete:
    #   the caller commits after every rank has returned. `state` is the
    #   trainer's part (progress, every rank's RNG, schedulers, callbacks,
    #   hparams, and state["shardwise"], the manifest), identical and
    #   picklable on every rank; store it so load_checkpoint can return it
    #   unchanged. Directory formats: call
    #   `shardwise.checkpoint.layout.write_trainer_state(path, state)` on rank 0,
    #   which also writes the manifest that makes the directory recognisable.
    #   Return None once this rank's bytes are written and flushed, or a
    #   concurrent.futures.Future that completes when they are (async saves);
    #   the caller waits for it before committing.
    #
    # load_checkpoint(path, checkpoint_format): called on every rank after
    #   setup (model wrapped, optimizers built). Load the model and optimizer
    #   state found at `path` (a committed checkpoint in `checkpoint_format`)
    #   into self.module / self.optimizers and return the `state` dict that was
    #   saved with it. For a format this strategy cannot read, raise
    #   shardwise.checkpoint.errors.CheckpointFormatError saying what to do;
    #   the built-in "full" / "sharded" readers below work for any model that
    #   torch.distributed.checkpoint.state_dict understands.
    @property
    def checkpoint_format(self) -> str:
        return "full"

    def save_checkpoint(self, path: str, state: Dict[str, Any]) -> Optional[Any]:
        return save_model_and_optimizers(
            self.module,
            self.optimizers,
            path,
            state,
            self.checkpoint_format,
            async_save=bool(getattr(self, "async_save", False)),
        )

    def load_checkpoint(self, path: str, checkpoint_format: str) -> Dict[str, Any]:
        return load_model_and_optimizers(self.module, self.optimizers, path, checkpoint_format)

    def model_state_dict(self, model: nn.Module) -> Dict[str, torch.Tensor]:
        return self.unwrap(model).state_dict()

    def teardown(self) -> None:
        if self._owns_process_group and dist.is_initialized():
            _leave_process_group(failing=sys.exc_info()[0] is not None)
            self._owns_process_group = False

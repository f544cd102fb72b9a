"""DeepSpeed ZeRO (stages 0-3, CPU offload, activation partitioning) behind the strategy contract.

DeepSpeed's engine owns more of the loop than PyTorch's wrappers do: it
accumulates, clips, scales fp16 losses and steps, all driven by one JSON
config. The user's arguments, an optional config (dict or JSON path) and
the Trainer's settings become that config (deepspeed_config.py): the
explicit config wins, our settings fill what it leaves open, and a
contradiction is an error naming both values, raised in the user's process
before any worker starts. The engine is then driven through the ordinary contract:
`no_backward_sync` marks the accumulation boundary, `backward` / `optimizer_step`
call the engine, `clip_gradients` defers to the engine's clipping, so the
Trainer loop stays strategy-agnostic. Weights start equal to DDP's: stages 0-2
build on the meta device and materialise with materialize.py's per-module
seeds; stage 3 builds under `deepspeed.zero.Init` (no rank ever holds the
whole model) and re-runs each module's init on its gathered parameters under
the same per-module seeds. On CPU, DeepSpeed runs with DS_ACCELERATOR=cpu over
the gloo group our base class created. Checkpoints go through the engine
(its sharded layout) and are converted with zero_to_fp32, checked against a
manifest of every parameter (see deepspeed_checkpoint.py).
"""

from __future__ import annotations

import contextlib
import copy
import importlib
import logging
import warnings
from dataclasses import replace
from typing import Any, Dict, Iterator, List, Optional, Union

import torch
import torch.distributed as dist
from torch import nn

from shardwise.distributed.env import drop_env_defaults
from shardwise.strategies.base import Strategy, global_seed
from shardwise.strategies.deepspeed_checkpoint import load_engine_checkpoint, save_engine_checkpoint
from shardwise.strategies.deepspeed_config import (
    DeepSpeedConfigError,
    build_config,
    cpu_adam_problem,
    lightning_options,
    load_config,
    offload_enabled,
    precision_from_config,
    size_limits,
)
from shardwise.strategies.deepspeed_env import apply_rank_env, ensure_accelerator_env, import_deepspeed
from shardwise.strategies.deepspeed_grads import local_gradients
from shardwise.strategies.deepspeed_zero3 import before_zero_init, check_zero3_dtypes, init_zero3_module
from shardwise.strategies.fsdp import build_policy_fn, describe_modules
from shardwise.strategies.materialize import rng_devices


class DeepSpeedStrategy(Strategy):
    """ZeRO data parallelism through DeepSpeed's engine. See docs/deepspeed.md for every knob.

    Arguments left as None take the config's value, else the default (stage 2,
    no offload, no activation partitioning); arguments that are set must agree
    with the config.
    """

    name = "deepspeed"
    needs_process_group = True  # DeepSpeed's collectives assume a group, even for one process
    is_sharded = True  # optimizer state from stage 1, gradients from 2, parameters at 3
    can_skip_step = False  # the engine takes every step

    def __init__(
        self,
        stage: Optional[int] = None,
        offload_optimizer: Optional[bool] = None,
        offload_parameters: Optional[bool] = None,
        partition_activations: Optional[bool] = None,
        cpu_checkpointing: Optional[bool] = None,
        contiguous_memory_optimization: Optional[bool] = None,
        activation_checkpointing_policy: Any = None,
        config: Union[None, str, Dict[str, Any]] = None,
        cpu_offload: Optional[bool] = None,
        logging_level: int = logging.WARNING,
        precision: Any = None,
        timeout_s: float = 1800.0,
        **lightning: Any,  # Lightning's other DeepSpeedStrategy arguments, set in the config (lightning_options)
    ) -> None:
        self.user_config = load_config(config)
        for key in ("optimizer", "scheduler"):
            if key in self.user_config:
                raise DeepSpeedConfigError(
                    f"The DeepSpeed config has a {key!r} section, but shardwise takes the optimizer and LR "
                    f"scheduler from configure_optimizers(). Remove the section and return the optimizer "
                    "there (DeepSpeedCPUAdam for offloaded training, or torch Adam/AdamW)."
                )
        if cpu_offload is not None:  # Lightning 1.x's DeepSpeedPlugin(cpu_offload=True)
            offload_optimizer = cpu_offload if offload_optimizer is None else offload_optimizer
            if (stage if stage is not None else self.user_config.get("zero_optimization", {}).get("stage")) == 3:
                offload_parameters = cpu_offload if offload_parameters is None else offload_parameters
        self.user_config, timeout = lightning_options(
            lightning, self.user_config, offload_parameters, offload_optimizer
        )
        super().__init__(precision=precision, timeout_s=timeout if timeout is not None else timeout_s)
        self.args = dict(
            stage=stage,
            offload_optimizer=offload_optimizer,
            offload_parameters=offload_parameters,
            partition_activations=partition_activations,
            cpu_checkpointing=cpu_checkpointing,
            contiguous_memory_optimization=contiguous_memory_optimization,
        )
        build_policy_fn(activation_checkpointing_policy, "activation_checkpointing_policy")
        self.activation_checkpointing_policy = activation_checkpointing_policy
        self.logging_level = logging_level
        self.loop: Dict[str, Any] = {}
        self.world_hint: Optional[int] = None
        self.config = self._build_config()  # validates now, in the user's process
        self.engine: Any = None
        self.num_checkpointed = 0
        if self.offload_optimizer:
            import_deepspeed(None, logging_level)
            problem = cpu_adam_problem()
            if problem is not None:
                raise DeepSpeedConfigError(
                    f"offload_optimizer=True steps the optimizer on the host with DeepSpeedCPUAdam, which is "
                    f"required here but unavailable: {problem}. Install it, or set offload_optimizer=False."
                )

    # ------------------------------------------------------------- config
    def _build_config(self) -> Dict[str, Any]:
        return build_config(
            self.user_config, self.args, self.precision.name if self.precision else None, self.loop, self.world_hint
        )

    @property
    def stage(self) -> int:
        return int(self.config["zero_optimization"]["stage"])

    @property
    def init_on_meta(self) -> bool:  # type: ignore[override]
        return self.stage < 3  # stage 3 builds real, already-sharded tensors under zero.Init

    @property
    def offload_optimizer(self) -> bool:
        return bool(offload_enabled(self.config["zero_optimization"], "offload_optimizer"))

    @property
    def offload_parameters(self) -> bool:
        return bool(offload_enabled(self.config["zero_optimization"], "offload_param"))

    @property
    def parallel_plan(self) -> Any:
        """This strategy as a ParallelPlan: ZeRO stage, offload, checkpointing (base.Strategy)."""
        policy = self.activation_checkpointing_policy
        return replace(
            super().parallel_plan,
            zero_stage=self.stage,
            ac="none" if policy is None else "full",
            blocks=policy,
            offload_params=self.offload_parameters,
            offload_optimizer=self.offload_optimizer,
        )

    def connect(
        self,
        accelerator: str = "auto",
        precision: Any = None,
        num_nodes: int = 1,
        devices: int = 1,
        timeout_s: Optional[float] = None,
    ) -> None:
        if precision is None and self._precision_arg is None:  # the config is the one place it is set
            self._precision_arg = precision_from_config(self.user_config)
            self.precision_source = "the DeepSpeed config" if self._precision_arg else None
        super().connect(accelerator, precision, num_nodes=num_nodes, devices=devices, timeout_s=timeout_s)
        ensure_accelerator_env(self.accelerator)
        self.world_hint = max(1, num_nodes * devices)
        self.config = self._build_config()

    def configure_training(
        self,
        accumulate_grad_batches: int = 1,
        gradient_clip_val: Optional[float] = None,
        gradient_clip_algorithm: str = "norm",
        micro_batch_size: Optional[int] = None,
    ) -> None:
        if gradient_clip_val is not None and gradient_clip_algorithm != "norm":
            raise DeepSpeedConfigError(
                "DeepSpeed clips gradients by global norm only; "
                f"gradient_clip_algorithm={gradient_clip_algorithm!r} is not available."
            )
        self.loop = dict(
            accumulate_grad_batches=accumulate_grad_batches,
            gradient_clip_val=float(gradient_clip_val) if gradient_clip_val is not None else None,
            micro_batch_size=micro_batch_size,
        )
        self.config = self._build_config()

    # ------------------------------------------------------------- set-up
    def setup_environment(self) -> None:
        if self.precision is None:
            self.connect()
        ensure_accelerator_env(self.accelerator)
        super().setup_environment()
        # DeepSpeed reads these even when the group exists (device choice, logging).
        apply_rank_env(self.env, self.root_device)
        deepspeed = import_deepspeed(self.accelerator, self.logging_level)
        # DeepSpeed's comm layer compiles a shared-memory all-reduce op on first use
        # (minutes on a fresh machine); it serves only inference_all_reduce, which
        # training never calls, so skip building it.
        ds_torch_comm = importlib.import_module("deepspeed.comm.torch")  # the attribute is shadowed by torch
        if getattr(importlib.import_module("deepspeed.comm.comm"), "cdb", None) is None and hasattr(
            ds_torch_comm, "build_shm_op"
        ):
            ds_torch_comm.build_shm_op = lambda: None
        # Adopt our process group instead of letting DeepSpeed create (or MPI-discover) one.
        deepspeed.comm.init_distributed(dist_backend=dist.get_backend(), dist_init_required=False, verbose=False)
        if deepspeed.comm.get_world_size() != dist.get_world_size():
            raise RuntimeError(
                f"deepspeed.comm sees world size {deepspeed.comm.get_world_size()} but the process "
                f"group has {dist.get_world_size()}."
            )
        self.world_hint = dist.get_world_size()
        self.config = self._build_config()
        self.grad_scaler = None  # DeepSpeed scales fp16 losses itself

    @property
    def scales_fp16_loss(self) -> bool:
        """fp16 under DeepSpeed's loss scaler: an inf gradient is its overflow signal (it skips that step
        and lowers the scale), not an error; found on an H200, where the health check stopped such runs."""
        return bool((getattr(self, "config", None) or {}).get("fp16", {}).get("enabled"))

    def setup_fake_environment(self, env: Any, fake_mode: Any) -> None:
        # The engine allocates its flat buffers and partitions in C++ and Python outside the
        # module's materialisation, so there is no fake mode to honour; the planner traces a
        # ZeRO stage as DDP and applies ZeRO's partitioning analytically (plan/analytic.py).
        raise NotImplementedError(
            "DeepSpeedStrategy cannot be set up on fake tensors; the memory planner traces "
            "ZeRO stages as DDP and partitions the states analytically."
        )

    @contextlib.contextmanager
    def module_init_context(self) -> Iterator[None]:
        """Stages 0-2: the meta device (materialised later, as DDP). Stage 3: zero.Init shards as it builds."""
        if self.stage < 3:
            with torch.device("meta"):
                yield
            return
        deepspeed = import_deepspeed(self.accelerator, self.logging_level)
        before_zero_init()
        remote = "cpu" if self.offload_parameters else None
        # dtype=None on purpose: zero.Init then takes the dtype from the config's
        # bf16 / fp16 sections. An explicit dtype is ignored by DeepSpeed (0.19.x,
        # `_set_dtype` operator precedence) on any accelerator without fp16
        # support, which silently built bf16 weights for an fp32 run on CPUs
        # without AVX512-FP16 (AMD EPYC). check_zero3_dtypes() guards the result.
        # fork_rng: construction-time init is thrown away (setup_module re-initialises),
        # so it must not advance the global RNG that DDP's meta build leaves untouched.
        with (
            torch.random.fork_rng(devices=rng_devices()),
            deepspeed.zero.Init(config_dict_or_path=copy.deepcopy(self.config), remote_device=remote, dtype=None),
        ):
            yield

    def _param_dtype(self) -> torch.dtype:
        if self.config.get("bf16", {}).get("enabled"):
            return torch.bfloat16
        if self.config.get("fp16", {}).get("enabled"):
            return torch.float16
        return torch.float32

    def setup_module(self, module: nn.Module) -> nn.Module:
        if self.stage == 3:
            check_zero3_dtypes(module, self._param_dtype())
            self._materialize_leftovers(module)
            init_zero3_module(module, global_seed())
        else:
            self.materialize(module)
            module = module.to(self.root_device)
        if self.activation_checkpointing_policy is not None:
            self.num_checkpointed = apply_deepspeed_checkpointing(module, self.activation_checkpointing_policy)
        elif self.config.get("activation_checkpointing", {}).get("partition_activations") or self.config.get(
            "activation_checkpointing", {}
        ).get("cpu_checkpointing"):
            warnings.warn(
                "partition_activations / cpu_checkpointing act only on layers run through "
                "deepspeed.checkpointing.checkpoint; pass activation_checkpointing_policy={YourBlock} "
                "to have shardwise wrap them.",
                stacklevel=2,
            )
        self._configure_activation_checkpointing()
        self.module = module
        return module

    def _materialize_leftovers(self, module: nn.Module) -> None:
        # Layers a TrainModule builds in __init__ are real; anything on meta outside
        # zero.Init would reach DeepSpeed unallocated, so materialise it as DDP would.
        if any(p.is_meta for p in module.parameters()) or any(b.is_meta for b in module.buffers()):
            self.materialize(module)

    def _configure_activation_checkpointing(self) -> None:
        ac = self.config.get("activation_checkpointing")
        if not ac and not self.num_checkpointed:
            return
        ac = ac or {}
        deepspeed = import_deepspeed(self.accelerator, self.logging_level)
        number = ac.get("number_checkpoints") or self.num_checkpointed or None
        if ac.get("contiguous_memory_optimization") and not number:
            raise DeepSpeedConfigError(
                "contiguous_memory_optimization=True needs the number of checkpointed "
                "layers: pass activation_checkpointing_policy={YourBlock} or set "
                "activation_checkpointing.number_checkpoints in the config."
            )
        deepspeed.checkpointing.configure(
            None,
            partition_activations=bool(ac.get("partition_activations")),
            contiguous_checkpointing=bool(ac.get("contiguous_memory_optimization")),
            num_checkpoints=number,
            checkpoint_in_cpu=bool(ac.get("cpu_checkpointing")),
            synchronize=bool(ac.get("synchronize_checkpoint_boundary")),
            profile=False,
        )

    def setup_optimizer(self, optimizer: torch.optim.Optimizer) -> torch.optim.Optimizer:
        """Build the engine around the model and this optimizer (DeepSpeed drives exactly one)."""
        if self.engine is not None:
            raise RuntimeError(
                "DeepSpeed drives exactly one optimizer per model, but configure_optimizers() "
                "returned more than one. Merge them into param groups of one optimizer."
            )
        if self.module is None:
            raise RuntimeError("Call setup_module(model) before setup_optimizer(optimizer).")
        deepspeed = import_deepspeed(self.accelerator, self.logging_level)
        optimizer = self._maybe_cpu_optimizer(optimizer)
        self._fill_size_limits()
        engine, ds_optimizer, _, _ = deepspeed.initialize(
            model=self.module, optimizer=optimizer, config=copy.deepcopy(self.config), dist_init_required=False
        )
        self.engine = engine
        self.optimizers.append(ds_optimizer)
        return ds_optimizer

    def _fill_size_limits(self) -> None:
        numels = [int(getattr(p, "ds_numel", p.numel())) for p in self.module.parameters()]
        self.config["zero_optimization"].update(size_limits(numels, self.user_config.get("zero_optimization")))

    def _maybe_cpu_optimizer(self, optimizer: torch.optim.Optimizer) -> torch.optim.Optimizer:
        """With the optimizer offloaded, the step runs on the host: DeepSpeed's CPU Adam is required.

        torch Adam / AdamW are swapped for DeepSpeedCPUAdam with the same
        hyperparameters. The param-group dicts are shared, so an LR scheduler
        built on the original optimizer still drives the new one.
        """
        if not self.offload_optimizer:
            return optimizer
        from deepspeed.ops.adagrad import DeepSpeedCPUAdagrad
        from deepspeed.ops.adam import DeepSpeedCPUAdam
        from deepspeed.ops.lion import DeepSpeedCPULion

        if isinstance(optimizer, (DeepSpeedCPUAdam, DeepSpeedCPUAdagrad, DeepSpeedCPULion)):
            return optimizer
        if type(optimizer) not in (torch.optim.Adam, torch.optim.AdamW):
            raise TypeError(
                f"offload_optimizer=True needs DeepSpeedCPUAdam (or DeepSpeedCPUAdagrad / DeepSpeedCPULion): the "
                f"offloaded step runs on the host. configure_optimizers() returned {type(optimizer).__name__}; "
                "return deepspeed.ops.adam.DeepSpeedCPUAdam(...) or torch.optim.AdamW (swapped automatically)."
            )
        groups = optimizer.param_groups
        if any(g.get("amsgrad") for g in groups):
            raise TypeError("DeepSpeedCPUAdam has no amsgrad; use amsgrad=False with offload_optimizer=True.")
        adamw = isinstance(optimizer, torch.optim.AdamW) or bool(groups[0].get("decoupled_weight_decay"))
        first = groups[0]
        return DeepSpeedCPUAdam(
            groups,
            lr=float(first["lr"]),
            betas=tuple(first["betas"]),
            eps=first["eps"],
            weight_decay=first["weight_decay"],
            adamw_mode=adamw,
        )

    # ------------------------------------------------------------- steps
    def require_engine(self) -> Any:
        """The DeepSpeed engine, or an error saying it is not built yet (steps and checkpoints need it)."""
        if self.engine is None:
            raise RuntimeError("The DeepSpeed engine is built by setup_optimizer(); call it before training.")
        return self.engine

    def autocast(self) -> contextlib.AbstractContextManager:
        # DeepSpeed casts the module itself (bf16 / fp16 sections); autocast on top
        # would mix two precision schemes.
        return contextlib.nullcontext()

    def call(self, model: nn.Module, method: str, *args: Any, **kwargs: Any) -> Any:
        """Route through the engine's forward (its hooks gather ZeRO-3 parameters and count steps)."""
        if self.engine is not None and (model is self.module or model is self.engine):
            model = self.engine
        return super().call(model, method, *args, **kwargs)

    def unwrap(self, model: nn.Module) -> nn.Module:
        return model.module if self.engine is not None and model is self.engine else model

    def backward(self, loss: torch.Tensor, model: Optional[nn.Module] = None, **kwargs: Any) -> None:
        # The Trainer already divided by the accumulation window (or by the step's global weight:
        # gradient_sum_scale), so the engine must not divide by gradient_accumulation_steps again.
        self.require_engine().backward(loss, scale_wrt_gas=False, **kwargs)

    def manual_backward(self, loss: torch.Tensor, model: nn.Module, **kwargs: Any) -> None:
        self.backward(loss, model, **kwargs)  # through the engine, retain_graph=... included

    def gathered(self, model: nn.Module) -> contextlib.AbstractContextManager:
        """ZeRO-3: every partitioned parameter gathered on every rank for the block (base.Strategy.gathered)."""
        if self.stage < 3:
            return contextlib.nullcontext()
        deepspeed = import_deepspeed(self.accelerator, self.logging_level)
        return deepspeed.zero.GatheredParameters(list(self.unwrap(model).parameters()), modifier_rank=None)

    @contextlib.contextmanager
    def no_backward_sync(self, model: nn.Module, enabled: bool) -> Iterator[None]:
        """Tell the engine whether this micro-batch ends the accumulation window.

        The engine reduces gradients (and, at the boundary, lets step() update)
        according to this flag, so it must be set before the backward. It is left
        set after the block because optimizer_step() follows the final one.
        """
        self.require_engine().set_gradient_accumulation_boundary(not enabled)
        yield

    def gradients(self, model: nn.Module) -> List[torch.Tensor]:
        """The gradients the engine holds after the window's last backward, before its step (the health check).

        From ZeRO-2 on DeepSpeed clears param.grad once it has reduced a gradient into its partitions, so the
        base class's answer would be empty and a NaN or all-zero step would pass unseen. ZeRO-1/2: this
        rank's averaged partition (fp32 `averaged_gradients`; with the optimizer offloaded, the fp32 partition
        it steps on). ZeRO-3: each trainable parameter's local fp32 partition. Each where it lives, once the
        engine's copies into it are complete (deepspeed_grads.py).
        """
        if self.engine is None or self.stage == 0:
            return super().gradients(model)
        trainable = [p for p in self.unwrap(model).parameters() if p.requires_grad]
        optimizer = self.engine.optimizer
        held = [g for g in local_gradients(optimizer, self.stage, self.offload_optimizer, trainable) if g is not None]
        if trainable and not held:  # never a silently empty check
            raise RuntimeError(
                f"Found no gradient in DeepSpeed {importlib.import_module('deepspeed').__version__}'s ZeRO-"
                f"{self.stage} optimizer ({type(optimizer).__name__}) after the backward: the non-finite and "
                "zero-gradient checks cannot run. Use Trainer(non_finite='off') with this DeepSpeed version "
                "(and report it), or the DeepSpeed version shardwise is tested with (see pyproject.toml)."
            )
        return held

    def clip_gradients(
        self,
        model: nn.Module,
        optimizer: torch.optim.Optimizer,
        max_norm: Optional[float] = None,
        max_value: Optional[float] = None,
    ) -> Optional[torch.Tensor]:
        """The engine clips inside step() at config['gradient_clipping']; this only checks they agree.

        Returns None: the norm exists only once the engine has stepped
        (`strategy.engine.get_global_grad_norm()`).
        """
        if max_value is not None:
            raise DeepSpeedConfigError("DeepSpeed clips by global norm only; clipping by value is not available.")
        configured = self.config.get("gradient_clipping") or 0.0
        if max_norm is not None and float(max_norm) != float(configured):
            raise DeepSpeedConfigError(
                f"clip_gradients(max_norm={max_norm}) but the engine clips at gradient_clipping={configured} "
                "inside its step. Pass the value before the engine is built: Trainer(gradient_clip_val=...) "
                "or strategy.configure_training(gradient_clip_val=...)."
            )
        return None

    def optimizer_step(self, optimizer: torch.optim.Optimizer) -> bool:
        engine = self.require_engine()
        if not engine.is_gradient_accumulation_boundary():
            raise RuntimeError(
                "optimizer_step() after a non-final micro-batch: run the last micro-batch of each "
                "window under strategy.no_backward_sync(model, enabled=False)."
            )
        engine.step()
        return bool(engine.was_step_applied())  # False when fp16 loss scaling skipped an overflow

    # ------------------------------------------------------------- state
    def model_state_dict(self, model: nn.Module) -> Dict[str, torch.Tensor]:
        """The full, unsharded state dict on every rank (gathers ZeRO-3 shards one module at a time)."""
        module = self.unwrap(model)
        if self.stage < 3:
            return {k: v.detach().clone() for k, v in module.state_dict().items()}
        deepspeed = import_deepspeed(self.accelerator, self.logging_level)
        out: Dict[str, torch.Tensor] = {}
        for prefix, mod in module.named_modules():
            own = list(mod.parameters(recurse=False))
            with deepspeed.zero.GatheredParameters(own, modifier_rank=None):
                for name, t in list(mod._parameters.items()) + list(mod._buffers.items()):
                    if t is not None and (name in mod._parameters or name not in mod._non_persistent_buffers_set):
                        out[f"{prefix}.{name}" if prefix else name] = t.detach().clone()
        return out

    @property
    def checkpoint_format(self) -> str:
        return "deepspeed"

    def save_checkpoint(self, path: str, state: Dict[str, Any]) -> None:
        """The engine's sharded files + trainer state + parameter list (see deepspeed_checkpoint.py)."""
        save_engine_checkpoint(self, path, state)

    def load_checkpoint(self, path: str, checkpoint_format: str = "deepspeed") -> Dict[str, Any]:
        """Load through the engine; another world size goes through DeepSpeed's universal checkpoint."""
        return load_engine_checkpoint(self, path, checkpoint_format)

    def teardown(self) -> None:
        self.engine = None
        super().teardown()
        drop_env_defaults()  # RANK / WORLD_SIZE set for DeepSpeed alone: not inherited by a later child process
        if not dist.is_initialized():
            # DeepSpeed caches the groups it derived from the one just destroyed
            # (data-parallel, world); a later run in this process would reach
            # them and fail with "Group ... is not registered". Drop them, as
            # deepspeed.comm.destroy_process_group does.
            from deepspeed.utils import groups

            release = getattr(groups, "_release_process_group_references", None)
            if release is not None:
                release(group=None)


# ----------------------------------------------------------------- helpers
def _trains(module: nn.Module) -> bool:
    return any(p.requires_grad for p in module.parameters())


def apply_deepspeed_checkpointing(root: nn.Module, policy: Any) -> int:
    """Run each module the policy selects through deepspeed.checkpointing.checkpoint.

    DeepSpeed's checkpointing is what partition_activations / cpu_checkpointing /
    contiguous_memory_optimization act on. Only tensor arguments are handed to
    it: keyword and non-tensor positional arguments (None, a tuple of rotary
    tables) are bound into the function, because DeepSpeed's partitioned path
    mis-counts non-tensor arguments when it rebuilds them for the backward.
    """
    fn = build_policy_fn(policy, "activation_checkpointing_policy")
    count = 0
    for module in root.modules():
        if module is root or getattr(module, "_shardwise_ds_checkpointed", False) or not fn(module, 0):
            continue
        original = module.forward

        def forward(*args: Any, _original=original, _module=module, **kwargs: Any) -> Any:
            from deepspeed import checkpointing

            if not torch.is_grad_enabled():  # validation: nothing to save for a backward
                return _original(*args, **kwargs)
            positions = [i for i, a in enumerate(args) if torch.is_tensor(a)]
            if not any(args[i].requires_grad for i in positions) and _trains(_module):
                # DeepSpeed's checkpoint is reentrant: with no input requiring grad (frozen embeddings
                # under LoRA) its output would not either, and the block's adapters would get no
                # gradient. A floating input made a leaf that requires grad keeps the graph (what
                # transformers' enable_input_require_grads does for the same reason).
                args = tuple(
                    a.detach().requires_grad_() if torch.is_tensor(a) and a.is_floating_point() else a for a in args
                )
            if kwargs or len(positions) < len(args):

                def run(*tensors: torch.Tensor) -> Any:
                    full = list(args)
                    for i, t in zip(positions, tensors):
                        full[i] = t
                    return _original(*full, **kwargs)

                return checkpointing.checkpoint(run, *(args[i] for i in positions))
            return checkpointing.checkpoint(_original, *args)

        module.forward = forward
        module._shardwise_ds_checkpointed = True
        count += 1
    if count == 0:
        raise ValueError(
            f"activation_checkpointing_policy={policy!r} matched no module of "
            f"{type(root).__name__}. The model contains: {describe_modules(root)}."
        )
    return count

"""FSDP on PyTorch's FSDP2 (`fully_shard`): shard parameters, gradients and optimizer state.

The order of set-up is fixed and matters (torchtitan's order):
1. `configure_model` builds on the meta device (nothing allocated);
2. activation checkpointing wraps the selected blocks, so recomputation
   happens inside each FSDP unit; with compile=True each block is then
   compiled (compile.py), its FSDP hooks left outside the compiled code;
3. `fully_shard` each block the wrap policy selects (children first), then
   the root, over a 1-D mesh (FULL_SHARD / SHARD_GRAD_OP) or a 2-D
   (replicate, shard) mesh (HYBRID_SHARD, NO_SHARD); with tensor or sequence
   parallel (tp_size / sp_size) the world is one (dp_replicate, dp_shard, sp,
   tp) mesh: tensor parallel is applied first, then sequence parallel, both
   before step 2, and FSDP shards over the data-parallel and sp ranks;
4. materialise only the local shards and initialise them with the same
   sharding-invariant init every strategy uses (materialize.py);
5. the optimizer is then built on the sharded (DTensor) parameters.
Lightning's names map onto FSDP2 like this: SHARD_GRAD_OP keeps parameters
gathered between forward and backward (reshard_after_forward=False),
NO_SHARD is a replicate-only 2-D mesh, and limit_all_gathers is always on in
FSDP2 (it rate-limits all-gathers by design), so the flag is accepted and
has nothing to switch.
"""

from __future__ import annotations

import contextlib
import inspect
import warnings
from collections import Counter
from dataclasses import replace
from typing import Any, Callable, Iterator, List, Optional, Sequence, Set, Tuple, Type, Union

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import (
    CheckpointImpl,
    CheckpointWrapper,
    checkpoint_wrapper,
)
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import CPUOffloadPolicy, FSDPModule, MixedPrecisionPolicy, fully_shard

from shardwise.distributed import ops
from shardwise.strategies import degrees, selective_ac
from shardwise.strategies.base import Strategy
from shardwise.strategies.fsdp_compat import (
    integer_params_to_ignore,
    manual_units,
    note_accepted,
    offload_flag,
    plain_class,
    precision_from_mixed_precision,
    sharding_strategy_name,
    state_dict_type_name,
)
from shardwise.strategies.local_optim import apply_local_shard_step, wants_local_step
from shardwise.strategies.materialize import has_meta_tensors
from shardwise.strategies.mesh import ParallelMesh, check_same_within_groups
from shardwise.strategies.parallel import ParallelPlan

ACCUMULATION_SYNCS = ("reduce_scatter", "none")

Policy = Union[None, Set[Type[nn.Module]], Sequence[Type[nn.Module]], Callable[..., bool], str, Sequence[str]]


def _inner(module: nn.Module) -> nn.Module:
    return module._checkpoint_wrapped_module if isinstance(module, CheckpointWrapper) else module


def build_policy_fn(policy: Policy, what: str) -> Optional[Callable[[nn.Module, int], bool]]:
    """Normalise a wrap / checkpoint policy to `fn(module, unwrapped_numel) -> bool`.

    Accepted forms: a set of module classes (`{Block}`), class
    names as strings (Hugging Face's `_no_split_modules`), a callable
    `module -> bool`, or an FSDP1-style policy such as
    `partial(size_based_auto_wrap_policy, min_num_params=...)`.
    """
    if policy is None:
        return None
    if isinstance(policy, str):
        policy = [policy]
    if isinstance(policy, type):
        policy = [policy]
    if isinstance(policy, (set, frozenset, list, tuple)):
        items = list(policy)
        classes = tuple(p for p in items if isinstance(p, type))
        names = {p for p in items if isinstance(p, str)}
        bad = [p for p in items if not isinstance(p, (type, str))]
        if bad or not items:
            raise TypeError(
                f"{what} must be a set of nn.Module classes (or class names), or a callable; got {policy!r}"
            )
        return lambda m, _numel: isinstance(m, classes) or type(m).__name__ in names
    if callable(policy):
        try:
            params = inspect.signature(policy).parameters
        except (TypeError, ValueError):
            params = {}
        if "recurse" in params:  # FSDP1-style: policy(module, recurse, nonwrapped_numel)
            fn = lambda m, numel: bool(policy(module=m, recurse=False, nonwrapped_numel=numel))  # noqa: E731
            # FSDP1 also asks whether to look inside a module at all (recurse=True): size-based
            # policies never descend into nn.MultiheadAttention, whose forward reads
            # out_proj.weight directly, so an out_proj unit would never be gathered.
            fn.descend = lambda m: bool(
                policy(module=m, recurse=True, nonwrapped_numel=sum(p.numel() for p in m.parameters()))
            )
            return fn
        return lambda m, _numel: bool(policy(m))
    raise TypeError(f"{what} must be a set of nn.Module classes, class names, or a callable; got {policy!r}")


def describe_modules(module: nn.Module, limit: int = 8) -> str:
    counts = Counter(type(_inner(m)).__name__ for m in module.modules() if not isinstance(m, CheckpointWrapper))
    return ", ".join(f"{name} ({n})" for name, n in counts.most_common(limit))


def apply_activation_checkpointing(
    module: nn.Module, policy: Policy, mode: str = "full", option: Union[str, int, None] = None
) -> int:
    """Wrap every module the policy selects in non-reentrant activation checkpointing.

    mode "full" recomputes each selected block; "selective" with option "op" saves matmul and
    attention outputs inside each block, with an integer N checkpoints every N-th block
    (selective_ac.py). Returns how many modules the policy selected.
    """
    fn = build_policy_fn(policy, "activation_checkpointing_policy")
    if fn is None:
        return 0
    mode, option = selective_ac.normalize(mode, option)
    count = 0
    for parent in list(module.modules()):
        for name, child in list(parent.named_children()):
            if isinstance(child, CheckpointWrapper) or isinstance(parent, CheckpointWrapper):
                continue
            if fn(child, 0):
                extra = selective_ac.checkpoint_kwargs(mode, option, count)
                if extra is not None:
                    setattr(
                        parent, name, checkpoint_wrapper(child, checkpoint_impl=CheckpointImpl.NO_REENTRANT, **extra)
                    )
                count += 1
    if count == 0:
        raise ValueError(
            f"activation_checkpointing_policy={policy!r} matched no module of {type(module).__name__}. "
            f"The model contains: {describe_modules(module)}. Pass the class of your transformer block."
        )
    return count


def _own_numel(module: nn.Module, done: Set[int]) -> int:
    """Parameters under `module` not already inside a selected unit (FSDP1 'nonwrapped_numel')."""
    total = 0
    for sub in module.modules():
        if id(sub) in done and sub is not module:
            continue
        total += sum(p.numel() for p in sub.parameters(recurse=False))
    return total


def select_units(module: nn.Module, policy: Policy) -> List[Tuple[str, nn.Module]]:
    """The submodules a wrap policy selects, children before parents (root excluded)."""
    fn = build_policy_fn(policy, "auto_wrap_policy")
    if fn is None:
        return []
    inside_wrapper = {id(m._checkpoint_wrapped_module) for m in module.modules() if isinstance(m, CheckpointWrapper)}
    descend = getattr(fn, "descend", None)
    not_entered: Set[int] = set()  # modules below one the FSDP1 policy does not recurse into
    if descend is not None:
        for sub in module.modules():
            if id(sub) not in not_entered and not descend(_inner(sub)):
                not_entered.update(id(m) for m in sub.modules() if m is not sub)
    selected: List[Tuple[str, nn.Module]] = []
    done: Set[int] = set()
    for name, sub in reversed(list(module.named_modules())):
        if sub is module or id(sub) in inside_wrapper or isinstance(sub, FSDPModule) or id(sub) in not_entered:
            continue
        if fn(_inner(sub), _own_numel(sub, done)):
            selected.append((name, sub))
            done.add(id(sub))
    return selected


def move_buffers(module: nn.Module, device: torch.device) -> None:
    """Put every buffer of `module` on `device` (shared buffers stay shared); parameters are not touched."""
    moved: dict = {}
    for sub in module.modules():
        for name, buf in list(sub._buffers.items()):
            if buf is not None and buf.device != device:
                if id(buf) not in moved:
                    moved[id(buf)] = buf.to(device)
                sub._buffers[name] = moved[id(buf)]


class FSDPStrategy(Strategy):
    """Fully sharded data parallel (FSDP2). See docs/fsdp.md for every knob.

    `accumulation_sync` chooses what a non-final micro-batch of a gradient
    accumulation window communicates:

    - "reduce_scatter" (default; torchtitan's behaviour): every micro-batch's
      backward reduce-scatters each unit's gradient, so between micro-batches
      a rank holds only its 1/N gradient shard -- gradient memory is the same
      as without accumulation. It costs one reduce-scatter per micro-batch
      instead of one per optimizer step. What can wait does wait: with a
      replicate dimension (HYBRID_SHARD, NO_SHARD, device_mesh=(r, s)) the
      all-reduce across replicas runs only on the last micro-batch
      (`set_requires_all_reduce(False)`; FSDP sums the shards meanwhile).
    - "none": no gradient communication until the last micro-batch (FSDP1's
      `no_sync`, `set_requires_gradient_sync(False)`). Every unit then keeps
      its whole unsharded gradient from the first micro-batch's backward to
      the optimizer step: reduce-dtype bytes x ALL parameters per rank (fp32:
      4 bytes x parameters, 28 GB for a 7B model, 280 GB for 70B) on top of
      the sharded states. Only worth it when the interconnect, not memory,
      is the bottleneck and the full gradient fits.
    """

    name = "fsdp"
    is_sharded = True
    # One process still shards over a world of one (planning, tests, one GPU); its group uses
    # the device's backend, since gloo cannot reduce-scatter the CUDA tensors of a CUDA mesh.
    needs_process_group = True

    def __init__(
        self,
        auto_wrap_policy: Policy = None,
        activation_checkpointing_policy: Policy = None,
        sharding_strategy: str = "FULL_SHARD",
        cpu_offload: bool = False,
        state_dict_type: str = "sharded",
        device_mesh: Any = None,
        limit_all_gathers: Optional[bool] = None,
        reshard_after_forward: Optional[bool] = None,
        precision: Any = None,
        timeout_s: float = 1800.0,
        async_save: bool = False,
        accumulation_sync: str = "reduce_scatter",
        optimizer_on_local_shards: Optional[bool] = None,
        mixed_precision: Any = None,
        activation_checkpointing: Policy = None,
        use_orig_params: Optional[bool] = None,
        sync_module_states: Optional[bool] = None,
        backward_prefetch: Any = None,
        forward_prefetch: Optional[bool] = None,
        activation_checkpointing_mode: str = "full",
        selective_ac_option: Union[str, int, None] = None,
        compile: Any = None,
        tp_size: int = 1,
        sp_size: int = 1,
        ep_size: int = 1,
        **_unknown: Any,
    ) -> None:
        # Lightning / Accelerate / FSDP1 spellings (fsdp_compat.py): enums and objects become our
        # names; what FSDP2 has nothing to do for is accepted and explained once per process.
        self.precision_source = None if mixed_precision is None else f"mixed_precision={mixed_precision!r}"
        if mixed_precision is not None:
            mapped = precision_from_mixed_precision(mixed_precision)
            if precision is not None and str(precision) != mapped:
                raise ValueError(
                    f"FSDPStrategy got precision={precision!r} and mixed_precision meaning {mapped!r}; "
                    "pass one of them."
                )
            precision = mapped
        if activation_checkpointing is not None:  # Lightning 2.0's name for the policy
            if activation_checkpointing_policy is not None:
                raise ValueError(
                    "Pass activation_checkpointing_policy or activation_checkpointing (its older name), not both."
                )
            activation_checkpointing_policy = activation_checkpointing
        for name, value in (
            ("use_orig_params", use_orig_params),
            ("sync_module_states", sync_module_states),
            ("backward_prefetch", backward_prefetch),
            ("forward_prefetch", forward_prefetch),
            ("limit_all_gathers", limit_all_gathers),
        ):
            if value is not None:
                note_accepted(name, value)
        super().__init__(precision=precision, timeout_s=timeout_s, compile=compile)
        if _unknown:
            raise TypeError(
                f"FSDPStrategy got unknown argument(s) {sorted(_unknown)}. Valid: auto_wrap_policy, "
                "activation_checkpointing_policy, sharding_strategy, cpu_offload, state_dict_type, "
                "device_mesh, limit_all_gathers, reshard_after_forward, precision, timeout_s, async_save, "
                "accumulation_sync, optimizer_on_local_shards, activation_checkpointing_mode, "
                "selective_ac_option, compile, tp_size, sp_size, ep_size, and Lightning's / torch's "
                "mixed_precision, activation_checkpointing, use_orig_params, sync_module_states, "
                "backward_prefetch, forward_prefetch."
            )
        sharding_strategy, implied_reshard = sharding_strategy_name(sharding_strategy)
        if reshard_after_forward is None:
            reshard_after_forward = implied_reshard
        state_dict_type = state_dict_type_name(state_dict_type)
        cpu_offload = offload_flag(cpu_offload)
        # "full" recomputes each checkpointed block; "selective": see selective_ac.py.
        self.activation_checkpointing_mode, self.selective_ac_option = selective_ac.normalize(
            activation_checkpointing_mode, selective_ac_option
        )
        # None: step non-torch optimizers (bitsandbytes, ...) on the local shards; see local_optim.py.
        self.optimizer_on_local_shards = optimizer_on_local_shards
        if accumulation_sync not in ACCUMULATION_SYNCS:
            raise ValueError(
                f"Unknown accumulation_sync {accumulation_sync!r}. Valid: 'reduce_scatter' (default: "
                "gradients stay sharded between micro-batches) or 'none' (no communication until "
                "the last micro-batch; keeps every unit's full gradient)."
            )
        self.accumulation_sync = accumulation_sync
        # Fail on malformed policies now, not inside every worker.
        build_policy_fn(auto_wrap_policy, "auto_wrap_policy")
        build_policy_fn(activation_checkpointing_policy, "activation_checkpointing_policy")
        self.auto_wrap_policy = auto_wrap_policy
        self.activation_checkpointing_policy = activation_checkpointing_policy
        self.state_dict_type = state_dict_type
        if async_save and state_dict_type != "sharded":
            raise ValueError(
                "async_save=True needs state_dict_type='sharded' (a full checkpoint is gathered "
                "to rank 0 and written synchronously)."
            )
        # Stage this rank's shards to host memory, then write them in a background thread.
        self.async_save = bool(async_save)
        self.device_mesh_arg = device_mesh
        self.limit_all_gathers = limit_all_gathers  # accepted for FSDP1 code; FSDP2 always limits
        self.reshard_after_forward = (
            sharding_strategy != "SHARD_GRAD_OP" if reshard_after_forward is None else reshard_after_forward
        )
        for name, value in zip(degrees.FLAGS + (degrees.EP_FLAG,), (tp_size, sp_size, ep_size)):
            degrees.refuse(degrees.value_problem(name, value))
        shape = tuple(device_mesh.shape if isinstance(device_mesh, DeviceMesh) else device_mesh or (1, -1))
        # The strategy's configuration, kept once: sharding, offload, mesh degrees (refused now, named, when
        # they cannot combine). sharding_strategy, cpu_offload, tp_size, sp_size and the layout read it.
        self.plan = ParallelPlan(
            "fsdp",
            sharding=sharding_strategy,
            dp_replicate=shape[0] if len(shape) == 2 else 1,
            dp_shard=shape[-1],
            tp=tp_size,
            sp=sp_size,
            ep=ep_size,
            offload_params=bool(cpu_offload),
            offload_optimizer=bool(cpu_offload),
        )
        self.mesh: Optional[DeviceMesh] = None  # FSDP2's: the data-parallel (and sp) ranks
        self.world_mesh: Optional[DeviceMesh] = None  # (dp_replicate, dp_shard, sp, tp), when tp or sp > 1
        self.tp_mesh: Optional[DeviceMesh] = None
        self.sp_mesh: Optional[DeviceMesh] = None
        self.ep_mesh = self.expert_mesh = None  # under ep: the experts' placement, their FSDP2 mesh (mesh.py)
        self._manual_units: List[nn.Module] = []

    @property
    def sharding_strategy(self) -> str:
        return self.plan.sharding

    @property
    def cpu_offload(self) -> bool:
        return self.plan.offload

    @cpu_offload.setter
    def cpu_offload(self, value: bool) -> None:  # the planner traces the on-device part without it
        self.plan = replace(self.plan, offload_params=bool(value), offload_optimizer=bool(value))

    @property
    def tp_size(self) -> int:
        return self.plan.tp

    @property
    def sp_size(self) -> int:
        return self.plan.sp

    @property
    def ep_size(self) -> int:
        return self.plan.ep

    @property
    def parallel_plan(self) -> Any:
        """This strategy as a ParallelPlan (base.Strategy): its plan, with checkpointing, blocks, precision
        and compile, which the strategy's policies and the base class hold."""
        base, checkpointed = super().parallel_plan, self.activation_checkpointing_policy is not None
        return replace(
            self.plan,
            ac=self.activation_checkpointing_mode if checkpointed else "none",
            selective_ac_option=self.selective_ac_option if checkpointed else None,
            blocks=self.auto_wrap_policy if self.auto_wrap_policy is not None else self.activation_checkpointing_policy,
            precision=base.precision,
            compile=base.compile,
        )

    @property
    def layout(self) -> ParallelMesh:
        """Which ranks do what in this world (mesh.py): data-parallel ranks, batch groups, FSDP groups."""
        return ParallelMesh.from_plan(self.plan, self.world_size, getattr(self, "num_nodes", 1) or 1)

    @property
    def data_parallel_size(self) -> int:
        return self.layout.data_parallel_size

    @property
    def data_parallel_rank(self) -> int:
        return self.layout.data_parallel_rank(self.global_rank)

    def check_batch(self, batch: Any) -> None:
        """Under sp/tp: stop, naming the fix, when the ranks of a group do not hold the same batch.

        One all-gather of three numbers per rank, once an epoch: a sampler of the user's own that splits
        by global rank would otherwise train each rank's shard of a different sample, silently."""
        if self.world_mesh is None or self.fake_mode is not None or not self.layout.has_model_parallel:
            return
        found = check_same_within_groups(batch, self.layout.batch_groups())
        if found is not None:
            raise ValueError(
                f"Ranks {found} are one sequence/tensor-parallel group (sp_size={self.sp_size}, "
                f"tp_size={self.tp_size}) but hold different batches. Every rank of such a group must read the "
                f"same samples: let shardwise distribute the DataLoader (a plain DataLoader; its sampler then "
                f"splits by data-parallel rank), or split your own sampler by strategy.data_parallel_rank over "
                f"strategy.data_parallel_size ({self.data_parallel_size}), not by global rank."
            )

    # ------------------------------------------------------------------ set-up
    def setup_environment(self) -> None:
        super().setup_environment()
        self._build_meshes(dist.get_world_size())
        # fp16: the base class's torch.amp.GradScaler, the one torch pairs with FSDP2. The gradients are
        # DTensors, whose inf check already agrees over the mesh; FSDP1's ShardedGradScaler would add an
        # all-reduce of its own per step (and, built without a device, is disabled off CUDA).
        if self.cpu_offload and self.root_device.type == "cpu":
            warnings.warn(
                "FSDPStrategy(cpu_offload=True) does nothing on CPU: parameters already live in "
                "host memory. It offloads parameters, gradients and optimizer state on CUDA.",
                stacklevel=2,
            )

    def setup_fake_environment(self, env: Any, fake_mode: Any) -> None:
        """Planning (base.Strategy.setup_fake_environment): the mesh of `env`'s world on the existing fake group."""
        super().setup_fake_environment(env, fake_mode)
        self._build_meshes(env.world_size)

    def _build_meshes(self, world_size: int) -> None:
        if isinstance(self.device_mesh_arg, DeviceMesh) and self.plan.tp == self.plan.sp == self.plan.ep == 1:
            self.mesh = self.device_mesh_arg  # the user's own: FSDP2 shards over it as it is
            return
        layout = ParallelMesh.from_plan(self.plan, world_size, getattr(self, "num_nodes", 1) or 1)
        meshes = layout.build(self.root_device.type)
        self.world_mesh, self.mesh, self.sp_mesh, self.tp_mesh = meshes.world, meshes.fsdp, meshes.sp, meshes.tp
        self.ep_mesh, self.expert_mesh = meshes.ep, meshes.expert_fsdp

    def _fsdp_kwargs(self) -> dict:
        kwargs: dict = {"mesh": self.mesh, "reshard_after_forward": self.reshard_after_forward}
        if self.precision.mixed:
            kwargs["mp_policy"] = MixedPrecisionPolicy(
                param_dtype=self.precision.compute_dtype, reduce_dtype=self.precision.reduce_dtype
            )
        if self.cpu_offload and self.root_device.type == "cuda":
            kwargs["offload_policy"] = CPUOffloadPolicy()
        return kwargs

    def _manual_wrap(self, module: nn.Module) -> nn.Module:
        fully_shard(module, **self._fsdp_kwargs())
        self._manual_units.append(module)
        return module

    def setup_optimizer(self, optimizer: torch.optim.Optimizer) -> torch.optim.Optimizer:
        # Kernels that do not understand DTensor (bitsandbytes, third-party optimizers) step on
        # each rank's local shards; torch's own optimizers handle DTensor (local_optim.py).
        if wants_local_step(optimizer, self.optimizer_on_local_shards):
            apply_local_shard_step(optimizer)
        return super().setup_optimizer(optimizer)

    def setup_module(self, module: nn.Module) -> nn.Module:
        # True-half runs: cast before sharding, as Strategy.setup_module does (a module built on meta
        # under the init context already has the dtype).
        if self.precision.casts_module and not has_meta_tensors(module):
            module = module.to(self.precision.param_dtype)
        # Tensor parallel, then sequence parallel, on the unsharded (meta) model: both swap modules or
        # their forward, which checkpointing, compile and fully_shard then wrap as they are.
        if self.tp_mesh is not None:
            from shardwise.strategies.tensor_parallel import apply_tensor_parallel

            apply_tensor_parallel(module, self.tp_mesh)
        if self.sp_mesh is not None:
            from shardwise.strategies.sequence_parallel import apply_sequence_parallel

            apply_sequence_parallel(module, self.sp_mesh)
        if self.ep_mesh is not None:  # experts split over ep (strategies/experts.py), sharded apart below
            from shardwise.strategies.experts import apply_expert_parallel

            apply_expert_parallel(module, self.ep_mesh, type(module).__name__)
        if self.activation_checkpointing_policy is not None:
            apply_activation_checkpointing(
                module,
                self.activation_checkpointing_policy,
                self.activation_checkpointing_mode,
                self.selective_ac_option,
            )
        # Checkpointing, then compile, then sharding (torchtitan's order): the blocks are the wrap units.
        self.apply_compile(module, self.auto_wrap_policy or self.activation_checkpointing_policy)
        units = select_units(module, self.auto_wrap_policy) or manual_units(module, self.auto_wrap_policy)
        if self.auto_wrap_policy is not None and not units:
            raise ValueError(
                f"auto_wrap_policy={self.auto_wrap_policy!r} matched no module of {type(module).__name__}, so "
                f"nothing but the root would be sharded. The model contains: {describe_modules(module)}. "
                "Pass the class of your transformer block (e.g. {nn.TransformerEncoderLayer, "
                "nn.TransformerDecoderLayer} for the demo Transformer)."
            )
        kwargs = self._fsdp_kwargs()
        ignored = integer_params_to_ignore(module, self.mesh.size())
        if ignored:
            kwargs["ignored_params"] = ignored
        if self.expert_mesh is not None:  # each experts module its own unit first, over dp_shard / ep
            from shardwise.strategies.experts import shard_experts

            shard_experts(module, self.expert_mesh, self.mesh.size(), kwargs)
        for _, unit in units:
            fully_shard(unit, **kwargs)
        # The root unit also owns what no policy selected (embeddings, head).
        fully_shard(module, **kwargs)
        init_device = torch.device("cpu") if "offload_policy" in kwargs else self.root_device
        self.materialize(module, init_device)
        if init_device != self.root_device:
            # CPU offload moves parameters only: FSDP2 never moves buffers (RoPE
            # frequencies, norm statistics), so they must sit where forward runs
            # (torchtitan's buffer_device).
            move_buffers(module, self.root_device)
        self.module = module
        self.units = [name for name, _ in units] + [f"<manual {type(m).__name__}>" for m in self._manual_units]
        return module

    @property
    def checkpoint_format(self) -> str:
        # "sharded": DCP, one file per rank, nothing gathered (the default);
        # "full": gathered tensor by tensor to rank 0's host memory, one file.
        return self.state_dict_type

    # ------------------------------------------------------------------ steps
    def no_backward_sync(self, model: nn.Module, enabled: bool):
        if not enabled or not isinstance(model, FSDPModule):
            return contextlib.nullcontext()
        if self.accumulation_sync == "none":
            return _switched_off(model.set_requires_gradient_sync)
        # "reduce_scatter": the reduce-scatter runs (so gradients stay sharded);
        # only a replicate dimension's all-reduce can wait for the last micro-batch.
        if self.mesh is not None and self.mesh.ndim > 1:
            return _switched_off(model.set_requires_all_reduce)
        return contextlib.nullcontext()

    @contextlib.contextmanager
    def gathered(self, model: nn.Module) -> Iterator[None]:
        """Every unit unsharded (all-gathered) for the block, resharded after (base.Strategy.gathered).

        After fit the parameters are DTensor shards, and a submodule called directly (`module.model(x)`)
        bypasses the root's forward hooks that gather them. Units called inside the block gather and
        reshard themselves as in training; the root's own parameters stay gathered until the block ends."""
        units = [m for m in model.modules() if isinstance(m, FSDPModule)]
        for unit in units:
            unit.unshard()
        try:
            yield
        finally:
            for unit in units:
                unit.reshard()

    def manual_model(self, model: nn.Module) -> nn.Module:
        """Manual optimization: refuse parameters of the root unit (base.Strategy.manual_model): gathered once
        per training_step, a second forward after a step would use stale weights (measured: a GAN 5e-2 off the
        one-device run in 6 steps, silently). A network that is a unit of its own (`manual_units`) gathers anew."""
        if getattr(self, "manual_checked", None) is model:  # checked once per model, not every step
            return model
        units = [m for m in model.modules() if isinstance(m, FSDPModule) and m is not model]
        inside = {id(p) for unit in units for p in unit.parameters()}
        owned = [name for name, p in model.named_parameters() if id(p) not in inside]
        if owned:
            nets = sorted({plain_class(c).__name__ for c in model.children() if any(True for _ in c.parameters())})
            raise ValueError(
                f"Manual optimization under FSDP: {len(owned)} parameter(s) ({', '.join(owned[:3])}) belong to "
                "the root unit, which gathers them once per training_step, so a forward after manual_backward "
                "or opt.step() would use stale weights. Make each network training_step calls a unit of its "
                f"own: FSDPStrategy(auto_wrap_policy={{{', '.join(nets)}}}), and keep no parameters directly "
                "on the TrainModule."
            )
        self.manual_checked = model
        return model

    def _full_norm(self, total: torch.Tensor) -> torch.Tensor:
        # Norms of sharded gradients are partial per rank; full_tensor() reduces them,
        # on the collective device: under cpu_offload they are CPU tensors on an NCCL mesh.
        return ops.full_tensor(total)


@contextlib.contextmanager
def _switched_off(setter):
    """Turn one of FSDP2's per-module communication switches off for a micro-batch's backward.

    set_requires_all_reduce: the reduce-scatter within the shard group still runs; the
    replica all-reduce waits for the last micro-batch. set_requires_gradient_sync
    (accumulation_sync="none"): gradients accumulate unsharded in each unit until the last
    micro-batch reduce-scatters the sum, a full gradient per rank meanwhile.
    """
    setter(False)
    try:
        yield
    finally:
        setter(True)

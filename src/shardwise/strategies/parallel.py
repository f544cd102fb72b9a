"""`ParallelPlan`: the one value that says how a model is parallelised.

A plan names the engine ("single", "ddp", "fsdp", "deepspeed"), the mesh
degrees (data-parallel replicate and shard, sequence parallel `sp` and tensor
parallel `tp`: the last two with FSDP2 only, on one DeviceMesh), FSDP's sharding or
DeepSpeed's ZeRO stage, activation checkpointing (which blocks, full or
selective), offload and precision. Everything that used to translate "what a
strategy is" goes through it: the names table (names.py, plain data read
here) maps each name to a plan, `build()` turns a plan into the strategy
object (the classes register in ENGINE_CLASSES where they are imported),
every strategy describes itself as one (`Strategy.parallel_plan`), and a
planner candidate is a plan plus a batch split. Each engine's memory and time
accounting is looked up from `engine` (accounting.py). A new dimension is a
field here and its rules in degrees.py, its layout in mesh.py, one apply
function and its accounting (docs/architecture.md, "How to add"). Imports no
torch: the CLI and the recipe's config checks read it cheaply.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any, Callable, Dict, Optional, Tuple, Union

from shardwise.strategies import degrees, names

ENGINES = ("single", "ddp", "fsdp", "deepspeed")
SHARDINGS = ("NO_SHARD", "SHARD_GRAD_OP", "FULL_SHARD", "HYBRID_SHARD")  # least to most sharded, then hybrid
AC_MODES = ("none", "full", "selective")
COMPILE_MODES = ("none", "blocks", "model")  # torch.compile per repeated block, or each network whole
FILL = -1  # a data-parallel degree filled in from the world size


@dataclass(frozen=True)
class MeshDims:
    """Resolved degrees for one world size; their product is the world size."""

    dp_replicate: int
    dp_shard: int
    tp: int = 1
    sp: int = 1
    ep: int = 1  # expert parallel: carved out of dp_shard (ep divides it), so not a factor of the world

    @property
    def world_size(self) -> int:
        return self.dp_replicate * self.dp_shard * self.tp * self.sp


@dataclass(frozen=True)
class ParallelPlan:
    """One parallel configuration (torchtitan's ParallelDims plus each engine's options).

    engine: "single" | "ddp" | "fsdp" | "deepspeed".
    dp_replicate, dp_shard: data-parallel degrees; -1 fills in from the world size. The default
        (1, -1) stands for the layout the engine and sharding imply (`dp_degrees`): DDP and FSDP
        NO_SHARD replicate (-1, 1), FSDP FULL_SHARD / SHARD_GRAD_OP and ZeRO shard (1, -1),
        HYBRID_SHARD replicates across nodes and shards inside one (-1, -1). Degrees equal to
        that layout are stored as the default, so equal configurations compare equal.
    tp, sp: tensor and sequence parallel degrees (FSDP only). The world is a (dp_replicate, dp_shard,
        sp, tp) mesh, tp varying fastest; the ranks of an sp or tp group read the same samples, FSDP
        shards over the data-parallel and sp ranks together (docs/parallelism.md).
    ep: expert parallel degree (FSDP only): the experts of a mixture-of-experts model split over ep
        ranks carved out of dp_shard (ep divides it; the ep ranks read different samples and exchange
        tokens by all-to-all); FSDP shards the other parameters over dp_shard and the experts over
        dp_shard / ep (torchtitan's layout).
    sharding: FSDP's sharding ("" means FULL_SHARD for FSDP; other engines have none).
    zero_stage: DeepSpeed's ZeRO stage (None: the strategy's default, 2, or the user's config).
    ac: activation checkpointing of `blocks`: "none" | "full" | "selective" (selective_ac.py;
        `selective_ac_option` "op" or N).
    blocks: the model's block classes (or class names): FSDP's units and what `ac` checkpoints;
        None when not known yet (then FSDP shards the whole model as one unit).
    offload_params, offload_optimizer: state kept in host memory (FSDP offloads both together).
    precision: None means the Trainer's.
    compile: torch.compile "none" | "blocks" (each of `blocks` after checkpointing, before sharding:
        compile.py) | "model"; DeepSpeed refuses it.
    """

    engine: str = "single"
    dp_replicate: int = 1
    dp_shard: int = FILL
    tp: int = 1
    sp: int = 1
    ep: int = 1
    sharding: str = ""
    zero_stage: Optional[int] = None
    ac: str = "none"
    selective_ac_option: Union[str, int, None] = None
    blocks: Any = None
    offload_params: bool = False
    offload_optimizer: bool = False
    precision: Optional[str] = None
    compile: str = "none"

    def __post_init__(self) -> None:
        set_ = object.__setattr__  # frozen: normalise once, here
        engine = str(self.engine).lower()
        set_(self, "engine", engine)
        if engine not in ENGINES:
            raise ValueError(f"ParallelPlan(engine={self.engine!r}): use one of {', '.join(ENGINES)}.")
        sharding = str(self.sharding or ("FULL_SHARD" if engine == "fsdp" else "")).upper()
        set_(self, "sharding", sharding)
        if (self.dp_replicate, self.dp_shard) == default_degrees(engine, sharding):
            set_(self, "dp_replicate", 1)
            set_(self, "dp_shard", FILL)
        set_(self, "ac", str(self.ac).lower())
        spelled = {True: "blocks", False: "none", None: "none"}  # as the Trainer's compile= spells them
        set_(self, "compile", spelled.get(self.compile, str(self.compile).lower()))
        if self.ac == "selective" and self.selective_ac_option is None:
            set_(self, "selective_ac_option", "op")
        set_(self, "blocks", _as_blocks(self.blocks))
        _validate(self)

    # ------------------------------------------------------------------ names
    @classmethod
    def from_name(cls, name: str, allow_ac: bool = True) -> "ParallelPlan":
        """A strategy name (strategies/names.py: aliases, case, dashes, the `_ac` suffix) -> its plan."""
        key, ac = names.key_of(name, allow_ac)
        return replace(PLANS[key], ac="full") if ac else PLANS[key]

    @property
    def name(self) -> Optional[str]:
        """The names table's name for this configuration (+ "_ac" for full checkpointing), or None."""
        return name_of(self)

    @property
    def label(self) -> str:
        """What reports print: "DDP", "FSDP FULL_SHARD + AC", "ZeRO-3 + offload + AC", ..."""
        if self.engine == "single":
            base = "single device"
        elif self.engine == "ddp":
            base = "DDP"
        elif self.engine == "fsdp":
            base = f"FSDP {self.sharding}"
        else:
            base = "DeepSpeed" if self.zero_stage is None else f"ZeRO-{self.zero_stage}"
        for degree, short in ((self.sp, "sp"), (self.tp, "tp"), (self.ep, "ep")):
            if degree > 1:
                base += f" x {short} {degree}"
        if self.offload_optimizer:  # (FSDP offloads both; ZeRO's parameter offload rides on it)
            base += " + offload"
        if self.uses_ac:
            base += " + AC"
        if self.compile != "none":
            base += " + compile" if self.compile == "blocks" else " + compiled model"
        return base

    def code(self, block: str = "Block") -> str:
        """The Trainer argument a user writes for this plan (reports and warnings show it)."""
        ac = f", activation_checkpointing_policy={{{block}}}" if self.uses_ac else ""
        if self.engine in ("single", "ddp"):
            return f'"{self.engine}"' if not ac else f"DDPStrategy()  # + checkpoint {block} yourself"
        if self.engine == "fsdp":
            extra = "" if self.sharding == "FULL_SHARD" else f', sharding_strategy="{self.sharding}"'
            off = ", cpu_offload=True" if self.offload else ""
            dims = "".join(f", {n}_size={d}" for n, d in (("sp", self.sp), ("tp", self.tp), ("ep", self.ep)) if d > 1)
            return f"FSDPStrategy(auto_wrap_policy={{{block}}}{extra}{dims}{ac}{off})"
        off = (", offload_optimizer=True" if self.offload_optimizer else "") + (
            ", offload_parameters=True" if self.offload_params else ""
        )
        return f"DeepSpeedStrategy(stage={self.zero_stage}{off}{ac})"

    @property
    def dp_degrees(self) -> Tuple[int, int]:
        """(dp_replicate, dp_shard), -1 still to be filled in: the explicit ones, else the implied layout."""
        if (self.dp_replicate, self.dp_shard) == (1, FILL):
            return default_degrees(self.engine, self.sharding)
        return (self.dp_replicate, self.dp_shard)

    @property
    def uses_ac(self) -> bool:
        return self.ac != "none"

    @property
    def offload(self) -> bool:
        return self.offload_params or self.offload_optimizer

    @property
    def splits_at_nodes(self) -> bool:
        """Whether the data-parallel degrees follow the node boundary (HYBRID_SHARD's layout)."""
        return self.dp_degrees == (FILL, FILL)

    def configuration(self) -> "ParallelPlan":
        """This plan without what belongs to a run rather than to the configuration (blocks, precision, compile)."""
        return replace(self, blocks=None, precision=None, compile="none")

    # ------------------------------------------------------------------ mesh
    def mesh(self, world_size: int, num_nodes: int = 1) -> MeshDims:
        """The degrees for `world_size` ranks on `num_nodes` nodes; ValueError if they cannot be laid out.

        -1 fills in; both data-parallel degrees -1 split at the node boundary
        (replicate across nodes, shard inside one: HYBRID_SHARD's rule).
        """
        if self.engine == "single":
            if world_size != 1:
                raise ValueError(f"strategy 'single' runs on one device, but the world size is {world_size}.")
            return MeshDims(1, 1)
        degrees.refuse(degrees.world_problem(world_size, self.tp, self.sp, degrees.FIELDS))
        dp = world_size // (self.tp * self.sp)
        replicate, shard = self.dp_degrees
        if replicate == FILL and shard == FILL:
            nodes = max(int(num_nodes or 1), 1)
            if dp % nodes:
                raise ValueError(
                    f"{self.sharding or self.engine} replicates across nodes and shards within one, but the "
                    f"world size {world_size} is not a multiple of num_nodes={nodes}. Give "
                    "device_mesh=(replicate, shard) explicitly."
                )
            replicate, shard = nodes, dp // nodes
        elif replicate == FILL or shard == FILL:
            known = shard if replicate == FILL else replicate
            if dp % known:
                raise ValueError(f"A data-parallel degree of {known} does not divide {dp} data-parallel ranks.")
            replicate, shard = (dp // known, known) if replicate == FILL else (known, dp // known)
        if replicate * shard != dp:
            raise ValueError(
                f"device_mesh={(replicate, shard)} has {replicate * shard} ranks but the world size is "
                f"{dp}; replicate x shard must equal it."
            )
        degrees.refuse(degrees.expert_degree_problem(self.ep, shard, degrees.EP_FIELD))
        return MeshDims(replicate, shard, self.tp, self.sp, self.ep)

    # ------------------------------------------------------------------ strategy
    def strategy_options(self) -> Dict[str, Any]:
        """The constructor arguments this configuration sets beyond the strategy class's defaults."""
        out: Dict[str, Any] = {}
        if self.engine == "fsdp":
            if self.sharding != "FULL_SHARD":
                out["sharding_strategy"] = self.sharding
            if self.offload:
                out["cpu_offload"] = True
            if (self.dp_replicate, self.dp_shard) != (1, FILL):
                out["device_mesh"] = (self.dp_replicate, self.dp_shard)
            if self.tp > 1:
                out["tp_size"] = self.tp
            if self.sp > 1:
                out["sp_size"] = self.sp
            if self.ep > 1:
                out["ep_size"] = self.ep
        elif self.engine == "deepspeed":
            if self.zero_stage is not None:
                out["stage"] = self.zero_stage
            if self.offload_optimizer:
                out["offload_optimizer"] = True
            if self.offload_params:
                out["offload_parameters"] = True
        return out

    def strategy_kwargs(
        self,
        blocks: Any = None,
        spelled: Optional[str] = None,
        engine_options: Optional[Dict[str, Dict[str, Any]]] = None,
        **options: Any,
    ) -> Dict[str, Any]:
        """Every constructor argument of this plan's strategy class (`build` passes them to it).

        blocks: the model's block classes when the plan has none (FSDP wraps each as a unit, `ac`
        checkpoints them). spelled: the name the user wrote, for error messages. options: further
        constructor arguments (e.g. bucket_cap_mb=25); they win over the plan's. engine_options:
        more of them for whichever engine the plan names, e.g. {"deepspeed": {"config": {...}}}.
        """
        units = self.blocks if self.blocks is not None else _as_blocks(blocks)
        units = set(units) if isinstance(units, tuple) else units
        said = spelled or self.name or self.label
        kwargs = self.strategy_options()
        if self.precision is not None:
            kwargs["precision"] = self.precision
        if self.engine == "fsdp" and units:
            kwargs["auto_wrap_policy"] = units
        if self.compile != "none":
            kwargs["compile"] = self.compile
        kwargs.update((engine_options or {}).get(self.engine, {}))
        kwargs.update(options)
        if self.uses_ac:
            if not units or self.engine not in ("fsdp", "deepspeed"):
                raise ValueError(
                    f"strategy={said!r}: activation checkpointing needs your block class; pass "
                    "FSDPStrategy(auto_wrap_policy={Block}, activation_checkpointing_policy={Block}) "
                    "(or DeepSpeedStrategy(..., activation_checkpointing_policy={Block}))."
                )
            kwargs["activation_checkpointing_policy"] = units
            if self.ac == "selective":
                if self.engine != "fsdp":
                    raise ValueError(f"strategy={said!r}: selective activation checkpointing is FSDPStrategy's.")
                kwargs["activation_checkpointing_mode"] = "selective"
                kwargs["selective_ac_option"] = self.selective_ac_option
        return kwargs

    def build(
        self,
        blocks: Any = None,
        spelled: Optional[str] = None,
        engine_options: Optional[Dict[str, Dict[str, Any]]] = None,
        **options: Any,
    ) -> Any:
        """The strategy object for this plan: its engine's class with `strategy_kwargs` (same arguments)."""
        return ENGINE_CLASSES[self.engine](**self.strategy_kwargs(blocks, spelled, engine_options, **options))


# engine -> its strategy class. strategies/__init__.py fills it where the classes are imported: each class
# module imports this one, so this one cannot import them (and importing any module of the package runs
# that __init__ first, so the table is complete before a plan can be built).
ENGINE_CLASSES: Dict[str, Callable[..., Any]] = {}


def default_degrees(engine: str, sharding: str = "") -> Tuple[int, int]:
    """(dp_replicate, dp_shard) the engine and sharding imply: the layout each name has always meant."""
    if engine == "single":
        return (1, 1)
    if engine == "ddp" or sharding == "NO_SHARD":
        return (FILL, 1)
    if sharding == "HYBRID_SHARD":
        return (FILL, FILL)
    return (1, FILL)


def _as_blocks(value: Any) -> Any:
    """Block classes / names as a hashable, order-free tuple; a callable policy as it is; None stays None."""
    if value is None or callable(value) and not isinstance(value, type):
        return value
    if isinstance(value, (type, str)):
        value = [value]
    items = list(value)
    return tuple(sorted(set(items), key=lambda b: (getattr(b, "__module__", ""), getattr(b, "__qualname__", str(b)))))


def _validate(p: ParallelPlan) -> None:
    """Refuse what no engine can run, naming the field."""
    for field_name in degrees.FIELDS + (degrees.EP_FIELD,):
        degrees.refuse(degrees.value_problem(field_name, getattr(p, field_name)))
    degrees.refuse(degrees.engine_problem(p.engine, p.tp, p.sp, degrees.FIELDS))
    degrees.refuse(degrees.expert_engine_problem(p.engine, p.ep, degrees.EP_FIELD))
    degrees.refuse(
        degrees.expert_combination_problem(p.ep, p.tp, p.sp, p.offload, p.compile != "none", degrees.EP_FIELD)
    )
    for field_name in ("dp_replicate", "dp_shard"):
        value = getattr(p, field_name)
        if not isinstance(value, int) or isinstance(value, bool) or (value < 1 and value != FILL):
            raise ValueError(f"ParallelPlan({field_name}={value!r}): use a positive integer, or -1 to fill in.")
    if p.engine == "fsdp":
        if p.sharding not in SHARDINGS:
            raise ValueError(f"ParallelPlan(sharding={p.sharding!r}): FSDP's are {', '.join(SHARDINGS)}.")
        if p.offload_params != p.offload_optimizer:
            raise ValueError(
                "FSDP offloads parameters, gradients and optimizer state together (CPUOffloadPolicy): "
                "set offload_params and offload_optimizer both, or neither."
            )
    elif p.sharding:
        raise ValueError(f"ParallelPlan(sharding={p.sharding!r}) is FSDP's; engine={p.engine!r} has none.")
    if p.engine == "deepspeed":
        if p.zero_stage not in (None, 0, 1, 2, 3):
            raise ValueError(f"ParallelPlan(zero_stage={p.zero_stage!r}): ZeRO stages are 0, 1, 2 and 3.")
        if p.dp_degrees[0] != 1:
            raise ValueError("ZeRO partitions over the whole world: dp_replicate must be 1 with DeepSpeed.")
    elif p.zero_stage is not None:
        raise ValueError(f"ParallelPlan(zero_stage={p.zero_stage!r}) is DeepSpeed's; engine={p.engine!r} has none.")
    if p.engine in ("single", "ddp"):
        if p.offload:
            raise ValueError(f"engine={p.engine!r} has no offload; use FSDP or DeepSpeed for it.")
        if p.dp_degrees[1] != 1:
            raise ValueError(f"engine={p.engine!r} replicates the model: dp_shard must be 1.")
    degrees.refuse(degrees.offload_problem(p.tp, p.offload, degrees.FIELDS))
    degrees.refuse(degrees.compile_problem(p.tp, p.sp, p.compile != "none", names=degrees.FIELDS))
    if p.compile not in COMPILE_MODES:
        raise ValueError(f"ParallelPlan(compile={p.compile!r}): use one of {', '.join(COMPILE_MODES)}.")
    if p.compile != "none" and p.engine == "deepspeed":
        raise ValueError(
            "torch.compile is not supported with DeepSpeed here: its engine owns the module's forward and "
            "ZeRO-3 gathers parameters in hooks inside it. Use strategy='fsdp' (FSDP2, compiled per block) or "
            "'ddp', or leave compile off."
        )
    if p.ac not in AC_MODES:
        raise ValueError(f"ParallelPlan(ac={p.ac!r}): use one of {', '.join(AC_MODES)}.")
    if p.ac == "selective":
        option = p.selective_ac_option
        if not (option == "op" or isinstance(option, int) and not isinstance(option, bool) and option >= 1):
            raise ValueError(f"selective_ac_option={option!r}: use 'op' or an integer N >= 1.")
    elif p.selective_ac_option is not None:
        raise ValueError("selective_ac_option needs ac='selective'.")


PLANS: Dict[str, ParallelPlan] = {name: ParallelPlan(**fields) for name, fields in names.TABLE.items()}


def name_of(plan: ParallelPlan) -> Optional[str]:
    """The table's name for a plan's configuration (+ `_ac` for full checkpointing), or None if it has none."""
    if plan.ac == "selective":
        return None
    wanted = replace(plan.configuration(), ac="none")
    for name, entry in PLANS.items():
        if entry == wanted and name not in names.SHORT_ALIASES:
            return name + (names.AC_SUFFIX if plan.uses_ac else "")
    return None


__all__ = [
    "ParallelPlan",
    "MeshDims",
    "PLANS",
    "ENGINES",
    "ENGINE_CLASSES",
    "SHARDINGS",
    "AC_MODES",
    "COMPILE_MODES",
    "default_degrees",
    "name_of",
]

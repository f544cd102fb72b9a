"""The configurations the planner compares: a ParallelPlan plus a batch split, and how each becomes a strategy.

A `Candidate` is what a user would try, from the least to the most sharded: DDP;
FSDP NO_SHARD, SHARD_GRAD_OP, FULL_SHARD, HYBRID_SHARD, each with and
without activation checkpointing; FULL_SHARD with CPU offload; DeepSpeed
ZeRO-1/2/3 and ZeRO-3 offload (sequence / tensor parallel degrees: parallel.py);
each at a micro-batch size with gradient accumulation that keeps the global batch. What the configuration *is* is its
`plan` (strategies/parallel.py); `build_strategy` is the only place a
candidate turns into a strategy, and both the planner's fake-tensor trace and
the accuracy benchmark's real runs call it, so what is predicted and what is
measured are the same configuration by construction.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import Any, Dict, Iterable, List, Optional, Sequence, Union

from shardwise.plan.errors import PlanError
from shardwise.plan.presets import divisors
from shardwise.strategies import DDPStrategy, FSDPStrategy
from shardwise.strategies.accounting import accounting_for
from shardwise.strategies.deepspeed import DeepSpeedStrategy
from shardwise.strategies.parallel import SHARDINGS, ParallelPlan
from shardwise.strategies.single import SingleDeviceStrategy

FSDP_SHARDINGS = SHARDINGS


@dataclass(frozen=True, init=False)
class Candidate:
    """One configuration (`plan`, without the model's blocks or a precision) at one batch split.

    `Candidate("fsdp", sharding="FULL_SHARD", activation_checkpointing=True)` is short for
    `Candidate(ParallelPlan("fsdp", sharding="FULL_SHARD", ac="full"))`.
    """

    plan: ParallelPlan
    micro_batch: int = 1
    accumulation: int = 1
    # plan(strategy=obj): the user's own strategy object, traced as it is (its wrap policy, mesh,
    # bucket layout); `custom` names it so two such objects are never confused as dict keys.
    custom: str = ""
    strategy: Any = field(default=None, compare=False, hash=False, repr=False)

    def __init__(
        self,
        plan: Union[ParallelPlan, str] = "ddp",
        *,
        sharding: str = "",
        stage: int = 0,
        activation_checkpointing: bool = False,
        offload: bool = False,
        micro_batch: int = 1,
        accumulation: int = 1,
        custom: str = "",
        strategy: Any = None,
    ) -> None:
        if not isinstance(plan, ParallelPlan):  # the short spelling: engine name + the planner's knobs
            plan = ParallelPlan(
                plan,
                sharding=sharding,
                zero_stage=stage or None,
                ac="full" if activation_checkpointing else "none",
                offload_optimizer=offload,
                offload_params=offload and (stage == 3 or plan == "fsdp"),
            )
        for name, value in (
            ("plan", plan.configuration()),
            ("micro_batch", micro_batch),
            ("accumulation", accumulation),
            ("custom", custom),
            ("strategy", strategy),
        ):
            object.__setattr__(self, name, value)

    @property
    def config_label(self) -> str:
        """The configuration without the batch split: what the user selects in the Trainer."""
        return self.custom or self.plan.label

    @property
    def name(self) -> str:
        """The nearest name in the strategy table (+ `_ac`): what --only reads back; "custom" if none.

        Nearest: a user's explicit mesh or selective checkpointing is read as the name it refines.
        """
        coarse = replace(self.plan, dp_replicate=1, dp_shard=-1, selective_ac_option=None)
        return replace(coarse, ac="full" if coarse.uses_ac else "none").name or "custom"

    @property
    def label(self) -> str:
        return f"{self.config_label}, mb {self.micro_batch}x{self.accumulation}"

    @property
    def config_key(self) -> "Candidate":
        return replace(self, micro_batch=0, accumulation=0)

    def with_batch(self, micro_batch: int, accumulation: int) -> "Candidate":
        return replace(self, micro_batch=micro_batch, accumulation=accumulation)

    def to_dict(self) -> Dict[str, Any]:
        """The JSON fields plan reports have always had (`--json`, the accuracy benchmark's records)."""
        return dict(
            kind=self.plan.engine,
            sharding=self.plan.sharding,
            stage=self.plan.zero_stage or 0,
            activation_checkpointing=self.plan.uses_ac,
            # What the planner models as offload: the optimizer's state stepping on the host (FSDP
            # moves its parameters with it; ZeRO-3 offload its parameters too).
            offload=self.plan.offload_optimizer,
            tp=self.plan.tp,
            sp=self.plan.sp,
            ep=self.plan.ep,
            micro_batch=self.micro_batch,
            accumulation=self.accumulation,
            custom=self.custom,
            name=self.name,
            label=self.label,
            config=self.config_label,
        )

    def trainer_strategy_code(self, block: str = "Block") -> str:
        """The Trainer argument a user writes for this candidate (shown in reports and warnings)."""
        if self.strategy is not None:
            return f"<your {type(self.strategy).__name__} object>"
        return self.plan.code(block)

    def build_strategy(
        self, block_classes: Sequence[Any], precision: Any = None, deepspeed_config: Optional[Dict[str, Any]] = None
    ) -> Any:
        """The strategy object the Trainer would run for this candidate."""
        if self.plan.uses_ac and not block_classes:
            raise PlanError("activation checkpointing needs the model's block class; none was found")
        return self.plan.build(
            block_classes or None, precision=precision, engine_options={"deepspeed": {"config": deepspeed_config}}
        )


def default_candidates(world_size: int, num_nodes: int, include_deepspeed: bool = True) -> List[Candidate]:
    """Every configuration, from the least to the most sharded (micro-batch filled in later)."""
    # DDPStrategy has no checkpointing knob, so "DDP + AC" is not something a user selects.
    out: List[Candidate] = [Candidate("ddp")]
    for sharding in FSDP_SHARDINGS:
        if sharding == "HYBRID_SHARD" and num_nodes < 2:
            continue  # one node: HYBRID_SHARD has nothing to replicate across (an error if asked for)
        for ac in (False, True):
            out.append(Candidate("fsdp", sharding=sharding, activation_checkpointing=ac))
    for ac in (False, True):
        out.append(Candidate("fsdp", sharding="FULL_SHARD", offload=True, activation_checkpointing=ac))
    if include_deepspeed:
        for stage in (1, 2, 3):
            for ac in (False, True):
                out.append(Candidate("deepspeed", stage=stage, activation_checkpointing=ac))
        for ac in (False, True):
            out.append(Candidate("deepspeed", stage=3, offload=True, activation_checkpointing=ac))
    return out


def parse_candidate(name: str) -> Candidate:
    """A strategy name (strategies/names.py), optionally + '_ac' -> Candidate (for --only).

    fsdp_ac, fsdp_shard_grad_op, deepspeed_stage_3_offload_ac, ...; the older spellings
    (fsdp_full_shard_ac, zero3_offload) are aliases in the same table.
    """
    try:
        plan = ParallelPlan.from_name(name)
    except ValueError as exc:
        raise PlanError(str(exc)) from None
    return Candidate(_as_planned(plan))


def _as_planned(plan: ParallelPlan) -> ParallelPlan:
    # One device is planned as DDP's row (one rank of it: the same memory).
    return replace(plan, engine="ddp") if plan.engine == "single" else plan


def batch_splits(batch_size: int) -> List[tuple]:
    """(micro_batch, accumulation) pairs that keep the per-device batch, largest micro-batch first."""
    return [(m, batch_size // m) for m in sorted(divisors(batch_size), reverse=True)]


def from_strategy(strategy: Any) -> Candidate:
    """plan(strategy=obj): the candidate that traces exactly this strategy object.

    FSDP and DDP are traced with a fresh copy of the object itself (its wrap
    policy -- none means the whole model is one unit, gathered at once --,
    its checkpointing policy, mesh, gradient-bucket layout and accumulation
    mode); DeepSpeed with its stage, offload and resolved configuration. A name
    or a ParallelPlan is built first (without the model's blocks, as the
    Trainer would).
    """
    if isinstance(strategy, (str, ParallelPlan)):
        from shardwise.strategies import build_strategy

        try:
            strategy = build_strategy(strategy, world_size=2)
        except ValueError as exc:
            raise PlanError(str(exc)) from exc
    if not isinstance(strategy, (DDPStrategy, SingleDeviceStrategy, FSDPStrategy, DeepSpeedStrategy)):
        raise PlanError(
            f"The planner does not model {type(strategy).__name__}; plan one of DDPStrategy, FSDPStrategy, "
            "DeepSpeedStrategy (or a name: ddp, fsdp, deepspeed_stage_3, ...)."
        )
    plan = _as_planned(strategy.parallel_plan.configuration())
    notes = accounting_for(plan).planner_notes(strategy)
    return Candidate(plan, custom=f"{plan.label}{notes} (your strategy)", strategy=strategy)


def requested_candidates(
    requested: Optional[Iterable[Union[str, ParallelPlan, Candidate, Any]]], world: int, num_nodes: int
) -> List[Candidate]:
    """plan(candidates=...): names, ParallelPlans, Candidates or strategy objects (None: every default one)."""
    if requested is None:
        return default_candidates(world, num_nodes)
    out = [
        c
        if isinstance(c, Candidate)
        else parse_candidate(c)
        if isinstance(c, str)
        else Candidate(_as_planned(c))
        if isinstance(c, ParallelPlan)
        else from_strategy(c)
        for c in requested
    ]
    check_layout(out, world, num_nodes)
    return out


def check_layout(out: List[Candidate], world: int, num_nodes: int) -> None:
    """Refuse configurations this world cannot run, before anything is traced."""
    for c in out:
        if c.plan.splits_at_nodes and (num_nodes < 2 or world % num_nodes):
            raise PlanError(
                f"HYBRID_SHARD replicates across nodes and shards within one, but num_nodes={num_nodes} "
                f"(world size {world}) cannot be split that way. Use num_nodes>=2, or FULL_SHARD on "
                "one node."
            )
        if c.plan.uses_ac and not accounting_for(c.plan).has_ac_option:
            raise PlanError(
                "DDP has no activation-checkpointing option in shardwise; use FSDP NO_SHARD + AC "
                "(the same replication) or ZeRO with AC."
            )
    if not out:
        raise PlanError("No configurations to plan.")

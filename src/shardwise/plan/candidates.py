"""The configurations the planner compares, and how each becomes a real strategy object.

A `Candidate` is what a user would try, from the least to the most sharded: DDP;
FSDP NO_SHARD, SHARD_GRAD_OP, FULL_SHARD, HYBRID_SHARD, each with and
without activation checkpointing; FULL_SHARD with CPU offload; DeepSpeed
ZeRO-1/2/3 and ZeRO-3 offload; each at a micro-batch size with gradient
accumulation that keeps the global batch. `build_strategy` is the only place a
candidate turns into a strategy, and both the planner's fake-tensor trace and
the accuracy benchmark's real runs call it, so what is predicted and what is
measured are the same configuration by construction.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import Any, Dict, List, Optional, Sequence

from shardwise.plan.presets import PlanError, divisors
from shardwise.strategies import DDPStrategy, FSDPStrategy
from shardwise.strategies.deepspeed import DeepSpeedStrategy
from shardwise.strategies.names import AC_SUFFIX, resolve
from shardwise.strategies.parallel import ParallelPlan
from shardwise.strategies.single import SingleDeviceStrategy

FSDP_SHARDINGS = ("NO_SHARD", "SHARD_GRAD_OP", "FULL_SHARD", "HYBRID_SHARD")


@dataclass(frozen=True)
class Candidate:
    """One configuration. kind: "ddp" | "fsdp" | "deepspeed"."""

    kind: str
    sharding: str = ""  # FSDP sharding strategy
    stage: int = 0  # DeepSpeed ZeRO stage
    activation_checkpointing: bool = False
    offload: bool = False
    micro_batch: int = 1
    accumulation: int = 1
    # plan(strategy=obj): the user's own strategy object, traced as it is (its wrap policy, mesh,
    # bucket layout); `custom` names it so two such objects are never confused as dict keys.
    custom: str = ""
    strategy: Any = field(default=None, compare=False, hash=False, repr=False)

    @property
    def config_label(self) -> str:
        """The configuration without the batch split: what the user selects in the Trainer."""
        if self.custom:
            return self.custom
        if self.kind == "ddp":
            base = "DDP"
        elif self.kind == "fsdp":
            base = f"FSDP {self.sharding}"
        else:
            base = f"ZeRO-{self.stage}"
        if self.offload:
            base += " + offload"
        if self.activation_checkpointing:
            base += " + AC"
        return base

    @property
    def name(self) -> str:
        """The strategy table's name (strategies/names.py), `_ac` for checkpointing: what --only reads back."""
        if self.kind == "ddp":
            return "ddp" + (AC_SUFFIX if self.activation_checkpointing else "")
        if self.kind == "fsdp":
            plan = ParallelPlan(
                "fsdp", sharding=self.sharding, offload_params=self.offload, offload_optimizer=self.offload
            )
        else:
            plan = ParallelPlan(
                "deepspeed",
                zero_stage=self.stage,
                offload_optimizer=self.offload,
                offload_params=self.offload and self.stage == 3,
            )
        plan = replace(plan, ac="full" if self.activation_checkpointing else "none")
        return plan.name or "custom"  # a user's strategy object with no name (e.g. HYBRID_SHARD + offload)

    @property
    def label(self) -> str:
        return f"{self.config_label}, mb {self.micro_batch}x{self.accumulation}"

    @property
    def config_key(self) -> "Candidate":
        return replace(self, micro_batch=0, accumulation=0)

    def with_batch(self, micro_batch: int, accumulation: int) -> "Candidate":
        return replace(self, micro_batch=micro_batch, accumulation=accumulation)

    def trainer_strategy_code(self, block: str = "Block") -> str:
        """The Trainer argument a user writes for this candidate (shown in reports and warnings)."""
        if self.strategy is not None:
            return f"<your {type(self.strategy).__name__} object>"
        ac = f", activation_checkpointing_policy={{{block}}}" if self.activation_checkpointing else ""
        if self.kind == "ddp":
            return '"ddp"' if not ac else f"DDPStrategy()  # + checkpoint {block} yourself"
        if self.kind == "fsdp":
            extra = "" if self.sharding == "FULL_SHARD" else f', sharding_strategy="{self.sharding}"'
            off = ", cpu_offload=True" if self.offload else ""
            return f"FSDPStrategy(auto_wrap_policy={{{block}}}{extra}{ac}{off})"
        off = ", offload_optimizer=True, offload_parameters=True" if self.offload else ""
        return f"DeepSpeedStrategy(stage={self.stage}{off}{ac})"

    def build_strategy(
        self, block_classes: Sequence[Any], precision: Any = None, deepspeed_config: Optional[Dict[str, Any]] = None
    ) -> Any:
        """The strategy object the Trainer would run for this candidate."""
        blocks = set(block_classes) if block_classes else None
        ac = blocks if self.activation_checkpointing else None
        if self.activation_checkpointing and not blocks:
            raise PlanError("activation checkpointing needs the model's block class; none was found")
        if self.kind == "ddp":
            from shardwise.strategies import DDPStrategy

            return DDPStrategy(precision=precision)
        if self.kind == "fsdp":
            from shardwise.strategies import FSDPStrategy

            return FSDPStrategy(
                auto_wrap_policy=blocks,
                activation_checkpointing_policy=ac,
                sharding_strategy=self.sharding,
                cpu_offload=self.offload,
                precision=precision,
            )

        return DeepSpeedStrategy(
            stage=self.stage,
            offload_optimizer=self.offload or None,
            offload_parameters=(self.offload and self.stage == 3) or None,
            activation_checkpointing_policy=ac,
            precision=precision,
            config=deepspeed_config,
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
        named = resolve(name, allow_ac=True)
    except ValueError as exc:
        raise PlanError(str(exc)) from None
    ac, options = named.activation_checkpointing, named.options
    if named.kind in ("single", "ddp"):
        return Candidate("ddp", activation_checkpointing=ac)
    if named.kind == "fsdp":
        return Candidate(
            "fsdp",
            sharding=options.get("sharding_strategy", "FULL_SHARD"),
            offload=bool(options.get("cpu_offload")),
            activation_checkpointing=ac,
        )
    return Candidate(
        "deepspeed", stage=options["stage"], offload=bool(options.get("offload_optimizer")), activation_checkpointing=ac
    )


def batch_splits(batch_size: int) -> List[tuple]:
    """(micro_batch, accumulation) pairs that keep the per-device batch, largest micro-batch first."""
    return [(m, batch_size // m) for m in sorted(divisors(batch_size), reverse=True)]


def from_strategy(strategy: Any) -> Candidate:
    """plan(strategy=obj): the candidate that traces exactly this strategy object.

    FSDP and DDP are traced with a fresh copy of the object itself (its wrap
    policy -- none means the whole model is one unit, gathered at once --,
    its checkpointing policy, mesh, gradient-bucket layout and accumulation
    mode); DeepSpeed with its stage, offload and resolved configuration.
    """

    if isinstance(strategy, str):
        from shardwise.strategies import build_strategy

        try:
            strategy = build_strategy(strategy, world_size=2)
        except ValueError as exc:
            raise PlanError(str(exc)) from exc
    if isinstance(strategy, (DDPStrategy, SingleDeviceStrategy)):
        bucket_view = getattr(strategy, "ddp_kwargs", {}).get("gradient_as_bucket_view", True)
        label = "DDP" + ("" if bucket_view else " (gradient_as_bucket_view=False)")
        return Candidate("ddp", custom=label + " (your strategy)", strategy=strategy)
    if isinstance(strategy, FSDPStrategy):
        wrap = "" if strategy.auto_wrap_policy is not None else ", no auto_wrap_policy: one unit"
        sync = (
            ""
            if strategy.accumulation_sync == "reduce_scatter"
            else f", accumulation_sync={strategy.accumulation_sync}"
        )
        base = Candidate(
            "fsdp",
            sharding=strategy.sharding_strategy,
            offload=bool(strategy.cpu_offload),
            activation_checkpointing=strategy.activation_checkpointing_policy is not None,
        )
        return replace(base, custom=f"{base.config_label}{wrap}{sync} (your strategy)", strategy=strategy)
    if type(strategy).__name__ == "DeepSpeedStrategy":
        base = Candidate(
            "deepspeed",
            stage=strategy.stage,
            offload=bool(strategy.offload_optimizer),
            activation_checkpointing=getattr(strategy, "activation_checkpointing_policy", None) is not None,
        )
        return replace(base, custom=f"{base.config_label} (your strategy)", strategy=strategy)
    raise PlanError(
        f"The planner does not model {type(strategy).__name__}; plan one of DDPStrategy, FSDPStrategy, "
        "DeepSpeedStrategy (or a name: ddp, fsdp, deepspeed_stage_3, ...)."
    )

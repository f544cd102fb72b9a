"""The recipe's strategy flags -> a ParallelPlan -> the strategy object, checked before any worker starts.

`shardwise finetune` spells a parallel configuration with its own flags (the
strategy name, sharding_strategy, cpu_offload, gradient_checkpointing,
auto_wrap_policy, strategy_options). `build_recipe_strategy` turns them into
one ParallelPlan (strategies/parallel.py) and builds the strategy from it;
validate_config runs it in the process the user started, so an unknown name,
an option the strategy's class does not take, or two flags that contradict
each other fail before any worker or weight exists. The config is the
recipe's FinetuneConfig (finetune.py), read by field name only.
"""

from __future__ import annotations

import dataclasses
import inspect
from typing import Any, Dict

from shardwise.recipes.hf_model import model_block_names
from shardwise.strategies import CLASSES, build_strategy
from shardwise.strategies.fsdp_compat import sharding_strategy_name
from shardwise.strategies.names import STRATEGIES, resolve
from shardwise.strategies.parallel import ParallelPlan


def recipe_strategies() -> tuple:
    """Every `strategy` name the recipe takes: "auto" and the strategy table's names (strategies/names.py)."""
    return ("auto", *STRATEGIES)


def check_strategy_options(cfg: Any, cls: Any, owned: Dict[str, str], fixed: Dict[str, Any]) -> Dict[str, Any]:
    """Check `cfg.strategy_options` against `cls`'s constructor; return them as keyword arguments.

    `owned`: constructor arguments the recipe sets from its own fields (key ->
    field), which are refused here so that one value has one place. `fixed`:
    what the strategy name already implies (deepspeed_stage_3 -> stage=3);
    an option may repeat it but not contradict it.
    """

    if not isinstance(cfg.strategy_options or {}, dict):
        raise ValueError(
            f"strategy_options must be a mapping of {cls.__name__} arguments, "
            f"got {type(cfg.strategy_options).__name__}."
        )
    options = dict(cfg.strategy_options or {})
    valid = [
        n
        for n, p in inspect.signature(cls.__init__).parameters.items()
        if n != "self" and p.kind not in (p.VAR_KEYWORD, p.VAR_POSITIONAL)
    ]
    for key, value in options.items():
        if key in owned:
            raise ValueError(
                f"strategy_options[{key!r}]: the recipe sets {cls.__name__}'s {key} from its own "
                f"option {owned[key]!r}; set {owned[key]}: {value!r} instead of putting it in "
                "strategy_options."
            )
        if key not in valid:
            allowed = [n for n in valid if n not in owned]
            raise ValueError(
                f"strategy_options[{key!r}] is not an argument of {cls.__name__} "
                f"(strategy={cfg.strategy!r}). Valid: {', '.join(allowed)}."
            )
        if key in fixed and fixed[key] != value:
            raise ValueError(
                f"strategy_options[{key!r}]={value!r} contradicts strategy={cfg.strategy!r}, which "
                f"means {key}={fixed[key]!r}. Use strategy='deepspeed' with the options, or drop it."
            )
    return options


def build_recipe_strategy(cfg: Any, folder: Any) -> Any:
    """The strategy object for `cfg` (also run by validate_config, so every mistake surfaces up front).

    The name is a ParallelPlan (strategies/names.py); the recipe's own options fill in what the name leaves
    open -- sharding_strategy and cpu_offload for FSDP, gradient_checkpointing (full, on the model's blocks)
    -- and the plan builds the strategy, with strategy_options as further constructor arguments.
    """
    if cfg.strategy.lower().strip() == "auto":
        plan, key = None, "auto"
    else:
        try:
            key = resolve(cfg.strategy).name  # the table's spelling: "deepspeed" alone leaves the stage open
            plan = ParallelPlan.from_name(cfg.strategy, allow_ac=False)
        except ValueError:
            raise ValueError(
                f"strategy={cfg.strategy!r} is not a fine-tuning strategy. Valid: {', '.join(recipe_strategies())}."
            ) from None
    blocks = list(cfg.auto_wrap_policy or model_block_names(folder.config))
    owned = {"precision": "precision", "timeout_s": "timeout_s"}
    if cfg.gradient_checkpointing:
        if not blocks:
            raise ValueError(
                f"{type(folder.config).__name__} declares no _no_split_modules, so there is no "
                "decoder layer to checkpoint; set auto_wrap_policy to the block class name(s)."
            )
        if plan is None or plan.engine not in ("fsdp", "deepspeed"):
            raise ValueError(
                "gradient_checkpointing is applied by the FSDP or DeepSpeed strategy here; "
                "use strategy='fsdp' or a deepspeed one."
            )
        owned["activation_checkpointing_policy"] = "gradient_checkpointing"
        plan = dataclasses.replace(plan, ac="full")
    if plan is None or plan.engine == "single":
        if cfg.strategy_options:
            raise ValueError(
                f"strategy_options={cfg.strategy_options!r}: strategy={cfg.strategy!r} takes no options; "
                "choose fsdp, ddp or a deepspeed strategy to pass them."
            )
        return "auto" if plan is None else build_strategy(plan)
    implied = plan.strategy_options()  # what the name fixes, e.g. its sharding or ZeRO stage
    extra: Dict[str, Any] = {"timeout_s": cfg.timeout_s}
    if plan.engine == "fsdp":
        # A name like fsdp_hybrid_shard fixes what the recipe's own field would otherwise say.
        sharding = implied.get("sharding_strategy", cfg.sharding_strategy)
        offload = implied.get("cpu_offload", cfg.cpu_offload)
        for field_name, value in (("sharding_strategy", sharding), ("cpu_offload", offload)):
            if getattr(cfg, field_name) not in (value, type(cfg).__dataclass_fields__[field_name].default):
                raise ValueError(
                    f"{field_name}={getattr(cfg, field_name)!r} contradicts strategy={cfg.strategy!r}, "
                    f"which means {field_name}={value!r}. Use strategy='fsdp' with {field_name}, "
                    "or drop it."
                )
        if not blocks:
            raise ValueError(
                f"{type(folder.config).__name__} declares no _no_split_modules, so there is no "
                "transformer block to shard by; set auto_wrap_policy to the block class name(s)."
            )
        owned.update({k: k for k in ("auto_wrap_policy", "sharding_strategy", "cpu_offload", "state_dict_type")})
        # Any spelling FSDPStrategy takes (torch's enum, Accelerate's numbers); 5, HYBRID_SHARD
        # without resharding, also means reshard_after_forward=False unless strategy_options say it.
        sharding, reshard = sharding_strategy_name(sharding)
        if reshard is not None:
            extra["reshard_after_forward"] = reshard
        plan = dataclasses.replace(plan, sharding=sharding, offload_params=offload, offload_optimizer=offload)
        extra["state_dict_type"] = cfg.state_dict_type
    elif plan.engine == "deepspeed":
        fsdp_only = [
            f
            for f, default in (("sharding_strategy", "FULL_SHARD"), ("state_dict_type", "sharded"))
            if getattr(cfg, f) != default
        ]
        if fsdp_only:
            raise ValueError(
                f"{', '.join(fsdp_only)} configure FSDP; strategy={cfg.strategy!r} does not use "
                "them. Remove them (DeepSpeed's ZeRO stage comes from the strategy name)."
            )
        owned["cpu_offload"] = "cpu_offload"
        if key == "deepspeed":  # the stage comes from strategy_options or the DeepSpeed config (default 2)
            plan, implied = dataclasses.replace(plan, zero_stage=None), {}
        # DeepSpeed's own cpu_offload: the optimizer, and the parameters too when the stage (which
        # may come from the user's DeepSpeed config, unknown here) is 3.
        extra["cpu_offload"] = True if cfg.cpu_offload else None
    options = check_strategy_options(cfg, CLASSES[plan.engine], owned, implied)
    return build_strategy(plan, blocks=blocks, **{**extra, **options})

"""The recipe's strategy flags -> a ParallelPlan -> the strategy object, checked before any worker starts.

`shardwise finetune` spells a parallel configuration with its own flags (the
strategy name, sharding_strategy, cpu_offload, gradient_checkpointing,
auto_wrap_policy, strategy_options). `build_recipe_strategy` turns them into
one ParallelPlan (strategies/parallel.py) and builds the strategy from it;
validate_config runs it in the process the user started, so an unknown name,
an option the strategy's class does not take, or two flags that contradict
each other fail before any worker or weight exists. The config is the
recipe's FinetuneConfig (finetune.py), read by field name only.

`tp_size` / `sp_size` become the plan's tensor and sequence degrees (FSDP2 on
one DeviceMesh with them). `check_parallel` refuses, each with its fix, what
those degrees cannot run with: a world size they do not divide, attention
heads, key/value heads or a sequence length they do not split evenly, ZeRO,
offload or adapters beside tensor parallel, torch.compile, and flash-attn's
own kernels under sequence parallel.
"""

from __future__ import annotations

import inspect
from typing import Any, Dict

from shardwise.distributed.env import detect_env, resolve_accelerator, resolve_devices
from shardwise.recipes.hf_model import model_block_names
from shardwise.recipes.moe import check_experts
from shardwise.strategies import CLASSES, build_strategy, degrees, names
from shardwise.strategies.fsdp_compat import sharding_strategy_name
from shardwise.strategies.parallel import PLANS, ParallelPlan


def recipe_strategies() -> tuple:
    """Every `strategy` name the recipe takes: "auto" and the strategy table's names (strategies/names.py)."""
    return ("auto", *names.TABLE)


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


def recipe_world_size(cfg: Any) -> int:
    """Ranks the run will have: the launcher's world size inside a worker, else devices x num_nodes."""
    env = detect_env()
    if env is not None:
        return env.world_size
    return resolve_devices(cfg.devices, resolve_accelerator(cfg.accelerator)) * max(int(cfg.num_nodes or 1), 1)


def check_parallel(cfg: Any, folder: Any, engine: str = "fsdp") -> None:
    """Refuse a tp_size / sp_size the run cannot honour, before any worker starts; each message names the fix.

    `engine`: the strategy name's engine ("auto" when the name is auto). The rules and their texts are
    strategies/degrees.py's, shared with the plan, the strategy and the planner; what only a Hugging Face
    model folder can say (its tensor-parallel plan and the styles in it) is checked here.
    """
    tp, sp = cfg.tp_size, cfg.sp_size
    for name, value in zip(degrees.FLAGS, (tp, sp)):
        degrees.refuse(degrees.value_problem(name, value))
    # ep_size: the model's experts, the engine, the world, and what ep is not combined with
    check_experts(cfg, folder, engine, recipe_world_size(cfg))
    if tp * sp == 1:
        return
    degrees.refuse(degrees.engine_problem(engine, tp, sp))
    degrees.refuse(degrees.world_problem(recipe_world_size(cfg), tp, sp))
    config = folder.config
    model = type(config).__name__
    heads = getattr(config, "num_attention_heads", None)
    kv_heads = getattr(config, "num_key_value_heads", None) or heads
    if heads is not None:
        degrees.refuse(
            degrees.heads_problem(
                heads, kv_heads, tp, sp, model, f"{cfg.model_path}/config.json", fields=degrees.HF_HEAD_FIELDS
            )
        )
    seq = cfg.data.max_seq_len
    if cfg.data.packing:  # unpacked batches are padded up to a multiple of sp
        degrees.refuse(degrees.sequence_problem(seq, tp, sp, "max_seq_len", tp_slices=False))
    if sp > 1:  # what the Hugging Face attention hook cannot honour: dropout, soft-capping, a short window
        from shardwise.strategies.sequence_parallel_hf import check_hf_sequence_parallel

        check_hf_sequence_parallel(config, sp, model, max_seq_len=seq)
    if tp > 1:
        if getattr(config, "base_model_tp_plan", None) is None:
            raise ValueError(
                f"tp_size={tp}: {model} ({cfg.model_path}) declares no tensor-parallel plan "
                "(base_model_tp_plan in transformers), so there is no column/row split to apply. Use sp_size "
                "or more FSDP ranks instead, or a model type that has one (Llama, Mistral, Qwen2, ...)."
            )
        from shardwise.strategies.tensor_parallel import HF_STYLES

        plan = {**(config.base_model_tp_plan or {}), **_causal_lm_tp_plan(config)}
        unknown = sorted({f"{key}: {style}" for key, style in plan.items() if style not in HF_STYLES})
        if unknown:
            raise ValueError(
                f"tp_size={tp}: {model}'s tp_plan uses styles shardwise does not translate "
                f"({', '.join(unknown)}; known: {', '.join(sorted(HF_STYLES))}). Use sp_size or FSDP alone "
                "for this model."
            )
        tied = bool(getattr(config, "tie_word_embeddings", False))
        degrees.refuse(degrees.tied_problem(tp, tied, f"{model} (tie_word_embeddings in config.json)"))
        degrees.refuse(degrees.split_problem(tp, "intermediate_size", getattr(config, "intermediate_size", None)))
        if "lm_head" in _causal_lm_tp_plan(config):
            degrees.refuse(degrees.split_problem(tp, "vocab_size", getattr(config, "vocab_size", None)))
        offload = bool(cfg.cpu_offload or "offload" in str(cfg.strategy).lower())
        degrees.refuse(degrees.offload_problem(tp, offload))
        adapter = "load_in_4bit (QLoRA)" if cfg.load_in_4bit else f"lora_r={cfg.lora_r} (LoRA)" if cfg.lora_r else None
        degrees.refuse(degrees.adapter_problem(tp, adapter))
    degrees.refuse(degrees.compile_problem(tp, sp, bool(cfg.torch_compile), flag="torch_compile"))
    degrees.refuse(degrees.attention_problem(sp, cfg.attn_implementation))


def _causal_lm_tp_plan(config: Any) -> Dict[str, str]:
    """The causal-LM class's own tp_plan entries (its head: Llama's lm_head is split column-wise)."""
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING

    try:
        return dict(getattr(MODEL_FOR_CAUSAL_LM_MAPPING[type(config)], "_tp_plan", None) or {})
    except KeyError:
        return {}


def build_recipe_strategy(cfg: Any, folder: Any) -> Any:
    """The strategy object for `cfg` (also run by validate_config, so every mistake surfaces up front).

    The name is a ParallelPlan's fields (strategies/names.py); the recipe's own options fill in what the
    name leaves open -- sharding_strategy and cpu_offload for FSDP, gradient_checkpointing (full, on the
    model's blocks), tp_size and sp_size (check_parallel refuses what they cannot run with first) -- and
    the one plan they make builds the strategy, with strategy_options as further constructor arguments.
    """
    if cfg.strategy.lower().strip() == "auto":
        key, fields = "auto", None
    else:
        try:
            key = names.key_of(cfg.strategy)[0]  # the table's spelling: "deepspeed" alone leaves the stage open
        except ValueError:
            raise ValueError(
                f"strategy={cfg.strategy!r} is not a fine-tuning strategy. Valid: {', '.join(recipe_strategies())}."
            ) from None
        fields = dict(names.TABLE[key])
    engine = "auto" if fields is None else fields["engine"]
    check_parallel(cfg, folder, engine)
    blocks = list(cfg.auto_wrap_policy or model_block_names(folder.config))
    owned = {"precision": "precision", "timeout_s": "timeout_s"}
    if cfg.gradient_checkpointing:
        if not blocks:
            raise ValueError(
                f"{type(folder.config).__name__} declares no _no_split_modules, so there is no "
                "decoder layer to checkpoint; set auto_wrap_policy to the block class name(s)."
            )
        if engine not in ("fsdp", "deepspeed"):
            raise ValueError(
                "gradient_checkpointing is applied by the FSDP or DeepSpeed strategy here; "
                "use strategy='fsdp' or a deepspeed one."
            )
        owned["activation_checkpointing_policy"] = "gradient_checkpointing"
        fields["ac"] = "full"
    if fields is None or engine == "single":
        if cfg.strategy_options:
            raise ValueError(
                f"strategy_options={cfg.strategy_options!r}: strategy={cfg.strategy!r} takes no options; "
                "choose fsdp, ddp or a deepspeed strategy to pass them."
            )
        return "auto" if fields is None else build_strategy(ParallelPlan(**fields))
    implied = PLANS[key].strategy_options()  # what the name fixes, e.g. its sharding or ZeRO stage
    extra: Dict[str, Any] = {"timeout_s": cfg.timeout_s}
    if engine == "fsdp":
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
        fields.update(sharding=sharding, offload_params=bool(offload), offload_optimizer=bool(offload))
        extra["state_dict_type"] = cfg.state_dict_type
    elif engine == "deepspeed":
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
            fields["zero_stage"], implied = None, {}
        # DeepSpeed's own cpu_offload: the optimizer, and the parameters too when the stage (which
        # may come from the user's DeepSpeed config, unknown here) is 3.
        extra["cpu_offload"] = True if cfg.cpu_offload else None
    owned.update(tp_size="tp_size", sp_size="sp_size", ep_size="ep_size")
    if cfg.tp_size * cfg.sp_size > 1:  # fsdp only (check_parallel); the plan lays out the mesh
        fields.update(tp=cfg.tp_size, sp=cfg.sp_size)
    ep = int(getattr(cfg, "ep_size", 1) or 1)
    if ep > 1:  # fsdp only (check_parallel); carved out of the data-parallel shard ranks (strategies/mesh.py)
        fields[degrees.EP_FIELD] = ep
    plan = ParallelPlan(**fields)  # the run's one plan
    options = check_strategy_options(cfg, CLASSES[plan.engine], owned, implied)
    return build_strategy(plan, blocks=blocks, **{**extra, **options})

"""docs/coming-from.md's generated tables: their names and ours, and the Lightning hook rows.

What a Lightning, Accelerate or Hugging Face FSDP-recipe user writes, and what
it means here, is one table kept in code so it cannot drift:
`tests/unit/test_compat_table.py` runs every row's `check` (the spelling is
accepted and means what the row says) and asserts that docs/coming-from.md
carries `render_block()` verbatim between `<!-- compat-table -->` markers.
Edit a row here, then paste the output of `python tests/helpers/coming_from.py`
into docs/coming-from.md. `render_rows(owner)` renders the hook rows of the
"Coming from Lightning" section from `shardwise.trainer.lightning_hooks.HOOKS`
(tests/unit/test_lightning_hooks.py keeps them in step). Documentation
generators live here, beside their tests, not in the package.
"""

from __future__ import annotations

import warnings
from dataclasses import dataclass
from typing import Callable, List, Optional

import torch.distributed.fsdp as torch_fsdp

from shardwise.recipes.hf_args import map_accelerate_config, translate_argv
from shardwise.strategies import FSDPStrategy
from shardwise.trainer.lightning_hooks import HOOKS, REFUSED, Hook

MARK_START, MARK_END = "<!-- compat-table -->", "<!-- /compat-table -->"


@dataclass(frozen=True)
class Row:
    source: str  # "Lightning", "torch FSDP1", "Accelerate config", "HF recipe"
    theirs: str
    ours: str
    note: str = ""
    check: Optional[Callable[[], bool]] = None  # True when the spelling is accepted as `ours` says


def _fsdp(**kw):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # the once-per-process notes
        return FSDPStrategy(**kw)


def _precision_of(strategy) -> str:
    """The precision a strategy runs with, resolved as the Trainer does (on CPU)."""
    strategy.connect(accelerator="cpu")
    return strategy.precision.name


def _argv(*args: str) -> List[str]:
    return translate_argv(list(args))[0]


def _notes(*args: str) -> List[str]:
    return translate_argv(list(args))[1]


def _accel(fsdp: dict, **top):
    return map_accelerate_config({"distributed_type": "FSDP", **top, "fsdp_config": fsdp})


def _torch(name: str):
    return getattr(torch_fsdp, name)


NOTHING = "accepted; FSDP2 has nothing to do for it (said once)"

ROWS: List[Row] = [
    # ---------------------------------------------------------------- Lightning
    Row("Lightning", '`Trainer(accelerator="gpu")`', '`accelerator="cuda"` (both accepted)'),
    Row("Lightning", "`Trainer(gpus=N)`", '`Trainer(accelerator="cuda", devices=N)`', "accepted with a warning"),
    Row("Lightning", '`Trainer(accelerator="ddp")` (1.x)', '`strategy="ddp"`', "accepted with a warning"),
    Row(
        "Lightning",
        "`plugins=DeepSpeedPlugin(stage=3, cpu_offload=True)`",
        "`strategy=DeepSpeedStrategy(stage=3, cpu_offload=True)`",
        "`shardwise.DeepSpeedPlugin` is an alias",
    ),
    Row("Lightning", "`trainer.fit(model)` with `train_dataloader()` / `val_dataloader()`", "the same"),
    Row("Lightning", "`LightningDataModule`, `fit(model, datamodule=dm)`", "`shardwise.DataModule`, the same"),
    Row(
        "Lightning",
        "`lightning.pytorch.demos.Transformer`, `WikiText2()`, `LightningTransformer`",
        "the same (Lightning's model, defaults and numbers)",
        "WikiText2 reads `./data/wikitext-2.txt` (or `data_dir`); shardwise never downloads",
        lambda: __import__("shardwise.demos", fromlist=["Transformer"]).Transformer().ninp == 200,
    ),
    Row(
        "Lightning",
        "`FSDPStrategy(auto_wrap_policy={Block})`",
        "the same; also class names, callables and `partial(size_based_auto_wrap_policy, ...)`",
        "",
        lambda: _fsdp(auto_wrap_policy={_torch("FSDPModule")}).auto_wrap_policy is not None,
    ),
    Row(
        "Lightning",
        "`activation_checkpointing_policy={Block}`",
        "the same",
        "",
        lambda: (
            _fsdp(activation_checkpointing_policy={_torch("FSDPModule")}).activation_checkpointing_policy is not None
        ),
    ),
    Row(
        "Lightning",
        "`activation_checkpointing=Block` (2.0)",
        "`activation_checkpointing_policy={Block}`",
        "",
        lambda: (
            _fsdp(activation_checkpointing=_torch("FSDPModule")).activation_checkpointing_policy is _torch("FSDPModule")
        ),
    ),
    Row(
        "Lightning",
        '`sharding_strategy="SHARD_GRAD_OP"`',
        "the same (FSDP2 `reshard_after_forward=False`)",
        "",
        lambda: _fsdp(sharding_strategy="SHARD_GRAD_OP").reshard_after_forward is False,
    ),
    Row(
        "Lightning",
        '`sharding_strategy="HYBRID_SHARD"` on one node',
        "a 1 x N mesh: trains like FULL_SHARD",
        "N nodes: an N x devices mesh",
        lambda: _fsdp(sharding_strategy="HYBRID_SHARD").sharding_strategy == "HYBRID_SHARD",
    ),
    Row(
        "Lightning",
        '`state_dict_type="full"` / `"sharded"`',
        "the same",
        'our default is "sharded" (Lightning\'s is "full")',
        lambda: _fsdp(state_dict_type="full").state_dict_type == "full",
    ),
    Row(
        "Lightning",
        "`limit_all_gathers=True`",
        NOTHING,
        "FSDP2 always rate-limits its all-gathers",
        lambda: _fsdp(limit_all_gathers=True) is not None,
    ),
    Row(
        "Lightning",
        "`precision=16`",
        '`"16-mixed"` (CUDA); use `"bf16-mixed"` on CPU',
        "fp16 on CPU is refused before any process starts",
    ),
    Row(
        "Lightning",
        "`wrap(layer)` inside `configure_model`",
        "the same (`torch.distributed.fsdp.wrap.wrap` or `shardwise.wrap`)",
        "a no-op under other strategies",
    ),
    # ------------------------------------------------------- torch FSDP1 objects
    Row(
        "torch FSDP1",
        "`ShardingStrategy.FULL_SHARD` ... `_HYBRID_SHARD_ZERO2`",
        "`sharding_strategy=` the same name",
        "_HYBRID_SHARD_ZERO2 = HYBRID_SHARD with `reshard_after_forward=False`",
        lambda: _fsdp(sharding_strategy=_torch("ShardingStrategy").SHARD_GRAD_OP).sharding_strategy == "SHARD_GRAD_OP",
    ),
    Row(
        "torch FSDP1",
        "`cpu_offload=CPUOffload(offload_params=True)`",
        "`cpu_offload=True`",
        "",
        lambda: _fsdp(cpu_offload=_torch("CPUOffload")(offload_params=True)).cpu_offload is True,
    ),
    Row(
        "torch FSDP1",
        "`mixed_precision=MixedPrecision(param_dtype=torch.bfloat16)`",
        '`precision="bf16-mixed"`',
        "other reduce/buffer dtypes are named, not honoured",
        lambda: (
            _precision_of(_fsdp(mixed_precision=_torch("MixedPrecision")(param_dtype=__import__("torch").bfloat16)))
            == "bf16-mixed"
        ),
    ),
    Row(
        "torch FSDP1",
        "`StateDictType.SHARDED_STATE_DICT` / `FULL_STATE_DICT`",
        '`state_dict_type="sharded"` / `"full"`',
        "LOCAL_STATE_DICT is refused (no flat parameters in FSDP2)",
        lambda: _fsdp(state_dict_type=_torch("StateDictType").FULL_STATE_DICT).state_dict_type == "full",
    ),
    Row(
        "torch FSDP1",
        "`use_orig_params=True`",
        NOTHING,
        "FSDP2 parameters are always the originals (DTensors)",
        lambda: _fsdp(use_orig_params=True) is not None,
    ),
    Row(
        "torch FSDP1",
        "`sync_module_states=True`",
        NOTHING,
        "every rank materialises or loads its own shard",
        lambda: _fsdp(sync_module_states=True) is not None,
    ),
    Row(
        "torch FSDP1",
        "`backward_prefetch=BackwardPrefetch.BACKWARD_PRE`",
        NOTHING,
        "FSDP2 always prefetches the next unit in backward",
        lambda: _fsdp(backward_prefetch=_torch("BackwardPrefetch").BACKWARD_PRE) is not None,
    ),
    Row(
        "torch FSDP1",
        "`forward_prefetch=True`",
        NOTHING,
        "no explicit forward prefetch is configured",
        lambda: _fsdp(forward_prefetch=True) is not None,
    ),
    Row(
        "any",
        "a non-torch optimizer (bitsandbytes `PagedAdamW32bit`, `AdamW8bit`, your own)",
        "works under FSDP: steps on each rank's local shards",
        "`FSDPStrategy(optimizer_on_local_shards=...)` forces it on/off; 8-bit state cannot be checkpointed under FSDP",
        lambda: _fsdp(optimizer_on_local_shards=True).optimizer_on_local_shards is True,
    ),
    Row(
        "torchtitan",
        '`activation_checkpoint.mode = "selective"`, `selective_ac_option = "op"` or `"2"`',
        '`FSDPStrategy(activation_checkpointing_mode="selective", selective_ac_option="op")` or `2`',
        'with `activation_checkpointing_policy={Block}`; "full" is the default mode',
        lambda: _fsdp(activation_checkpointing_mode="selective", selective_ac_option="2").selective_ac_option == 2,
    ),
    # --------------------------------------------------- Accelerate config yaml
    Row(
        "Accelerate config",
        "`distributed_type: FSDP`",
        "`--strategy fsdp`",
        "DEEPSPEED, MULTI_GPU, MULTI_CPU, NO too",
        lambda: _accel({})[0]["strategy"] == "fsdp",
    ),
    Row(
        "Accelerate config",
        "`fsdp_sharding_strategy: 1` (or `FULL_SHARD`)",
        "`--sharding_strategy FULL_SHARD`",
        "1-5 as torch's enum",
        lambda: _accel({"fsdp_sharding_strategy": 2})[0]["sharding_strategy"] == "SHARD_GRAD_OP",
    ),
    Row(
        "Accelerate config",
        "`fsdp_auto_wrap_policy: TRANSFORMER_BASED_WRAP`",
        "the default: the model's `_no_split_modules`",
        "SIZE_BASED_WRAP / NO_WRAP are named, not honoured",
        lambda: "auto_wrap_policy" not in _accel({"fsdp_auto_wrap_policy": "TRANSFORMER_BASED_WRAP"})[0],
    ),
    Row(
        "Accelerate config",
        "`fsdp_transformer_layer_cls_to_wrap: LlamaDecoderLayer`",
        "`--auto_wrap_policy [LlamaDecoderLayer]`",
        "",
        lambda: (
            _accel({"fsdp_transformer_layer_cls_to_wrap": "LlamaDecoderLayer"})[0]["auto_wrap_policy"]
            == ["LlamaDecoderLayer"]
        ),
    ),
    Row(
        "Accelerate config",
        "`fsdp_offload_params: true`",
        "`--cpu_offload true`",
        "",
        lambda: _accel({"fsdp_offload_params": True})[0]["cpu_offload"] is True,
    ),
    Row(
        "Accelerate config",
        "`fsdp_state_dict_type: SHARDED_STATE_DICT`",
        "`--state_dict_type sharded`",
        "",
        lambda: _accel({"fsdp_state_dict_type": "SHARDED_STATE_DICT"})[0]["state_dict_type"] == "sharded",
    ),
    Row(
        "Accelerate config",
        "`fsdp_activation_checkpointing: true`",
        "`--gradient_checkpointing true`",
        "",
        lambda: _accel({"fsdp_activation_checkpointing": True})[0]["gradient_checkpointing"] is True,
    ),
    Row(
        "Accelerate config",
        "`fsdp_cpu_ram_efficient_loading`, `fsdp_sync_module_states`, `fsdp_use_orig_params`, "
        "`fsdp_forward_prefetch`, `fsdp_backward_prefetch`",
        "accepted; nothing to do (one note each)",
        "",
        lambda: len(_accel({"fsdp_sync_module_states": True, "fsdp_use_orig_params": True})[1]) == 2,
    ),
    Row(
        "Accelerate config",
        "`mixed_precision: bf16`",
        "`--precision bf16-mixed`",
        "fp16 -> 16-mixed, no -> 32-true",
        lambda: _accel({}, mixed_precision="bf16")[0]["precision"] == "bf16-mixed",
    ),
    Row(
        "Accelerate config",
        "`num_machines: 2`, `num_processes: 16`",
        "`--num_nodes 2 --devices 8`",
        "accelerate counts processes over all machines",
        lambda: _argv("--num_machines", "2", "--num_processes", "16")[-2:] == ["--devices", "8"],
    ),
    Row(
        "Accelerate config",
        "`machine_rank`, `main_process_ip`, `main_process_port`",
        "`shardwise launch --node-rank --master-addr --master-port`",
        "the launcher's settings; named when given",
    ),
    # ------------------------------------------------ the HF recipe's train.py
    Row(
        "HF recipe",
        "`--model_name meta-llama/...` (`--model_revision`)",
        "`--model_path meta-llama/...` (`--revision`): a hub id or a local folder",
        "safetensors, config and tokenizer files only, downloaded once per cache (HF_HOME, HF_TOKEN, HF_HUB_OFFLINE)",
        lambda: _argv("--model_name", "m") == ["--model_path", "m"],
    ),
    Row(
        "HF recipe",
        "`--dataset_name ...` (`--dataset_config_name`)",
        "`--dataset <hub id, file or folder>` (`--dataset_config`, `--dataset_revision`)",
        "",
        lambda: _argv("--dataset_name", "d") == ["--dataset", "d"],
    ),
    Row(
        "HF recipe",
        "`--bf16 True` / `--fp16 True`",
        "`--precision bf16-mixed` / `16-mixed`",
        "",
        lambda: _argv("--bf16", "True") == ["--precision", "bf16-mixed"],
    ),
    Row(
        "HF recipe",
        "`--use_flash_attn True`",
        "`--attn_implementation flash_attention_2`",
        "without CUDA: sdpa, with a note",
        lambda: bool(_argv("--use_flash_attn", "True") or _notes("--use_flash_attn", "True")),
    ),
    Row(
        "HF recipe",
        "`--use_reentrant False`",
        "always non-reentrant",
        "True is named, not honoured",
        lambda: _argv("--use_reentrant", "False") == [],
    ),
    Row(
        "HF recipe",
        "`--ddp_timeout 5400`",
        "`--timeout_s 5400`",
        "",
        lambda: _argv("--ddp_timeout", "5400") == ["--timeout_s", "5400"],
    ),
    Row(
        "HF recipe",
        "`--splits train_sft,test_sft`",
        "`--dataset_split train_sft --eval_split test_sft`",
        "the split trained on, then the one evaluated on",
        lambda: _argv("--splits", "train,test") == ["--dataset_split", "train", "--eval_split", "test"],
    ),
    Row(
        "HF recipe",
        "`--eval_strategy` (`--evaluation_strategy`) / `--save_strategy` `steps|epoch|no`",
        "the same names: every `--eval_steps` / `--save_steps`, at each epoch's end, or never",
        "`--logging_strategy` takes `steps` only",
        lambda: _argv("--evaluation_strategy", "epoch") == ["--eval_strategy", "epoch"],
    ),
    Row(
        "HF recipe",
        "`--max_length` (TRL), `--use_gradient_checkpointing`, `--use_4bit_quantization`",
        "`--max_seq_len`, `--gradient_checkpointing`, `--load_in_4bit`",
        "both spellings with different values are refused by name",
        lambda: _argv("--max_length", "512") == ["--max_seq_len", "512"],
    ),
    Row(
        "HF recipe",
        "`--use_peft_lora True`",
        "`--lora_r 64` unless `--lora_r` is given",
        "64 is the recipe's own default; `False` means full fine-tuning",
        lambda: _argv("--use_peft_lora", "True") == ["--lora_r", "64"],
    ),
    Row(
        "HF recipe",
        "`--chat_template_format chatml` / `none`",
        "the same: ChatML when the tokenizer has no template / text as is, messages by the tokenizer's template",
        "",
        lambda: _argv("--chat_template_format", "chatml") == ["--chat_template_format", "chatml"],
    ),
    Row(
        "HF recipe",
        '`--fsdp "full_shard auto_wrap offload"`',
        "`--strategy fsdp --sharding_strategy FULL_SHARD --cpu_offload true`",
        "",
        lambda: "--cpu_offload" in _argv("--fsdp", "full_shard auto_wrap offload"),
    ),
    Row("HF recipe", "`--fsdp_config fsdp_config.yaml` (or `--config_file`)", "read as the Accelerate rows above", ""),
    Row(
        "HF recipe",
        "`--optim paged_adamw_32bit`",
        "the same; on CPU unpaged",
        "bitsandbytes steps on FSDP's local shards",
        lambda: _argv("--optim", "paged_adamw_32bit") == ["--optim", "paged_adamw_32bit"],
    ),
    Row(
        "HF recipe",
        "`--log_level`, `--report_to`",
        "named in one note line each, not honoured",
        "",
        lambda: len(_notes("--log_level", "info", "--report_to", "wandb")) == 2,
    ),
    Row(
        "HF recipe",
        "`--push_to_hub`, `--hub_model_id`, `--hub_private_repo`, `--hub_strategy end|every_save`, `--hub_token`",
        "the same",
        "uploaded from rank 0 in the background after the export is verified; every_save: each checkpoint to "
        "last-checkpoint/",
        lambda: (
            _argv("--push_to_hub", "--hub_strategy", "every_save")
            == ["--push_to_hub", "true", "--hub_strategy", "every_save"]
        ),
    ),
    Row(
        "HF recipe",
        "`--learning_rate`, `--max_steps`, `--per_device_train_batch_size`, `--gradient_checkpointing`, "
        "`--packing`, `--max_seq_len`, ...",
        "the same names",
        "",
        lambda: _argv("--learning_rate", "1e-5") == ["--learning_rate", "1e-5"],
    ),
]


def _cell(text: str) -> str:
    return text.replace("|", "\\|")


def render_table() -> str:
    lines = ["| from | they write | shardwise | note |", "|---|---|---|---|"]
    lines += [f"| {r.source} | {_cell(r.theirs)} | {_cell(r.ours)} | {_cell(r.note)} |" for r in ROWS]
    return "\n".join(lines)


def render_block() -> str:
    return f"{MARK_START}\n{render_table()}\n{MARK_END}"


def status_word(hook: Hook) -> str:
    """The docs' word for a hook row: same, different (called, with a note) or refused."""
    if hook.status == REFUSED:
        return "refused"
    return "different" if hook.note or hook.moved or hook.args_differ else "same"


def render_rows(owner: str) -> str:
    """docs/coming-from.md's rows for `owner`'s hooks ("module", "callback", "datamodule")."""
    rows = []
    for hook in HOOKS:
        if hook.owner == owner:
            text = hook.where + (f"; {hook.note}" if hook.note else "")
            rows.append(f"| `{hook.name}` | {status_word(hook)} | {text.replace('|', '/')} |")
    return "\n".join(rows)


if __name__ == "__main__":
    print(render_block())

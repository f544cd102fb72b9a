"""The model families users fine-tune, each built tiny from its transformers config, through the recipe.

Every family is saved with `save_pretrained` (the layout its hub checkpoints have:
a Mixtral's experts one by one, a Qwen3-MoE's per-expert projections) with a
small word-level tokenizer, and fine-tuned by `shardwise finetune`'s function
with LoRA for 2 steps: on one process (global batch 2), and in one 2-rank gloo
launch that runs every family in turn under FSDP x 2 (batch 1 per rank) and,
where the family's config has a `base_model_tp_plan`, tensor parallel 2 and
sequence parallel 2 (batch 2). Each multi-rank run must give the one-process
losses; every merged export must load with AutoModelForCausalLM and give the
logits the trained model gave. The table of what works and what is refused
(and why) is docs/finetuning.md's model-matrix section: the test writes it and
fails when the committed section differs.

The mixture-of-experts acceptance rides on the same launch: a tiny Mixtral and
a tiny Qwen3-MoE fully fine-tuned in fp32 on one process and under FSDP x 2 on
the same global batches give per-step losses within 1e-5 of each other and of
a plain transformers training loop (AdamW, the batches the recipe trained on),
and their exports give the trained logits.
"""

from __future__ import annotations

import os
from typing import Any, Dict, List, Tuple

import pytest
import torch

from helpers.hf import build_tokenizer, chat_records, write_jsonl

transformers = pytest.importorskip("transformers")
pytest.importorskip("peft")

ROOT = os.path.join(os.path.dirname(__file__), "..", "..")
DOCS = os.path.join(ROOT, "docs", "finetuning.md")
CONSTRAINTS = os.path.join(ROOT, "constraints.txt")
BEGIN = "<!-- model-matrix: written by tests/recipes/test_model_matrix.py; do not edit by hand -->"
END = "<!-- model-matrix end -->"
STEPS = 2
PROBE = [[3, 8, 5, 9, 12, 4, 7, 6]]  # token ids whose logits the trained model and its export must agree on

# family -> (config class name, family-specific fields, LoRA targets). Hidden 16-32, 1-2 layers.
ATTN = dict(hidden_size=32, num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128)
FAMILIES: Dict[str, Tuple[str, Dict[str, Any], List[str]]] = {
    "Llama 3.x": ("LlamaConfig", dict(intermediate_size=64, rope_scaling=None), ["q_proj", "v_proj"]),
    "Qwen2.5": ("Qwen2Config", dict(intermediate_size=64), ["q_proj", "v_proj"]),
    "Qwen3 dense": ("Qwen3Config", dict(intermediate_size=64, head_dim=8), ["q_proj", "v_proj"]),
    "Mistral": ("MistralConfig", dict(intermediate_size=64, sliding_window=None), ["q_proj", "v_proj"]),
    "Gemma 2": ("Gemma2Config", dict(intermediate_size=64, head_dim=8, query_pre_attn_scalar=8), ["q_proj", "v_proj"]),
    "Gemma 3": (
        "Gemma3TextConfig",
        dict(intermediate_size=64, head_dim=8, query_pre_attn_scalar=8),
        ["q_proj", "v_proj"],
    ),
    "Phi-3 / Phi-4": ("Phi3Config", dict(intermediate_size=64), ["qkv_proj"]),
    "Mixtral": (
        "MixtralConfig",
        dict(intermediate_size=32, num_local_experts=4, num_experts_per_tok=2),
        ["q_proj", "v_proj"],
    ),
    "Qwen3-MoE": (
        "Qwen3MoeConfig",
        dict(intermediate_size=64, moe_intermediate_size=16, num_experts=4, num_experts_per_tok=2, head_dim=8),
        ["q_proj", "v_proj"],
    ),
    "gpt-oss": (
        "GptOssConfig",
        dict(intermediate_size=32, num_local_experts=4, num_experts_per_tok=2, head_dim=8, sliding_window=16),
        ["q_proj", "v_proj"],
    ),
}
MOE = ("Mixtral", "Qwen3-MoE")
# tp 2 and sp 2 run for these (one dense, one mixture-of-experts): every 2-rank run costs ~2 s of the suite.
# tp runs full fine-tuning (the recipe refuses LoRA with tp: PEFT's layers are not split by the tp plan).
PARALLEL = ("Llama 3.x", "Qwen3-MoE")
# transformers has no SDPA attention for these: the recipe runs them with attn_implementation=eager.
EAGER = ("Gemma 2", "gpt-oss")
LAYOUTS = ("1 process", "FSDP x 2", "tp 2", "sp 2")


def _slug(family: str) -> str:
    return "".join(c if c.isalnum() else "-" for c in family.lower())


def build_family(root: str, family: str, records: List[Dict]) -> str:
    """The family's tiny model and the tokenizer saved as a hub folder; its path."""
    cls_name, fields, _ = FAMILIES[family]
    texts = [m["content"] for r in records for m in r["messages"]]
    tokenizer = build_tokenizer(texts)
    config = getattr(transformers, cls_name)(
        vocab_size=len(tokenizer),
        num_hidden_layers=2,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
        tie_word_embeddings=False,
        **ATTN,
        **fields,
    )
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(config)
    path = os.path.join(root, _slug(family))
    model.save_pretrained(path)
    tokenizer.save_pretrained(path)
    return path


def has_tp_plan(model_dir: str) -> bool:
    config = transformers.AutoConfig.from_pretrained(model_dir)
    return bool(getattr(config, "base_model_tp_plan", None))


def run_config(family: str, model_dir: str, data: str, out: str, layout: str, lora: bool) -> Any:
    from shardwise.recipes.finetune import coerce_config

    devices, per_device, extra = {
        "1 process": (1, 2, {}),
        "FSDP x 2": (2, 1, {"strategy": "fsdp"}),
        "tp 2": (2, 2, {"strategy": "fsdp", "tp_size": 2}),
        "sp 2": (2, 2, {"strategy": "fsdp", "sp_size": 2}),
    }[layout]
    if family in EAGER:
        extra = {**extra, "attn_implementation": "eager"}
    if family in MOE and not lora and devices == 1:
        extra = {**extra, "save_steps": STEPS}  # a recipe checkpoint for `shardwise convert`
    adapter = dict(lora_r=4, lora_alpha=8, lora_target_modules=FAMILIES[family][2], merge=True) if lora else {}
    return coerce_config(
        dict(
            model_path=model_dir,
            dataset=data,
            max_seq_len=32,
            per_device_train_batch_size=per_device,
            devices=devices,
            precision="32-true",
            max_steps=STEPS,
            learning_rate=1e-2 if lora else 1e-3,
            lr_scheduler_type="constant",
            max_grad_norm=None,
            eval_split_ratio=0.0,
            logging_steps=1,
            seed=5,
            output_dir=out,
            cache_dir=os.path.join(os.path.dirname(out), "cache"),
            **adapter,
            **extra,
        )
    )


def _probe(module: Any) -> Dict[str, Any]:
    """after_fit (every rank): the trained model's logits on PROBE (None where the layout's forward needs
    its own inputs, e.g. sp's sequence slices), and the batches a recording module kept."""
    from torch.distributed.fsdp import FSDPModule

    logits = None
    try:
        if isinstance(module, FSDPModule):  # the root's weights (embeddings, norm, head) are its own
            module.unshard()
        with torch.no_grad():
            logits = module.model(input_ids=torch.tensor(PROBE)).logits.detach().clone()
        if hasattr(logits, "full_tensor"):
            logits = logits.full_tensor()
    except Exception:  # noqa: BLE001 - the export is then checked against the one-process run's logits
        logits = None
    finally:
        if isinstance(module, FSDPModule):
            module.reshard()
    return {"logits": logits, "batches": getattr(module, "batches", None)}


def _recording_module(cfg: Any, folder: Any, total_steps: Any) -> Any:
    """The recipe's module, also keeping every micro-batch it trains on (for the plain transformers loop)."""
    from shardwise.recipes.causal_lm import CausalLMModule

    class Recording(CausalLMModule):
        def on_train_batch_start(self, batch: Dict[str, torch.Tensor], batch_idx: int) -> None:
            super().on_train_batch_start(batch, batch_idx)
            self.batches.append({k: v.detach().clone().cpu() for k, v in batch.items()})

    module = Recording(cfg, folder, total_steps)
    module.batches = []
    return module


def run(cfg: Any, record: bool = False) -> Dict[str, Any]:
    """One run in this process (one rank of it under a launch): losses, probe logits, or the refusal."""
    from shardwise.recipes import finetune as recipe

    original = recipe.build_module
    if record:
        recipe.build_module = _recording_module
    try:
        result = recipe.finetune(cfg, after_fit=_probe)
    except (ValueError, NotImplementedError, RuntimeError) as exc:
        return {"refused": _first_sentence(f"{type(exc).__name__}: {exc}")}
    finally:
        recipe.build_module = original
    return {"losses": [s["loss"] for s in result.losses], "out": result.output_dir, **result.extra}


def _first_sentence(text: str) -> str:
    text = " ".join(text.split()).replace("|", "/")
    end = text.find(". ", 0, 300)
    return text[: end + 1] if end > 0 else text[:300] + ("..." if len(text) > 300 else "")


def run_two_rank(configs: List[Any]) -> List[Dict[str, Any]]:
    """Worker of shardwise.launch: every family's 2-rank runs, one after another in one process group."""
    import torch.distributed as dist

    dist.init_process_group("gloo")
    return [run(cfg) for cfg in configs]


@pytest.fixture(scope="module")
def matrix(tmp_path_factory):
    import shardwise

    root = str(tmp_path_factory.mktemp("model-matrix"))
    records = chat_records(24)
    data = write_jsonl(os.path.join(root, "chat.jsonl"), records)
    results: Dict[Tuple[str, str, bool], Dict[str, Any]] = {}
    two_rank: List[Tuple[Tuple[str, str, bool], Any]] = []
    folders = {}
    for family in FAMILIES:
        folders[family] = model_dir = build_family(root, family, records)
        layouts = ["1 process", "FSDP x 2"] + (["tp 2", "sp 2"] if family in PARALLEL else [])
        plans = [(layout, layout != "tp 2") for layout in layouts]
        if family in MOE or family in PARALLEL:
            plans.append(("1 process", False))
        if family in MOE:
            plans.append(("FSDP x 2", False))
        for layout, lora in plans:
            out = os.path.join(root, "runs", _slug(family), f"{_slug(layout)}-{'lora' if lora else 'full'}")
            cfg = run_config(family, model_dir, data, out, layout, lora)
            if layout == "1 process":
                results[(family, layout, lora)] = run(cfg, record=not lora)
            else:
                two_rank.append(((family, layout, lora), cfg))
    ranks = shardwise.launch(run_two_rank, [cfg for _, cfg in two_rank], devices=2)
    for i, (key, _) in enumerate(two_rank):
        results[key] = ranks[0][i]
    return folders, results


def _export_logits(folder: str) -> torch.Tensor:
    model = transformers.AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32)
    with torch.no_grad():
        return model(input_ids=torch.tensor(PROBE)).logits


def check_run(res: Dict[str, Any], reference: Dict[str, Any], lora: bool) -> str:
    """'works', or what failed: losses against the one-process run's, the export against the trained logits."""
    if "refused" in res:
        return f"refused: {res['refused']}"
    gap = max(abs(a - b) for a, b in zip(res["losses"], reference["losses"]))
    if len(res["losses"]) != STEPS or gap > 1e-5:
        return f"FAILS: losses {res['losses']} vs one process {reference['losses']}"
    trained = res["logits"] if res["logits"] is not None else reference["logits"]
    exported = _export_logits(os.path.join(res["out"], "merged") if lora else res["out"])
    diff = float((exported - trained).abs().max())
    return "works" if diff <= 1e-4 else f"FAILS: export logits differ by {diff:.2e}"


def table(folders: Dict[str, str], results: Dict[Tuple[str, str, bool], Dict[str, Any]]) -> str:
    lines = [
        "| family | architecture | attention | tp_plan | " + " | ".join(LAYOUTS) + " |",
        "|---|---|---|---|" + "---|" * len(LAYOUTS),
    ]
    for family, folder in folders.items():
        arch = transformers.AutoConfig.from_pretrained(folder).architectures[0]
        cells = []
        for layout in LAYOUTS:
            lora = layout != "tp 2"
            res, ref = results.get((family, layout, lora)), results.get((family, "1 process", lora))
            if res is None:
                cells.append("not run here")
            elif "refused" in ref and res is not ref:
                cells.append("not compared (one process refused)")
            else:
                cells.append(check_run(res, ref, lora))
        tp = "yes" if has_tp_plan(folder) else "no"
        attn = "eager" if family in EAGER else "sdpa"
        lines.append(f"| {family} | `{arch}` | {attn} | {tp} | " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


def _docs_section(text: str) -> str:
    if BEGIN not in text or END not in text:
        return ""
    return text.split(BEGIN, 1)[1].split(END, 1)[0].strip("\n") + "\n"


def pinned_transformers() -> str:
    """The transformers version constraints.txt pins: the docs table is the one measured with it."""
    with open(CONSTRAINTS) as fh:
        return next(line.split("==")[1].strip() for line in fh if line.lower().startswith("transformers=="))


def test_families_fine_tune_with_lora_and_export_and_the_docs_table_is_current(matrix):
    folders, results = matrix
    rows = table(folders, results)
    cells = {line.split(" | ")[0].lstrip("| "): line for line in rows.splitlines()[2:]}
    working = [f for f, line in cells.items() if line.split(" | ")[4:6] == ["works", "works"]]
    assert len(working) >= 8, rows
    for family in (*MOE, "Llama 3.x", "Qwen2.5", "Qwen3 dense", "Mistral", "Phi-3 / Phi-4"):
        assert "FAILS" not in cells[family], rows
    if transformers.__version__ != pinned_transformers():
        return  # another release (tools/newest_releases.sh): the families must work, the docs say the pinned one
    written = f"With transformers {transformers.__version__}:\n\n{rows}"
    with open(DOCS) as fh:
        text = fh.read()
    if _docs_section(text) != written:
        if BEGIN in text:
            head, rest = text.split(BEGIN, 1)
            text = head + BEGIN + "\n" + written + END + rest.split(END, 1)[1]
        else:
            text = text.rstrip("\n") + "\n\n" + BEGIN + "\n" + written + END + "\n"
        with open(DOCS, "w") as fh:
            fh.write(text)
        pytest.fail(f"docs/finetuning.md's model matrix was out of date; rewritten, commit it:\n{written}")


def _plain_transformers_losses(model_dir: str, batches: List[Dict[str, torch.Tensor]]) -> List[float]:
    """A plain transformers loop on the batches the recipe trained on: AdamW as the recipe builds it."""
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    model.train()
    decay = [p for p in model.parameters() if p.dim() >= 2]
    no_decay = [p for p in model.parameters() if p.dim() < 2]
    groups = [{"params": decay, "weight_decay": 0.0}, {"params": no_decay, "weight_decay": 0.0}]
    optimizer = torch.optim.AdamW(groups, lr=1e-3, betas=(0.9, 0.999), eps=1e-8)
    losses = []
    for batch in batches:
        # position_ids: packed rows restart them per document, which keeps the documents apart.
        inputs = {k: batch[k] for k in ("input_ids", "attention_mask", "position_ids", "labels") if k in batch}
        loss = model(**inputs, use_cache=False).loss
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        losses.append(float(loss))
    return losses


@pytest.mark.parametrize("family", MOE)
def test_hub_layout_moe_fine_tunes_the_same_on_one_process_fsdp_and_plain_transformers(matrix, family):
    folders, results = matrix
    from safetensors import safe_open

    with safe_open(os.path.join(folders[family], "model.safetensors"), "pt") as fh:
        assert any(".experts.0." in k for k in fh.keys())  # the hub layout: one tensor per expert
    one, fsdp = results[(family, "1 process", False)], results[(family, "FSDP x 2", False)]
    assert "refused" not in one and "refused" not in fsdp, (one, fsdp)
    plain = _plain_transformers_losses(folders[family], one["batches"])
    assert len(one["losses"]) == len(fsdp["losses"]) == len(plain) == STEPS
    for a, b, c in zip(one["losses"], fsdp["losses"], plain):
        assert abs(a - b) <= 1e-5 and abs(a - c) <= 1e-5, (one["losses"], fsdp["losses"], plain)
    for res in (one, fsdp):
        exported = _export_logits(res["out"])
        assert float((exported - res["logits"]).abs().max()) <= 1e-4
        with safe_open(os.path.join(res["out"], "model.safetensors"), "pt") as fh:
            with safe_open(os.path.join(folders[family], "model.safetensors"), "pt") as src:
                assert sorted(fh.keys()) == sorted(src.keys())  # written in the hub layout it was read in
    # `shardwise convert` of the recipe's checkpoint writes the hub layout too, with the trained weights.
    from shardwise.recipes.convert import convert

    ckpts = os.path.join(one["out"], "checkpoints")
    ckpt = os.path.join(ckpts, next(f for f in sorted(os.listdir(ckpts)) if f"step={STEPS}" in f))
    converted = os.path.join(os.path.dirname(one["out"]), "converted")
    convert(ckpt, converted, quiet=True, base_model=folders[family])
    with safe_open(os.path.join(converted, "model.safetensors"), "pt") as fh:
        with safe_open(os.path.join(folders[family], "model.safetensors"), "pt") as src:
            assert sorted(fh.keys()) == sorted(src.keys())
    assert float((_export_logits(converted) - one["logits"]).abs().max()) <= 1e-4

"""The fine-tuning recipe on one global batch split four ways (issue 20): the runs, the batches they saw.

One global batch of 4 sequences per optimizer step, as one process x batch 4, one process x batch 1 x
accumulation 4, and 2 ranks x batch 1 x accumulation 2 under DDP, FSDP and DeepSpeed ZeRO-2 (CPU). The chat data has
conversations of 1 to 6 turns, so sequences carry very different numbers of target tokens: a loss
averaged per micro-batch weighs a 10-token answer as much as a 70-token one, a loss normalised over
the step's target tokens does not. Each run records, per optimizer step, which sequences it trained
on (a recording subclass of the recipe's module), so a comparison can check that every layout saw
the same global batch. Used by tests/recipes/test_global_batch_loss.py and
benchmarks/global_batch_loss.py; module-level so spawned workers import it.
"""

from __future__ import annotations

import dataclasses
import os
import random
from typing import Any, Dict, List, Tuple

import torch

from helpers.hf import COLOURS, THINGS, build_model_folder, write_jsonl

STEPS = 6
# name -> (processes, strategy, per-device batch, accumulation): 4 sequences per optimizer step in each.
LAYOUTS = {
    "1 process x batch 4": (1, "single", 4, 1),
    "1 process x batch 1 x accumulation 4": (1, "single", 1, 4),
    "DDP 2 ranks x batch 1 x accumulation 2": (2, "ddp", 1, 2),
    "FSDP 2 ranks x batch 1 x accumulation 2": (2, "fsdp", 1, 2),
    "ZeRO-2 2 ranks x batch 1 x accumulation 2": (2, "deepspeed_stage_2", 1, 2),
}
REFERENCE = "1 process x batch 4"


def varied_chat_records(n: int = 96, seed: int = 0) -> List[Dict[str, Any]]:
    """Chat records of 1 to 6 turns, half without a system prompt: from ~10 to ~90 tokens each."""
    rng = random.Random(seed)
    answer = {t: COLOURS[i % len(COLOURS)] for i, t in enumerate(THINGS)}
    records = []
    for i in range(n):
        thing = rng.choice(THINGS)
        messages = [{"role": "system", "content": "you are a helpful assistant"}] if rng.random() < 0.5 else []
        messages += [
            {"role": "user", "content": f"what colour is the {thing} ?"},
            {"role": "assistant", "content": f"the {thing} is {answer[thing]} ."},
        ]
        for _ in range(rng.choice([0, 0, 1, 3, 5]) if i % 3 else 0):
            messages += [
                {"role": "user", "content": "are you sure ?"},
                {"role": "assistant", "content": f"yes , the {thing} is {answer[thing]} ."},
            ]
        records.append({"messages": messages, "id": i})
    return records


def build_assets(root: str) -> Tuple[str, str]:
    """(model folder, data file) under `root`: a tiny random Llama and the varied chat data."""
    records = varied_chat_records()
    return build_model_folder(os.path.join(root, "model"), records), write_jsonl(
        os.path.join(root, "chat.jsonl"), records
    )


def config(model_dir: str, data: str, out: str, layout: str, packing: bool, **changes: Any) -> Any:
    from shardwise.recipes.finetune import coerce_config

    devices, strategy, batch, accumulate = LAYOUTS[layout]
    return coerce_config(
        dict(
            model_path=model_dir,
            dataset=data,
            max_seq_len=64 if packing else 96,
            packing=packing,
            per_device_train_batch_size=batch,
            gradient_accumulation_steps=accumulate,
            devices=devices,
            strategy=strategy,
            precision="32-true",
            max_steps=STEPS,
            learning_rate=1e-3,
            lr_scheduler_type="constant",
            max_grad_norm=1.0,
            eval_split_ratio=0.0,
            logging_steps=1,
            seed=11,
            output_dir=out,
            cache_dir=os.path.join(os.path.dirname(out), f"cache-{packing}"),
            **changes,
        )
    )


def _recording_module(cfg: Any, folder: Any, total_steps: Any) -> Any:
    """The recipe's module, also recording the sequences of every micro-batch by optimizer step."""
    from shardwise.recipes.causal_lm import CausalLMModule

    class Recording(CausalLMModule):
        def on_train_batch_start(self, batch: Dict[str, torch.Tensor], batch_idx: int) -> None:
            super().on_train_batch_start(batch, batch_idx)
            mask = batch.get("attention_mask", torch.ones_like(batch["input_ids"]))
            rows = [tuple(ids[m.bool()].tolist()) for ids, m in zip(batch["input_ids"].cpu(), mask.cpu())]
            self.seen.setdefault(self.trainer.global_step + 1, []).extend(rows)

        def on_train_batch_end(self, outputs: Any, batch: Any, batch_idx: int) -> None:
            super().on_train_batch_end(outputs, batch, batch_idx)
            if self.trainer.is_last_microbatch:  # what the Trainer logged for the step
                self.logged.append(self.trainer.callback_metrics["train_loss"])

    module = Recording(cfg, folder, total_steps)
    module.seen, module.logged = {}, []
    return module


def _keep(module: Any) -> Dict[str, Any]:
    return {"seen": module.seen, "logged": module.logged}


def run(cfg: Any) -> Dict[str, Any]:
    """One run of `cfg` in this process (one rank of it, under a launcher): losses, sequences seen."""
    from shardwise.recipes import finetune as recipe

    original, recipe.build_module = recipe.build_module, _recording_module
    try:
        result = recipe.finetune(cfg, after_fit=_keep)
    finally:
        recipe.build_module = original
    return {
        "losses": [s["loss"] for s in result.losses],
        "logged": result.extra["logged"],
        "seen": result.extra["seen"],
        "out": result.output_dir,
    }


def run_two_rank_layouts(configs: List[Any]) -> List[Dict[str, Any]]:
    """Worker of shardwise.launch: the 2-rank runs one after another in one process group."""
    import torch.distributed as dist

    dist.init_process_group("gloo")  # kept for every run here: the strategies join it instead of owning one
    return [run(cfg) for cfg in configs]


def run_layouts(model_dir: str, data: str, root: str, packing: bool, **changes: Any) -> Dict[str, Dict[str, Any]]:
    """Every layout of LAYOUTS on the same data: name -> losses, sequences seen per step (all ranks), export."""
    return run_layouts_packed_and_not(model_dir, data, root, [packing], **changes)[packing]


def run_layouts_packed_and_not(
    model_dir: str, data: str, root: str, packings: List[bool], **changes: Any
) -> Dict[bool, Dict[str, Dict[str, Any]]]:
    """run_layouts for each packing setting, the 2-rank layouts of all of them in one launch (start-up costs
    more than these runs): packing -> layout name -> results."""
    import shardwise

    out: Dict[bool, Dict[str, Dict[str, Any]]] = {packing: {} for packing in packings}
    two_rank = []
    for packing in packings:
        runs = os.path.join(root, f"packing-{packing}")
        for name, (devices, *_rest) in LAYOUTS.items():
            cfg = config(model_dir, data, os.path.join(runs, name.replace(" ", "_")), name, packing, **changes)
            if devices == 1:
                out[packing][name] = run(cfg)
            else:
                two_rank.append((packing, name, cfg))
    ranks = shardwise.launch(run_two_rank_layouts, [c for *_, c in two_rank], devices=2)
    for i, (packing, name, _) in enumerate(two_rank):
        merged: Dict[int, List[Any]] = {}
        for rank_results in ranks:
            for step, rows in rank_results[i]["seen"].items():
                merged.setdefault(step, []).extend(rows)
        out[packing][name] = {**ranks[0][i], "seen": merged}
    return out


def exported_weights(folder: str) -> Dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    return load_file(os.path.join(folder, "model.safetensors"))


def compare(results: Dict[str, Dict[str, Any]]) -> Dict[str, Dict[str, Any]]:
    """Per layout against REFERENCE: largest relative loss difference per step, largest weight difference,
    and whether each step's sequences (as a multiset) are the reference's."""
    ref = results[REFERENCE]
    ref_weights = exported_weights(ref["out"])
    report = {}
    for name, res in results.items():
        weights = exported_weights(res["out"])
        report[name] = dataclasses.asdict(
            Gap(
                losses=res["losses"],
                max_rel_loss=max(abs(a - b) / abs(b) for a, b in zip(res["losses"], ref["losses"])),
                max_weight=max(float((weights[k] - v).abs().max()) for k, v in ref_weights.items()),
                same_batches=all(sorted(res["seen"][s]) == sorted(ref["seen"][s]) for s in ref["seen"])
                and sorted(res["seen"]) == sorted(ref["seen"]),
            )
        )
    return report


@dataclasses.dataclass
class Gap:
    losses: List[float]
    max_rel_loss: float
    max_weight: float
    same_batches: bool

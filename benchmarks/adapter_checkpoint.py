"""Adapter checkpoints against full ones: the bytes a LoRA / QLoRA run's resumable checkpoint holds beside a
full fine-tuning checkpoint of the same model, and the exported folders (issue 21).

The same tiny local Llama (tests/helpers/hf.py, built here, nothing downloaded) is fine-tuned for 2 steps
on one process with `save_steps=2`, once in full, once with LoRA and once with QLoRA; the script prints each
checkpoint's size on disk, its ratio to the full one, and the trainable share.

    python benchmarks/adapter_checkpoint.py [--hidden 512 --layers 4]
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "tests"))

from shardwise.recipes.finetune import finetune  # noqa: E402

from helpers.hf import build_model_folder, chat_records, write_jsonl  # noqa: E402


def _size(path: str) -> int:
    return sum(os.path.getsize(os.path.join(d, f)) for d, _, files in os.walk(path) for f in files)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--hidden", type=int, default=512)
    parser.add_argument("--layers", type=int, default=4)
    args = parser.parse_args()
    root = tempfile.mkdtemp(prefix="adapter_ckpt_")
    records = chat_records(64)
    model_dir = build_model_folder(
        os.path.join(root, "base"), records, hidden=args.hidden, intermediate=2 * args.hidden, layers=args.layers
    )
    data = write_jsonl(os.path.join(root, "chat.jsonl"), records)
    runs = {
        "full": dict(),
        "LoRA r=16 (q_proj, v_proj)": dict(lora_r=16, lora_alpha=32, lora_target_modules=["q_proj", "v_proj"]),
        "QLoRA r=16 (all-linear)": dict(
            lora_r=16, lora_alpha=32, lora_target_modules=["all-linear"], load_in_4bit=True, precision="bf16-mixed"
        ),
    }
    rows = []
    for name, extra in runs.items():
        out = os.path.join(root, name.split()[0])
        cfg = dict(
            model_path=model_dir,
            dataset=data,
            max_seq_len=64,
            max_steps=2,
            save_steps=2,
            precision="32-true",
            devices=1,
            strategy="fsdp",
            eval_split_ratio=0.0,
            logging_steps=100,
            output_dir=out,
            cache_dir=os.path.join(root, "cache"),
        )
        cfg.update(extra)
        result = finetune(cfg)
        trainable, total = result.parameters["trainable"], result.parameters["total"]
        rows.append((name, _size(os.path.join(out, "checkpoints")), trainable, total))
    full = rows[0][1]
    print(f"tiny Llama: hidden {args.hidden}, {args.layers} layers; checkpoint of step 2 (model + optimizer + states)")
    print(f"{'run':<30} {'checkpoint':>12} {'vs full':>8} {'trainable':>22}")
    for name, size, trainable, total in rows:
        print(f"{name:<30} {size / 2**20:>9.2f} MiB {size / full:>7.1%} {trainable:>10,} of {total:>10,}")


if __name__ == "__main__":
    main()

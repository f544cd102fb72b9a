"""A fine-tuning run under FSDP x sp 2 that test_parallel_resume.py starts as a subprocess and SIGKILLs.

`python parallel_resume_script.py ROOT MODEL DATA KILL_AT` runs the recipe of
`shardwise finetune` on 4 processes as dp2 x sp2 (a checkpoint every 3
steps) and, right after optimizer step KILL_AT, kills the whole job with
SIGKILL: the launcher first, its workers die with it (checkpoint_kill_script's
kill_job). `recipe_config` is the one configuration the test and this script
share; only the layout, the output folder and the resume point change.
"""

from __future__ import annotations

import os
import sys

from shardwise.recipes.finetune import FinetuneConfig, coerce_config

SAVE_EVERY = 3
STEPS = 6
GLOBAL_BATCH = 4  # packed 32-token blocks per optimizer step, at every layout


def recipe_config(root: str, model: str, data: str, name: str, **changes) -> FinetuneConfig:
    """fp32, constant LR, the default clipping; dp2 x sp2 on 4 processes unless `changes` say otherwise."""
    base = dict(
        model_path=model,
        dataset=data,
        max_seq_len=32,
        max_steps=STEPS,
        precision="32-true",
        accelerator="cpu",
        learning_rate=3e-3,
        lr_scheduler_type="constant",
        eval_split_ratio=0.0,
        logging_steps=1,
        seed=3,
        save_steps=SAVE_EVERY,
        save_total_limit=3,
        cache_dir=os.path.join(root, "tokenized"),
        output_dir=os.path.join(root, name),
        devices=4,
        sp_size=2,
        per_device_train_batch_size=GLOBAL_BATCH // 2,
    )
    base.update(changes)
    return coerce_config(base)


def killed_worker(cfg: FinetuneConfig, kill_at: int) -> None:
    """One rank: the recipe with checkpoint_kill_script's Killer beside its checkpoint callback (the recipe takes
    no callbacks)."""
    from checkpoint_kill_script import Killer

    from shardwise.recipes import finetune as recipe

    own = recipe._callbacks
    recipe._callbacks = lambda c: [Killer(kill_at), *own(c)]
    recipe.finetune(cfg)


def main() -> None:
    import shardwise

    root, model, data, kill_at = sys.argv[1], sys.argv[2], sys.argv[3], int(sys.argv[4])
    cfg = recipe_config(root, model, data, "run")
    shardwise.launch(killed_worker, cfg, kill_at, devices=cfg.devices)


if __name__ == "__main__":
    main()

"""After `resume_from_checkpoint`, `finetune_history.json` holds every step of the run once (issue 26).

It used to hold only the steps after the resume: the history lived in the module alone. It now travels
in every checkpoint, and a step's loss is recorded before the checkpoint callback saves at that step
(the module's own on_train_batch_end runs after the callbacks'). One process, a tiny Llama: a run saved
at step 2 and stopped at step 3, resumed from its step-2 checkpoint to step 5.
"""

from __future__ import annotations

import json
import os

import pytest

from shardwise.recipes.finetune import finetune

from helpers.hf import build_model_folder, chat_records, write_jsonl


def test_resumed_history_has_every_step_once(tmp_path):
    records = chat_records(60)
    common = dict(
        model_path=build_model_folder(str(tmp_path / "m"), records),
        dataset=write_jsonl(str(tmp_path / "chat.jsonl"), records),
        output_dir=str(tmp_path / "out"),
        max_seq_len=32,
        learning_rate=3e-3,
        lr_scheduler_type="constant",
        precision="32-true",
        eval_split_ratio=0.0,
        devices=1,
        save_steps=2,
        save_total_limit=3,
        logging_steps=100,  # no log line syncs the history before the save: the save must
        cache_dir=str(tmp_path / "cache"),
    )
    first = finetune(dict(max_steps=3, **common))
    assert [s["step"] for s in first.losses] == [1, 2, 3]
    checkpoints = tmp_path / "out" / "checkpoints"
    step2 = [name for name in os.listdir(checkpoints) if "step=2" in name]
    assert len(step2) == 1, os.listdir(checkpoints)
    resumed = finetune(dict(max_steps=5, resume_from_checkpoint=str(checkpoints / step2[0]), **common))
    with open(tmp_path / "out" / "finetune_history.json") as fh:
        written = json.load(fh)["losses"]
    for history in (resumed.losses, written):
        assert [s["step"] for s in history] == [1, 2, 3, 4, 5], history
    # Steps 1-2 come from the checkpoint as they were; step 3 ran again from it, the same step.
    assert resumed.losses[:2] == first.losses[:2]
    assert resumed.losses[2]["loss"] == pytest.approx(first.losses[2]["loss"], rel=1e-5)

"""`shardwise pretrain` end to end: a tiny Llama from scratch on two prepared corpora (0.7 / 0.3), FSDP on 2 processes.

Two launches serve every check. The first (`pretrain(devices=2)` from this process) trains with a checkpoint every
5 steps, and its rank 0 is killed with SIGKILL right after step 12 (the launcher then stops rank 1 and fails). The
second (one launch of 2 workers) resumes that run from `last` to step 20, then trains the uninterrupted reference
in the same processes;
the reference is also the export check. The loss falls; the killed run's steps 1-12 and the resumed run's steps
11-20 (losses, evaluation losses, batch fingerprints) equal the reference's bitwise; the exported folder loads with
AutoModelForCausalLM and gives the trained (sharded) model's logits. Bad input is refused before any launch.
"""

from __future__ import annotations

import dataclasses
import json
import os
import random
import re
import signal

import pytest
import torch

from shardwise.callbacks.fingerprint import read_fingerprints
from shardwise.cli import main as cli
from shardwise.distributed.launch import WorkerFailedError
from shardwise.recipes.pretrain import PretrainConfig, pretrain, validate_config
from shardwise.recipes.pretrain_data import parse_data

KILL_AT, SAVE_EVERY, STEPS = 12, 5, 20
NUMBERS = "zero one two three four five six seven eight nine ten eleven twelve".split()
PROBE = [[5, 9, 14, 3, 22, 7, 11, 30, 2, 17, 8, 4]]  # token ids whose logits the export must reproduce


class KillAfter:
    """At the start of the step after `step`: global rank 0 writes the losses so far, then SIGKILLs itself (the
    launcher sees it die and stops the other rank, as it would after a crash of the machine's rank 0)."""

    def __init__(self, step: int, path: str) -> None:
        self.step, self.path = step, path

    def on_train_batch_start(self, trainer, module, batch, batch_idx) -> None:
        if trainer.global_step == self.step and trainer.is_global_zero:
            with open(self.path, "w") as fh:
                json.dump(module.history, fh)
                fh.flush()
                os.fsync(fh.fileno())
            os.kill(os.getpid(), signal.SIGKILL)


def probe_logits(module):
    """after_fit (every rank): the trained, sharded model's logits on PROBE (a collective forward)."""
    from torch.distributed.fsdp import FSDPModule

    # The FSDP root is the TrainModule: its own parameters (the embeddings) are gathered by hand, the decoder
    # layers' by their units' hooks, as in training.
    root = next(m for m in (module, module.model) if isinstance(m, FSDPModule))
    root.unshard()
    with torch.no_grad():
        logits = module.model(input_ids=torch.tensor(PROBE)).logits.float().cpu()
    root.reshard()
    return logits


def resume_then_reference(resumed: PretrainConfig, reference: PretrainConfig):
    """One launch, two runs: the killed run resumed from `last`, then the uninterrupted run."""
    return pretrain(resumed), pretrain(reference, after_fit=probe_logits)


def _corpora(root: str):
    from transformers import LlamaConfig

    from shardwise.corpus import prepare

    from helpers.hf import COLOURS, THINGS, build_tokenizer

    rng = random.Random(0)
    facts = [f"the {thing} is {COLOURS[i % len(COLOURS)]} ." for i, thing in enumerate(THINGS)]
    docs = {
        "facts": [" ".join(rng.choice(facts) for _ in range(rng.randint(1, 4))) for _ in range(150)],
        "counting": [" ".join(NUMBERS[s : s + rng.randint(3, 8)]) for s in (rng.randint(0, 5) for _ in range(150))],
    }
    tokenizer = build_tokenizer(docs["facts"] + docs["counting"])
    tokenizer.save_pretrained(os.path.join(root, "tok"))
    for name, texts in docs.items():
        with open(os.path.join(root, f"{name}.jsonl"), "w") as fh:
            fh.writelines(json.dumps({"text": t}) + "\n" for t in texts)
        prepare([os.path.join(root, f"{name}.jsonl")], os.path.join(root, name), os.path.join(root, "tok"), num_proc=1)
    LlamaConfig(
        vocab_size=len(tokenizer),
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=64,
    ).save_pretrained(os.path.join(root, "model"))
    return PretrainConfig(
        model=os.path.join(root, "model"),
        data=f"{os.path.join(root, 'facts')}:0.7,{os.path.join(root, 'counting')}:0.3",
        seq_length=32,
        global_batch_size=4,
        micro_batch_size=2,
        max_steps=STEPS,
        eval_every=10,
        eval_samples=8,
        logging_steps=1,
        learning_rate=1e-2,
        warmup_steps=2,
        accelerator="cpu",
        devices=2,
        strategy="fsdp",
        seed=3,
    )


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    from shardwise.distributed.launch import launch

    root = str(tmp_path_factory.mktemp("pretrain"))
    base = _corpora(root)
    killed = dataclasses.replace(base, output_dir=os.path.join(root, "run"), save_steps=SAVE_EVERY)
    history = os.path.join(root, "killed_history.json")
    # Started from this process (no interpreter of its own to start): the SIGKILL takes rank 0 only, the launcher
    # stops rank 1 and reports the signal (SystemExit with the signal's status).
    with pytest.raises((SystemExit, WorkerFailedError)):
        pretrain(killed, callbacks=[KillAfter(KILL_AT, history)])
    assert os.path.exists(history)
    resumed = dataclasses.replace(killed, resume_from_checkpoint="last")
    reference = dataclasses.replace(base, output_dir=os.path.join(root, "reference"))
    (resumed_result, reference_result), other = launch(resume_then_reference, resumed, reference, devices=2)
    with open(history) as fh:
        killed_losses = json.load(fh)
    return {
        "killed": killed_losses,
        "resumed": resumed_result,
        "reference": reference_result,
        "logits": [reference_result.extra, other[1].extra],
    }


def test_loss_falls_and_tokens_are_counted(runs):
    losses = [s["loss"] for s in runs["reference"].losses]
    assert [s["step"] for s in runs["reference"].losses] == list(range(1, STEPS + 1))
    assert sum(losses[-3:]) / 3 < 0.7 * sum(losses[:3]) / 3, losses
    evals = runs["reference"].eval_losses
    assert [e["step"] for e in evals] == [10, 20] and evals[1]["eval_loss"] < evals[0]["eval_loss"]
    assert runs["reference"].tokens_per_step == 4 * 32 and runs["reference"].tokens_per_s > 0


def test_killed_and_resumed_run_equals_the_uninterrupted_one_bitwise(runs):
    reference = {s["step"]: s["loss"] for s in runs["reference"].losses}
    killed = {s["step"]: s["loss"] for s in runs["killed"]}
    assert sorted(killed) == list(range(1, KILL_AT + 1))
    assert all(killed[s] == reference[s] for s in killed), (killed, reference)
    # Resumed from step 10 (the last checkpoint before the kill): steps 11-20 retrained, 1-10 from the checkpoint.
    resumed = {s["step"]: s["loss"] for s in runs["resumed"].losses}
    assert resumed == reference
    # The evaluation after the resume (step 20) too. (Step 10's ran after that step's checkpoint was written, so the
    # checkpoint does not hold it.)
    assert (
        runs["resumed"].eval_losses[-1] == runs["reference"].eval_losses[-1]
        and runs["resumed"].eval_losses[-1]["step"] == 20
    )
    assert runs["resumed"].tokens_per_s > 0
    fingerprints = read_fingerprints(runs["resumed"].output_dir)
    assert sorted(fingerprints) == list(range(1, STEPS + 1))
    assert fingerprints == read_fingerprints(runs["reference"].output_dir)


def test_exported_folder_loads_with_the_trained_logits(runs):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    sharded, other_rank = runs["logits"]
    assert torch.equal(sharded, other_rank)
    exported = AutoModelForCausalLM.from_pretrained(runs["reference"].output_dir)
    with torch.no_grad():
        logits = exported(input_ids=torch.tensor(PROBE)).logits.float()
    torch.testing.assert_close(logits, sharded, rtol=1e-5, atol=1e-5)
    assert len(AutoTokenizer.from_pretrained(runs["reference"].output_dir)) == exported.config.vocab_size


def test_bad_input_is_refused_before_launch(tmp_path, capsys):
    from shardwise.corpus import prepare

    from helpers.hf import build_tokenizer

    tok = build_tokenizer(["alpha beta gamma delta"] * 4)
    tok.save_pretrained(str(tmp_path / "tok"))
    (tmp_path / "c.txt").write_text("alpha beta gamma delta\n" * 40)
    prepare([str(tmp_path / "c.txt")], str(tmp_path / "c"), str(tmp_path / "tok"), num_proc=1)
    (tmp_path / "half").mkdir()
    (tmp_path / "half" / "plan.json").write_text("{}")
    from transformers import LlamaConfig

    LlamaConfig(vocab_size=len(tok), hidden_size=16, intermediate_size=32, num_hidden_layers=1, num_attention_heads=2,
                max_position_embeddings=16).save_pretrained(str(tmp_path / "m"))  # fmt: skip
    ok = PretrainConfig(model=str(tmp_path / "m"), data=str(tmp_path / "c"), seq_length=8, accelerator="cpu", devices=1)
    validate_config(ok)
    cases = [
        (dict(data=str(tmp_path / "nowhere")), FileNotFoundError, "not a prepared corpus.*shardwise prepare"),
        (dict(data=str(tmp_path / "half")), FileNotFoundError, "did not finish"),
        (dict(data=f"{tmp_path / 'c'}:0"), ValueError, "weight 0.0; weights must be positive"),
        (dict(seq_length=32), ValueError, "exceeds the model's maximum of 16 positions.*max_position_embeddings"),
        (dict(config_overrides={"vocab_size": 4}), ValueError, f"has {len(tok)} tokens but .*vocab_size: {len(tok)}"),
        (dict(model="llama-2-7b"), ValueError, "planner's own .* presets"),
        (dict(global_batch_size=3, micro_batch_size=2), ValueError, "not a multiple of micro_batch_size"),
        # --ep_size: MoE configs only; named by where the config came from (not the output folder's config.json)
        (
            dict(ep_size=2),
            ValueError,
            rf"ep_size=2: LlamaConfig \({re.escape(str(tmp_path / 'm' / 'config.json'))}\) has no",
        ),
    ]
    for change, error, match in cases:
        with pytest.raises(error, match=match):
            validate_config(dataclasses.replace(ok, **change))
    # --data's spellings: a flag, a YAML list of strings or mappings, a mapping; a path without a weight weighs 1.
    want = [("c", 0.7), ("d", 0.3)]
    assert parse_data("c:0.7,d:0.3") == parse_data(["c:0.7", {"path": "d", "weight": 0.3}]) == want
    assert parse_data({"c": 0.7, "d": 0.3}) == want and parse_data("c") == [("c", 1.0)]
    with pytest.raises(ValueError, match="named twice"):
        parse_data("c:1,c:2")
    # The command line says the same in one line, exit status 2, before any worker starts.
    assert cli(["pretrain", "--model", str(tmp_path / "m"), "--data", f"{tmp_path / 'c'}:-1"]) == 2
    assert "weights must be positive" in capsys.readouterr().err

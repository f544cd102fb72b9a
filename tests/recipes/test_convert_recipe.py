# `shardwise convert` of a full fine-tuning recipe checkpoint gives a Hugging Face folder that
# from_pretrained loads (the recipe module's `model.` prefix removed, the tied lm_head left out, config,
# generation config and tokenizer files from the base folder the checkpoint records, or --base_model) and
# that computes exactly the logits of the recipe's own export of the same step. With the base folder moved,
# nothing is written and the error names the recorded folder and --base_model, which then converts; a base
# folder of another architecture is refused by name and shape; a file OUT gets every tensor under its
# Hugging Face name; and a plain module that happens to hold its network as `self.model` converts as before,
# prefix kept (the recipe is recognised by what its module stores in the checkpoint, not by names).
from __future__ import annotations

import os
import shutil

import pytest
import torch
from safetensors import safe_open

from shardwise.cli import main
from shardwise.recipes.convert import convert
from shardwise.recipes.data import DataOptions
from shardwise.recipes.finetune import FinetuneConfig, finetune

from helpers.hf import build_model_folder, chat_records, write_jsonl

PROBE = torch.tensor([[2, 7, 11, 5, 9, 14, 3, 8]])
SIZES = dict(hidden=32, layers=1, heads=4, kv_heads=2, intermediate=64)


def names_in(folder):
    with safe_open(os.path.join(folder, "model.safetensors"), framework="pt") as fh:
        return set(fh.keys())


def logits(folder):
    from transformers import AutoModelForCausalLM

    with torch.no_grad():
        return AutoModelForCausalLM.from_pretrained(folder)(input_ids=PROBE).logits


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    """A 2-step recipe run on one process (tied embeddings) checkpointing its last step: (base, ckpt, export)."""
    root = str(tmp_path_factory.mktemp("recipe"))
    records = chat_records(20)
    base = build_model_folder(os.path.join(root, "base"), records, tie=True, **SIZES)
    out = os.path.join(root, "out")
    finetune(
        FinetuneConfig(
            model_path=base,
            max_steps=2,
            save_steps=2,
            learning_rate=1e-2,
            precision="32-true",
            devices=1,
            logging_steps=100,
            output_dir=out,
            data=DataOptions(
                dataset=write_jsonl(os.path.join(root, "chat.jsonl"), records),
                max_seq_len=32,
                eval_split_ratio=0.0,
                cache_dir=os.path.join(root, "cache"),
            ),
        )
    )
    return base, os.path.join(out, "checkpoints", "last.ckpt"), out  # the export is of step 2 too


def test_the_converted_folder_loads_and_gives_the_trained_logits(run, tmp_path, capsys):
    from transformers import AutoConfig, AutoTokenizer

    base, ckpt, export = run
    out = str(tmp_path / "hf")
    assert main(["convert", ckpt, out]) == 0  # the base folder the checkpoint records
    assert "fine-tuning recipe" in capsys.readouterr().out
    for fname in ("config.json", "generation_config.json", "tokenizer.json", "tokenizer_config.json"):
        assert os.path.exists(os.path.join(out, fname)), fname
    # The names save_pretrained writes: the recipe's export's, no module prefix, the tied lm_head left out.
    assert names_in(out) == names_in(export)
    assert "lm_head.weight" not in names_in(out) and not any(n.startswith("model.model.") for n in names_in(out))
    assert AutoConfig.from_pretrained(out).tie_word_embeddings
    torch.testing.assert_close(logits(out), logits(export), atol=1e-5, rtol=0)
    assert not torch.allclose(logits(out), logits(base), atol=1e-3)  # the trained model, not the base
    assert AutoTokenizer.from_pretrained(out)("the sky").input_ids

    half = convert(ckpt, str(tmp_path / "bf16"), dtype="bf16", base_model=base, quiet=True)
    assert AutoConfig.from_pretrained(str(tmp_path / "bf16")).dtype == torch.bfloat16, half


def test_without_a_usable_base_folder_nothing_is_written_and_the_fix_is_named(run, tmp_path):
    base, ckpt, export = run
    out = str(tmp_path / "hf")
    moved = str(tmp_path / "moved")
    os.rename(base, moved)
    try:
        with pytest.raises(ValueError, match="the base model folder the checkpoint records, .*base.*--base_model"):
            convert(ckpt, out, quiet=True)
        assert not os.path.exists(out)
        convert(ckpt, out, base_model=moved, quiet=True)  # the folder where it is now
        torch.testing.assert_close(logits(out), logits(export), atol=1e-5, rtol=0)
    finally:
        os.rename(moved, base)
    out = str(tmp_path / "hf2")
    gone = str(tmp_path / "gone")
    shutil.copytree(base, gone)
    shutil.rmtree(gone)
    with pytest.raises(ValueError, match="--base_model .*gone.* has no config.json"):
        convert(ckpt, out, base_model=gone, quiet=True)
    other = build_model_folder(str(tmp_path / "other"), chat_records(20), **{**SIZES, "hidden": 48})
    with pytest.raises(ValueError, match="does not hold the architecture.*shapes"):
        convert(ckpt, out, base_model=other, quiet=True)
    assert not os.path.exists(out)

    # A file OUT needs no config: every tensor, under the model's own names.
    single = str(tmp_path / "weights.safetensors")
    convert(ckpt, single, quiet=True)
    with safe_open(single, framework="pt") as fh:
        assert set(fh.keys()) == names_in(run[2]) | {"lm_head.weight"}


def test_a_plain_module_holding_self_model_converts_as_before(tmp_path):
    from shardwise import Trainer, TrainModule
    from shardwise.callbacks import ModelCheckpoint

    class Plain(TrainModule):
        def __init__(self):
            super().__init__()
            self.model = torch.nn.Linear(4, 2)

        def training_step(self, batch, batch_idx):
            return self.model(batch).pow(2).mean()

        def configure_optimizers(self):
            return torch.optim.SGD(self.parameters(), lr=0.1)

    trainer = Trainer(
        accelerator="cpu",
        devices=1,
        max_steps=1,
        logger=False,
        enable_progress_bar=False,
        default_root_dir=str(tmp_path),
        callbacks=[ModelCheckpoint(every_n_train_steps=1)],
    )
    trainer.fit(Plain(), torch.utils.data.DataLoader(torch.randn(4, 4), batch_size=2))
    out = str(tmp_path / "hf")
    convert(str(tmp_path / "checkpoints"), out, quiet=True)
    assert names_in(out) == {"model.weight", "model.bias"} and not os.path.exists(os.path.join(out, "config.json"))
    with pytest.raises(ValueError, match="--base_model"):
        convert(str(tmp_path / "checkpoints"), str(tmp_path / "again"), base_model=str(tmp_path), quiet=True)

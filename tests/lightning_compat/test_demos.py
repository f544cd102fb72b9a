"""`shardwise.demos` is Lightning's demos module after the import rename: the demo Transformer is Lightning's
model (defaults, parameter names, initialisation and forward: the same numbers from the same seed, recorded
from Lightning 2.6.6 in tests/fixtures/lightning_demo_transformer.json), WikiText2 takes Lightning's
arguments and never downloads, LightningTransformer and BoringModel train, LightningLSTM reads its
streams, and the MNIST datamodule (a download) is refused by name."""

from __future__ import annotations

import json
import os

import pytest
import torch
from lightning_compat.demo_probe import probe

import shardwise
from shardwise.demos import BoringDataModule, BoringModel, LightningLSTM, LightningTransformer, Transformer, WikiText2
from shardwise.demos.mnist_datamodule import MNIST
from shardwise.utilities import NotProvidedError

FIXTURE = os.path.join(os.path.dirname(__file__), "..", "fixtures", "lightning_demo_transformer.json")


def test_the_demo_transformer_is_lightnings():
    lightning = json.load(open(FIXTURE))
    mine = probe(Transformer)
    assert mine["defaults"] == lightning["defaults"]  # vocab 33278, ninp 200, nhead 2, nhid 200, 2 layers, 0.2
    assert mine["parameters_at_vocab_40"] == lightning["parameters_at_vocab_40"]
    assert mine["names"] == lightning["names"]
    for key in ("train_loss", "grad_norm", "eval_loss"):  # same init, same dropout draws, same forward
        # 1e-5: the fixture was recorded on another CPU, whose kernels round differently (~4e-6 seen)
        assert mine[key] == pytest.approx(lightning[key], rel=1e-5), key


def test_wikitext2_takes_lightnings_arguments_and_never_downloads(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    with pytest.raises(FileNotFoundError, match="never downloads") as err:
        WikiText2()
    assert WikiText2.URL in str(err.value)
    os.makedirs("data")
    words = [f"w{i % 13}" for i in range(2000)]
    with open("data/wikitext-2.txt", "w") as fh:  # the file Lightning's WikiText2 downloads
        fh.write("\n".join(" ".join(words[i : i + 10]) for i in range(0, 2000, 10)) + "\n")
    dataset = WikiText2(download=True)
    assert dataset.block_size == 35 and dataset.data.numel() == 2200  # 200 lines of 10 words + <eos>
    assert len(dataset) == 2200 // 35 - 1  # Lightning's count
    inputs, target = dataset[1]
    assert inputs.tolist() == dataset.data[35:70].tolist() and target.tolist() == dataset.data[36:71].tolist()

    shardwise.seed_everything(0)
    module = LightningTransformer(vocab_size=dataset.vocab_size)
    losses = []

    class Record(shardwise.Callback):
        def on_train_batch_end(self, trainer, module, outputs, batch, batch_idx):
            losses.append(float((outputs if torch.is_tensor(outputs) else outputs["loss"]).detach()))

    trainer = shardwise.Trainer(
        max_steps=2, logger=False, enable_checkpointing=False, enable_progress_bar=False, callbacks=[Record()]
    )
    trainer.fit(module)  # prepare_data and train_dataloader read ./data/wikitext-2.txt
    assert len(losses) == 2 and all(loss == loss for loss in losses)

    options = dict(logger=False, enable_checkpointing=False, enable_progress_bar=False)
    # LightningLSTM's batches: row i of each batch continues row i of the one before
    loader = LightningLSTM(vocab_size=dataset.vocab_size).train_dataloader()
    first, second = [inputs for inputs, _ in list(loader)[:2]]
    chunk = len(dataset) // 20
    assert first.shape == (20, 35) and first[1].tolist() == dataset[chunk][0].tolist()
    assert second[0].tolist() == dataset[1][0].tolist()

    trainer = shardwise.Trainer(max_steps=2, limit_val_batches=2, limit_test_batches=2, **options)
    boring = BoringModel()
    trainer.fit(boring, datamodule=BoringDataModule())
    assert trainer.global_step == 2
    assert trainer.test(boring, datamodule=BoringDataModule(), verbose=False) == [{}]  # it logs nothing
    with pytest.raises(NotProvidedError, match="never downloads"):
        MNIST("data", download=True)

"""A Hugging Face user's first instinct, from_pretrained inside configure_model, gets a pointer to what to do."""

from __future__ import annotations

import pytest
import torch
from torch.utils.data import DataLoader, TensorDataset

from shardwise import Trainer, TrainModule

from helpers.hf import build_model_folder, chat_records


class Pretrained(TrainModule):
    def __init__(self, path):
        super().__init__()
        self.path = path

    def configure_model(self):
        from transformers import AutoModelForCausalLM

        self.model = AutoModelForCausalLM.from_pretrained(self.path)

    def training_step(self, batch):
        return self.model(input_ids=batch[0], labels=batch[0]).loss

    def configure_optimizers(self):
        return torch.optim.AdamW(self.parameters(), lr=1e-4)


def test_from_pretrained_in_configure_model_points_to_from_config_and_init_weights(tmp_path):
    folder = build_model_folder(str(tmp_path / "model"), chat_records(8))
    trainer = Trainer(
        accelerator="cpu", devices=1, max_steps=1, logger=False, enable_progress_bar=False, enable_checkpointing=False
    )
    data = DataLoader(TensorDataset(torch.randint(0, 10, (4, 8))), batch_size=2)
    with pytest.raises(RuntimeError, match=r"calls from_pretrained.*from_config.*init_weights\(\).*shardwise finetune"):
        trainer.fit(Pretrained(folder), data)

"""ExpertLoadMonitor on a real one-process run of the bundled GPT-MoE: tokens per expert, and a dead expert named.

The test model's routers never pick expert 7 (a forward hook lowers its logit by 1e4), so after
`dead_after` optimizer steps the monitor warns once, naming expert 7 of both layers, and logs it idle; every
other expert's tokens add up to tokens x top_k per layer. The idle streaks travel in the callback's state.
"""

import warnings

import pytest
import torch
from torch.utils.data import DataLoader

from shardwise import Trainer, TrainModule
from shardwise.callbacks.expert_load import ExpertLoadMonitor
from shardwise.models.gpt_moe import GPTMoE, gpt_moe_config

from helpers.lm import token_data

DEAD = 7


class NoSeven(TrainModule):
    def configure_model(self) -> None:
        self.model = GPTMoE(gpt_moe_config("gpt-moe-tiny", vocab_size=32, block_size=16))
        for layer in self.model.moe_layers:
            layer.router.register_forward_hook(lambda m, args, out: out - 1e4 * (torch.arange(out.shape[-1]) == DEAD))

    def loss_weight(self, batch):
        return batch[0][:, 1:].numel()

    def training_step(self, batch, batch_idx):
        logits = self.model(batch[0][:, :-1])
        return self.model.loss(logits, batch[0][:, 1:])

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1)


def test_tokens_per_expert_are_logged_and_a_dead_expert_is_named_once():
    monitor = ExpertLoadMonitor(dead_after=2, log_every_n_steps=1)
    trainer = Trainer(
        accelerator="cpu",
        max_steps=3,
        callbacks=[monitor],
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
    )
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        trainer.fit(NoSeven(), DataLoader(token_data(12, seq=9, vocab=32), batch_size=4))
    dead = [str(w.message) for w in caught if "Dead experts" in str(w.message)]
    assert len(dead) == 1 and "step 2" in dead[0] and "layer 0 expert 7, layer 1 expert 7" in dead[0], dead
    counts = monitor.last
    assert counts.shape == (2, 8) and counts[:, DEAD].tolist() == [0, 0]
    assert counts.sum(1).tolist() == [4 * 8 * 2] * 2  # 4 sequences x 8 tokens x top-2, per layer
    logged = monitor.metrics(counts)
    assert logged["experts/layer1/expert7"] == 0 and logged["experts/layer0/idle"] >= 1
    assert logged["experts/layer0/max_load"] >= 8 / 7  # 7 experts share what 8 would: at least 8/7 of even
    restored = ExpertLoadMonitor(dead_after=2)
    restored.load_state_dict(monitor.state_dict())
    assert restored.idle[:, DEAD].tolist() == [3, 3] and restored.warned == {(0, DEAD), (1, DEAD)}
    with pytest.raises(ValueError, match="dead_after=0"):
        ExpertLoadMonitor(dead_after=0)

"""ExpertLoadMonitor on a real one-process run of the bundled GPT-MoE: tokens per expert, and a dead expert named.

The test model's routers never pick expert 7 (a forward hook lowers its logit by 1e4), so after
`dead_after` optimizer steps the monitor warns once, naming expert 7 of both layers, and logs it idle; every
other expert's tokens add up to tokens x top_k per layer. The idle streaks travel in the callback's state.
Without a monitor given, the Trainer attaches one to a model that keeps an `expert_load` and it logs each layer's
load; router_losses keeps per-layer counts for a Hugging Face model's layers passed as one entry.
"""

import warnings

import pytest
import torch
from torch.utils.data import DataLoader

from shardwise import Trainer, TrainModule
from shardwise.callbacks.expert_load import ExpertLoadMonitor
from shardwise.expert_parallel import router_losses
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


class Logged:
    def __init__(self) -> None:
        self.rows = []

    def log_metrics(self, metrics, step=None):
        self.rows.append(dict(metrics))


def test_the_trainer_attaches_a_monitor_to_an_moe_model_and_it_logs_every_layer():
    logged = Logged()
    trainer = Trainer(
        accelerator="cpu", max_steps=2, log_every_n_steps=1, logger=logged, enable_checkpointing=False,
        enable_progress_bar=False,
    )  # fmt: skip
    trainer.fit(NoSeven(), DataLoader(token_data(8, seq=9, vocab=32), batch_size=4))
    assert sum(isinstance(c, ExpertLoadMonitor) for c in trainer.callbacks) == 1
    loads = [r for r in logged.rows if "experts/layer1/max_load" in r]
    assert len(loads) == 2, logged.rows  # one row per step, both layers, every expert (2 x 8 <= the limit)
    for row in loads:
        for layer in (0, 1):
            assert row[f"experts/layer{layer}/expert{DEAD}"] == 0 and row[f"experts/layer{layer}/idle"] >= 1
            assert sum(row[f"experts/layer{layer}/expert{e}"] for e in range(8)) == 4 * 8 * 2
            assert row[f"experts/layer{layer}/min_load"] == 0 and row[f"experts/layer{layer}/max_load"] >= 8 / 7


def test_layers_passed_as_one_entry_keep_their_own_counts():
    torch.manual_seed(0)
    logits = [torch.randn(6, 4) for _ in range(3)]  # 3 layers of 6 tokens, 4 experts
    index = [x.topk(2, dim=-1).indices for x in logits]
    mask = torch.tensor([1, 1, 0, 1, 1, 1], dtype=torch.bool)
    joined = router_losses([(torch.cat(logits), torch.cat(index))], 4, mask=mask.repeat(3), rows_per_token=3)
    want = torch.stack([torch.bincount(i[mask].reshape(-1), minlength=4) for i in index]).double()
    assert torch.equal(joined.counts, want) and joined.tokens.tolist() == [5.0] * 3

"""A model built in configure_model starts from the weights building it eagerly gives.

configure_model runs on the meta device, where the init a model's own __init__ applies stores nothing;
shardwise records that construction and replays it when the weights are allocated
(strategies/init_replay.py). Three constructions users bring, each with init beyond reset_parameters():
nn.Transformer's xavier pass (Lightning's FSDP guide model), nanoGPT's `self.apply(self._init_weights)`
with its scaled c_proj init and tied head, and a Hugging Face model from a config (post_init). Each is
fitted for one step with the Trainer on one process and under FSDP on two; the weights at on_train_start
must equal the eagerly built model's from the same seed: bitwise on one process, and under FSDP too
(every rank replays the whole stream and keeps its slice).
"""

from __future__ import annotations

import math
from typing import Any, Dict

import pytest
import torch
from torch import nn
from torch.distributed.tensor import DTensor

import shardwise
from shardwise import Callback, Trainer, TrainModule

SEED = 31


def transformer() -> nn.Module:
    return nn.Transformer(d_model=16, nhead=2, num_encoder_layers=1, num_decoder_layers=1, dim_feedforward=32)


class NanoGPT(nn.Module):
    """nanoGPT's initialisation pattern (karpathy/nanoGPT model.py): tied head, apply(_init_weights), scaled c_proj."""

    def __init__(self, vocab: int = 32, dim: int = 16, layers: int = 2) -> None:
        super().__init__()
        self.wte = nn.Embedding(vocab, dim)
        self.wpe = nn.Embedding(8, dim)
        self.h = nn.ModuleList(
            nn.ModuleDict({"c_attn": nn.Linear(dim, 3 * dim), "c_proj": nn.Linear(dim, dim), "ln": nn.LayerNorm(dim)})
            for _ in range(layers)
        )
        self.lm_head = nn.Linear(dim, vocab, bias=False)
        self.wte.weight = self.lm_head.weight
        self.apply(self._init_weights)
        for name, p in self.named_parameters():
            if name.endswith("c_proj.weight"):
                torch.nn.init.normal_(p, mean=0.0, std=0.02 / math.sqrt(2 * layers))

    def _init_weights(self, module: nn.Module) -> None:
        if isinstance(module, nn.Linear):
            torch.nn.init.normal_(module.weight, mean=0.0, std=0.02)
            if module.bias is not None:
                torch.nn.init.zeros_(module.bias)
        elif isinstance(module, nn.Embedding):
            torch.nn.init.normal_(module.weight, mean=0.0, std=0.02)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        x = self.wte(tokens) + self.wpe(torch.arange(tokens.shape[1]))
        for block in self.h:
            x = x + block["c_proj"](block["c_attn"](block["ln"](x))[..., : x.shape[-1]])
        return self.lm_head(x)


def hf_llama() -> nn.Module:
    from transformers import AutoModelForCausalLM, LlamaConfig

    config = LlamaConfig(
        vocab_size=32,
        hidden_size=16,
        intermediate_size=32,
        num_hidden_layers=2,
        num_attention_heads=2,
        num_key_value_heads=1,
        max_position_embeddings=16,
    )
    return AutoModelForCausalLM.from_config(config)


BUILDERS = {"transformer": transformer, "nanogpt": NanoGPT, "hf_llama": hf_llama}


class Built(TrainModule):
    def __init__(self, kind: str) -> None:
        super().__init__()
        self.kind = kind
        self.model = None

    def configure_model(self) -> None:
        self.model = BUILDERS[self.kind]()

    def training_step(self, batch):
        if self.kind == "transformer":
            x = batch.float().unsqueeze(-1).expand(*batch.shape, 16)
            return self.model(x, x).float().pow(2).mean()
        out = self.model(batch)
        return (out.logits if hasattr(out, "logits") else out).float().pow(2).mean()

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.0)


class Weights(Callback):
    def on_train_start(self, trainer, module) -> None:
        self.weights = {
            k: (v.full_tensor() if isinstance(v, DTensor) else v).detach().cpu().clone()
            for k, v in module.model.state_dict().items()
        }
        self.rng = torch.random.get_rng_state()


def fitted_weights(kind: str, strategy: str = "auto", devices: int = 1) -> Dict[str, Any]:
    shardwise.seed_everything(SEED)
    weights = Weights()
    trainer = Trainer(
        accelerator="cpu",
        devices=devices,
        strategy=strategy,
        max_steps=1,
        callbacks=[weights],
        logger=False,
        enable_progress_bar=False,
        enable_checkpointing=False,
    )
    trainer.fit(Built(kind), [torch.arange(8).reshape(2, 4) % 32])
    return {"weights": weights.weights, "rng": weights.rng}


def eager(kind: str) -> Dict[str, Any]:
    torch.manual_seed(SEED)
    model = BUILDERS[kind]()
    return {
        "weights": {k: v.detach().clone() for k, v in model.state_dict().items()},
        "rng": torch.random.get_rng_state(),
    }


def on_two_ranks() -> Dict[str, Any]:
    return {kind: fitted_weights(kind, strategy="fsdp", devices=2)["weights"] for kind in BUILDERS}


def unequal(got: Dict[str, torch.Tensor], want: Dict[str, torch.Tensor]) -> list:
    assert sorted(got) == sorted(want)
    return [k for k in want if not torch.equal(got[k], want[k])]


@pytest.fixture(scope="module")
def fsdp_weights():
    return shardwise.launch(on_two_ranks, devices=2)[0]


@pytest.mark.parametrize("kind", sorted(BUILDERS))
def test_configure_model_weights_equal_eager_on_one_process(kind):
    if kind == "hf_llama":
        pytest.importorskip("transformers")
    want = eager(kind)
    got = fitted_weights(kind)
    assert unequal(got["weights"], want["weights"]) == []
    # The generator ends where eager construction leaves it: dropout draws the same masks.
    assert torch.equal(got["rng"], want["rng"])


@pytest.mark.parametrize("kind", sorted(BUILDERS))
def test_configure_model_weights_equal_eager_under_fsdp(kind, fsdp_weights):
    assert unequal(fsdp_weights[kind], eager(kind)["weights"]) == []

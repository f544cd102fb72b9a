# LoRA for Trainer users, in one process: shardwise.adapters on meta-device models
# (the adapters' seeded init is the same through the strategy's per-module reset
# and through init_lora_weights, A random and B zero), the names the rank-0
# loader maps, a TrainModule that calls apply_lora in configure_model under FSDP
# (frozen base weights sharded, no gradient and no optimizer state; accumulation
# and clipping), and the loud failures: a step whose trainable gradients are all
# zero (LoRA A and B both zero; a loss multiplied by 0) stops with a message that
# says "zero", one with a NaN says "non-finite", and a fit with nothing trainable
# is refused before the first step.
from __future__ import annotations

import pytest
import torch
from peft import LoraConfig
from torch import nn

from shardwise import TrainModule
from shardwise.adapters import LoraOptions, apply_lora, count_parameters, init_lora_weights, is_adapter_model
from shardwise.adapters.lora import base_weight_name, lora_layers
from shardwise.health import NonFiniteError
from shardwise.strategies.materialize import materialize_module
from shardwise.trainer.nonfinite import ZeroGradientError

from helpers.trainers import quiet_trainer


def mlp() -> nn.Module:
    return nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 16), nn.Tanh(), nn.Linear(16, 1))


def meta_lora(**config) -> nn.Module:
    with torch.device("meta"):
        model = mlp()
    return apply_lora(model, LoraConfig(r=2, target_modules=["0", "2"], **config))


def test_meta_lora_is_initialised_the_same_by_reset_and_by_init_lora_weights():
    by_reset = meta_lora()
    materialize_module(by_reset, torch.device("cpu"), seed=3)
    by_hook = meta_lora()
    by_hook.to_empty(device="cpu")
    assert init_lora_weights(by_hook, 3) == 4
    reset, hooked = by_reset.state_dict(), by_hook.state_dict()
    adapters = [k for k in reset if "lora_" in k]
    assert len(adapters) == 4
    for key in adapters:
        assert torch.equal(reset[key], hooked[key]), key
        assert (reset[key].abs().sum() > 0) == ("lora_A" in key), key  # PEFT's init: A random, B zero
    other_seed = meta_lora()
    materialize_module(other_seed, torch.device("cpu"), seed=4)
    assert not torch.equal(other_seed.state_dict()[adapters[0]], reset[adapters[0]])
    assert is_adapter_model(by_reset) and not is_adapter_model(mlp())
    trainable, total = count_parameters(by_reset)
    assert trainable == 2 * (8 + 16) + 2 * (16 + 16) and total == trainable + sum(p.numel() for p in mlp().parameters())


def test_names_and_options():
    assert base_weight_name("base_model.model.model.layers.0.mlp.up_proj.base_layer.weight") == (
        "model.layers.0.mlp.up_proj.weight"
    )
    assert base_weight_name("base_model.model.model.layers.0.mlp.up_proj.lora_B.default.weight") is None
    assert base_weight_name("model.norm.weight") == "model.norm.weight"
    config = LoraOptions(r=4, alpha=8, dropout=0.1, target_modules=["all-linear"]).to_peft()
    assert (config.r, config.lora_alpha, config.lora_dropout, config.target_modules) == (4, 8, 0.1, "all-linear")
    with pytest.raises(ValueError, match="lora_r=0"):
        LoraOptions(r=0).to_peft()
    with pytest.raises(ValueError, match=r"Modules with weights in this model: 0, 2, 4"):
        apply_lora(mlp(), LoraConfig(r=2, target_modules=["qkv"]))
    with pytest.raises(ValueError, match="already a peft.PeftModel"):
        apply_lora(meta_lora(), LoraOptions(r=2, target_modules=["0"]))


class LoraRegression(TrainModule):
    """A Trainer user's LoRA module: the base model built and wrapped in configure_model."""

    def __init__(self, loss_scale: float = 1.0, zero_adapters: bool = False, freeze_all: bool = False):
        super().__init__()
        self.loss_scale, self.zero_adapters, self.freeze_all = loss_scale, zero_adapters, freeze_all
        self.model = None
        self.grads_seen = []

    def configure_model(self):
        if self.model is None:
            self.model = apply_lora(mlp(), LoraConfig(r=2, target_modules=["0", "2", "4"]))
            if self.freeze_all:
                self.model.requires_grad_(False)

    def init_weights(self):
        for layer in self.model.modules():  # the base weights (a pretrained model would be loaded here)
            if isinstance(layer, nn.Linear):
                layer.reset_parameters()
        init_lora_weights(self.model, seed=0)
        if self.zero_adapters:  # the planted silent failure: B = 0 and A = 0, so no adapter gets a gradient
            for _, layer, name in lora_layers(self.model):
                layer.lora_A[name].weight.zero_()

    def training_step(self, batch, batch_idx):
        x, y = batch
        return nn.functional.mse_loss(self.model(x), y) * self.loss_scale

    def on_before_optimizer_step(self, optimizer):
        self.grads_seen.append({n for n, p in self.model.named_parameters() if p.grad is not None})

    def configure_optimizers(self):
        return torch.optim.AdamW([p for p in self.parameters() if p.requires_grad], lr=1e-2)


def loader(n=32):
    g = torch.Generator().manual_seed(0)
    x = torch.randn(n, 8, generator=g)
    data = torch.utils.data.TensorDataset(x, x.sum(dim=1, keepdim=True).sin())
    return torch.utils.data.DataLoader(data, batch_size=4)


def test_trainer_user_lora_under_fsdp_trains_only_the_adapters():
    module = LoraRegression()
    trainer = quiet_trainer(strategy="fsdp", max_steps=4, accumulate_grad_batches=2, gradient_clip_val=0.5)
    try:
        trainer.fit(module, loader())
        params = dict(module.model.named_parameters())
        assert all(type(p).__name__ == "DTensor" for p in params.values())  # frozen weights are sharded too
        trainable = {n for n, p in params.items() if p.requires_grad}
        assert trainable and all("lora_" in n for n in trainable)
        assert all(seen == trainable for seen in module.grads_seen) and len(module.grads_seen) == 4
        state = trainer.optimizers[0].state
        assert {n for n, p in params.items() if p in state} == trainable  # no optimizer state for frozen ones
    finally:
        trainer.strategy.teardown()


@pytest.mark.parametrize(
    "kwargs, error, message",
    [
        ({"zero_adapters": True}, ZeroGradientError, "Every trainable gradient is zero at optimizer step 1"),
        ({"loss_scale": 0.0}, ZeroGradientError, "Every trainable gradient is zero at optimizer step 1"),
        ({"loss_scale": float("nan")}, NonFiniteError, "Non-finite values at optimizer step 1"),
        ({"freeze_all": True}, ValueError, "trainable parameter count is 0 of 579"),
    ],
)
def test_planted_silent_failures_stop_the_run(kwargs, error, message):
    module = LoraRegression(**kwargs)
    with pytest.raises(error, match=message) as info:
        quiet_trainer(max_steps=3).fit(module, loader())
    assert module.grads_seen == [] or len(module.grads_seen) == 1  # stopped at the first step
    if error is ZeroGradientError:
        assert "rank 0: 6 gradient tensor(s)" in str(info.value) and "global_step stays 0" in str(info.value)


@pytest.mark.parametrize(
    "value, expected",
    [
        ("all-linear", ["all-linear"]),
        ("q_proj,v_proj", ["q_proj", "v_proj"]),
        ("[q_proj,v_proj]", ["q_proj", "v_proj"]),
    ],
)
def test_cli_takes_peft_target_module_spellings(value, expected):
    from shardwise.cli.finetune import parser, translate

    argv = ["--model_path", "m", "--lora_r", "16", "--lora_alpha", "32", "--lora_dropout", "0.05"]
    ns = parser().parse_args(translate([*argv, "--lora_target_modules", value]))
    assert (ns.lora_r, ns.lora_alpha, ns.lora_dropout, ns.lora_target_modules) == (16, 32, 0.05, expected)


def test_export_adapter_of_checkpoint_wrapped_layers_and_its_refusal(tmp_path, monkeypatch):
    """Activation checkpointing renames the LoRA layers' parameters (`_checkpoint_wrapped_module.`); PEFT finds
    adapter keys by the model's own module names, so the export must hand it those (it wrote 0 tensors), and
    an export that would write fewer tensors than the model has LoRA matrices is refused, not written."""
    from peft import PeftModel
    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper

    from shardwise.adapters.export import export_adapter, export_merged
    from shardwise.recipes import lora_export as export

    # The path docs/adapters.md gave before the export moved to recipes/ names the same functions.
    assert (export_adapter, export_merged) == (export.export_adapter, export.export_merged)
    torch.manual_seed(0)
    base = mlp()
    base_state = {k: v.clone() for k, v in base.state_dict().items()}
    model = apply_lora(base, LoraConfig(r=2, target_modules=["0", "2"], init_lora_weights=False))  # B non-zero
    inner = model.get_base_model()
    inner[0], inner[2] = checkpoint_wrapper(inner[0]), checkpoint_wrapper(inner[2])
    assert any("_checkpoint_wrapped_module" in n for n, _ in model.named_parameters())
    export.export_adapter(model, str(tmp_path / "adapter"))
    fresh = mlp()
    fresh.load_state_dict(base_state)
    loaded = PeftModel.from_pretrained(fresh, str(tmp_path / "adapter"))
    x = torch.randn(5, 8)
    with torch.no_grad():
        torch.testing.assert_close(loaded(x), model(x), rtol=0, atol=1e-6)
        with loaded.disable_adapter():
            assert not torch.allclose(loaded(x), model(x), atol=1e-3)  # the adapter matters: it was loaded
    # The old naming (wrapper prefix stripped before PEFT's selection) matches none of the 4 matrices: refused.
    stripped = [(export.canonical_name(n), p) for n, p in export._adapter_tensors(model)]
    monkeypatch.setattr(export, "_adapter_tensors", lambda peft_model: stripped)
    with pytest.raises(ValueError, match="has 4 LoRA matrices, but only 0"):
        export.export_adapter(model, str(tmp_path / "refused"))
    assert not (tmp_path / "refused" / "adapter_model.safetensors").exists()

# Model converters (adapters/converters.py), in one process: the recipe's flags become the converters it
# applies before the strategy shards the model (QLoRA's NF4 base first, then LoRA), the strategy's plan is
# read only when a 4-bit base needs it (a module set up without a Trainer has none), each converter gets
# what the one before returned, a converter returning no module is refused by name, and the recipe's
# ConverterSteps callback runs a converter's post_optimizer_step once per optimizer step, not per
# micro-batch. The fine-tuning runs of tests/recipes/test_lora.py and test_qlora.py go through the same
# converters end to end.
from __future__ import annotations

import pytest
import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from shardwise import TrainModule
from shardwise.adapters import LoraOptions, is_adapter_model
from shardwise.adapters.converters import (
    LoraConverter,
    NF4BaseConverter,
    build_converters,
    convert_model,
)
from shardwise.recipes.causal_lm import ConverterSteps
from shardwise.recipes.finetune import FinetuneConfig, coerce_config
from shardwise.strategies.parallel import ParallelPlan

from helpers.trainers import quiet_trainer


def _config(**flags) -> FinetuneConfig:
    return coerce_config(dict(model_path="unused", dataset="-", **flags))


def _no_plan():
    raise AssertionError("the strategy's plan was read without a 4-bit base")


def test_recipe_flags_become_converters_in_order():
    assert build_converters(_config(), _no_plan) == []  # full fine-tuning
    assert build_converters(_config(lora_r=8, lora_target_modules=["q_proj"]), _no_plan) == [
        LoraConverter(LoraOptions(r=8, alpha=16, dropout=0.0, target_modules=["q_proj"]))
    ]
    qlora = build_converters(_config(lora_r=8, load_in_4bit=True, precision="32-true"), lambda: None)
    assert [type(c) for c in qlora] == [NF4BaseConverter, LoraConverter]  # quantise the base, then wrap it
    assert qlora[0].compute_dtype == torch.float32
    with pytest.raises(ValueError, match="load_in_4bit does not work under DeepSpeed ZeRO-3"):
        build_converters(_config(lora_r=8, load_in_4bit=True), lambda: ParallelPlan(engine="deepspeed", zero_stage=3))


def _mlp() -> nn.Module:
    return nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 4))


def test_each_converter_gets_what_the_one_before_returned():
    from bitsandbytes.nn import Linear4bit

    with torch.device("meta"):
        model = _mlp()
    options = LoraOptions(r=2, target_modules=["0", "2"]).to_peft()
    options.task_type = None  # a plain PeftModel: PEFT's causal-LM wrapper needs a transformers model
    converted = convert_model(model, [NF4BaseConverter(torch.float32), LoraConverter(options)])
    assert is_adapter_model(converted) and converted is not model  # PEFT's wrapper around the 4-bit base
    base = converted.get_base_model()
    assert isinstance(base[0].base_layer, Linear4bit) and isinstance(base[2].base_layer, Linear4bit)
    assert all("lora_" in n for n, p in converted.named_parameters() if p.requires_grad)

    class Forgetful:
        def convert(self, model):
            model.half()  # in place, but returns nothing

    with pytest.raises(TypeError, match="Forgetful.convert returned NoneType, not an nn.Module"):
        convert_model(_mlp(), [Forgetful()])


class LoraFree:
    """A converter that changes nothing and has no per-step work, as LoRA and QLoRA have none."""

    def convert(self, model: nn.Module) -> nn.Module:
        return model


class MaxNorm:
    """A converter with per-step work: each output unit's weight row is scaled back to norm <= 1 after
    every optimizer step (a max-norm constraint), and the steps it ran after are counted."""

    def __init__(self) -> None:
        self.steps = 0

    def convert(self, model: nn.Module) -> nn.Module:
        return model

    @torch.no_grad()
    def post_optimizer_step(self, model: nn.Module) -> None:
        self.steps += 1
        norms = model.weight.norm(dim=1, keepdim=True)
        model.weight.div_(norms.clamp_min(1.0))


class Regression(TrainModule):
    def __init__(self, converters) -> None:
        super().__init__()
        self.converters = converters
        self.model = convert_model(nn.Linear(4, 2), converters)

    def training_step(self, batch, batch_idx):
        x, y = batch
        return nn.functional.mse_loss(self.model(x), y)

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=5.0)  # large steps: the rows would outgrow norm 1


def test_post_optimizer_step_runs_once_per_optimizer_step():
    g = torch.Generator().manual_seed(0)
    data = TensorDataset(torch.randn(12, 4, generator=g), 10 * torch.randn(12, 2, generator=g))
    hook = MaxNorm()
    module = Regression([LoraFree(), hook])  # the first has no post_optimizer_step: skipped
    trainer = quiet_trainer(max_steps=3, accumulate_grad_batches=2, callbacks=[ConverterSteps()])
    trainer.fit(module, DataLoader(data, batch_size=2))
    assert trainer.global_step == 3 and hook.steps == 3  # six micro-batches, three steps
    assert module.model.weight.norm(dim=1).max() <= 1.0 + 1e-6
    unconstrained = Regression([LoraFree()])
    quiet_trainer(max_steps=3, accumulate_grad_batches=2, callbacks=[ConverterSteps()]).fit(
        unconstrained, DataLoader(data, batch_size=2)
    )
    assert unconstrained.model.weight.norm(dim=1).max() > 1.5  # what the hook held back

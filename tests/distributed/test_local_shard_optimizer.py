"""Optimizers that do not understand DTensor train under FSDP2 exactly as under DDP (issue 12, item 3).

One launch of two gloo ranks runs every case through the low-level strategy
API (the Trainer calls the same setup_optimizer / optimizer_step):
a pure-Python Adam that raises on DTensor, and, when installed, bitsandbytes'
PagedAdamW32bit (CPU kernels) and AdamW8bit.
"""

from __future__ import annotations

import importlib.util
import math

import pytest
import torch
from torch import nn
from torch.distributed.tensor import DTensor

import shardwise

HAS_BNB = importlib.util.find_spec("bitsandbytes") is not None


class PlainAdam(torch.optim.Optimizer):
    """A third-party optimizer in plain PyTorch, as found in research code: it refuses DTensor."""

    def __init__(self, params, lr=1e-2, betas=(0.9, 0.99), eps=1e-8):
        super().__init__(params, dict(lr=lr, betas=betas, eps=eps))

    @torch.no_grad()
    def step(self, closure=None):
        for group in self.param_groups:
            b1, b2 = group["betas"]
            for p in group["params"]:
                if p.grad is None:
                    continue
                if isinstance(p, DTensor) or isinstance(p.grad, DTensor):
                    raise TypeError("PlainAdam: DTensor is not supported by this kernel")
                state = self.state[p]
                if not state:
                    state["step"] = 0
                    state["exp_avg"] = torch.zeros_like(p)
                    state["exp_avg_sq"] = torch.zeros_like(p)
                state["step"] += 1
                state["exp_avg"].mul_(b1).add_(p.grad, alpha=1 - b1)
                state["exp_avg_sq"].mul_(b2).addcmul_(p.grad, p.grad, value=1 - b2)
                step_size = group["lr"] / (1 - b1 ** state["step"])
                denom = (state["exp_avg_sq"] / (1 - b2 ** state["step"])).sqrt_().add_(group["eps"])
                p.addcdiv_(state["exp_avg"], denom, value=-step_size)


def _model():
    # 7 output rows: the last layer's shards are uneven (4 + 3 rows).
    return nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 7))


def _losses(strategy, make_optimizer, steps=4):
    strategy.connect(accelerator="cpu")
    strategy.setup_environment()
    with strategy.module_init_context():
        model = _model()
    model = strategy.setup_module(model)
    optimizer = strategy.setup_optimizer(make_optimizer(model.parameters()))
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: 1.0 / (1 + step))  # built after setup
    gen = torch.Generator().manual_seed(100 + strategy.global_rank)
    losses = []
    for _ in range(steps):
        x = torch.randn(8, 16, generator=gen)
        loss = model(x).pow(2).mean()
        strategy.backward(loss)
        strategy.optimizer_step(optimizer)
        optimizer.zero_grad(set_to_none=True)
        scheduler.step()
        losses.append(float(strategy.reduce(loss.detach(), "mean")))
    return model, optimizer, losses


def _flat(tree, prefix=""):
    """The non-scalar tensors of a (nested) optimizer state dict, by path."""
    out = {}
    for key, value in tree.items():
        if isinstance(value, dict):
            out.update(_flat(value, f"{prefix}{key}."))
        elif isinstance(value, torch.Tensor) and value.dim() > 0:
            out[prefix + str(key)] = value
    return out


def _run():
    from torch.distributed.checkpoint.state_dict import get_optimizer_state_dict, set_optimizer_state_dict

    from shardwise.strategies import DDPStrategy, FSDPStrategy

    out = {}
    makers = {"plain": lambda ps: PlainAdam(ps, lr=1e-2)}
    if HAS_BNB:
        import bitsandbytes as bnb

        makers["paged32"] = lambda ps: bnb.optim.PagedAdamW32bit(ps, lr=1e-2)
    for name, make in makers.items():
        shardwise.seed_everything(7)
        _, _, ddp = _losses(DDPStrategy(), make)
        shardwise.seed_everything(7)
        model, optimizer, fsdp = _losses(FSDPStrategy(), make)
        out[name] = (ddp, fsdp)
        # The state is laid out like the parameters (DTensor shards), so DCP saves and reshards it.
        # (bitsandbytes nests its tensors in a "__bnb_optimizer_quant_state__" dict; DCP flattens it.)
        sd = _flat(get_optimizer_state_dict(model, optimizer)["state"])
        out[name + ":dtensor_state"] = bool(sd) and all(isinstance(v, DTensor) for v in sd.values())
        # Loading into a fresh optimizer runs DCP's state initialisation (a step) through the wrapper.
        fresh = make(model.parameters())
        shardwise.strategies.fsdp.apply_local_shard_step(fresh)
        set_optimizer_state_dict(model, fresh, get_optimizer_state_dict(model, optimizer))
        again = _flat(get_optimizer_state_dict(model, fresh)["state"])
        out[name + ":reloaded"] = sd.keys() == again.keys() and all(
            torch.equal(v.full_tensor(), again[k].full_tensor()) for k, v in sd.items()
        )
    # The same optimizer without the local-shard step really fails on DTensor.
    strategy = FSDPStrategy(optimizer_on_local_shards=False)
    try:
        _losses(strategy, makers["plain"], steps=1)
        out["plain:without"] = "no error"
    except TypeError as exc:
        out["plain:without"] = str(exc)
    if HAS_BNB:
        import bitsandbytes as bnb

        model, optimizer, losses = _losses(
            FSDPStrategy(), lambda ps: bnb.optim.AdamW8bit(ps, lr=1e-2, min_8bit_size=16), steps=2
        )
        out["8bit:finite"] = all(math.isfinite(v) for v in losses)
        try:
            optimizer.state_dict()
            out["8bit:save"] = "saved"
        except RuntimeError as exc:
            out["8bit:save"] = str(exc)
    return out


@pytest.mark.timeout(180)
def test_optimizers_that_reject_dtensor_step_on_local_shards():
    result = shardwise.launch(_run, devices=2)[0]
    for name in ("plain", "paged32") if HAS_BNB else ("plain",):
        ddp, fsdp = result[name]
        assert fsdp == pytest.approx(ddp, rel=1e-5, abs=1e-6), name
        assert ddp[-1] < ddp[0], name
        assert result[name + ":dtensor_state"] and result[name + ":reloaded"], name
    assert "DTensor is not supported" in result["plain:without"]
    if HAS_BNB:
        assert result["8bit:finite"]
        assert "not shaped like the parameter shards" in result["8bit:save"]

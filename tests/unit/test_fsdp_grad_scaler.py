"""FSDP2 with fp16 loss scaling uses torch.amp.GradScaler, the scaler torch pairs with FSDP2 (issue 36, item 8).

FSDP1's ShardedGradScaler was used: it all-reduces its inf flag over the world
on every step, although FSDP2's gradients are DTensors whose inf check already
agrees over the mesh, and built without a device it is silently disabled off
CUDA (scale 1.0, so fp16 gradients underflow and an overflow is never skipped).
16-mixed is refused on CPU for training (gloo lacks fp16 reductions), so the
precision is set on the strategy directly: the parameters are fp16 in the
forward, the gradients are reduced in fp32, and the scaler under test is the
strategy's own. A world of one process; an inf gradient must skip the step.
"""

import warnings

import torch
import torch.distributed as dist
from torch import nn

from shardwise import FSDPStrategy
from shardwise.precision import build_precision


def test_fp16_fsdp2_scales_skips_an_overflow_and_adds_no_collective(monkeypatch):
    strategy = FSDPStrategy()
    strategy.connect("cpu")
    strategy.precision = build_precision("16-mixed", "cuda")  # past the CPU refusal: the scaler is under test
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        strategy.setup_environment()
    try:
        torch.manual_seed(0)
        with strategy.module_init_context():
            model = nn.Sequential(nn.Linear(8, 8), nn.Tanh(), nn.Linear(8, 1))
        model = strategy.setup_module(model)
        optimizer = strategy.setup_optimizer(torch.optim.SGD(model.parameters(), lr=0.05))
        reduces = []
        real = dist.all_reduce
        monkeypatch.setattr(dist, "all_reduce", lambda *a, **k: (reduces.append(a[0].shape), real(*a, **k))[1])
        x = torch.randn(16, 8, generator=torch.Generator().manual_seed(1))
        losses, taken, scales = [], [], []
        for step in range(4):
            loss = model(x).float().pow(2).mean()
            if step == 2:
                loss = loss * float("inf")  # an overflow: every gradient inf
            strategy.backward(loss, model)
            before = [p.detach().full_tensor().clone() for p in model.parameters()]
            taken.append(strategy.optimizer_step(optimizer))
            scales.append(strategy.grad_scaler.get_scale())
            if not taken[-1]:
                assert all(torch.equal(b, p.detach().full_tensor()) for b, p in zip(before, model.parameters()))
            optimizer.zero_grad(set_to_none=True)
            losses.append(float(loss))
        assert isinstance(strategy.grad_scaler, torch.amp.GradScaler)
        assert scales[0] == 2.0**16 and taken == [True, True, False, True]  # enabled; the overflow skipped
        assert scales[2] == scales[1] / 2 and losses[3] < losses[0]  # backed off, and it trains
        assert reduces == []  # the inf check agreed through the DTensor gradients: no all-reduce of its own
    finally:
        strategy.teardown()

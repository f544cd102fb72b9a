"""What test_demos.py compares between `shardwise.demos.Transformer` and Lightning's demo Transformer:
the constructor's defaults, the parameter names and count, and, from one seed, the loss and gradient norm of a
training-mode forward (dropout draws included) and an evaluation-mode forward of a small-vocabulary model.
tests/fixtures/record_lightning_demo.py runs it on Lightning's class."""

from __future__ import annotations

import inspect
from typing import Any, Dict

import torch
import torch.nn.functional as F


def probe(transformer_cls: Any) -> Dict[str, Any]:
    defaults = {k: p.default for k, p in inspect.signature(transformer_cls).parameters.items()}
    torch.manual_seed(0)
    model = transformer_cls(vocab_size=40)
    out: Dict[str, Any] = {
        "defaults": defaults,
        "parameters_at_vocab_40": sum(p.numel() for p in model.parameters()),
        "names": [name for name, _ in model.named_parameters()],
    }
    inputs = torch.randint(0, 40, (3, 7))
    target = torch.randint(0, 40, (3, 7))
    loss = F.nll_loss(model(inputs, target), target.view(-1))
    loss.backward()
    out["train_loss"] = float(loss.detach())
    out["grad_norm"] = float(torch.cat([p.grad.flatten() for p in model.parameters()]).norm())
    model.eval()
    with torch.no_grad():
        out["eval_loss"] = float(F.nll_loss(model(inputs, target), target.view(-1)))
    return out

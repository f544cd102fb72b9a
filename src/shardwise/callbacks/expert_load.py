"""ExpertLoadMonitor: tokens per expert of a mixture-of-experts model, logged, and a warning for dead experts.

A model that keeps an `expert_load` (expert_parallel.ExpertLoad: the bundled GPTMoE does, the fine-tuning
recipe attaches one to a Hugging Face MoE) adds each micro-batch's tokens per expert to it, counted over
the data-parallel ranks (the router losses' all-reduce already made them global, so every rank holds the
same numbers and this callback adds no collective). At each optimizer step the callback takes the step's
counts [layers, experts]; every `log_every_n_steps` it logs, per layer, the tokens of each expert
(`experts/layer{l}/expert{e}`, with `per_expert=True`; the default, None, logs them while the model has at
most PER_EXPERT_LIMIT experts over all layers), the busiest and the idlest expert's share over the even share
(`experts/layer{l}/max_load` and `min_load`: 1.0 is perfect balance) and how many experts got nothing
(`experts/layer{l}/idle`). An expert that receives no token for `dead_after` optimizer steps in a row is
named once in a warning, with its layer (its router never picks it: its weights stop training); the
streaks are part of the checkpoint, so a resumed run warns as the uninterrupted one would. The Trainer
attaches one (`attach_monitor`, with the defaults) when the model it set up keeps an `expert_load` and no
ExpertLoadMonitor was given: pass your own to change `dead_after` or the logging.
"""

from __future__ import annotations

import warnings
from typing import Any, Dict, List, Optional

import torch

from shardwise.expert_parallel import ExpertLoad

__all__ = ["ExpertLoadMonitor", "expert_loads", "attach_monitor", "PER_EXPERT_LIMIT"]

PER_EXPERT_LIMIT = 256  # layers x experts up to which per_expert=None logs every expert's tokens


def expert_loads(module: Any) -> List[ExpertLoad]:
    """Every ExpertLoad a module's submodules keep (as `expert_load`), in module order."""
    found = []
    for sub in module.modules():
        load = getattr(sub, "expert_load", None)
        if isinstance(load, ExpertLoad) and all(load is not f for f in found):
            found.append(load)
    return found


class ExpertLoadMonitor:
    """Log tokens per expert every `log_every_n_steps` (None: the Trainer's); warn when one idles `dead_after` steps."""

    def __init__(
        self, dead_after: int = 100, log_every_n_steps: Optional[int] = None, per_expert: Optional[bool] = None
    ) -> None:
        if not isinstance(dead_after, int) or isinstance(dead_after, bool) or dead_after < 1:
            raise ValueError(f"ExpertLoadMonitor(dead_after={dead_after!r}): use a whole number of steps, 1 or more.")
        self.dead_after = dead_after
        self.log_every_n_steps = log_every_n_steps
        self.per_expert = per_expert
        self.idle: Optional[torch.Tensor] = None  # [layers, experts]: optimizer steps in a row without a token
        self.warned: set = set()
        self.last: Optional[torch.Tensor] = None  # the last step's counts
        self._found: Any = None  # (module, its ExpertLoads): looked up once per module, not every step

    def on_train_batch_end(self, trainer: Any, module: Any, outputs: Any, batch: Any, batch_idx: int) -> None:
        if not trainer.is_last_microbatch:
            return
        if self._found is None or self._found[0] is not module:
            self._found = (module, expert_loads(module))
        taken = [load.pop() for load in self._found[1]]
        taken = [c for c in taken if c is not None]
        if not taken:
            return
        counts = torch.cat([c.reshape(-1, c.shape[-1]) for c in taken]).detach().cpu()
        self.last = counts
        self._track(counts, trainer)
        every = self.log_every_n_steps or getattr(trainer, "log_every_n_steps", 1)
        if trainer.global_step % every == 0:
            trainer.log_metrics(self.metrics(counts), step=trainer.global_step)

    def metrics(self, counts: torch.Tensor) -> Dict[str, float]:
        out: Dict[str, float] = {}
        per_expert = self.per_expert if self.per_expert is not None else counts.numel() <= PER_EXPERT_LIMIT
        for layer, row in enumerate(counts.double()):
            even = float(row.sum()) / row.numel()
            out[f"experts/layer{layer}/max_load"] = float(row.max()) / even if even else 0.0
            out[f"experts/layer{layer}/min_load"] = float(row.min()) / even if even else 0.0
            out[f"experts/layer{layer}/idle"] = float((row == 0).sum())
            if per_expert:
                out.update({f"experts/layer{layer}/expert{e}": float(v) for e, v in enumerate(row)})
        return out

    def _track(self, counts: torch.Tensor, trainer: Any) -> None:
        if self.idle is None or self.idle.shape != counts.shape:
            self.idle = torch.zeros(counts.shape, dtype=torch.long)
        self.idle = torch.where(counts == 0, self.idle + 1, torch.zeros_like(self.idle))
        dead = [(int(layer), int(e)) for layer, e in (self.idle >= self.dead_after).nonzero().tolist()]
        new = [d for d in dead if d not in self.warned]
        self.warned.update(new)
        if new and getattr(trainer, "is_global_zero", True):
            named = ", ".join(f"layer {layer} expert {e}" for layer, e in new[:8]) + (" ..." if len(new) > 8 else "")
            warnings.warn(
                f"Dead experts at step {trainer.global_step}: {named} received no token in the last "
                f"{self.dead_after} optimizer steps, so their weights no longer train. Raise the load-balancing "
                "loss's weight (router_aux_loss_coef), lower the learning rate of the router, or check the data.",
                stacklevel=2,
            )

    def state_dict(self) -> dict:
        return {"idle": None if self.idle is None else self.idle.tolist(), "warned": sorted(self.warned)}

    def load_state_dict(self, state: dict) -> None:
        idle = state.get("idle")
        self.idle = None if idle is None else torch.tensor(idle, dtype=torch.long)
        self.warned = {tuple(w) for w in state.get("warned", [])}


def attach_monitor(callbacks: List[Any], module: Any) -> None:
    """Append an ExpertLoadMonitor to `callbacks` (in place) when `module` keeps an ExpertLoad (a mixture-of-
    experts model: the bundled GPTMoE, a Hugging Face MoE in the recipes) and none is there yet."""
    if expert_loads(module) and not any(isinstance(c, ExpertLoadMonitor) for c in callbacks):
        callbacks.append(ExpertLoadMonitor())

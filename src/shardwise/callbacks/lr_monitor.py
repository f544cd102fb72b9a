# LearningRateMonitor: logs each optimizer's learning rate so schedules can be checked
# against the loss curve. Keys follow Lightning's so existing dashboards keep working:
# "lr-<OptimizerClass>" (or the scheduler config's "name"), "-1", "-2" suffixes when
# names repeat, and "/pg<i>" (1-based, or the param group's "name") when an
# optimizer has several param groups. With logging_interval="step" it logs just
# before every optimizer step (the rate that step uses), with "epoch" at each epoch
# start, and with None each scheduler at its own interval ("step" or "epoch");
# optimizers without a scheduler are then logged at every step.
from __future__ import annotations

from typing import Any

__all__ = ["LearningRateMonitor"]


def _value(x: Any) -> float:
    return float(x.item() if hasattr(x, "item") else x)


class LearningRateMonitor:
    def __init__(self, logging_interval: str | None = None, log_momentum: bool = False, log_weight_decay: bool = False):
        if logging_interval not in (None, "step", "epoch"):
            raise ValueError(
                f"LearningRateMonitor(logging_interval={logging_interval!r}): expected 'step', 'epoch' or None"
            )
        self.logging_interval = logging_interval
        self.log_momentum = log_momentum
        self.log_weight_decay = log_weight_decay
        self._entries: list[tuple[Any, dict | None, str]] = []  # (optimizer, scheduler config, name)
        self._last_step = -1
        self.last_logged: dict[str, float] = {}

    def on_train_start(self, trainer: Any, module: Any) -> None:
        if not getattr(trainer, "loggers", None):
            raise ValueError(
                "LearningRateMonitor needs a logger: pass Trainer(logger=...) "
                "(the default, logger=True, works) or remove the callback."
            )
        strategy = trainer.strategy
        configs = list(getattr(strategy, "lr_schedulers", None) or [])
        entries, seen = [], {}
        for opt in strategy.optimizers:
            config = next((c for c in configs if getattr(c.get("scheduler"), "optimizer", None) is opt), None)
            name = (config or {}).get("name") or f"lr-{type(opt).__name__}"
            count = seen.get(name, 0)
            seen[name] = count + 1
            entries.append((opt, config, name if count == 0 else f"{name}-{count}"))
        self._entries = entries
        self._last_step = -1

    def on_before_optimizer_step(self, trainer: Any, module: Any, optimizer: Any) -> None:
        # Called once per optimizer; log all of them once per global step.
        if self.logging_interval == "epoch" or trainer.global_step == self._last_step:
            return
        self._last_step = trainer.global_step
        self._log(trainer, "step")

    def on_train_epoch_start(self, trainer: Any, module: Any) -> None:
        if self.logging_interval != "step":
            self._log(trainer, "epoch")

    def _log(self, trainer: Any, interval: str) -> None:
        stats = self.extract(interval)
        if stats:
            self.last_logged = stats
            trainer.log_metrics(stats, step=trainer.global_step)

    def extract(self, interval: str) -> dict[str, float]:
        stats: dict[str, float] = {}
        for opt, config, name in self._entries:
            if self.logging_interval is None:
                own = config.get("interval", "epoch") if config is not None else "step"
                if own != interval:
                    continue
            groups = opt.param_groups
            for i, group in enumerate(groups):
                key = name if len(groups) == 1 else f"{name}/{group.get('name') or f'pg{i + 1}'}"
                stats[key] = _value(group["lr"])
                if self.log_momentum:
                    momentum = group.get("momentum", group.get("betas", (None,))[0])
                    if momentum is not None:
                        stats[f"{key}-momentum"] = _value(momentum)
                if self.log_weight_decay and "weight_decay" in group:
                    stats[f"{key}-weight_decay"] = _value(group["weight_decay"])
        return stats

    def state_dict(self) -> dict:
        return {}

    def load_state_dict(self, state: dict) -> None:
        pass

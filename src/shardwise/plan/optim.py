"""The optimizer the planner traces, as it will run on the target device.

What moves the peak is not only "Adam" but its implementation:
- `foreach` (PyTorch's default on CUDA for Adam / AdamW / SGD when every
  parameter is on CUDA and `fused` is not set) makes its temporaries for the
  whole parameter list at once: one parameter-sized fp32 list for Adam's
  `sqrt(v)`, 16 GiB per GPU for a 70B model on 16 GPUs;
- the for-loop (`foreach=False`, PyTorch's default on CPU) makes them one
  parameter at a time: the largest parameter's size;
- `fused=True` runs one kernel per group: no temporaries;
- bitsandbytes' paged optimizers (`paged_adamw_32bit`, `paged_adamw_8bit`)
  keep their state in CUDA unified memory, which the driver pages out to
  the host under memory pressure: counted as `paged_resident` (default 0) of
  its size on the device. Their update is one fused kernel (no temporaries);
- 8-bit state (`adamw_8bit`, `paged_adamw_8bit`): two uint8 moments, 2 bytes
  per parameter instead of 8 (the per-block absmax scales add ~0.2%).
bitsandbytes is not needed: its optimizers are traced as a fused torch AdamW
(same state shapes, no temporaries), and the state is scaled.

`OptimizerChoice.apply(optimizer)` sets the implementation on an optimizer a
`configure_optimizers` built (the user's own included): an explicit choice
wins; otherwise, on a CUDA target, groups that left both `foreach` and
`fused` unset get `foreach=True`, which is what PyTorch picks there (on the
CPU it picks the for-loop, which is what a CPU trace runs anyway).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Optional

from shardwise.plan.errors import PlanError

# name -> (torch optimizer the LMModule builds, foreach, fused, state bytes per fp32-Adam byte, paged)
_NAMES = {
    "adamw": ("adamw", None, None, 1.0, False),
    "adam": ("adam", None, None, 1.0, False),
    "sgd": ("sgd", None, None, 1.0, False),
    "adamw_foreach": ("adamw", True, None, 1.0, False),
    "adamw_forloop": ("adamw", False, None, 1.0, False),
    "adamw_fused": ("adamw", None, True, 1.0, False),
    "adamw_torch": ("adamw", None, None, 1.0, False),  # Hugging Face TrainingArguments spellings
    "adamw_torch_fused": ("adamw", None, True, 1.0, False),
    "paged_adamw_32bit": ("adamw", None, True, 1.0, True),
    "paged_adamw": ("adamw", None, True, 1.0, True),
    "paged_adamw_8bit": ("adamw", None, True, 0.25, True),
    "adamw_8bit": ("adamw", None, True, 0.25, False),
    "adamw_bnb_8bit": ("adamw", None, True, 0.25, False),
}


def optimizer_names() -> list:
    return sorted(_NAMES)


@dataclass(frozen=True)
class OptimizerChoice:
    """What the trace builds and how its state is counted."""

    name: str = "adamw"
    base: str = "adamw"  # adamw | adam | sgd (what LMModule.configure_optimizers builds)
    foreach: Optional[bool] = None
    fused: Optional[bool] = None
    state_scale: float = 1.0  # device-resident optimizer-state bytes per traced byte
    paged: bool = False
    target: str = "cuda"

    @property
    def implementation(self) -> str:
        """foreach | fused | for-loop, as it will run on the target."""
        if self.fused:
            return "fused"
        if self.foreach or (self.foreach is None and self.target == "cuda"):
            return "foreach"
        return "for-loop"

    def describe(self) -> str:
        parts = [f"{self.name} ({self.implementation}"]
        if self.paged:
            parts.append(f", paged state {self.state_scale:.0%} resident on the device")
        elif self.state_scale != 1.0:
            parts.append(f", 8-bit state: {self.state_scale:g}x fp32 Adam's")
        return "".join(parts) + ")"

    def apply(self, optimizer: Any) -> Any:
        """Set the implementation on a built optimizer (its groups' foreach / fused), as the target would run it."""
        for group in getattr(optimizer, "param_groups", ()):
            if "foreach" not in group and "fused" not in group:
                continue
            if self.fused is not None or self.foreach is not None:
                if "fused" in group:
                    group["fused"] = bool(self.fused)
                if "foreach" in group:
                    group["foreach"] = None if self.fused else self.foreach
            elif self.target == "cuda" and group.get("foreach") is None and not group.get("fused"):
                group["foreach"] = True
        # torch caches "any group fused" at construction; keep it in step with the groups.
        if hasattr(optimizer, "defaults"):
            if self.fused is not None and "fused" in optimizer.defaults:
                optimizer.defaults["fused"] = bool(self.fused)
        return optimizer


def resolve_optimizer(
    name: str,
    foreach: Optional[bool] = None,
    fused: Optional[bool] = None,
    paged_resident: float = 0.0,
    target: str = "cuda",
) -> OptimizerChoice:
    key = (name or "adamw").lower().replace("-", "_").strip()
    if key not in _NAMES:
        raise PlanError(f"Unknown optimizer {name!r}; known: {', '.join(optimizer_names())}.")
    if foreach and fused:
        raise PlanError("foreach=True and fused=True: PyTorch takes one implementation; choose one.")
    if not 0.0 <= paged_resident <= 1.0:
        raise PlanError(f"paged_resident={paged_resident!r}: a fraction of the paged state, 0 to 1.")
    base, f_each, f_used, scale, paged = _NAMES[key]
    if foreach is not None or fused is not None:
        if paged or scale != 1.0:
            raise PlanError(f"{name} is a bitsandbytes optimizer (one fused kernel): foreach / fused do not apply.")
        f_each, f_used = foreach, fused
    if paged:
        scale *= paged_resident
    return OptimizerChoice(
        name=key, base=base, foreach=f_each, fused=f_used, state_scale=scale, paged=paged, target=target
    )


__all__ = ["OptimizerChoice", "resolve_optimizer", "optimizer_names"]

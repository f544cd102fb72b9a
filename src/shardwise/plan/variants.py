"""Optimizer variants that change the verdict, tried without being asked.

A user planning full fine-tuning with AdamW rarely thinks of asking for
bitsandbytes' 8-bit or paged AdamW, yet at 70B they are often the difference
between "nothing fits" and a plan (Hugging Face's Llama-2-70B recipe needs
paged_adamw_32bit on one node). So when the verdict leaves something on the
table -- nothing fits, or a configuration faster than the recommendation was
passed over for memory -- the planner re-plans those configurations with
each variant it knows (optim.py: 8-bit state is 2 bytes per parameter, paged
state lives in host-backed unified memory) and reports each variant whose
best fitting configuration is a different, better answer: it fits where
nothing did, or it is faster than the recommendation. The variants are
reported beside the plan (`Plan.variants`, a note), never silently chosen:
they change the optimizer's numerics and add a dependency.
ZeRO rows are left out (DeepSpeed builds its own optimizer from its config),
and so are a user's TrainModule (its own optimizer is traced as written) and
adapter plans (their optimizer state is already small).
"""

from __future__ import annotations

from typing import Any, Callable, Dict, List, Optional, Tuple

from shardwise.memory import format_bytes
from shardwise.plan.recommend import TIE_TOLERANCE, format_seconds

VARIANTS = ("adamw_8bit", "paged_adamw_32bit")  # bitsandbytes; the 8-bit paged one adds nothing on the device
_FROM = ("adamw", "adam", "adamw_foreach", "adamw_forloop", "adamw_fused", "adamw_torch", "adamw_torch_fused")


def worth_trying(optimizer_name: str, estimates: List[Any], best: Optional[Any], spec_kind: str, adapters: Any) -> bool:
    """Whether a variant could change the verdict (and the plan's optimizer is one a variant replaces)."""
    if spec_kind == "module" or adapters is not None or optimizer_name not in _FROM:
        return False
    judged = [e for e in estimates if e.fits is not None]
    if not judged:
        return False
    return best is None or any(not e.fits and e.step_seconds < best.step_seconds for e in judged)


def candidates_to_retry(estimates: List[Any], best: Optional[Any], traced: Callable[[Any], bool]) -> List[Any]:
    """Configurations (without batch split) a variant could make the answer: faster than `best`, or all."""
    out: List[Any] = []
    for e in estimates:
        c = e.candidate
        if not traced(c) or (best is not None and e.step_seconds >= best.step_seconds * (1 - TIE_TOLERANCE)):
            continue
        key = c.config_key
        if key not in out:
            out.append(key)
    return out


def try_variants(
    replan: Callable[[str, List[Any]], Tuple[Optional[Any], List[Any]]],
    cands: List[Any],
    best: Optional[Any],
) -> Tuple[List[Dict[str, Any]], List[str]]:
    """Re-plan `cands` with each variant; (records of the variants that change the verdict, notes)."""
    records: List[Dict[str, Any]] = []
    notes: List[str] = []
    if not cands:
        return records, notes
    for name in VARIANTS:
        choice, _ = replan(name, cands)
        if choice is None:
            continue
        if best is not None and choice.step_seconds >= best.step_seconds * (1 - TIE_TOLERANCE):
            continue
        gain = (
            "fits where nothing else does"
            if best is None
            else f"is {best.step_seconds / choice.step_seconds - 1:.0%} faster than the recommendation"
        )
        records.append(
            dict(
                optimizer=name,
                label=choice.label,
                candidate=choice.candidate.to_dict(),
                reserved=choice.reserved,
                allocated=choice.allocated,
                step_seconds=choice.step_seconds,
                cpu_per_node=choice.cpu_per_node,
            )
        )
        notes.append(
            f"With --optimizer {name} (bitsandbytes), {choice.label} {gain}: {format_bytes(choice.reserved)} "
            f"reserved, est. {format_seconds(choice.step_seconds)} per step. It changes the optimizer's "
            "numerics; plan it with --optimizer to see every row."
        )
    return records, notes


__all__ = ["VARIANTS", "worth_trying", "candidates_to_retry", "try_variants"]

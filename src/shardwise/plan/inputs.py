"""The planner's inputs checked before anything is traced: counts, sizes, precision, sequence length.

Every mistake a user can fix is a PlanError naming the value and what to use
instead; the checked layout (world size, sequence length, memory sizes in
bytes, reserved factor) is what `plan()` goes on with.
"""

from __future__ import annotations

from typing import Any, Optional, Tuple

from shardwise.memory import parse_bytes
from shardwise.plan.errors import PlanError
from shardwise.plan.presets import ModelSpec
from shardwise.precision import build_precision


def validate_inputs(
    spec: ModelSpec,
    batch_size: int,
    seq_len: Optional[int],
    devices: int,
    num_nodes: int,
    device_memory: Any,
    cpu_memory: Any,
    precision: str,
    accelerator: str,
    reserved_factor: Optional[float],
) -> Tuple[int, int, Optional[int], Optional[int], Optional[float]]:
    """(world size, sequence length, device memory, cpu memory, reserved factor), or a PlanError."""
    for name, value in (("devices", devices), ("num_nodes", num_nodes), ("batch_size", batch_size)):
        if not isinstance(value, int) or value < 1:
            raise PlanError(f"{name}={value!r}: use a positive integer.")
    if accelerator not in ("cuda", "cpu"):
        raise PlanError(f"accelerator={accelerator!r}: plan for 'cuda' (GPUs) or 'cpu'.")
    try:
        build_precision(precision, accelerator)
    except ValueError as exc:
        raise PlanError(str(exc)) from exc

    def size(value: Any, what: str) -> Optional[int]:
        if value is None:
            return None
        try:
            return parse_bytes(value)
        except (ValueError, TypeError) as exc:
            raise PlanError(f"{what}={value!r} is not a memory size. {exc}") from exc

    dev_mem, cpu_mem = size(device_memory, "device_memory"), size(cpu_memory, "cpu_memory")
    if seq_len is None:
        seq_len = spec.default_seq_len
    if not isinstance(seq_len, int) or seq_len < 1:
        raise PlanError(f"seq_len={seq_len!r}: use a positive integer.")
    if spec.kind == "gpt" and seq_len > spec.config.block_size:
        longer = " The presets llama-3.1-8b / llama-3.1-70b have 131072." if spec.name.startswith("llama-3") else ""
        raise PlanError(f"seq_len={seq_len} exceeds {spec.name}'s context length {spec.config.block_size}.{longer}")
    if reserved_factor is not None and not reserved_factor >= 1.0:
        raise PlanError(
            f"reserved_factor={reserved_factor!r}: the allocator reserves at least what is allocated (>= 1)."
        )
    factor = None if reserved_factor is None else float(reserved_factor)
    return devices * num_nodes, seq_len, dev_mem, cpu_mem, factor


__all__ = ["validate_inputs"]

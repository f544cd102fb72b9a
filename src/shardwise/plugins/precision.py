"""Lightning's precision plugins, refused by name: precision is the Trainer's `precision=` argument here."""

from __future__ import annotations

from shardwise.utilities.refusal import build_refused_class

_USE = (
    "pass Trainer(precision=...) instead: '32-true', '64-true', 'bf16-mixed', '16-mixed', 'bf16-true' or "
    "'16-true' (under FSDP and DeepSpeed the strategy applies it in its own way)"
)
Precision = build_refused_class("Precision", __name__, _USE)
MixedPrecision = build_refused_class("MixedPrecision", __name__, _USE)
HalfPrecision = build_refused_class("HalfPrecision", __name__, _USE)
DoublePrecision = build_refused_class("DoublePrecision", __name__, _USE)
FSDPPrecision = build_refused_class("FSDPPrecision", __name__, _USE)
DeepSpeedPrecision = build_refused_class("DeepSpeedPrecision", __name__, _USE)
BitsandbytesPrecision = build_refused_class(
    "BitsandbytesPrecision",
    __name__,
    "4-bit / 8-bit base weights are QLoRA here: `shardwise finetune --load_in_4bit true` with LoRA adapters",
)
TransformerEnginePrecision = build_refused_class(
    "TransformerEnginePrecision", __name__, "FP8 training is not supported; use precision='bf16-mixed'"
)
XLAPrecision = build_refused_class("XLAPrecision", __name__, "shardwise runs on CPUs and CUDA GPUs, not XLA")

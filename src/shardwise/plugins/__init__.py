"""`shardwise.plugins`: Lightning's plugin names, importable so a ported script's imports work, each refused.

shardwise has no plugin objects: precision is `Trainer(precision=...)` (or the
strategy's), checkpoint I/O belongs to the strategy, the launch environment is
read from the launcher's variables, and layer synchronisation is
`Trainer(sync_batchnorm=True)`. Building any of these names raises
NotProvidedError saying which of those to use.
"""

from __future__ import annotations

from shardwise.plugins.environments import ClusterEnvironment, SLURMEnvironment  # noqa: F401
from shardwise.plugins.precision import (  # noqa: F401
    BitsandbytesPrecision,
    DeepSpeedPrecision,
    DoublePrecision,
    FSDPPrecision,
    HalfPrecision,
    MixedPrecision,
    Precision,
    TransformerEnginePrecision,
    XLAPrecision,
)
from shardwise.utilities.refusal import build_refused_class

_CHECKPOINT_IO = (
    "the strategy writes its own checkpoint format (one file or a DCP directory, checksummed); "
    "FSDPStrategy(async_save=True) saves in the background"
)
_SYNC = "use Trainer(sync_batchnorm=True)"
CheckpointIO = build_refused_class("CheckpointIO", __name__, _CHECKPOINT_IO)
TorchCheckpointIO = build_refused_class("TorchCheckpointIO", __name__, _CHECKPOINT_IO)
AsyncCheckpointIO = build_refused_class("AsyncCheckpointIO", __name__, _CHECKPOINT_IO)
XLACheckpointIO = build_refused_class("XLACheckpointIO", __name__, "shardwise runs on CPUs and CUDA GPUs, not XLA")
LayerSync = build_refused_class("LayerSync", __name__, _SYNC)
TorchSyncBatchNorm = build_refused_class("TorchSyncBatchNorm", __name__, _SYNC)

__all__ = [
    "AsyncCheckpointIO",
    "BitsandbytesPrecision",
    "CheckpointIO",
    "DeepSpeedPrecision",
    "DoublePrecision",
    "FSDPPrecision",
    "HalfPrecision",
    "LayerSync",
    "MixedPrecision",
    "Precision",
    "TorchCheckpointIO",
    "TorchSyncBatchNorm",
    "TransformerEnginePrecision",
    "XLACheckpointIO",
    "XLAPrecision",
]

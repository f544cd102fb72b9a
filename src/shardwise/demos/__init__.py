"""`shardwise.demos`: Lightning's demos module (`lightning.pytorch.demos`) after the import rename, and the pieces
the `shardwise demo` command and the seed examples use.

Lightning's names are Lightning's classes: `Transformer`, `WikiText2` and `LightningTransformer`
(`demos.transformer`), `SimpleLSTM`, `SequenceSampler` and `LightningLSTM` (`demos.lstm`), `BoringModel`,
`BoringDataModule`, `DemoModel` and the random datasets (`demos.boring_classes`); `demos.mnist_datamodule`
is refused by name (it downloads). Nothing here downloads. shardwise's own: `PythonDocsText` (an offline
corpus from CPython's help texts), `load_text_dataset`, and `LanguageModel`, which trains shardwise's causal
demo model (`shardwise.models.Transformer`).
"""

from shardwise.demos.boring_classes import BoringDataModule, BoringModel, DemoModel
from shardwise.demos.lstm import LightningLSTM, SequenceSampler, SimpleLSTM
from shardwise.demos.transformer import (
    Dictionary,
    LanguageModel,
    LightningTransformer,
    PythonDocsText,
    TokenBlocks,
    Transformer,
    WikiText2,
    load_text_dataset,
)

__all__ = [
    "BoringDataModule",
    "BoringModel",
    "DemoModel",
    "Dictionary",
    "LanguageModel",
    "LightningLSTM",
    "LightningTransformer",
    "PythonDocsText",
    "SequenceSampler",
    "SimpleLSTM",
    "TokenBlocks",
    "Transformer",
    "WikiText2",
    "load_text_dataset",
]

"""`lightning.pytorch.core` after the import rename: `from shardwise.core import LightningModule` (as Lightning's
examples write it) gives the TrainModule, and LightningDataModule the DataModule, the same classes as at the
package root."""

from shardwise.module import DataModule, TrainModule

LightningModule = TrainModule
LightningDataModule = DataModule

__all__ = ["LightningModule", "LightningDataModule"]

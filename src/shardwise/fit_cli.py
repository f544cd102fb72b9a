"""`shardwise fit`: train a TrainModule class from a YAML config or flags, no script needed.

The schema is the signatures themselves (jsonargparse): `model` is any
TrainModule subclass given by class path and init args, `data` any Dataset,
`trainer` every Trainer argument. Example config:

    model:
      class_path: mypkg.LanguageModel
      init_args: {vocab_size: 8832}
    data:
      class_path: shardwise.demos.PythonDocsText
      init_args: {block_size: 64}
    batch_size: 8
    trainer: {devices: 2, strategy: fsdp, max_steps: 100}

    shardwise fit --config run.yaml --trainer.precision bf16-mixed
"""
from __future__ import annotations

from typing import List, Optional


def main(argv: Optional[List[str]] = None) -> int:
    from jsonargparse import ActionConfigFile, ArgumentParser
    from torch.utils.data import DataLoader, Dataset

    from shardwise import TrainModule, Trainer, seed_everything

    parser = ArgumentParser(prog="shardwise fit", description="Train a TrainModule from a config.")
    parser.add_argument("--config", action=ActionConfigFile, help="YAML file with any of the options below")
    parser.add_subclass_arguments(TrainModule, "model", required=True, help="the TrainModule to train")
    parser.add_subclass_arguments(Dataset, "data", required=True, help="training Dataset")
    parser.add_subclass_arguments(Dataset, "val_data", required=False, help="validation Dataset")
    parser.add_argument("--batch_size", type=int, default=8)
    parser.add_argument("--shuffle", type=bool, default=True)
    parser.add_argument("--seed", type=Optional[int], default=42)
    parser.add_argument("--ckpt_path", type=Optional[str], default=None, help='"last" or a checkpoint path')
    parser.add_class_arguments(Trainer, "trainer")
    cfg = parser.parse_args(argv)
    if cfg.seed is not None:
        seed_everything(cfg.seed)
    init = parser.instantiate_classes(cfg)
    trainer: Trainer = init.trainer
    train = DataLoader(init.data, batch_size=cfg.batch_size, shuffle=cfg.shuffle)
    val = DataLoader(init.val_data, batch_size=cfg.batch_size) if init.get("val_data") is not None else None
    trainer.fit(init.model, train, val, ckpt_path=cfg.ckpt_path)
    return 0

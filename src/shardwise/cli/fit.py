"""`shardwise fit`: train a TrainModule class from a YAML config or flags, no script needed.

The schema is the signatures themselves: `model` is any TrainModule subclass
given by class path and init args, `data` any Dataset, `trainer` every Trainer
argument. Example config:

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

from typing import Any, Optional

from jsonargparse import ActionConfigFile, ArgumentParser


def parser() -> ArgumentParser:
    from torch.utils.data import Dataset

    from shardwise import Trainer, TrainModule

    p = ArgumentParser(description="Train a TrainModule from a config.")
    p.add_argument("--config", action=ActionConfigFile, help="YAML file with any of the options below")
    p.add_subclass_arguments(TrainModule, "model", required=True, help="the TrainModule to train")
    p.add_subclass_arguments(Dataset, "data", required=True, help="training Dataset")
    p.add_subclass_arguments(Dataset, "val_data", required=False, help="validation Dataset")
    p.add_argument("--batch_size", type=int, default=8, help="per-process batch size")
    p.add_argument("--shuffle", type=bool, default=True, help="shuffle the training data")
    p.add_argument("--seed", type=Optional[int], default=42, help="seed_everything(seed); null: no seeding")
    p.add_argument("--ckpt_path", type=Optional[str], default=None, help='resume: "last" or a checkpoint path')
    p.add_class_arguments(Trainer, "trainer")
    return p


def run(cfg: Any) -> int:
    from torch.utils.data import DataLoader

    from shardwise import seed_everything

    if cfg.seed is not None:
        seed_everything(cfg.seed)
    init = parser().instantiate_classes(cfg)
    train = DataLoader(init.data, batch_size=cfg.batch_size, shuffle=cfg.shuffle)
    val = DataLoader(init.val_data, batch_size=cfg.batch_size) if init.get("val_data") is not None else None
    init.trainer.fit(init.model, train, val, ckpt_path=cfg.ckpt_path)
    return 0

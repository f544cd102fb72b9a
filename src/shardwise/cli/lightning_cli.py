"""`shardwise.cli.LightningCLI`: Lightning's LightningCLI, on jsonargparse as Lightning's is, for scripts ported
by renaming their imports.

`LightningCLI(ModelClass, DataModuleClass, trainer_defaults=..., save_config_kwargs=..., run=..., args=...)`
builds one parser from the signatures: `--model.*` (the module's `__init__`), `--data.*` (the datamodule's),
`--trainer.*` (every Trainer argument), `--seed_everything`, `--optimizer` / `--lr_scheduler` (any
torch optimizer or scheduler, as `class_path` / `init_args` or the short form `--optimizer Adam
--optimizer.lr 0.01`), `--config file.yaml` and `--print_config`. With `run=True` (the default) the
first argument is a subcommand, `fit`, `validate`, `test` or `predict`, which also takes that Trainer
method's own arguments (`--ckpt_path`, ...) and runs it; with `run=False` the script calls the Trainer
itself. `cli.model`, `cli.datamodule`, `cli.trainer`, `cli.config`, `cli.config_init` and
`cli.subcommand` are Lightning's attributes; `model_class=None` or `subclass_mode_model=True` takes any
TrainModule by class path (likewise the datamodule). The config of a fit is saved as `config.yaml` in
the run's log folder (SaveConfigCallback, `save_config_kwargs={"overwrite": True}`). A `--ckpt_path`
naming a checkpoint gives the module the hyper-parameters saved in it, as Lightning does.

One difference: an optimizer given on the command line is built inside `configure_optimizers`, from the
parameters the module has then (after `configure_model` and sharding), where Lightning builds it from
`model.parameters()` when the CLI starts, which a module that builds its layers in `configure_model`
does not have yet.
"""

from __future__ import annotations

import importlib
import os
import sys
from types import MethodType
from typing import Any, Dict, List, Optional, Tuple, Type, Union

import torch
from jsonargparse import ActionConfigFile, ArgumentParser, Namespace
from torch.optim import Optimizer
from torch.optim.lr_scheduler import LRScheduler

from shardwise._version import __version__
from shardwise.checkpoint.reader import open_checkpoint
from shardwise.module import DataModule, TrainModule
from shardwise.seed import seed_everything
from shardwise.trainer import Trainer

__all__ = ["LightningArgumentParser", "LightningCLI", "ReduceLROnPlateau", "SaveConfigCallback", "instantiate_class"]

ArgsType = Optional[Union[List[str], Dict[str, Any], Namespace]]
SUBCOMMANDS: Dict[str, set] = {  # each subcommand's Trainer method, less what the CLI passes itself
    "fit": {"model", "train_dataloaders", "val_dataloaders", "datamodule"},
    "validate": {"model", "dataloaders", "datamodule"},
    "test": {"model", "dataloaders", "datamodule"},
    "predict": {"model", "dataloaders", "datamodule"},
}


class ReduceLROnPlateau(torch.optim.lr_scheduler.ReduceLROnPlateau):
    """torch's ReduceLROnPlateau with the metric it watches (`monitor`), so a config can name both."""

    def __init__(self, optimizer: Optimizer, monitor: str, *args: Any, **kwargs: Any) -> None:
        super().__init__(optimizer, *args, **kwargs)
        self.monitor = monitor


SCHEDULERS = (LRScheduler, torch.optim.lr_scheduler.ReduceLROnPlateau)


def instantiate_class(args: Any, init: Dict[str, Any]) -> Any:
    """`class_path(*args, **init_args)` from a `{"class_path", "init_args"}` mapping (Lightning's helper)."""
    if isinstance(init, Namespace):
        init = init.as_dict()
    module_name, _, class_name = init["class_path"].rpartition(".")
    cls = getattr(importlib.import_module(module_name), class_name)
    args = args if isinstance(args, tuple) else (args,)
    return cls(*args, **(init.get("init_args") or {}))


def _built(value: Any) -> Any:
    """Trainer values typed loosely (callbacks, logger, plugins): `class_path` specs become objects."""
    if isinstance(value, Namespace):
        value = value.as_dict()
    if isinstance(value, list):
        return [_built(v) for v in value]
    if isinstance(value, dict) and "class_path" in value:
        return instantiate_class((), value)
    return value


class LightningArgumentParser(ArgumentParser):
    """jsonargparse's parser with Lightning's helpers for its classes, optimizers and schedulers."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        kwargs.setdefault("dump_header", [f"shardwise=={__version__}"])
        super().__init__(*args, **kwargs)
        self._optimizers: Dict[str, Tuple[Any, str]] = {}
        self._lr_schedulers: Dict[str, Tuple[Any, str]] = {}

    def add_lightning_class_args(
        self, lightning_class: Any, nested_key: str, subclass_mode: bool = False, required: bool = True
    ) -> List[str]:
        """The class's `__init__` arguments under `nested_key` (any subclass of it by class path in subclass mode)."""
        if subclass_mode:
            return self.add_subclass_arguments(lightning_class, nested_key, fail_untyped=False, required=required)
        is_trainer = isinstance(lightning_class, type) and issubclass(lightning_class, Trainer)
        return self.add_class_arguments(
            lightning_class, nested_key, fail_untyped=False, instantiate=not is_trainer, sub_configs=True
        )

    def add_optimizer_args(
        self, optimizer_class: Any = (Optimizer,), nested_key: str = "optimizer", link_to: str = "AUTOMATIC"
    ) -> None:
        """An optimizer's arguments (all but `params`), built by the CLI when `link_to` is AUTOMATIC."""
        self._add_built_later(optimizer_class, nested_key, {"params"})
        self._optimizers[nested_key] = (optimizer_class, link_to)

    def add_lr_scheduler_args(
        self, lr_scheduler_class: Any = SCHEDULERS, nested_key: str = "lr_scheduler", link_to: str = "AUTOMATIC"
    ) -> None:
        """A scheduler's arguments (all but `optimizer`), built by the CLI when `link_to` is AUTOMATIC."""
        self._add_built_later(lr_scheduler_class, nested_key, {"optimizer"})
        self._lr_schedulers[nested_key] = (lr_scheduler_class, link_to)

    def _add_built_later(self, cls: Any, nested_key: str, skip: set) -> None:
        options = dict(instantiate=False, fail_untyped=False, skip=skip)
        if isinstance(cls, tuple):
            self.add_subclass_arguments(cls, nested_key, required=False, **options)
        else:
            self.add_class_arguments(cls, nested_key, **options)


class SaveConfigCallback:
    """Writes the run's config to `<trainer.log_dir>/config.yaml` when fit (or another stage) sets up, on rank 0.

    An existing file is an error unless `overwrite=True`: it belongs to an earlier run in the same folder.
    """

    def __init__(
        self,
        parser: LightningArgumentParser,
        config: Namespace,
        config_filename: str = "config.yaml",
        overwrite: bool = False,
        multifile: bool = False,
        save_to_log_dir: bool = True,
    ) -> None:
        self.parser, self.config, self.config_filename = parser, config, config_filename
        self.overwrite, self.multifile, self.save_to_log_dir = overwrite, multifile, save_to_log_dir
        self.already_saved = False
        if not save_to_log_dir and type(self).save_config is SaveConfigCallback.save_config:
            raise ValueError(
                "SaveConfigCallback(save_to_log_dir=False) saves nothing: subclass it and implement save_config(), "
                "or pass LightningCLI(save_config_callback=None)."
            )

    def setup(self, trainer: Any, pl_module: Any, stage: str) -> None:
        if self.already_saved:
            return
        if self.save_to_log_dir:
            log_dir = trainer.log_dir
            config_path = os.path.join(log_dir, self.config_filename)
            if not self.overwrite:
                exists = trainer.strategy.broadcast(os.path.isfile(config_path) if trainer.is_global_zero else False)
                if exists:
                    raise RuntimeError(
                        f"SaveConfigCallback: {config_path} exists (an earlier run's config). Delete it, pass "
                        'LightningCLI(save_config_kwargs={"overwrite": True}) to overwrite it, or '
                        "LightningCLI(save_config_callback=None) not to save the config."
                    )
            if trainer.is_global_zero:
                os.makedirs(log_dir, exist_ok=True)
                self.parser.save(self.config, config_path, overwrite=self.overwrite, multifile=self.multifile)
        if trainer.is_global_zero:
            self.save_config(trainer, pl_module, stage)
            self.already_saved = True
        self.already_saved = trainer.strategy.broadcast(self.already_saved)

    def save_config(self, trainer: Any, pl_module: Any, stage: str) -> None:
        """Override to save the config somewhere else too (rank 0 only: no collectives here)."""


class LightningCLI:
    """Lightning's command line for a module and a datamodule: parse, seed, build, and run a subcommand."""

    def __init__(
        self,
        model_class: Optional[Type[TrainModule]] = None,
        datamodule_class: Optional[type] = None,
        save_config_callback: Optional[Type[SaveConfigCallback]] = SaveConfigCallback,
        save_config_kwargs: Optional[Dict[str, Any]] = None,
        trainer_class: Type[Trainer] = Trainer,
        trainer_defaults: Optional[Dict[str, Any]] = None,
        seed_everything_default: Union[bool, int] = True,
        parser_kwargs: Optional[Dict[str, Any]] = None,
        parser_class: Type[LightningArgumentParser] = LightningArgumentParser,
        subclass_mode_model: bool = False,
        subclass_mode_data: bool = False,
        args: ArgsType = None,
        run: bool = True,
        auto_configure_optimizers: bool = True,
        load_from_checkpoint_support: bool = True,
    ) -> None:
        del load_from_checkpoint_support  # load_from_checkpoint rebuilds from the saved hyper-parameters anyway
        self.save_config_callback = save_config_callback
        self.save_config_kwargs = save_config_kwargs or {}
        self.trainer_class = trainer_class
        self.trainer_defaults = trainer_defaults or {}
        self.seed_everything_default = seed_everything_default
        self.parser_kwargs = parser_kwargs or {}
        self.parser_class = parser_class
        self.auto_configure_optimizers = auto_configure_optimizers
        self.model_class, self._model_class = model_class, model_class or TrainModule
        self.subclass_mode_model = model_class is None or subclass_mode_model
        self.datamodule_class, self._datamodule_class = datamodule_class, datamodule_class or DataModule
        self.subclass_mode_data = datamodule_class is None or subclass_mode_data

        main_kwargs = {k: v for k, v in self.parser_kwargs.items() if k not in SUBCOMMANDS}
        self.parser = self.init_parser(**main_kwargs)
        self._subcommand_parsers: Dict[str, LightningArgumentParser] = {}
        self._subcommand_method_arguments: Dict[str, List[str]] = {}
        if run:
            subcommands = self.parser.add_subcommands()
            for name in SUBCOMMANDS:
                kwargs = dict(self.parser_kwargs.get(name, {}))
                kwargs.setdefault("description", _first_line(getattr(trainer_class, name).__doc__))
                sub = self.init_parser(**kwargs)
                self._add_arguments(sub)
                self._subcommand_method_arguments[name] = sub.add_method_arguments(
                    trainer_class, name, skip=set(SUBCOMMANDS[name]), fail_untyped=False
                )
                self._subcommand_parsers[name] = sub
                subcommands.add_subcommand(name, sub, help=kwargs["description"])
        else:
            self._add_arguments(self.parser)
        if isinstance(args, (dict, Namespace)):
            self.config = self.parser.parse_object(args)
        else:
            self.config = self.parser.parse_args(_torch_short_names(sys.argv[1:] if args is None else list(args)))
        self.subcommand: Optional[str] = self.config["subcommand"] if run else None
        self._parse_ckpt_path()
        self._set_seed()
        self.before_instantiate_classes()
        self.instantiate_classes()
        self.after_instantiate_classes()
        if self.subcommand is not None:
            self._run_subcommand(self.subcommand)

    # ------------------------------------------------------------------ the parser
    def init_parser(self, **kwargs: Any) -> LightningArgumentParser:
        parser = self.parser_class(**kwargs)
        parser.add_argument("-c", "--config", action=ActionConfigFile, help="a configuration file, YAML or JSON")
        return parser

    def add_arguments_to_parser(self, parser: LightningArgumentParser) -> None:
        """Override to add arguments of your own (or link some)."""

    def _add_arguments(self, parser: LightningArgumentParser) -> None:
        parser.add_argument(
            "--seed_everything",
            type=Union[bool, int],
            default=self.seed_everything_default,
            help="an int: seed_everything(it) before the classes are built; true: a random seed; false: none",
        )
        parser.add_lightning_class_args(self.trainer_class, "trainer")
        parser.set_defaults({f"trainer.{k}": v for k, v in self.trainer_defaults.items() if k != "callbacks"})
        parser.add_lightning_class_args(self._model_class, "model", subclass_mode=self.subclass_mode_model)
        parser.add_lightning_class_args(
            self._datamodule_class,
            "data",
            subclass_mode=self.subclass_mode_data,
            required=self.datamodule_class is not None,  # without one, the module's own loaders
        )
        self.add_arguments_to_parser(parser)
        if self.auto_configure_optimizers:
            if not parser._optimizers:
                parser.add_optimizer_args((Optimizer,))
            if not parser._lr_schedulers:
                parser.add_lr_scheduler_args(SCHEDULERS)
        for key, (_, link_to) in {**parser._optimizers, **parser._lr_schedulers}.items():
            if link_to != "AUTOMATIC":
                parser.link_arguments(key, link_to)

    def _parser(self, subcommand: Optional[str]) -> LightningArgumentParser:
        return self.parser if subcommand is None else self._subcommand_parsers[subcommand]

    def _get(self, config: Namespace, key: str, default: Any = None) -> Any:
        return config.get(str(self.subcommand), config).get(key, default)

    # ------------------------------------------------------------------ building
    def _parse_ckpt_path(self) -> None:
        """`--ckpt_path` naming a checkpoint: its saved hyper-parameters become the model's arguments, over the
        config and the command line (Lightning's order), so the module is built in the checkpoint's shape."""
        if not self.subcommand:
            return
        ckpt_path = self.config[self.subcommand].get("ckpt_path")
        if not ckpt_path or not os.path.exists(str(ckpt_path)):
            return  # "last", "best", or nothing: the Trainer resolves those
        hparams = open_checkpoint(str(ckpt_path)).trainer_state().get("hyper_parameters") or {}
        model = self.config[self.subcommand].get("model")
        if not hparams or model is None:
            return
        accepted = model.get("init_args", model) if self.subclass_mode_model else model
        known = {k: v for k, v in hparams.items() if k in accepted}  # only what the constructor takes
        if known:
            key = "model.init_args" if self.subclass_mode_model else "model"
            self.config = self.parser.parse_object({self.subcommand: {key: known}}, self.config)

    def _set_seed(self) -> None:
        seed = self._get(self.config, "seed_everything")
        if seed is False or seed is None:
            return
        seed = seed_everything(None if seed is True else seed, workers=True)
        (self.config[self.subcommand] if self.subcommand else self.config)["seed_everything"] = seed

    def before_instantiate_classes(self) -> None:
        """Override to run code before the classes are built."""

    def after_instantiate_classes(self) -> None:
        """Override to run code after the classes are built."""

    def instantiate_classes(self) -> None:
        parser = self._parser(self.subcommand)
        instantiate = getattr(parser, "instantiate", None) or parser.instantiate_classes  # jsonargparse < 4.49
        self.config_init = instantiate(self.config.get(str(self.subcommand), self.config))
        if self.subcommand is not None:  # keep Lightning's shape: config_init[subcommand] holds the objects
            self.config_init = Namespace({self.subcommand: self.config_init})
        self.datamodule = self._get(self.config_init, "data")
        self.model = self._get(self.config_init, "model")
        self._add_configure_optimizers_method_to_model(self.subcommand)
        self.trainer = self.instantiate_trainer()

    def instantiate_trainer(self, **kwargs: Any) -> Trainer:
        config = {k: _built(v) for k, v in dict(self._get(self.config_init, "trainer", Namespace())).items()}
        config.update(kwargs)
        callbacks = config.get("callbacks")
        callbacks = [] if callbacks is None else list(callbacks) if isinstance(callbacks, list) else [callbacks]
        defaults = self.trainer_defaults.get("callbacks")
        if defaults is not None:
            callbacks += defaults if isinstance(defaults, list) else [defaults]
        if self.save_config_callback is not None and not config.get("fast_dev_run", False):
            config_of_run = self.config.get(str(self.subcommand), self.config)
            callbacks.append(
                self.save_config_callback(self._parser(self.subcommand), config_of_run, **self.save_config_kwargs)
            )
        config["callbacks"] = callbacks
        return self.trainer_class(**config)

    @staticmethod
    def configure_optimizers(lightning_module: Any, optimizer: Optimizer, lr_scheduler: Any = None) -> Any:
        """What the module's configure_optimizers returns when the CLI gives the optimizer (override to change it)."""
        if lr_scheduler is None:
            return optimizer
        if isinstance(lr_scheduler, ReduceLROnPlateau):
            return {
                "optimizer": optimizer,
                "lr_scheduler": {"scheduler": lr_scheduler, "monitor": lr_scheduler.monitor},
            }
        return [optimizer], [lr_scheduler]

    def _add_configure_optimizers_method_to_model(self, subcommand: Optional[str]) -> None:
        """`--optimizer` / `--lr_scheduler` given: they replace the module's configure_optimizers (as in Lightning)."""
        if not self.auto_configure_optimizers:
            return
        parser = self._parser(subcommand)
        optimizers = [k for k, (_, link) in parser._optimizers.items() if link == "AUTOMATIC"]
        schedulers = [k for k, (_, link) in parser._lr_schedulers.items() if link == "AUTOMATIC"]
        if len(optimizers) > 1 or len(schedulers) > 1:
            raise ValueError(
                f"LightningCLI builds at most one optimizer and one scheduler itself; found {optimizers + schedulers}. "
                "Link the others (link_to=...) and return them from your module's configure_optimizers."
            )
        optimizer_init = self._get(self.config_init, optimizers[0]) if optimizers else None
        if not optimizer_init:
            return
        scheduler_init = self._get(self.config_init, schedulers[0]) if schedulers else None
        cli = self

        def configure_optimizers(module: Any) -> Any:
            # Built here, from the parameters the module has now: after configure_model and sharding.
            optimizer = instantiate_class(module.parameters(), optimizer_init)
            scheduler = instantiate_class(optimizer, scheduler_init) if scheduler_init else None
            return cli.configure_optimizers(module, optimizer, scheduler)

        self.model.configure_optimizers = MethodType(configure_optimizers, self.model)

    # ------------------------------------------------------------------ running
    def _run_subcommand(self, subcommand: str) -> None:
        before = getattr(self, f"before_{subcommand}", None)
        if callable(before):
            before()
        method = getattr(self, subcommand, getattr(self.trainer, subcommand))
        kwargs = {
            k: v for k, v in self.config_init[subcommand].items() if k in self._subcommand_method_arguments[subcommand]
        }
        kwargs["model"] = self.model
        if self.datamodule is not None:
            kwargs["datamodule"] = self.datamodule
        method(**kwargs)
        after = getattr(self, f"after_{subcommand}", None)
        if callable(after):
            after()


_SHORT_NAMES = {"--optimizer": torch.optim, "--lr_scheduler": torch.optim.lr_scheduler}


def _torch_short_names(argv: List[str]) -> List[str]:
    """`--optimizer Adam` means torch's Adam even when another package with an `Adam` is imported (bitsandbytes
    has one; jsonargparse would call the short name ambiguous); `--lr_scheduler ReduceLROnPlateau` means the
    one with `monitor`. Full class paths and JSON specs pass as they are."""
    out, i = [], 0
    while i < len(argv):
        arg = argv[i]
        key, eq, value = arg.partition("=")
        if key in _SHORT_NAMES and not eq and i + 1 < len(argv):
            out.append(arg)
            i += 1
            value = argv[i]
            out.append(_full_name(key, value))
        elif key in _SHORT_NAMES and eq:
            out.append(f"{key}={_full_name(key, value)}")
        else:
            out.append(arg)
        i += 1
    return out


def _full_name(key: str, value: str) -> str:
    if not value.isidentifier():
        return value  # a class path, a JSON spec
    if key == "--lr_scheduler" and value == "ReduceLROnPlateau":
        return f"{__name__}.ReduceLROnPlateau"
    return f"{_SHORT_NAMES[key].__name__}.{value}" if hasattr(_SHORT_NAMES[key], value) else value


def _first_line(doc: Optional[str]) -> str:
    return (doc or "").strip().split("\n")[0]

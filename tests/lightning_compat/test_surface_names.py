"""Every name a Lightning 2.x script imports resolves under shardwise after the package rename.

The rename rule: `lightning.pytorch`, `pytorch_lightning` and `lightning` become `shardwise` in the
import lines (`lightning.pytorch.callbacks` -> `shardwise.callbacks`). NAMES lists what Lightning
2.6.6 exports from the modules scripts import from (its `__all__`, and the helpers scripts import
from `utilities.rank_zero` / `utilities.types`). Each must exist at the renamed path, and be either
the real thing or a stand-in that refuses by name, with the reason, when it is built or called.
"""

from __future__ import annotations

import importlib

import pytest
import torch

import shardwise
from shardwise.utilities import NotProvidedError

NAMES = {
    "lightning": ["Callback", "Fabric", "LightningDataModule", "LightningModule", "Trainer", "seed_everything"],
    "lightning.pytorch": ["Callback", "LightningDataModule", "LightningModule", "Trainer", "seed_everything"],
    "lightning.pytorch.callbacks": [
        "BackboneFinetuning", "BaseFinetuning", "BasePredictionWriter", "BatchSizeFinder", "Callback", "Checkpoint",
        "DeviceStatsMonitor", "EMAWeightAveraging", "EarlyStopping", "GradientAccumulationScheduler",
        "LambdaCallback", "LearningRateFinder", "LearningRateMonitor", "ModelCheckpoint", "ModelPruning",
        "ModelSummary", "OnExceptionCheckpoint", "ProgressBar", "RichModelSummary", "RichProgressBar",
        "SpikeDetection", "StochasticWeightAveraging", "TQDMProgressBar", "ThroughputMonitor", "Timer",
        "WeightAveraging",
    ],
    # Lightning's module paths scripts import single callbacks from.
    "lightning.pytorch.callbacks.model_checkpoint": ["ModelCheckpoint"],
    "lightning.pytorch.callbacks.early_stopping": ["EarlyStopping"],
    "lightning.pytorch.callbacks.lr_monitor": ["LearningRateMonitor"],
    "lightning.pytorch.callbacks.callback": ["Callback"],
    "lightning.pytorch.callbacks.model_summary": ["ModelSummary"],
    "lightning.pytorch.callbacks.progress": ["RichProgressBar", "TQDMProgressBar"],
    "lightning.pytorch.strategies": [
        "DDPStrategy", "DeepSpeedStrategy", "FSDPStrategy", "ModelParallelStrategy", "ParallelStrategy",
        "SingleDeviceStrategy", "Strategy",
    ],
    "lightning.pytorch.utilities": [
        "AttributeDict", "CombinedLoader", "GradClipAlgorithmType", "LightningEnum", "disable_possible_user_warnings",
        "find_shared_parameters", "grad_norm", "is_picklable", "is_shared_filesystem", "measure_flops",
        "move_data_to_device", "rank_zero_deprecation", "rank_zero_info", "rank_zero_only", "rank_zero_warn",
        "set_shared_parameters", "suggested_max_num_workers",
    ],
    "lightning.pytorch.utilities.rank_zero": [
        "rank_prefixed_message", "rank_zero_debug", "rank_zero_deprecation", "rank_zero_info", "rank_zero_only",
        "rank_zero_warn",
    ],
    "lightning.pytorch.utilities.types": [
        "EVAL_DATALOADERS", "LRSchedulerConfig", "LRSchedulerConfigType", "LRSchedulerPLType", "LRSchedulerType",
        "LRSchedulerTypeUnion", "OptimizerLRScheduler", "OptimizerLRSchedulerConfig", "STEP_OUTPUT",
        "TRAIN_DATALOADERS",
    ],
    # The loggers and CLI classes provided so far. Lightning also exports CometLogger, LitLogger and
    # MLFlowLogger (loggers), OptimizerCallable, LRSchedulerCallable and ArgsType (cli), and the demos:
    # add each here once it exists, real or refused by name.
    "lightning.pytorch.loggers": ["CSVLogger", "Logger", "TensorBoardLogger", "WandbLogger"],
    "lightning.pytorch.cli": ["LightningCLI", "LightningArgumentParser", "SaveConfigCallback"],
    "lightning.pytorch.plugins": [
        "AsyncCheckpointIO", "BitsandbytesPrecision", "CheckpointIO", "DeepSpeedPrecision", "DoublePrecision",
        "FSDPPrecision", "HalfPrecision", "LayerSync", "MixedPrecision", "Precision", "TorchCheckpointIO",
        "TorchSyncBatchNorm", "TransformerEnginePrecision", "XLACheckpointIO", "XLAPrecision",
    ],
    "lightning.pytorch.plugins.environments": [
        "ClusterEnvironment", "KubeflowEnvironment", "LSFEnvironment", "LightningEnvironment", "MPIEnvironment",
        "SLURMEnvironment", "TorchElasticEnvironment", "XLAEnvironment",
    ],
    "lightning.pytorch.tuner": ["Tuner"],
    "lightning.pytorch.utilities.exceptions": ["MisconfigurationException"],
    "lightning.pytorch.utilities.seed": ["isolate_rng"],
}  # fmt: skip


def renamed(path: str) -> str:
    for old in ("lightning.pytorch", "pytorch_lightning", "lightning"):
        if path == old or path.startswith(old + "."):
            return "shardwise" + path[len(old) :]
    raise AssertionError(path)


@pytest.mark.parametrize("path", sorted(NAMES))
def test_every_name_resolves_and_is_real_or_refused_by_name(path):
    module = importlib.import_module(renamed(path))
    missing = [name for name in NAMES[path] if not hasattr(module, name)]
    assert missing == [], f"{renamed(path)} lacks {missing}"
    for name in NAMES[path]:
        obj = getattr(module, name)
        reason = getattr(obj, "refused_reason", None)
        if reason is None:
            continue
        with pytest.raises(NotProvidedError) as refused:
            obj()
        message = str(refused.value)
        assert name in message and reason in message and len(reason) > 20  # the name, why, and what instead


def test_the_core_classes_are_shardwise_own_not_copies():
    import shardwise as L
    import shardwise.callbacks as callbacks

    assert L.LightningModule is L.TrainModule and L.LightningDataModule is L.DataModule
    # Code that writes L.pytorch.<module>.<name> in its body (not only in imports) after `import lightning as L`.
    assert L.pytorch.callbacks.ModelCheckpoint is callbacks.ModelCheckpoint and L.pytorch.Trainer is L.Trainer
    assert L.pytorch.tuner.Tuner is importlib.import_module("shardwise.tuner").Tuner
    assert L.Callback is callbacks.Callback and L.seed_everything(3, workers=True) == 3
    # The callbacks Lightning has that shardwise provides do something; only the listed ones refuse.
    provided = {"Callback", "DeviceStatsMonitor", "EarlyStopping", "LambdaCallback", "LearningRateMonitor",
                "ModelCheckpoint", "ModelSummary", "RichModelSummary", "RichProgressBar", "TQDMProgressBar",
                "ThroughputMonitor"}  # fmt: skip
    for name in NAMES["lightning.pytorch.callbacks"]:
        assert (getattr(getattr(callbacks, name), "refused_reason", None) is None) == (name in provided), name


def test_rank_zero_helpers_and_grad_norm_behave_as_lightnings(monkeypatch):
    from shardwise.utilities import AttributeDict, grad_norm
    from shardwise.utilities.rank_zero import rank_zero_only, rank_zero_warn

    calls = []
    record = rank_zero_only(lambda x: calls.append(x) or x, default="skipped")
    assert record(1) == 1 and calls == [1]
    monkeypatch.setattr(rank_zero_only, "rank", 1)  # a script that sets the rank itself is obeyed
    assert record(2) == "skipped" and calls == [1]
    with pytest.warns(UserWarning, match="only once"):
        monkeypatch.setattr(rank_zero_only, "rank", 0)
        rank_zero_warn("only once")

    layer = torch.nn.Linear(3, 2)
    layer(torch.ones(4, 3)).sum().backward()
    norms = grad_norm(layer, norm_type=2)
    assert set(norms) == {"grad_2.0_norm/weight", "grad_2.0_norm/bias", "grad_2.0_norm_total"}
    assert float(norms["grad_2.0_norm/bias"]) == pytest.approx(4 * 2**0.5)
    total = torch.cat([layer.weight.grad.flatten(), layer.bias.grad]).norm()
    assert float(norms["grad_2.0_norm_total"]) == pytest.approx(float(total))

    from shardwise.utilities.seed import isolate_rng

    torch.manual_seed(1)
    first = torch.rand(1)
    torch.manual_seed(1)
    with isolate_rng():
        torch.rand(3)
    assert torch.equal(torch.rand(1), first)  # as if the block had drawn nothing

    hp = AttributeDict(lr=0.1)
    hp.layers = 2
    assert hp["layers"] == 2 and hp.lr == 0.1
    with pytest.raises(AttributeError, match="momentum"):
        hp.momentum


def test_lightning_strategy_strings_map_or_refuse_by_name():
    from shardwise.strategies import DDPStrategy, build_strategy

    for name, unused in (("ddp_find_unused_parameters_true", True), ("ddp_spawn", False),
                         ("ddp_notebook_find_unused_parameters_false", False)):  # fmt: skip
        strategy = build_strategy(name, world_size=2)
        assert isinstance(strategy, DDPStrategy) and strategy.ddp_kwargs["find_unused_parameters"] is unused
    for name in ("deepspeed_stage_3_offload_nvme", "xla"):
        with pytest.raises(ValueError, match=f"strategy='{name}' \\(Lightning's\\) is not available: "):
            build_strategy(name)
    with pytest.raises(NotProvidedError, match="ModelParallelStrategy .*tp_size"):
        shardwise.strategies.ModelParallelStrategy()


def test_lightnings_ddp_strategy_arguments_port():
    import datetime

    from shardwise.strategies import DDPStrategy

    ddp = DDPStrategy(find_unused_parameters=True, timeout=datetime.timedelta(minutes=2), start_method="spawn",
                      broadcast_buffers=False)  # fmt: skip
    assert ddp.timeout_s == 120.0
    assert ddp.ddp_kwargs["broadcast_buffers"] is False and ddp.ddp_kwargs["find_unused_parameters"] is True
    with pytest.raises(ValueError, match="process_group_backend='nccl'\\) on cpu: shardwise uses 'gloo'"):
        DDPStrategy(process_group_backend="nccl").setup_environment()

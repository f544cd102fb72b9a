"""trainer.test / trainer.predict (issue 24, item 2): test_step / predict_step, their loader hooks and the
DataModule's, Lightning's return values, hooks and setup / teardown stages, under every strategy."""

import importlib.util

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

import shardwise
from shardwise import DataModule, FSDPStrategy, Trainer, TrainModule
from shardwise.callbacks import ModelCheckpoint

from helpers.selection import selected_params
from helpers.trainers import quiet_trainer as _trainer


def _data(n=24, seed=0):
    g = torch.Generator().manual_seed(seed)
    return TensorDataset(torch.randn(n, 4, generator=g), torch.randn(n, 1, generator=g))


class Regressor(TrainModule):
    def __init__(self):
        super().__init__()
        self.net = nn.Linear(4, 1)
        self.stages = []

    def forward(self, x):
        return self.net(x)

    def setup(self, stage):
        self.stages.append(("setup", stage))

    def teardown(self, stage):
        self.stages.append(("teardown", stage))

    def training_step(self, batch, batch_idx):
        x, y = batch
        return F.mse_loss(self(x), y)

    def validation_step(self, batch, batch_idx):
        x, y = batch
        self.log("val_loss", F.mse_loss(self(x), y))

    def test_step(self, batch, batch_idx):
        x, y = batch
        self.log("test_loss", F.mse_loss(self(x), y), sync_dist=True)

    def predict_step(self, batch, batch_idx):
        return self(batch[0])

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1)


def _mse(module, dataset):
    x, y = dataset.tensors
    with torch.no_grad():
        return F.mse_loss(module(x), y).item()


def test_test_after_fit_returns_the_epoch_metrics_and_prints_them(capsys):
    module = Regressor()
    trainer = _trainer(max_steps=3)
    trainer.fit(module, DataLoader(_data(), batch_size=8))
    results = trainer.test(module, DataLoader(_data(seed=1), batch_size=8))
    assert results == [{"test_loss": pytest.approx(_mse(module, _data(seed=1)), rel=1e-5)}]
    assert "test_loss" in capsys.readouterr().out
    assert trainer.test(dataloaders=DataLoader(_data(seed=1), batch_size=8), verbose=False) == results  # module kept
    assert capsys.readouterr().out == ""
    assert trainer.callback_metrics["test_loss"] == pytest.approx(results[0]["test_loss"])
    assert module.training  # back in training mode, as Lightning's on_test_model_train leaves it


def test_predict_returns_each_batch_and_defaults_to_forward():
    module = Regressor()
    trainer = _trainer()
    x = _data(10).tensors[0]
    predictions = trainer.predict(module, DataLoader(_data(10), batch_size=4))
    assert [p.shape for p in predictions] == [(4, 1), (4, 1), (2, 1)]
    with torch.no_grad():
        torch.testing.assert_close(torch.cat(predictions), module(x))
    assert all(not p.requires_grad for p in predictions)

    class ForwardOnly(Regressor):
        predict_step = None  # Lightning's default predict_step: the module's forward on the batch

        def forward(self, batch):
            return self.net(batch[0])

    out = _trainer().predict(ForwardOnly(), DataLoader(_data(10), batch_size=5))
    assert [p.shape for p in out] == [(5, 1), (5, 1)]
    assert _trainer().predict(Regressor(), DataLoader(_data(4), batch_size=2), return_predictions=False) is None


def test_several_loaders():
    class Multi(Regressor):
        def test_step(self, batch, batch_idx, dataloader_idx=0):
            x, y = batch
            self.log("loss", F.mse_loss(self(x), y))

        def on_test_epoch_end(self):
            self.log("constant", 1.0)

        def predict_step(self, batch, batch_idx, dataloader_idx=0):
            return dataloader_idx

    module = Multi()
    loaders = [DataLoader(_data(8, seed=s), batch_size=4) for s in (1, 2)]
    results = _trainer().test(module, loaders, verbose=False)
    assert len(results) == 2
    assert set(results[0]) == {"loss/dataloader_idx_0", "constant"}
    assert set(results[1]) == {"loss/dataloader_idx_1", "constant"}
    assert results[1]["loss/dataloader_idx_1"] == pytest.approx(_mse(module, _data(8, seed=2)), rel=1e-5)
    predictions = _trainer().predict(module, {"a": loaders[0], "b": loaders[1]})
    assert predictions == [[0, 0], [1, 1]]

    class TwoArgs(Regressor):
        pass

    with pytest.raises(TypeError, match="take a third argument, dataloader_idx"):
        _trainer().test(TwoArgs(), loaders, verbose=False)


def test_hooks_in_lightnings_order_and_stages():
    calls = []

    class Recorder:
        def __getattr__(self, name):
            if name.startswith("on_test") or name.startswith("on_predict") or name in ("setup", "teardown"):
                return lambda trainer, module, *a, **k: calls.append(("cb", name, k.get("stage")))
            raise AttributeError(name)

    class Hooked(Regressor):
        def __getattribute__(self, name):
            attr = super().__getattribute__(name)
            if (name.startswith("on_test") or name.startswith("on_predict")) and callable(attr):

                def record(*a, **k):
                    calls.append(("module", name, None))
                    return attr(*a, **k)

                return record
            return attr

    module = Hooked()
    trainer = _trainer(callbacks=[Recorder()], max_steps=1)
    trainer.fit(module, DataLoader(_data(8), batch_size=4))
    trainer.validate(module, DataLoader(_data(8), batch_size=4))
    calls.clear()
    trainer.test(module, DataLoader(_data(8), batch_size=4), verbose=False)
    names = [(who, name) for who, name, _ in calls]
    assert names == [
        ("cb", "setup"),
        ("module", "on_test_model_eval"),
        ("cb", "on_test_start"),
        ("module", "on_test_start"),
        ("cb", "on_test_epoch_start"),
        ("module", "on_test_epoch_start"),
        *[
            pair
            for _ in range(2)
            for pair in [
                ("cb", "on_test_batch_start"),
                ("module", "on_test_batch_start"),
                ("cb", "on_test_batch_end"),
                ("module", "on_test_batch_end"),
            ]
        ],
        ("cb", "on_test_epoch_end"),
        ("module", "on_test_epoch_end"),
        ("cb", "on_test_end"),
        ("module", "on_test_end"),
        ("module", "on_test_model_train"),
        ("cb", "teardown"),
    ]
    assert ("cb", "setup", "test") in calls and ("cb", "teardown", "test") in calls
    calls.clear()
    trainer.predict(module, DataLoader(_data(4), batch_size=4))
    names = [(who, name) for who, name, _ in calls]
    assert names == [
        ("cb", "setup"),
        ("module", "on_predict_model_eval"),
        ("cb", "on_predict_start"),
        ("module", "on_predict_start"),
        ("cb", "on_predict_epoch_start"),
        ("module", "on_predict_epoch_start"),
        ("cb", "on_predict_batch_start"),
        ("module", "on_predict_batch_start"),
        ("cb", "on_predict_batch_end"),
        ("module", "on_predict_batch_end"),
        ("cb", "on_predict_epoch_end"),
        ("module", "on_predict_epoch_end"),
        ("cb", "on_predict_end"),
        ("module", "on_predict_end"),
        ("cb", "teardown"),
    ]
    assert module.stages == [
        ("setup", "fit"),
        ("teardown", "fit"),
        ("setup", "validate"),
        ("teardown", "validate"),
        ("setup", "test"),
        ("teardown", "test"),
        ("setup", "predict"),
        ("teardown", "predict"),
    ]


class Data(DataModule):
    def __init__(self):
        self.stages = []

    def setup(self, stage):
        self.stages.append(stage)

    def train_dataloader(self):
        return DataLoader(_data(8), batch_size=4)

    def test_dataloader(self):
        return DataLoader(_data(8, seed=3), batch_size=4)

    def predict_dataloader(self):
        return DataLoader(_data(6, seed=3), batch_size=3)


def test_datamodule_and_module_loader_hooks():
    dm = Data()
    module = Regressor()
    results = _trainer().test(module, dm, verbose=False)  # a datamodule as the second positional argument
    assert results[0]["test_loss"] == pytest.approx(_mse(module, _data(8, seed=3)), rel=1e-5)
    assert len(_trainer().predict(module, datamodule=dm)) == 2
    assert dm.stages == ["test", "predict"]

    class OwnLoader(Regressor):
        def test_dataloader(self):
            return DataLoader(_data(8, seed=4), batch_size=8)

    own = OwnLoader()
    assert _trainer().test(own, verbose=False)[0]["test_loss"] == pytest.approx(_mse(own, _data(8, seed=4)), rel=1e-5)


def test_ckpt_path_restores_the_weights(tmp_path):
    module = Regressor()
    trainer = _trainer(max_steps=4, enable_checkpointing=True, default_root_dir=str(tmp_path))
    trainer.fit(module, DataLoader(_data(), batch_size=8))
    expected = _mse(module, _data(seed=1))
    best = trainer.checkpoint_callback.best_model_path if hasattr(trainer, "checkpoint_callback") else None
    best = best or [cb for cb in trainer.callbacks if isinstance(cb, ModelCheckpoint)][0].best_model_path
    with torch.no_grad():
        module.net.weight.add_(1.0)  # the weights in memory differ from the checkpoint's
    loader = DataLoader(_data(seed=1), batch_size=8)
    assert trainer.test(module, loader, verbose=False)[0]["test_loss"] != pytest.approx(expected, rel=1e-5)
    assert trainer.test(module, loader, ckpt_path="best", verbose=False)[0]["test_loss"] == pytest.approx(
        expected, rel=1e-5
    )
    fresh = Regressor()
    got = _trainer().test(fresh, loader, ckpt_path=best, verbose=False)
    assert got[0]["test_loss"] == pytest.approx(expected, rel=1e-5)


def test_test_and_predict_without_fit_need_no_optimizer():
    class Inference(TrainModule):
        def __init__(self):
            super().__init__()
            self.net = nn.Linear(4, 1)

        def test_step(self, batch, batch_idx):
            self.log("out", self.net(batch[0]).mean())

        def predict_step(self, batch, batch_idx):
            return self.net(batch[0])

    module = Inference()
    assert "out" in _trainer().test(module, DataLoader(_data(8), batch_size=4), verbose=False)[0]
    assert len(_trainer().predict(module, DataLoader(_data(8), batch_size=4))) == 2


def test_refusals_name_the_fix():
    class NoTest(TrainModule):
        def __init__(self):
            super().__init__()
            self.net = nn.Linear(4, 1)

    with pytest.raises(TypeError, match="test_step"):
        _trainer().test(NoTest(), DataLoader(_data(4), batch_size=2))
    with pytest.raises(ValueError, match="test\\(\\) has no data"):
        _trainer().test(Regressor())
    with pytest.raises(ValueError, match="needs a module"):
        _trainer().predict(dataloaders=DataLoader(_data(4), batch_size=2))
    with pytest.raises(TypeError, match="takes a shardwise.TrainModule, got Linear"):
        _trainer().test(nn.Linear(4, 1), DataLoader(_data(4), batch_size=2))


def test_one_process_fsdp():  # DeepSpeed runs in processes of its own: test_test_and_predict_on_two_ranks
    module = Regressor()
    trainer = _trainer(strategy=FSDPStrategy(), max_steps=2)
    trainer.fit(module, DataLoader(_data(), batch_size=8))
    with module.gathered():
        expected = _mse(module, _data(seed=1))
        with torch.no_grad():
            direct = module(_data(seed=1).tensors[0])
    assert trainer.test(module, DataLoader(_data(seed=1), batch_size=8), verbose=False)[0][
        "test_loss"
    ] == pytest.approx(expected, rel=1e-5)
    torch.testing.assert_close(torch.cat(trainer.predict(module, DataLoader(_data(seed=1), batch_size=5))), direct)


# ------------------------------------------------------------------ several processes
class Indexed(Regressor):
    """predict_step returns the sample indices it saw (the inputs' first column holds them)."""

    def predict_step(self, batch, batch_idx):
        self(batch[0])  # a forward through the (sharded) model: collectives must pair across ranks
        return batch[0][:, 0].long().tolist()


def _indexed(n):
    x = torch.randn(n, 4)
    x[:, 0] = torch.arange(n, dtype=torch.float32)
    return TensorDataset(x, torch.randn(n, 1))


def evaluate_on_ranks(strategy_name, n_predict):
    shardwise.seed_everything(0)
    module = Indexed()
    strategy = FSDPStrategy() if strategy_name == "fsdp" else strategy_name
    trainer = Trainer(
        accelerator="cpu",
        devices=2,
        strategy=strategy,
        max_steps=2,
        logger=False,
        enable_progress_bar=False,
        enable_checkpointing=False,
    )
    trainer.fit(module, DataLoader(_data(), batch_size=4))
    results = trainer.test(module, DataLoader(_data(16, seed=1), batch_size=4), verbose=False)
    predictions = trainer.predict(module, DataLoader(_indexed(n_predict), batch_size=2))
    if strategy_name == "fsdp":
        state = {k: v.full_tensor() for k, v in module.state_dict().items()}
    else:
        state = trainer.strategy.model_state_dict(trainer.model)
    return results, predictions, {k: v.clone() for k, v in state.items()}, list(module.stages)


def evaluate_each(strategy_names, n_predict):
    """One worker: evaluate_on_ranks for each strategy in turn, in the same processes."""
    return {name: evaluate_on_ranks(name, n_predict) for name in strategy_names}


PREDICT_SAMPLES = 5  # rank 0 predicts samples 0, 2, 4 (two batches), rank 1 samples 1, 3 (one batch)


@pytest.fixture(scope="module")
def two_rank_runs(request):
    """The selected strategies of test_test_and_predict_on_two_ranks, one after another in one launch of 2
    ranks (start-up costs more than these runs): strategy -> each rank's result. DeepSpeed runs last, and only
    where it is installed."""
    names = selected_params(request, "strategy", ["test_test_and_predict_on_two_ranks"])
    names = sorted(names, key=lambda n: n.startswith("deepspeed"))
    if any(n.startswith("deepspeed") for n in names) and importlib.util.find_spec("deepspeed") is None:
        names = [n for n in names if not n.startswith("deepspeed")]
    ranks = shardwise.launch(evaluate_each, names, PREDICT_SAMPLES, devices=2)
    return {name: [rank[name] for rank in ranks] for name in names}


@pytest.mark.slow
@pytest.mark.parametrize("strategy", ["ddp", "fsdp", "deepspeed_stage_3"])
def test_test_and_predict_on_two_ranks(strategy, two_rank_runs):
    if strategy.startswith("deepspeed"):
        pytest.importorskip("deepspeed")
    n = PREDICT_SAMPLES
    ranks = two_rank_runs[strategy]
    seen = sorted(i for _, predictions, _, _ in ranks for batch in predictions for i in batch)
    assert seen == list(range(n))  # each sample predicted exactly once across the ranks
    assert [i for batch in ranks[0][1] for i in batch] == [0, 2, 4]
    # test metrics logged with sync_dist: the same value on every rank, the mean over the test set
    state = ranks[0][2]
    net = nn.Linear(4, 1)
    net.load_state_dict({k.removeprefix("net."): v for k, v in state.items()})
    x, y = _data(16, seed=1).tensors
    with torch.no_grad():
        expected = F.mse_loss(net(x), y).item()
    for results, _, _, stages in ranks:
        assert results[0]["test_loss"] == pytest.approx(expected, rel=1e-5)
        assert stages == [
            ("setup", "fit"),
            ("teardown", "fit"),
            ("setup", "test"),
            ("teardown", "test"),
            ("setup", "predict"),
            ("teardown", "predict"),
        ]


def test_validate_from_a_checkpoint_on_a_fresh_trainer(tmp_path):
    module = Regressor()
    trainer = _trainer(max_steps=3)
    trainer.fit(module, DataLoader(_data(), batch_size=8))
    path = trainer.save_checkpoint(str(tmp_path / "model.ckpt"))
    results = _trainer().validate(Regressor(), DataLoader(_data(seed=1), batch_size=8), ckpt_path=path)
    assert results[0]["val_loss"] == pytest.approx(_mse(module, _data(seed=1)), rel=1e-5)

"""Every Lightning hook is called where Lightning calls it, or refused by name (issue 24 item 1).

The reference is a run of real Lightning, recorded once into tests/fixtures/lightning_hook_order.json
(tests/fixtures/record_lightning_hooks.py says how and which version; Lightning is not installed here).
The same recorder (tests/helpers/hook_recording.py) runs the same module on our Trainer.
"""

from __future__ import annotations

import inspect
import json
import os
import types

import pytest
import torch
from torch.utils.data import DataLoader, TensorDataset

import shardwise
from shardwise import Callback, DataModule, Trainer, TrainModule
from shardwise.trainer.lightning_hooks import CALLED, HOOKS, REFUSED

from helpers.coming_from import render_rows
from helpers.hook_recording import CALLS, TRAINER_KWARGS, module_class, record, recording_classes

README = os.path.join(os.path.dirname(__file__), "..", "..", "docs", "coming-from.md")  # README's tables moved here
FIXTURE = os.path.join(os.path.dirname(__file__), "..", "fixtures", "lightning_hook_order.json")
LIGHTNING = json.load(open(FIXTURE))
OURS = types.SimpleNamespace(LightningModule=TrainModule, Callback=Callback, Trainer=Trainer)
TABLE = {(h.owner, h.name): h for h in HOOKS}
MOVED = {h.name for h in HOOKS if h.moved}


def called(owner):
    return [h.name for h in HOOKS if h.owner == owner and h.status == CALLED]


# The fixture's runs have no sanity check (Lightning's num_sanity_val_steps=0) except "fit_sanity".
NO_SANITY = {"num_sanity_val_steps": 0} if "num_sanity_val_steps" in inspect.signature(Trainer).parameters else {}


def ours(what, **kwargs):
    return record(OURS, what, called("module"), called("callback"), **{**NO_SANITY, **kwargs})


def comparable(calls):
    """The calls both sides make at the same point: without refused hooks and those we call elsewhere."""
    out = []
    for c in calls:
        hook = TABLE[(c["who"], c["hook"])]
        if hook.status == REFUSED or hook.moved:
            continue
        out.append((c["who"], c["hook"], tuple(c["args"]) if not hook.args_differ else "...", c.get("kwargs")))
    return out


def test_the_table_has_every_hook_lightning_has_and_nothing_else():
    recorded = {("module", h) for h in LIGHTNING["module_hooks"]} | {
        ("callback", h) for h in LIGHTNING["callback_hooks"]
    }
    table = {k for k in TABLE if k[0] != "datamodule"}
    assert recorded - table == set(), "Lightning hooks missing from lightning_hooks.HOOKS"
    assert table - recorded == set(), "rows for hooks Lightning 2.x does not have"
    assert len(TABLE) == len(HOOKS), "a hook appears twice"
    assert {h.status for h in HOOKS} == {CALLED, REFUSED}
    assert all(h.where for h in HOOKS)
    called_lightning = {(c["who"], c["hook"]) for run in LIGHTNING["runs"].values() for c in run}
    assert called_lightning <= set(TABLE)


@pytest.mark.parametrize("what", ["fit", "validate"])
def test_the_order_and_arguments_are_lightnings(what):
    theirs = LIGHTNING["runs"][what]
    mine = ours(what)
    assert comparable(mine) == comparable(theirs)
    # The loader hooks we call earlier (lightning_hooks.HOOKS says why): right after the module's setup.
    names = [c["hook"] for c in mine if c["who"] == "module"]
    after_setup = names[names.index("setup") + 1 : names.index("setup") + 1 + len([n for n in names if n in MOVED])]
    assert set(after_setup) == {n for n in names if n in MOVED}


@pytest.mark.parametrize("what", ["test", "predict"])
def test_the_order_of_test_and_predict_is_lightnings(what):
    if not hasattr(Trainer, what):
        pytest.skip(f"Trainer.{what} is not built yet (issue 24 item 2)")
    assert comparable(ours(what)) == comparable(LIGHTNING["runs"][what])


def test_the_sanity_check_order_is_lightnings():
    if not NO_SANITY:
        pytest.skip("Trainer(num_sanity_val_steps=...) is not built yet (issue 24 item 7)")
    mine = ours("fit", num_sanity_val_steps=1, max_epochs=1, limit_train_batches=1, limit_val_batches=1)
    assert comparable(mine) == comparable(LIGHTNING["runs"]["fit_sanity"])


# ------------------------------------------------------------------ every CALLED row is called
class _DataModule(DataModule):
    def setup(self, stage):
        self.data = TensorDataset(torch.randn(8, 4), torch.randn(8, 2))

    def train_dataloader(self):
        return DataLoader(self.data, batch_size=4)

    def val_dataloader(self):
        return DataLoader(self.data, batch_size=4)

    def test_dataloader(self):
        return DataLoader(self.data, batch_size=4)

    def predict_dataloader(self):
        return DataLoader(self.data, batch_size=4)


def _recording_datamodule():
    hooks = called("datamodule")

    def make(name):
        def method(self, *args, **kwargs):
            CALLS.append({"who": "datamodule", "hook": name})
            fn = getattr(super(type(self), self), name, None)
            if name == "transfer_batch_to_device":
                return shardwise.move_to_device(args[0], args[1])
            return fn(*args, **kwargs) if fn is not None else (args[0] if args else None)

        return method

    return type("Recorded", (_DataModule,), {h: make(h) for h in hooks})()


class _Failing(Exception):
    pass


def test_every_called_row_is_called_by_some_run(tmp_path):
    """Each CALLED row is observed in a run here, or in the order tests' runs (fit / validate / test / predict)."""
    seen = {(c["who"], c["hook"]) for what in ("fit", "validate") for c in ours(what)}
    module_cls, callback_cls = recording_classes(OURS, called("module"), called("callback"))
    # Checkpoint hooks: save in one fit, load in the next.
    CALLS.clear()
    trainer = Trainer(**{**TRAINER_KWARGS, "callbacks": [callback_cls()], "default_root_dir": str(tmp_path)})
    trainer.fit(module_cls(), datamodule=_recording_datamodule())  # and the datamodule's state_dict ...
    path = trainer.save_checkpoint(str(tmp_path / "ckpt"))
    trainer = Trainer(**{**TRAINER_KWARGS, "callbacks": [callback_cls()], "max_epochs": 3})
    trainer.fit(module_cls(), datamodule=_recording_datamodule(), ckpt_path=path)  # ... load_state_dict
    seen |= {(c["who"], c["hook"]) for c in CALLS}
    # on_exception, the datamodule's hooks.
    CALLS.clear()
    failing = type("Failing", (module_cls,), {"training_step": lambda self, b, i: (_ for _ in ()).throw(_Failing())})
    with pytest.raises(_Failing):
        Trainer(**{**TRAINER_KWARGS, "callbacks": [callback_cls()]}).fit(failing(), datamodule=_recording_datamodule())
    Trainer(**{**TRAINER_KWARGS, "callbacks": [callback_cls()]}).fit(module_cls(), datamodule=_recording_datamodule())
    seen |= {(c["who"], c["hook"]) for c in CALLS}
    for what in ("test", "predict"):
        if hasattr(Trainer, what):
            seen |= {(c["who"], c["hook"]) for c in ours(what)}
            CALLS.clear()
            getattr(Trainer(**{**TRAINER_KWARGS, "callbacks": []}), what)(
                module_cls(), datamodule=_recording_datamodule()
            )
            seen |= {(c["who"], c["hook"]) for c in CALLS}
    if NO_SANITY:
        seen |= {(c["who"], c["hook"]) for c in ours("fit", num_sanity_val_steps=1, max_epochs=1)}
    missing = [
        (h.owner, h.name)
        for h in HOOKS
        if h.status == CALLED
        and (h.owner, h.name) not in seen
        and hasattr(Trainer, h.stage if h.stage != "any" else "fit")
    ]
    # A row for a stage not built yet is listed for the helper building it; nothing else may be missing.
    pending = set() if NO_SANITY else {("callback", "on_sanity_check_start"), ("callback", "on_sanity_check_end")}
    assert [m for m in missing if m not in pending] == []


# --------------------------------------------------------------- every REFUSED row is refused
@pytest.mark.parametrize("hook", [h for h in HOOKS if h.status == REFUSED], ids=lambda h: f"{h.owner}.{h.name}")
def test_defining_a_refused_hook_stops_fit_naming_it(hook):
    def noop(self, *args, **kwargs):
        return {}

    module_cls, datamodule = module_class(OURS), None
    callbacks = []
    if hook.owner == "module":
        module_cls = type("Defines", (module_cls,), {hook.name: noop})
    elif hook.owner == "callback":
        callbacks = [type("Defines", (Callback,), {hook.name: noop})()]
    else:
        datamodule = type("Defines", (_DataModule,), {hook.name: noop})()
    trainer = Trainer(**{**TRAINER_KWARGS, "callbacks": callbacks})
    with pytest.raises(TypeError, match=f"Defines.{hook.name}: "):
        trainer.fit(module_cls(), datamodule=datamodule)


def test_a_custom_clipping_rule_is_refused_where_the_engine_clips():
    pytest.importorskip("deepspeed")

    class Clips(module_class(OURS)):
        def configure_gradient_clipping(self, optimizer, gradient_clip_val=None, gradient_clip_algorithm=None):
            pass

    trainer = Trainer(**{**TRAINER_KWARGS, "strategy": "deepspeed_stage_2"})
    with pytest.raises(TypeError, match="configure_gradient_clipping: DeepSpeedStrategy's engine clips"):
        trainer.fit(Clips())


# ------------------------------------------------------------------------ README's tables
def test_readme_coming_from_lightning_has_a_row_for_everything_lightning_has():
    text = open(README).read()
    section = text[text.index("\n## Coming from Lightning\n") :]
    section = section[: section.index("\n## ", 1)]
    for owner in ("module", "callback", "datamodule"):
        assert render_rows(owner) in section, (
            f"docs/coming-from.md's {owner} hook rows differ from tests/helpers/coming_from.render_rows"
        )
    rows = {line.split("|")[1].strip() for line in section.splitlines() if line.startswith("| `")}
    names = {name.strip(" `") for row in rows for name in row.split(",")}
    assert set(LIGHTNING["trainer_arguments"]) - names == set(), (
        "Trainer arguments without a row in docs/coming-from.md"
    )
    assert set(LIGHTNING["callbacks"]) - names == set(), "Lightning callbacks without a row in docs/coming-from.md"
    statuses = {line.split("|")[2].strip() for line in section.splitlines() if line.startswith("| `")}
    assert statuses <= {"same", "different", "refused"}

"""Run a Lightning example ported by renaming its package, under shardwise or under Lightning, and read its numbers.

The scripts in ports/ are Lightning's own, changed only in their import lines (lightning.pytorch ->
shardwise). `run_port(name, package)` turns them back into Lightning's imports for package="lightning"
(tests/fixtures/record_lightning_ports.py records Lightning 2.6.6's numbers that way) and runs the file as
`python <file> <arguments>` would (as `__main__`, sys.argv set), from the same seed, and returns what its
last Trainer ends with: its callback_metrics after each of its fit / validate / test / predict calls,
the global step and the weights (each tensor's sum of magnitudes and first values). Between the script's
import lines and the rest of it the harness swaps downloads and torchvision for port_stand_ins.py's
(`_stand_ins`), keeps a long run short and small (SHORT, SIZES) and adds the multi-process runs' Trainer
arguments (devices, strategy): the script's own text stays Lightning's. A script run through its
LightningCLI gets those settings as `--trainer.*` arguments on its command line.
"""

from __future__ import annotations

import ast
import os
import sys
from typing import Any, Callable, Dict, List

import port_stand_ins as stand_ins

HERE = os.path.dirname(os.path.abspath(__file__))
PORTS = ("autoencoder", "bug_report_model", "fsdp_guide", "generative_adversarial_net", "transformer")
CLI_PORTS = ("autoencoder",)  # built by a LightningCLI: Trainer arguments go on its command line
SEED = 42
_FEW = {"max_epochs": 1, "limit_train_batches": 3, "limit_val_batches": 2, "limit_test_batches": 2}
# Per port: Trainer arguments that keep the run short (over the script's own), the same in both runs.
SHORT: Dict[str, Dict[str, Any]] = {
    "transformer": _FEW,
    "generative_adversarial_net": _FEW,
    "autoencoder": {**_FEW, "limit_predict_batches": 2},  # 1 on a command line is read as 1.0 (all) by both
    "fsdp_guide": {**_FEW, "limit_train_batches": 2, "devices": 1},  # the guide asks for 2 CUDA devices
}
# The FSDP guide's 1B-parameter Transformer at a size a CPU test trains in a second (the same in both runs).
SIZES = {"fsdp_guide": {"nlayers": 1, "nhid": 64, "ninp": 32, "nhead": 4}}


def _stand_ins(name: str, namespace: Dict[str, Any], package: str) -> Dict[str, Any]:
    """The names this port's namespace gets after its imports ran (downloads -> synthetic data, ...)."""
    if name in ("transformer", "fsdp_guide"):
        out: Dict[str, Any] = {"WikiText2": stand_ins.SyntheticWikiText2}
        if name in SIZES:
            build = namespace["Transformer"]
            out["Transformer"] = lambda **kwargs: build(**{**kwargs, **SIZES[name]})
        return out
    if name == "generative_adversarial_net":
        base = __import__(package if package == "shardwise" else "lightning.pytorch", fromlist=["x"])
        return {"MNISTDataModule": stand_ins.synthetic_mnist_datamodule(base.LightningDataModule),
                "_TORCHVISION_AVAILABLE": True}  # fmt: skip
    if name == "autoencoder":
        return {"MNIST": stand_ins.SyntheticMNIST, "_TORCHVISION_AVAILABLE": True}
    return {}


def source(name: str, package: str) -> str:
    text = open(os.path.join(HERE, "ports", f"{name}.py")).read()
    if package == "lightning":
        lines = text.splitlines(keepends=True)
        for i, line in enumerate(lines):
            if line.startswith(("from shardwise", "import shardwise")):
                line = line.replace("from shardwise import", "from lightning.pytorch import")
                line = line.replace("from shardwise.", "from lightning.pytorch.")
                lines[i] = line.replace("import shardwise", "import lightning")
        text = "".join(lines)
    return text


class _WithTrainer:
    """A package whose Trainer is the recording one; every other name is the package's."""

    def __init__(self, package: Any, trainer: Any) -> None:
        self._package, self.Trainer = package, trainer

    def __getattr__(self, name: str) -> Any:
        return getattr(self._package, name)


def _full(tensor: Any) -> Any:
    return tensor.full_tensor() if hasattr(tensor, "full_tensor") else tensor  # FSDP's DTensor shards


def _summary(tensor: Any) -> List[float]:
    """A tensor as [sum of |x|, its first 8 values]: a model's worth of weights in a reviewable fixture."""
    flat = tensor.detach().double().flatten()
    return [float(flat.abs().sum())] + flat[:8].tolist()


def _split(text: str, filename: str) -> List[Any]:
    """The script compiled in two parts: its leading imports, then the rest."""
    body = ast.parse(text, filename).body
    first = next(i for i, node in enumerate(body) if not isinstance(node, (ast.Import, ast.ImportFrom, ast.Expr)))
    return [compile(ast.Module(body=part, type_ignores=[]), filename, "exec") for part in (body[:first], body[first:])]


def _watch(trainer: Any, made: List[Any]) -> None:
    """Note `trainer` in `made`, and its callback_metrics after each fit / validate / test / predict."""
    after: Dict[str, Dict[str, float]] = {}
    made.append((trainer, after))
    for stage in ("fit", "validate", "test", "predict"):
        call = getattr(trainer, stage)

        def watched(*args: Any, _call: Any = call, _stage: str = stage, **kwargs: Any) -> Any:
            out = _call(*args, **kwargs)
            after[_stage] = {k: float(v) for k, v in sorted(trainer.callback_metrics.items())}
            return out

        setattr(trainer, stage, watched)


def _record(namespace: Dict[str, Any], made: List[Any], trainer_kwargs: Dict[str, Any], cli: bool) -> None:
    """Every Trainer the script builds (and every LightningCLI's) is watched (`_watch`), with trainer_kwargs."""
    if cli:
        base_cli = namespace["LightningCLI"]

        class RecordingCLI(base_cli):  # type: ignore[misc, valid-type]
            def __init__(self, *args: Any, **kwargs: Any) -> None:
                super().__init__(*args, **kwargs)
                _watch(self.trainer, made)

        namespace["LightningCLI"] = RecordingCLI
        return
    trainer_class = namespace["Trainer"] if "Trainer" in namespace else namespace["L"].Trainer

    class Recording(trainer_class):  # type: ignore[misc, valid-type]
        def __init__(self, *args: Any, **kwargs: Any) -> None:
            super().__init__(*args, **{**kwargs, **trainer_kwargs})
            _watch(self, made)

    if "Trainer" in namespace:
        namespace["Trainer"] = Recording
    else:  # `import lightning as L` ... L.Trainer(...): the harness's own module object in its place
        namespace["L"] = _WithTrainer(namespace["L"], Recording)


def _argument(key: str, value: Any) -> str:
    return f"--trainer.{key}={value}"


def run_port(name: str, package: str = "shardwise", **trainer_kwargs: Any) -> Dict[str, Any]:
    seed_everything: Callable[[int], Any]
    if package == "lightning":
        from lightning.pytorch import seed_everything
    else:
        from shardwise import seed_everything
    filename = os.path.join(HERE, "ports", f"{name}.py")
    imports, rest = _split(source(name, package), filename)
    namespace: Dict[str, Any] = {"__name__": "__main__", "__file__": filename}
    made: List[Any] = []
    trainer_kwargs = {**SHORT.get(name, {}), **trainer_kwargs}
    argv = [filename] + ([_argument(k, v) for k, v in trainer_kwargs.items()] if name in CLI_PORTS else [])
    saved_argv = sys.argv
    with stand_ins.outside_world():
        exec(imports, namespace)
        namespace.update(_stand_ins(name, namespace, package))
        _record(namespace, made, trainer_kwargs, name in CLI_PORTS)
        seed_everything(SEED)
        sys.argv = argv
        try:
            exec(rest, namespace)
        finally:
            sys.argv = saved_argv
    trainer, after = made[-1]
    state = trainer.lightning_module.state_dict()
    return {
        "callback_metrics": after,
        "weights": {k: _summary(_full(v)) for k, v in sorted(state.items())},
        "global_step": int(trainer.global_step),
    }

"""Run a Lightning example ported by renaming its package, under shardwise or under Lightning, and read its numbers.

The scripts in ports/ are Lightning's own, changed only in their import lines (lightning.pytorch ->
shardwise). `run_port(name, package)` turns them back into Lightning's imports for package="lightning"
(tests/fixtures/record_lightning_ports.py records Lightning 2.6.6's numbers that way), seeds everything,
runs the script's entry point and returns what its last Trainer ends with: callback_metrics, the global
step and the weights (each tensor's sum of magnitudes and first values). The harness, not the script,
swaps a download for same-shaped synthetic data (STAND_INS), keeps a long run short (SHORT) and adds the
multi-process runs' Trainer arguments (devices, strategy): the script's own text stays Lightning's.
"""

from __future__ import annotations

import os
from typing import Any, Dict, List

HERE = os.path.dirname(os.path.abspath(__file__))
PORTS = {"bug_report_model": "run", "transformer": "main"}  # port -> its entry point
SEED = 42
# Per port: Trainer arguments that keep the run short (over the script's own), the same in both runs.
SHORT = {"transformer": {"max_epochs": 1, "limit_train_batches": 3, "limit_val_batches": 2, "limit_test_batches": 2}}


class SyntheticWikiText2:
    """WikiText2's shape without its download: (input, target) blocks of 35 token ids, a vocab_size."""

    def __init__(self, data_dir: Any = None, block_size: int = 35, download: bool = True) -> None:
        import torch

        self.vocab_size = 1000
        self.block_size = block_size
        generator = torch.Generator().manual_seed(0)  # its own generator: the seeded stream is the script's
        self.data = torch.randint(0, self.vocab_size, (4100 * block_size + 1,), generator=generator)

    def __len__(self) -> int:
        return 4100

    def __getitem__(self, index: int) -> Any:
        start = index * self.block_size
        chunk = self.data[start : start + self.block_size + 1]
        return chunk[:-1], chunk[1:]


STAND_INS = {"transformer": {"WikiText2": SyntheticWikiText2}}  # downloads -> same-shaped synthetic data


def source(name: str, package: str) -> str:
    text = open(os.path.join(HERE, "ports", f"{name}.py")).read()
    if package == "lightning":
        text = text.replace("from shardwise import", "from lightning.pytorch import")
        text = text.replace("from shardwise.", "from lightning.pytorch.").replace(
            "import shardwise", "import lightning"
        )
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


def run_port(name: str, package: str = "shardwise", **trainer_kwargs: Any) -> Dict[str, Any]:
    if package == "lightning":
        from lightning.pytorch import seed_everything
    else:
        from shardwise import seed_everything
    namespace: Dict[str, Any] = {"__name__": f"port_{name}"}
    exec(compile(source(name, package), f"{name}.py", "exec"), namespace)
    made: List[Any] = []

    namespace.update(STAND_INS.get(name, {}))
    trainer_kwargs = {**SHORT.get(name, {}), **trainer_kwargs}
    trainer_class = namespace["Trainer"] if "Trainer" in namespace else namespace["L"].Trainer

    class Recording(trainer_class):  # type: ignore[misc, valid-type]
        def __init__(self, *args: Any, **kwargs: Any) -> None:
            super().__init__(*args, **{**kwargs, **trainer_kwargs})
            made.append(self)

    if "Trainer" in namespace:
        namespace["Trainer"] = Recording
    else:  # `import lightning as L` ... L.Trainer(...): the harness's own module object in its place
        namespace["L"] = _WithTrainer(namespace["L"], Recording)
    seed_everything(SEED)
    namespace[PORTS[name]]()
    trainer = made[-1]
    state = trainer.lightning_module.state_dict()
    return {
        "callback_metrics": {k: float(v) for k, v in sorted(trainer.callback_metrics.items())},
        "weights": {k: _summary(_full(v)) for k, v in sorted(state.items())},
        "global_step": int(trainer.global_step),
    }

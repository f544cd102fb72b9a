"""Run a Lightning example ported by renaming its package, under shardwise or under Lightning, and read its numbers.

The scripts in ports/ are Lightning's own, changed only in their import lines (lightning.pytorch ->
shardwise). `run_port(name, package)` turns them back into Lightning's imports for package="lightning"
(tests/fixtures/record_lightning_ports.py records Lightning 2.6.6's numbers that way), seeds everything,
runs the script's entry point and returns what its last Trainer ends with: callback_metrics and the
weights. The harness, not the script, may add Trainer arguments (devices, strategy) for the
multi-process runs: the script's own text stays Lightning's.
"""

from __future__ import annotations

import os
from typing import Any, Dict, List

HERE = os.path.dirname(os.path.abspath(__file__))
PORTS = {"bug_report_model": "run"}  # port -> its entry point
SEED = 42


def source(name: str, package: str) -> str:
    text = open(os.path.join(HERE, "ports", f"{name}.py")).read()
    if package == "lightning":
        text = text.replace("from shardwise import", "from lightning.pytorch import")
        text = text.replace("from shardwise.", "from lightning.pytorch.").replace(
            "import shardwise", "import lightning"
        )
    return text


def _full(tensor: Any) -> Any:
    return tensor.full_tensor() if hasattr(tensor, "full_tensor") else tensor  # FSDP's DTensor shards


def run_port(name: str, package: str = "shardwise", **trainer_kwargs: Any) -> Dict[str, Any]:
    if package == "lightning":
        from lightning.pytorch import seed_everything
    else:
        from shardwise import seed_everything
    namespace: Dict[str, Any] = {"__name__": f"port_{name}"}
    exec(compile(source(name, package), f"{name}.py", "exec"), namespace)
    made: List[Any] = []

    class Recording(namespace["Trainer"]):  # type: ignore[misc, valid-type]
        def __init__(self, *args: Any, **kwargs: Any) -> None:
            super().__init__(*args, **{**kwargs, **trainer_kwargs})
            made.append(self)

    namespace["Trainer"] = Recording
    seed_everything(SEED)
    namespace[PORTS[name]]()
    trainer = made[-1]
    state = trainer.lightning_module.state_dict()
    return {
        "callback_metrics": {k: float(v) for k, v in sorted(trainer.callback_metrics.items())},
        "weights": {k: _full(v).detach().double().flatten().tolist() for k, v in sorted(state.items())},
        "global_step": int(trainer.global_step),
    }

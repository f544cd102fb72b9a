# WandbLogger: one Weights & Biases run per job, opened on global rank 0 only. wandb is an
# optional extra, imported when the logger is constructed on rank 0 (a missing install fails
# before training and names the pip command). W&B's step (`_step`) is the Trainer's
# global_step, so a step's training, validation and epoch values share one history row.
# A resumed job continues the checkpoint's run (same id, resume="allow"). W&B's history is
# append-only, so the points the run already holds from the checkpoint's step on are not
# logged again (tracker.py). Online, W&B's server reports where the run's history ends
# (run.step), and everything before that is held. Offline there is no server: each attempt
# writes its own folder (wandb/offline-run-*-<id>) and `wandb sync` merges them, so the
# resumed run reads the history rows of the earlier attempts' .wandb files with wandb's
# own reader (`wandb leet inspect --json`) and skips what they hold.
from __future__ import annotations

import glob
import json
import os
import secrets
import subprocess
import sys
import warnings
from typing import Any, Dict, Iterator, Optional, Set

from shardwise.loggers.csv import NoOpExperiment, rank_zero
from shardwise.loggers.tracker import TrackerLogger

__all__ = ["WandbLogger"]


def _wandb():
    try:
        import wandb
    except ImportError as err:
        raise ImportError(
            'WandbLogger needs wandb: pip install "shardwise[wandb]" (or pip install wandb). '
            "The default CSVLogger has no extra dependency."
        ) from err
    return wandb


def read_history(path: str) -> Iterator[Dict[str, Any]]:
    """The history rows of a run's .wandb file, read by wandb itself (each a dict holding `_step`)."""
    proc = subprocess.run(
        [sys.executable, "-m", "wandb", "leet", "inspect", "--json", path],
        capture_output=True,
        text=True,
        timeout=120,
    )
    if proc.returncode != 0:
        raise RuntimeError(f"`wandb leet inspect --json {path}` failed: {proc.stderr.strip()[-500:]}")
    for line in proc.stdout.splitlines():
        if '"history"' not in line:
            continue
        record = json.loads(line)
        if record.get("type") == "history":
            yield record["history"]["item"]


class WandbLogger(TrackerLogger):
    """Log to Weights & Biases: ``WandbLogger(project="llama-ft")``.

    save_dir: where wandb writes its local folder (``<save_dir>/wandb``).
    id: continue this run id (a resumed checkpoint continues its own run without it).
    mode: "online", "offline" or "disabled"; None means wandb's default (``WANDB_MODE``).
    prefix: put before every metric name. Other keywords go to ``wandb.init`` as they are
    (entity, group, tags, notes, settings, ...).
    """

    def __init__(
        self,
        project: Optional[str] = None,
        name: Optional[str] = None,
        save_dir: str = ".",
        id: Optional[str] = None,  # noqa: A002 (wandb's own name for it)
        mode: Optional[str] = None,
        prefix: str = "",
        **init_kwargs: Any,
    ) -> None:
        super().__init__(id, prefix)
        for taken in ("id", "resume", "dir", "reinit"):
            if taken in init_kwargs:
                raise ValueError(
                    f"WandbLogger sets wandb.init's {taken!r} itself (one run per job, continued on resume); "
                    "pass save_dir= for the folder and id= for a run id."
                )
        self.project, self.name, self.mode = project, name, mode
        self._save_dir = os.fspath(save_dir)
        self._init_kwargs = init_kwargs
        self._run: Any = None
        if rank_zero():
            _wandb()  # fail at construction, not at the first logged step

    @property
    def save_dir(self) -> str:
        return self._save_dir

    @property
    def log_dir(self) -> str:
        return self._save_dir

    @property
    def experiment(self) -> Any:
        """The wandb Run on rank 0 (elsewhere an object whose every call does nothing), for tables, media, ...

        Log through it with ``step=trainer.global_step``: the logger's rows use the Trainer's step as W&B's.
        """
        return self._run if self.ensure_open() else NoOpExperiment()

    def _open(self, run_id: Optional[str]) -> str:
        wandb = _wandb()
        os.makedirs(self._save_dir, exist_ok=True)
        self._run = wandb.init(
            project=self.project,
            name=self.name,
            dir=self._save_dir,
            id=run_id or secrets.token_hex(4),  # chosen here: the same id on every (re)open
            resume="allow",  # the same id continues the run (a resumed job, or a second fit)
            mode=self.mode,
            reinit="create_new",  # our own run, whatever wandb.run the user's code has
            **self._init_kwargs,
        )
        return self._run.id

    def _points_since(self, step: int) -> Dict[int, Set[str]]:
        run = self._run
        if not run.offline:
            # The server resumed the run: its history ends before run.step, and W&B itself would
            # drop anything logged below it. Hold every key there (None: all keys of the step).
            return {s: _ALL for s in range(step, run.step)}
        held: Dict[int, Set[str]] = {}
        own = os.path.realpath(run.settings.sync_dir)
        pattern = os.path.join(run.settings.wandb_dir, f"offline-run-*-{run.id}", f"run-{run.id}.wandb")
        for path in sorted(glob.glob(pattern)):
            if os.path.realpath(os.path.dirname(path)) == own:
                continue
            try:
                for row in read_history(path):
                    if int(row.get("_step", -1)) >= step:
                        held.setdefault(int(row["_step"]), set()).update(k for k in row if not k.startswith("_"))
            except (OSError, RuntimeError, ValueError, subprocess.TimeoutExpired) as err:
                warnings.warn(
                    f"WandbLogger: could not read the earlier attempt {path} of run {run.id} ({err}); steps "
                    f"after {step} that it logged may appear twice once synced.",
                    UserWarning,
                    stacklevel=2,
                )
        return held

    def _write_params(self, params: Dict[str, Any]) -> None:
        self._run.config.update(params, allow_val_change=True)

    def _write_metrics(self, metrics: Dict[str, float], step: Optional[int]) -> None:
        self._run.log(metrics, step=step)

    def _close(self, status: str) -> None:
        self._run.finish(exit_code=0 if status == "success" else 1)
        self._run = None


class _AllKeys(frozenset):
    """Every metric name (a step W&B's server already holds)."""

    def __contains__(self, key: object) -> bool:
        return True


_ALL = _AllKeys()

"""Chaos resume harness: random kill / resume schedules compared with the uninterrupted run.

DESIGN.md's "Trust" promise -- any number of interruptions, anywhere, resumes
to the same losses as the uninterrupted run -- checked by machine. This one
file is both halves:

* the DRIVER (`python chaos_script.py --spec S.json --leg i --root R`) trains
  the schedule's small model (dropout on, shuffled data, a per-step LR
  schedule, gradient accumulation, sometimes validation) with fit(ckpt_path=
  "last") for leg i>0, and -- when the leg has a kill -- delivers SIGKILL or
  SIGTERM to one rank or to the launcher at the chosen point: right after an
  optimizer step, between two micro-batches of a window, inside a save (the
  temporary checkpoint written, the commit renamed but `last` not moved, an
  old checkpoint half-pruned), during validation, at the end of an epoch, or
  right after the resume before any step ("start").
  Rank 0 appends one JSON line per optimizer step (run, step, epoch, loss)
  to R/losses.jsonl with flush + fsync, so whatever survives a kill is whole.
  The recorded loss is the global batch's mean (an all-reduce over ranks), so
  the same schedule at world size 1 and 2 records the same numbers up to
  rounding; schedules that change world size use a dropout whose mask is a
  hash of (sample, epoch, unit) instead of the RNG, so that they can be
  compared at all (a rank's RNG stream cannot be re-split across ranks).
* the HARNESS (`generate`, `run_schedule`), imported by test_chaos.py and
  benchmarks/chaos.py: seeded random schedules, the legs run as real
  subprocesses, and the checks -- per-step losses bitwise equal to the
  uninterrupted run at the same world size (1e-6 relative after a world-size
  change), no step missing or duplicated in the combined record, SIGTERM
  losing no completed step and exiting with PREEMPTED_EXIT_CODE, no hidden
  temporary entries left, `last.ckpt` at max_steps, and every checkpoint the
  uninterrupted run keeps (save_top_k) that the final leg saved present and
  loadable. The resume point of each leg is read from what was committed
  (last.ckpt's manifest), never assumed.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import re
import signal
import subprocess
import sys
import time
from typing import Any, Dict, List, Optional

HERE = os.path.dirname(os.path.abspath(__file__))
SCRIPT = os.path.abspath(__file__)
GLOBAL_BATCH = 4
FEATURES, HIDDEN, CLASSES = 8, 16, 3
VAL_SAMPLES = 8
PREEMPTED_FALLBACK = 75

STRATEGIES = (
    "single",
    "ddp",
    "fsdp",
    "fsdp_shard_grad_op",
    "fsdp_no_shard",
    "deepspeed_stage_1",
    "deepspeed_stage_2",
    "deepspeed_stage_3",
)
POINTS = ("step", "micro", "save_write", "save_commit", "save_prune", "validation", "epoch_end")
# "start" (kill right after the resume) is drawn from its own generator, so adding it kept earlier seeds' schedules.
START_PROBABILITY = 0.08


# =============================================================== the driver
def _driver(spec: Dict[str, Any], leg: int, root: str, fresh_seed: bool) -> None:
    import torch
    import torch.distributed as dist
    import torch.nn.functional as F
    from torch import nn
    from torch.utils.data import DataLoader, TensorDataset

    import shardwise
    from shardwise import Trainer, TrainModule
    from shardwise.callbacks import ModelCheckpoint
    from shardwise.distributed.context import current as launch_context

    keyed = spec["dropout"] == "keyed"

    def keyed_dropout(h: torch.Tensor, idx: torch.Tensor, epoch: int) -> torch.Tensor:
        # Integer hash of (sample, epoch, unit): the same mask whichever rank holds the sample.
        unit = torch.arange(h.shape[1], dtype=torch.int64)
        k = idx.to(torch.int64)[:, None] * 1_000_003 + epoch * 7_919 + unit[None, :] * 104_729 + spec["seed"]
        for _ in range(3):
            k = ((k ^ (k >> 13)) * 0x5BD1E995 + 0x27D4EB2F) & 0x7FFFFFFF
        keep = (k % 100 >= 25).to(h.dtype)
        return h * keep / 0.75

    class Net(TrainModule):
        def configure_model(self) -> None:
            self.inp = nn.Linear(FEATURES, HIDDEN)
            self.norm = nn.LayerNorm(HIDDEN)
            self.drop = nn.Dropout(0.25)
            self.out = nn.Sequential(nn.Linear(HIDDEN, HIDDEN), nn.GELU(), nn.Linear(HIDDEN, CLASSES))

        def forward(self, x, idx):
            h = torch.nn.functional.gelu(self.norm(self.inp(x)))
            if self.training:
                h = keyed_dropout(h, idx, self.trainer.current_epoch) if keyed else self.drop(h)
            return self.out(h)

        def training_step(self, batch, batch_idx):
            x, y, idx = batch
            return F.cross_entropy(self(x, idx), y)

        def validation_step(self, batch, batch_idx):
            x, y, idx = batch
            self.log("val_loss", F.cross_entropy(self(x, idx), y), sync_dist=True)

        def configure_optimizers(self):
            opt = torch.optim.AdamW(self.parameters(), lr=3e-3, weight_decay=0.1)
            sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0 / (1 + 0.05 * s))
            return {"optimizer": opt, "lr_scheduler": {"scheduler": sched, "interval": "step"}}

    class NoVal(Net):
        validation_step = None  # getattr(...) is not callable: no validation

    devices = spec["legs"][leg]["devices"] if leg >= 0 else spec["legs"][0]["devices"]
    per_rank = GLOBAL_BATCH // devices
    n_train = GLOBAL_BATCH * spec["batches_per_epoch"]
    g = torch.Generator().manual_seed(1000 + spec["seed"])
    train = TensorDataset(
        torch.randn(n_train, FEATURES, generator=g),
        torch.randint(0, CLASSES, (n_train,), generator=g),
        torch.arange(n_train),
    )
    val = TensorDataset(
        torch.randn(VAL_SAMPLES, FEATURES, generator=g),
        torch.randint(0, CLASSES, (VAL_SAMPLES,), generator=g),
        torch.arange(VAL_SAMPLES),
    )
    train_loader = DataLoader(train, batch_size=per_rank, shuffle=True)
    val_loader = DataLoader(val, batch_size=VAL_SAMPLES // devices) if spec["val"] != "none" else None

    losses_path = os.path.join(root, "losses.jsonl")

    def append(path: str, row: Dict[str, Any]) -> None:
        with open(path, "a") as fh:
            fh.write(json.dumps(row) + "\n")
            fh.flush()
            os.fsync(fh.fileno())

    class Recorder:
        """One line per optimizer step: the mean over the window's micro-batches and all ranks."""

        def __init__(self, tag: str) -> None:
            self.tag, self.window = tag, []

        def on_train_batch_end(self, trainer, module, outputs, batch, batch_idx) -> None:
            self.window.append(outputs.detach().float().reshape(()))
            if not trainer.is_last_microbatch:
                return
            value = torch.stack(self.window).mean()
            self.window = []
            if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
                dist.all_reduce(value)
                value = value / dist.get_world_size()
            if trainer.is_global_zero:
                append(
                    losses_path,
                    {
                        "run": self.tag,
                        "step": trainer.global_step,
                        "epoch": trainer.current_epoch,
                        "loss": float(value).hex(),
                    },
                )

    kill = spec["legs"][leg].get("kill") if leg >= 0 else None
    state: Dict[str, Any] = {"armed": False, "trainer": None, "threshold": 0}

    def rank() -> int:
        return int(os.environ.get("RANK", "0"))

    def trigger_rank() -> int:
        return 1 if kill["target"] == "rank1" else 0

    def due(step: Optional[int] = None) -> bool:
        if not state["armed"] or rank() != trigger_rank():
            return False
        trainer = state["trainer"]
        return (trainer.global_step if step is None else step) >= state["threshold"]

    def fire(where: str) -> None:
        state["armed"] = False
        trainer = state["trainer"]
        sig = getattr(signal, kill["signal"])
        append(
            os.path.join(root, "kills.jsonl"),
            {
                "leg": leg,
                "point": where,
                "step": trainer.global_step,
                "batch_idx": trainer.batch_idx,
                "epoch": trainer.current_epoch,
                "rank": rank(),
                "time": time.time(),
                # inside an accumulation window: a step is in progress
                "mid_window": where in ("micro", "validation") and not trainer.is_last_microbatch,
            },
        )
        launched = launch_context().launched_by_shardwise
        if kill["target"] == "launcher" and launched:
            os.kill(os.getppid(), sig)
            if sig == signal.SIGKILL:  # PR_SET_PDEATHSIG brings ours; do nothing until it arrives
                while True:
                    time.sleep(1)
        else:
            os.kill(os.getpid(), sig)

    class Killer:
        def on_train_start(self, trainer, module) -> None:
            state["trainer"] = trainer
            state["threshold"] = trainer.global_step + kill["after"]
            state["armed"] = True
            if kill["point"] == "start" and due():  # right after the resume, before any step
                fire("start")

        def on_train_batch_end(self, trainer, module, outputs, batch, batch_idx) -> None:
            if kill["point"] == "step" and trainer.is_last_microbatch and due():
                fire("step")
            elif kill["point"] == "micro" and not trainer.is_last_microbatch and due(trainer.global_step + 1):
                fire("micro")

        def on_validation_batch_end(self, trainer, module, outputs, batch, batch_idx) -> None:
            if kill["point"] == "validation" and due():
                fire("validation")

        def on_train_epoch_end(self, trainer, module) -> None:
            if kill["point"] == "epoch_end" and due():
                fire("epoch_end")

    callbacks: List[Any] = [Recorder("reference" if leg < 0 else f"leg{leg}")]
    ckpt = ModelCheckpoint(
        every_n_train_steps=spec["save_every"], save_top_k=spec["top_k"], every_n_epochs=spec["every_n_epochs"] or None
    )
    if kill is not None:
        _patch_saves(kill, state, due, fire)
        killer = Killer()
        callbacks += [killer, ckpt] if kill.get("before_ckpt") else [ckpt, killer]
    else:
        callbacks.append(ckpt)

    def fit(run_root: str, tag_leg: int, ckpt_path: Optional[str], seed: int) -> None:
        shardwise.seed_everything(seed)
        callbacks[0] = Recorder("reference" if tag_leg < 0 else f"leg{tag_leg}")
        trainer = Trainer(
            accelerator="cpu",
            devices=devices,
            strategy=spec["strategy"],
            max_steps=spec["max_steps"],
            accumulate_grad_batches=spec["accumulate"],
            val_check_interval=spec["val"] if isinstance(spec["val"], int) else None,
            logger=False,
            enable_progress_bar=False,
            default_root_dir=run_root,
            callbacks=callbacks
            if tag_leg >= 0
            else [
                callbacks[0],
                ModelCheckpoint(
                    every_n_train_steps=spec["save_every"],
                    save_top_k=spec["top_k"],
                    every_n_epochs=spec["every_n_epochs"] or None,
                ),
            ],
        )
        module = Net() if val_loader is not None else NoVal()
        trainer.fit(module, train_loader, val_loader, ckpt_path=ckpt_path)

    if leg < 0:
        fit(os.path.join(root, "reference"), -1, None, spec["seed"])
        return
    # A resumed leg seeds differently on purpose: everything must come from the checkpoint.
    fit(
        os.path.join(root, "run"),
        leg,
        "last" if leg > 0 else None,
        spec["seed"] + 977 * leg if fresh_seed else spec["seed"],
    )


def _patch_saves(kill: Dict[str, Any], state: Dict[str, Any], due, fire) -> None:
    """Kill points inside ModelCheckpoint's save: written-not-committed, committed-not-`last`, half-pruned."""
    import torch

    from shardwise.checkpoint import layout, training

    point = kill["point"]
    if point == "save_write":
        original = training.PendingCheckpoint.commit

        def commit(self):
            # every rank evaluates the same condition (global_step); only the trigger rank fires
            trainer = state["trainer"]
            if state["armed"] and trainer is not None and trainer.global_step >= state["threshold"]:
                if torch.distributed.is_initialized():
                    torch.distributed.barrier()  # every rank's part is written
                if due():
                    if kill["signal"] == "SIGKILL" and trainer.is_global_zero:
                        files = (
                            [os.path.join(r, f) for r, _, fs in os.walk(self.tmp) for f in fs]
                            if os.path.isdir(self.tmp)
                            else [self.tmp]
                        )
                        files = [f for f in files if os.path.isfile(f)]
                        if files:
                            victim = max(files, key=os.path.getsize)
                            with open(victim, "r+b") as fh:
                                fh.truncate(os.path.getsize(victim) // 2)
                    fire("save_write")
                else:
                    state["armed"] = False
            return original(self)

        training.PendingCheckpoint.commit = commit
    elif point == "save_commit":
        original_point = layout.point_last

        def point_last(directory, target, *args, **kwargs):
            if due():
                fire("save_commit")
            return original_point(directory, target, *args, **kwargs)

        layout.point_last = point_last
    elif point == "save_prune":
        original_remove = layout.remove_checkpoint

        def remove_checkpoint(path):
            name = os.path.basename(path)
            if due() and not layout.is_hidden_leftover(name) and os.path.exists(path) and not os.path.islink(path):
                trash = layout.temp_path(path, layout.new_token()).replace(layout._TEMP_MARK, layout._TRASH_MARK)
                os.rename(path, trash)
                fire("save_prune")
                return original_remove(trash)
            return original_remove(path)

        layout.remove_checkpoint = remove_checkpoint


def _driver_main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--spec", required=True, help="JSON file written by the harness")
    parser.add_argument("--leg", type=int, required=True, help="-1: the uninterrupted reference run")
    parser.add_argument("--root", required=True)
    parser.add_argument("--fresh-seed", action="store_true")
    parser.add_argument(
        "--then-reference",
        default=None,
        help="after the leg, run the uninterrupted reference into this root (saves a start-up)",
    )
    args = parser.parse_args()
    with open(args.spec) as fh:
        spec = json.load(fh)
    _driver(spec, args.leg, args.root, args.fresh_seed)
    if args.then_reference:
        _driver(spec, -1, args.then_reference, False)


# ============================================================ the schedules
def generate(seed: int, **override: Any) -> Dict[str, Any]:
    """A random schedule, a pure function of `seed` (and of the overrides, applied before dependent choices)."""
    rng = random.Random(seed)
    s: Dict[str, Any] = {"seed": seed}
    s["strategy"] = override.get("strategy") or rng.choice(STRATEGIES)
    s["accumulate"] = override.get("accumulate") or rng.choice([1, 1, 2, 3])
    steps_per_epoch = rng.choice([5, 6, 7])
    partial = rng.randrange(s["accumulate"])  # a last, shorter accumulation window at epoch end
    s["batches_per_epoch"] = override.get("batches_per_epoch") or steps_per_epoch * s["accumulate"] - partial
    s["max_steps"] = override.get("max_steps") or rng.randint(2 * steps_per_epoch + 2, 3 * steps_per_epoch + 3)
    s["val"] = override.get("val") or rng.choice(["none", "epoch", rng.choice([3, 4, 5])])
    s["save_every"] = override.get("save_every") or rng.choice([2, 3, 4, 5])
    s["top_k"] = override.get("top_k") or rng.choice([1, 2, 3, -1])
    s["every_n_epochs"] = override.get("every_n_epochs", rng.choice([0, 0, 1]))
    resumes = override.get("resumes") or rng.randint(1, 4)
    signals = override.get("signals") or ["SIGKILL", "SIGTERM"]
    multi = s["strategy"] != "single"
    worlds = override.get("worlds") or [rng.choice([1, 2]) if multi else 1 for _ in range(resumes + 1)]
    if multi and "worlds" not in override and rng.random() < 0.5:
        worlds = [2] * (resumes + 1)  # half the multi-rank schedules stay at one world size: bitwise
    legs = []
    budget = s["max_steps"] - 2
    for i in range(resumes):
        points = [
            p
            for p in POINTS
            if (p != "micro" or s["accumulate"] > 1)
            and (p != "validation" or s["val"] != "none")
            and (p != "save_prune" or s["top_k"] != -1)
        ]
        point = rng.choice(points)
        targets = ["rank0"] + (["rank1", "launcher"] if worlds[i] > 1 else [])
        if point in ("save_commit", "save_prune"):
            targets = [t for t in targets if t != "rank1"]  # rank 0 alone runs those
        after = rng.randint(1, max(1, min(s["max_steps"] // 2, budget // max(1, resumes - i))))
        if i > 0 and random.Random(f"{seed}-start-{i}").random() < START_PROBABILITY:
            point, after = "start", 0
        budget -= after + 1
        legs.append(
            {
                "devices": worlds[i],
                "kill": {
                    "point": point,
                    "after": after,
                    "target": rng.choice(targets),
                    "signal": rng.choice(signals),
                    "before_ckpt": rng.random() < 0.5,
                },
            }
        )
    legs.append({"devices": worlds[resumes], "kill": None})
    for i, leg in enumerate(override.get("kills", [])):  # explicit kills, for the fixed suite
        legs[i]["kill"].update(leg)
    s["legs"] = legs
    s["dropout"] = "keyed" if len(set(worlds)) > 1 else "rng"
    return s


def describe(s: Dict[str, Any]) -> str:
    legs = []
    for leg in s["legs"]:
        k = leg["kill"]
        legs.append(
            f"w{leg['devices']}" + (f":{k['signal']}@{k['point']}+{k['after']}->{k['target']}" if k else ":end")
        )
    return (
        f"seed={s['seed']} {s['strategy']} max_steps={s['max_steps']} acc={s['accumulate']} "
        f"batches/epoch={s['batches_per_epoch']} val={s['val']} every={s['save_every']} top_k={s['top_k']} "
        f"epochs={s['every_n_epochs']} dropout={s['dropout']} legs=[{' '.join(legs)}]"
    )


# ============================================================== the harness
def _env() -> Dict[str, str]:
    return {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONWARNINGS": "ignore", "DS_ACCELERATOR": "cpu"}


def _launch(
    spec_path: str, leg: int, root: str, fresh_seed: bool, timeout: float, then_reference: Optional[str] = None
) -> subprocess.CompletedProcess:
    cmd = [sys.executable, SCRIPT, "--spec", spec_path, "--leg", str(leg), "--root", root]
    if fresh_seed:
        cmd.append("--fresh-seed")
    if then_reference:
        cmd += ["--then-reference", then_reference]
    try:
        return subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env=_env(), cwd=root)
    except subprocess.TimeoutExpired as exc:
        return subprocess.CompletedProcess(cmd, -999, exc.stdout or "", (exc.stderr or "") + "\n[harness] TIMEOUT")


def _rows(root: str) -> List[Dict[str, Any]]:
    path = os.path.join(root, "losses.jsonl")
    if not os.path.exists(path):
        return []
    rows = []
    with open(path) as fh:
        for line in fh:
            try:
                rows.append(json.loads(line))
            except ValueError:  # a torn last line of a killed writer would be dropped here
                pass
    return rows


def preempted_exit_code() -> Optional[int]:
    """shardwise.distributed.PREEMPTED_EXIT_CODE once it exists (None before)."""
    try:
        import shardwise.distributed as d
    except ImportError:
        return None
    code = getattr(d, "PREEMPTED_EXIT_CODE", None)
    for name in ("env", "preempt"):
        if code is None:
            try:
                code = getattr(__import__(f"shardwise.distributed.{name}", fromlist=["x"]), "PREEMPTED_EXIT_CODE", None)
            except ImportError:
                pass
    return code


def _committed_step(ckpt_dir: str) -> Optional[int]:
    from shardwise.checkpoint import layout

    last = layout.latest_checkpoint(ckpt_dir)
    return None if last is None else int(layout.read_manifest(last)["global_step"])


def check_loadable(path: str) -> Optional[str]:
    """Read every tensor and the trainer state of the checkpoint at `path`; the error, or None."""
    import contextlib
    import io

    from shardwise.checkpoint import open_checkpoint

    try:
        with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(io.StringIO()):  # zero_to_fp32
            reader = open_checkpoint(path)
            names = [t.name for t in reader.tensors()]
            tensors = reader.read(names)
            state = reader.trainer_state()
        if set(tensors) != set(names):
            return f"{path}: read {len(tensors)} of {len(names)} tensors"
        if "train_state" not in state:
            return f"{path}: trainer state has no train_state"
    except Exception as exc:  # any error here is the finding
        return f"{path}: {type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}"
    return None


def _close(a: float, b: float, exact: bool) -> bool:
    return a == b if exact else abs(a - b) <= 1e-6 * max(abs(a), abs(b), 1e-12)


def run_schedule(
    spec: Dict[str, Any], workdir: str, timeout: float = 300.0, reference_cache: Optional[str] = None, log=print
) -> Dict[str, Any]:
    """Run a schedule's legs and its reference; return {"ok", "failures", "warnings", "legs", ...}."""
    from shardwise.checkpoint import layout

    os.makedirs(workdir, exist_ok=True)
    spec_path = os.path.join(workdir, "spec.json")
    with open(spec_path, "w") as fh:
        json.dump(spec, fh)
    failures: List[str] = []
    warnings_: List[str] = []
    ckpt_dir = os.path.join(workdir, "run", "checkpoints")
    preempt_code = preempted_exit_code()
    t0 = time.monotonic()
    legs_info = []
    sigterm = False
    # ----------------------------------------------- where the reference is
    ref_root = os.path.join(workdir, "ref")
    key = json.dumps(
        {**{k: v for k, v in spec.items() if k != "legs"}, "w0": spec["legs"][0]["devices"]}, sort_keys=True
    )
    cached = None
    if reference_cache:
        import hashlib

        os.makedirs(reference_cache, exist_ok=True)
        cached = os.path.join(reference_cache, hashlib.sha1(key.encode()).hexdigest()[:16])
        if os.path.exists(os.path.join(cached, "done")):
            ref_root = cached
    have_reference = ref_root == cached
    os.makedirs(ref_root, exist_ok=True)
    for i, leg in enumerate(spec["legs"]):
        kill = leg["kill"]
        committed_before = _committed_step(ckpt_dir) if i > 0 else None
        start = committed_before or 0
        # The final leg at the reference's world size runs the reference too, in the same processes.
        along = (
            ref_root if (kill is None and not have_reference and leg["devices"] == spec["legs"][0]["devices"]) else None
        )
        proc = _launch(
            spec_path, i, workdir, fresh_seed=committed_before is not None, timeout=timeout, then_reference=along
        )
        with open(os.path.join(workdir, f"leg{i}.log"), "w") as fh:
            fh.write(f"exit {proc.returncode}\n--- stdout\n{proc.stdout}\n--- stderr\n{proc.stderr}")
        kills = [k for k in _read_jsonl(os.path.join(workdir, "kills.jsonl")) if k["leg"] == i]
        info = {
            "leg": i,
            "devices": leg["devices"],
            "start": start,
            "code": proc.returncode,
            "fired": kills[0] if kills else None,
        }
        legs_info.append(info)
        tail = [_error_line(proc.stderr)]
        if kill is None:
            if proc.returncode != 0:
                own = [r["step"] for r in _rows(workdir) if r["run"] == f"leg{i}"]
                ref_steps = [r["step"] for r in _rows(ref_root) if r["run"] == "reference"] if along else []
                message = f"leg {i} (final, w{leg['devices']}, resumed from step {start}) exited {proc.returncode}"
                if along and own and max(own) == spec["max_steps"]:
                    # Its own training finished; the process died in the second fit() (the reference, ours, not
                    # the schedule's) or at exit after it. The reference is re-run alone below when incomplete, so
                    # the comparison stands: a warning, and chaos_bugs.md #8, not a resume failure.
                    warnings_.append(
                        f"{message} after finishing its own steps, in the reference fit() run next in "
                        f"the same processes ({len(ref_steps)} of {spec['max_steps']} reference steps "
                        f"recorded{', so at exit' if len(ref_steps) == spec['max_steps'] else ''}): "
                        f"{tail[0]}"
                    )
                else:
                    failures.append(f"{message}: {tail[0]}")
            continue
        if not kills:
            warnings_.append(
                f"leg {i}: kill point {kill['point']}+{kill['after']} never reached (exit {proc.returncode})"
            )
            if proc.returncode != 0:
                failures.append(f"leg {i} exited {proc.returncode} before its kill point: {' | '.join(tail)}")
        elif kill["signal"] == "SIGTERM":
            sigterm = True
            want = preempt_code if preempt_code is not None else PREEMPTED_FALLBACK
            if proc.returncode != want:
                failures.append(
                    f"[SIGTERM] leg {i}: SIGTERM to {kill['target']} at {kills[0]['point']} "
                    f"(step {kills[0]['step']}) exited {proc.returncode}, expected {want} "
                    f"(PREEMPTED_EXIT_CODE{'' if preempt_code is not None else ' not defined yet'})"
                    f": {tail[0]}"
                )
        elif proc.returncode == 0:
            failures.append(f"leg {i}: SIGKILL fired at {kills[0]['point']} but the leg exited 0")
        info["committed"] = _committed_step(ckpt_dir)
    elapsed_legs = time.monotonic() - t0

    # ----------------------------------------------------- the reference run
    def reference_done() -> bool:
        return len([r for r in _rows(ref_root) if r["run"] == "reference"]) == spec["max_steps"]

    if not have_reference:
        if not reference_done():  # not run along the final leg (another world size, or that leg failed)
            import shutil

            shutil.rmtree(ref_root, ignore_errors=True)
            os.makedirs(ref_root)
            proc = _launch(spec_path, -1, ref_root, fresh_seed=False, timeout=timeout)
            if proc.returncode != 0:
                failures.append(f"reference run exited {proc.returncode}: {proc.stderr.strip()[-800:]}")
        if cached and reference_done():
            import shutil

            shutil.rmtree(cached, ignore_errors=True)
            shutil.copytree(ref_root, cached, symlinks=True)
            open(os.path.join(cached, "done"), "w").close()
    reference = {r["step"]: r for r in _rows(ref_root) if r["run"] == "reference"}
    if sorted(reference) != list(range(1, spec["max_steps"] + 1)):
        failures.append(f"reference run recorded steps {sorted(reference)}")
    ran_along = (
        not have_reference
        and os.path.exists(os.path.join(ref_root, "reference"))
        and any(r["run"] == "reference" for r in _rows(ref_root))
        and legs_info[-1]["code"] == 0
    )

    # ---------------------------------------------------------------- losses
    rows = _rows(workdir)
    combined: List[int] = []
    w0 = spec["legs"][0]["devices"]
    exact = True
    for i, info in enumerate(legs_info):
        leg_rows = [r for r in rows if r["run"] == f"leg{i}"]
        steps = [r["step"] for r in leg_rows]
        exact = exact and spec["legs"][i]["devices"] == w0
        if steps and steps != list(range(info["start"] + 1, info["start"] + 1 + len(steps))):
            failures.append(f"leg {i} (resumed from committed step {info['start']}) recorded steps {steps}")
        upto = legs_info[i + 1]["start"] if i + 1 < len(legs_info) else spec["max_steps"]
        if i + 1 < len(legs_info):
            last_done = max(steps, default=info["start"])
            if upto > last_done:
                failures.append(f"leg {i}: committed step {upto} is ahead of the last step it recorded ({last_done})")
            kill = spec["legs"][i]["kill"]
            if kill and kill["signal"] == "SIGTERM" and info.get("fired") and upto < last_done:
                failures.append(
                    f"[SIGTERM] leg {i}: SIGTERM at {info['fired']['point']} (step {info['fired']['step']}) "
                    f"lost completed steps {upto + 1}..{last_done}: last committed step is {upto}"
                )
            if kill and kill["signal"] == "SIGTERM" and info.get("fired"):
                # Fired after step N completed: the contract is to stop at N (N+1 mid-window, or when the signal
                # went through the launcher and reached the workers a moment later).
                in_progress = info["fired"].get("mid_window", kill["point"] == "micro")
                allowed = info["fired"]["step"] + (1 if in_progress or kill["target"] == "launcher" else 0)
                if last_done > allowed:
                    warnings_.append(
                        f"[SIGTERM] leg {i}: SIGTERM at {info['fired']['point']} after step "
                        f"{info['fired']['step']} (to {kill['target']}), yet the leg ran on to step "
                        f"{last_done} before saving and exiting"
                    )
        combined += [s for s in steps if s <= upto]
        for r in leg_rows:
            ref = reference.get(r["step"])
            if ref is None:
                continue
            a, b = float.fromhex(r["loss"]), float.fromhex(ref["loss"])
            if not _close(a, b, exact) or r["epoch"] != ref["epoch"]:
                failures.append(
                    f"leg {i} (w{spec['legs'][i]['devices']}, resumed from step {info['start']}) "
                    f"step {r['step']}: loss {a!r} epoch {r['epoch']} vs uninterrupted {b!r} epoch "
                    f"{ref['epoch']} ({'bitwise' if exact else 'rel 1e-6'})"
                )
                break  # the first divergence of a leg is the finding; later ones follow from it
    if ran_along and any(" vs uninterrupted " in f for f in failures):
        # The reference ran in the final leg's processes: confirm it alone, so that state leaking from one
        # fit() into the next in a process is told apart from a resume bug.
        alone = os.path.join(workdir, "ref-alone")
        os.makedirs(alone, exist_ok=True)
        _launch(spec_path, -1, alone, fresh_seed=False, timeout=timeout)
        solo = {r["step"]: r["loss"] for r in _rows(alone) if r["run"] == "reference"}
        if solo != {s_: r["loss"] for s_, r in reference.items()}:
            failures.append(
                "the reference run alone differs from the reference run after a resumed fit() in the "
                "same processes: state leaks from one fit() into the next"
            )
    missing = sorted(set(range(1, spec["max_steps"] + 1)) - set(combined))
    dup = sorted({s for s in combined if combined.count(s) > 1})
    if missing or dup:
        failures.append(f"combined record: missing steps {missing}, duplicated steps {dup}")

    # ----------------------------------------------------------- checkpoints
    if os.path.isdir(ckpt_dir):
        leftovers = [n for n in os.listdir(ckpt_dir) if layout.is_hidden_leftover(n)]
        if leftovers:
            failures.append(f"hidden temporary entries left after the final leg: {leftovers}")
    final_start = legs_info[-1]["start"]
    got = layout.list_checkpoints(ckpt_dir)
    ref_kept = sorted(e.step for e in layout.list_checkpoints(os.path.join(ref_root, "reference", "checkpoints")))
    last = os.path.join(ckpt_dir, layout.LAST_NAME)
    last_step = _committed_step(ckpt_dir) if os.path.exists(last) else None
    if last_step != spec["max_steps"]:
        failures.append(
            f"last.ckpt points at step {last_step}, expected the final step {spec['max_steps']} "
            f"(uninterrupted run keeps steps {ref_kept})"
        )
    got_steps = [e.step for e in got]
    required = sorted(s for s in ref_kept if s > final_start)
    absent = [s for s in required if s not in got_steps]
    if absent:
        failures.append(
            f"checkpoints of steps {absent} missing: the uninterrupted run keeps {ref_kept}, "
            f"this one has {sorted(got_steps)} (final leg started at {final_start})"
        )
    stray = sorted(set(got_steps) - set(ref_kept)) + sorted({s for s in got_steps if got_steps.count(s) > 1})
    if stray:
        warnings_.append(
            f"checkpoints the uninterrupted run does not keep: steps {stray} "
            f"({sorted(os.path.basename(e.path) for e in got)})"
        )
    for entry in got:
        error = check_loadable(entry.path)
        if error:
            failures.append(f"checkpoint not loadable: {error}")
    result = {
        "ok": not failures,
        "failures": failures,
        "warnings": warnings_,
        "legs": legs_info,
        "sigterm": sigterm,
        "seconds": round(time.monotonic() - t0, 1),
        "legs_seconds": round(elapsed_legs, 1),
        "schedule": describe(spec),
    }
    return result


def _error_line(stderr: str) -> str:
    """The exception a failed leg died with (its last 'XxxError: ...' line), else its last line."""
    lines = [ln.strip() for ln in stderr.strip().splitlines() if ln.strip()]
    lines = [ln.split("]:", 1)[1].strip() if ln.startswith("[rank") and "]:" in ln else ln for ln in lines]
    errors = [ln for ln in lines if re.match(r"^[\w.]+(Error|Exception|Interrupt)\b.*", ln) or "terminate called" in ln]
    line = (errors or lines or ["(no stderr)"])[-1]
    return line if len(line) <= 400 else line[:400] + "..."


def _read_jsonl(path: str) -> List[Dict[str, Any]]:
    if not os.path.exists(path):
        return []
    with open(path) as fh:
        return [json.loads(line) for line in fh if line.strip().endswith("}")]


if __name__ == "__main__":
    _driver_main()

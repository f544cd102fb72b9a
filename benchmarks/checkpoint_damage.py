"""Damage every file of every checkpoint format at random; each must be refused by name, nothing loaded.

    python benchmarks/checkpoint_damage.py --seed 0 [--rounds 3] [--formats ddp,fsdp_full,fsdp_sharded,deepspeed]

Issue 27's campaign as a script. For each format -- one file from DDP, one
file from FSDP with state_dict_type="full", an FSDP sharded (DCP) directory,
a DeepSpeed ZeRO-2 directory -- two runs ("a" and "b", other seeds) train 6
steps with a checkpoint every 3. Then, `--rounds` times for every file of
run a's step-6 checkpoint and every kind of damage:

- flip: XOR one byte at a random offset with a random non-zero mask;
- truncate: cut the file to a random shorter length;
- delete: remove the file;
- replace: put run b's file of the same name in its place (skipped when the
  two are byte-identical, e.g. DCP's .metadata of the same model);
- edit: change a field (global_step, epoch, batch_idx, run_id) of the
  manifest or the trainer state, at random with or without re-sealing the
  manifest and recomputing the file's digest, as a forger would; in files
  without fields (tensor data), a flip;

a copy of run a's directory is damaged and then resumed with
fit(ckpt_path=<the checkpoint>) and fit(ckpt_path="last"), inspected and
converted. Each must end in a named checkpoint error (not a bare CheckpointError, never a
torch or pickle one), with the model as it was initialised and no
on_load_checkpoint called, and `shardwise inspect` / `convert` must exit 1.
Two outcomes are right and not refusals: another run's one-file checkpoint
passed explicitly loads (it is sound, and asking for it by path is how one
resumes from another run), and a deleted one-file checkpoint leaves `last`
to fall back to the run's previous checkpoint (step 3).
tests/unit/test_checkpoint_integrity.py imports this module (pyproject's
pytest pythonpath) and runs one round of the three fast formats in the
suite; DeepSpeed runs in a launched worker (engine start-up is slow).
"""

from __future__ import annotations

import argparse
import json
import os
import random
import shutil
import sys
import tempfile
import time
from dataclasses import dataclass
from typing import Any, Dict, List, Optional

import torch
import torch.distributed as dist

HERE = os.path.dirname(os.path.abspath(__file__))
if os.path.join(HERE, "..", "tests") not in sys.path:  # helpers.checkpoints, when run as a script
    sys.path.insert(0, os.path.join(HERE, "..", "tests"))

import shardwise  # noqa: E402
from shardwise import FSDPStrategy, Trainer  # noqa: E402
from shardwise.callbacks import ModelCheckpoint  # noqa: E402
from shardwise.checkpoint import errors, onefile  # noqa: E402
from shardwise.checkpoint.integrity import MANIFEST_NAME, seal  # noqa: E402
from shardwise.cli import main as cli_main  # noqa: E402

from helpers.checkpoints import Net, loader  # noqa: E402

FAST_FORMATS = ("ddp", "fsdp_full", "fsdp_sharded")
FORMATS = FAST_FORMATS + ("deepspeed",)
KINDS = ("flip", "truncate", "delete", "replace", "edit")
STEPS, EVERY = 6, 3
TARGET = f"epoch=0-step={STEPS}.ckpt"
FIELDS = ("global_step", "epoch", "batch_idx", "run_id")
# What a refusal may be: the specific errors, never the CheckpointError base class itself.
NAMED = (errors.CorruptCheckpointError, errors.CheckpointNotFoundError, errors.ForeignCheckpointError)


def strategy_for(fmt: str) -> Any:
    if fmt == "ddp":
        return "ddp"
    if fmt == "fsdp_full":
        return FSDPStrategy(state_dict_type="full")
    if fmt == "fsdp_sharded":
        return FSDPStrategy()
    from shardwise.strategies.deepspeed import DeepSpeedStrategy

    return DeepSpeedStrategy(stage=2)


class Spy:
    """Records whether a checkpoint was loaded (and which step), and the weights when fit() failed."""

    def __init__(self) -> None:
        self.loaded: Optional[Dict[str, Any]] = None
        self.at_failure: Optional[Dict[str, torch.Tensor]] = None

    def on_load_checkpoint(self, trainer: Any, module: Any, checkpoint: Dict[str, Any]) -> None:
        self.loaded = dict(checkpoint.get("train_state") or {})

    def on_exception(self, trainer: Any, module: Any, exc: BaseException) -> None:
        if module is not None:
            self.at_failure = weights(module)


def weights(module: torch.nn.Module) -> Dict[str, torch.Tensor]:
    out = {}
    for name, p in module.named_parameters():
        t = p.full_tensor() if hasattr(p, "full_tensor") else p
        out[name] = t.detach().cpu().clone()
    return out


def train(root: str, fmt: str, seed: int, ckpt_path: Optional[str] = None, spy: Optional[Spy] = None) -> None:
    """fit() one run of `fmt` into `root` (6 steps, a checkpoint every 3); the error, if any, propagates."""
    shardwise.seed_everything(seed)
    spy = spy or Spy()
    trainer = Trainer(
        accelerator="cpu",
        devices=1,
        strategy=strategy_for(fmt),
        max_steps=STEPS,
        logger=False,
        enable_progress_bar=False,
        default_root_dir=root,
        callbacks=[spy, ModelCheckpoint(every_n_train_steps=EVERY, save_top_k=-1)],
    )
    try:
        trainer.fit(Net("adamw"), loader(), ckpt_path=ckpt_path)
    finally:
        _release_group()


_OWN_GROUP = [True]  # False in a launched worker (_worker), whose group outlives each Trainer


def _release_group() -> None:
    # FSDP on one process creates its own gloo group; the next Trainer makes a new one.
    if _OWN_GROUP[0] and dist.is_initialized():
        dist.destroy_process_group()


@dataclass
class Built:
    fmt: str
    a: str  # run a's root directory (its checkpoints/ holds steps 3 and 6, last -> 6)
    b: str
    fresh: Dict[str, torch.Tensor]  # the weights a run starts with before any checkpoint is loaded
    files: List[str]  # the files of the step-6 checkpoint ("" for a one-file checkpoint)


def build(root: str, fmt: str) -> Built:
    a, b = os.path.join(root, fmt, "a"), os.path.join(root, fmt, "b")
    train(a, fmt, seed=1)
    train(b, fmt, seed=2)
    # The weights at the moment a load fails when nothing at all was loaded (a missing path).
    spy = Spy()
    try:
        train(os.path.join(root, fmt, "fresh"), fmt, SEED_UNDER_TEST, os.path.join(root, "no-such.ckpt"), spy)
    except errors.CheckpointNotFoundError:
        pass
    assert spy.at_failure is not None
    fresh = spy.at_failure
    target = os.path.join(a, "checkpoints", TARGET)
    files = [""] if os.path.isfile(target) else sorted(_walk(target))
    return Built(fmt, a, b, fresh, files)


SEED_UNDER_TEST = 7  # every damaged load starts from this seed, as the fresh reference does


def _walk(directory: str) -> List[str]:
    return [os.path.relpath(os.path.join(r, f), directory) for r, _, fs in os.walk(directory) for f in fs]


# ------------------------------------------------------------------ damage
def _flip(rng: random.Random, path: str) -> str:
    size = os.path.getsize(path)
    offset = rng.randrange(size)
    mask = rng.randrange(1, 256)
    with open(path, "r+b") as fh:
        fh.seek(offset)
        byte = fh.read(1)[0]
        fh.seek(offset)
        fh.write(bytes([byte ^ mask]))
    return f"flipped byte {offset} of {size} (xor {mask:#04x})"


def _edited(rng: random.Random, value: Any, field: str) -> Any:
    if field == "run_id":
        return os.urandom(6).hex()
    return int(value) + rng.choice([1, 2, -1])


def _edit_one_file(rng: random.Random, path: str) -> str:
    with open(path, "rb") as fh:
        data = fh.read()
    comment = onefile.archive_comment(path)
    raw = data[: len(data) - len(comment) - 2] + b"\0\0"  # torch's own bytes, comment length 0 again
    manifest = onefile.parse_trailer(path, comment).manifest
    field = rng.choice(FIELDS)
    how = rng.choice(["trailer", "trailer, re-digested", "pickled, re-digested"])
    if how.startswith("trailer"):
        manifest = {**manifest, field: _edited(rng, manifest[field], field)}
    else:  # the state's own copy, the file re-written as a forger would, with a valid digest
        payload = torch.load(path, weights_only=True)
        section = "train_state" if field in payload.get("train_state", {}) else "shardwise"
        payload[section][field] = _edited(rng, payload[section][field], field)
        buffer = _Buffer()
        torch.save(payload, buffer)
        raw = bytes(buffer.data)
    with open(path, "wb") as fh:
        writer = onefile.TrailerWriter(fh)
        writer.write(raw)
        writer.finish(manifest)
    if how == "trailer":  # the digest recorded before the edit, as if only the JSON had been changed
        with open(path, "r+b") as fh:
            fh.seek(-onefile.HEX_LEN, os.SEEK_END)
            fh.write(data[-onefile.HEX_LEN :])
    return f"edited {field} ({how})"


class _Buffer:
    def __init__(self) -> None:
        self.data = bytearray()

    def write(self, chunk: Any) -> int:
        self.data += bytes(chunk)
        return len(chunk)

    def flush(self) -> None:
        pass


def _edit_json(rng: random.Random, path: str, manifest_file: bool) -> str:
    with open(path) as fh:
        content = json.load(fh)
    candidates = [f for f in FIELDS if f in content] if manifest_file else []
    if not candidates:  # deepspeed.json: any top-level field
        field = rng.choice(sorted(k for k in content if isinstance(content[k], int)) or sorted(content))
        content[field] = _edited(rng, 0, "x") if isinstance(content[field], int) else "edited"
        resealed = False
    else:
        field = rng.choice(candidates)
        content[field] = _edited(rng, content[field], field)
        resealed = rng.random() < 0.5
        if resealed:
            content = seal(content)
    with open(path, "w") as fh:
        json.dump(content, fh)
    return f"edited {field}" + (" and re-sealed the manifest" if resealed else "")


def _edit_torch(rng: random.Random, path: str) -> str:
    payload = torch.load(path, weights_only=True)
    field = rng.choice([f for f in FIELDS if f in payload.get("train_state", {})])
    payload["train_state"][field] = _edited(rng, payload["train_state"][field], field)
    torch.save(payload, path)
    return f"edited train_state.{field}"


def damage(rng: random.Random, kind: str, ckpt: str, rel: str, other: str) -> Optional[str]:
    """Apply `kind` to file `rel` of checkpoint `ckpt` ("" = the one file); what was done, or None when
    the damage would change nothing (run b's file is byte-identical)."""
    path = os.path.join(ckpt, rel) if rel else ckpt
    if kind == "flip":
        return _flip(rng, path)
    if kind == "truncate":
        size = os.path.getsize(path)
        length = rng.randrange(size)
        with open(path, "r+b") as fh:
            fh.truncate(length)
        return f"truncated {size} -> {length} bytes"
    if kind == "delete":
        os.remove(path)
        return "deleted"
    if kind == "replace":
        source = os.path.join(other, rel) if rel else other
        with open(source, "rb") as a, open(path, "rb") as b:
            if a.read() == b.read():
                return None
        shutil.copyfile(source, path)
        return "replaced by run b's"
    if not rel:
        return _edit_one_file(rng, path)
    name = os.path.basename(rel)
    if name.endswith(".json"):
        return _edit_json(rng, path, name == MANIFEST_NAME)
    if name == "trainer_state.pt":
        return _edit_torch(rng, path)
    if name == "latest":  # DeepSpeed's tag file
        with open(path, "w") as fh:
            fh.write("global_step999")
        return "edited the tag"
    return _flip(rng, path) + " (no fields: a flip)"


# ------------------------------------------------------------------ checking
@dataclass
class Outcome:
    fmt: str
    rel: str
    kind: str
    what: str
    results: Dict[str, str]
    problems: List[str]

    @property
    def ok(self) -> bool:
        return not self.problems


def _refused(built: Built, root: str, ckpt_path: str) -> tuple:
    """(what happened, problem) of fit(ckpt_path=...) on the damaged copy: problem is None for a
    refusal by name with nothing loaded, the Spy when it loaded, else what was wrong."""
    spy = Spy()
    error: Optional[BaseException] = None
    try:
        train(root, built.fmt, SEED_UNDER_TEST, ckpt_path, spy)
    except BaseException as exc:  # noqa: B036 - the point is which exception, whatever it is
        if isinstance(exc, KeyboardInterrupt):
            raise
        error = exc
    if error is None:
        return f"loaded step {(spy.loaded or {}).get('global_step')}", spy
    text = f"{type(error).__name__}"
    if not isinstance(error, NAMED):
        return text, f"{ckpt_path}: {type(error).__name__} is not a named checkpoint error: {error}"
    if spy.loaded is not None:
        return text, f"{ckpt_path}: refused after on_load_checkpoint ran"
    changed = [k for k in built.fresh if not torch.equal(built.fresh[k], (spy.at_failure or {}).get(k))]
    if changed:
        return text, f"{ckpt_path}: refused, but the weights changed ({changed[:3]})"
    return text, None


def run_case(built: Built, work: str, rel: str, kind: str, rng: random.Random) -> Optional[Outcome]:
    root = os.path.join(work, f"{built.fmt}-{kind}-{rel.replace('/', '_') or 'file'}-{rng.randrange(10**6)}")
    shutil.copytree(built.a, root, symlinks=True)
    ckpt = os.path.join(root, "checkpoints", TARGET)
    what = damage(rng, kind, ckpt, rel, os.path.join(built.b, "checkpoints", TARGET))
    if what is None:
        shutil.rmtree(root)
        return None
    one_file = not rel
    results: Dict[str, str] = {}
    problems: List[str] = []
    # inspect and convert first: a fit that falls back to an earlier checkpoint saves new ones.
    for command in ("inspect", "convert"):
        argv = [command, ckpt] + ([os.path.join(root, "out")] if command == "convert" else [])
        status = _quiet(lambda: cli_main(argv))
        results[command] = f"exit {status}"
        expected = 0 if (command == "convert" and one_file and kind == "replace") else 1
        if status != expected:
            problems.append(f"{command}: exit {status}, expected {expected}")
    for how, path in (("explicit", ckpt), ("last", "last")):
        text, result = _refused(built, root, path)
        results[how] = text
        # The two right outcomes that are not refusals (see the module docstring).
        expected_load = (
            {
                ("replace", "explicit"): f"loaded step {STEPS}",
                ("delete", "last"): f"loaded step {EVERY}",
            }.get((kind, how))
            if one_file
            else None
        )
        if isinstance(result, Spy):  # it loaded
            if text != expected_load:
                problems.append(f"{how}: {text}: the damaged checkpoint was not refused")
        elif result is not None:
            problems.append(f"{how}: {result}")
        elif expected_load:
            problems.append(f"{how}: refused ({text}) but should have {expected_load}")
    shutil.rmtree(root, ignore_errors=True)
    return Outcome(built.fmt, rel or "(the file)", kind, what, results, problems)


def _quiet(fn: Any) -> Any:
    """Run fn with stdout / stderr (the CLI's report) sent to /dev/null."""
    import contextlib
    import io

    with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(io.StringIO()):
        return fn()


def cases(built: Built, work: str, rng: random.Random, kinds: Any = KINDS) -> List[Outcome]:
    """One random case of each kind (of `kinds`) for every file of `built`'s checkpoint."""
    import warnings

    outcomes: List[Outcome] = []
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # discovery and torch warn along the way; the outcomes are the point
        for rel in built.files:
            for kind in kinds(rng) if callable(kinds) else kinds:
                outcome = run_case(built, work, rel, kind, rng)
                if outcome is not None:
                    outcomes.append(outcome)
    return outcomes


def campaign(root: str, formats: List[str], seed: int, rounds: int, kinds: Any = KINDS) -> List[Outcome]:
    """Build each format once, then `rounds` random cases of every (file, kind)."""
    rng = random.Random(seed)
    outcomes: List[Outcome] = []
    for fmt in formats:
        built = build(root, fmt)
        for _ in range(rounds):
            outcomes += cases(built, os.path.join(root, "work"), rng, kinds)
    return outcomes


def render(outcomes: List[Outcome]) -> str:
    lines = ["| format | kind | cases | as expected | explicit fit | fit('last') |", "|---|---|---|---|---|---|"]
    groups: Dict[tuple, List[Outcome]] = {}
    for o in outcomes:
        groups.setdefault((o.fmt, o.kind), []).append(o)
    for (fmt, kind), group in groups.items():
        tally = {
            how: ", ".join(
                f"{name} x{n}" for name, n in sorted(_count(o.results[how].split(" step")[0] for o in group).items())
            )
            for how in ("explicit", "last")
        }
        good = sum(o.ok for o in group)
        lines.append(f"| {fmt} | {kind} | {len(group)} | {good} | {tally['explicit']} | {tally['last']} |")
    return "\n".join(lines)


def _count(items: Any) -> Dict[str, int]:
    out: Dict[str, int] = {}
    for item in items:
        out[item] = out.get(item, 0) + 1
    return out


def campaign_in_worker(root: str, formats: List[str], seed: int, rounds: int, sample: int = 0) -> List[Dict[str, Any]]:
    """In a launched worker (DeepSpeed): the campaign, as plain dicts; `sample` kinds per file (0: all)."""
    _OWN_GROUP[0] = False  # the launcher's group (or the first strategy's) serves every Trainer here
    kinds = (lambda rng: rng.sample(KINDS, sample)) if sample else KINDS
    return [o.__dict__ for o in campaign(root, formats, seed, rounds, kinds)]


def main() -> int:
    parser = argparse.ArgumentParser(description="random damage to every checkpoint file of every format")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--rounds", type=int, default=3, help="random cases per (format, file, kind)")
    parser.add_argument("--formats", default=",".join(FORMATS))
    args = parser.parse_args()
    formats = [f for f in args.formats.split(",") if f]
    start = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="shardwise-damage-") as root:
        outcomes = campaign(root, [f for f in formats if f != "deepspeed"], args.seed, args.rounds)
        if "deepspeed" in formats:  # the engine in a worker process, as the Trainer would launch it
            entries = shardwise.launch(campaign_in_worker, root, ["deepspeed"], args.seed, args.rounds, devices=1)
            outcomes += [Outcome(**entry) for entry in entries[0]]
    print(render(outcomes))
    bad = [o for o in outcomes if not o.ok]
    for o in bad:
        print(f"UNEXPECTED {o.fmt} {o.rel} {o.kind} ({o.what}): {'; '.join(o.problems)}")
    print(
        f"{len(outcomes)} cases, seed {args.seed}, {len(bad)} unexpected, {time.perf_counter() - start:.0f} s "
        f"({os.cpu_count()} CPU cores, torch {torch.__version__})"
    )
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())

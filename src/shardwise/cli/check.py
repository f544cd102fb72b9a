"""`shardwise check`: prove that a TrainModule trains the same on N ranks as on one process, before renting GPUs.

    shardwise check mypkg.models.LanguageModel --strategy fsdp --devices 2 --accumulate_grad_batches 2
    shardwise check train.py --init_args.n_layer 2 --batch_size 4
    shardwise check python:mypkg.MinGPT --init_args.config.n_layer 2 --data.class_path mypkg.Tokens
    shardwise check mypkg.MoEModel --strategy fsdp --devices 4 --ep_size 2   # dp 2 x ep 2 vs one process
    shardwise check --config check.yaml
    shardwise check fingerprints run_a/ run_b/      # two runs' BatchFingerprint files: the same data per step?

The module is an import path (`pkg.mod.Class`, `python:` optional) or a
script (`train.py`, `train.py:Class`; imported, so its `if __name__ ==
"__main__":` part does not run). Its init args are typed against its
signature: `--init_args.NAME VALUE`, nested fields `--init_args.config.n_layer
2`, or `init_args:` in the YAML; this is how a large model is checked at a
small size. The data is `--data` (a Dataset class path and init args, as in
`shardwise fit`) or the module's own train_dataloader().

It trains `--steps` optimizer steps on `--devices` CPU processes (gloo, fp32)
under `--strategy`, micro-batch `--batch_size` and `--accumulate_grad_batches`,
and the same steps on one process with the global batch, from the same seed
(see shardwise/scaling). Exit status: 0 when the runs are equivalent within
the tolerances the report states, 1 when they are not (the verdict names the
first cause found and its fix) or a worker failed, 2 for a usage mistake.

`shardwise check fingerprints A B` trains nothing: it compares two runs' per-step
global batch fingerprints (callbacks/fingerprint.py; a folder or its
batch_fingerprints.jsonl) and exits 0 when every step both took saw the same
global batch -- a resumed run, or one on another number of processes, against
the uninterrupted one.
"""

from __future__ import annotations

import json as _json
from typing import Any, Dict, List, Optional

from jsonargparse import ActionConfigFile, ArgumentParser

_INIT_ARGS = "--init_args."


def parser() -> ArgumentParser:
    from torch.utils.data import Dataset

    p = ArgumentParser(
        description="Check that a TrainModule trains the same on N ranks (any strategy, accumulation) as on one "
        "process with the same global batch: per-step losses, parameters, each rank's samples, buffers."
    )
    p.add_argument("--config", action=ActionConfigFile, help="YAML file with any of the options below")
    p.add_argument(
        "target",
        type=str,
        help="the TrainModule: pkg.mod.Class, python:pkg.mod.Class, train.py or train.py:Class; or `fingerprints`",
    )
    p.add_argument(
        "runs",
        type=str,
        nargs="*",
        default=[],
        help="after `fingerprints`: the two runs to compare (folders or batch_fingerprints.jsonl files)",
    )
    p.add_argument(
        "--init_args",
        type=Optional[Dict[str, Any]],
        default=None,
        help="the module's init args, e.g. --init_args.n_layer 2 (a smaller config of a large model)",
    )
    p.add_subclass_arguments(
        Dataset, "data", required=False, help="training Dataset (default: the module's train_dataloader())"
    )
    p.add_argument(
        "--batch_size", type=Optional[int], default=None, help="micro-batch per rank (default: the loader's)"
    )
    p.add_argument("--shuffle", type=Optional[bool], default=None, help="shuffle a --data Dataset (default: true)")
    p.add_argument(
        "--strategy",
        type=str,
        default="ddp",
        help="a strategy name (fsdp, ddp, deepspeed_stage_3, ...) or python:m.attr",
    )
    p.add_argument("--devices", type=int, default=2, help="data-parallel ranks (local CPU processes)")
    p.add_argument(
        "--ep_size",
        type=int,
        default=1,
        help="expert parallel degree for a mixture-of-experts module (FSDP): the experts split over ep of the "
        "--devices ranks, e.g. --devices 4 --ep_size 2 checks dp 2 x ep 2 against one process",
    )
    p.add_argument("--accumulate_grad_batches", type=int, default=1, help="micro-batches per optimizer step")
    p.add_argument("--steps", type=int, default=3, help="optimizer steps in each run")
    p.add_argument("--seed", type=int, default=42, help="seed of both runs")
    p.add_argument("--loss_rtol", type=float, default=1e-5, help="tolerance on each step's loss (relative)")
    p.add_argument(
        "--param_rtol", type=float, default=1e-5, help="tolerance on ||P_N - P_1|| / ||P_1|| after the steps"
    )
    p.add_argument("--json", type=bool, default=False, help="print the report as JSON")
    return p


def translate(args: List[str]) -> List[str]:
    """`--init_args.config.n_layer 2` (a field of a nested init arg) -> `--init_args.config '{"n_layer": 2}'`.

    jsonargparse reads one level of `--init_args.NAME`; deeper names are merged here, per top-level name.
    """
    import yaml

    out: List[str] = []
    nested: Dict[str, Dict[str, Any]] = {}
    i = 0
    while i < len(args):
        name, eq, value = args[i].partition("=")
        keys = name[len(_INIT_ARGS) :].split(".") if name.startswith(_INIT_ARGS) else []
        if len(keys) < 2:
            out.append(args[i])
            i += 1
            continue
        if not eq:
            value = args[i + 1] if i + 1 < len(args) else ""
            i += 1
        node = nested.setdefault(keys[0], {})
        for key in keys[1:-1]:
            node = node.setdefault(key, {})
        node[keys[-1]] = yaml.safe_load(value)
        i += 1
    for key, value in nested.items():
        out += [_INIT_ARGS + key, _json.dumps(value)]
    return out


def _strategy(value: str) -> Any:
    """A strategy name as it is, or python:module.attr: a Strategy / ParallelPlan, or a function returning one."""
    if not value.startswith("python:"):
        return value
    from shardwise.scaling.target import load_target
    from shardwise.strategies import ParallelPlan, Strategy

    obj = load_target(value)
    return obj if isinstance(obj, (Strategy, ParallelPlan)) else obj()


def _with_experts(strategy: Any, ep: int) -> Any:
    """The strategy with expert parallel of degree `ep` (a name or a plan; a strategy object carries its own)."""
    if ep == 1:
        return strategy
    from dataclasses import replace

    from shardwise.strategies import ParallelPlan

    if isinstance(strategy, str):
        strategy = ParallelPlan.from_name(strategy)
    if not isinstance(strategy, ParallelPlan):
        raise ValueError(
            f"--ep_size {ep} with a strategy object: give it the degree itself (FSDPStrategy(ep_size={ep})) and "
            "leave --ep_size out."
        )
    return replace(strategy, ep=ep)


def _compare_fingerprints(paths: List[str]) -> int:
    from shardwise.callbacks.fingerprint import compare_fingerprints, read_fingerprints

    if len(paths) != 2:
        raise ValueError(f"check fingerprints takes two runs (folders or .jsonl files), got {len(paths)}: {paths}.")
    same, sentence = compare_fingerprints(read_fingerprints(paths[0]), read_fingerprints(paths[1]))
    print(sentence)
    return 0 if same else 1


def run(cfg: Any) -> int:
    if cfg.target == "fingerprints":
        return _compare_fingerprints(cfg.runs)
    if cfg.runs:
        raise ValueError(f"shardwise check takes one TrainModule, got {[cfg.target, *cfg.runs]}.")
    from shardwise.scaling import check

    p = parser()
    init = (getattr(p, "instantiate", None) or p.instantiate_classes)(cfg)  # jsonargparse < 4.49: the old name
    report = check(
        cfg.target,
        init.get("data"),
        init_args=cfg.init_args,
        strategy=_with_experts(_strategy(cfg.strategy), cfg.ep_size),
        devices=cfg.devices,
        accumulate_grad_batches=cfg.accumulate_grad_batches,
        batch_size=cfg.batch_size,
        shuffle=cfg.shuffle,
        steps=cfg.steps,
        seed=cfg.seed,
        loss_rtol=cfg.loss_rtol,
        param_rtol=cfg.param_rtol,
    )
    print(_json.dumps(report.to_dict(), indent=2) if cfg.json else report.format())
    return 0 if report.ok else 1

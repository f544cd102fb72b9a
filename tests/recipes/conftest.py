"""One 2-process launch for the recipe files' 2-process runs (test_finetune_deepspeed.py,
test_finetune_parallel.py, test_finetune_trl.py, test_lora.py, test_lora_checkpoint.py,
test_moe_expert_parallel.py, test_qlora.py).

Each of these files fine-tunes in 2 launched processes, and starting them (each worker imports transformers,
DeepSpeed, PEFT, bitsandbytes) costs more than their runs. The session fixture `recipe_runs` runs the runs of every such
file whose selected tests need them in one launch, one file after another, and hands each file its ranks'
results. A file takes part by defining `shared_launch(root)`: (its assets, the module-level function the
workers run, that function's arguments). Each file's function runs as it would in a launch of its own: a
process group it leaves is taken down before the next file's runs, with the group references DeepSpeed
derived from it (tests/helpers/shared_launch.py).
"""

from __future__ import annotations

import pytest


@pytest.fixture(scope="session")
def recipe_runs(request, tmp_path_factory):
    """module name -> (assets, [each rank's return value]) for the selected files with `shared_launch`."""
    import shardwise

    from helpers.shared_launch import run_in_turn

    modules = []  # the files whose selected tests need their runs (a refusal test alone starts nothing)
    for item in request.session.items:
        module = getattr(item, "module", None)
        if hasattr(module, "shared_launch") and "recipe_runs" in item.fixturenames and module not in modules:
            modules.append(module)
    assets, jobs = {}, []
    for module in sorted(modules, key=lambda m: m.__name__):  # the same order however the files were named
        root = tmp_path_factory.mktemp(module.__name__.rsplit(".", 1)[-1])
        assets[module.__name__], fn, args = module.shared_launch(root)
        jobs.append((fn, args))
    ranks = shardwise.launch(run_in_turn, jobs, devices=2)
    return {name: (assets[name], [rank[i] for rank in ranks]) for i, name in enumerate(assets)}

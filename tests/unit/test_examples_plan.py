"""The shipped 70B example is a configuration the memory planner says fits (issue 15).

examples/slurm/llama_70b_chat.yaml runs on 2 nodes x 8 A100-80GB
(examples/slurm/finetune_llama.sbatch). The planner is asked about exactly
its settings: the model it names (the llama-2-70b preset: no weights are
read), its precision, sequence length, per-device batch x accumulation, its
sharding with gradient checkpointing, and its optimizer as the recipe builds
it on CUDA (`optim: adamw` is torch's fused AdamW there). The previous
example (HYBRID_SHARD, bf16-mixed, paged AdamW) needed ~200 GiB per GPU.
"""

import os

import yaml

import shardwise

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
EXAMPLE = os.path.join(ROOT, "examples", "slurm", "llama_70b_chat.yaml")
SBATCH = os.path.join(ROOT, "examples", "slurm", "finetune_llama.sbatch")
GIB = 2**30
# The recipe's optimizer names -> what the planner traces on a CUDA target.
RECIPE_OPTIM_ON_CUDA = {"adamw": "adamw_fused", "adamw_torch": "adamw_foreach", "adamw_torch_fused": "adamw_fused"}


def test_llama_70b_example_fits_two_nodes_of_eight_80gb_gpus():
    with open(EXAMPLE) as fh:
        cfg = yaml.safe_load(fh)
    with open(SBATCH) as fh:
        sbatch = fh.read()
    assert "#SBATCH --nodes=2" in sbatch and "--devices 8" in sbatch and "#SBATCH --gpus-per-node=8" in sbatch
    assert "70b" in cfg["model_path"].lower() and "llama-2" in cfg["model_path"].lower()
    assert cfg["strategy"] == "fsdp" and cfg["sharding_strategy"] == "FULL_SHARD"
    assert cfg["gradient_checkpointing"] is True and not cfg.get("cpu_offload", False)
    assert cfg["optim"] in RECIPE_OPTIM_ON_CUDA, cfg["optim"]  # no paged optimizer with FSDP
    plan = shardwise.plan(
        "llama-2-70b",
        batch_size=cfg["per_device_train_batch_size"] * cfg.get("gradient_accumulation_steps", 1),
        seq_len=cfg["max_seq_len"],
        devices=8,
        num_nodes=2,
        device_memory="80GiB",
        precision=cfg["precision"],
        candidates=["fsdp_ac"],
        optimizer=RECIPE_OPTIM_ON_CUDA[cfg["optim"]],
    )
    (estimate,) = [e for e in plan.estimates if e.fits] or plan.estimates[:1]
    assert estimate.fits and estimate.reserved <= 80 * GIB, (
        estimate.label,
        estimate.allocated / GIB,
        estimate.reserved / GIB,
        plan.reason,
    )
    assert plan.recommended is not None and plan.recommended.candidate.config_key == estimate.candidate.config_key

"""The fine-tuning recipe's loss is normalised over each step's global target tokens (issue 20).

One global batch of 4 chat sequences per step, whose target tokens range
from ~10 to ~90, laid out five ways (tests/helpers/global_batch.py): one
process x batch 4, one process x batch 1 x accumulation 4, and 2 ranks x
batch 1 x accumulation 2 under DDP, FSDP and DeepSpeed ZeRO-2; fp32, AdamW,
6 steps, without and with packing. Every layout trains on the same
sequences at every step (recorded on every rank: the distributed sampler
deals the one-process permutation out to the ranks in turn), and gives the
same per-step losses (within 1e-4 relative) and exported weights (within
1e-5). Before the recipe summed its loss and declared loss_weight, the split
layouts differed from the first by 1.8% in loss (BENCHMARKS.md). The loss
of a step is the model's own mean over the step's target tokens (checked
against Hugging Face's loss of the batch), and the recipe's history holds
what the Trainer logs as train_loss.
"""

from __future__ import annotations

import os

import pytest
import torch

from helpers.global_batch import REFERENCE, build_assets, compare, run_layouts_packed_and_not
from helpers.selection import selected_params


def _hf_loss_of_first_step(model_dir, sequences):
    """Hugging Face's own loss of the first global batch at the initial weights (mean over its target tokens)."""
    from transformers import AutoModelForCausalLM

    from shardwise.recipes.data import PadCollate

    model = AutoModelForCausalLM.from_pretrained(model_dir, torch_dtype=torch.float32)
    batch = PadCollate(pad_id=model.config.pad_token_id)([torch.tensor(s) for s in sequences])
    with torch.no_grad():
        return float(model(**batch, use_cache=False).loss)


@pytest.fixture(scope="module")
def layouts(request, tmp_path_factory):
    """The selected packing settings' runs: one model and data, the 2-rank layouts of both settings in one
    launch (start-up costs more than these runs); packing -> layout name -> results."""
    packings = selected_params(
        request, "packing", ["test_one_global_batch_in_five_layouts_gives_the_same_steps_and_weights"]
    )
    root = str(tmp_path_factory.mktemp("global-batch"))
    model_dir, data = build_assets(root)
    return model_dir, run_layouts_packed_and_not(model_dir, data, os.path.join(root, "runs"), packings)


@pytest.mark.slow
@pytest.mark.parametrize("packing", [False, True], ids=["unpacked", "packed"])
def test_one_global_batch_in_five_layouts_gives_the_same_steps_and_weights(layouts, packing):
    model_dir, by_packing = layouts
    results = by_packing[packing]
    report = compare(results)
    assert len(report) == 5
    for name, gap in report.items():
        assert len(gap["losses"]) == 6, name
        assert gap["same_batches"], name
        assert gap["max_rel_loss"] < 1e-4, (name, gap)
        assert gap["max_weight"] < 1e-5, (name, gap)
        # The recipe's history is what the Trainer logged as the step's train_loss.
        assert results[name]["logged"] == pytest.approx(results[name]["losses"], rel=1e-6), name
    reference = results[REFERENCE]
    assert reference["losses"][-1] < reference["losses"][0]
    if not packing:  # the unpacked sequences are whole: Hugging Face's own loss of the step-1 batch
        expected = _hf_loss_of_first_step(model_dir, reference["seen"][1])
        assert reference["losses"][0] == pytest.approx(expected, rel=1e-5)

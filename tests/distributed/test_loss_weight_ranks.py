"""loss_weight across ranks (issue 20): the same global batch, split over 2 ranks and 2 micro-batches, gives the
one-process steps under DDP, FSDP and DeepSpeed ZeRO-2, for one extra scalar all-reduce per optimizer step.

A tagger whose samples hold 1 to 6 labelled positions returns the summed loss
and its count as loss_weight (helpers/weighted.py). One process with batch 8
is the reference; 2 ranks x batch 2 x accumulation 2 see the same 8 samples
per step (the distributed sampler deals the one-process permutation out in
turn). Per-step logged losses and the final parameters agree within 1e-5.
The optimizer is SGD, whose step is proportional to the gradient, so a
gradient scaled by a wrong factor (the world size, or DeepSpeed's
accumulation count divided twice) shows in the parameters; Adam's would
hide it.
Every torch.distributed.all_reduce call is counted per optimizer step: the
weighted module runs exactly one more than the same model with a mean loss,
a scalar (the step's global weight); its logged loss rides on the health
check's all-reduce, which grows by one element.
"""

from __future__ import annotations

import pytest

import shardwise

from helpers.weighted import MeanTagger, SummedTagger, train, train_split_runs

STEPS = 4
STRATEGIES = ("ddp", "fsdp", "deepspeed_stage_2")


def _max_rel(a, b):
    return max(abs(x - y) / abs(y) for x, y in zip(a, b))


@pytest.mark.slow
def test_two_ranks_with_accumulation_match_one_process_with_one_extra_scalar_all_reduce():
    reference = train(SummedTagger, batch_size=8, steps=STEPS)
    configs = [
        dict(key=f"{strategy} {cls.__name__}", module_cls=cls, strategy=strategy, devices=2, batch_size=2, accumulate=2)
        for strategy in STRATEGIES
        for cls in (SummedTagger, MeanTagger)
    ]
    for config in configs:
        config["steps"] = STEPS
    ranks = shardwise.launch(train_split_runs, configs, devices=2)
    for strategy in STRATEGIES:
        weighted, mean = ranks[0][f"{strategy} SummedTagger"], ranks[0][f"{strategy} MeanTagger"]
        assert len(weighted["losses"]) == STEPS
        assert ranks[1][f"{strategy} SummedTagger"]["losses"] == weighted["losses"]  # every rank logs the same
        assert _max_rel(weighted["losses"], reference["losses"]) < 1e-5, (strategy, weighted["losses"])
        for name, value in reference["params"].items():
            assert float((weighted["params"][name] - value).abs().max()) < 1e-5, (strategy, name)
        # The mean loss averages 4 micro-batch means per step: another step than one process's.
        assert max(float((mean["params"][n] - v).abs().max()) for n, v in reference["params"].items()) > 1e-3
        # Collectives: per step, one all-reduce more than the mean-loss run, and it is a scalar.
        for rank_result in ranks:
            steps_w, steps_m = (rank_result[f"{strategy} {c}"]["collectives"] for c in ("SummedTagger", "MeanTagger"))
            assert len(steps_w) == len(steps_m) == STEPS
            for w, m in zip(steps_w, steps_m):
                assert len(w) == len(m) + 1, (strategy, w, m)
                assert w.count(1) == m.count(1) + 1, (strategy, w, m)
                assert sum(w) == sum(m) + 2, (strategy, w, m)  # the scalar, and the loss share in the health check

"""A ``BasePredictionWriter`` writes each predicted sample exactly once, whatever the layout: the ranks of a
replica (tp, cp, pp) predict the same samples, and only one of them (tp and cp rank 0 of the last stage) writes,
as under DDP each process writes its own samples once. One 2-process launch (dp=2, dp_shard=2, tp=2, pp=2, cp=2)
and one 4-process launch (dp2 x tp2, pp2 x cp2), the example GPT, a writer recording the sample indices each rank
was asked to write."""

from collections import Counter

import pytest

from tests.parity import Case, train_layout

GPT = dict(module="tests.lm_models:tiny_gpt", data="tests.lm_models:token_data", max_steps=1,
           callbacks=["tests.probes:PredictionWrites"])
TWO = [Case(f"predict_{name}", strategy=strategy, **GPT)
       for name, strategy in (("dp2", {"dp": 2}), ("dp_shard2", {"dp_shard": 2}), ("tp2", {"tp": 2}),
                              ("pp2", {"pp": 2}), ("cp2", {"cp": 2}))]
FOUR = [Case("predict_dp2_tp2", strategy={"dp": 2, "tp": 2}, **GPT),
        Case("predict_pp2_cp2", strategy={"pp": 2, "cp": 2}, **GPT)]
WRITERS = {"predict_dp2": 2, "predict_dp_shard2": 2, "predict_tp2": 1, "predict_pp2": 1, "predict_cp2": 1,
           "predict_dp2_tp2": 2, "predict_pp2_cp2": 1}  # ranks that hold different samples


@pytest.fixture(scope="module")
def records():
    return {**train_layout(TWO, 2, timeout=300), **train_layout(FOUR, 4, timeout=300)}


@pytest.mark.parametrize("case", TWO + FOUR, ids=lambda case: case.name)
def test_each_sample_is_written_once(records, case):
    extras = records[case.name]["extras"]
    written = extras["written"]
    assert len(written) == WRITERS[case.name], (case.name, sorted(written))
    counts = Counter(index for lines in written.values() for line in lines for index in line["indices"])
    assert sorted(counts) == list(range(extras["samples"])) and set(counts.values()) == {1}, (case.name, counts)

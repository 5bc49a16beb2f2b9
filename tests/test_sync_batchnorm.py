"""``Trainer(sync_batchnorm=True)``: BatchNorm normalizes with the statistics of the whole batch, over dp x cp, on
CPU with gloo (torch's SyncBatchNorm runs on CUDA only), at parity with one process on the whole batch (loss per
step, final weights and the running statistics, 1e-5) at dp=2, cp=2, dp_shard=2 and dp2 x cp2. Without it each
replica keeps its own statistics, as under DDPStrategy, and the run differs from one process (the negative
control: the parity cases can fail). One 2-process and one 4-process launch."""

from dataclasses import replace

import pytest

from tests.parity import Case, assert_parity, max_difference, reference, report_difference, train_layout

BN = dict(module="tests.batchnorm_models:BatchNormLM", data="tests.lm_models:token_data", max_steps=3,
          trainer={"sync_batchnorm": True})
TWO = [Case(f"sync_bn_{name}", strategy=strategy, **BN)
       for name, strategy in (("dp2", {"dp": 2}), ("cp2", {"cp": 2}), ("dp_shard2", {"dp_shard": 2}))]
UNSYNCED = [replace(case, name=f"{case.name}_off", trainer={}) for case in TWO[:2]]
FOUR = [Case("sync_bn_dp2_cp2", strategy={"dp": 2, "cp": 2}, **BN)]


@pytest.fixture(scope="module")
def records():
    return {**train_layout(TWO + UNSYNCED, 2, timeout=300), **train_layout(FOUR, 4, timeout=300)}


@pytest.mark.parametrize("case", TWO + FOUR, ids=lambda case: case.name)
def test_global_statistics_match_one_process(records, case):
    expected = reference(case)
    report_difference(case, expected, records[case.name])
    assert_parity(case, expected, records[case.name])
    assert "norm.running_var" in records[case.name]["weights"]


@pytest.mark.parametrize("case", UNSYNCED, ids=lambda case: case.name)
def test_without_it_each_replica_keeps_its_own_statistics(records, case):
    loss, weight = max_difference(reference(case), records[case.name])
    assert loss > 1e-4 or weight > 1e-3, (case.name, loss, weight)
    # The replicas' statistics differ from each other too (every rank's record is compared with rank 0's).
    assert "rank 1 against rank 0: weight" in records[case.name]["disagreement"] and \
        "norm.running_" in records[case.name]["disagreement"], records[case.name]["disagreement"]

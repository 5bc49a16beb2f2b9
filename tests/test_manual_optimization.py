"""Manual optimization (``automatic_optimization = False``) against one process: one 2-process launch, one
4-process launch for the combinations.

The module (``tests.lm_models.ManualGPT``) calls ``manual_backward``, logs the gradient norm, clips the norm
to 0.5 (below the real norm, about 1: it clips) with ``self.clip_gradients`` and steps, under dp=2, dp_shard=2,
cp=2 and tp=2; and accumulates two ``manual_backward`` calls per step, the first inside
``block_backward_sync()``: over two batches under dp=2 and dp_shard=2, where only the second batch may
communicate, and within one training_step (the batch in two chunks) under cp=2. With 4 processes: dp2 x tp2,
dp_shard2 x tp2 (chunks), dp_shard2 x cp2 and HSDP dp2 x dp_shard2 (over batches), dp2 x cp2 (both).
Tolerances as elsewhere: losses and logged values within 1e-5 relative per step, final weights within
1e-5 + 1e-5*|w| (SGD with momentum). A step whose last backward was blocked raises on every rank before any
collective.
"""

import pytest

from tests.parity import (Case, assert_error, assert_parity, reference, report_difference, train_layout,
                          train_layout_with_failures)

MANUAL = dict(module="tests.lm_models:manual_gpt", data="tests.lm_models:token_data", batch_size=8)
ACCUMULATE = {"accumulate": 2}
CASES = [
    Case("manual_dp2", **MANUAL, strategy={"dp": 2}, max_steps=3),
    Case("manual_shard2", **MANUAL, strategy={"dp_shard": 2}, max_steps=3),
    Case("manual_cp2", **MANUAL, strategy={"cp": 2}, max_steps=3),
    Case("manual_tp2", **MANUAL, strategy={"tp": 2}, max_steps=3),
    Case("manual_dp2_accumulate", **MANUAL, strategy={"dp": 2}, module_kwargs=ACCUMULATE, max_steps=2,
         callbacks=["tests.probes:GradientCommTrace"]),
    Case("manual_shard2_accumulate", **MANUAL, strategy={"dp_shard": 2}, module_kwargs=ACCUMULATE, max_steps=2,
         callbacks=["tests.fsdp_probes:ShardTrace"]),
    Case("manual_cp2_chunks", **MANUAL, strategy={"cp": 2}, module_kwargs={"chunks": 2}, max_steps=2),
]
COMBINED = [
    Case("manual_dp2_tp2", **MANUAL, strategy={"dp": 2, "tp": 2}, max_steps=2),
    Case("manual_shard2_tp2_chunks", **MANUAL, strategy={"dp": 1, "dp_shard": 2, "tp": 2},
         module_kwargs={"chunks": 2}, max_steps=2),
    Case("manual_shard2_cp2_accumulate", **MANUAL, strategy={"dp": 1, "dp_shard": 2, "cp": 2},
         module_kwargs=ACCUMULATE, max_steps=2),
    Case("manual_hsdp_accumulate", **MANUAL, strategy={"dp": 2, "dp_shard": 2}, module_kwargs=ACCUMULATE,
         max_steps=2),
    Case("manual_dp2_cp2_chunks_accumulate", **MANUAL, strategy={"dp": 2, "cp": 2},
         module_kwargs={"chunks": 2, "accumulate": 2}, max_steps=2),
]
FAILING = [Case("manual_dp2_blocked_step", **MANUAL, strategy={"dp": 2}, max_steps=1,
                module_kwargs={"block_last": True})]


@pytest.fixture(scope="module")
def runs():
    return train_layout_with_failures(CASES, FAILING, 2, timeout=400)


@pytest.fixture(scope="module")
def combined():
    return train_layout(COMBINED, 4, timeout=400)


@pytest.mark.parametrize("case", CASES + COMBINED, ids=lambda case: case.name)
def test_manual_optimization_matches_single_process(request, case):
    got = request.getfixturevalue("runs")[0] if case in CASES else request.getfixturevalue("combined")
    expected, got = reference(case), got[case.name]
    report_difference(case, expected, got)
    assert_parity(case, expected, got)
    # The gradient norm the module logs at each step (before clipping): the norm of the synchronized gradients.
    norms = [logged.get("grad_norm") for logged in got["logged"]]
    expected_norms = [logged.get("grad_norm") for logged in expected["logged"]]
    assert [n is None for n in norms] == [n is None for n in expected_norms], (norms, expected_norms)
    assert [n for n in norms if n is not None] == pytest.approx([n for n in expected_norms if n is not None], rel=1e-5)
    assert all(logged["grad_norm"] > case.module_kwargs.get("clip", 0.5) for logged in expected["logged"]
               if "grad_norm" in logged), "the clip must clip"


def test_accumulation_synchronizes_only_the_last_backward(runs):
    # Batches 0 and 2 run their backward inside block_backward_sync(): no all-reduce, no reduce-scatter then;
    # batches 1 and 3 synchronize what both accumulated, during their backward.
    launches = runs[0]["manual_dp2_accumulate"]["extras"]["comm"]
    assert launches and {(batch, in_backward) for batch, in_backward, _ in launches} == {(1, True), (3, True)}
    assert set(runs[0]["manual_shard2_accumulate"]["extras"]["reduce_scatters"]) == {1, 3}


def test_step_after_a_blocked_backward_is_refused_on_every_rank(runs):
    assert_error(runs[1]["manual_dp2_blocked_step"], "RuntimeError",
                 ["clip_gradients after a manual_backward inside block_backward_sync()", "outside the block"])

"""Data parallelism against one process: losses, logged metrics, torchmetrics, weights, buckets, resume.

Tolerances: losses and logged values within 1e-5 relative; weights within 1e-5 + 1e-5 * |w| after 8-16 AdamW
steps. A one-ulp difference in a gradient is amplified by AdamW, so these bounds are tight enough to fail on
any real mistake (a missing division by dp, a skipped bucket, a wrong sampler offset).
"""

import pytest
import torch

from tests.parity import Case, assert_exact_resume, assert_parity, reference, train_layout

MODEL = dict(module="tests.models:Classifier", data="tests.models:classification_data")
VALIDATE = {"limit_val_batches": 4, "val_check_interval": 4}
COMM = ["tests.probes:GradientCommTrace"]

TWO = [
    Case("dp2", **MODEL, strategy={"dp": 2}, max_steps=8, trainer=VALIDATE),
    Case("dp2_accumulate_clip", **MODEL, strategy={"dp": 2}, max_steps=16, callbacks=COMM,
         trainer={"accumulate_grad_batches": 2, "gradient_clip_val": 0.05}),
    Case("dp2_bucket_per_param", **MODEL, strategy={"dp": 2, "bucket_mb": 1e-6}, max_steps=8, callbacks=COMM),
    Case("dp2_one_bucket", **MODEL, strategy={"dp": 2, "bucket_mb": 1e4}, max_steps=8,
         callbacks=COMM + ["tests.probes:GradientStorage"]),
    # Gradients kept across steps and zeroed in place, accumulated over two micro-batches.
    Case("dp2_zero_grad_in_place", module="tests.probes:classifier_zeroing_in_place", data=MODEL["data"],
         strategy={"dp": 2, "bucket_mb": 1e4}, max_steps=8, trainer={"accumulate_grad_batches": 2},
         callbacks=["tests.probes:GradientStorage"]),
    Case("dp2_resumed_mid_epoch", **MODEL, strategy={"dp": 2}, max_steps=16, resume_at=12),
    # Built without a common seed: every rank starts from rank 0's weights, as with DDP (checked by debug=True).
    Case("dp2_unseeded", module="tests.probes:rank_seeded_classifier", data=MODEL["data"],
         strategy={"dp": 2, "debug": True}, max_steps=4),
    # debug=True on a correct run: its checks pass and change nothing.
    Case("dp2_debug", **MODEL, strategy={"dp": 2, "debug": True, "debug_steps": 3}, max_steps=8, trainer=VALIDATE),
]
FOUR = [
    Case("dp4", **MODEL, strategy={"dp": 4}, max_steps=8, trainer=VALIDATE),
    Case("dp4_accumulate_clip", **MODEL, strategy={"dp": "auto"}, max_steps=16,
         trainer={"accumulate_grad_batches": 2, "gradient_clip_val": 0.05}),
    # The classifier has nothing tensor parallelism could shard on its own: its tp ranks hold it whole.
    Case("dp2_tp2_sampler", **MODEL, strategy={"dp": 2, "tp": 2, "tp_plan": "none", "debug": True}, max_steps=4,
         callbacks=["tests.probes:BatchTrace"]),
]
CASES = {case.name: case for case in TWO + FOUR}


@pytest.fixture(scope="module")
def two():
    return train_layout(TWO, 2, timeout=300)


@pytest.fixture(scope="module")
def four_on_two_nodes():
    # Two simulated nodes of two processes: NODE_RANK/LOCAL_RANK as a cluster scheduler sets them.
    return train_layout(FOUR, 4, num_nodes=2, timeout=300)


@pytest.mark.parametrize("name", ["dp2", "dp2_accumulate_clip", "dp2_bucket_per_param", "dp2_one_bucket",
                                  "dp2_zero_grad_in_place", "dp2_debug"])
def test_dp2_matches_single_process(two, name):
    case = CASES[name]
    epoch_metrics = ("train_acc", "val_loss", "val_acc") if case.trainer.get("limit_val_batches") else ("train_acc",)
    assert_parity(case, reference(case), two[name], epoch_metrics=epoch_metrics)


@pytest.mark.parametrize("name", ["dp4", "dp4_accumulate_clip"])
def test_dp4_on_two_nodes_matches_single_process(four_on_two_nodes, name):
    case = CASES[name]
    epoch_metrics = ("train_acc", "val_loss", "val_acc") if case.trainer.get("limit_val_batches") else ("train_acc",)
    assert_parity(case, reference(case), four_on_two_nodes[name], epoch_metrics=epoch_metrics)


def test_bucket_size_does_not_change_results(two):
    default = two["dp2"]["weights"]
    for name in ("dp2_bucket_per_param", "dp2_one_bucket"):
        for key, value in default.items():
            assert torch.equal(two[name]["weights"][key], value), f"{name}: {key} differs from default buckets"
        assert two[name]["losses"] == two["dp2"]["losses"]


def test_all_reduce_runs_inside_backward_and_only_before_optimizer_steps(two):
    per_param = two["dp2_bucket_per_param"]["extras"]["comm"]
    # Eight parameter tensors, one bucket each, every step. From the second step on (the first one learns the
    # order in which gradients arrive) all but the never-used parameter's buckets are launched while backward
    # is still running; those two can only go once backward is over.
    assert sorted({batch for batch, _, _ in per_param}) == list(range(8))
    assert len(per_param) == 8 * 8
    for batch, in_backward, names in per_param[8:]:
        assert in_backward == (names not in (["unused.weight"], ["unused.bias"])), (batch, names)
    one_bucket = two["dp2_one_bucket"]["extras"]["comm"]
    assert [batch for batch, _, _ in one_bucket] == list(range(8))
    assert all(len(names) == 8 for _, _, names in one_bucket)
    # With accumulate_grad_batches=2 the first micro-step of every pair sends nothing.
    # (16 optimizer steps = 32 batches = four epochs of 8 batches; one default-size bucket per step.)
    batches = [batch for batch, _, _ in two["dp2_accumulate_clip"]["extras"]["comm"]]
    assert batches == [1, 3, 5, 7] * 4, batches


def test_gradients_are_views_of_one_bucket_kept_across_steps(two):
    """The averaged gradients the optimizer sees live in the bucket's buffer, the same one every step (as DDP's
    gradient_as_bucket_view): no buffer is allocated per step, and gradients zeroed in place are accumulated
    into it directly."""
    for name in ("dp2_one_bucket", "dp2_zero_grad_in_place"):
        steps = two[name]["extras"]["grad_storage"]
        assert len(steps) == 8, name
        # The first step builds the buckets in registration order, then rebuilds them in arrival order.
        for step, storages in enumerate(steps[1:], start=1):
            assert sorted(storages) == [f"net.{i}.{kind}" for i in (0, 2, 4) for kind in ("bias", "weight")]
            buffers = set(storages.values())
            assert len(buffers) == 1, f"{name} step {step}: gradients in {len(buffers)} buffers, not one bucket"
            assert storages == steps[1], f"{name} step {step}: the bucket was reallocated"


def test_resume_continues_exactly(two):
    """Checkpoint at step 12 (mid-epoch: 8 batches per epoch), resume in a new Trainer: same numbers, bit for bit."""
    case, resumed = CASES["dp2_resumed_mid_epoch"], two["dp2_resumed_mid_epoch"]
    assert len(resumed["losses"]) == 16
    assert_exact_resume(resumed)
    assert_parity(case, reference(case), resumed)


def test_sampler_splits_over_dp_only(four_on_two_nodes):
    extras = four_on_two_nodes["dp2_tp2_sampler"]["extras"]
    batches, coordinates = extras["batches"], extras["coordinates"]
    by_replica = {}
    for rank, seen in enumerate(batches):
        by_replica.setdefault(coordinates[rank]["dp"], []).append(seen)
    assert sorted(by_replica) == [0, 1]
    for replica, views in by_replica.items():
        assert all(view == views[0] for view in views), f"ranks of replica {replica} saw different batches"
    first, second = (set(v for step in by_replica[d][0] for v in step) for d in (0, 1))
    assert first and second and not first & second, "replicas saw overlapping samples"


def test_unseeded_module_starts_from_rank_0_weights(two):
    # debug=True compares the replicas' weights before steps 0 to 2, so the launch passing shows they agree;
    # the reference builds the module as rank 0 does (RANK unset: seed 100), so parity shows they are rank 0's.
    case = CASES["dp2_unseeded"]
    assert len(two[case.name]["losses"]) == case.max_steps
    assert_parity(case, reference(case), two[case.name], epoch_metrics=("train_acc",))

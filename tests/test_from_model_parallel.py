"""A module written for Lightning's ``ModelParallelStrategy`` runs unchanged under ``FourDStrategy``: Lightning's
tensor-parallel example (``tests/model_parallel_example.py``: its model, its ``parallelize(model, device_mesh)``
on ``device_mesh["data_parallel"]`` and ``device_mesh["tensor_parallel"]``, its steps inside ``loss_parallel()``,
``init_weights`` in ``on_train_start``, built under ``init_module(empty_init=True)``).

One 4-process launch: ModelParallelStrategy(2, 2) itself, and FourDStrategy at dp_shard2 x tp2 and dp2 x tp2 with
the module's own plan (left as it is: no second ``fully_shard``) and with ``configure_model`` removed (the automatic
plan, the user's ``loss_parallel()`` nested in the strategy's); clipping, token-weighted masked targets, each
replica's own mean (``loss_normalization="replica"``: the DTensor loss goes unweighed to logging) and a resume from
the strategy's checkpoint on the module's own plan. The example's logits, and so its loss, are DTensors. Each against one process (the module without
``configure_model``) from the same starting weights, at 1e-5 (loss per step, logged loss, final weights), and
FourDStrategy's runs against ModelParallelStrategy's at the same tolerance. cp and pp refuse a module that applied
``fully_shard`` itself, on every rank, before training."""

from dataclasses import replace

import pytest

from tests.parity import Case, assert_error, assert_parity, reference, report_difference, train_layout_with_failures

EXAMPLE = "tests.model_parallel_example"
BASE = dict(module=f"{EXAMPLE}:example", data=f"{EXAMPLE}:random_tokens", empty_init=True, max_steps=4,
            callbacks=[f"{EXAMPLE}:MeshNames"])
OWN, AUTOMATIC = {"plan": "own"}, {"plan": "automatic"}
MODEL_PARALLEL = Case("model_parallel_strategy", strategy_class="lightning.pytorch.strategies:ModelParallelStrategy",
                      strategy={"data_parallel_size": 2, "tensor_parallel_size": 2}, module_kwargs=OWN, **BASE)
CASES = [
    MODEL_PARALLEL,
    Case("own_dp_shard2_tp2", strategy={"dp_shard": 2, "tp": 2}, module_kwargs=OWN, **BASE),
    Case("own_dp2_tp2", strategy={"dp": 2, "tp": 2}, module_kwargs=OWN, **BASE),
    Case("own_dp_shard2_tp2_clip", strategy={"dp_shard": 2, "tp": 2}, module_kwargs=OWN,
         trainer={"gradient_clip_val": 0.05}, **BASE),
    Case("own_dp2_tp2_masked_resumed", strategy={"dp": 2, "tp": 2}, module_kwargs=dict(OWN, masked=True),
         resume_at=2, **BASE),
    Case("own_dp2_tp2_replica_means", strategy={"dp": 2, "tp": 2, "loss_normalization": "replica"},
         module_kwargs=OWN, **BASE),
    Case("automatic_dp_shard2_tp2", strategy={"dp_shard": 2, "tp": 2}, module_kwargs=AUTOMATIC, **BASE),
    Case("automatic_dp2_tp2", strategy={"dp": 2, "tp": 2}, module_kwargs=AUTOMATIC, **BASE),
]
FAILING = {
    "cp": (Case("own_dp2_cp2", strategy={"dp": 2, "cp": 2}, module_kwargs=OWN, **BASE),
           ["configure_model applied fully_shard itself", "FourDStrategy(cp=2)", "cp=1", "dp_shard="]),
    "pp": (Case("own_dp2_pp2", strategy={"dp": 2, "pp": 2}, module_kwargs=OWN, **BASE),
           ["configure_model applied fully_shard itself", "FourDStrategy(pp=2)", "pp=1", "dp_shard="]),
}


@pytest.fixture(scope="module")
def launch():
    return train_layout_with_failures(CASES, [case for case, _ in FAILING.values()], 4, timeout=600)


def _one_process(case: Case) -> dict:
    """The module without ``configure_model`` (one process has no mesh), otherwise the same case."""
    return reference(replace(case, module_kwargs=dict(case.module_kwargs, plan="automatic")))


@pytest.mark.parametrize("case", CASES, ids=lambda case: case.name)
def test_matches_one_process(launch, case):
    got, expected = launch[0][case.name], _one_process(case)
    report_difference(case, expected, got)
    assert_parity(case, expected, got)


@pytest.mark.parametrize("case", [c for c in CASES if c.name in ("own_dp_shard2_tp2", "own_dp2_tp2",
                                                                   "automatic_dp_shard2_tp2", "automatic_dp2_tp2")],
                         ids=lambda case: case.name)
def test_matches_model_parallel_strategy(launch, case):
    assert_parity(case, launch[0][MODEL_PARALLEL.name], launch[0][case.name])


def test_own_plan_is_left_as_it_is(launch):
    records = launch[0]
    mesh = ["data_parallel", "tensor_parallel"]  # the module's own 2-D FSDP x TP layout, under both strategies
    for name in ("model_parallel_strategy", "own_dp_shard2_tp2", "own_dp2_tp2"):
        extras = records[name]["extras"]
        assert extras["head_mesh"] == mesh and extras["fsdp_units"] == 3, (name, extras)  # 2 blocks and the model
    # The automatic plan: the head sharded over the vocabulary on the strategy's own tp mesh, FSDP under dp_shard.
    assert records["automatic_dp2_tp2"]["extras"]["head_mesh"] == ["tp"]
    assert records["automatic_dp_shard2_tp2"]["extras"]["fsdp_units"] > 0


@pytest.mark.parametrize("dim", list(FAILING))
def test_cp_and_pp_refuse_a_module_that_sharded_itself(launch, dim):
    assert_error(launch[1][FAILING[dim][0].name], "ValueError", FAILING[dim][1])

"""Weight averaging as Lightning users add it, against one process: Lightning's ``StochasticWeightAveraging``
(supported where every rank holds whole weights, dp and cp; refused before any process group elsewhere, with a fix
that works: the EMA below), and an exponential moving average kept in a callback, one tensor per parameter, in every
layout. The example GPT, 12 steps over 3 epochs (SWA averages from the second); final weights are the averages.
One 2-process launch and one 4-process launch; parity at 1e-5 (loss per step, logged loss, final weights)."""

import pytest

from tests.parity import Case, assert_error, assert_parity, reference, report_difference, train_layout_with_failures

BASE = dict(module="tests.averaging_models:averaged_gpt", data="tests.lm_models:token_data", max_steps=12)
SWA, EMA = {"averaging": "swa"}, {"averaging": "ema"}
TWO = [Case("swa_dp2", strategy={"dp": 2}, module_kwargs=SWA, **BASE),
       Case("swa_cp2", strategy={"cp": 2}, module_kwargs=SWA, **BASE)] + [
       Case(f"ema_{name}", strategy=strategy, module_kwargs=EMA, **BASE)
       for name, strategy in (("dp2", {"dp": 2}), ("dp_shard2", {"dp_shard": 2}), ("tp2", {"tp": 2}),
                              ("pp2", {"pp": 2}), ("cp2", {"cp": 2}))]
FOUR = [Case("swa_dp2_cp2", strategy={"dp": 2, "cp": 2}, module_kwargs=SWA, **BASE),
        Case("ema_dp2_tp2", strategy={"dp": 2, "tp": 2}, module_kwargs=EMA, **BASE)]
REFUSED = {name: Case(f"swa_{name}", strategy=strategy, module_kwargs=SWA, **BASE)
           for name, strategy in (("tp2", {"tp": 2}), ("dp_shard2", {"dp_shard": 2}), ("pp2", {"pp": 2}))}


@pytest.fixture(scope="module")
def launches():
    two, refused = train_layout_with_failures(TWO, list(REFUSED.values()), 2, timeout=600)
    four, _ = train_layout_with_failures(FOUR, [], 4, timeout=600)
    return {**two, **four}, refused


@pytest.mark.parametrize("case", TWO + FOUR, ids=lambda case: case.name)
def test_averaged_weights_match_one_process(launches, case):
    expected, got = reference(case), launches[0][case.name]
    report_difference(case, expected, got)
    assert_parity(case, expected, got)


@pytest.mark.parametrize("averaging", [SWA, EMA], ids=["swa", "ema"])
def test_averaging_changes_the_weights(averaging):
    """The parity above compares averages, not the last weights: one process's differ from a run without."""
    averaged = reference(Case("averaged", module_kwargs=averaging, **BASE))["weights"]
    plain = reference(Case("plain", module_kwargs={"averaging": "none"}, **BASE))["weights"]
    assert max((averaged[k] - plain[k]).abs().max().item() for k in plain) > 1e-3


@pytest.mark.parametrize("name", list(REFUSED))
def test_swa_is_refused_where_weights_are_sharded_or_cut(launches, name):
    size = {"tp2": "tp=2", "dp_shard2": "dp_shard=2", "pp2": "pp=2"}[name]
    assert_error(launches[1][REFUSED[name].name], "ValueError",
                 [f"StochasticWeightAveraging with FourDStrategy({size})", "exponential moving average", "lerp_"])

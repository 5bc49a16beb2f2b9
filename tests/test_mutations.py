"""The parity cases can fail: six known-bad changes (tests/mutations.py, applied in the ranks' processes by
monkeypatching, nothing edited) each make a fast parity case of their group fail, while the same case without
the change passes. The cases train the tiny GPT with SGD (momentum 0.9) and no clipping for 3 steps at 2
processes, compared with one process at 1e-5: a gradient off by any factor moves the weights. The unchanged
cases run after the changed ones in the same processes, so a change that outlived its case fails them too.

| change | group | case |
|---|---|---|
| no division by the number of replicas | dp | dp=2 |
| the token-mean loss's gradient doubled (cp's scaling counted twice) | cp | cp=2 |
| one micro-batch's gradient dropped | pp | pp=2, 4 micro-batches |
| token counts not reduced over the replicas | dp | dp=2 |
| FSDP's reduce-scatter skipped | dp_shard | dp_shard=2 |
| a replicated parameter's partial gradient not reduced over tp | tp | tp=2 with sequence parallelism |
"""

from dataclasses import replace

import pytest

from tests.parity import Case, assert_parity, reference, train_layout

BASE = Case("base", module="tests.lm_models:tiny_gpt", data="tests.lm_models:token_data", max_steps=3)
LAYOUTS = {"dp": {"dp": 2}, "cp": {"cp": 2}, "pp": {"pp": 2, "pp_microbatches": 4}, "dp_shard": {"dp_shard": 2},
           "tp": {"tp": 2, "sequence_parallel": True}}
MUTATIONS = {"NoDataParallelDivision": "dp", "DoubledLossScale": "cp", "DroppedMicrobatch": "pp",
             "UnreducedTokenCounts": "dp", "SkippedReduceScatter": "dp_shard",
             "UnreducedReplicatedGradient": "tp"}


def _mutated(name: str) -> Case:
    return replace(BASE, name=name, strategy=LAYOUTS[MUTATIONS[name]], callbacks=[f"tests.mutations:{name}"])


@pytest.fixture(scope="module")
def records():
    controls = [replace(BASE, name=f"control_{group}", strategy=layout) for group, layout in LAYOUTS.items()]
    # the controls run after the changes in the same processes: a change its teardown did not undo fails them
    return train_layout([_mutated(name) for name in MUTATIONS] + controls, 2, timeout=600)


@pytest.mark.parametrize("group", sorted(LAYOUTS))
def test_the_unchanged_case_passes(records, group):
    case = replace(BASE, name=f"control_{group}", strategy=LAYOUTS[group])
    assert_parity(case, reference(case), records[case.name])


@pytest.mark.parametrize("name", sorted(MUTATIONS))
def test_the_change_makes_its_case_fail(records, name):
    case = _mutated(name)
    with pytest.raises(AssertionError):
        assert_parity(case, reference(case), records[name])

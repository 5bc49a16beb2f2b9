"""Every layout with dp, pp, cp, tp in {1, 2} (16 layouts, up to 16 processes) against one process.

Run alone with ``pytest -m parity_matrix``. Two models: the example GPT (rotary tables, RMSNorm, separate
q/k/v/o) and a Hugging Face LlamaForCausalLM from a tiny config (grouped K/V heads, HF rotary embedding
with position_ids). Losses per step and logged train_loss within 1e-5 relative, final weights within
1e-5 + 1e-5*|w|, after 4 SGD steps (see tests/lm_models.py for why SGD).
"""

import itertools

import pytest

from tests.parity import Case, assert_parity, check_launch, reference, run_layout

pytestmark = pytest.mark.parity_matrix

MODELS = {
    "gpt": dict(module="tests.lm_models:tiny_gpt"),
    "llama": dict(module="tests.lm_models:HFCausalLM", module_kwargs={"kind": "llama"}),
}
LAYOUTS = [dict(zip(("dp", "pp", "cp", "tp"), sizes)) for sizes in itertools.product((1, 2), repeat=4)]


def _name(layout: dict, model: str) -> str:
    return f"{model}-dp{layout['dp']}pp{layout['pp']}cp{layout['cp']}tp{layout['tp']}"


def _cases(world_size: int) -> list[Case]:
    return [
        Case(_name(layout, model), data="tests.lm_models:token_data", strategy=layout, batch_size=8,
             max_steps=4, **spec)
        for layout in LAYOUTS if layout["dp"] * layout["pp"] * layout["cp"] * layout["tp"] == world_size
        for model, spec in MODELS.items()
    ]


@pytest.mark.parametrize("world_size", [1, 2, 4, 8, 16])
def test_every_layout_matches_one_process(world_size):
    cases = _cases(world_size)
    result = run_layout(cases, world_size, timeout=900)
    check_launch(result, cases)
    for case in cases:
        assert_parity(case, reference(case), result.results[case.name])

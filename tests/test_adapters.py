"""Frozen parameters and peft LoRA adapters under every dimension, against one process.

A zoo Llama with its token embedding frozen, and ``peft.get_peft_model`` LoRA on its attention and MLP projections
(base frozen, the optimizer over the trainable parameters), train at tp=2, cp=2, pp=2 and dp_shard=2 in ONE launch
of 2 processes, and at tp2 x dp2, tp2 x cp2 and pp2 x dp_shard2 (LoRA also at pp2 x tp2) in one launch of 4:
losses per step, logged train_loss and final weights within 1e-5 of one process after 3 SGD steps. LoRA at tp=2
also on Phi-3's fused projections (qkv_proj, gate_up_proj: lora_B rows permuted with the base rows), on Gemma's
k and v projections kept whole (one key/value head), with sequence parallelism, and on the token embedding and
the LM head. Three runs checkpoint at step 2 and resume exactly. Every run reports that no frozen parameter got
a gradient, optimizer state or gradient-bucket space; the adapter that peft's ``save_pretrained`` writes from
the trained full state loads into a plain model and gives the trained logits.
"""

from __future__ import annotations

import pytest
import torch

from tests.adapter_models import LoRALM, base_lm, trained_lora
from tests.parity import (Case, assert_error, assert_exact_resume, assert_parity, reference, report_difference,
                          train_layout_with_failures)

STEPS = 3
PROBE = ["tests.adapter_models:FineTuneProbe"]
MODELS = {
    "frozen_embedding": dict(module="tests.adapter_models:FrozenEmbeddingLM"),
    "lora": dict(module="tests.adapter_models:LoRALM"),
}
# tp_strict: a plan that left the adapted layers whole (under 90% of the body sharded) is an error, not a
# run at parity that shards only the embedding and head.
TP = {"tp": 2, "tp_strict": True}
PP = {"pp": 2, "pp_microbatches": 2}
TWO = {"tp2": TP, "cp2": {"cp": 2}, "pp2": PP, "dp_shard2": {"dp_shard": 2}}
# pp2 x dp_shard2: the frozen embedding is an FSDP unit of its own under pipelining, none of whose parameters trains.
FOUR = {"tp2dp2": {**TP, "dp": 2}, "tp2cp2": {**TP, "cp": 2}, "pp2dp_shard2": {**PP, "dp_shard": 2}}


def _case(model: str, layout: str, strategy: dict, **spec) -> Case:
    return Case(f"{model}-{layout}", data="tests.lm_models:token_data", strategy=strategy, max_steps=STEPS,
                **{"callbacks": PROBE, **MODELS[model], **spec})


# Also checkpointed at step 2 and resumed in a new Trainer (model and optimizer state of the trainable part).
RESUMED = ("lora-tp2", "frozen_embedding-dp_shard2", "lora-tp2dp2")


def _cases(layouts: dict[str, dict]) -> list[Case]:
    return [_case(model, layout, strategy, resume_at=2 if f"{model}-{layout}" in RESUMED else None)
            for model in MODELS for layout, strategy in layouts.items()]


# LoRA on the fused projections of Phi-3, on Gemma's k_proj and v_proj kept whole (one key/value head), and on
# each pipeline stage's share of the plan.
MORE = {2: [_case("lora", "phi3-tp2", TP, module_kwargs={"family": "phi3"}),
            _case("lora", "gemma-tp2", TP, module_kwargs={"family": "gemma"}),
            _case("lora", "tp2sp", {**TP, "sequence_parallel": True}),  # its frozen norms sequence-parallel
            _case("lora", "vocabulary-tp2", TP, module_kwargs={"vocabulary": True})],  # on embedding and LM head
        4: [_case("lora", "pp2tp2", {**PP, **TP})]}
CASES = {size: _cases(layouts) + MORE[size] for size, layouts in ((2, TWO), (4, FOUR))}
BY_NAME = {case.name: (size, case) for size, cases in CASES.items() for case in cases}
# Must fail on every rank: the embedding frozen at set-up, made trainable before the second step.
THAWED = _case("frozen_embedding", "tp2-thawed", TWO["tp2"], callbacks=["tests.adapter_models:ThawEmbedding"])
FAILING = {2: [THAWED], 4: []}


@pytest.fixture(scope="module")
def launches():
    return {}


def _launch(launches: dict, size: int) -> tuple[dict, dict]:
    if size not in launches:
        launches[size] = train_layout_with_failures(CASES[size], FAILING[size], size, timeout=540)
    return launches[size]


def _record(launches: dict, name: str) -> dict:
    return _launch(launches, BY_NAME[name][0])[0][name]


@pytest.mark.parametrize("name", list(BY_NAME))
def test_fine_tuning_matches_one_process(launches, name):
    case = BY_NAME[name][1]
    got, expected = _record(launches, name), reference(case)
    report_difference(case, expected, got)
    assert_parity(case, expected, got)
    extras = got["extras"]
    assert extras["frozen"], "the model froze nothing"
    for what in ("frozen_with_grad", "frozen_in_optimizer_state", "frozen_in_buckets"):
        assert extras[what] == [], (what, extras[what])


@pytest.mark.parametrize("name", RESUMED)
def test_a_run_resumed_from_its_checkpoint_equals_the_uninterrupted_one(launches, name):
    assert_exact_resume(_record(launches, name))


@pytest.mark.parametrize("name", ["lora-tp2", "lora-phi3-tp2", "lora-vocabulary-tp2", "lora-pp2"])
def test_saved_adapter_loads_into_a_plain_model_with_the_trained_logits(launches, name, tmp_path):
    import peft

    case = BY_NAME[name][1]
    record = _record(launches, name)
    for file, data in record["extras"]["adapter"].items():
        (tmp_path / file).write_bytes(data)
    family, vocabulary = case.module_kwargs.get("family", "llama"), case.module_kwargs.get("vocabulary", False)
    trained = trained_lora(family, record["weights"], vocabulary).eval()
    loaded = peft.PeftModel.from_pretrained(base_lm(family, record["weights"]).model, tmp_path).eval()
    tokens = torch.randint(0, 64, (2, 16), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        expected, got = trained(tokens), loaded(input_ids=tokens).logits
    assert (expected - trained_lora(family, reference(case)["weights"], vocabulary)(tokens)).abs().max() < 1e-4
    torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("name", [name for name in BY_NAME if name.startswith("lora-") and "tp2" in name])
def test_adapters_follow_their_base_layers_sharding_with_no_collective_of_their_own(launches, name):
    """q_proj (colwise): lora_B sharded by rows with the base, lora_A whole, no collective in its forward.
    o_proj (rowwise): lora_A sharded by columns with the base, lora_B whole, one collective in its forward: the
    base layer's all-reduce (reduce-scatter under sequence parallelism), which the adapter's partial output joins."""
    extras = _record(launches, name)["extras"]
    rowwise = "reduce_scatter_tensor" if BY_NAME[name][1].strategy.get("sequence_parallel") else "all_reduce"
    assert extras["adapter_placements"] == {
        "colwise:base_layer.weight": "(Shard(dim=0),)", "colwise:lora_A.default.weight": "(Replicate(),)",
        "colwise:lora_B.default.weight": "(Shard(dim=0),)",
        "rowwise:base_layer.weight": "(Shard(dim=1),)", "rowwise:lora_A.default.weight": "(Shard(dim=1),)",
        "rowwise:lora_B.default.weight": "(Replicate(),)",
    }
    assert extras["adapter_forward_collectives"] == {"colwise": {}, "rowwise": {f"c10d_functional.{rowwise}": 1}}


def test_a_parameter_frozen_at_setup_that_trains_later_is_refused_on_every_rank(launches):
    assert_error(_launch(launches, 2)[1][THAWED.name], "RuntimeError", [
        "model.model.embed_tokens.weight had requires_grad=False when FourDStrategy set up FrozenEmbeddingLM and"
        " requires grad now", "Fix: choose what trains before fit starts"])


# ------------------------------------------------------------------------------ without processes


def test_the_plan_printout_names_the_adapters_and_how_each_is_placed():
    from lightning_4d.tensor_parallel import plan_tensor_parallel

    text = plan_tensor_parallel(LoRALM("llama"), 2).describe()
    layers = "model.base_model.model.model.layers.*"
    assert (f"  adapters  {layers}.self_attn.{{q_proj,k_proj,v_proj}}, {layers}.mlp.{{gate_proj,up_proj}} (LoRA"
            " default): lora_B colwise with the base layer, lora_A whole on every rank") in text, text
    assert (f"  adapters  {layers}.self_attn.o_proj, {layers}.mlp.down_proj (LoRA default): lora_A rowwise with the"
            " base layer, lora_B whole on every rank") in text, text
    text = plan_tensor_parallel(LoRALM("llama", vocabulary=True), 2).describe()
    assert "  embedding model.base_model.model.model.embed_tokens.base_layer: rowwise" in text, text
    assert ("  adapters  model.base_model.model.model.embed_tokens (LoRA default): whole on every rank beside the"
            " sharded base layer") in text, text
    assert "model.base_model.model.lm_head (LoRA default): lora_B colwise" in text, text


def test_an_adapter_other_than_plain_lora_is_refused_before_any_collective_with_a_fix():
    from lightning_4d.tensor_parallel import plan_tensor_parallel

    with pytest.raises(ValueError, match=r"model.base_model.model.model.layers.0.self_attn.q_proj \(Linear\) is an"
                                         r" adapted layer with parameters \['lora_magnitude_vector.default.weight'\]"
                                         r".*Fix: keep it unsharded with tp_plan: \{'model.base_model.model.model"
                                         r".layers.\*.self_attn.q_proj': replicate\}, use plain LoRA on it, or use"
                                         r" tp=1."):
        plan_tensor_parallel(LoRALM("llama", use_dora=True), 2)

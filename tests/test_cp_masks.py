"""Context parallelism with the masks long-context training uses (issue #29), on unchanged models.

A Hugging Face Llama on right-padded SFT batches (``attention_mask``) and on packed documents (``position_ids``
restarting at 0), Mistral with a sliding window on sequences of four windows, Gemma 3 alternating a sliding-
window layer and a global one, and a hand-written model masking documents from a ``document_ids`` entry
(``cp_document_key``), and Ulysses (``cp_comm='a2a'``) on a grouped-query Llama: each trained under cp=2 (one launch) and cp=4, cp2 x tp2 and cp2 x pp2 (one launch of
four processes), some also with activation checkpointing and with dp_shard=2, against one process on the same batches (tests/parity.py: per-step losses, logged train_loss
and final weights within 1e-5, fp32, SGD). Each mask matters: one process without it trains to other numbers
(tests/test_ring_attention_masks.py checks the attention itself against dense masks).
"""

from dataclasses import replace

import pytest

from tests.parity import (Case, assert_error, assert_parity, max_difference, reference, report_difference,
                          train_layout_with_failures)

MODELS = {
    "padded_llama": dict(module="tests.cp_mask_models:MaskedLM", module_kwargs={"family": "llama"},
                         data="tests.cp_mask_models:padded_data"),
    "packed_llama": dict(module="tests.cp_mask_models:MaskedLM", module_kwargs={"family": "llama"},
                         data="tests.cp_mask_models:packed_data"),
    "window_mistral": dict(module="tests.cp_mask_models:MaskedLM", module_kwargs={"family": "mistral"},
                           data="tests.cp_mask_models:plain_data"),
    "mixed_gemma3": dict(module="tests.cp_mask_models:MaskedLM", module_kwargs={"family": "gemma3"},
                         data="tests.cp_mask_models:plain_data"),
    # Ulysses (all-to-all over heads) on a grouped-query Llama, with padding
    "ulysses_padded_llama8": dict(module="tests.cp_mask_models:MaskedLM", module_kwargs={"family": "llama8"},
                                  data="tests.cp_mask_models:padded_data", strategy={"cp_comm": "a2a"}),
    "document_ids": dict(module="tests.cp_mask_models:DocumentAttentionLM", data="tests.cp_mask_models:document_data",
                         strategy={"cp_document_key": "document_ids"}),
}
LAYOUTS = {2: {"cp2": {"cp": 2}},
           4: {"cp4": {"cp": 4}, "cp2_tp2": {"cp": 2, "tp": 2}, "cp2_pp2": {"cp": 2, "pp": 2, "pp_microbatches": 2}}}


# Composed with activation checkpointing (the attention recomputed in backward) and with sharded data parallelism.
COMPOSED = {2: [("padded_llama", "cp2_checkpointed", {"cp": 2, "activation_checkpointing": "full"}),
                ("window_mistral", "cp2_checkpointed", {"cp": 2, "activation_checkpointing": "full"}),
                ("packed_llama", "cp2_checkpointed", {"cp": 2, "activation_checkpointing": "full"})],
            4: [("padded_llama", "cp2_dp_shard2", {"cp": 2, "dp_shard": 2}),
                ("packed_llama", "cp2_dp_shard2", {"cp": 2, "dp_shard": 2}),
                ("mixed_gemma3", "cp2_dp_shard2", {"cp": 2, "dp_shard": 2})]}


def _case(model_name: str, layout_name: str, layout: dict) -> Case:
    spec = dict(MODELS[model_name])
    strategy = {**spec.pop("strategy", {}), **layout}
    return Case(f"{model_name}-{layout_name}", strategy=strategy, max_steps=3, batch_size=4, **spec)


def _cases(world_size: int) -> list[Case]:
    cases = [_case(model_name, layout_name, layout) for layout_name, layout in LAYOUTS[world_size].items()
             for model_name in MODELS
             # one attention layer: nothing to split into stages or shard by plan
             if not (model_name == "document_ids" and ("tp" in layout or "pp" in layout))]
    return cases + [_case(*composed) for composed in COMPOSED[world_size]]


CASES = {case.name: case for size in LAYOUTS for case in _cases(size)}


# A model that leaves the batch's attention_mask unused, on data whose first batch has no padding: the first
# batch's masks read as padded (the facts apply where the shard cannot tell), the later ones are checked against
# that on the device, and the check, read at the next batch, stops the run on every rank. The fix the error names,
# the same data without attention_mask, trains as one process.
BLIND = dict(module="tests.cp_mask_models:PaddingBlindLM", data="tests.cp_mask_models:late_padded_data",
             strategy={"cp": 2}, max_steps=4, batch_size=4)
BLIND_FIX = Case("padding_blind-cp2-no_attention_mask",
                 **{**BLIND, "data": "tests.cp_mask_models:late_padded_data_without_mask"})
FAILING_TWO = [Case("padding_blind-cp2", **BLIND)]


@pytest.fixture(scope="module")
def two_launch():
    return train_layout_with_failures(_cases(2) + [BLIND_FIX], FAILING_TWO, 2, timeout=420)


@pytest.fixture(scope="module")
def two(two_launch):
    return two_launch[0]


# Ulysses at cp=4 on a Llama with 2 key/value heads: refused on every rank before the first step.
FAILING = [_case("padded_llama", "cp4_a2a", {"cp": 4, "cp_comm": "a2a"})]


@pytest.fixture(scope="module")
def four():
    return train_layout_with_failures(_cases(4), FAILING, 4, timeout=600)


@pytest.mark.parametrize("name", [case.name for case in _cases(2)])
def test_two_processes_match_one(two, name):
    case = CASES[name]
    expected = reference(case)
    report_difference(case, expected, two[name])
    assert_parity(case, expected, two[name])


@pytest.mark.parametrize("name", [case.name for case in _cases(4)])
def test_four_processes_match_one(four, name):
    case = CASES[name]
    expected = reference(case)
    report_difference(case, expected, four[0][name])
    assert_parity(case, expected, four[0][name])


def test_a_mask_that_changes_meaning_stops_the_run_and_the_fix_trains_as_one_process(two_launch):
    assert_error(two_launch[1]["padding_blind-cp2"], "ValueError",
                 ["attention masks of an attention call the first time as made of causal order, the batch's padding"
                  " ('attention_mask')", "leave it out of the batch too"])
    expected = reference(BLIND_FIX)
    report_difference(BLIND_FIX, expected, two_launch[0][BLIND_FIX.name])
    assert_parity(BLIND_FIX, expected, two_launch[0][BLIND_FIX.name])


def test_ulysses_refuses_heads_cp_does_not_divide(four):
    assert_error(four[1]["padded_llama-cp4_a2a"], "ValueError",
                 ["cp_comm='a2a' gives each of the cp=4 ranks 1/4 of the attention heads", "has 2 key/value heads",
                  "Use cp_comm='ring'"])


@pytest.mark.parametrize("model", list(MODELS))
def test_each_mask_changes_what_one_process_trains(model):
    """Without the mask (no padding, no documents, no window) one process is off by over 10x the tolerance: the
    parity above can only hold if the mask was applied over the whole sequence."""
    case = CASES[f"{model}-cp2"]
    unmasked = replace(case, module_kwargs={**case.module_kwargs, "unmasked": True})
    loss, weight = max_difference(reference(case), reference(unmasked))
    assert loss > 1e-4 or weight > 1e-4, (loss, weight)


def test_an_unknown_micro_batch_in_recomputation_is_refused():
    """Pipeline x context parallelism with activation checkpointing: a Hugging Face layer recomputed during
    backward without a mask on a padded batch cannot know its micro-batch's rows; refused rather than guessed."""
    import torch

    from lightning_4d.context_parallel.masks import AttentionLayer, SequenceFacts, unmasked

    padding = torch.ones(4, 8, dtype=torch.long)
    padding[0, :2] = 0
    facts = SequenceFacts(padding, None, None, torch.tensor([0, 1, 6, 7]))
    facts.select(1, 2)
    layer = AttentionLayer(causal=True, window=None)
    assert unmasked(True, facts, layer, 2, 8) is None  # rows 2-3: no padding anywhere
    with pytest.raises(ValueError, match="activation_checkpointing='none' with pp and cp on padded batches"):
        unmasked(True, facts, layer, 2, 8, recomputing=True)

"""Activation checkpointing applied by the composition: each mode keeps less for backward, and training under
it gives the numbers of one process (losses per step, logged train_loss, final weights within 1e-5) under dp,
tp, cp and pp. The user's own (Hugging Face) checkpointing under cp is in tests/test_context_parallel.py."""

import gc

import pytest
import torch
from lightning.pytorch import Callback
from torch.profiler import ProfilerActivity, profile

from lightning_4d.memory.activation_checkpointing import ActivationCheckpointConfig, apply_activation_checkpointing
from lightning_4d.planner import Layout, Model, Training, estimate, kept_bytes_per_layer
from tests.lm_models import tiny_gpt, token_data
from tests.parity import Case, assert_error, assert_parity, reference, train_layout_with_failures

LM = dict(module="tests.lm_models:tiny_gpt", data="tests.lm_models:token_data", max_steps=4)


class CheckpointedBlocks(Callback):
    """Reports which blocks the strategy checkpointed on each rank (none would make parity tell nothing)."""

    def parity_extras(self, trainer):
        return {"checkpointed": trainer.strategy.parallel.checkpointed_blocks}


PROBE = ["tests.test_activation_checkpointing:CheckpointedBlocks"]
MODES_UNDER = ("full", "selective", "every_n")
TWO = [Case(f"{dim}2_{mode}", strategy={dim: 2, "activation_checkpointing": mode}, callbacks=PROBE, **LM)
       for dim in ("dp", "tp", "cp", "pp") for mode in MODES_UNDER]
# Rank 0 holds blocks 0-1 of 4 under pp=2; the others hold all 4. every_n checkpoints every second block
# counted over the whole model (1 and 3).
EXPECTED_BLOCKS = {case.name: ([0, 1] if case.name.startswith("pp") else [0, 1, 2, 3])
                   if not case.name.endswith("every_n") else ([1] if case.name.startswith("pp") else [1, 3])
                   for case in TWO}
# The module's own checkpointing (Hugging Face's gradient checkpointing, non-reentrant) under each dimension;
# cp=2 and pp=2 x cp=2 are in tests/test_context_parallel.py.
OWN = [Case(f"{dim}2_hf_own_checkpointing", module="tests.cp_models:CheckpointedLlama", strategy={dim: 2},
            data="tests.lm_models:token_data", max_steps=4) for dim in ("dp", "tp", "pp")]
FAILING = {
    "no_blocks": (Case("no_blocks", module="tests.models:Classifier", data="tests.models:classification_data",
                       strategy={"dp": 2, "activation_checkpointing": "full"}, max_steps=1),
                  "ValueError", ["activation_checkpointing works on the module's blocks",
                                 "activation_checkpointing='none'"]),
    # Reentrant: the received activation would get no gradient (the fix, use_reentrant=False, is pp2 in OWN).
    "pp2_hf_reentrant": (Case("pp2_hf_reentrant", module="tests.cp_models:CheckpointedLlama",
                              module_kwargs={"use_reentrant": True}, data="tests.lm_models:token_data",
                              strategy={"pp": 2}, max_steps=1),
                         "ValueError", ["pp=2: model.model.layers.0 (LlamaDecoderLayer) checkpoints itself with"
                                        " use_reentrant=True", "{'use_reentrant': False}",
                                        "activation_checkpointing='full'"]),
}


@pytest.fixture(scope="module")
def two():
    return train_layout_with_failures(TWO + OWN, [case for case, _, _ in FAILING.values()], 2, timeout=600)


@pytest.mark.parametrize("case", TWO, ids=lambda c: c.name)
def test_each_mode_matches_one_process(two, case):
    records, _ = two
    assert records[case.name]["extras"]["checkpointed"] == EXPECTED_BLOCKS[case.name]
    assert_parity(case, reference(case), records[case.name])


@pytest.mark.parametrize("case", OWN, ids=lambda c: c.name)
def test_the_modules_own_checkpointing_matches_one_process(two, case):
    records, _ = two
    assert_parity(case, reference(case), records[case.name])


@pytest.mark.parametrize("name", FAILING)
def test_what_cannot_be_checkpointed_is_refused(two, name):
    _, errors = two
    _, kind, phrases = FAILING[name]
    assert_error(errors[name], kind, phrases)


def _held_after_forward(mode: str) -> int:
    """Bytes a forward of the example GPT leaves allocated (its output and what autograd keeps for backward),
    from the profiler's CPU allocation records."""
    torch.manual_seed(0)
    module = tiny_gpt(n_layer=4, n_embd=64, block_size=128)
    apply_activation_checkpointing(list(enumerate(module.model.layers)), ActivationCheckpointConfig(mode))
    inputs = token_data(size=4, seq_len=128).tensors[0]
    # Frees of tensors allocated before the profile count as negative usage: collect earlier tests' garbage
    # first, and keep the collector from running inside the window (it once made 'full' hold -1 MB).
    gc.collect()
    gc.disable()
    try:
        with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as profiler:
            loss = module(inputs).sum()
    finally:
        gc.enable()
    held = sum(event.self_cpu_memory_usage for event in profiler.key_averages())
    loss.backward()  # the checkpointed blocks recompute here
    return held


MODES = ("none", "every_n", "selective", "full")


@pytest.fixture(scope="module")
def held():
    return {mode: _held_after_forward(mode) for mode in MODES}


def test_each_mode_keeps_less_for_backward(held):
    # Measured: none 9.9 MB, every second block 5.4 MB, selective 5.7 MB, full 0.94 MB (0.095 of none).
    none, every_2, selective, full = (held[mode] for mode in MODES)
    assert full < selective < none and full < every_2 < none, (none, every_2, selective, full)
    assert full < 0.35 * none, (full, none)


def test_the_planner_counts_what_each_mode_keeps(held):
    """The planner's activations after the forward (its peak adds one recomputed block) are within 30% of the
    measured ones for every mode (measured: planner 10.1/5.6/5.9/1.2 MB against 9.9/5.4/5.7/0.94 MB)."""
    model = Model.from_module(tiny_gpt(n_layer=4, n_embd=64, block_size=128))
    for mode in MODES:
        training = Training(seq_len=128, global_batch=4, activation_checkpointing=mode)
        _, block = kept_bytes_per_layer(model, training, Layout())
        after_forward = estimate(model, training, Layout()).memory["activations"] - (block if mode != "none" else 0)
        assert abs(after_forward - held[mode]) <= 0.3 * held[mode], (mode, after_forward, held[mode])


def test_bad_options_are_refused_before_launch():
    with pytest.raises(ValueError, match="activation_checkpointing='some' is not a mode: use one of none, full"):
        ActivationCheckpointConfig("some")
    with pytest.raises(ValueError, match="activation_checkpointing_every=0 must be a positive number of blocks"):
        ActivationCheckpointConfig("every_n", 0)


def test_hugging_face_kv_caches_are_turned_off():
    """A checkpointed Hugging Face layer recomputed with use_cache=True appends its keys and values to the cache
    again (torch's checkpoint then sees tensors of twice the length): turned off, as gradient_checkpointing_enable
    turns it off, and named."""
    import transformers

    from lightning_4d.memory.activation_checkpointing import disable_kv_caches

    config = transformers.LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                                      num_attention_heads=4, num_key_value_heads=2)
    wrapper = torch.nn.ModuleDict({"model": transformers.LlamaForCausalLM(config)})
    assert wrapper["model"].config.use_cache is True
    assert disable_kv_caches(wrapper) == ["model (LlamaForCausalLM)"]
    assert wrapper["model"].config.use_cache is False
    assert disable_kv_caches(wrapper) == []

"""The model zoo (``tests/zoo_models.py``) under each dimension at 2 against one process, and its refusals.

Every family (Hugging Face, litgpt, torchtitan, torch's and Lightning's own, the Llama fine-tuned: peft
LoRA, or its embedding frozen; Qwen2-MoE and Mixtral with fused experts, DeepSeek-V3's latent attention,
BERT's masked LM and T5's encoder-decoder), unchanged inside a plain LightningModule, trains at dp=2, tp=2, cp=2 and pp=2 (the default strategy options, nothing named but
tp_strict) in ONE launch of 2 processes: losses per step, logged train_loss and final
weights within 1e-5 relative of one process, after 3 SGD steps (the third step's loss already depends on two
updates through momentum; more steps cost time, not evidence). Where a dimension refuses a family, the refusal
is a case that must fail on every rank with its message, and the fix the message names trains at parity in the
same launch. Bloom under cp, Lightning's demo Transformer under cp (its positional encoding reads the sequence
length) and under pp (nn.Transformer is an encoder-decoder), T5 under cp (its relative-position bias) and under pp
(an encoder-decoder) are the refusals today.

``TABLE`` declares what each family does under each dimension; the tests check it cell by cell, and
``docs/zoo_table.py`` writes ``docs/zoo.md`` from it (``test_docs_zoo_table_is_current`` fails when that file
is stale). Three families also train at dp2 x pp2 x cp2 x tp2 in ``tests/test_parity_matrix.py``.
"""

from __future__ import annotations

import json
import sys
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Union

import pytest

from tests import zoo_models
from tests.parity import (Case, assert_error, assert_exact_resume, assert_parity, reference, report_difference,
                          train_layout_with_failures)
from tests.test_parity_matrix import ZOO_FAMILIES as FOUR_D_FAMILIES

# The families of the zoo: tiny configs of library classes (see tests/zoo_models.py): Hugging Face, torch and
# Lightning's own, litgpt and torchtitan.
ZOO = (zoo_models.FAMILIES + zoo_models.LIBRARY_FAMILIES + zoo_models.FINE_TUNING_FAMILIES + zoo_models.MASK_FAMILIES
       + zoo_models.NEW_FAMILIES)
DIMENSIONS = ("dp", "tp", "cp", "pp")
# Each dimension at 2, nothing else named; tensor parallelism strict: a family whose automatic plan shards less
# than 90% of its body is refused, so a cell at parity cannot come from a model left mostly whole.
CELL = {dim: {dim: 2, **({"tp_strict": True} if dim == "tp" else {})} for dim in DIMENSIONS}
STEPS = 3
# Also trained at dp=2 x pp=2 x cp=2 x tp=2 in tests/test_parity_matrix.py (Llama as tests.lm_models' HFCausalLM).
FOUR_D = ("llama", *FOUR_D_FAMILIES)


@dataclass(frozen=True)
class Refused:
    """A dimension that refuses a family: the error every rank raises, phrases of its message (the module it
    names and the fix), and the fix as strategy options, which must train at parity."""

    error: str
    phrases: tuple[str, ...]
    fix: dict = field(hash=False)
    why: str  # for docs/zoo.md: what the model does that the dimension cannot take
    fix_text: str  # for docs/zoo.md: the fix, as a user writes it


_DEMO = "model.transformer."


def _replicated(dim: str, error_phrases: tuple[str, ...], why: str) -> Refused:
    """A dimension refused with the fix every such message names: that dimension at 1, dp=2 in its place."""
    return Refused("ValueError", (*error_phrases, f"Use {dim}=1 (dp=N replicates the model instead)"), fix={"dp": 2},
                   why=why, fix_text=f"{dim}=1 (`dp=2` replicates the model instead)")


REFUSED: dict[tuple[str, str], Refused] = {
    # Bloom adds its ALiBi bias to attention scores it computes itself (transformers offers no 'sdpa' for it).
    ("bloom", "cp"): Refused(
        "ValueError", ("cp=2: model.transformer.h.0.self_attention (BloomAttention) computes attention by hand",
                       "attn_implementation='eager'", "BloomForCausalLM offers no attn_implementation='sdpa'",
                       "use cp=1 (dp=N replicates the model instead)"),
        fix={"dp": 2},
        why="Bloom computes attention scores by hand to add ALiBi (Hugging Face's 'eager' attention, no 'sdpa')",
        fix_text="cp=1 (`dp=2` replicates the model instead)"),
    # Lightning's demo PositionalEncoding adds pe[:, x.size(1)] (the row at the sequence length, not the rows
    # up to it) to every token: on a shard that is another row. Its 12 nn.MultiheadAttention (the decoder's
    # cross-attention reads the sequence-sharded memory) train at cp=2 with that table's rows made alike (below).
    ("lightning_demo", "cp"): Refused(
        "ValueError", ("cp=2: model.pos_encoder (lightning.pytorch.demos' PositionalEncoding) adds pe[:, x.size(1)]",
                       "Use cp=1 (dp=N replicates the model instead)"),
        fix={"dp": 2},
        why="Lightning's demo `PositionalEncoding` adds the table's row at the sequence length (`pe[:, x.size(1)]`)"
            " to every token: a shard's length picks another row",
        fix_text="cp=1 (`dp=2` replicates the model instead)"),
    # nn.Transformer: an encoder and a decoder, each a list of 4 layers. Cut at either (pp_blocks), the later
    # stage computed the decoder's target embedding (or the encoder's memory) from modules it does not hold and
    # trained a different model without an error (loss 5e-2 off at the first step): refused as an encoder-decoder.
    ("lightning_demo", "pp"): Refused(
        "ValueError", (f"pp=2: {_DEMO.rstrip('.')} (Transformer) is an encoder-decoder",
                       "reads the encoder's output (memory)", "Use pp=1 (dp=N replicates the model instead)"),
        fix={"dp": 2},
        why="nn.Transformer is an encoder-decoder: its decoder reads the encoder's output and the embedded target"
            " beside the one activation pipeline stages pass on",
        fix_text="pp=1 (`dp=2` replicates the model instead)"),
    # T5 adds a learned bias per bucket of query-key distance to its scores, computed from the lengths it holds
    # (transformers 5.3: by hand, no 'sdpa'; 5.24: as SDPA's mask): refused before the attention's mask is met.
    ("t5", "cp"): _replicated(
        "cp", ("cp=2: model.encoder.block.0.layer.0.SelfAttention (T5Attention) adds a learned relative-position bias",
               "relative_attention_bias: 8 distance buckets x 4 heads"),
        "T5 adds a learned relative-position bias (`relative_attention_bias`, per bucket of query-key distance) to"
        " its attention scores, computed from the positions a rank holds"),
    # T5's decoder reads the encoder's output beside its own input, as nn.Transformer's does.
    ("t5", "pp"): _replicated(
        "pp", ("pp=2: model (T5ForConditionalGeneration) is an encoder-decoder",
               "reads the encoder's output (memory)"),
        "T5ForConditionalGeneration is an encoder-decoder: its decoder reads the encoder's output and its own embedded"
        " input beside the one activation pipeline stages pass on"),
    # Manual optimization: the pipeline schedule runs every micro-batch's backward itself.
    ("llama_manual", "pp"): Refused(
        "ValueError", ("FourDStrategy(pp=2) needs automatic optimization", "ManualClipLM.automatic_optimization is False",
                       "Use automatic optimization, or pp=1."),
        fix={"dp": 2},
        why="the pipeline schedule runs the forward and backward of every micro-batch itself, so `manual_backward`"
            " cannot",
        fix_text="automatic optimization, or pp=1 (`dp=2` replicates the model instead)"),
}
# What the cells at parity show besides parity (knowledge the zoo's earlier homes in the suite recorded).
NOTES: dict[tuple[str, str], str] = {
    ("opt", "cp"): "OPT's learned positions take `position_ids` after an attention mask: they get global positions",
    ("opt", "pp"): "OPT's `final_layer_norm`, registered before its layers, goes to the last stage, where it runs",
    ("opt", "tp"): "OPT's decoder layer holds `fc1`/`fc2` beside `self_attn`: both are sharded regions",
    ("torch_transformer", "tp"): "`nn.MultiheadAttention`'s fused `in_proj_weight` sharded by heads (permuted"
                                 " per rank), lightning_4d's forward on each instance; `linear1`/`linear2` a region",
    ("torch_transformer", "cp"): "`nn.MultiheadAttention` runs lightning_4d's forward, whose attention call is"
                                 " ring attention (causal from `is_causal`)",
    ("lightning_demo", "tp"): "`nn.Transformer`: 12 `nn.MultiheadAttention` (self- and cross-attention) sharded by"
                              " heads",
    ("torch_transformer", "pp"): "`nn.TransformerEncoder` reads `self.layers[0]` in its forward: each stage's list"
                                 " is numbered from 0 while it runs",
    ("gpt_neox", "tp"): "`query_key_value` holds q, k, v head by head: a contiguous shard is whole heads",
    ("bloom", "tp"): "`query_key_value` head by head; the ALiBi bias, built for every head, gets each rank's rows",
    ("gemma", "tp"): "one key/value head: k and v whole on both ranks, q and o sharded",
    ("phi3", "tp"): "fused `qkv_proj` and `gate_up_proj`, permuted per rank",
    ("llama_lora", "tp"): "peft LoRA, base frozen: on q/k/v/gate/up `lora_B` sharded with the base and `lora_A`"
                          " whole; on o/down `lora_A` sharded with the base and `lora_B` whole (tests/test_adapters.py"
                          " also at dp_shard=2, tp2 x dp2, tp2 x cp2 and on Phi-3's fused projections)",
    ("llama_frozen_embedding", "tp"): "the vocabulary-sharded embedding frozen: no gradient, hook or optimizer state",
    ("llama_sft", "cp"): "supervised fine-tuning batches, each prompt masked with -100 (its length drawn from 0 to the"
                         " whole window): sequence shards hold different numbers of answer tokens, weighted as one"
                         " process weighs them (docs/fine_tuning.md; tests/test_fine_tuning.py has more layouts)",
    ("llama_mlm", "cp"): "masked-LM targets, about 15% of the positions, the rest -100",
    ("llama_packed", "cp"): "documents of 2 to 12 tokens packed into each row, `position_ids` restarting at 0: each"
                            " document attends only to itself, across shards (docs/context_parallel.md#masks-padding"
                            "-sliding-windows-packed-documents; tests/test_cp_masks.py has more layouts)",
    ("mistral_sliding", "cp"): "a sliding window of 8 tokens on sequences of 32: tiles outside the window skipped",
    ("gemma3_sliding", "cp"): "a sliding-window layer (8 tokens) and a global layer on sequences of 32, each with its"
                              " own mask",
    ("llama_manual", "tp"): "`manual_backward`, `clip_gradients` by the norm over the whole model (clipping: 0.5,"
                            " below the real norm), `step`; tests/test_manual_optimization.py has more layouts",
    ("qwen2_moe", "tp"): "fused 3-D experts (`gate_up_proj` [E, 2I, H], `down_proj` [E, H, I]) sharded on their"
                         " intermediate dimension, one sum over tp after the combine; the shared expert an MLP region;"
                         " 4 experts, top-2, every one routed to (tests/test_expert_parallel.py checks it, and"
                         " trains ep layouts)",
    ("mixtral", "tp"): "fused 3-D experts sharded on their intermediate dimension, the router whole",
    ("deepseek_v3", "tp"): "multi-head latent attention (dense layers only): heads split after the low-rank"
                           " up-projections (`q_b_proj`, `kv_b_proj` column-wise, `o_proj` row-wise), the"
                           " down-projections and their norms whole, the shared rotary key columns' gradient summed"
                           " over tp",
    ("deepseek_v3", "cp"): "value heads (8) narrower than query/key heads (16: 8 without and 8 with rotary)",
    ("bert", "tp"): "`BertForMaskedLM`: q/k/v in `attention.self`, the output projection in the sibling"
                    " `attention.output`, the MLP over the layer's `intermediate`/`output`",
    ("bert", "cp"): "bidirectional attention (no causal mask) across the shards; masked-LM windows, a quarter of"
                    " the tokens masked, every position a target",
    ("bert", "pp"): "the decoder tied to the word embedding: kept by the first and the last stage, gradients summed",
    ("t5", "tp"): "`T5ForConditionalGeneration`: self- and cross-attention by heads, each stack's relative-position"
                  " bias split with the heads, the one `shared` table (tied to both stacks' `embed_tokens` and"
                  " `lm_head`) sharded alike under its names; trained to reverse its source",
}

PARITY = "parity"
TABLE: dict[str, dict[str, Union[str, Refused]]] = {
    family: {dim: REFUSED.get((family, dim), PARITY) for dim in DIMENSIONS} for family in ZOO}
assert set(REFUSED) <= {(f, d) for f in ZOO for d in DIMENSIONS}, "a refusal for a family or dimension not in TABLE"


def _case(family: str, name: str, strategy: dict) -> Case:
    return Case(name, module="tests.zoo_models:zoo_lm", module_kwargs={"family": family},
                data=zoo_models.FAMILY_DATA.get(family, "tests.lm_models:token_data"), strategy=strategy,
                max_steps=STEPS)


def _cases() -> tuple[list[Case], list[Case], dict[tuple[str, str], str]]:
    """The parity cases (every cell at parity, every refusal's fix), the failing cases (every refusal), and
    for each cell the name of the case that shows it at parity (a refused cell: its fix's)."""
    parity: dict[tuple[str, str], Case] = {}  # (family, strategy as JSON) -> case: a fix met twice runs once
    failing, shown = [], {}
    for family in ZOO:
        for dim in DIMENSIONS:
            cell = TABLE[family][dim]
            name = f"{family}-{dim}2"
            strategy = CELL[dim] if cell == PARITY else cell.fix
            if cell != PARITY:
                failing.append(_case(family, name, {dim: 2}))
                name += "-fix"
            key = (family, json.dumps(strategy, sort_keys=True))
            parity.setdefault(key, _case(family, name, strategy))
            shown[family, dim] = parity[key].name
    return list(parity.values()), failing, shown


PARITY_CASES, FAILING_CASES, SHOWN = _cases()
# nn.Transformer's self- and cross-attention under cp, without the demo's length-dependent position row.
PARITY_CASES.append(Case("lightning_demo_same_position_rows-cp2", module="tests.zoo_models:LightningDemoSameRowsLM",
                         data="tests.lm_models:token_data", strategy={"cp": 2}, max_steps=STEPS))
BY_NAME = {case.name: case for case in PARITY_CASES}


# torchtitan's state-dict hooks rename its fused wqkv (saved as wq/wk/wv), so its checkpoints take the module's own
# state_dict/load_state_dict: in the same launch, at tp=2, a checkpoint at step 2 resumed exactly, and weights of
# another seed loaded from a plain state_dict file (init_from) against one process starting from the same file.
TITAN = "torchtitan_llama3"
OTHER_SEED = 4321


def _titan_state_cases(workdir: Path) -> tuple[Case, Case, Case]:
    import lightning.pytorch as pl
    import torch

    pl.seed_everything(OTHER_SEED, verbose=False)
    weights = workdir / "torchtitan_other_seed.pt"
    torch.save(zoo_models.zoo_lm(TITAN).state_dict(), weights)
    resumed = replace(_case(TITAN, f"{TITAN}-tp2-resumed", CELL["tp"]), max_steps=4, resume_at=2)
    from_file = _case(TITAN, f"{TITAN}-tp2-init_from_file", {**CELL["tp"], "init_from": str(weights)})
    one_process = replace(from_file, module="tests.zoo_models:zoo_lm_from",
                          module_kwargs={"family": TITAN, "weights": str(weights)}, strategy={})
    return resumed, from_file, one_process


@pytest.fixture(scope="module")
def titan_state(tmp_path_factory):
    return _titan_state_cases(tmp_path_factory.mktemp("titan"))


@pytest.fixture(scope="module")
def zoo(titan_state):
    resumed, from_file, _ = titan_state
    return train_layout_with_failures(PARITY_CASES + [resumed, from_file], FAILING_CASES, 2, timeout=600)


@pytest.mark.parametrize("name", list(BY_NAME))
def test_family_matches_one_process(zoo, name):
    case = BY_NAME[name]
    expected = reference(case)
    report_difference(case, expected, zoo[0][name])
    assert_parity(case, expected, zoo[0][name])


@pytest.mark.parametrize(("family", "dim"), list(REFUSED), ids=lambda v: v)
def test_refusal_names_the_module_and_a_fix_that_trains(zoo, family, dim):
    refused = REFUSED[family, dim]
    assert_error(zoo[1][f"{family}-{dim}2"], refused.error, list(refused.phrases))
    fix = BY_NAME[SHOWN[family, dim]]  # the message's fix (refused.fix), trained in the same launch
    assert_parity(fix, reference(fix), zoo[0][fix.name])


def test_torchtitans_renamed_state_resumes_exactly_and_loads_from_a_file(zoo, titan_state):
    resumed, from_file, one_process = titan_state
    records = zoo[0]
    assert_exact_resume(records[resumed.name])
    assert_parity(resumed, reference(resumed), records[resumed.name])
    expected = reference(one_process)  # starts from the file's weights, as init_from does
    assert abs(expected["losses"][0] - reference(from_file)["losses"][0]) > 1e-3, "the file's weights are the seed's"
    assert_parity(from_file, expected, records[from_file.name])


def test_every_cell_is_declared_and_run():
    assert set(TABLE) == set(ZOO) and all(set(row) == set(DIMENSIONS) for row in TABLE.values())
    assert set(SHOWN) == {(f, d) for f in ZOO for d in DIMENSIONS}
    for (family, dim), name in SHOWN.items():
        if TABLE[family][dim] == PARITY:
            assert BY_NAME[name].strategy == CELL[dim], (family, dim, BY_NAME[name].strategy)


# ------------------------------------------------------------------------------ without processes


@pytest.mark.parametrize("implementation, how", [("eager", "by hand"), ("flex_attention", "with its own kernel")])
def test_hugging_face_attention_other_than_sdpa_is_refused_with_sdpa_as_the_fix(implementation, how):
    """A model that could run 'sdpa' but was loaded with 'eager' (the refusal Bloom gets names cp=1 only) or with
    'flex_attention' (its own kernel, out of ring attention's reach): the fix it names is what every other Hugging
    Face family of the zoo does, trained above at cp=2."""
    import transformers

    from lightning_4d.context_parallel import check_attention_reachable

    model = transformers.AutoModelForCausalLM.from_config(zoo_models._hf_config("llama"),
                                                          attn_implementation=implementation)
    with pytest.raises(ValueError, match=rf"cp=2: model.layers.0.self_attn \(LlamaAttention\) computes attention {how}"
                                         rf" .*attn_implementation='{implementation}'.*Load it with"
                                         r" attn_implementation='sdpa', or use cp=1"):
        check_attention_reachable(model, 2)
    check_attention_reachable(zoo_models.zoo_lm("llama"), 2)  # the zoo's, loaded with 'sdpa'


def test_docs_zoo_table_is_current():
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "docs"))
    import zoo_table

    zoo, _ = zoo_table.sweep_sections(zoo_table.OUTPUT.read_text())  # the sweep: tests/test_family_sweep.py
    assert zoo == zoo_table.render(), "docs/zoo.md is stale: run python docs/zoo_table.py"

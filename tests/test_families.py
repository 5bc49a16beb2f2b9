"""Model families issue #28 names, from Hugging Face configs, trained against one process on the same global
batches (losses per step, logged train loss, final weights within 1e-5; fp32, SGD, dropout 0; gradients
clipped below their norm, so the clip's global norm over plain and DTensor gradients takes part):

1. A BERT-style encoder (``BertForMaskedLM``; RoBERTa and XLM-R share the layout): the automatic plan finds
   q/k/v in ``attention.self`` with the output projection in the sibling ``attention.output`` and the MLP over
   the layer's ``intermediate``/``output``, and shards >= 90% of the body (``tp_strict``). At tp=2, cp=2
   (bidirectional attention) and dp2 x tp2.
2. Multi-head latent attention (``DeepseekV3ForCausalLM`` without experts): the heads split after the low-rank
   up-projections (q_b_proj, kv_b_proj column-wise, o_proj row-wise), the down-projections and their norms
   whole, the rotary key columns' gradient summed over tp. At tp=2 (also with the full-rank q_proj of
   DeepSeek-V2-Lite) and cp=2 (value heads narrower than query/key heads).
   With 512 learned positions (more rows than its vocabulary) the word embedding and the tied MLM decoder are
   still the ones sharded over the vocabulary; so are OPT's token embedding and head beside its 130 positions
   (at tp=2 and cp=2).
3. T5 (``T5ForConditionalGeneration``): q/k/v/o attentions (self and cross), the relative-position bias
   (``nn.Embedding(buckets, heads)``) split with the heads, the one shared table tied across ``shared``, the
   encoder's and decoder's ``embed_tokens`` and ``lm_head`` placed alike. At tp=2 (``tp_strict``) and dp2 x tp2.
4. Families the sweep (tests/family_sweep.py) flagged, now planned: Phi (q/k/v -> ``dense``), XLM (q_lin/k_lin/
   v_lin -> out_lin, lin1 -> lin2), ELECTRA (BERT's layout behind an embedding projection) and Falcon-7B's
   multi-query ``query_key_value`` (every q head, then one k and one v head), and ModernBERT, encoder (fused
   ``Wqkv`` -> ``Wo``) and decoder (q/k/v_proj -> ``Wo``), each with a fused gate|up ``Wi`` -> ``Wo`` MLP and a
   sliding-window layer, at tp=2 (``tp_strict``).

One 2-process and one 4-process launch (tests/parity.py) hold every case; plans and refusals run in this
process.
"""

from __future__ import annotations

import pytest

from lightning_4d.tensor_parallel import plan_tensor_parallel
from tests.family_models import BertMLM, DeepseekV3LM, T5Seq2Seq
from tests.parity import Case
from tests.test_library_patterns import CLIP, SHARDING, _assert_parity  # parity, clipping acts, tp shards
from tests.test_tp_strategy import _launch  # one launch per world size (timeout 600 s)

F = "tests.family_models:"
STRICT = {"tp_strict": True}
BERT = dict(module=F + "BertMLM", data=F + "mlm_data", max_steps=3, trainer=CLIP, callbacks=[SHARDING])

MLA = dict(module=F + "DeepseekV3LM", data="tests.lm_models:token_data", max_steps=3, trainer=CLIP,
           callbacks=[SHARDING])
SWEPT = dict(module=F + "SweptLM", data="tests.lm_models:token_data", max_steps=3, trainer=CLIP,
             callbacks=[SHARDING])
OPT = dict(module=F + "OPTLongPositions", data="tests.lm_models:token_data", max_steps=3, trainer=CLIP,
           callbacks=[SHARDING])
T5 = dict(module=F + "T5Seq2Seq", data=F + "seq2seq_data", max_steps=3, trainer=CLIP, callbacks=[SHARDING])

TWO = [
    Case("bert_tp2", strategy={"tp": 2, **STRICT}, **BERT),
    Case("bert_cp2", strategy={"cp": 2}, **BERT),
    Case("mla_tp2", strategy={"tp": 2, **STRICT}, **MLA),
    Case("mla_full_rank_q_tp2", strategy={"tp": 2, **STRICT}, module_kwargs={"q_lora_rank": None}, **MLA),
    Case("mla_cp2", strategy={"cp": 2}, **MLA),
    Case("t5_tp2", strategy={"tp": 2, **STRICT}, **T5),
    # Learned positions with more rows than the vocabulary: the vocabulary embedding and head are still found.
    Case("bert_512_positions_tp2", strategy={"tp": 2}, module_kwargs={"positions": 512}, **BERT),
    Case("opt_long_positions_tp2", strategy={"tp": 2}, **OPT),
    Case("opt_long_positions_cp2", strategy={"cp": 2}, **OPT),
    *(Case(f"{family}_tp2", strategy={"tp": 2, **STRICT}, module_kwargs={"family": family}, **SWEPT)
      for family in ("phi", "xlm", "electra", "falcon", "modernbert", "modernbert_decoder")),
]
FOUR = [
    Case("bert_dp2_tp2", strategy={"dp": 2, "tp": 2, **STRICT}, **BERT),
    Case("t5_dp2_tp2", strategy={"dp": 2, "tp": 2, **STRICT}, **T5),
]
ALL = {case.name: case for case in TWO + FOUR}


@pytest.fixture(scope="module")
def two():
    return _launch(2, TWO, {})


@pytest.fixture(scope="module")
def four():
    return _launch(4, FOUR, {})


@pytest.mark.parametrize("name", [case.name for case in TWO])
def test_two_processes_match_one(two, name):
    _assert_parity(ALL[name], two[0][name])


@pytest.mark.parametrize("name", [case.name for case in FOUR])
def test_four_processes_match_one(four, name):
    _assert_parity(ALL[name], four[0][name])


# ------------------------------------------------------------------------------------ 1. BERT-style encoders


def test_bert_layers_are_sharded(two):
    dtensors = two[0]["bert_tp2"]["extras"]["dtensors"]
    layer = "model.bert.encoder.layer.0."
    for name in ("attention.self.query.weight", "attention.self.value.bias", "attention.output.dense.weight",
                 "intermediate.dense.weight", "output.dense.weight"):
        assert layer + name in dtensors, (name, dtensors)
    # The decoder's bias is listed under its first registration, cls.predictions.bias: that alias follows it.
    for name in ("model.bert.embeddings.word_embeddings.weight", "model.cls.predictions.bias"):
        assert name in dtensors, (name, dtensors)


def test_vocabulary_is_found_when_positions_outnumber_it(two):
    """BERT with 512 learned positions and OPT with 130, both over a vocabulary of 64: the token embedding and
    the head tied to it are sharded over the vocabulary (the position tables stay whole), at parity above."""
    bert = two[0]["bert_512_positions_tp2"]["extras"]["dtensors"]
    for name in ("model.bert.embeddings.word_embeddings.weight", "model.cls.predictions.bias"):
        assert name in bert, (name, bert)
    assert "model.bert.embeddings.position_embeddings.weight" not in bert
    opt = two[0]["opt_long_positions_tp2"]["extras"]["dtensors"]
    assert "model.model.decoder.embed_tokens.weight" in opt, opt
    assert "model.model.decoder.embed_positions.weight" not in opt
    plan = plan_tensor_parallel(BertMLM(positions=512), 2)
    assert plan.styles["model.bert.embeddings.word_embeddings"].role == "embedding"
    assert plan.styles["model.cls.predictions.decoder"].role == "head"


def test_bert_plan():
    """q/k/v one level down, the output projection in the sibling; its LayerNorm (after the all-reduce) whole;
    the head sizes of ``attention.self`` divided; >= 90% of the body sharded even at this tiny size."""
    plan = plan_tensor_parallel(BertMLM(), 2)
    layer = "model.bert.encoder.layer.0"
    attention = plan.regions[f"{layer}.attention"]
    assert (attention.heads, attention.head_dim, attention.narrow) == (4, 8, False)
    assert attention.after == ("output.LayerNorm",) and attention.projection_norms == ()
    assert plan.regions[layer].kind == "mlp" and plan.regions[layer].loose
    for name, style in (("attention.self.query", "colwise"), ("attention.self.key", "colwise"),
                        ("attention.self.value", "colwise"), ("attention.output.dense", "rowwise"),
                        ("intermediate.dense", "colwise"), ("output.dense", "rowwise")):
        assert plan.styles[f"{layer}.{name}"].style == style, name
    assert f"{layer}.attention.output.LayerNorm" not in plan.styles
    assert plan.attributes[f"{layer}.attention.self"] == {"num_attention_heads": 2, "all_head_size": 16}
    assert plan.coverage.share >= 0.9, plan.coverage.describe()


@pytest.mark.parametrize("family", ["Bert", "Roberta", "XLMRoberta", "Electra"])
def test_bert_style_families_at_their_real_sizes(family):
    """The real configs' sizes (base: hidden 768, 12 heads, 12 layers; on the meta device): the same layout
    found in each family, tied head included, and nearly all of the body sharded at tp=4."""
    import torch
    import transformers

    config = getattr(transformers, f"{family}Config")()
    config.vocab_size = -(-config.vocab_size // 64) * 64  # padded, as the refusal of BERT's 30522 says
    with torch.device("meta"):
        model = getattr(transformers, f"{family}ForMaskedLM")(config)
    plan = plan_tensor_parallel(model, 4)
    attention = [r for r in plan.regions.values() if r.kind == "attention"]
    assert len(attention) == config.num_hidden_layers and attention[0].heads == config.num_attention_heads
    assert sum(r.kind == "mlp" for r in plan.regions.values()) == config.num_hidden_layers
    assert plan.coverage.share >= 0.95, plan.coverage.describe()


def test_bert_sequence_parallel_is_refused():
    """Neither the MLP (its linears beside the layer's attention) nor the attention (the residual BERT adds
    inside ``attention.output`` is the hidden state the attention received, which sequence parallelism would
    hand it as a sequence shard) can take it: refused before any collective, naming the module and the fix."""
    with pytest.raises(ValueError, match=r"sequence_parallel=True: model.bert.encoder.layer.0 \(BertLayer\) holds"
                                         r" its MLP's linears intermediate.dense and output.dense.*Use"
                                         r" sequence_parallel=False"):
        plan_tensor_parallel(BertMLM(), 2, sequence_parallel=True)
    with pytest.raises(ValueError, match=r"sequence_parallel=True: model.bert.encoder.layer.0.attention "
                                         r"\(BertAttention\) adds the hidden state.*Use sequence_parallel=False"):
        plan_tensor_parallel(BertMLM(), 2, {"model.bert.encoder.layer.*.intermediate": "replicate"},
                             sequence_parallel=True)


# ------------------------------------------------------------------------------ 2. multi-head latent attention


def test_mla_plan():
    """Heads split after the up-projections; the low-rank parts whole; the rotary key columns (from
    kv_lora_rank on) of kv_a_proj_with_mqa summed over tp; the dense layers >= 90% sharded."""
    plan = plan_tensor_parallel(DeepseekV3LM(), 2)
    attention = "model.model.layers.0.self_attn"
    region = plan.regions[attention]
    assert (region.heads, region.head_dim, region.narrow) == (4, 16, False)
    assert region.low_rank == ("q_a_proj", "q_a_layernorm", "kv_a_proj_with_mqa", "kv_a_layernorm")
    assert region.shared_columns == ("kv_a_proj_with_mqa", 16)
    for name, style in (("q_b_proj", "colwise"), ("kv_b_proj", "colwise"), ("o_proj", "rowwise")):
        assert plan.styles[f"{attention}.{name}"].style == style, name
    for name in region.low_rank:
        assert f"{attention}.{name}" not in plan.styles, name
    assert plan.attributes[attention] == {"num_heads": 2}
    assert plan.coverage.share >= 0.9, plan.coverage.describe()
    assert "low-rank q_a_proj, q_a_layernorm, kv_a_proj_with_mqa, kv_a_layernorm whole on every rank" in plan.describe()


def test_mla_at_deepseek_v3_sizes():
    """DeepSeek-V3's own attention and dense-layer sizes (hidden 7168, 128 heads, q_lora_rank 1536, kv_lora_rank
    512; two dense layers, on the meta device): the same plan, 97% of the body sharded at tp=8."""
    import torch
    import transformers

    config = transformers.DeepseekV3Config(num_hidden_layers=2, first_k_dense_replace=2, vocab_size=1024)
    with torch.device("meta"):
        model = transformers.DeepseekV3ForCausalLM(config)
    plan = plan_tensor_parallel(model, 8)
    region = plan.regions["model.layers.0.self_attn"]
    assert (region.heads, region.head_dim, region.shared_columns) == (128, 192, ("kv_a_proj_with_mqa", 512))
    assert plan.coverage.share >= 0.97, plan.coverage.describe()


def test_mla_layers_are_sharded(two):
    dtensors = two[0]["mla_tp2"]["extras"]["dtensors"]
    for name in ("q_b_proj", "kv_b_proj", "o_proj"):
        assert f"model.model.layers.0.self_attn.{name}.weight" in dtensors, (name, dtensors)
    assert "model.model.layers.0.self_attn.kv_a_proj_with_mqa.weight" not in dtensors


# ------------------------------------------------------------------------------------- 3. encoder-decoders


def test_t5_plan():
    """Self- and cross-attention by heads, the relative-position bias column-wise (by heads), the tied table
    rowwise under each of its three embedding names and column-wise as the head: 99% of the body sharded."""
    plan = plan_tensor_parallel(T5Seq2Seq(), 2)
    first = "model.encoder.block.0.layer.0.SelfAttention"
    assert plan.regions[first].head_embeddings == ("relative_attention_bias",)
    assert plan.styles[f"{first}.relative_attention_bias"].style == "colwise"
    assert plan.regions["model.decoder.block.0.layer.1.EncDecAttention"].heads == 4
    for name in ("model.shared", "model.encoder.embed_tokens", "model.decoder.embed_tokens"):
        assert plan.styles[name].style == "rowwise" and plan.styles[name].role == "embedding", name
    assert plan.styles["model.lm_head"].style == "colwise"
    assert plan.attributes[first] == {"n_heads": 2, "d_model": 16, "inner_dim": 16}
    assert plan.coverage.share >= 0.99, plan.coverage.describe()
    assert "relative_attention_bias split by heads" in plan.describe()


def test_t5_tied_table_stays_one_parameter(two):
    """The table is one parameter after sharding (listed once, as model.shared.weight), a DTensor; the
    relative-position biases are sharded."""
    dtensors = two[0]["t5_tp2"]["extras"]["dtensors"]
    assert "model.shared.weight" in dtensors and "model.lm_head.weight" not in dtensors, dtensors
    for stack in ("encoder", "decoder"):
        assert f"model.{stack}.block.0.layer.0.SelfAttention.relative_attention_bias.weight" in dtensors, stack


# ------------------------------------------------------------------------------ 4. families the sweep flagged


@pytest.mark.parametrize("family, names", [
    ("phi", ("self_attn.q_proj", "self_attn.dense", "mlp.fc1", "mlp.fc2")),
    ("xlm", ("q_lin", "v_lin", "out_lin", "lin1", "lin2")),
    ("falcon", ("self_attention.query_key_value", "self_attention.dense", "mlp.dense_h_to_4h")),
])
def test_swept_families_are_sharded(two, family, names):
    dtensors = two[0][f"{family}_tp2"]["extras"]["dtensors"]
    for name in names:
        assert any(name + ".weight" in key and ".0." in key for key in dtensors), (name, dtensors)

"""Tiny Hugging Face models of the families issue #28 names, from configs (random weights, no download), inside
plain LightningModules that know nothing about lightning_4d (tests/test_families.py).

- ``BertMLM``: ``BertForMaskedLM``: q/k/v in ``attention.self``, the output projection in the sibling
  ``attention.output`` (which adds the residual and normalizes), the MLP over the layer's ``intermediate`` and
  ``output``; the decoder tied to the word embedding and its bias to ``cls.predictions.bias``. Bidirectional.
- ``mlm_data``: random token windows with a quarter of the tokens replaced by the mask token; every position is
  a target (its original token).
"""

import torch
from torch.utils.data import TensorDataset

from tests.lm_models import SEQ, VOCAB, _CausalLM

MASK = VOCAB - 1


def mlm_data(train: bool = True, size: int = 32, seq_len: int = SEQ, vocab: int = VOCAB):
    generator = torch.Generator().manual_seed(0 if train else 1)
    tokens = torch.randint(1, vocab - 1, (size, seq_len), generator=generator)
    masked = torch.rand(size, seq_len, generator=generator) < 0.25
    return TensorDataset(tokens.masked_fill(masked, MASK), tokens)


class BertMLM(_CausalLM):
    """``BertForMaskedLM`` (intermediate 4 x hidden, as BERT's own configs: the share tp shards is a real one)."""

    def __init__(self, hidden: int = 32, layers: int = 2, heads: int = 4, positions: int = 2 * SEQ) -> None:
        super().__init__()
        import transformers

        config = transformers.BertConfig(
            vocab_size=VOCAB, hidden_size=hidden, num_hidden_layers=layers, num_attention_heads=heads,
            intermediate_size=4 * hidden, max_position_embeddings=positions, type_vocab_size=1,
            hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0, attn_implementation="sdpa", pad_token_id=0)
        self.model = transformers.BertForMaskedLM(config)

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        return self.model(input_ids=input_ids).logits


class OPTLongPositions(_CausalLM):
    """``OPTForCausalLM`` whose learned positions (128 + OPT's offset of 2 rows) outnumber the vocabulary (64), as a
    small vocabulary's would: the token embedding is the one the tied head reads back, not the largest."""

    def __init__(self, hidden: int = 32, layers: int = 2, heads: int = 4) -> None:
        super().__init__()
        import transformers

        config = transformers.OPTConfig(
            vocab_size=VOCAB, hidden_size=hidden, ffn_dim=2 * hidden, num_hidden_layers=layers,
            num_attention_heads=heads, max_position_embeddings=128, word_embed_proj_dim=hidden, dropout=0.0,
            attention_dropout=0.0, layerdrop=0.0, bos_token_id=0, eos_token_id=1, pad_token_id=None)
        self.model = transformers.OPTForCausalLM(config)

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        return self.model(input_ids=input_ids).logits


class DeepseekV3LM(_CausalLM):
    """``DeepseekV3ForCausalLM`` without experts (``first_k_dense_replace`` = its layers): multi-head latent
    attention (q_a_proj -> q_a_layernorm -> q_b_proj, kv_a_proj_with_mqa -> kv_a_layernorm -> kv_b_proj, a
    decoupled rotary key shared by the heads, o_proj) and dense MLPs (intermediate 4 x hidden)."""

    def __init__(self, hidden: int = 32, layers: int = 2, heads: int = 4, q_lora_rank: int | None = 16) -> None:
        super().__init__()
        import transformers

        config = transformers.DeepseekV3Config(
            vocab_size=VOCAB, hidden_size=hidden, intermediate_size=4 * hidden, num_hidden_layers=layers,
            first_k_dense_replace=layers, num_attention_heads=heads, num_key_value_heads=heads,
            q_lora_rank=q_lora_rank, kv_lora_rank=16, qk_rope_head_dim=8, qk_nope_head_dim=8, v_head_dim=8,
            max_position_embeddings=64, attn_implementation="sdpa", bos_token_id=0, eos_token_id=1,
            pad_token_id=None, tie_word_embeddings=False)
        self.model = transformers.DeepseekV3ForCausalLM(config)

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        return self.model(input_ids=input_ids).logits


def seq2seq_data(train: bool = True, size: int = 32, seq_len: int = SEQ, vocab: int = VOCAB):
    """Random source windows; the target is the source reversed (the decoder must read the encoder)."""
    generator = torch.Generator().manual_seed(0 if train else 1)
    tokens = torch.randint(1, vocab, (size, seq_len), generator=generator)
    return TensorDataset(tokens, tokens.flip(-1))


class T5Seq2Seq(_CausalLM):
    """``T5ForConditionalGeneration``: one ``shared`` embedding tied to the encoder's and decoder's
    ``embed_tokens`` and to ``lm_head``; a relative-position bias (``nn.Embedding(buckets, heads)``) in the first
    self-attention of the encoder and of the decoder; cross-attention in every decoder block."""

    def __init__(self, hidden: int = 32, layers: int = 2, heads: int = 4) -> None:
        super().__init__()
        import transformers

        config = transformers.T5Config(
            vocab_size=VOCAB, d_model=hidden, d_kv=hidden // heads, d_ff=4 * hidden, num_layers=layers,
            num_heads=heads, relative_attention_num_buckets=8, dropout_rate=0.0, decoder_start_token_id=0,
            pad_token_id=0, eos_token_id=1, tie_word_embeddings=True)
        self.model = transformers.T5ForConditionalGeneration(config)

    def _loss(self, batch):
        source, target = batch
        decoder_input = torch.cat([torch.zeros_like(target[:, :1]), target[:, :-1]], dim=1)  # shifted right
        logits = self.model(input_ids=source, decoder_input_ids=decoder_input).logits
        return torch.nn.functional.cross_entropy(logits.reshape(-1, logits.size(-1)), target.reshape(-1))


# Families the sweep (tests/family_sweep.py) flagged, each at a tiny size with dropout off: (class, config
# class, sizes). Phi holds q/k/v with a ``dense`` output projection; XLM (FlauBERT alike) q_lin/k_lin/v_lin ->
# out_lin and lin1 -> lin2, bidirectional; ELECTRA a BERT layout behind an embedding projection (embedding size
# 16 -> hidden 32), the share the sweep found under 90% only because that projection weighs so much when tiny;
# Falcon-7B's multi-query query_key_value (every q head, then one k and one v head) and dense.
# ModernBERT (encoder and decoder): a fused Wqkv -> Wo attention (encoder; the decoder's q/k/v_proj -> Wo) and a
# fused gate|up Wi -> Wo MLP; every other layer attends within a window of 8 tokens (local_attention) here.
MODERNBERT = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                  max_position_embeddings=64, local_attention=8, attention_dropout=0.0, embedding_dropout=0.0,
                  mlp_dropout=0.0, pad_token_id=0, bos_token_id=0, eos_token_id=0, cls_token_id=0, sep_token_id=0)
SWEPT = {
    "phi": ("PhiForCausalLM", "PhiConfig", dict(
        hidden_size=32, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4, partial_rotary_factor=0.5,
        max_position_embeddings=64, resid_pdrop=0.0, embd_pdrop=0.0, attention_dropout=0.0)),
    "xlm": ("XLMWithLMHeadModel", "XLMConfig", dict(
        n_words=VOCAB, emb_dim=32, n_layers=2, n_heads=4, max_position_embeddings=32, dropout=0.0,
        attention_dropout=0.0, pad_index=0, use_lang_emb=False, n_langs=1)),
    "falcon": ("FalconForCausalLM", "FalconConfig", dict(
        hidden_size=32, num_hidden_layers=2, num_attention_heads=4, multi_query=True, new_decoder_architecture=False,
        parallel_attn=True, alibi=False, bias=False, max_position_embeddings=64, hidden_dropout=0.0,
        attention_dropout=0.0)),
    "electra": ("ElectraForMaskedLM", "ElectraConfig", dict(
        embedding_size=16, hidden_size=32, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
        max_position_embeddings=64, type_vocab_size=1, hidden_dropout_prob=0.0,
        attention_probs_dropout_prob=0.0, pad_token_id=0)),
    "modernbert": ("ModernBertForMaskedLM", "ModernBertConfig", MODERNBERT),
    "modernbert_decoder": ("ModernBertDecoderForCausalLM", "ModernBertDecoderConfig", MODERNBERT),
}


class SweptLM(_CausalLM):
    """A family of ``SWEPT`` by name, loaded with 'sdpa' attention where it has one."""

    def __init__(self, family: str = "phi") -> None:
        super().__init__()
        import transformers

        model_class, config_class, sizes = SWEPT[family]
        config = getattr(transformers, config_class)(**{"vocab_size": VOCAB, **sizes})
        model_class = getattr(transformers, model_class)
        config._attn_implementation = "sdpa" if model_class._supports_sdpa else "eager"
        self.model = model_class(config)

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        return self.model(input_ids=input_ids).logits

"""The model zoo: library model classes at tiny configs (random weights, no download), each inside a plain
LightningModule that a user would write, unchanged for lightning_4d.

``zoo_lm(family)`` builds one. Every config has 4 layers, hidden 32, 4 attention heads and vocabulary
``VOCAB``, dropout off, SDPA attention where the family offers it, so that the same module trains on one
process and under any layout at 2 with the same numbers. ``FAMILIES`` lists them; ``token_data`` from
``tests.lm_models`` is their data.
"""

from __future__ import annotations

import torch
from torch import nn

from tests.lm_models import VOCAB, _CausalLM

HIDDEN = 32
LAYERS = 4
HEADS = 4


def _hf_config(family: str):
    import transformers

    common = dict(vocab_size=VOCAB, bos_token_id=0, eos_token_id=1, pad_token_id=None)
    llama_like = dict(hidden_size=HIDDEN, intermediate_size=2 * HIDDEN, num_hidden_layers=LAYERS,
                      num_attention_heads=HEADS, max_position_embeddings=64, **common)
    if family == "llama":
        return transformers.LlamaConfig(num_key_value_heads=2, **llama_like)
    if family == "mistral":
        return transformers.MistralConfig(num_key_value_heads=2, sliding_window=None, **llama_like)
    if family == "qwen2":
        return transformers.Qwen2Config(num_key_value_heads=2, use_sliding_window=False, **llama_like)
    if family == "phi3":
        return transformers.Phi3Config(num_key_value_heads=4, resid_pdrop=0.0, embd_pdrop=0.0,
                                       attention_dropout=0.0, **llama_like)
    if family == "gemma":
        return transformers.GemmaConfig(num_key_value_heads=1, head_dim=HIDDEN // HEADS, **llama_like)
    if family == "gpt_neox":
        return transformers.GPTNeoXConfig(hidden_size=HIDDEN, intermediate_size=2 * HIDDEN,
                                          num_hidden_layers=LAYERS, num_attention_heads=HEADS,
                                          max_position_embeddings=64, hidden_dropout=0.0, attention_dropout=0.0,
                                          use_parallel_residual=True, rotary_pct=0.5, **common)
    if family == "opt":
        # 32 positions (34 rows with OPT's offset of 2): fewer than the vocabulary, as in every real OPT.
        return transformers.OPTConfig(hidden_size=HIDDEN, ffn_dim=2 * HIDDEN, num_hidden_layers=LAYERS,
                                      num_attention_heads=HEADS, max_position_embeddings=32,
                                      word_embed_proj_dim=HIDDEN, dropout=0.0, attention_dropout=0.0,
                                      layerdrop=0.0, **common)
    if family == "bloom":
        return transformers.BloomConfig(hidden_size=HIDDEN, n_layer=LAYERS, n_head=HEADS, hidden_dropout=0.0,
                                        attention_dropout=0.0, **common)
    if family == "gpt_bigcode":
        return transformers.GPTBigCodeConfig(n_embd=HIDDEN, n_layer=LAYERS, n_head=HEADS, n_positions=64,
                                             multi_query=True, resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0,
                                             **common)
    raise ValueError(f"family={family!r} is not in the zoo: one of {FAMILIES}")


HF_FAMILIES = ("llama", "mistral", "qwen2", "phi3", "gemma", "gpt_neox", "opt", "bloom", "gpt_bigcode")
FAMILIES = HF_FAMILIES + ("lightning_demo", "torch_transformer")


class HFZooLM(_CausalLM):
    """``AutoModelForCausalLM.from_config`` in a LightningModule, as a user fine-tuning a Hub model writes it."""

    def __init__(self, family: str = "llama") -> None:
        super().__init__()
        import transformers

        config = _hf_config(family)
        attention = "eager" if family == "bloom" else "sdpa"  # Bloom computes ALiBi attention by hand
        self.model = transformers.AutoModelForCausalLM.from_config(config, attn_implementation=attention)

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        return self.model(input_ids=input_ids).logits


class LightningDemoLM(_CausalLM):
    """``lightning.pytorch.demos.Transformer`` (an ``nn.Transformer`` encoder-decoder), trained on next tokens
    the way Lightning's own demo does: the sequence is both the source and the target."""

    def __init__(self) -> None:
        super().__init__()
        from lightning.pytorch.demos import Transformer

        self.model = Transformer(vocab_size=VOCAB, ninp=HIDDEN, nhead=HEADS, nhid=2 * HIDDEN, nlayers=LAYERS,
                                 dropout=0.0)

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        return self.model(input_ids, input_ids)


class TorchEncoderLM(_CausalLM):
    """torch's own ``nn.TransformerEncoder`` (batch first, causal mask) between an embedding and a head."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(VOCAB, HIDDEN)
        layer = nn.TransformerEncoderLayer(HIDDEN, HEADS, 2 * HIDDEN, dropout=0.0, batch_first=True)
        self.encoder = nn.TransformerEncoder(layer, LAYERS, enable_nested_tensor=False)
        self.head = nn.Linear(HIDDEN, VOCAB)

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        mask = nn.Transformer.generate_square_subsequent_mask(input_ids.size(1))
        return self.head(self.encoder(self.embed(input_ids), mask=mask, is_causal=True))


class ModuleDictLM(_CausalLM):
    """Blocks in an ``nn.ModuleDict`` keyed by layer number and run with ``self.layers.values()``, as
    torchtitan's Llama keeps them (torchtitan itself is not installed: its model code imports triton)."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(VOCAB, HIDDEN)
        self.layers = nn.ModuleDict({str(i): nn.TransformerEncoderLayer(HIDDEN, HEADS, 2 * HIDDEN, dropout=0.0,
                                                                        batch_first=True) for i in range(LAYERS)})
        self.norm = nn.LayerNorm(HIDDEN)
        self.head = nn.Linear(HIDDEN, VOCAB)

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        mask = nn.Transformer.generate_square_subsequent_mask(input_ids.size(1))
        hidden = self.embed(input_ids)
        for layer in self.layers.values():
            hidden = layer(hidden, src_mask=mask, is_causal=True)
        return self.head(self.norm(hidden))


class HeadFirstLM(_CausalLM):
    """litgpt's ``GPT`` layout (litgpt is not installed, see the issue): ``lm_head`` registered before
    ``transformer``, an ``nn.ModuleDict`` of ``wte``, the block list ``h`` and ``ln_f``; it runs after them."""

    def __init__(self) -> None:
        super().__init__()
        self.lm_head = nn.Linear(HIDDEN, VOCAB, bias=False)
        blocks = nn.ModuleList(nn.TransformerEncoderLayer(HIDDEN, HEADS, 2 * HIDDEN, dropout=0.0, batch_first=True)
                               for _ in range(LAYERS))
        self.transformer = nn.ModuleDict(dict(wte=nn.Embedding(VOCAB, HIDDEN), h=blocks, ln_f=nn.LayerNorm(HIDDEN)))

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        mask = nn.Transformer.generate_square_subsequent_mask(input_ids.size(1))
        x = self.transformer.wte(input_ids)
        for block in self.transformer.h:
            x = block(x, src_mask=mask, is_causal=True)
        return self.lm_head(self.transformer.ln_f(x))


def zoo_lm(family: str = "llama") -> _CausalLM:
    if family == "lightning_demo":
        return LightningDemoLM()
    if family == "torch_transformer":
        return TorchEncoderLM()
    return HFZooLM(family)


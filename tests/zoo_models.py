"""The model zoo: library model classes at tiny configs (random weights, no download), each inside a plain
LightningModule that a user would write, unchanged for lightning_4d.

``zoo_lm(family)`` builds one. Every config has 4 layers, hidden 32, 4 attention heads and vocabulary
``VOCAB``, dropout off, SDPA attention where the family offers it, so that the same module trains on one
process and under any layout at 2 with the same numbers. ``FAMILIES`` lists them; ``token_data`` from
``tests.lm_models`` is their data. The families of issues #28 and #30 (``NEW_FAMILIES``) keep the 2-layer
configs their own tests train (tests/moe_models.py, tests/family_models.py): 2 layers are enough for pp=2.
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
    raise ValueError(f"family={family!r} is not in the zoo: one of {FAMILIES + LIBRARY_FAMILIES}")


HF_FAMILIES = ("llama", "mistral", "qwen2", "phi3", "gemma", "gpt_neox", "opt", "bloom", "gpt_bigcode")
# Other libraries' own model code (installed by the ``test`` extra, see pyproject.toml).
LIBRARY_FAMILIES = ("litgpt_llama", "litgpt_pythia", "torchtitan_llama3")
FAMILIES = HF_FAMILIES + ("lightning_demo", "torch_transformer")
# Fine-tuning the zoo's Llama (tests/adapter_models.py): peft LoRA on its projections, its embedding frozen; on
# supervised fine-tuning batches (prompts masked with -100) and masked-LM targets (tests/fine_tuning_models.py);
# with manual optimization and clipping.
FINE_TUNING_FAMILIES = ("llama_lora", "llama_frozen_embedding", "llama_sft", "llama_mlm", "llama_manual")
# Long-context masks (tests/cp_mask_models.py): packed documents with restarting position_ids, Mistral's sliding
# window and Gemma 3's sliding and global layers on sequences of four windows.
MASK_FAMILIES = ("llama_packed", "mistral_sliding", "gemma3_sliding")
# Issues #28 and #30 at the sizes of their own tests: Qwen2-MoE (a shared expert beside the routed ones) and
# Mixtral, 4 experts, top-2 (hidden 16); DeepSeek-V3 without experts (its multi-head latent attention); BERT
# trained on masked-LM windows (bidirectional; every position a target); T5 (T5ForConditionalGeneration, an
# encoder-decoder) trained to reverse its source.
NEW_FAMILY_CLASSES = {"qwen2_moe": ("tests.moe_models", "HFMoELM", ("qwen2_moe",)),
                      "mixtral": ("tests.moe_models", "HFMoELM", ("mixtral",)),
                      "deepseek_v3": ("tests.family_models", "DeepseekV3LM", ()),
                      "bert": ("tests.family_models", "BertMLM", ()),
                      "t5": ("tests.family_models", "T5Seq2Seq", ())}
NEW_FAMILIES = tuple(NEW_FAMILY_CLASSES)
# The data a family trains on, where it is not tests.lm_models:token_data.
FAMILY_DATA = {"bert": "tests.family_models:mlm_data", "t5": "tests.family_models:seq2seq_data",
               "llama_sft": "tests.fine_tuning_models:sft_data", "llama_mlm": "tests.fine_tuning_models:mlm_data",
               "llama_packed": "tests.cp_mask_models:packed_data", "mistral_sliding": "tests.cp_mask_models:plain_data",
               "gemma3_sliding": "tests.cp_mask_models:plain_data"}


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


class LightningDemoSameRowsLM(LightningDemoLM):
    """``LightningDemoLM`` whose positional table has every row alike, so that ``pe[:, x.size(1)]`` (the row at
    the sequence length) is the same on a context-parallel shard: its nn.Transformer trains at cp=2."""

    def __init__(self) -> None:
        super().__init__()
        encoder = self.model.pos_encoder
        encoder.pe = torch.linspace(-1, 1, encoder.dim).expand(1, encoder.max_len, -1).clone()


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


class LitGPTLM(_CausalLM):
    """``litgpt.GPT`` from one of litgpt's own named configs, shrunk to the zoo's size, as a user pre-training
    a litgpt model in their own LightningModule writes it. ``litgpt_llama``: Llama 3.2's architecture (RMSNorm,
    SwiGLU ``LLaMAMLP``, grouped queries, Llama 3 rope scaling); ``litgpt_pythia``: Pythia's (GPT-NeoX: LayerNorm,
    parallel residual, biases, partial rotary: here half of each head)."""

    def __init__(self, family: str = "litgpt_llama") -> None:
        super().__init__()
        from litgpt import GPT, Config

        size = dict(n_layer=LAYERS, n_embd=HIDDEN, n_head=HEADS, vocab_size=VOCAB, padded_vocab_size=VOCAB,
                    block_size=64, intermediate_size=2 * HIDDEN)
        if family == "litgpt_llama":
            config = Config.from_name("Llama-3.2-1B", n_query_groups=2, **size)
        elif family == "litgpt_pythia":
            config = Config.from_name("pythia-14m", rotary_percentage=0.5, **size)
        else:
            raise ValueError(f"family={family!r}: use 'litgpt_llama' or 'litgpt_pythia'")
        self.model = GPT(config)
        self.model.apply(self.model._init_weights)

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        return self.model(input_ids)


def _torchtitan_llama3_config():
    """A Llama 3 config of the zoo's size from torchtitan's own builders, with its fused ``wqkv`` (as every
    torchtitan Llama 3 flavour) and its ``F.scaled_dot_product_attention`` inner attention."""
    from functools import partial

    from torchtitan.models.common import ComplexRoPE, Embedding, Linear, RMSNorm, ScaledDotProductAttention
    from torchtitan.models.common.config_utils import make_ffn_config, make_gqa_config
    from torchtitan.models.llama3 import Llama3Model
    from torchtitan.models.llama3.model import Llama3TransformerBlock

    linear = {"weight": partial(nn.init.trunc_normal_, std=0.02), "bias": nn.init.zeros_}
    norm = {"weight": nn.init.ones_}
    rope = ComplexRoPE.Config(dim=HIDDEN // HEADS, max_seq_len=64, theta=500000, scaling="llama")
    layers = [Llama3TransformerBlock.Config(
        attention_norm=RMSNorm.Config(normalized_shape=HIDDEN, param_init=norm),
        ffn_norm=RMSNorm.Config(normalized_shape=HIDDEN, param_init=norm),
        attention=make_gqa_config(dim=HIDDEN, n_heads=HEADS, n_kv_heads=2, wqkv_param_init=linear,
                                  wo_param_init=linear, inner_attention=ScaledDotProductAttention.Config(),
                                  fuse_qkv=True, rope=rope),
        feed_forward=make_ffn_config(dim=HIDDEN, hidden_dim=2 * HIDDEN, w1_param_init=linear,
                                     w2w3_param_init=linear),
    ) for _ in range(LAYERS)]
    return Llama3Model.Config(
        dim=HIDDEN, vocab_size=VOCAB, layers=layers,
        tok_embeddings=Embedding.Config(num_embeddings=VOCAB, embedding_dim=HIDDEN,
                                        param_init={"weight": partial(nn.init.normal_, std=1.0)}),
        norm=RMSNorm.Config(normalized_shape=HIDDEN, param_init=norm),
        lm_head=Linear.Config(in_features=HIDDEN, out_features=VOCAB, param_init=linear))


class TorchTitanLM(_CausalLM):
    """torchtitan's ``Llama3Model`` (blocks in an ``nn.ModuleDict``, its own ``Embedding`` and ``Linear``
    subclasses) built from its config and initialised by its ``init_states``, in a LightningModule."""

    def __init__(self) -> None:
        super().__init__()
        self.model = _torchtitan_llama3_config().build()
        self.model.init_states()

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        return self.model(input_ids)


def zoo_lm(family: str = "llama") -> _CausalLM:
    if family in NEW_FAMILY_CLASSES:
        from importlib import import_module

        where, name, args = NEW_FAMILY_CLASSES[family]
        return getattr(import_module(where), name)(*args)
    if family in MASK_FAMILIES:
        from tests.cp_mask_models import MaskedLM

        return MaskedLM(family.split("_")[0])
    if family in ("llama_sft", "llama_mlm"):
        return HFZooLM("llama")
    if family == "llama_manual":
        from tests.fine_tuning_models import manual_clip_lm

        return manual_clip_lm("llama")
    if family in FINE_TUNING_FAMILIES:
        from tests.adapter_models import FrozenEmbeddingLM, LoRALM

        return LoRALM("llama") if family == "llama_lora" else FrozenEmbeddingLM("llama")
    if family in ("litgpt_llama", "litgpt_pythia"):
        return LitGPTLM(family)
    if family == "torchtitan_llama3":
        return TorchTitanLM()
    if family == "lightning_demo":
        return LightningDemoLM()
    if family == "torch_transformer":
        return TorchEncoderLM()
    return HFZooLM(family)


def zoo_lm_from(family: str, weights: str) -> _CausalLM:
    """``zoo_lm(family)`` starting from the weights of a saved ``state_dict``: the single-process side of a case
    that starts from the same file through ``FourDStrategy(init_from=...)``."""
    module = zoo_lm(family)
    module.load_state_dict(torch.load(weights, weights_only=True))
    return module

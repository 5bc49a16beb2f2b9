"""Tiny models for the three library patterns of issue #28 (tests/test_library_patterns.py); like
``lm_models`` they know nothing about lightning_4d.

- ``InplaceGPT``: in-place arithmetic into what tensor-parallel layers return: ``h += residual`` on an
  attention output, ``m.add_(h)`` on an MLP output, ``q *= scale`` on a projection, ``x *= sqrt(dim)`` on the
  token embedding's output, ``logits *= 2.0``, ``logits.add_(bias)``, ``logits.masked_fill_(mask, v)`` on the
  LM head's (each legal in one process: nothing autograd saved is modified).
- ``BroadcastKVGPT``: one key/value head that scaled-dot-product attention broadcasts over the query heads,
  called without ``enable_gqa`` (legal in torch: a head dim of 1 broadcasts).
- ``LayerNormQKGPT``: LayerNorms over the whole q and k projections (a norm that is not an RMSNorm).
- ``Olmo2LM``: Hugging Face ``Olmo2ForCausalLM`` from a tiny config: ``q_norm``/``k_norm`` are RMSNorms over the
  whole q/k projection (``num_heads * head_dim``), applied before the heads are split.
"""

import math

import torch
import torch.nn as nn
import torch.nn.functional as F

from tests.lm_models import VOCAB, HFCausalLM, _CausalLM
from tests.tp_models import RMSNorm


class InplaceAttention(nn.Module):
    def __init__(self, dim: int, n_head: int, kv_heads: int | None = None) -> None:
        super().__init__()
        self.n_head, self.head_dim = n_head, dim // n_head
        self.n_kv_heads = kv_heads or n_head
        self.q_proj = nn.Linear(dim, dim, bias=False)
        self.k_proj = nn.Linear(dim, self.n_kv_heads * self.head_dim, bias=False)
        self.v_proj = nn.Linear(dim, self.n_kv_heads * self.head_dim, bias=False)
        self.o_proj = nn.Linear(dim, dim, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        B, T, C = x.shape
        q = self.q_proj(x)
        q *= self.head_dim ** -0.5  # in place into a column-wise output (fairseq's `q *= self.scaling`)
        q = q.view(B, T, self.n_head, self.head_dim).transpose(1, 2)
        k = self.k_proj(x).view(B, T, self.n_kv_heads, self.head_dim).transpose(1, 2)
        v = self.v_proj(x).view(B, T, self.n_kv_heads, self.head_dim).transpose(1, 2)
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=1.0)
        return self.o_proj(y.transpose(1, 2).reshape(B, T, C))


class BroadcastKVAttention(InplaceAttention):
    """Multi-query attention written without ``enable_gqa``: k and v have one head, which torch's
    scaled_dot_product_attention broadcasts over the query heads."""

    kv_heads = 1  # 2 for 4 query heads is a size mismatch in torch (without enable_gqa): the error case

    def __init__(self, dim: int, n_head: int) -> None:
        super().__init__(dim, n_head, kv_heads=self.kv_heads)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        B, T, C = x.shape
        q = self.q_proj(x).view(B, T, self.n_head, self.head_dim).transpose(1, 2)
        k = self.k_proj(x).view(B, T, self.n_kv_heads, self.head_dim).transpose(1, 2)
        v = self.v_proj(x).view(B, T, self.n_kv_heads, self.head_dim).transpose(1, 2)
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.o_proj(y.transpose(1, 2).reshape(B, T, C))


class LayerNormQKAttention(InplaceAttention):
    """LayerNorms (with bias) over the whole q and k projections: a norm that is no RMSNorm, sharded by
    DTensor's generic path."""

    def __init__(self, dim: int, n_head: int) -> None:
        super().__init__(dim, n_head)
        self.q_norm, self.k_norm = nn.LayerNorm(dim), nn.LayerNorm(dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        B, T, C = x.shape
        q = self.q_norm(self.q_proj(x)).view(B, T, self.n_head, self.head_dim).transpose(1, 2)
        k = self.k_norm(self.k_proj(x)).view(B, T, self.n_head, self.head_dim).transpose(1, 2)
        v = self.v_proj(x).view(B, T, self.n_head, self.head_dim).transpose(1, 2)
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.o_proj(y.transpose(1, 2).reshape(B, T, C))


class MLP(nn.Module):
    def __init__(self, dim: int) -> None:
        super().__init__()
        self.up_proj, self.down_proj = nn.Linear(dim, 4 * dim), nn.Linear(4 * dim, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.gelu(self.up_proj(x)))


class Block(nn.Module):
    """With ``inplace`` the residual adds go into the attention's and the MLP's outputs in place."""

    def __init__(self, dim: int, n_head: int, attention: type[nn.Module], inplace: bool) -> None:
        super().__init__()
        self.norm1, self.attn = RMSNorm(dim), attention(dim, n_head)
        self.norm2, self.mlp = RMSNorm(dim), MLP(dim)
        self.inplace = inplace

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not self.inplace:
            x = x + self.attn(self.norm1(x))
            return x + self.mlp(self.norm2(x))
        h = self.attn(self.norm1(x))
        h += x  # `out += residual`: in place into the attention's row-wise output
        m = self.mlp(self.norm2(h))
        m.add_(h)  # `m.add_(h)`: in place into the MLP's row-wise output
        return m


class _BlockLM(_CausalLM):
    attention: type[nn.Module] = InplaceAttention
    inplace = True

    def __init__(self, vocab_size: int = VOCAB, dim: int = 32, n_head: int = 4, n_layer: int = 2) -> None:
        super().__init__()
        self.dim = dim
        self.tok_emb = nn.Embedding(vocab_size, dim)
        self.layers = nn.ModuleList(Block(dim, n_head, self.attention, self.inplace) for _ in range(n_layer))
        self.norm = RMSNorm(dim)
        self.lm_head = nn.Linear(dim, vocab_size, bias=False)
        self.register_buffer("logit_bias", torch.linspace(-1.0, 1.0, vocab_size))

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        x = self.tok_emb(idx)
        if not self.inplace:
            return self._blocks(x * math.sqrt(self.dim))
        x *= math.sqrt(self.dim)  # in place into the vocabulary-parallel embedding's output (Gemma's scaling)
        return self._blocks(x)

    def _blocks(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            x = layer(x)
        logits = self.lm_head(self.norm(x))
        if self.inplace:  # in place into the LM head's (vocabulary-sharded) logits, with a scalar and a tensor
            logits *= 2.0
            logits.add_(self.logit_bias)
            logits.masked_fill_(self.logit_bias > 0.9, -2.0)  # suppress a few tokens
        return logits


class InplaceGPT(_BlockLM):
    attention = InplaceAttention


class BroadcastKVGPT(_BlockLM):
    attention = BroadcastKVAttention
    inplace = False


class LayerNormQKGPT(_BlockLM):
    attention = LayerNormQKAttention
    inplace = False


class LogitsAssignGPT(BroadcastKVGPT):
    """Assigns into its logits (``logits[..., 0] = -1``): the fused LM-head loss applies it to each chunk; an
    unfused head's loss under tensor parallelism reads them sharded over the vocabulary, and refuses it."""

    def _blocks(self, x: torch.Tensor) -> torch.Tensor:
        logits = super()._blocks(x)
        logits[..., 0] = -1.0
        return logits


class TwoKVHeadsAttention(BroadcastKVAttention):
    kv_heads = 2


class TwoKVHeadsWithoutGQA(BroadcastKVGPT):
    """Two key/value heads for four query heads, without ``enable_gqa``: torch refuses it (a size mismatch)."""

    attention = TwoKVHeadsAttention


class Olmo2LM(HFCausalLM):
    """``Olmo2ForCausalLM`` (q_norm/k_norm over the whole projections) in a plain LightningModule."""

    def __init__(self, hidden: int = 32, layers: int = 2, heads: int = 4, kv_heads: int = 4) -> None:
        _CausalLM.__init__(self)
        import transformers

        config = transformers.Olmo2Config(
            vocab_size=VOCAB, hidden_size=hidden, intermediate_size=2 * hidden, num_hidden_layers=layers,
            num_attention_heads=heads, num_key_value_heads=kv_heads, max_position_embeddings=64,
            attn_implementation="sdpa", bos_token_id=0, eos_token_id=1, pad_token_id=None)
        self.model = transformers.Olmo2ForCausalLM(config)

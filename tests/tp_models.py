"""Tiny models in the styles the tensor-parallel planner must handle unchanged.

Each mirrors how a real code base writes attention: which attributes hold head counts,
whether widths come from the input (``B, T, C = x.size()``), fused or separate q/k/v.
"""

from __future__ import annotations

import math

import torch
import torch.nn as nn
import torch.nn.functional as F


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float = 1e-6) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps) * self.weight


# --- lightning_4d/demos/gpt.py structure: model.layers[i].attn.{q,k,v,o}_proj, mlp.{up,down}_proj


class GPTAttention(nn.Module):
    def __init__(self, dim: int, n_head: int) -> None:
        super().__init__()
        self.n_head, self.head_dim = n_head, dim // n_head
        self.q_proj = nn.Linear(dim, dim, bias=False)
        self.k_proj = nn.Linear(dim, dim, bias=False)
        self.v_proj = nn.Linear(dim, dim, bias=False)
        self.o_proj = nn.Linear(dim, dim, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        B, T, C = x.shape
        q = self.q_proj(x).view(B, T, self.n_head, self.head_dim).transpose(1, 2)
        k = self.k_proj(x).view(B, T, self.n_head, self.head_dim).transpose(1, 2)
        v = self.v_proj(x).view(B, T, self.n_head, self.head_dim).transpose(1, 2)
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.o_proj(y.transpose(1, 2).reshape(B, T, C))


class CustomHeadsAttention(nn.Module):
    """Head count under a name no preset knows, reshapes with -1: only a user plan can say what to divide."""

    def __init__(self, dim: int, n_head: int) -> None:
        super().__init__()
        self.heads = n_head
        self.q_proj, self.k_proj = nn.Linear(dim, dim), nn.Linear(dim, dim)
        self.v_proj, self.o_proj = nn.Linear(dim, dim), nn.Linear(dim, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        B, T, _ = x.shape
        q, k, v = (p(x).view(B, T, self.heads, -1).transpose(1, 2) for p in (self.q_proj, self.k_proj, self.v_proj))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.o_proj(y.transpose(1, 2).reshape(B, T, -1))


class GPTMLP(nn.Module):
    def __init__(self, dim: int, hidden: int) -> None:
        super().__init__()
        self.up_proj = nn.Linear(dim, hidden)
        self.down_proj = nn.Linear(hidden, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.gelu(self.up_proj(x)))


class GPTBlock(nn.Module):
    def __init__(self, dim: int, n_head: int, attention: type[nn.Module] = GPTAttention) -> None:
        super().__init__()
        self.norm1, self.attn = RMSNorm(dim), attention(dim, n_head)
        self.norm2, self.mlp = RMSNorm(dim), GPTMLP(dim, 4 * dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.norm1(x))
        return x + self.mlp(self.norm2(x))


class TinyGPT(nn.Module):
    def __init__(
        self,
        vocab: int = 64,
        dim: int = 32,
        n_head: int = 4,
        n_layer: int = 2,
        attention: type[nn.Module] = GPTAttention,
    ) -> None:
        super().__init__()
        self.tok_emb = nn.Embedding(vocab, dim)
        self.layers = nn.ModuleList(GPTBlock(dim, n_head, attention) for _ in range(n_layer))
        self.norm = RMSNorm(dim)
        self.lm_head = nn.Linear(dim, vocab, bias=False)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        x = self.tok_emb(idx)
        for layer in self.layers:
            x = layer(x)
        return self.lm_head(self.norm(x))


# --- nanoGPT: fused c_attn split by n_embd, heads from C // n_head, tied weights, learned positions


class NanoLayerNorm(nn.Module):
    def __init__(self, ndim: int, bias: bool) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(ndim))
        self.bias = nn.Parameter(torch.zeros(ndim)) if bias else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.layer_norm(x, self.weight.shape, self.weight, self.bias, 1e-5)


class NanoSelfAttention(nn.Module):
    def __init__(self, n_embd: int, n_head: int, dropout: float) -> None:
        super().__init__()
        self.c_attn = nn.Linear(n_embd, 3 * n_embd)
        self.c_proj = nn.Linear(n_embd, n_embd)
        self.attn_dropout, self.resid_dropout = nn.Dropout(dropout), nn.Dropout(dropout)
        self.n_head, self.n_embd, self.dropout = n_head, n_embd, dropout

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        B, T, C = x.size()
        q, k, v = self.c_attn(x).split(self.n_embd, dim=2)
        k = k.view(B, T, self.n_head, C // self.n_head).transpose(1, 2)
        q = q.view(B, T, self.n_head, C // self.n_head).transpose(1, 2)
        v = v.view(B, T, self.n_head, C // self.n_head).transpose(1, 2)
        att = (q @ k.transpose(-2, -1)) * (1.0 / math.sqrt(k.size(-1)))
        att = att.masked_fill(torch.ones(T, T, dtype=torch.bool).triu(1), float("-inf"))
        y = self.attn_dropout(F.softmax(att, dim=-1)) @ v
        y = y.transpose(1, 2).contiguous().view(B, T, C)
        return self.resid_dropout(self.c_proj(y))


class NanoMLP(nn.Module):
    def __init__(self, n_embd: int, dropout: float) -> None:
        super().__init__()
        self.c_fc, self.gelu = nn.Linear(n_embd, 4 * n_embd), nn.GELU()
        self.c_proj, self.dropout = nn.Linear(4 * n_embd, n_embd), nn.Dropout(dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.dropout(self.c_proj(self.gelu(self.c_fc(x))))


class NanoBlock(nn.Module):
    def __init__(self, n_embd: int, n_head: int, dropout: float) -> None:
        super().__init__()
        self.ln_1, self.attn = NanoLayerNorm(n_embd, True), NanoSelfAttention(n_embd, n_head, dropout)
        self.ln_2, self.mlp = NanoLayerNorm(n_embd, True), NanoMLP(n_embd, dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln_1(x))
        return x + self.mlp(self.ln_2(x))


class NanoGPT(nn.Module):
    def __init__(
        self,
        vocab: int = 64,
        block_size: int = 16,
        n_embd: int = 32,
        n_head: int = 4,
        n_layer: int = 2,
        dropout: float = 0.0,
    ) -> None:
        super().__init__()
        self.transformer = nn.ModuleDict(
            dict(
                wte=nn.Embedding(vocab, n_embd),
                wpe=nn.Embedding(block_size, n_embd),
                drop=nn.Dropout(dropout),
                h=nn.ModuleList(NanoBlock(n_embd, n_head, dropout) for _ in range(n_layer)),
                ln_f=NanoLayerNorm(n_embd, True),
            )
        )
        self.lm_head = nn.Linear(n_embd, vocab, bias=False)
        self.transformer.wte.weight = self.lm_head.weight

    def forward(self, idx: torch.Tensor, targets: torch.Tensor | None = None):
        t = idx.size(1)
        pos = torch.arange(0, t, dtype=torch.long)
        x = self.transformer.drop(self.transformer.wte(idx) + self.transformer.wpe(pos))
        for block in self.transformer.h:
            x = block(x)
        logits = self.lm_head(self.transformer.ln_f(x))
        loss = None
        if targets is not None:
            loss = F.cross_entropy(logits.view(-1, logits.size(-1)), targets.view(-1), ignore_index=-1)
        return logits, loss


# --- litgpt: fused GQA qkv laid out [q | k | v], sizes read from a shared config object


class LitConfig:
    def __init__(
        self, vocab: int = 64, n_embd: int = 32, n_head: int = 4, n_query_groups: int = 2, n_layer: int = 2
    ) -> None:
        self.padded_vocab_size, self.n_embd, self.n_layer = vocab, n_embd, n_layer
        self.n_head, self.n_query_groups = n_head, n_query_groups
        self.head_size = n_embd // n_head
        self.intermediate_size = 2 * n_embd


class LitAttention(nn.Module):
    def __init__(self, config: LitConfig) -> None:
        super().__init__()
        self.qkv = nn.Linear(config.n_embd, (config.n_head + 2 * config.n_query_groups) * config.head_size)
        self.proj = nn.Linear(config.head_size * config.n_head, config.n_embd)
        self.config = config

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        head_size, n_head, n_query_groups = self.config.head_size, self.config.n_head, self.config.n_query_groups
        B, T, C = x.size()
        q, k, v = self.qkv(x).split(
            (n_head * head_size, n_query_groups * head_size, n_query_groups * head_size), dim=-1
        )
        q = q.view(B, T, n_head, head_size).transpose(1, 2)
        k = k.view(B, T, n_query_groups, head_size).transpose(1, 2)
        v = v.view(B, T, n_query_groups, head_size).transpose(1, 2)
        k = k.repeat_interleave(n_head // n_query_groups, dim=1)
        v = v.repeat_interleave(n_head // n_query_groups, dim=1)
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True).transpose(1, 2)
        return self.proj(y.reshape(B, T, head_size * n_head))


class LitMLP(nn.Module):
    def __init__(self, config: LitConfig) -> None:
        super().__init__()
        self.fc_1 = nn.Linear(config.n_embd, config.intermediate_size, bias=False)
        self.fc_2 = nn.Linear(config.n_embd, config.intermediate_size, bias=False)
        self.proj = nn.Linear(config.intermediate_size, config.n_embd, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.proj(F.silu(self.fc_1(x)) * self.fc_2(x))


class LitBlock(nn.Module):
    def __init__(self, config: LitConfig) -> None:
        super().__init__()
        self.norm_1, self.attn = RMSNorm(config.n_embd), LitAttention(config)
        self.norm_2, self.mlp = RMSNorm(config.n_embd), LitMLP(config)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.attn(self.norm_1(x)) + x
        return self.mlp(self.norm_2(x)) + x


class LitGPT(nn.Module):
    def __init__(self, config: LitConfig | None = None) -> None:
        super().__init__()
        self.config = config = config or LitConfig()
        self.lm_head = nn.Linear(config.n_embd, config.padded_vocab_size, bias=False)
        self.transformer = nn.ModuleDict(
            dict(
                wte=nn.Embedding(config.padded_vocab_size, config.n_embd),
                h=nn.ModuleList(LitBlock(config) for _ in range(config.n_layer)),
                ln_f=RMSNorm(config.n_embd),
            )
        )

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        x = self.transformer.wte(idx)
        for block in self.transformer.h:
            x = block(x)
        return self.lm_head(self.transformer.ln_f(x))


# --- Meta / torchtitan Llama: wq/wk/wv/wo with n_heads, n_kv_heads; w1/w2/w3; tok_embeddings, output


class MetaAttention(nn.Module):
    def __init__(self, dim: int, n_heads: int, n_kv_heads: int) -> None:
        super().__init__()
        self.n_heads, self.n_kv_heads, self.head_dim = n_heads, n_kv_heads, dim // n_heads
        self.n_rep = n_heads // n_kv_heads
        self.wq = nn.Linear(dim, n_heads * self.head_dim, bias=False)
        self.wk = nn.Linear(dim, n_kv_heads * self.head_dim, bias=False)
        self.wv = nn.Linear(dim, n_kv_heads * self.head_dim, bias=False)
        self.wo = nn.Linear(n_heads * self.head_dim, dim, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        bs, seqlen, _ = x.shape
        xq = self.wq(x).view(bs, seqlen, self.n_heads, self.head_dim).transpose(1, 2)
        xk = self.wk(x).view(bs, seqlen, self.n_kv_heads, self.head_dim).transpose(1, 2)
        xv = self.wv(x).view(bs, seqlen, self.n_kv_heads, self.head_dim).transpose(1, 2)
        xk, xv = xk.repeat_interleave(self.n_rep, dim=1), xv.repeat_interleave(self.n_rep, dim=1)
        out = F.scaled_dot_product_attention(xq, xk, xv, is_causal=True).transpose(1, 2)
        return self.wo(out.contiguous().view(bs, seqlen, -1))


class MetaFeedForward(nn.Module):
    def __init__(self, dim: int, hidden: int) -> None:
        super().__init__()
        self.w1, self.w2, self.w3 = (
            nn.Linear(dim, hidden, bias=False),
            nn.Linear(hidden, dim, bias=False),
            nn.Linear(dim, hidden, bias=False),
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.w2(F.silu(self.w1(x)) * self.w3(x))


class MetaBlock(nn.Module):
    def __init__(self, dim: int, n_heads: int, n_kv_heads: int) -> None:
        super().__init__()
        self.attention_norm, self.attention = RMSNorm(dim), MetaAttention(dim, n_heads, n_kv_heads)
        self.ffn_norm, self.feed_forward = RMSNorm(dim), MetaFeedForward(dim, 2 * dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = x + self.attention(self.attention_norm(x))
        return h + self.feed_forward(self.ffn_norm(h))


class MetaLlama(nn.Module):
    def __init__(
        self, vocab: int = 64, dim: int = 32, n_heads: int = 4, n_kv_heads: int = 2, n_layers: int = 2
    ) -> None:
        super().__init__()
        self.tok_embeddings = nn.Embedding(vocab, dim)
        self.layers = nn.ModuleList(MetaBlock(dim, n_heads, n_kv_heads) for _ in range(n_layers))
        self.norm = RMSNorm(dim)
        self.output = nn.Linear(dim, vocab, bias=False)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        h = self.tok_embeddings(tokens)
        for layer in self.layers:
            h = layer(h)
        return self.output(self.norm(h))


# --- models the planner must refuse with a clear error


class TorchEncoder(nn.Module):
    """nn.TransformerEncoderLayer: attention is nn.MultiheadAttention (``attention``: its options, e.g. the
    add_bias_kv / add_zero_attn / kdim variants tensor and context parallelism refuse)."""

    def __init__(self, vocab: int = 64, dim: int = 32, **attention) -> None:
        super().__init__()
        self.emb = nn.Embedding(vocab, dim)
        self.layers = nn.ModuleList(
            nn.TransformerEncoderLayer(dim, 4, 2 * dim, dropout=0.0, batch_first=True) for _ in range(2)
        )
        for layer in self.layers if attention else ():
            layer.self_attn = nn.MultiheadAttention(dim, 4, batch_first=True, **attention)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        x = self.emb(idx)
        for layer in self.layers:
            x = layer(x)
        return x


class PlainMLPStack(nn.Module):
    """Nothing the planner recognises: three linears in a row."""

    def __init__(self) -> None:
        super().__init__()
        self.net = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 16), nn.ReLU(), nn.Linear(16, 8))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net(x)

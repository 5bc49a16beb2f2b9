"""Models with BatchNorm, written as users write them; none knows about lightning_4d.

- ``BatchNormLM``: token embedding, a ``BatchNorm1d`` over the channels of every token (``[batch, channels,
  tokens]``), causal scaled-dot-product attention, and the LM head: its statistics are over the batch's samples
  and tokens, so under dp the replicas', under cp the shards' parts of them.
"""

import torch.nn.functional as F
from torch import nn

from tests.lm_models import VOCAB, _CausalLM, sgd


class BatchNormLM(_CausalLM):
    def __init__(self, width: int = 32, heads: int = 4):
        super().__init__()
        self.heads = heads
        self.embed = nn.Embedding(VOCAB, width)
        self.norm = nn.BatchNorm1d(width, momentum=0.5)
        self.qkv = nn.Linear(width, 3 * width)
        self.head = nn.Linear(width, VOCAB)

    def forward(self, ids):
        x = self.norm(self.embed(ids).transpose(1, 2)).transpose(1, 2)
        B, T, C = x.shape
        q, k, v = (t.view(B, T, self.heads, C // self.heads).transpose(1, 2) for t in self.qkv(x).chunk(3, -1))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True).transpose(1, 2).reshape(B, T, C)
        return self.head(x + y)

    def configure_optimizers(self):
        return sgd(self)

"""Ulysses attention: all-to-all from sequence shards to head shards, whole-sequence attention, and back.

Each of the ``cp`` ranks holds a zigzag shard of every sequence with all heads. One all-to-all trades that for
all tokens of ``heads / cp`` heads; each rank then computes ordinary attention over the whole sequence for its
heads (the mask, causal or a :class:`~lightning_4d.context_parallel.sequence_mask.SequenceMask`, applies
directly), and a second all-to-all returns every rank its tokens with all heads. Per layer a rank sends
``(cp - 1) / cp`` of its q, k, v and output once, where the ring passes every K/V block ``cp - 1`` times: less
traffic when the heads divide evenly, at the price of holding the whole sequence of its heads (attention
memory O(L) per head, O(L^2) for a mask written out) and of needing ``cp`` to divide the query and the key/value
heads (after tensor parallelism's split).
"""

from __future__ import annotations

import math
from typing import Optional

import torch
import torch.distributed as dist
import torch.nn.functional as F

from lightning_4d import _compat as compat
from lightning_4d.context_parallel.sequence_mask import SequenceMask
from lightning_4d.context_parallel.zigzag import cached_order

__all__ = ["check_heads", "ulysses_attention"]


def check_heads(query_heads: int, kv_heads: int, cp: int, where: str) -> None:
    """Refuse head counts that ``cp`` does not divide (each rank takes ``1/cp`` of them)."""
    for name, heads in (("query", query_heads), ("key/value", kv_heads)):
        if heads % cp:
            raise ValueError(
                f"cp_comm='a2a' gives each of the cp={cp} ranks 1/{cp} of the attention heads, but {where} has"
                f" {heads} {name} heads on each rank, which {cp} does not divide. Use cp_comm='ring' (any head"
                f" count), or a cp that divides {heads}.")


def _to_heads(t: torch.Tensor, group: dist.ProcessGroup, cp: int, order: torch.Tensor) -> torch.Tensor:
    """[B, H, S, D] (this rank's tokens, all heads) -> [B, H/cp, L, D] (all tokens in order, this rank's heads)."""
    b, h, s, d = t.shape
    sent = t.reshape(b, cp, h // cp, s, d).transpose(0, 1)  # chunk j: the heads rank j takes
    received = compat.all_to_all_in_stream(sent, group)  # chunk r: rank r's tokens of this rank's heads
    by_rank = received.permute(1, 2, 0, 3, 4).reshape(b, h // cp, cp * s, d)
    return by_rank.index_select(2, order.argsort())


def _to_tokens(t: torch.Tensor, group: dist.ProcessGroup, cp: int, order: torch.Tensor) -> torch.Tensor:
    """The inverse of :func:`_to_heads`: [B, H/cp, L, D] -> [B, H, S, D]."""
    b, h_local, length, d = t.shape
    by_rank = t.index_select(2, order).reshape(b, h_local, cp, length // cp, d).permute(2, 0, 1, 3, 4)
    received = compat.all_to_all_in_stream(by_rank, group)  # chunk g: head group g of this rank's tokens
    return received.transpose(0, 1).reshape(b, cp * h_local, length // cp, d)


def ulysses_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, group: Optional[dist.ProcessGroup],
                      is_causal: bool = False, scale: Optional[float] = None,
                      mask: Optional[SequenceMask] = None) -> torch.Tensor:
    """Exact attention of zigzag-sharded ``q`` [B, Hq, S, D] (or in ``mask.layout``) over ``k``/``v`` [B, Hkv, S, D]
    of the whole sequence, by all-to-all over heads; ``cp`` (the size of ``group``) must divide Hq and Hkv."""
    group = group if group is not None else dist.group.WORLD
    cp = dist.get_world_size(group)
    check_heads(q.size(1), k.size(1), cp, "this attention call")
    if is_causal and mask is not None:
        raise ValueError("ulysses_attention: pass either is_causal=True or a SequenceMask, not both")
    length = q.size(2) * cp
    order = cached_order(length, cp, q.device) if mask is None or mask.layout is None else mask.layout.order(q.device)
    qh, kh, vh = (_to_heads(t, group, cp, order) for t in (q, k, v))
    dense = None
    if mask is not None:
        whole = torch.arange(length, device=q.device)
        dense = mask.between(whole, whole)
    out = F.scaled_dot_product_attention(qh, kh, vh, attn_mask=dense, is_causal=is_causal,
                                         scale=scale if scale is not None else 1.0 / math.sqrt(q.size(-1)),
                                         enable_gqa=qh.size(1) != kh.size(1))
    return _to_tokens(out, group, cp, order)

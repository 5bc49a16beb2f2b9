"""torch's shape rules for ``scaled_dot_product_attention`` operands, mapped onto what ring attention takes."""

from __future__ import annotations

import torch

from lightning_4d._compat import without_function_modes

__all__ = ["sdpa_operands"]


def sdpa_operands(
    query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, enable_gqa: bool = False
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Size]:
    """The operands of a ``scaled_dot_product_attention(query, key, value, enable_gqa=...)`` call as
    :func:`~lightning_4d.context_parallel.ring_attention.ring_attention` takes them: ``q`` ``[N, H, S, E]``, ``k`` and ``v`` ``[N, Hkv, S, E]`` with ``Hkv``
    dividing ``H`` (query head ``h`` reads key/value head ``h // (H // Hkv)``), and the output's leading dims,
    ``[*lead, H]``, that ring attention's ``[N, H, S, Ev]`` output is reshaped to.

    The shapes torch accepts are accepted, with torch's meaning; what torch rejects is rejected with torch's own
    error, because torch itself checks them (on the meta device, no data). Without ``enable_gqa`` the dims before
    the last two broadcast as in a matmul: a key/value head dim of 1 is read by every query head (multi-query
    attention written without ``enable_gqa``), while 2 key/value heads for 4 query heads is torch's size
    mismatch. With ``enable_gqa`` key and value heads are repeated (``repeat_interleave``) to the query's. A
    single broadcast head stays one head here (the kernels read it for every query head, and it travels round
    the ring once); dims of size 1 that broadcast otherwise (batch, or fewer heads in one of key and value only)
    are expanded.
    """
    try:
        with without_function_modes():
            expected = torch.nn.functional.scaled_dot_product_attention(
                *(t.new_empty(t.shape, device="meta") for t in (query, key, value)), enable_gqa=enable_gqa
            )
    except (RuntimeError, ValueError) as error:
        raise type(error)(
            f"{error} (torch's scaled_dot_product_attention rejects these shapes too: query {tuple(query.shape)},"
            f" key {tuple(key.shape)}, value {tuple(value.shape)}, enable_gqa={enable_gqa})"
        ) from error
    *lead, heads, _, _ = expected.shape
    lead = torch.Size(lead)

    def kv_heads(t: torch.Tensor) -> int:
        return t.size(-3) if t.dim() >= 3 else 1

    hk, hv = kv_heads(key), kv_heads(value)
    groups = hk if hk == hv else (max(hk, hv) if max(hk, hv) % min(hk, hv) == 0 else heads)

    def grouped(t: torch.Tensor, h: int) -> torch.Tensor:
        if t.dim() < 3:
            t = t.unsqueeze(0)
        if h != groups:  # torch's meaning in both cases: enable_gqa repeats each head, a single head broadcasts
            t = t.repeat_interleave(groups // h, dim=-3)
        return t.expand(*lead, groups, *t.shape[-2:]).reshape(-1, groups, *t.shape[-2:])

    q = query if query.dim() >= 3 else query.unsqueeze(0)
    q = q.expand(*lead, heads, *q.shape[-2:]).reshape(-1, heads, *q.shape[-2:])
    return q, grouped(key, hk), grouped(value, hv), torch.Size((*lead, heads))

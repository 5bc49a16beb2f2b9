"""The load-balanced ("zigzag") sequence layout of context parallelism.

With causal masking a contiguous split would give the last rank almost all of the work, so each sequence is cut
into ``2 * cp`` equal chunks and rank ``r`` holds chunks ``r`` and ``2 * cp - 1 - r``: every rank then sees the
same amount of unmasked attention. Local order stays increasing in global position.
"""

from __future__ import annotations

import functools
from typing import Optional

import torch

__all__ = ["shard_sequence", "unshard_sequence", "zigzag_positions"]


def _nearest_multiples(length: int, multiple: int) -> str:
    """The positive multiples of ``multiple`` next to ``length``, for an error message: "8 or 12", "4"."""
    below = length // multiple * multiple
    return f"{below} or {below + multiple}" if below > 0 else f"{below + multiple}"


def zigzag_positions(seq_len: int, cp_size: int, cp_rank: int) -> torch.Tensor:
    """Global positions of the tokens held by ``cp_rank``, in local order.

    Rank ``r`` holds chunks ``r`` and ``2 * cp_size - 1 - r`` of ``2 * cp_size`` equal
    chunks, concatenated in that order, so local order is increasing in global position.
    """
    if cp_size < 1:
        raise ValueError(f"cp_size must be >= 1, got {cp_size}")
    if not 0 <= cp_rank < cp_size:
        raise ValueError(f"cp_rank must be in [0, {cp_size}), got {cp_rank}")
    n_chunks = 2 * cp_size
    if seq_len <= 0 or seq_len % n_chunks:
        raise ValueError(
            f"sequence length {seq_len} is not a positive multiple of 2*cp = {n_chunks} "
            f"(zigzag context parallelism needs 2 equal chunks per cp rank); "
            f"pad or truncate it to {_nearest_multiples(seq_len, n_chunks)}"
        )
    chunk = seq_len // n_chunks
    first = torch.arange(cp_rank * chunk, (cp_rank + 1) * chunk)
    second = torch.arange((n_chunks - 1 - cp_rank) * chunk, (n_chunks - cp_rank) * chunk)
    return torch.cat([first, second])


def shard_sequence(t: torch.Tensor, dim: int, cp_size: int, cp_rank: int) -> torch.Tensor:
    """This rank's zigzag shard of ``t`` along the sequence dimension ``dim``."""
    positions = zigzag_positions(t.size(dim), cp_size, cp_rank).to(t.device)
    return t.index_select(dim, positions)


def unshard_sequence(shards: list[torch.Tensor] | tuple[torch.Tensor, ...], dim: int) -> torch.Tensor:
    """Reassemble the full sequence from every rank's zigzag shard (in cp-rank order).

    The inverse of :func:`shard_sequence`; pair it with ``dist.all_gather`` to rebuild a
    full tensor on every rank (e.g. to check results or to compute a sequence-level loss).
    """
    cp_size = len(shards)
    if cp_size == 0:
        raise ValueError("unshard_sequence needs at least one shard")
    seq_len = shards[0].size(dim) * cp_size
    order = torch.cat([zigzag_positions(seq_len, cp_size, r) for r in range(cp_size)])
    return torch.cat(list(shards), dim=dim).index_select(dim, order.argsort().to(shards[0].device))


@functools.lru_cache(maxsize=64)
def cached_positions(length: int, cp: int, rank: int, device: Optional[torch.device] = None) -> torch.Tensor:
    """:func:`zigzag_positions` once per (length, cp, rank), on ``device`` (default: host memory): asked for
    every step and every K/V tile of every masked call, copied to the device once, never in a step (the callers
    only read it)."""
    positions = zigzag_positions(length, cp, rank)
    return positions if device is None or device.type == "cpu" else positions.to(device)


@functools.lru_cache(maxsize=16)
def cached_order(length: int, cp: int, device: torch.device) -> torch.Tensor:
    """Every rank's positions in rank order (the whole sequence as the ranks' shards concatenate it), on
    ``device``, once per (length, cp)."""
    return torch.cat([cached_positions(length, cp, r) for r in range(cp)]).to(device)

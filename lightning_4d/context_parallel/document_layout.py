"""The document-balanced sequence layout of context parallelism, for packed batches.

Under a document mask (packed sequences: a token attends to the earlier tokens of its own document only) the
zigzag split is not balanced: its chunks cut documents anywhere, and a document much longer than a chunk weighs on
the ranks that hold its end (8,192 tokens of documents of 64 to 4,096 tokens: the slowest of 4 ranks did 31% more
attention work than the fastest). Here each rank's share is cut into ``pieces`` equal contiguous pieces. Ring
attention computes a piece as one query tile against every key tile that the mask lets it see: its own, and the
earlier ones its documents reach back into. That count is the piece's work; the pieces are dealt to the ranks, the
same number to each, so that the busiest rank carries as little as it can: largest first to the least loaded rank
with room, then swaps between the busiest and the least busy rank while one narrows their gap. Every cp rank derives
the same layout from the same batch (integer arithmetic in host memory), so nothing is exchanged for it.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional

import torch
from torch import Tensor

from lightning_4d.context_parallel.zigzag import cached_positions

__all__ = ["SequenceLayout", "balanced_layout", "piece_work", "positions_of"]

# Pieces per rank: finer pieces balance better and let ring attention skip more of what a document mask hides, at
# the cost of more (smaller) kernel calls.
PIECES = 8
# What a tile pair costs, forward and backward, when one document covers it wholly, and when the mask hides part of
# it (the diagonal, a document's edge): fitted over packings by bench/cp_tile_cost.py (ATen's CPU flash attention,
# 256- and 512-token tiles, 4 heads of 64), a masked pair took 1.02-1.42 times a whole one (1.28-1.29 at 256 tokens)
# and per-rank CPU time at cp=2 fitted 1.07; with 1.25 the ranks' CPU times at cp=2 came within 1-2%, against 5-6%
# with the 1.5 a forward-only measurement gave. On CUDA such tiles run the math kernel.
WHOLE_COST, MASKED_COST = 4, 5


@dataclass(frozen=True, eq=False)
class SequenceLayout:
    """Which global positions each cp rank holds: ``positions[r]``, rank ``r``'s, in its local order (increasing),
    made of ``pieces`` contiguous runs of equal length. Ring attention computes each run as one tile."""

    positions: Tensor  # [cp, L / cp] int64, in host memory
    pieces: int
    _on_device: dict = field(default_factory=dict, repr=False)

    def of(self, rank: int, device: Optional[torch.device] = None) -> Tensor:
        """Rank ``rank``'s positions, on ``device`` (default: host memory), copied there once."""
        if device is None or device.type == "cpu":
            return self.positions[rank]
        return self._copied(rank, self.positions[rank], device)

    def order(self, device: torch.device) -> Tensor:
        """Every rank's positions in rank order: the whole sequence as the ranks' shards concatenate it."""
        whole = self.positions.flatten()
        return whole if device.type == "cpu" else self._copied("order", whole, device)

    def _copied(self, name: object, positions: Tensor, device: torch.device) -> Tensor:
        """``positions`` on ``device``, from pinned memory without making the host wait (a layout is a step's: it
        keeps the pinned source alive while the copy may run)."""
        key = (name, device)
        if key not in self._on_device:
            pinned = positions.pin_memory() if device.type == "cuda" else positions
            self._on_device[key] = (pinned, pinned.to(device, non_blocking=True))
        return self._on_device[key][1]


def positions_of(layout: Optional[SequenceLayout], length: int, cp: int, rank: int,
                 device: Optional[torch.device] = None) -> Tensor:
    """The global positions ``rank`` of ``cp`` holds of sequences of ``length`` in ``layout`` (None: the
    zigzag's), on ``device`` (default: host memory)."""
    return cached_positions(length, cp, rank, device) if layout is None else layout.of(rank, device)


def piece_work(documents: Tensor, piece: int) -> list[int]:
    """Per piece of ``piece`` tokens of sequences packed with ``documents`` ([batch, L]: a document id per token,
    documents contiguous), the work of the tiles of keys ring attention computes it against under a causal document
    mask: its own and every earlier one its first token's document reaches into (a tile pair runs for the whole
    batch when any row needs it). A pair the mask hides in part runs with the mask, which costs more:
    :data:`MASKED_COST` against :data:`WHOLE_COST` for a pair that one document covers wholly in every row."""
    length = documents.size(-1)
    index = torch.arange(length)
    starts = torch.ones(documents.shape, dtype=torch.bool)
    starts[:, 1:] = documents[:, 1:] != documents[:, :-1]
    document_start = torch.where(starts, index, 0).cummax(-1).values  # first position of each token's document
    pieces = torch.arange(length // piece)
    reach = (document_start[:, ::piece] // piece).amin(0)  # the earliest key tile each piece sees, over the rows
    # key tiles from this one on lie wholly in the document of the piece's last token, in every row
    whole_from = torch.maximum((document_start[:, piece - 1::piece] + piece - 1) // piece, reach[None]).amax(0)
    whole = (pieces - whole_from).clamp(min=0)
    return (WHOLE_COST * whole + MASKED_COST * (pieces - reach + 1 - whole)).tolist()


def _deal(work: list[int], cp: int, pieces: int) -> list[list[int]]:
    """The pieces (indices into ``work``) each rank holds: ``pieces`` each, the busiest rank's total kept low."""
    held: list[list[int]] = [[] for _ in range(cp)]
    loads = [0] * cp
    for piece in sorted(range(len(work)), key=lambda i: (-work[i], i)):
        rank = min((r for r in range(cp) if len(held[r]) < pieces), key=lambda r: (loads[r], r))
        held[rank].append(piece)
        loads[rank] += work[piece]
    while True:  # each swap lowers the sum of squared loads, so this ends
        busiest = max(range(cp), key=lambda r: (loads[r], -r))
        idlest = min(range(cp), key=lambda r: (loads[r], r))
        gap = loads[busiest] - loads[idlest]
        swaps = [(abs(gap - 2 * (work[a] - work[b])), a, b) for a in held[busiest] for b in held[idlest]
                 if 0 < work[a] - work[b] < gap]
        if not swaps:
            return held
        _, a, b = min(swaps)
        held[busiest][held[busiest].index(a)], held[idlest][held[idlest].index(b)] = b, a
        loads[busiest] -= work[a] - work[b]
        loads[idlest] += work[a] - work[b]


def balanced_layout(documents: Tensor, cp: int, pieces: Optional[int] = None) -> SequenceLayout:
    """The layout of sequences packed with ``documents`` ([batch, L] document ids, in host memory) over ``cp``
    ranks that balances causal attention within documents. ``pieces`` per rank: by default the most of
    :data:`PIECES`, 4, 2, 1 that divides a rank's ``L / cp`` tokens."""
    length = documents.size(-1)
    local = length // cp
    if length % cp:
        raise ValueError(f"balanced_layout: a sequence of {length} tokens does not split over cp={cp} ranks")
    if pieces is None:
        pieces = next(n for n in (PIECES, 4, 2, 1) if local % n == 0)
    elif local % pieces:
        raise ValueError(f"balanced_layout: pieces={pieces} does not divide a rank's {local} tokens")
    piece = local // pieces
    held = _deal(piece_work(documents.reshape(-1, length), piece), cp, pieces)
    runs = torch.arange(length).view(cp * pieces, piece)
    positions = torch.stack([runs[sorted(mine)].flatten() for mine in held])
    return SequenceLayout(positions, pieces)

"""How key/value tiles travel between the ranks of a context-parallel group for ring attention, and their
gradients back: round the ring, overlapped with the compute (``cp_comm="ring"``), or all-gathered at once
(``"allgather"``). :data:`STREAMS` maps each ``comm`` to its K/V stream and its gradient collector."""

from __future__ import annotations

import functools
from typing import Optional

import torch
import torch.distributed as dist

__all__ = ["STREAMS"]

# K/V and dK/dV exchanges can be in flight at the same time between the same peers;
# separate tags keep them from being matched with each other.
_KV_TAG = 0
_GRAD_TAG = 1


# --------------------------------------------------------------------------- communication
#
# K/V travel round the ring in tiles rather than whole blocks. Stream position ``g`` is tile
# ``g % n`` of the block a rank computes on at step ``g // n`` (its own block at step 0). The
# next rank computes on the same tile one block step (n positions) later, so at position ``g``
# a rank sends the tile it computes on and receives position ``g + n``, overlapped with the
# compute. Position ``g`` lives in slot ``g % (n + 1)`` of a pool: ``g + n`` lands in the slot
# that position ``g - 1`` has just left. A rank so holds 1 + 1/n blocks of others' K/V where
# whole-block double buffering holds 2. dK/dV partial sums travel the same way, one position
# behind their tiles' compute.


@functools.lru_cache(maxsize=None)
def _ring_peers(group) -> Optional[tuple[int, int]]:
    """Global ranks of the next and the previous cp rank, or None when alone (cached: asked once per tile)."""
    rank, size = dist.get_rank(group), dist.get_world_size(group)
    if size == 1:
        return None
    return dist.get_global_rank(group, (rank + 1) % size), dist.get_global_rank(group, (rank - 1) % size)


def _ring_shift(send: torch.Tensor, recv: torch.Tensor, group, tag: int) -> list:
    """Send to the next cp rank and receive from the previous one, asynchronously (a copy when alone)."""
    peers = _ring_peers(dist.group.WORLD if group is None else group)  # a re-created world is a new key
    if peers is None:
        recv.copy_(send)
        return []
    nxt, prv = peers
    return dist.batch_isend_irecv(
        [
            dist.P2POp(dist.isend, send, nxt, group, tag),
            dist.P2POp(dist.irecv, recv, prv, group, tag),
        ]
    )


def _tile_pool(t: torch.Tensor, tiles: list[slice], dtype: torch.dtype) -> torch.Tensor:
    """``len(tiles) + 1`` contiguous slots, each a stacked pair of ``t``-shaped tiles."""
    shape = (len(tiles) + 1, 2, t.size(0), t.size(1), t.size(2) // len(tiles), t.size(3))
    return torch.empty(shape, dtype=dtype, device=t.device)


def _ring_kv(k: torch.Tensor, v: torch.Tensor, group, tiles: list[slice]):
    """Yield ``(owner cp rank, tile index, K tile, V tile)`` over every rank's block, own block first.

    The tile computed on is forwarded, and the tile needed one block step later received, while
    the caller computes (see the comment above).
    """
    rank, size = dist.get_rank(group), dist.get_world_size(group)
    n = len(tiles)
    pool = _tile_pool(k, tiles, k.dtype) if size > 1 else None
    for step in range(size):
        for j, rows in enumerate(tiles):
            g = step * n + j
            k_tile, v_tile = (k[:, :, rows], v[:, :, rows]) if step == 0 else pool[g % (n + 1)]
            works = []
            if step < size - 1:
                slot = pool[g % (n + 1)]
                if step == 0:  # a contiguous copy to send
                    slot[0].copy_(k_tile)
                    slot[1].copy_(v_tile)
                works = _ring_shift(slot, pool[(g + n) % (n + 1)], group, _KV_TAG)
            yield (rank - step) % size, j, k_tile, v_tile
            for work in works:
                work.wait()


def _gathered_kv(k: torch.Tensor, v: torch.Tensor, group, tiles: list[slice]):
    """Like :func:`_ring_kv`, from one all-gather that runs while the own block is computed on."""
    rank, size = dist.get_rank(group), dist.get_world_size(group)
    gathered = k.new_empty((2, size * k.size(0), *k.shape[1:]))
    works = [
        dist.all_gather_single(gathered[0], k.contiguous(), group=group, async_op=True),
        dist.all_gather_single(gathered[1], v.contiguous(), group=group, async_op=True),
    ]
    for j, rows in enumerate(tiles):
        yield rank, j, k[:, :, rows], v[:, :, rows]
    for work in works:
        work.wait()
    blocks = gathered.unflatten(1, (size, k.size(0)))
    for step in range(1, size):
        owner = (rank - step) % size
        for j, rows in enumerate(tiles):
            yield owner, j, blocks[0, owner][:, :, rows], blocks[1, owner][:, :, rows]


class _RingGrads:
    """dK/dV partial sums (fp32) of every K/V tile, passed round the ring behind the tile.

    A tile's partial sum arrives from the previous rank, takes this rank's share and leaves for
    the next one; after the last rank it reaches the owner. Slots as in :func:`_ring_kv`.
    """

    def __init__(self, k: torch.Tensor, group, tiles: list[slice]):
        self.group, self.tiles, self.shape = group, tiles, k.shape
        self.rank, self.size = dist.get_rank(group), dist.get_world_size(group)
        # fp32 so low-precision gradients are summed over cp ranks without extra rounding.
        self.pool = _tile_pool(k, tiles, torch.float32)
        self.works: list = []
        self.current = -1  # stream position whose partial sum is being added to
        self.arriving = -1  # stream position whose partial sum the pending works receive

    def _position(self, owner: int, tile: int) -> int:
        return (self.rank - owner) % self.size * len(self.tiles) + tile

    def _slot(self, g: int) -> torch.Tensor:
        return self.pool[g % len(self.pool)]

    def _finish(self) -> None:
        for work in self.works:
            work.wait()
        self.works = []

    def target(self, owner: int, tile: int) -> torch.Tensor:
        """The partial sum of ``owner``'s K/V tile, to add this rank's share to."""
        g = self._position(owner, tile)
        if g != self.current:
            if g == self.arriving:  # one tile per block: posted at the previous position (else long done)
                self._finish()
            if g < len(self.tiles):  # own block: the sum starts here
                self._slot(g).zero_()
            self.current = g
        return self._slot(g)

    def done(self, owner: int, tile: int) -> None:
        """Pass the partial sum of ``owner``'s tile on, once the previous one has left."""
        g = self._position(owner, tile)
        self.target(owner, tile)  # also for a tile no local query sees: it must still move on
        self._finish()
        n = len(self.tiles)
        self.works = _ring_shift(self._slot(g), self._slot(g + n), self.group, _GRAD_TAG)
        self.arriving = g + n

    def result(self) -> torch.Tensor:
        """dK/dV of the own block: its tiles' sums, back after a full cycle."""
        self._finish()
        n = len(self.tiles)
        dkv = self.pool.new_empty((2, *self.shape))
        for j, rows in enumerate(self.tiles):
            dkv[:, :, :, rows].copy_(self._slot(self.size * n + j))
        return dkv


class _GatheredGrads:
    """dK/dV for every rank's block, summed onto their owners with one reduce-scatter."""

    def __init__(self, k: torch.Tensor, group, tiles: list[slice]):
        self.group, self.tiles = group, tiles
        self.size = dist.get_world_size(group)
        self.acc = torch.zeros((self.size, 2, *k.shape), dtype=torch.float32, device=k.device)

    def target(self, owner: int, tile: int) -> torch.Tensor:
        return self.acc[owner][:, :, :, self.tiles[tile]]

    def done(self, owner: int, tile: int) -> None:
        """Nothing moves before the final reduce-scatter."""

    def result(self) -> torch.Tensor:
        mine = self.acc.new_empty(self.acc.shape[1:])
        dist.reduce_scatter_single(mine, self.acc.flatten(0, 1), group=self.group)
        return mine


STREAMS = {"ring": (_ring_kv, _RingGrads), "allgather": (_gathered_kv, _GatheredGrads)}

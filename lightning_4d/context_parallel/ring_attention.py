"""Context-parallel (ring) attention over a load-balanced zigzag sequence layout.

Each of the ``cp`` ranks of a context-parallel group holds ``S = L / cp`` tokens of
every sequence. With causal masking a contiguous split would give the last rank
almost all of the work, so the sequence is cut into ``2 * cp`` equal chunks and
rank ``r`` holds chunks ``r`` and ``2 * cp - 1 - r`` (the "zigzag" layout): every
rank then sees the same amount of unmasked attention.

The attention itself is computed tile by tile (a tile of the local queries against a
tile of one rank's K/V at a time; quarters where the length allows) and the partial
results are merged exactly with their log-sum-exp, so the output equals full attention
over the whole sequence. K/V, and in backward their gradients' partial sums, travel
round the ring in the same tiles, overlapped with the compute: with quarters a rank
holds 1.25 blocks of each beyond its own share, where whole-block double buffering
holds 2. Pure ``torch.distributed``; no
Lightning needed.

Masks beyond causal or full attention (a :class:`SequenceMask`: padding, a sliding window, packed documents)
are described in global terms over the whole sequences, which every cp rank holds (they are small: one
number per token), so a tile pair's mask is computed where it is needed and nothing extra travels. A tile
pair that the mask hides wholly is skipped (a sliding window's work grows with the window, not the
sequence), one it leaves whole runs unmasked, and only tiles at a mask's edges run with a mask.
"""

from __future__ import annotations

import math
from typing import Any, Optional

import torch
import torch.distributed as dist

from lightning_4d import _compat as compat
from lightning_4d.context_parallel.document_layout import positions_of
from lightning_4d.context_parallel.kv_streams import STREAMS
from lightning_4d.context_parallel.sequence_mask import SequenceMask, check_mask

__all__ = ["ring_attention"]

# Tiles per K/V block (fewer where the local length does not divide): a rank holds (n + 1) / n
# blocks of others' K/V, and as much of dK/dV partial sums, at a cost of n messages per block
# step and about n * n / 2 kernel calls per block.
_TILES = 4


# --------------------------------------------------------------------------- local kernels
#
# A kernel computes attention of some queries against one K/V tile and returns the
# output, the fp32 log-sum-exp [B, Hq, Sq] that the merge needs, and whatever opaque
# state its backward wants back. Its backward is handed the *final* (merged) output and
# log-sum-exp, which makes the per-tile gradients exact without any extra correction.


def _additive(mask: Optional[torch.Tensor], dtype: torch.dtype) -> Optional[torch.Tensor]:
    """A boolean tile mask (True: seen) as the additive one fused kernels take."""
    if mask is None:
        return None
    return torch.zeros(mask.shape, dtype=dtype, device=mask.device).masked_fill_(~mask, -math.inf)


class _CpuFlashKernel:
    """ATen's CPU flash attention; handles grouped K/V heads and masks natively."""

    takes_masks = True

    def forward(self, q, k, v, causal, scale, mask=None):
        out, lse = compat.flash_attention_cpu(q, k, v, 0.0, causal, attn_mask=_additive(mask, q.dtype), scale=scale)
        return out, lse, None

    def backward(self, dout, q, k, v, out, lse, aux, causal, scale, mask=None):
        return compat.flash_attention_cpu_backward(
            dout, q, k, v, out, lse, 0.0, causal, attn_mask=_additive(mask, q.dtype), scale=scale
        )


class _MathKernel:
    """Plain fp32 matmul attention: the fallback when no fused kernel fits.

    Grouped K/V heads are handled by viewing queries as [B, Hkv, group, S, D] and
    broadcasting K/V over the group instead of repeating them per query head.
    """

    takes_masks = True

    def _probs(self, q5, k, lse5, causal, scale, mask):
        scores = (q5.float() @ k.float().unsqueeze(2).transpose(-1, -2)) * scale
        if causal:
            hidden = torch.ones(scores.shape[-2:], dtype=torch.bool, device=scores.device).triu(1)
            scores = scores.masked_fill(hidden, float("-inf"))
        if mask is not None:  # [B, 1, Sq, Sk] over the query heads' groups
            scores = scores.masked_fill(~mask.unsqueeze(2), float("-inf"))
        if lse5 is None:
            lse5 = scores.logsumexp(dim=-1)
        return (scores - lse5.unsqueeze(-1)).exp().nan_to_num_(0.0), lse5  # a row that sees nothing: zeros

    def forward(self, q, k, v, causal, scale, mask=None):
        q5 = q.unflatten(1, (k.size(1), -1))
        probs, lse5 = self._probs(q5, k, None, causal, scale, mask)
        out = probs @ v.float().unsqueeze(2)
        return out.flatten(1, 2).to(q.dtype), lse5.flatten(1, 2), None

    def backward(self, dout, q, k, v, out, lse, aux, causal, scale, mask=None):
        groups = (k.size(1), -1)
        q5, dout5, out5 = (t.unflatten(1, groups).float() for t in (q, dout, out))
        probs, _ = self._probs(q5, k, lse.unflatten(1, groups), causal, scale, mask)
        dv = (probs.transpose(-1, -2) @ dout5).sum(2)
        dprobs = dout5 @ v.float().unsqueeze(2).transpose(-1, -2)
        dscores = probs * (dprobs - (dout5 * out5).sum(-1, keepdim=True)) * scale
        dq = dscores @ k.float().unsqueeze(2)
        dk = (dscores.transpose(-1, -2) @ q5).sum(2)
        return dq.flatten(1, 2).to(q.dtype), dk.to(k.dtype), dv.to(v.dtype)


class _CudaKernel:
    """Shared plumbing for the fused CUDA kernels (not exercised by the CPU test suite).

    They want equal head counts and contiguous inputs, so K/V are expanded per tile
    (only locally, after communication) and their gradients folded back. Tiles at a mask's edge
    run on the math kernel instead (``takes_masks``).
    """

    takes_masks = False

    @staticmethod
    def _expand(t: torch.Tensor, groups: int) -> torch.Tensor:
        return t.repeat_interleave(groups, dim=1) if groups > 1 else t.contiguous()

    def forward(self, q, k, v, causal, scale):
        groups = q.size(1) // k.size(1)
        return self._forward(q.contiguous(), self._expand(k, groups), self._expand(v, groups), causal, scale)

    def backward(self, dout, q, k, v, out, lse, aux, causal, scale):
        hkv, groups = k.size(1), q.size(1) // k.size(1)
        dq, dk, dv = self._backward(
            dout.contiguous(),
            q.contiguous(),
            self._expand(k, groups),
            self._expand(v, groups),
            out.contiguous(),
            lse.contiguous(),
            aux,
            causal,
            scale,
        )
        dk, dv = (g.unflatten(1, (hkv, groups)).sum(2) for g in (dk, dv))
        return dq, dk, dv


class _CudaFlashKernel(_CudaKernel):
    def _forward(self, q, k, v, causal, scale):
        out, lse, cum_q, cum_k, max_q, max_k, rng_state, unused, _ = (
            compat.flash_attention_cuda(q, k, v, 0.0, causal, False, scale=scale)
        )
        return out, lse, (cum_q, cum_k, max_q, max_k, rng_state, unused)

    def _backward(self, dout, q, k, v, out, lse, aux, causal, scale):
        cum_q, cum_k, max_q, max_k, rng_state, unused = aux
        return compat.flash_attention_cuda_backward(
            dout, q, k, v, out, lse, cum_q, cum_k, max_q, max_k, 0.0, causal, rng_state, unused, scale=scale
        )


class _CudaEfficientKernel(_CudaKernel):
    """Memory-efficient kernel; it pads its log-sum-exp to a multiple of 32 rows."""

    def _forward(self, q, k, v, causal, scale):
        out, lse, seed, offset = compat.efficient_attention_cuda(
            q, k, v, None, True, 0.0, causal, scale=scale
        )
        return out, lse[..., : q.size(2)], (seed, offset)

    def _backward(self, dout, q, k, v, out, lse, aux, causal, scale):
        seed, offset = aux
        padded = torch.nn.functional.pad(lse, (0, -lse.size(-1) % 32))
        dq, dk, dv, _ = compat.efficient_attention_cuda_backward(
            dout, q, k, v, None, out, padded, seed, offset, 0.0, [True, True, True, False], causal, scale=scale
        )
        return dq, dk, dv


def _select_kernel(q: torch.Tensor, is_causal: bool):
    """Fastest local kernel that also returns the log-sum-exp for this device and dtype."""
    if q.device.type == "cpu":
        return _CpuFlashKernel()
    if q.device.type == "cuda":
        # Checked on a same-head-count stand-in: K/V get expanded per tile before the call.
        params = torch.backends.cuda.SDPAParams(q, q, q, None, 0.0, is_causal, False)
        if torch.backends.cuda.can_use_flash_attention(params):
            return _CudaFlashKernel()
        if torch.backends.cuda.can_use_efficient_attention(params):
            return _CudaEfficientKernel()
    return _MathKernel()


# --------------------------------------------------------------------------- tile schedule


def _tile_rows(seq: int, window: Optional[int] = None, pieces: Optional[int] = None) -> list[slice]:
    """Equal tiles of the local sequence: ``_TILES`` of them where the length allows, else 2 or 1; under a
    sliding ``window``, enough (an even number) that a tile is no longer than the window where the length
    allows, so that the tiles outside it, skipped, leave work per query token flat as the sequence grows.

    A causal (zigzag) local length is even, so its tiles never straddle the two chunks. The ``pieces`` of a
    :class:`~.document_layout.SequenceLayout` are a tile each (split again under a window).
    """
    if pieces is None:
        return _split(seq, next(count for count in (_TILES, 2, 1) if seq % count == 0), window)
    piece = seq // pieces
    return [slice(p * piece + rows.start, p * piece + rows.stop)
            for p in range(pieces) for rows in _split(piece, 1, window)]


def _mask_tiles(seq: int, mask: Optional[SequenceMask]) -> list[slice]:
    """The tiles of a local sequence of ``seq`` tokens under ``mask`` (its window and layout)."""
    if mask is None:
        return _tile_rows(seq)
    return _tile_rows(seq, mask.window, mask.layout.pieces if mask.layout is not None else None)


def _split(seq: int, count: int, window: Optional[int]) -> list[slice]:
    """``seq`` rows as ``count`` equal tiles, or more under ``window`` (see :func:`_tile_rows`)."""
    if window is not None and seq // count > window:
        count = next((c for c in range(max(count, 2), seq + 1, 2) if seq % c == 0 and seq // c <= window), count)
    rows = seq // count
    return [slice(i * rows, (i + 1) * rows) for i in range(count)]


def _global_tile(rank: int, tile: int, tiles: int, cp: int) -> int:
    """Position of ``rank``'s local ``tile`` among the equal tiles of the whole zigzag sequence."""
    half = tiles // 2
    chunk = rank if tile < half else 2 * cp - 1 - rank
    return chunk * half + tile % half


def _visible(q_rank: int, kv_rank: int, kv_tile: int, tiles: int, cp: int, is_causal: bool) -> list[tuple[int, bool]]:
    """The local query tiles that attend to ``kv_rank``'s K/V tile ``kv_tile``, each with whether causally.

    Zigzag tiles are equal, aligned ranges of global positions, so a query/key tile pair is fully
    visible (keys earlier), fully masked (keys later) or diagonal (same range, causal mask). Over
    one K/V block every rank gets the same work: half of the pairs, counting a diagonal as half.
    """
    if not is_causal:
        return [(i, False) for i in range(tiles)]
    key = _global_tile(kv_rank, kv_tile, tiles, cp)
    queries = (_global_tile(q_rank, i, tiles, cp) for i in range(tiles))
    return [(i, key == query) for i, query in enumerate(queries) if key <= query]


def _pairs(rank: int, owner: int, kv_tile: int, tiles: list[slice], cp: int, is_causal: bool,
           mask: Optional[SequenceMask], device: torch.device = torch.device("cpu")
           ) -> list[tuple[int, bool, Optional[torch.Tensor]]]:
    """The local query tiles that attend to ``owner``'s K/V tile ``kv_tile``: (query tile, whether with the
    kernel's causal flag, the boolean tile mask or None). Under a :class:`SequenceMask` a pair it hides wholly
    is left out and one it leaves whole runs unmasked, so work follows what the mask lets through."""
    if mask is None:
        return [(i, causal, None) for i, causal in _visible(rank, owner, kv_tile, len(tiles), cp, is_causal)]
    length = cp * tiles[-1].stop  # tile masks on ``device``, the queries' (a window alone has no tensor to follow)
    q_positions = positions_of(mask.layout, length, cp, rank, device)
    k_positions = positions_of(mask.layout, length, cp, owner, device)[tiles[kv_tile]]
    # which pairs to compute, and which unmasked, is decided on the host, from the mask's host twin
    host = mask.on_host()
    q_host = positions_of(mask.layout, length, cp, rank)
    k_host = positions_of(mask.layout, length, cp, owner)[tiles[kv_tile]]
    pairs = []
    for i, rows in enumerate(tiles):
        anything, everything = host.seen_in(q_host[rows], k_host, (length, cp, rank, owner, kv_tile, i, len(tiles)))
        if anything:
            pairs.append((i, False, None if everything else mask.between(q_positions[rows], k_positions)))
    return pairs


def tile_work(mask: SequenceMask, length: int, cp: int, rank: int) -> tuple[int, int]:
    """Query x key elements of the tile pairs ring attention computes on ``rank`` of ``cp`` for sequences of
    ``length`` under ``mask``: of those it runs unmasked, and of those it runs with the mask (the balance of a
    layout; benchmarks and tests read it)."""
    tiles = _mask_tiles(length // cp, mask)
    work = [0, 0]
    for owner in range(cp):
        for j, keys in enumerate(tiles):
            for i, _, seen in _pairs(rank, owner, j, tiles, cp, False, mask):
                work[seen is not None] += (tiles[i].stop - tiles[i].start) * (keys.stop - keys.start)
    return work[0], work[1]


def _merge(out: torch.Tensor, lse: torch.Tensor, tile_out: torch.Tensor, tile_lse: torch.Tensor) -> None:
    """Fold one tile's softmax-normalised result into the running (fp32) one, in place.

    The running result starts as output 0 and log-sum-exp -inf, which the first tile replaces exactly.
    ``tile_out`` is the kernel's own fresh output and is overwritten.
    """
    new_lse = torch.logaddexp(lse, tile_lse)
    out.mul_((lse - new_lse).exp_().unsqueeze(-1))
    out.add_(tile_out.float().mul_((tile_lse - new_lse).exp_().unsqueeze(-1)))
    lse.copy_(new_lse)


def _merge_masked(out: torch.Tensor, lse: torch.Tensor, tile_out: torch.Tensor, tile_lse: torch.Tensor) -> None:
    """:func:`_merge` for a masked tile, where a query row may have seen nothing yet (log-sum-exp -inf on both
    sides): such a row stays output 0, log-sum-exp -inf."""
    new_lse = torch.logaddexp(lse, tile_lse)
    anchor = new_lse.masked_fill(new_lse == -math.inf, 0.0)
    out.mul_((lse - anchor).exp_().unsqueeze(-1))
    out.add_(tile_out.float().nan_to_num_(0.0).mul_((tile_lse - anchor).exp_().unsqueeze(-1)))
    lse.copy_(new_lse)


# --------------------------------------------------------------------------- autograd
#
# Every tile pair's results are dropped as soon as they are merged or added (the helpers'
# locals), and the K/V pool before the dK/dV result is assembled (the passes' locals).


_MATH = _MathKernel()


def _forward_tile(kernel, q, k, v, out, lse, causal: bool, scale: float, mask: Optional[torch.Tensor] = None):
    """Attend one query tile to one K/V tile, merge into ``out``/``lse``; the kernel's state for backward."""
    if mask is None:
        tile_out, tile_lse, aux = kernel.forward(q, k, v, causal, scale)
        _merge(out, lse, tile_out, tile_lse)
        return aux
    kernel = kernel if kernel.takes_masks else _MATH
    tile_out, tile_lse, aux = kernel.forward(q, k, v, causal, scale, mask)
    # A row the tile hides wholly: some kernels return log-sum-exp 0 for it, which would weigh in.
    tile_lse = tile_lse.masked_fill(~mask.any(-1).expand_as(tile_lse), -math.inf)
    _merge_masked(out, lse, tile_out, tile_lse)
    return aux


def _backward_tile(kernel, dout, q, k, v, out, lse, aux, causal: bool, scale: float, dq, grads, owner: int, tile: int,
                   mask: Optional[torch.Tensor] = None):
    """Gradients of one query tile / K/V tile pair, added into ``dq`` and the K/V tile's partial sums."""
    if mask is None:
        dq_tile, dk_tile, dv_tile = kernel.backward(dout, q, k, v, out, lse, aux, causal, scale)
    else:
        kernel = kernel if kernel.takes_masks else _MATH
        dq_tile, dk_tile, dv_tile = kernel.backward(dout, q, k, v, out, lse, aux, causal, scale, mask)
    dq.add_(dq_tile)
    dkv = grads.target(owner, tile)  # after the kernel, so a partial sum still arriving overlaps it
    dkv[0].add_(dk_tile)
    dkv[1].add_(dv_tile)


def _forward_pass(q, k, v, group, is_causal: bool, scale: float, comm: str, kernel, mask=None):
    rank, size = dist.get_rank(group), dist.get_world_size(group)
    tiles = _mask_tiles(q.size(2), mask)
    out = torch.zeros(q.shape, dtype=torch.float32, device=q.device)
    lse = torch.full(q.shape[:-1], -math.inf, dtype=torch.float32, device=q.device)
    auxes = []
    for owner, j, k_tile, v_tile in STREAMS[comm][0](k, v, group, tiles):
        for i, causal, seen in _pairs(rank, owner, j, tiles, size, is_causal, mask, q.device):
            rows = tiles[i]
            q_tile, out_tile, lse_tile = q[:, :, rows], out[:, :, rows], lse[:, :, rows]
            auxes.append(_forward_tile(kernel, q_tile, k_tile, v_tile, out_tile, lse_tile, causal, scale, seen))
    return out, lse, auxes


def _backward_pass(ctx: Any, dout, q, k, v, out, lse, dq, grads) -> None:
    rank, size = dist.get_rank(ctx.group), dist.get_world_size(ctx.group)
    tiles = grads.tiles
    auxes = iter(ctx.auxes)
    for owner, j, k_tile, v_tile in STREAMS[ctx.comm][0](k, v, ctx.group, tiles):
        for i, causal, seen in _pairs(rank, owner, j, tiles, size, ctx.is_causal, ctx.mask, q.device):
            rows = tiles[i]
            _backward_tile(
                ctx.kernel,
                dout[:, :, rows],
                q[:, :, rows],
                k_tile,
                v_tile,
                out[:, :, rows],
                lse[:, :, rows],
                next(auxes),
                causal,
                ctx.scale,
                dq[:, :, rows],
                grads,
                owner,
                j,
                seen,
            )
        grads.done(owner, j)


class _RingAttention(torch.autograd.Function):
    """Forward merges tiles by log-sum-exp; backward recomputes each tile pair against the
    saved final output/log-sum-exp and returns dK/dV to their owners."""

    @staticmethod
    def forward(ctx: Any, q, k, v, group, is_causal: bool, scale: float, comm: str, kernel, mask=None):
        out, lse, auxes = _forward_pass(q, k, v, group, is_causal, scale, comm, kernel, mask)
        out = out.to(q.dtype)
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.group, ctx.is_causal, ctx.scale, ctx.comm, ctx.kernel, ctx.auxes, ctx.mask = (
            group, is_causal, scale, comm, kernel, auxes, mask
        )
        return out

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx: Any, dout):
        q, k, v, out, lse = ctx.saved_tensors
        if ctx.mask is not None:  # a query that saw no key: +inf makes every probability of its row 0
            lse = lse.masked_fill(lse == -math.inf, math.inf)
        # fp32 accumulation; for fp32 inputs it is the returned gradient itself.
        dq = torch.zeros(q.shape, dtype=torch.float32, device=q.device)
        grads = STREAMS[ctx.comm][1](k, ctx.group, _mask_tiles(q.size(2), ctx.mask))
        _backward_pass(ctx, dout.contiguous(), q, k, v, out, lse, dq, grads)
        dkv = grads.result()
        return dq.to(q.dtype), dkv[0].to(k.dtype), dkv[1].to(v.dtype), None, None, None, None, None, None


def _validate(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, is_causal: bool, comm: str) -> None:
    if comm not in STREAMS:
        raise ValueError(f"unknown comm mode {comm!r}; use one of {tuple(STREAMS)}")
    for name, t in (("q", q), ("k", k), ("v", v)):
        if t.dim() != 4:
            raise ValueError(f"{name} must be [batch, heads, seq, head_dim], got shape {tuple(t.shape)}")
    if k.shape != v.shape:
        raise ValueError(f"k and v must have the same shape, got {tuple(k.shape)} and {tuple(v.shape)}")
    if q.size(0) != k.size(0) or q.size(2) != k.size(2) or q.size(3) != k.size(3):
        raise ValueError(
            f"q {tuple(q.shape)} and k/v {tuple(k.shape)} must agree on batch, local sequence "
            f"length and head_dim (only the head count may differ)"
        )
    if q.size(1) % k.size(1):
        raise ValueError(
            f"query heads ({q.size(1)}) must be a multiple of key/value heads ({k.size(1)}) "
            f"for grouped-query attention; choose a K/V head count that divides {q.size(1)}"
        )
    if q.dtype != k.dtype or q.dtype != v.dtype or q.device != k.device or q.device != v.device:
        raise ValueError(
            f"q, k, v must share dtype and device, got {q.dtype}/{k.dtype}/{v.dtype} "
            f"on {q.device}/{k.device}/{v.device}"
        )
    if is_causal and q.size(2) % 2:
        raise ValueError(
            f"local sequence length {q.size(2)} is odd, but causal ring attention needs the "
            f"zigzag layout (two equal chunks per rank); make the global length a multiple of "
            f"2*cp and shard it with shard_sequence"
        )


def ring_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    *,
    group: dist.ProcessGroup | None,
    is_causal: bool = False,
    scale: float | None = None,
    comm: str = "ring",
    mask: Optional[SequenceMask] = None,
) -> torch.Tensor:
    """Exact attention of the local queries over the whole context-parallel sequence.

    ``q`` is [B, Hq, S, D], ``k``/``v`` are [B, Hkv, S, D] with ``Hq % Hkv == 0``: this
    rank's shards of a length ``L = S * cp`` sequence, where ``cp`` is the size of
    ``group`` (``None``: the default group). For ``is_causal`` the shards must be in the
    zigzag layout of :func:`shard_sequence` and masking uses global positions; without
    masking any layout works, and a mask's ``layout`` names another (a document-balanced one).
    ``scale`` defaults to ``1/sqrt(D)``.

    ``comm="ring"`` passes K/V round the group with P2P overlapped with compute (memory
    stays O(S)); ``comm="allgather"`` gathers all K/V once (O(L) memory, fewer and larger
    messages). ``mask``: a :class:`SequenceMask` (padding, sliding window, packed documents) in place of
    ``is_causal``, over zigzag shards. Returns [B, Hq, S, D] in the input dtype; differentiable w.r.t. q, k, v.
    """
    _validate(q, k, v, is_causal, comm)
    if mask is not None and is_causal:
        raise ValueError("ring_attention: pass either is_causal=True or a SequenceMask (with causal=True), not both")
    if group is None:
        group = dist.group.WORLD
    if mask is not None:
        check_mask(mask, q, dist.get_world_size(group))
    if scale is None:
        scale = 1.0 / math.sqrt(q.size(-1))
    return _RingAttention.apply(q, k, v, group, is_causal, scale, comm, _select_kernel(q, is_causal), mask)

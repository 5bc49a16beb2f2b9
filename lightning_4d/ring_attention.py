"""Context-parallel (ring) attention over a load-balanced zigzag sequence layout.

Each of the ``cp`` ranks of a context-parallel group holds ``S = L / cp`` tokens of
every sequence. With causal masking a contiguous split would give the last rank
almost all of the work, so the sequence is cut into ``2 * cp`` equal chunks and
rank ``r`` holds chunks ``r`` and ``2 * cp - 1 - r`` (the "zigzag" layout): every
rank then sees the same amount of unmasked attention.

The attention itself is computed block by block (local queries against one rank's
K/V at a time) and the partial results are merged exactly with their log-sum-exp,
so the output equals full attention over the whole sequence. Pure
``torch.distributed``; no Lightning needed.
"""

from __future__ import annotations

import math
from typing import Any

import torch
import torch.distributed as dist

__all__ = ["ring_attention", "shard_sequence", "unshard_sequence", "zigzag_positions"]

_COMM_MODES = ("ring", "allgather")
# K/V and dK/dV exchanges can be in flight at the same time between the same peers;
# separate tags keep them from being matched with each other.
_KV_TAG = 0
_GRAD_TAG = 1



# --------------------------------------------------------------------------- layout


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
        below = (seq_len // n_chunks) * n_chunks
        above = below + n_chunks
        nearest = f"{below} or {above}" if below > 0 else f"{above}"
        raise ValueError(
            f"sequence length {seq_len} is not a positive multiple of 2*cp = {n_chunks} "
            f"(zigzag context parallelism needs 2 equal chunks per cp rank); "
            f"pad or truncate it to {nearest}"
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


# --------------------------------------------------------------------------- local kernels
#
# A kernel computes attention of some queries against one K/V block and returns the
# output, the fp32 log-sum-exp [B, Hq, Sq] that the merge needs, and whatever opaque
# state its backward wants back. Its backward is handed the *final* (merged) output and
# log-sum-exp, which makes the per-block gradients exact without any extra correction.


class _CpuFlashKernel:
    """ATen's CPU flash attention; handles grouped K/V heads natively."""

    def forward(self, q, k, v, causal, scale):
        out, lse = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(q, k, v, 0.0, causal, scale=scale)
        return out, lse, None

    def backward(self, dout, q, k, v, out, lse, aux, causal, scale):
        return torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward(
            dout, q, k, v, out, lse, 0.0, causal, scale=scale
        )


class _MathKernel:
    """Plain fp32 matmul attention: the fallback when no fused kernel fits.

    Grouped K/V heads are handled by viewing queries as [B, Hkv, group, S, D] and
    broadcasting K/V over the group instead of repeating them per query head.
    """

    def _probs(self, q5, k, lse5, causal, scale):
        scores = (q5.float() @ k.float().unsqueeze(2).transpose(-1, -2)) * scale
        if causal:
            mask = torch.ones(scores.shape[-2:], dtype=torch.bool, device=scores.device).triu(1)
            scores = scores.masked_fill(mask, float("-inf"))
        if lse5 is None:
            lse5 = scores.logsumexp(dim=-1)
        return (scores - lse5.unsqueeze(-1)).exp(), lse5

    def forward(self, q, k, v, causal, scale):
        q5 = q.unflatten(1, (k.size(1), -1))
        probs, lse5 = self._probs(q5, k, None, causal, scale)
        out = probs @ v.float().unsqueeze(2)
        return out.flatten(1, 2).to(q.dtype), lse5.flatten(1, 2), None

    def backward(self, dout, q, k, v, out, lse, aux, causal, scale):
        groups = (k.size(1), -1)
        q5, dout5, out5 = (t.unflatten(1, groups).float() for t in (q, dout, out))
        probs, _ = self._probs(q5, k, lse.unflatten(1, groups), causal, scale)
        dv = (probs.transpose(-1, -2) @ dout5).sum(2)
        dprobs = dout5 @ v.float().unsqueeze(2).transpose(-1, -2)
        dscores = probs * (dprobs - (dout5 * out5).sum(-1, keepdim=True)) * scale
        dq = dscores @ k.float().unsqueeze(2)
        dk = (dscores.transpose(-1, -2) @ q5).sum(2)
        return dq.flatten(1, 2).to(q.dtype), dk.to(k.dtype), dv.to(v.dtype)


class _CudaKernel:
    """Shared plumbing for the fused CUDA kernels (not exercised by the CPU test suite).

    They want equal head counts and contiguous inputs, so K/V are expanded per block
    (only locally, after communication) and their gradients folded back.
    """

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
            torch.ops.aten._scaled_dot_product_flash_attention(q, k, v, 0.0, causal, False, scale=scale)
        )
        return out, lse, (cum_q, cum_k, max_q, max_k, rng_state, unused)

    def _backward(self, dout, q, k, v, out, lse, aux, causal, scale):
        cum_q, cum_k, max_q, max_k, rng_state, unused = aux
        return torch.ops.aten._scaled_dot_product_flash_attention_backward(
            dout, q, k, v, out, lse, cum_q, cum_k, max_q, max_k, 0.0, causal, rng_state, unused, scale=scale
        )


class _CudaEfficientKernel(_CudaKernel):
    """Memory-efficient kernel; it pads its log-sum-exp to a multiple of 32 rows."""

    def _forward(self, q, k, v, causal, scale):
        out, lse, seed, offset = torch.ops.aten._scaled_dot_product_efficient_attention(
            q, k, v, None, True, 0.0, causal, scale=scale
        )
        return out, lse[..., : q.size(2)], (seed, offset)

    def _backward(self, dout, q, k, v, out, lse, aux, causal, scale):
        seed, offset = aux
        padded = torch.nn.functional.pad(lse, (0, -lse.size(-1) % 32))
        dq, dk, dv, _ = torch.ops.aten._scaled_dot_product_efficient_attention_backward(
            dout, q, k, v, None, out, padded, seed, offset, 0.0, [True, True, True, False], causal, scale=scale
        )
        return dq, dk, dv


def _select_kernel(q: torch.Tensor, is_causal: bool):
    """Fastest local kernel that also returns the log-sum-exp for this device and dtype."""
    if q.device.type == "cpu":
        return _CpuFlashKernel()
    if q.device.type == "cuda":
        # Checked on a same-head-count stand-in: K/V get expanded per block before the call.
        params = torch.backends.cuda.SDPAParams(q, q, q, None, 0.0, is_causal, False)
        if torch.backends.cuda.can_use_flash_attention(params):
            return _CudaFlashKernel()
        if torch.backends.cuda.can_use_efficient_attention(params):
            return _CudaEfficientKernel()
    return _MathKernel()


# --------------------------------------------------------------------------- block schedule


def _block_plan(q_rank: int, kv_rank: int, is_causal: bool, seq: int) -> tuple[slice, slice, bool]:
    """Which local query rows attend to which rows of ``kv_rank``'s block, and whether causally.

    With zigzag chunks (q: r, 2cp-1-r; kv: j, 2cp-1-j) each chunk pair is fully visible,
    fully masked or diagonal. Off-diagonal blocks reduce to one fully visible rectangle of
    half the block: all queries vs. the first K/V chunk (j < r) or the second query chunk
    vs. all keys (j > r), so every rank does the same work at every step.
    """
    everything = slice(None)
    if not is_causal:
        return everything, everything, False
    half = seq // 2
    if kv_rank == q_rank:
        return everything, everything, True
    if kv_rank < q_rank:
        return everything, slice(0, half), False
    return slice(half, None), everything, False


def _merge(out: torch.Tensor, lse: torch.Tensor, block_out: torch.Tensor, block_lse: torch.Tensor) -> None:
    """Fold one block's softmax-normalised result into the running (fp32) one, in place."""
    new_lse = torch.logaddexp(lse, block_lse)
    out.mul_((lse - new_lse).exp_().unsqueeze(-1))
    out.add_(block_out.float() * (block_lse - new_lse).exp_().unsqueeze(-1))
    lse.copy_(new_lse)


# --------------------------------------------------------------------------- communication


def _ring_shift(send: torch.Tensor, recv: torch.Tensor, group, tag: int) -> list:
    """Send to the next cp rank and receive from the previous one, asynchronously."""
    rank, size = dist.get_rank(group), dist.get_world_size(group)
    nxt = dist.get_global_rank(group, (rank + 1) % size)
    prv = dist.get_global_rank(group, (rank - 1) % size)
    return dist.batch_isend_irecv(
        [
            dist.P2POp(dist.isend, send, nxt, group, tag),
            dist.P2POp(dist.irecv, recv, prv, group, tag),
        ]
    )


def _visit_kv(kv: torch.Tensor, group, comm: str):
    """Yield ``(owner cp rank, stacked [K, V] block)`` for every rank, own block first.

    The transfer of the next block is in flight while the caller computes on the
    current one (ring: P2P shift; allgather: the gather runs under the local block).
    """
    rank, size = dist.get_rank(group), dist.get_world_size(group)
    if comm == "allgather":
        gathered = kv.new_empty((size * kv.size(0), *kv.shape[1:]))
        work = dist.all_gather_single(gathered, kv, group=group, async_op=True)
        yield rank, kv
        work.wait()
        blocks = gathered.unflatten(0, (size, kv.size(0)))
        for step in range(1, size):
            owner = (rank - step) % size
            yield owner, blocks[owner]
        return
    current, spare = kv, torch.empty_like(kv)
    for step in range(size):
        works = _ring_shift(current, spare, group, _KV_TAG) if step < size - 1 else []
        yield (rank - step) % size, current
        for work in works:
            work.wait()
        current, spare = spare, current


class _RingGrads:
    """dK/dV partial sums that travel with their K/V block and reach the owner after a full cycle."""

    def __init__(self, kv: torch.Tensor, group):
        self.group = group
        self.size = dist.get_world_size(group)
        # fp32 so low-precision gradients are summed over cp ranks without extra rounding.
        self.acc = torch.zeros(kv.shape, dtype=torch.float32, device=kv.device)
        self.spare = torch.empty_like(self.acc)
        self.works: list = []

    def add(self, owner: int, rows: slice, dk: torch.Tensor, dv: torch.Tensor) -> None:
        for work in self.works:
            work.wait()  # ``acc`` now holds owner's partial sum from the previous rank
        self.acc[0][:, :, rows] += dk
        self.acc[1][:, :, rows] += dv
        if self.size > 1:
            self.works = _ring_shift(self.acc, self.spare, self.group, _GRAD_TAG)
            self.acc, self.spare = self.spare, self.acc

    def result(self) -> torch.Tensor:
        for work in self.works:
            work.wait()
        return self.acc


class _GatheredGrads:
    """dK/dV for every rank's block, summed onto their owners with one reduce-scatter."""

    def __init__(self, kv: torch.Tensor, group):
        self.group = group
        self.size = dist.get_world_size(group)
        self.kv_shape = kv.shape
        self.acc = torch.zeros((self.size, *kv.shape), dtype=torch.float32, device=kv.device)

    def add(self, owner: int, rows: slice, dk: torch.Tensor, dv: torch.Tensor) -> None:
        self.acc[owner, 0][:, :, rows] += dk
        self.acc[owner, 1][:, :, rows] += dv

    def result(self) -> torch.Tensor:
        mine = self.acc.new_empty(self.kv_shape)
        dist.reduce_scatter_single(mine, self.acc.flatten(0, 1), group=self.group)
        return mine


# --------------------------------------------------------------------------- autograd


class _RingAttention(torch.autograd.Function):
    """Forward merges blocks by log-sum-exp; backward recomputes each block against the
    saved final output/log-sum-exp and returns dK/dV to their owners."""

    @staticmethod
    def forward(ctx: Any, q, k, v, group, is_causal: bool, scale: float, comm: str, kernel):
        seq = q.size(2)
        rank = dist.get_rank(group)
        out = torch.empty(q.shape, dtype=torch.float32, device=q.device)
        lse = torch.empty(q.shape[:-1], dtype=torch.float32, device=q.device)
        auxes = []
        for step, (owner, kv) in enumerate(_visit_kv(torch.stack([k, v]), group, comm)):
            q_rows, kv_rows, causal = _block_plan(rank, owner, is_causal, seq)
            block_out, block_lse, aux = kernel.forward(
                q[:, :, q_rows], kv[0][:, :, kv_rows], kv[1][:, :, kv_rows], causal, scale
            )
            auxes.append(aux)
            if step == 0:  # own block: always covers every query row
                out.copy_(block_out)
                lse.copy_(block_lse)
            else:
                _merge(out[:, :, q_rows], lse[:, :, q_rows], block_out, block_lse)
        out = out.to(q.dtype)
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.group, ctx.is_causal, ctx.scale, ctx.comm, ctx.kernel, ctx.auxes = (
            group, is_causal, scale, comm, kernel, auxes
        )
        return out

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx: Any, dout):
        q, k, v, out, lse = ctx.saved_tensors
        group, kernel = ctx.group, ctx.kernel
        dout = dout.contiguous()
        seq, rank = q.size(2), dist.get_rank(group)
        kv = torch.stack([k, v])
        dq = torch.zeros(q.shape, dtype=torch.float32, device=q.device)
        grads = (_RingGrads if ctx.comm == "ring" else _GatheredGrads)(kv, group)
        for (owner, kv_block), aux in zip(_visit_kv(kv, group, ctx.comm), ctx.auxes):
            q_rows, kv_rows, causal = _block_plan(rank, owner, ctx.is_causal, seq)
            dq_block, dk_block, dv_block = kernel.backward(
                dout[:, :, q_rows],
                q[:, :, q_rows],
                kv_block[0][:, :, kv_rows],
                kv_block[1][:, :, kv_rows],
                out[:, :, q_rows],
                lse[:, :, q_rows],
                aux,
                causal,
                ctx.scale,
            )
            dq[:, :, q_rows] += dq_block
            grads.add(owner, kv_rows, dk_block, dv_block)
        dkv = grads.result()
        return dq.to(q.dtype), dkv[0].to(k.dtype), dkv[1].to(v.dtype), None, None, None, None, None


def _validate(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, is_causal: bool, comm: str) -> None:
    if comm not in _COMM_MODES:
        raise ValueError(f"unknown comm mode {comm!r}; use one of {_COMM_MODES}")
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
) -> torch.Tensor:
    """Exact attention of the local queries over the whole context-parallel sequence.

    ``q`` is [B, Hq, S, D], ``k``/``v`` are [B, Hkv, S, D] with ``Hq % Hkv == 0``: this
    rank's shards of a length ``L = S * cp`` sequence, where ``cp`` is the size of
    ``group`` (``None``: the default group). For ``is_causal`` the shards must be in the
    zigzag layout of :func:`shard_sequence` and masking uses global positions; without
    masking any layout works. ``scale`` defaults to ``1/sqrt(D)``.

    ``comm="ring"`` passes K/V round the group with P2P overlapped with compute (memory
    stays O(S)); ``comm="allgather"`` gathers all K/V once (O(L) memory, fewer and larger
    messages). Returns [B, Hq, S, D] in the input dtype; differentiable w.r.t. q, k, v.
    """
    _validate(q, k, v, is_causal, comm)
    if group is None:
        group = dist.group.WORLD
    if scale is None:
        scale = 1.0 / math.sqrt(q.size(-1))
    return _RingAttention.apply(q, k, v, group, is_causal, scale, comm, _select_kernel(q, is_causal))

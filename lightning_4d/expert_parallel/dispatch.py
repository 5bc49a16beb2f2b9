"""Tokens to the ranks holding their experts and back, two ways. Both are dropless: every (token, expert) pair is
computed, so each token's output does not depend on where its experts live, and the layout matches one process.

* :class:`GatheredDispatch` (fused 3-D experts): every rank of the group gathers the group's tokens and their
  routing, runs its own experts on the pairs routed to them as one grouped matmul over a buffer sized for the
  worst case (the groups' bounds stay on the device), and the weighted sums go back by reduce-scatter. Every
  size is known before the step, so the host never waits for the device. The price: each rank receives all
  ``ep x T`` tokens where an all-to-all would carry about ``T x top_k`` pairs (``ep / top_k`` times the traffic),
  and the pair buffer holds ``ep x T x min(top_k, E/ep)`` rows.
* :class:`AllToAllDispatch` (hand-written experts, which run one expert at a time on the rows each received, as
  their own forward does): an all-to-all of counts, then of tokens (the backward is the reverse all-to-all).
  c10d takes its split sizes as Python integers, so each layer reads its counts on the host.
"""

from __future__ import annotations

import functools
from collections.abc import Callable

import torch
import torch.distributed as dist
from torch import Tensor

from lightning_4d import _compat as compat


class _AllToAll(torch.autograd.Function):
    """Rows of ``x`` split by ``send`` to each rank of ``group``; ``receive`` rows arrive from each."""

    @staticmethod
    def forward(ctx, x: Tensor, send: list[int], receive: list[int], dispatch: AllToAllDispatch) -> Tensor:
        ctx.send, ctx.receive, ctx.dispatch = send, receive, dispatch
        return dispatch.exchange(x, send, receive)

    @staticmethod
    def backward(ctx, grad: Tensor) -> tuple[Tensor, None, None, None]:
        return ctx.dispatch.exchange(grad, ctx.receive, ctx.send), None, None, None


class AllToAllDispatch:
    """Dispatch and combine over one expert group of ``ep`` ranks, each holding ``local`` consecutive experts."""

    def __init__(self, group: dist.ProcessGroup, ep: int, local: int) -> None:
        self.group, self.ep, self.local = group, ep, local
        self.sent_bytes = 0  # what this rank sent to the others of its group (counts and tokens), since creation

    def exchange(self, x: Tensor, send: list[int], receive: list[int]) -> Tensor:
        x = x.contiguous()
        out = x.new_empty((sum(receive), *x.shape[1:]))
        rank = dist.get_rank(self.group)
        self.sent_bytes += (sum(send) - send[rank]) * x[0].numel() * x.element_size() if len(x) else 0
        dist.all_to_all_single(out, x, output_split_sizes=receive, input_split_sizes=send, group=self.group)
        return out

    def __call__(self, hidden: Tensor, top_k_index: Tensor, top_k_weights: Tensor,
                 compute: Callable[[Tensor, Tensor], Tensor]) -> Tensor:
        tokens, k = top_k_index.shape
        experts = self.ep * self.local
        chosen = top_k_index.reshape(-1)
        order = torch.argsort(chosen, stable=True)  # (token, expert) pairs grouped by expert, so by rank
        token_of = order // k
        per_expert = torch.bincount(chosen, minlength=experts)
        # how many pairs each rank sends this rank for each of its local experts: [source rank, local expert]
        arriving = torch.empty_like(per_expert)
        self.sent_bytes += (self.ep - 1) * self.local * per_expert.element_size()
        dist.all_to_all_single(arriving, per_expert, group=self.group)
        arriving = arriving.view(self.ep, self.local)
        send = per_expert.view(self.ep, self.local).sum(1).tolist()
        receive = arriving.sum(1).tolist()
        received = _AllToAll.apply(hidden[token_of], send, receive, self)
        local_expert = torch.arange(self.local, device=hidden.device).repeat(self.ep).repeat_interleave(
            arriving.reshape(-1))
        out = compute(received, local_expert)
        back = _AllToAll.apply(out, receive, send, self)
        weighted = back * top_k_weights.reshape(-1)[order].unsqueeze(-1).to(back.dtype)
        return torch.zeros_like(hidden).index_add(0, token_of, weighted.to(hidden.dtype))


# (rows [N, H] sorted by local expert, offsets [E/ep] int32: each expert's end row, valid [N, 1]) -> [N, H]:
# this rank's experts on their rows, unweighted; rows at or past offsets[-1] are padding (their values ignored).
GroupedCompute = Callable[[Tensor, Tensor, Tensor], Tensor]


class GatheredDispatch:
    """Dispatch and combine over one expert group of ``ep`` ranks, each holding ``local`` consecutive experts,
    with sizes fixed before the step (see the module docstring)."""

    def __init__(self, group: dist.ProcessGroup, ep: int, local: int) -> None:
        self.group, self.ep, self.local = group, ep, local
        self.first = dist.get_rank(group) * local  # this rank's first expert
        self.sent_bytes = 0  # what this rank sent to the others of its group, forward and backward, since creation

    def __call__(self, hidden: Tensor, top_k_index: Tensor, top_k_weights: Tensor, compute: GroupedCompute) -> Tensor:
        tokens, k = top_k_index.shape
        everyone = compat.all_gather_in_stream(hidden.contiguous(), self.group, differentiable=True)
        chosen = compat.all_gather_in_stream(top_k_index.contiguous(), self.group).reshape(-1)
        weights = compat.all_gather_in_stream(top_k_weights.contiguous(), self.group, differentiable=True)
        peers, states = self.ep - 1, hidden.numel() * hidden.element_size()
        scores = top_k_weights.numel() * top_k_weights.element_size()
        self.sent_bytes += peers * (states + top_k_index.numel() * top_k_index.element_size() + scores)
        mine = chosen - self.first
        # each pair's local expert, or ``local`` (sorted last) for a pair another rank computes
        expert = torch.where((mine >= 0) & (mine < self.local), mine, self.local)
        capacity = self.ep * tokens * min(k, self.local)  # the most pairs this rank can be sent
        order = torch.argsort(expert, stable=True)[:capacity]
        per_expert = torch.zeros(self.local + 1, dtype=torch.int64, device=expert.device)
        per_expert.scatter_add_(0, expert, torch.ones_like(expert))
        offsets = per_expert[:self.local].cumsum(0).to(torch.int32)
        valid = (torch.arange(capacity, device=expert.device) < offsets[-1]).unsqueeze(1)
        token = order // k
        rows = torch.where(valid, everyone[token], 0)  # padding rows are zeros, and pass no gradient back
        out = torch.where(valid, compute(rows, offsets, valid), 0)
        weighted = out * weights.reshape(-1)[order].unsqueeze(1).to(out.dtype)
        summed = torch.zeros_like(everyone).index_add(0, token, weighted.to(everyone.dtype))
        combined = compat.reduce_scatter_in_stream(summed, self.group)
        self.sent_bytes += peers * states
        if combined.requires_grad:  # counted when the backward runs: once, also when checkpointing recomputes
            backward = peers * (states * (1 + hidden.requires_grad) + scores * top_k_weights.requires_grad)
            combined.register_hook(functools.partial(self._sent_backward, backward))
        return combined

    def _sent_backward(self, sent: int, grad: Tensor) -> None:
        """The backward's traffic: the combined gradient gathered, the tokens' and weights' scattered back."""
        self.sent_bytes += sent

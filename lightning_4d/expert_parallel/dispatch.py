"""Tokens to the rank holding their expert and back: an all-to-all of counts, then of tokens (autograd: the
backward is the reverse all-to-all), the experts run on what arrived, and the results return in the order sent.
Dropless: every (token, expert) pair is computed, so each token's output does not depend on where its experts
live, and the layout matches one process."""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.distributed as dist
from torch import Tensor


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

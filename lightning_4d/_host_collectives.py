"""Collectives of CPU tensors (gloo) through c10d, for ``_compat``'s ``*_in_stream`` functions.

torch's functional collectives on gloo now and then corrupt the heap ("malloc(): unaligned tcache chunk
detected", "free(): invalid pointer": SIGABRT; or SIGSEGV) or lose a message (a timeout): 6 of 20 launches of 1000
ep=2 steps failed through them on torch 2.13, 0 of 20 through these (tests/expert_parallel_stress.py,
docs/troubleshooting.md). Their point, a wait the device stream makes instead of the host, has no use on gloo,
which runs every collective on the host: CPU tensors take c10d's collectives, launched asynchronously and waited
for at once. Only public c10d calls; the choice between the two paths stays in ``_compat``.
"""

from __future__ import annotations

from typing import Any, Callable

import torch
import torch.distributed as dist

REDUCE_OPS = {"sum": dist.ReduceOp.SUM, "max": dist.ReduceOp.MAX, "min": dist.ReduceOp.MIN}


def on_host(tensor: torch.Tensor) -> bool:
    """A CPU tensor: its collective runs on gloo, through c10d (see above)."""
    return tensor.device.type == "cpu"


def reduced(tensor: torch.Tensor, op: str, group: Any) -> torch.Tensor:
    """``tensor`` reduced over ``group`` (``op``: "sum", "max", "min") as a new tensor."""
    out = tensor.clone()
    dist.all_reduce(out, op=REDUCE_OPS[op], group=group, async_op=True).wait()
    return out


def gathered(tensor: torch.Tensor, group: Any) -> torch.Tensor:
    """``tensor`` gathered over ``group`` along dim 0, in rank order."""
    tensor = tensor.contiguous()
    out = tensor.new_empty((dist.get_world_size(group) * tensor.shape[0], *tensor.shape[1:]))
    dist.all_gather_single(out, tensor, group=group, async_op=True).wait()
    return out


def scattered(tensor: torch.Tensor, group: Any) -> torch.Tensor:
    """``tensor`` summed over ``group``, this rank keeping its block of dim 0."""
    tensor = tensor.contiguous()
    out = tensor.new_empty((tensor.shape[0] // dist.get_world_size(group), *tensor.shape[1:]))
    dist.reduce_scatter_single(out, tensor, group=group, async_op=True).wait()
    return out


def exchanged(tensor: torch.Tensor, group: Any) -> torch.Tensor:
    """Equal chunks of ``tensor``'s dim 0 exchanged over ``group`` (chunk ``j`` to rank ``j``)."""
    tensor = tensor.contiguous()
    out = torch.empty_like(tensor)
    dist.all_to_all_single(out, tensor, group=group, async_op=True).wait()
    return out


class Differentiable(torch.autograd.Function):
    """A collective of CPU tensors (``there``) whose backward is another (``back``, the gradient's way back)."""

    @staticmethod
    def forward(ctx, tensor: torch.Tensor, group: Any, there: Callable, back: Callable) -> torch.Tensor:
        ctx.group, ctx.back = group, back
        return there(tensor, group)

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> tuple[torch.Tensor, None, None, None]:
        return ctx.back(grad, ctx.group), None, None, None

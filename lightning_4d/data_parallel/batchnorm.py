"""BatchNorm over the global batch, on CPU (gloo) as on GPU: ``Trainer(sync_batchnorm=True)``.

Each data-parallel replica (and each context-parallel shard) holds part of the batch, so a BatchNorm layer in
training normalizes with the statistics of its part: another model than one process, which normalizes with the
whole batch's. Lightning's ``sync_batchnorm=True`` converts the layers to torch's ``SyncBatchNorm``, which runs on
CUDA only. Here every ``BatchNorm1d/2d/3d`` in training mode computes, per channel, the count, sum and sum of
squares of what it holds, adds them over the ranks that split the batch (one all-reduce), and normalizes with the
global mean and (biased) variance; its backward adds the two per-channel sums the input gradient needs the same
way. The running statistics are updated with the global ones (unbiased variance), so every rank keeps the same.
In eval mode the layer is torch's own. The layers keep their class and parameters (checkpoints do not change):
the forward is set on each instance, and :func:`restore_batchnorm` takes it off again.
"""

from __future__ import annotations

import functools
from typing import Any, Optional

import torch
import torch.distributed as dist
from torch import Tensor, nn

_FORWARD = "forward"


BATCHNORMS = (nn.BatchNorm1d, nn.BatchNorm2d, nn.BatchNorm3d)


def batchnorm_layers(module: nn.Module) -> list[tuple[str, nn.Module]]:
    """The BatchNorm layers of ``module`` (torch's 1d, 2d and 3d), by name."""
    return [(name, m) for name, m in module.named_modules() if isinstance(m, BATCHNORMS)]


def batchnorm_statistics(module: nn.Module, splits: dict[str, int], group: dist.ProcessGroup, requested: bool,
                         warn: bool) -> None:
    """``Trainer(sync_batchnorm=True)`` (``requested``): the BatchNorm layers normalize with the statistics of the
    batch split over ``group`` (dp x cp). Without it, a model with BatchNorm whose batch is split (``splits``: the
    data-parallel and context-parallel sizes) says once (``warn``) that each rank keeps its own, as under DDP."""
    layers = batchnorm_layers(module)
    if not layers or all(size == 1 for size in splits.values()):
        return
    if requested:
        sync_batchnorm(module, group)
    elif warn:
        from lightning.fabric.utilities import rank_zero_warn

        rank_zero_warn(f"{len(layers)} BatchNorm layers ({layers[0][0]}, ...) normalize with the statistics of the"
                       f" part of the batch each rank holds ({', '.join(f'{k}={v}' for k, v in splits.items())}), as"
                       " under DDPStrategy, not the whole batch's as one process does: Trainer(sync_batchnorm=True)"
                       " gives them the whole batch's.")


def sync_batchnorm(module: nn.Module, group: dist.ProcessGroup) -> list[str]:
    """Give every BatchNorm layer of ``module`` the statistics of the batch split over ``group``; their names."""
    layers = batchnorm_layers(module)
    for _, layer in layers:
        setattr(layer, _FORWARD, functools.partial(_global_forward, layer, group))
    return [name for name, _ in layers]


def restore_batchnorm(module: nn.Module) -> None:
    """Take :func:`sync_batchnorm`'s forward off every BatchNorm layer of ``module`` again."""
    for _, layer in batchnorm_layers(module):
        if isinstance(vars(layer).get(_FORWARD), functools.partial):
            delattr(layer, _FORWARD)


def _global_forward(layer: nn.Module, group: dist.ProcessGroup, x: Tensor) -> Tensor:
    if not layer.training or dist.get_world_size(group) == 1:
        return type(layer).forward(layer, x)
    out, mean, var, count = _GlobalBatchNorm.apply(x, layer.weight, layer.bias, layer.eps, group)
    if layer.track_running_stats:
        with torch.no_grad():
            layer.num_batches_tracked.add_(1)
            momentum = (1.0 / float(layer.num_batches_tracked) if layer.momentum is None else layer.momentum)
            layer.running_mean.mul_(1 - momentum).add_(mean.detach(), alpha=momentum)
            unbiased = var.detach() * count / (count - 1).clamp(min=1)
            layer.running_var.mul_(1 - momentum).add_(unbiased, alpha=momentum)
    return out


class _GlobalBatchNorm(torch.autograd.Function):
    """Batch normalization with per-channel statistics summed over ``group``, forward and backward."""

    @staticmethod
    def forward(ctx: Any, x: Tensor, weight: Optional[Tensor], bias: Optional[Tensor], eps: float,
                group: dist.ProcessGroup) -> tuple[Tensor, Tensor, Tensor, Tensor]:
        channels, dims = x.size(1), [0, *range(2, x.dim())]
        xf = x.float()
        count = xf.new_full((1,), x.numel() // channels)
        stats = torch.cat([xf.sum(dims), (xf * xf).sum(dims), count])
        dist.all_reduce(stats, group=group)
        total = stats[-1]
        mean = stats[:channels] / total
        var = (stats[channels:2 * channels] / total - mean * mean).clamp(min=0)
        invstd = torch.rsqrt(var + eps)
        shape = [1, channels] + [1] * (x.dim() - 2)
        normalized = (xf - mean.view(shape)) * invstd.view(shape)
        out = normalized
        if weight is not None:
            out = out * weight.float().view(shape)
        if bias is not None:
            out = out + bias.float().view(shape)
        ctx.save_for_backward(normalized, invstd, weight, total)
        ctx.group, ctx.has_bias, ctx.dtype = group, bias is not None, x.dtype
        ctx.mark_non_differentiable(mean, var, total)
        return out.to(x.dtype), mean, var, total

    @staticmethod
    def backward(ctx: Any, grad: Tensor, *_: Any) -> tuple[Optional[Tensor], ...]:
        normalized, invstd, weight, total = ctx.saved_tensors
        channels, dims = grad.size(1), [0, *range(2, grad.dim())]
        shape = [1, channels] + [1] * (grad.dim() - 2)
        g = grad.float()
        sum_g, sum_g_normalized = g.sum(dims), (g * normalized).sum(dims)
        grad_weight = sum_g_normalized if weight is not None and ctx.needs_input_grad[1] else None
        grad_bias = sum_g if ctx.has_bias and ctx.needs_input_grad[2] else None
        grad_x = None
        if ctx.needs_input_grad[0]:
            both = torch.cat([sum_g, sum_g_normalized])
            dist.all_reduce(both, group=ctx.group)
            mean_g, mean_g_normalized = (both / total).split(channels)
            scale = invstd * (weight.float() if weight is not None else 1.0)
            grad_x = (scale.view(shape) * (g - mean_g.view(shape) - normalized * mean_g_normalized.view(shape)))
            grad_x = grad_x.to(ctx.dtype)
        return (grad_x, None if grad_weight is None else grad_weight.to(weight.dtype),
                None if grad_bias is None else grad_bias.to(weight.dtype if weight is not None else ctx.dtype),
                None, None)


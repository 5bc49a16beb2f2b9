"""Gradient clipping by the true global norm over a model whose parameters are mixed: DTensor shards
(tensor parallelism), plain replicated tensors, and pipeline stages that hold disjoint parameters."""

from __future__ import annotations

import math
from collections.abc import Iterable
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor, Replicate

from lightning_4d import _compat as compat

__all__ = ["clip_grad_norm_"]

# Set on a DTensor parameter whose local shard holds rows that several ranks hold alike (the k and v rows of a fused
# projection when there are fewer key/value heads than tensor-parallel ranks): [(dim, start, length, copies)], the
# rows ``start:start+length`` of ``dim`` in the shard being held by ``copies`` ranks. The norm counts them once.
REPEATED_ROWS = "_lightning_4d_repeated_rows"

@torch.no_grad()
def clip_grad_norm_(
    parameters: torch.Tensor | Iterable[torch.Tensor],
    max_norm: float,
    norm_type: float = 2.0,
    error_if_nonfinite: bool = False,
    group: dist.ProcessGroup | None = None,
    skip_in_norm: Iterable[torch.Tensor] = (),
) -> torch.Tensor:
    """Clip by the true global norm over plain and DTensor gradients; returns that norm.

    DTensor gradients count their shards once per mesh dim they are sharded on (one
    all-reduce per distinct mesh/placement); plain gradients are replicated copies and count
    once.  ``group`` (e.g. the pipeline-parallel group, whose ranks hold disjoint parameters)
    is all-reduced on top, so every rank of it must call this.  The gradients of the
    parameters in ``skip_in_norm`` are scaled but left out of the norm (a weight whose
    gradient another rank of ``group`` already counts).
    """
    params = [parameters] if isinstance(parameters, torch.Tensor) else list(parameters)
    grads = [p.grad for p in params if p.grad is not None]
    skipped = {id(p) for p in skip_in_norm}
    counted = [(p.grad, getattr(p, REPEATED_ROWS, ())) for p in params if p.grad is not None and id(p) not in skipped]
    norm_type = float(norm_type)
    inf = math.isinf(norm_type)
    device = grads[0].device if grads else torch.device("cpu")
    if group is not None and dist.get_backend(group) == "nccl" and device.type == "cpu":
        device = torch.device("cuda", torch.cuda.current_device())

    def combine(values: list[torch.Tensor]) -> torch.Tensor:
        if not values:
            return torch.zeros((), device=device)
        stacked = torch.stack([v.float().to(device) for v in values])
        return stacked.max() if inf else stacked.sum()

    def local_stat(tensors: list[torch.Tensor], weights: list[float] | None = None) -> torch.Tensor:
        norms = [torch.linalg.vector_norm(t, norm_type).float() for t in tensors]
        if inf:
            return combine(norms)
        return combine([n**norm_type * w for n, w in zip(norms, weights or [1.0] * len(norms))])

    by_layout: dict[tuple, tuple[list[torch.Tensor], list[float]]] = {}
    plain: list[torch.Tensor] = []
    for grad, repeated in counted:
        if isinstance(grad, DTensor):
            if any(p.is_partial() for p in grad.placements):
                grad = grad.redistribute(placements=[Replicate() if p.is_partial() else p for p in grad.placements])
            tensors, weights = by_layout.setdefault((grad.device_mesh, grad.placements), ([], []))
            local = grad.to_local()
            tensors.append(local)
            weights.append(1.0)
            for dim, start, length, copies in repeated:  # count once what `copies` ranks hold alike
                tensors.append(local.narrow(dim, start, length))
                weights.append(1 / copies - 1)
        else:
            plain.append(grad)
    # Functional all-reduces, waited for on the device where the norm is used: the host never waits for them.
    op = "max" if inf else "sum"
    stats = [local_stat(plain)]
    for (mesh, placements), (tensors, weights) in by_layout.items():
        stat = local_stat(tensors, weights)
        for mesh_dim, placement in enumerate(placements):
            # Split over this mesh dim: Shard, and the strided shard FSDP puts over a tensor-parallel shard (whose
            # is_shard() is False). Partial placements were made Replicate above.
            if not placement.is_replicate():
                stat = compat.all_reduce_in_stream(stat, op, mesh.get_group(mesh_dim))
        stats.append(stat)
    total = combine(stats)
    if group is not None:
        total = compat.all_reduce_in_stream(total, op, group)
    total = total if inf else total ** (1.0 / norm_type)
    if error_if_nonfinite and not torch.isfinite(total):
        raise RuntimeError(f"The total norm of order {norm_type} for gradients is non-finite, so it cannot be clipped.")
    coef = (max_norm / (total + 1e-6)).clamp(max=1.0)
    for grad in grads:
        grad.mul_(coef.to(grad.device))
    return total


def install_clipping(plugin: Any, parallel: Any, whole_model: bool) -> None:
    """Clipping on Lightning's precision ``plugin`` (``gradient_clip_val`` and ``self.clip_gradients``) that refuses
    gradients a blocked manual backward left unsynchronized (``parallel.check_synchronized``) and, when the model is
    split (``whole_model``: tp, pp, dp_shard or ep), clips by the norm over the whole model with
    ``parallel.clip_grad_norm_``: Lightning's own sees this rank's shards and stage only."""
    base = type(plugin)

    def clip_grad_by_norm(optimizer: Any, clip_val: float) -> None:
        parallel.check_synchronized("clip_gradients")
        if whole_model:
            parallel.clip_grad_norm_(list(plugin.main_params(optimizer)), float(clip_val))
        else:
            base.clip_grad_by_norm(plugin, optimizer, clip_val)

    def clip_grad_by_value(optimizer: Any, clip_val: float) -> None:
        # Elementwise, so each rank clamps what it holds; one tensor at a time: torch's foreach kernels refuse a
        # list mixing tensor-parallel DTensors with plain tensors.
        parallel.check_synchronized("clip_gradients")
        torch.nn.utils.clip_grad_value_(list(plugin.main_params(optimizer)), float(clip_val), foreach=False)

    plugin.clip_grad_by_norm, plugin.clip_grad_by_value = clip_grad_by_norm, clip_grad_by_value

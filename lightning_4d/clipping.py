"""Gradient clipping by the true global norm over a model whose parameters are mixed: DTensor shards
(tensor parallelism), plain replicated tensors, and pipeline stages that hold disjoint parameters."""

from __future__ import annotations

import math
from collections.abc import Iterable

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor, Replicate

__all__ = ["clip_grad_norm_"]

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
    counted = [p.grad for p in params if p.grad is not None and id(p) not in skipped]
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

    def local_stat(tensors: list[torch.Tensor]) -> torch.Tensor:
        norms = [torch.linalg.vector_norm(t, norm_type).float() for t in tensors]
        return combine(norms if inf else [n**norm_type for n in norms])

    by_layout: dict[tuple, list[torch.Tensor]] = {}
    plain: list[torch.Tensor] = []
    for grad in counted:
        if isinstance(grad, DTensor):
            if any(p.is_partial() for p in grad.placements):
                grad = grad.redistribute(placements=[Replicate() if p.is_partial() else p for p in grad.placements])
            by_layout.setdefault((grad.device_mesh, grad.placements), []).append(grad.to_local())
        else:
            plain.append(grad)
    op = dist.ReduceOp.MAX if inf else dist.ReduceOp.SUM
    stats = [local_stat(plain)]
    for (mesh, placements), tensors in by_layout.items():
        stat = local_stat(tensors)
        for mesh_dim, placement in enumerate(placements):
            # Split over this mesh dim: Shard, and the strided shard FSDP puts over a tensor-parallel shard (whose
            # is_shard() is False). Partial placements were made Replicate above.
            if not placement.is_replicate():
                dist.all_reduce(stat, op=op, group=mesh.get_group(mesh_dim))
        stats.append(stat)
    total = combine(stats)
    if group is not None:
        dist.all_reduce(total, op=op, group=group)
    total = total if inf else total ** (1.0 / norm_type)
    if error_if_nonfinite and not torch.isfinite(total):
        raise RuntimeError(f"The total norm of order {norm_type} for gradients is non-finite, so it cannot be clipped.")
    coef = (max_norm / (total + 1e-6)).clamp(max=1.0)
    for grad in grads:
        grad.mul_(coef.to(grad.device))
    return total

"""Each fused-experts module's weights split over the ep mesh (``Shard(0)``: E/ep whole experts per rank) and
its forward set to dispatch tokens to them (:class:`~lightning_4d.experts.ExpertsForward`)."""

from __future__ import annotations

from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Shard, distribute_tensor

from lightning_4d.experts import FUSED_NAMES, ExpertsForward, find_fused_experts
from lightning_4d.expert_parallel.dispatch import AllToAllDispatch


def apply_expert_parallel(module: nn.Module, ep_mesh: DeviceMesh) -> tuple[list[nn.Parameter], list[AllToAllDispatch]]:
    """Split every fused-experts module of ``module`` over ``ep_mesh`` (1-D); returns the expert parameters (their
    gradients are reduced over the ep replicas only) and the dispatchers (their traffic counters).

    Every rank holds identical weights already (broadcast from rank 0), so each keeps its slice without
    communicating. Weights tensor parallelism sharded already (a DTensor on the tp mesh) are refused here: the
    composition passes a module whose experts ep splits first."""
    ep = ep_mesh.size()
    group = ep_mesh.get_group()
    params, dispatchers = [], []
    for fqn, found in find_fused_experts(module).items():
        experts = module.get_submodule(fqn)
        for name in FUSED_NAMES:
            param = getattr(experts, name)
            if isinstance(param, DTensor):
                raise ValueError(f"{fqn}.{name} is a DTensor already ({param.placements}): expert parallelism splits"
                                 " whole-built experts. Build the module without DTensor experts.")
            sharded = distribute_tensor(param.detach(), ep_mesh, [Shard(0)], src_data_rank=None)
            new = nn.Parameter(sharded, requires_grad=param.requires_grad)
            experts.register_parameter(name, new)
            params.append(new)
        forward = ExpertsForward.of(experts)
        forward.local_experts = found.experts // ep
        forward.grad_scale = 1.0 / ep
        forward.dispatch = AllToAllDispatch(group, ep, found.experts // ep)
        dispatchers.append(forward.dispatch)
    return params, dispatchers

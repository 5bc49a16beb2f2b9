"""Each fused-experts module's weights split over the ep mesh (``Shard(0)``: E/ep whole experts per rank) and
its forward set to dispatch tokens to them (:class:`~lightning_4d.experts.ExpertsForward`)."""

from __future__ import annotations

from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Shard, distribute_tensor

from lightning_4d.experts import FUSED_NAMES, ExpertsForward, find_fused_experts
from lightning_4d.expert_parallel.dispatch import AllToAllDispatch


def apply_expert_parallel(module: nn.Module,
                          experts_mesh: DeviceMesh) -> tuple[list[nn.Parameter], list[AllToAllDispatch]]:
    """Split every fused-experts module of ``module`` over the ``ep`` dim of ``experts_mesh`` (the layout's
    ``(ep_pp, ep_replica, ep, ep_tp)`` mesh); returns the expert parameters (their gradients are reduced over the
    ep replicas only) and the dispatchers (their traffic counters).

    Every rank holds identical weights already (broadcast from rank 0), so each keeps its slice without
    communicating. Weights tensor parallelism sharded already (a DTensor on the tp mesh, ``Shard(1|2)``) keep
    their tp slice: they become DTensors on the ``(ep, ep_tp)`` mesh, ``[Shard(0), Shard(1|2)]``."""
    ep_mesh = experts_mesh["ep"]
    ep, rank = ep_mesh.size(), ep_mesh.get_local_rank()
    params, dispatchers = [], []
    for fqn, found in find_fused_experts(module).items():
        experts = module.get_submodule(fqn)
        local = found.experts // ep
        for name in FUSED_NAMES:
            param = getattr(experts, name)
            if isinstance(param, DTensor):  # tensor parallelism's slice of every expert: keep this rank's experts
                (placement,) = param.placements
                mine = param.to_local().detach()[rank * local:(rank + 1) * local]
                sharded = DTensor.from_local(mine, experts_mesh["ep", "ep_tp"], [Shard(0), placement],
                                             run_check=False, shape=param.shape, stride=param.stride())
            else:
                sharded = distribute_tensor(param.detach(), ep_mesh, [Shard(0)], src_data_rank=None)
            new = nn.Parameter(sharded, requires_grad=param.requires_grad)
            experts.register_parameter(name, new)
            params.append(new)
        forward = ExpertsForward.of(experts)
        forward.local_experts = local
        forward.grad_scale = 1.0 / ep
        forward.dispatch = AllToAllDispatch(ep_mesh.get_group(), ep, local)
        dispatchers.append(forward.dispatch)
    return params, dispatchers

"""Each fused-experts module's weights split over the ep mesh (``Shard(0)``: E/ep whole experts per rank) and
its forward set to dispatch tokens to them (:class:`~lightning_4d.experts.ExpertsForward`)."""

from __future__ import annotations

import copy
from collections.abc import Callable

import torch
from torch import Tensor, nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Shard, distribute_tensor
from torch.func import functional_call

from lightning_4d.experts import (FUSED_NAMES, ExpertList, ExpertsForward, ScaleGrad, check_expert_list,
                                  find_expert_lists, find_fused_experts, local, route)
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
    for fqn, found in find_expert_lists(module).items():
        moe = module.get_submodule(fqn)
        routed = check_expert_list(moe, found)
        if routed is None:  # the plan's check passed on the same weights: a bug
            raise RuntimeError(f"{fqn}: its routing no longer matches the form checked before set-up; please report.")
        stacked = StackedExperts(moe.experts, ep_mesh)
        moe.experts = stacked
        params += list(stacked.parameters())
        dispatch = AllToAllDispatch(ep_mesh.get_group(), ep, found.experts // ep)
        moe.forward = _routed_forward(moe, routed, stacked, dispatch)
        dispatchers.append(dispatch)
    return params, dispatchers


def _routed_forward(moe: nn.Module, found: ExpertList, stacked: StackedExperts,
                    dispatch: AllToAllDispatch) -> Callable[[Tensor], Tensor]:
    def forward(x: Tensor) -> Tensor:
        return route(moe, found, x, lambda tokens, chosen, weights: dispatch(tokens, chosen, weights, stacked.compute))

    return forward


class StackedExperts(nn.Module):
    """A hand-written ``nn.ModuleList`` of alike experts held as this rank's E/ep of them: each parameter of the
    expert class stacked over the experts (``[E, ...]``, a DTensor ``Shard(0)`` on the ep mesh; ``.`` in its name
    becomes ``__``), run by the expert class's own forward (``torch.func.functional_call`` on a meta copy of the
    first expert). State dicts keep the ``ModuleList``'s keys (``3.gate_proj.weight``), whole on every rank."""

    def __init__(self, experts: nn.ModuleList, ep_mesh: DeviceMesh) -> None:
        super().__init__()
        template = experts[0]
        self.names = [name for name, _ in template.named_parameters()]
        self.count, self.ep = len(experts), ep_mesh.size()
        object.__setattr__(self, "template", copy.deepcopy(template).to("meta"))  # not a child: no state
        for name in self.names:
            whole = torch.stack([expert.get_parameter(name).detach() for expert in experts])
            sharded = distribute_tensor(whole, ep_mesh, [Shard(0)], src_data_rank=None)
            self.register_parameter(name.replace(".", "__"),
                                    nn.Parameter(sharded, requires_grad=template.get_parameter(name).requires_grad))
        self.register_state_dict_post_hook(_to_expert_keys)
        self.register_load_state_dict_pre_hook(_from_expert_keys)

    def compute(self, tokens: Tensor, expert: Tensor) -> Tensor:
        """This rank's experts on the tokens it received (row ``i`` to local expert ``expert[i]``), unweighted."""
        weights = {name: ScaleGrad.apply(local(getattr(self, name.replace(".", "__"))), 1.0 / self.ep)
                   for name in self.names}
        out = torch.zeros_like(tokens)
        for index in range(self.count // self.ep):
            rows = torch.where(expert == index)[0]
            own = {name: value[index] for name, value in weights.items()}
            out = out.index_add(0, rows, functional_call(self.template, own, (tokens[rows],)))
        return out


def _to_expert_keys(module: StackedExperts, state_dict: dict, prefix: str, local_metadata: dict) -> None:
    for name in module.names:
        value = state_dict.pop(prefix + name.replace(".", "__"))
        whole = value.full_tensor() if isinstance(value, DTensor) else value
        for index in range(module.count):
            state_dict[f"{prefix}{index}.{name}"] = whole[index]


def _from_expert_keys(module: StackedExperts, state_dict: dict, prefix: str, *args) -> None:
    for name in module.names:
        keys = [f"{prefix}{index}.{name}" for index in range(module.count)]
        if not all(key in state_dict for key in keys):
            continue  # strict loading names what is missing
        parts = [state_dict.pop(key) for key in keys]
        whole = torch.stack([p.full_tensor() if isinstance(p, DTensor) else p for p in parts])
        param = getattr(module, name.replace(".", "__"))
        state_dict[prefix + name.replace(".", "__")] = distribute_tensor(
            whole.to(param.device), param.device_mesh, param.placements, src_data_rank=None)

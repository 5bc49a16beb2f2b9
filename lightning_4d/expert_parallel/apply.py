"""Each fused-experts module's weights split over the ep mesh (``Shard(0)``: E/ep whole experts per rank) and
its forward set to dispatch tokens to them (:class:`~lightning_4d.modules.experts.ExpertsForward`)."""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

import torch
from torch import Tensor, nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Shard, distribute_tensor
from torch.func import functional_call

from lightning_4d.modules.experts import (FUSED_NAMES, ExpertList, ExpertsForward, ScaleGrad, check_expert_list,
                                  find_expert_lists, find_fused_experts, grouped_reproduces, local, route)
from lightning_4d.expert_parallel.dispatch import AllToAllDispatch, GatheredDispatch


def apply_expert_parallel(module: nn.Module,
                          experts_mesh: DeviceMesh) -> tuple[list[nn.Parameter], list[Any]]:
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
        if grouped_reproduces(experts, found):  # the host never waits
            dispatch, compute = GatheredDispatch(ep_mesh.get_group(), ep, local), forward.grouped
        else:  # its own arithmetic, on host-sized rows
            dispatch, compute = AllToAllDispatch(ep_mesh.get_group(), ep, local), forward.compute
        forward.dispatch = functools.partial(dispatch, compute=compute)
        dispatchers.append(dispatch)
    for fqn, found in find_expert_lists(module).items():
        moe = module.get_submodule(fqn)
        routed = check_expert_list(moe, found)
        if routed is None:  # the plan's check passed on the same weights: a bug
            raise RuntimeError(f"{fqn}: its routing no longer matches the form checked before set-up; please report.")
        stacked = StackedExperts(moe.experts, experts_mesh)
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
    becomes ``__``), run by the expert class's own forward (``torch.func.functional_call`` on the first expert,
    whose own parameters are dropped). State dicts keep the ``ModuleList``'s keys (``3.gate_proj.weight``), whole
    on every rank; :meth:`module_keys` gives the same names to optimizer state.

    Under tensor parallelism the experts arrive as MLP regions (each parameter a DTensor on the tp mesh, the
    first expert's modules carrying tp's input/output hooks): each keeps its tp slice, stacked as
    ``[Shard(0), Shard(d + 1)]`` on the ``(ep, ep_tp)`` mesh, and is handed to the expert's forward as the tp
    DTensor it was, so tp's hooks reduce each expert's output as they did before ep."""

    def __init__(self, experts: nn.ModuleList, experts_mesh: DeviceMesh) -> None:
        super().__init__()
        ep_mesh = experts_mesh["ep"]
        template = experts[0]
        self.names = [name for name, _ in template.named_parameters()]
        self.count, self.ep = len(experts), ep_mesh.size()
        rank, local_count = ep_mesh.get_local_rank(), self.count // self.ep
        self.tp_placements: dict[str, Any] = {}  # name -> (tp mesh, tp placement, whole per-expert shape)
        for name in self.names:
            first = template.get_parameter(name)
            if isinstance(first, DTensor):  # tensor parallelism's slice of every expert: keep this rank's experts
                (placement,) = first.placements
                self.tp_placements[name] = (first.device_mesh, placement, first.shape, first.stride())
                mine = torch.stack([experts[index].get_parameter(name).to_local().detach()
                                    for index in range(rank * local_count, (rank + 1) * local_count)])
                stacked_placement = Shard(placement.dim + 1) if isinstance(placement, Shard) else placement
                sharded = DTensor.from_local(mine, experts_mesh["ep", "ep_tp"], [Shard(0), stacked_placement],
                                             run_check=False, shape=(self.count, *first.shape),
                                             stride=torch.empty(self.count, *first.shape, device="meta").stride())
            else:
                whole = torch.stack([expert.get_parameter(name).detach() for expert in experts])
                sharded = distribute_tensor(whole, ep_mesh, [Shard(0)], src_data_rank=None)
            self.register_parameter(name.replace(".", "__"),
                                    nn.Parameter(sharded, requires_grad=first.requires_grad))
        for name in self.names:  # the template keeps its code and hooks, not its weights (functional_call's)
            owner, _, leaf = name.rpartition(".")
            holder = template.get_submodule(owner)
            holder.register_parameter(leaf, nn.Parameter(torch.empty(0, device="meta"), requires_grad=False))
        object.__setattr__(self, "template", template)  # not a child: no state
        self.register_state_dict_post_hook(_to_expert_keys)
        self.register_load_state_dict_pre_hook(_from_expert_keys)

    def module_keys(self) -> dict[str, list[str]]:
        """Each stacked parameter's name (relative to this module) -> the ModuleList's names of its experts."""
        return {name.replace(".", "__"): [f"{index}.{name}" for index in range(self.count)] for name in self.names}

    def _as_expert(self, name: str, value: Tensor) -> Tensor:
        if name not in self.tp_placements:
            return value
        mesh, placement, shape, stride = self.tp_placements[name]
        return DTensor.from_local(value, mesh, [placement], run_check=False, shape=shape, stride=stride)

    def compute(self, tokens: Tensor, expert: Tensor) -> Tensor:
        """This rank's experts on the tokens it received (row ``i`` to local expert ``expert[i]``), unweighted."""
        weights = {name: ScaleGrad.apply(local(getattr(self, name.replace(".", "__"))), 1.0 / self.ep)
                   for name in self.names}
        out = torch.zeros_like(tokens)
        for index in range(self.count // self.ep):
            rows = torch.where(expert == index)[0]
            own = {name: self._as_expert(name, value[index]) for name, value in weights.items()}
            out = out.index_add(0, rows, functional_call(self.template, own, (tokens[rows],)))
        return out


def replaced_expert_lists(module: nn.Module) -> list[str]:
    """The FQNs of the hand-written ``nn.ModuleList`` experts expert parallelism replaced (their modules, and
    tensor parallelism's self-check copies of them, no longer run)."""
    return [fqn for fqn, m in module.named_modules() if isinstance(m, StackedExperts)]


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

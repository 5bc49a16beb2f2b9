"""The plans of a layout, made without communicating: the tensor-parallel plan on the whole module and the
pipeline plan, with the refusals that must come before any collective (alike on every rank)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Optional

from torch import nn
from torch.distributed.tensor import DTensor

from lightning_4d.context_parallel import check_attention_reachable
from lightning_4d.expert_parallel import check_ep_model
from lightning_4d.modules.experts import find_expert_lists
from lightning_4d.pipeline import PipelineConfig, PipelinePlan
from lightning_4d.tensor_parallel import TensorParallelConfig, TensorParallelPlan, plan_tensor_parallel

__all__ = ["Plans", "make_plans"]


@dataclass(frozen=True)
class Plans:
    """What :func:`parallelize` will do to a module, decided without communication."""

    tensor: Optional[TensorParallelPlan]  # None: tp=1, or DTensor parameters made by the user already
    pipeline: Optional[PipelinePlan]  # None: pp=1

    def describe(self) -> str:
        return "\n".join(plan.describe() for plan in (self.tensor, self.pipeline) if plan is not None)


def make_plans(module: nn.Module, mesh_dims: Any, *, pipeline: PipelineConfig, tensor: TensorParallelConfig) -> Plans:
    """Both plans for ``module`` (pure: raises a ValueError naming the fix, the same on every rank).

    ``mesh_dims``: the :class:`~lightning_4d.parallel_dims.ParallelDims` of the layout.
    """
    if mesh_dims.pp_enabled:
        automatic = getattr(module, "automatic_optimization", True)
        if not automatic:
            raise ValueError(f"FourDStrategy(pp={mesh_dims.pp}) needs automatic optimization, but"
                             f" {type(module).__name__}.automatic_optimization is False: the pipeline schedule runs"
                             " forward and backward of every micro-batch itself, so manual_backward cannot. Use"
                             " automatic optimization, or pp=1.")
        routed = next((name for name, m in module.named_modules()
                       if getattr(getattr(m, "config", None), "output_router_logits", False) is True), None)
        if routed is not None:
            raise ValueError(f"FourDStrategy(pp={mesh_dims.pp}) with {routed + '.' if routed else ''}config."
                             "output_router_logits=True: the router's auxiliary loss combines every layer's router logits, which live on"
                             " different pipeline stages. Use pp=1 (ep, dp, tp and cp keep the auxiliary loss exact),"
                             " or set config.output_router_logits=False.")
    if mesh_dims.cp_enabled:
        check_attention_reachable(module, mesh_dims.cp)
    if mesh_dims.ep_enabled:
        check_ep_model(module, mesh_dims.ep, mesh_dims.tp)
    pipeline_plan = PipelinePlan.build(module, pipeline) if mesh_dims.pp_enabled else None
    tensor_plan = None
    if mesh_dims.tp_enabled and not any(isinstance(p, DTensor) for p in module.parameters()):
        tensor_plan = plan_tensor_parallel(module, mesh_dims.tp, **tensor.plan_kwargs())
        if tensor_plan.enabled and tensor_plan.coverage is not None:
            tensor_plan.coverage.check(mesh_dims.tp, tensor.strict)
        if mesh_dims.ep_enabled:
            _check_stackable_experts(module, tensor_plan, mesh_dims.ep, mesh_dims.tp)
    return Plans(tensor_plan, pipeline_plan)


def _check_stackable_experts(module: nn.Module, plan: TensorParallelPlan, ep: int, tp: int) -> None:
    """Expert parallelism stacks a hand-written MoE's experts into one tensor per weight, with tensor parallelism's
    slice of each; a fused gate|up projection whose rows tp permutes (and un-permutes in the state dict with hooks
    on the expert's own module) would keep permuted rows in checkpoints once stacked: refused before any
    collective."""
    for moe in find_expert_lists(module).values():
        fused = sorted(fqn for fqn, region in plan.regions.items()
                       if fqn.startswith(f"{moe.fqn}.experts.") and region.fused is not None and region.fused.moves(tp))
        if fused:
            raise ValueError(f"ep={ep} with tp={tp}: the experts of {moe.fqn} ({moe.cls}) hold a fused projection"
                             f" ({fused[0]}.{plan.regions[fused[0]].inputs[0]}) whose rows tensor parallelism"
                             " reorders per rank, which stacked experts cannot keep. Fix: write the expert with separate"
                             f" gate and up linears, or use tp=1 with ep={ep}, or ep=1 with tp={tp}.")

"""Fused 3-D experts (Hugging Face transformers 5.x MoE layers) sharded over tp on their intermediate dimension.

Each expert is a gated MLP: ``gate_up_proj[e]`` [2I, H] is a column-wise projection holding gate then up,
``down_proj[e]`` [H, I] the row-wise one that reads their product. So, as for a dense MLP, every rank holds
every expert's slice of I (``gate_up_proj`` ``Shard(1)``, its rows permuted once so that a rank's contiguous
slice holds its half of gate and its half of up; ``down_proj`` ``Shard(2)``), computes each routed token's
partial output for all of its experts, and the combined output is summed over tp once, after the combine
(:class:`~lightning_4d.modules.experts.ExpertsForward`). The router and shared experts are planned as the rest of the
block (a shared expert is an MLP region of its own). Checkpoints keep the original gate|up row order.
"""

from __future__ import annotations

from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import Shard, distribute_tensor

from lightning_4d.modules.experts import ExpertsForward, find_fused_experts
from lightning_4d.tensor_parallel.plan import FusedGateUpLayout, ModuleStyle, TensorParallelPlan, _under
from lightning_4d.tensor_parallel.styles import _fused_state_dict_hooks

STYLE = "experts"


def plan_experts(plan: TensorParallelPlan, module: nn.Module, replicated: list[str], sequence_parallel: bool) -> None:
    """Add every fused-experts module outside ``replicated`` to ``plan`` (pure; raises before any collective)."""
    tp = plan.tp_size
    for fqn, found in find_fused_experts(module).items():
        if _under(fqn, replicated):
            continue
        if found.inner % tp:
            raise ValueError(f"tp={tp}: {fqn} ({found.cls}) has an expert intermediate size of {found.inner}, which"
                             f" tp does not divide. Use a tp that divides {found.inner}, or keep the experts whole"
                             f" with tp_plan={{'{fqn}': 'replicate'}}.")
        if sequence_parallel:
            raise ValueError(f"sequence_parallel=True with the fused experts {fqn} ({found.cls}): their block reshapes"
                             " the hidden states to tokens before routing, which a sequence-sharded activation does"
                             " not allow. Use sequence_parallel=False (tensor parallelism still shards the experts).")
        plan.styles[fqn] = ModuleStyle(STYLE, role="experts")


def apply_experts(module: nn.Module, fqn: str, tp_mesh: DeviceMesh) -> None:
    """Shard one fused-experts module over ``tp_mesh`` (collective only in that every rank calls it alike)."""
    tp = tp_mesh.size()
    inner = module.down_proj.shape[2]
    layout = FusedGateUpLayout(inner=inner, dim=1)
    for name, dim, permute in (("gate_up_proj", 1, True), ("down_proj", 2, False)):
        param = getattr(module, name)
        value = layout.to_tp(param.detach(), tp, 1) if permute else param.detach()
        sharded = distribute_tensor(value, tp_mesh, [Shard(dim)], src_data_rank=None)
        module.register_parameter(name, nn.Parameter(sharded, requires_grad=param.requires_grad))
    _fused_state_dict_hooks(module, layout, tp, names=("gate_up_proj", "gate_up_proj_bias"))
    ExpertsForward.of(module).tp_group = tp_mesh.get_group()
